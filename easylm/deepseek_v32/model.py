"""DeepSeek-V3.2's model: DeepSeek-V3's layers (easylm/deepseek_v3/model.py) with DeepSeek sparse
attention in place of MLA over all keys (easylm/models/sparse_attention.py); its parameters
DeepSeek-V3's and, per layer, `self_attn/indexer/...`."""

from easylm.deepseek_v3.model import PARTITION_RULES as DEEPSEEK_V3_RULES
from easylm.models import sparse_attention
from easylm.models.sparse_attention import SparseMLACausalLM

PARTITION_RULES = sparse_attention.PARTITION_RULES + DEEPSEEK_V3_RULES


class DeepseekV32ForCausalLM(SparseMLACausalLM):
    pass
