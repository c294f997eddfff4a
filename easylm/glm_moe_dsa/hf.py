"""The mapping between easylm GLM-5 parameters and transformers' `GlmMoeDsaForCausalLM` tensors:
easylm/models/sigmoid_moe_hf.py's, the indexer's under their own names
(`self_attn.indexer.wq_b`, `wk`, `k_norm`, `weights_proj`), multi-token-prediction
layers skipped."""

import functools

from easylm.glm_moe_dsa.config import GlmMoeDsaConfig
from easylm.glm_moe_dsa.model import GlmMoeDsaForCausalLM
from easylm.models import sigmoid_moe_hf

to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=GlmMoeDsaForCausalLM)
load_hf_params = functools.partial(sigmoid_moe_hf.load_hf_params, config_class=GlmMoeDsaConfig, lm=GlmMoeDsaForCausalLM)
