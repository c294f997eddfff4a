"""The mapping between easylm DeepSeek-V3 parameters and transformers' `DeepseekV3ForCausalLM`
tensors: easylm/models/sigmoid_moe_hf.py's (the experts one tensor per expert as
save_pretrained writes them, the router as mlp.gate, the correction bias kept fp32,
multi-token-prediction layers skipped), over DeepSeek-V3's parameters."""

import functools
import os

from easylm.deepseek_v3.config import DeepseekV3Config, from_hf_dict
from easylm.deepseek_v3.model import DeepseekV3ForCausalLM
from easylm.models import sigmoid_moe_hf
from easylm.models.hf_checkpoint import read_config

to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=DeepseekV3ForCausalLM)
from_hf = functools.partial(sigmoid_moe_hf.from_hf, lm=DeepseekV3ForCausalLM)


def read_hf_config(directory: str) -> DeepseekV3Config:
    return from_hf_dict(read_config(directory), os.path.join(directory, "config.json"))


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    return sigmoid_moe_hf.load_hf_params(directory, read_hf_config, DeepseekV3ForCausalLM,
                                         dtype, place)
