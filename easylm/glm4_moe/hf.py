"""The mapping between easylm GLM-4.5 parameters and transformers' `Glm4MoeForCausalLM`
tensors: easylm/models/sigmoid_moe_hf.py's (the experts one tensor per expert as
save_pretrained writes them, the router as mlp.gate, the correction bias kept fp32,
multi-token-prediction layers skipped), over GLM-4.5's parameters."""

import functools
import os

from easylm.glm4_moe.config import Glm4MoeConfig, from_hf_dict
from easylm.glm4_moe.model import Glm4MoeForCausalLM
from easylm.models import sigmoid_moe_hf
from easylm.models.hf_checkpoint import read_config

to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=Glm4MoeForCausalLM)
from_hf = functools.partial(sigmoid_moe_hf.from_hf, lm=Glm4MoeForCausalLM)


def read_hf_config(directory: str) -> Glm4MoeConfig:
    return from_hf_dict(read_config(directory), os.path.join(directory, "config.json"))


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    return sigmoid_moe_hf.load_hf_params(directory, read_hf_config, Glm4MoeForCausalLM, dtype,
                                         place)
