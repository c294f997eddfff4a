"""The mapping between easylm GLM-4.5 parameters and transformers' `Glm4MoeForCausalLM`:
DeepSeek-V3's (easylm/deepseek_v3/hf.py: the experts one tensor per expert as
save_pretrained writes them, the router as mlp.gate, the correction bias kept fp32,
multi-token-prediction layers skipped), over GLM-4.5's parameters."""

import functools
import os

from easylm.deepseek_v3 import hf as deepseek_v3_hf
from easylm.errors import UserError
from easylm.glm4_moe.config import Glm4MoeConfig, from_hf_dict
from easylm.glm4_moe.model import Glm4MoeForCausalLM
from easylm.models.hf_checkpoint import HFTensors, read_config

to_hf = functools.partial(deepseek_v3_hf.to_hf, lm=Glm4MoeForCausalLM)
from_hf = functools.partial(deepseek_v3_hf.from_hf, lm=Glm4MoeForCausalLM)


def read_hf_config(directory: str) -> Glm4MoeConfig:
    return from_hf_dict(read_config(directory), os.path.join(directory, "config.json"))


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    if dtype not in deepseek_v3_hf.DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(deepseek_v3_hf.DTYPES)}")
    config = read_hf_config(directory)
    return config, from_hf(HFTensors(directory), config, dtype=deepseek_v3_hf.DTYPES[dtype],
                           source=directory, place=place)
