"""Llama 4's text model on the shared decoder (easylm/models/decoder.py), as transformers'
Llama4ForCausalLM computes it.

Each layer is x + attention(norm(x)), then x + feed_forward(norm(x)). A rotary layer
(kind rope_*) rotates queries and keys by interleaved pairs (Meta's complex form), then
divides each head by its RMS (weightless, `use_qk_norm`), and attends over its chunk of
`attention_chunk_size` positions (the decoder's chunked mask). A NoPE layer (nope_*) has
no rotary and sees the whole context, its queries multiplied by the temperature
1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) at position p. The feed-forward is
a dense gated MLP (*_dense) or the experts (*_moe): the router's best logit through a
sigmoid weighs the token's *input* to its one expert (expert(s x), not s expert(x)), and
a shared expert of the same width takes every token.

Interleaved rotary is computed on the pairs laid out as halves (evens, then odds): the
same scores, since queries and keys are permuted alike and the RMS norm ignores order;
the cache holds keys so laid out.

Parameter names are transformers' (`model/layers/<i>/self_attn/q_proj/kernel`,
`.../feed_forward/{router,experts,shared_expert}/...`, `.../feed_forward/gate_proj/kernel`).

Shape letters: B batch, T positions, S cache positions, D width, N query heads, K
key/value heads, H head dim, E experts.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from easylm.llama4.config import Llama4Config
from easylm.models import moe, rope
from easylm.models.attention import attention
from easylm.models.context_parallel import SplitSequence
from easylm.models.decoder import (HEADS, CausalLM, Sublayer, apply_rotary,
                                   refuse_splash_split, write_cache)
from easylm.models.sigmoid_moe import _SharedExperts as GatedMLP
from easylm.runtime.sharding import BATCH_AXES, constrain

PARTITION_RULES = moe.PARTITION_RULES + (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/bias", P("mp")),
    (r"self_attn/o_proj/bias", P("fsdp")),
    (r"(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"down_proj/kernel", P("mp", "fsdp")),
    (r"(input_layernorm|post_attention_layernorm)/weight", P(None)),
    (r"model/norm/weight", P(None)),
    (r"lm_head/kernel", P("fsdp", "mp")),
)


def weightless_rms(x, eps: float):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class Llama4Attention(Sublayer):
    rope: bool = True

    @nn.compact
    def __call__(self, x, cos, sin, mask, positions, cache):
        c = self.config
        B, T, _ = x.shape
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        q = self.dense(N * H, "q_proj", bias)(x).reshape(B, T, N, H)
        k = self.dense(K * H, "k_proj", bias)(x).reshape(B, T, K, H)
        v = self.dense(K * H, "v_proj", bias)(x).reshape(B, T, K, H)
        if self.rope:  # interleaved pairs as halves, then the half-split rotation
            halves = lambda a: jnp.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)
            q, k = apply_rotary(halves(q), cos, sin), apply_rotary(halves(k), cos, sin)
            if c.use_qk_norm:
                q, k = weightless_rms(q, c.rms_norm_eps), weightless_rms(k, c.rms_norm_eps)
        elif c.attn_temperature_tuning:  # (B, T, 1, 1)
            scale = 1 + c.attn_scale * jnp.log1p(jnp.floor(
                (positions.astype(jnp.float32) + 1) / c.floor_scale))
            q = (q * scale[..., None, None]).astype(q.dtype)
        q, k, v = constrain(q, HEADS), constrain(k, HEADS), constrain(v, HEADS)
        if cache is not None:
            k, v, cache = write_cache(cache, k, v, positions)
        if isinstance(mask, SplitSequence):  # the sequence split over 'sp' (no chunk)
            refuse_splash_split(c.attention)
            out = mask.attention(q, k, v, positions, 0, None)
        else:
            out = attention(q, k, v, mask, c.attention)  # (B, T, N, H)
        out = checkpoint_name(out, "attention_out")
        return self.dense(c.hidden_size, "o_proj", bias)(out.reshape(B, T, N * H)), cache


class Llama4MoE(nn.Module):
    """x (B, T, D) -> (y, RouterStats): one expert a token, fed its input times the
    router's sigmoid score, plus the shared expert."""

    config: Llama4Config
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        c, m = self.config, self.config.moe()
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        logits = moe.Router(m.num_experts, False, c.initializer_range, self.param_dtype,
                            name="router")(tokens)  # (N, E) fp32
        experts = None
        if self.has_variable(moe.REPLAY, "experts"):
            experts = self.get_variable(moe.REPLAY, "experts").reshape(B * T, 1)
        weights, experts = moe.route(logits, m, experts)  # (N, 1)
        params = moe.Experts(m, D, self.param_dtype, name="experts")()
        scaled = (tokens.astype(jnp.float32) * weights).astype(self.dtype)
        out, dropped = moe.dispatch(scaled, jnp.ones_like(weights), experts, params, m,
                                    self.dtype)
        shared = GatedMLP(c.intermediate_size, c.initializer_range, self.dtype,
                          self.param_dtype, name="shared_expert")(x)
        stats = moe.RouterStats(logits, experts,
                                jnp.bincount(experts.reshape(-1), length=m.num_experts), dropped)
        return shared + out.reshape(B, T, D).astype(self.dtype), stats


class DecoderLayer(Sublayer):
    kind: str = "rope_moe"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        cos, sin, mask, _ = context  # no window: a chunk is in the mask
        h, cache = Llama4Attention(c, self.dtype, self.param_dtype, rope=self.kind.startswith(
            "rope"), name="self_attn")(self.norm("input_layernorm")(x), cos, sin, mask,
                                       positions, cache)
        x = x + h
        h = self.norm("post_attention_layernorm")(x)
        if self.kind.endswith("moe"):
            h, stats = Llama4MoE(c, self.dtype, self.param_dtype, name="feed_forward")(h)
            self.sow("router", "stats", stats)
        else:
            h = GatedMLP(c.intermediate_size_mlp, c.initializer_range, self.dtype,
                         self.param_dtype, name="feed_forward")(h)
        return constrain(x + h, P(BATCH_AXES, None, None)), cache


class Llama4ForCausalLM(CausalLM):
    layer = DecoderLayer

    @classmethod
    def inv_freq(cls, config: Llama4Config, kind: str):
        return _inv_freq(config) if kind.startswith("rope") else None

    @classmethod
    def chunk(cls, config: Llama4Config, kind: str) -> int:
        return config.attention_chunk_size if kind.startswith("rope") else 0


def _inv_freq(config: Llama4Config):
    """Inverse frequencies (H/2,) of the rotary layers, Llama 3.1's scaling where set."""
    H = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if config.rope_scaling_type != "llama3":
        return inv_freq
    return rope.llama3(inv_freq, config.rope_scaling_factor, config.rope_low_freq_factor,
                       config.rope_high_freq_factor, config.rope_original_max_position_embeddings)
