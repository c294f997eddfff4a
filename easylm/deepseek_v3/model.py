"""DeepSeek-V3's model on the shared decoder (easylm/models/decoder.py).

Each layer is x + MLA(norm(x)) (easylm/models/mla.py), then x + MLP(norm(x)): a dense
gated MLP for the first `first_k_dense_replace` layers (kind "dense"), DeepSeek's
sigmoid-routed experts with shared experts after (kind "moe"), both easylm/models/
sigmoid_moe_decoder.py's. Parameter names are transformers' (`model/layers/<i>/self_attn/
q_a_proj`, `.../mlp/experts/...`); the correction bias is carried as a parameter,
`mlp/e_score_correction_bias` (it gets no gradient: it only picks experts). The cache
holds per layer the latent (`LatentCache`, C + R values a token); a decode step absorbs
kv_b_proj (`MultiHeadLatentAttention.absorbs`).
"""

from jax.sharding import PartitionSpec as P

from easylm.deepseek_v3.config import DeepseekV3Config
from easylm.models import sigmoid_moe, sigmoid_moe_decoder
from easylm.models.mla import LatentCache, LatentRotary, MultiHeadLatentAttention
from easylm.runtime.sharding import BATCH_AXES

PARTITION_RULES = sigmoid_moe.PARTITION_RULES + (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"self_attn/(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa)/kernel", P("fsdp", None)),
    (r"self_attn/kv_b_proj/kernel", P(None, "mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"self_attn/.*/bias", P(None)),
    (r"mlp/(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"mlp/down_proj/kernel", P("mp", "fsdp")),
    (r"(layernorm|norm)/weight", P(None)),
    (r"lm_head/kernel", P("fsdp", "mp")),
)
CACHE_RULES = ((r"(^|/)kv$", P(BATCH_AXES, None, None, None)),)


class DecoderLayer(sigmoid_moe_decoder.DecoderLayer):
    def attend(self, x, context, positions, cache):
        cos, sin, mask, _ = context  # MLA has no window
        return MultiHeadLatentAttention(self.config.mla(), self.dtype, self.param_dtype,
                                        name="self_attn")(x, cos, sin, positions, mask, cache)


class DeepseekV3ForCausalLM(LatentRotary, sigmoid_moe_decoder.SigmoidMoECausalLM):
    layer = DecoderLayer

    @classmethod
    def layer_cache(cls, config: DeepseekV3Config, kind: str, batch_size: int, length: int,
                    dtype):
        return LatentCache.init(config.mla(), batch_size, length, dtype)

    @classmethod
    def cache_rules(cls, config):
        return CACHE_RULES
