"""The mapping between easylm GLM-4.5 parameters and transformers' `Glm4MoeForCausalLM`
tensors: easylm/models/sigmoid_moe_hf.py's (the experts one tensor per expert as
save_pretrained writes them, the router as mlp.gate, the correction bias kept fp32,
multi-token-prediction layers skipped), over GLM-4.5's parameters."""

import functools

from easylm.glm4_moe.config import Glm4MoeConfig
from easylm.glm4_moe.model import Glm4MoeForCausalLM
from easylm.models import sigmoid_moe_hf

to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=Glm4MoeForCausalLM)
from_hf = functools.partial(sigmoid_moe_hf.from_hf, lm=Glm4MoeForCausalLM)

load_hf_params = functools.partial(sigmoid_moe_hf.load_hf_params, config_class=Glm4MoeConfig,
                                   lm=Glm4MoeForCausalLM)
