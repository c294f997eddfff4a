"""GLM-4.5's model on the shared decoder (easylm/models/decoder.py).

Each layer is x + Attention(norm(x)) (the shared grouped-query attention: q/k/v biases,
optional per-head q/k norms, rotary on the first `rotary_dim()` dims of each head), then
x + MLP(norm(x)): a dense gated MLP for the first `first_k_dense_replace` layers (kind
"dense"), DeepSeek-V3's sigmoid-routed experts with shared experts after (kind "moe"),
both easylm/models/sigmoid_moe_decoder.py's. Parameter names are transformers'; the
correction bias is carried as a parameter, `mlp/e_score_correction_bias`, as DeepSeek-V3's
is (it gets no gradient: it only picks experts).
"""

from jax.sharding import PartitionSpec as P

from easylm.models import sigmoid_moe, sigmoid_moe_decoder
from easylm.models.decoder import Attention

PARTITION_RULES = sigmoid_moe.PARTITION_RULES + (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/bias", P("mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"mlp/(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"mlp/down_proj/kernel", P("mp", "fsdp")),
    (r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)/weight", P(None)),
    (r"model/norm/weight", P(None)),
    (r"lm_head/kernel", P("fsdp", "mp")),
)


class DecoderLayer(sigmoid_moe_decoder.DecoderLayer):
    def attend(self, x, context, positions, cache):
        c = self.config
        cos, sin, mask, window = context
        return Attention(c, self.dtype, self.param_dtype, qkv_bias=c.attention_bias,
                         qk_norm=c.use_qk_norm, name="self_attn")(
            x, cos, sin, mask, window, positions, cache)


class Glm4MoeForCausalLM(sigmoid_moe_decoder.PartialRotaryMoECausalLM):
    layer = DecoderLayer

