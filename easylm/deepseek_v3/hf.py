"""The mapping between easylm DeepSeek-V3 parameters and transformers' `DeepseekV3ForCausalLM`
tensors: easylm/models/sigmoid_moe_hf.py's (the experts one tensor per expert as
save_pretrained writes them, the router as mlp.gate, the correction bias kept fp32,
multi-token-prediction layers skipped), over DeepSeek-V3's parameters."""

import functools

from easylm.deepseek_v3.config import DeepseekV3Config
from easylm.deepseek_v3.model import DeepseekV3ForCausalLM
from easylm.models import sigmoid_moe_hf

to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=DeepseekV3ForCausalLM)
from_hf = functools.partial(sigmoid_moe_hf.from_hf, lm=DeepseekV3ForCausalLM)

load_hf_params = functools.partial(sigmoid_moe_hf.load_hf_params, config_class=DeepseekV3Config,
                                   lm=DeepseekV3ForCausalLM)
