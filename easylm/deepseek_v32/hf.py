"""The mapping between easylm DeepSeek-V3.2 parameters and transformers' `DeepseekV32ForCausalLM` tensors:
easylm/models/sigmoid_moe_hf.py's, the indexer's under their own names
(`self_attn.indexer.wq_b`, `wk`, `k_norm`, `weights_proj`), multi-token-prediction
layers skipped."""

import functools

from easylm.deepseek_v32.config import DeepseekV32Config
from easylm.deepseek_v32.model import DeepseekV32ForCausalLM
from easylm.models import sigmoid_moe_hf

to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=DeepseekV32ForCausalLM)
load_hf_params = functools.partial(sigmoid_moe_hf.load_hf_params, config_class=DeepseekV32Config, lm=DeepseekV32ForCausalLM)
