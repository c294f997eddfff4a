"""OLMo 3's model on the shared decoder (easylm/models/decoder.py), as transformers'
`Olmo3ForCausalLM` computes it. What differs from LLaMA:

    x = x + norm_post_attn(attention(x))      post-norm: each sublayer's output normalised,
    x = x + norm_post_ffw(mlp(x))             its input not
    q = norm_q(x Wq), k = norm_k(x Wk)        over all heads at once (N*H, K*H), before rotary
    norm(x) = (w * x / rms(x)) in fp32, then cast

Sliding layers see the last `sliding_window` positions; each kind rotates by its own
rotary (`Olmo3Config.rotary`). Parameter names are transformers':

    model/layers/<i>/self_attn/{q,k,v,o}_proj/kernel       (D, N*H), (D, K*H), ..., (N*H, D)
    model/layers/<i>/self_attn/q_norm/weight (N*H,)         k_norm (K*H,)
    model/layers/<i>/post_attention_layernorm/weight (D,)   post_feedforward_layernorm
    model/layers/<i>/mlp/{gate,up,down}_proj/kernel

Shape letters: B batch, T positions, D width, N query heads, K key/value heads, H head dim.
"""

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.models.decoder import (
    Attention,
    CausalLM,
    FP32ScaledRMSNorm,
    GatedMLP,
    Sublayer,
    pattern_period,
)
from easylm.olmo3.config import Olmo3Config
from easylm.runtime.sharding import BATCH_AXES, constrain

PARTITION_RULES = (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/bias", P("mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"self_attn/o_proj/bias", P(None)),
    (r"mlp/(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"mlp/down_proj/kernel", P("mp", "fsdp")),
    (r"(layernorm|q_norm|k_norm)/weight", P(None)),
    (r"model/norm/weight", P(None)),
    (r"lm_head/kernel", P("fsdp", "mp")),
)


class DecoderLayer(Sublayer):
    norm_class: type = FP32ScaledRMSNorm
    kind: str = "full_attention"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        cos, sin, mask, window = context
        kw = dict(config=c, dtype=self.dtype, param_dtype=self.param_dtype,
                  norm_class=FP32ScaledRMSNorm)
        h, cache = Attention(**kw, qkv_bias=c.attention_bias, out_bias=c.attention_bias,
                             qk_norm_over_heads=True, name="self_attn")(
            x, cos, sin, mask, window, positions, cache)
        x = x + self.norm("post_attention_layernorm")(h)
        x = x + self.norm("post_feedforward_layernorm")(GatedMLP(**kw, name="mlp")(x))
        return constrain(x, P(BATCH_AXES, None, None)), cache


class Olmo3ForCausalLM(CausalLM):
    layer = DecoderLayer
    norm = FP32ScaledRMSNorm

    @classmethod
    def period(cls, config: Olmo3Config) -> int:
        return pattern_period(config.layer_kinds(), 4)

    @classmethod
    def inv_freq(cls, config: Olmo3Config, kind: str):
        return jnp.asarray(config.rotary(kind)[0])

    @classmethod
    def rope_attention_factor(cls, config: Olmo3Config, kind: str) -> float:
        return config.rotary(kind)[1]

    @classmethod
    def window(cls, config: Olmo3Config, kind: str) -> int:
        return config.sliding_window if kind == "sliding_attention" else 0
