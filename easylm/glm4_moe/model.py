"""GLM-4.5's model on the shared decoder (easylm/models/decoder.py).

Each layer is x + Attention(norm(x)) (the shared grouped-query attention: q/k/v biases,
optional per-head q/k norms, rotary on the first `rotary_dim()` dims of each head), then
x + MLP(norm(x)): a dense gated MLP for the first `first_k_dense_replace` layers (kind
"dense"), DeepSeek-V3's sigmoid-routed experts with shared experts after (kind "moe",
easylm/models/sigmoid_moe.py). Parameter names are transformers'; the correction bias is
carried as a parameter, `mlp/e_score_correction_bias`, as DeepSeek-V3's is (it gets no
gradient: it only picks experts).
"""

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.glm4_moe.config import Glm4MoeConfig
from easylm.models import rope, sigmoid_moe
from easylm.models.decoder import Attention, CausalLM, GatedMLP, RMSNorm, Sublayer
from easylm.runtime.sharding import BATCH_AXES, constrain

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


class DecoderLayer(Sublayer):
    norm_class: type = RMSNorm
    kind: str = "moe"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        cos, sin, mask = context
        h, cache = Attention(c, self.dtype, self.param_dtype, qkv_bias=c.attention_bias,
                             qk_norm=c.use_qk_norm, name="self_attn")(
            self.norm("input_layernorm")(x), cos, sin, mask, 0, positions, cache)
        x = x + h
        h = self.norm("post_attention_layernorm")(x)
        if self.kind == "dense":
            h = GatedMLP(c, self.dtype, self.param_dtype, name="mlp")(h)
        else:
            h, stats = sigmoid_moe.SigmoidMoE(c.moe(), self.dtype, self.param_dtype,
                                              bias_collection="params", name="mlp")(h)
            self.sow("router", "stats", stats)
        return constrain(x + h, P(BATCH_AXES, None, None)), cache


class Glm4MoeForCausalLM(CausalLM):
    layer = DecoderLayer
    norm = RMSNorm

    @classmethod
    def period(cls, config: Glm4MoeConfig) -> int:
        # The dense layers come first: one pattern only when all layers are alike.
        return 1 if len(set(config.layer_kinds())) == 1 else config.num_hidden_layers

    @classmethod
    def inv_freq(cls, config: Glm4MoeConfig, kind: str):
        # (R/2,): cos and sin R wide, so apply_rotary rotates the first R dims only.
        return jnp.asarray(rope.default(config.rope_theta, config.rotary_dim())[0])
