"""GLM-5's model: DeepSeek-V3.2's (easylm/models/sparse_attention.py), the layers that share
the last full layer's keys without an indexer of their own."""

from easylm.deepseek_v32.model import PARTITION_RULES
from easylm.models.sparse_attention import SparseMLACausalLM

__all__ = ["PARTITION_RULES", "GlmMoeDsaForCausalLM"]


class GlmMoeDsaForCausalLM(SparseMLACausalLM):
    pass
