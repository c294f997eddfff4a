"""MiniMax-M2's model on the shared decoder (easylm/models/decoder.py).

Each layer is x + Attention(norm(x)) (the shared grouped-query attention: q and k
RMS-normalised over all heads at once, rotary on the first `rotary_dim()` dims of each
head), then x + MoE(norm(x)): DeepSeek-V3's sigmoid-routed experts over one group with no
shared expert (easylm/models/sigmoid_moe_decoder.py's layer, kind "moe"). Parameter names
are transformers' but for the MoE (easylm/minimax_m2/hf.py); the correction bias is
carried as a parameter, `mlp/e_score_correction_bias` (no gradient: it only picks).
"""

from jax.sharding import PartitionSpec as P

from easylm.models import sigmoid_moe, sigmoid_moe_decoder
from easylm.models.decoder import Attention

PARTITION_RULES = sigmoid_moe.PARTITION_RULES + (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)/weight", P(None)),
    (r"model/norm/weight", P(None)),
    (r"lm_head/kernel", P("fsdp", "mp")),
)


class DecoderLayer(sigmoid_moe_decoder.DecoderLayer):
    def attend(self, x, context, positions, cache):
        cos, sin, mask, window = context
        return Attention(self.config, self.dtype, self.param_dtype, qk_norm_over_heads=True,
                         name="self_attn")(x, cos, sin, mask, window, positions, cache)


class MiniMaxM2ForCausalLM(sigmoid_moe_decoder.PartialRotaryMoECausalLM):
    layer = DecoderLayer

