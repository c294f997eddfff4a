"""The Gemma 3 text model in Flax, as transformers' `Gemma3ForCausalLM` computes it.

What differs from LLaMA (easylm/llama/model.py):

    x = embed(ids) * sqrt(D)                      the scale in the compute dtype
    h = attention(norm_in(x))                     q, k RMS-normalised per head before rotary;
    x = x + norm_post_attn(h)                     scores scaled by query_pre_attn_scalar^-1/2;
    h = mlp(norm_pre_ffw(x))                      sliding layers see the last W positions and
    x = x + norm_post_ffw(h)                      rotate by their own base, global ones all
    mlp(x) = down(gelu_tanh(gate(x)) * up(x))     positions (with optional linear scaling)
    norm(x) = x / rms(x) * (1 + w)                in fp32, w initialised at 0

Parameter names follow HF's, so conversion is a table lookup (easylm/gemma/hf.py):

    model/embed_tokens/embedding                          (V, D)
    model/layers/<i>/input_layernorm/weight               (D,)   post_attention_layernorm,
                                                                 pre_feedforward_layernorm,
                                                                 post_feedforward_layernorm
    model/layers/<i>/self_attn/q_proj/kernel              (D, N*H)  k_proj, v_proj: (D, K*H)
    model/layers/<i>/self_attn/o_proj/kernel              (N*H, D)
    model/layers/<i>/self_attn/q_norm/weight              (H,)   k_norm
    model/layers/<i>/mlp/gate_proj/kernel                 (D, F) up_proj (D, F), down_proj (F, D)
    model/norm/weight                                     (D,)
    lm_head/kernel                                        (D, V) absent when tied (Gemma: tied)

The decoder around the layer (embedding, the stack, norm, head, the key/value cache and
its write) is easylm/models/decoder.py's. With `scan_layers` the layers scan as a repeating
block of `sliding_window_pattern` layers (5 sliding, 1 global), the layers left after the
last whole block unscanned. The cache keeps every position (no rolling buffer): the
memory of a model without windows.

Shape letters: B batch, T positions, S cache positions, D width, F MLP width,
V vocabulary, N query heads, K key/value heads, H head dim.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from easylm.gemma.config import GemmaConfig
from easylm.models.decoder import Attention, CausalLM, GatedMLP, Sublayer
from easylm.runtime.sharding import BATCH_AXES, constrain

_LAYER_RULES = (
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"mlp/(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"mlp/down_proj/kernel", P("mp", "fsdp")),
    (r"(layernorm|feedforward_layernorm|q_norm|k_norm)/weight", P(None)),
    (r"model/norm/weight", P(None)),
)
# The vocabulary is split over 'mp' (the head's logits then come out split, the (B, T, V)
# tensor being the largest at Gemma's 262k tokens) when every usual 'mp' divides it:
# Gemma 3's 262,144 and 262,208 are multiples of 64. Another vocabulary keeps its rows
# whole and splits the width over ('fsdp', 'mp') instead: a parameter must divide its mesh
# axes, and the mesh is not known when the rules are.
VOCAB_SPLITS = 64


def partition_rules(config: GemmaConfig):
    """The one table that says how Gemma is sharded (parameters no rule matches are an
    error)."""
    if config.vocab_size % VOCAB_SPLITS == 0:
        vocab = ((r"model/embed_tokens/embedding", P("mp", "fsdp")),
                 (r"lm_head/kernel", P("fsdp", "mp")))
    else:
        vocab = ((r"model/embed_tokens/embedding", P(None, ("fsdp", "mp"))),
                 (r"lm_head/kernel", P(("fsdp", "mp"), None)))
    return vocab + _LAYER_RULES


class RMSNorm(nn.Module):
    """x / rms(x) * (1 + w) in fp32, then the compute dtype (Gemma's order: HF casts after
    the product, LLaMA before it)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.zeros_init(), (x.shape[-1],),
                            self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)


class DecoderLayer(Sublayer):
    norm_class: type = RMSNorm
    kind: str = "full_attention"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        cos, sin, mask, window = context
        kw = dict(config=c, dtype=self.dtype, param_dtype=self.param_dtype, norm_class=RMSNorm)
        h, cache = Attention(**kw, qk_norm=True, scale=float(c.query_pre_attn_scalar) ** -0.5,
                             name="self_attn")(
            self.norm("input_layernorm")(x), cos, sin, mask, window, positions,
            cache)
        x = x + self.norm("post_attention_layernorm")(h)
        h = GatedMLP(**kw, activation=functools.partial(nn.gelu, approximate=True), name="mlp")(
            self.norm("pre_feedforward_layernorm")(x))
        x = x + self.norm("post_feedforward_layernorm")(h)
        return constrain(x, P(BATCH_AXES, None, None)), cache


class GemmaForCausalLM(CausalLM):
    """`apply(params, input_ids)` -> logits (B, T, V) in the compute dtype; with `cache=`
    (from `init_cache`) and `positions=`, `(logits, cache)` (easylm/models/decoder.py)."""

    layer = DecoderLayer
    norm = RMSNorm

    @classmethod
    def inv_freq(cls, config: GemmaConfig, kind: str):
        # HF's default rope; linear scaling divides the global layers' frequencies.
        theta, scaling = ((config.rope_theta, config.rope_scaling_factor)
                          if kind == "full_attention" else (config.rope_local_base_freq, 1.0))
        H = config.head_dim
        return 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)) / scaling

    @classmethod
    def window(cls, config: GemmaConfig, kind: str) -> int:
        return config.sliding_window if kind == "sliding_attention" else 0

    @classmethod
    def embed_scale(cls, config: GemmaConfig) -> float:
        return float(np.sqrt(config.hidden_size))  # bf16 rounds sqrt(2560) to 50.5
