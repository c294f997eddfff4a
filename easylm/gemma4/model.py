"""The Gemma 4 text model in Flax, as transformers' `Gemma4ForCausalLM` computes it.

Gemma 3's decoder (easylm/gemma/model.py) with these parts of its own:

    x = embed(ids) * sqrt(D)
    u_l = (norm(proj(x) / sqrt(D))_l + embed_ple(ids)_l * sqrt(P)) / sqrt(2)   per-layer inputs
    h = attention(norm_in(x))              q, k RMS-normalised per head, v without a scale;
    x = x + norm_post_attn(h)              scores not scaled (1.0); a full layer has its own
    h = mlp(norm_pre_ffw(x))                 head width and kv heads, and with k_eq_v no
    [h = norm_1(h) + norm_2(experts(norm_pre_2(x)))]   v_proj (its keys are its values)
    x = x + norm_post_ffw(h)
    x = x + norm_ple(proj_l(gelu_tanh(gate_l(x)) * u_l))
    x = x * layer_scalar
    norm(x) = w * x / rms(x)               in fp32, w initialised at 1 (not Gemma 3's 1 + w)

KV sharing: the last `num_kv_shared_layers` layers compute no keys or values; each
attends over those of the last earlier layer of its kind (sliding or full), passed along
with the hidden states, and holds no cache (its kind is `shared_<kind>`, whose cache
entry is empty). The experts are routed on the residual before the MLP: softmax over
proj(norm(x) * scale / sqrt(D)), the top k renormalised and times a per-expert scale,
through easylm/models/moe.py's grouped matmul.

What passes from layer to layer (`layer_stream`): {"x": (B, T, D), "kv": {kind: (k, v)}
the last keys and values (B, T or S, K, H) of each kind a shared layer takes, zeros until
a layer of the kind makes them}, one structure and shape from layer to layer, so that a
scan carries it; each layer is called with its own per-layer input u_l (B, T, P) beside it
(the decoder slices (L, B, T, P), or as a scan's per-repeat input, docs/families.md).

Parameter names are transformers' (`model/layers/<i>/self_attn/q_proj/kernel`,
`model/layers/<i>/router/kernel` for router.proj, `model/layers/<i>/experts/gate_proj`
(E, D, F) for half of experts.gate_up_proj); easylm/gemma4/hf.py maps them. Scanned, the
layers that make keys/values are `model/layers/slot<j>/...` and the KV-shared ones a
second block, `model/layers_from<s>/slot<j>/...` (easylm/models/decoder.py).

Shape letters: B batch, T positions, S cache positions, D width, F MLP width, N query
heads, K key/value heads, H head width, L layers, P per-layer input width, E experts.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from easylm.gemma4.config import Gemma4Config
from easylm.models import moe
from easylm.models.decoder import (
    Attention,
    CACHE_PARTITION_RULES,
    CausalLM,
    GatedMLP,
    RMSNorm as _RMSNorm,
    Sublayer,
    apply_rotary,
    write_cache,
)
from easylm.runtime.sharding import BATCH_AXES, constrain

gelu_tanh = functools.partial(nn.gelu, approximate=True)
SHARED = "shared_"  # the kind prefix of a layer that takes its keys/values from another

_RULES = moe.PARTITION_RULES + (
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"mlp/(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"mlp/down_proj/kernel", P("mp", "fsdp")),
    (r"per_layer_input_gate/kernel", P("fsdp", None)),
    (r"per_layer_projection/kernel", P("fsdp", None)),
    (r"model/per_layer_model_projection/kernel", P(None, "fsdp")),
    (r"(norm|norm_1|norm_2)/weight$", P(None)),
    (r"(layer_scalar|router/scale|router/per_expert_scale)$", P(None)),
)
VOCAB_SPLITS = 64  # as Gemma 3's (easylm/gemma/model.py)


def partition_rules(config: Gemma4Config):
    """The one table that says how Gemma 4 is sharded."""
    if config.vocab_size % VOCAB_SPLITS == 0:
        vocab = ((r"model/embed_tokens/embedding", P("mp", "fsdp")),
                 (r"lm_head/kernel", P("fsdp", "mp")))
    else:
        vocab = ((r"model/embed_tokens/embedding", P(None, ("fsdp", "mp"))),
                 (r"lm_head/kernel", P(("fsdp", "mp"), None)))
    ple_rows = "mp" if config.vocab_size_per_layer_input % VOCAB_SPLITS == 0 else None
    return vocab + ((r"model/embed_tokens_per_layer/embedding", P(ple_rows, None)),) + _RULES


class RMSNorm(_RMSNorm):
    """w * x / rms(x), scaled in fp32 then cast (transformers' Gemma4RMSNorm); w from 1."""

    scale_in_fp32 = True


def unscaled_norm(x, eps: float):
    """x / rms(x) in fp32, cast back (Gemma4RMSNorm with_scale=False: v_norm, the router's)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)).astype(
        x.dtype)


def base_kind(kind: str) -> str:
    return kind.removeprefix(SHARED)


class SelfAttention(Attention):
    """Gemma 4's attention: the shared kernel (`Attention.attend`), scale 1.0, with a kind's
    own shapes, keys as values on k_eq_v layers, and keys/values taken from another layer
    (`shared_kv`) on a KV-shared one."""

    kind: str = "sliding_attention"

    @nn.compact
    def __call__(self, x, cos, sin, mask, window, positions, cache, shared_kv):
        c = self.config
        B, T, _ = x.shape
        N = c.num_attention_heads
        K, H = c.attention_shape(base_kind(self.kind))
        q = self.dense(N * H, "q_proj")(x).reshape(B, T, N, H)
        q = constrain(apply_rotary(self.norm("q_norm")(q), cos, sin), P(BATCH_AXES, "sp", "mp",
                                                                        None))
        if self.kind.startswith(SHARED):
            k, v = shared_kv  # (B, T or S, K, H), as the layer that made them attended
        else:
            k = self.dense(K * H, "k_proj")(x).reshape(B, T, K, H)
            v = k if c.attention_k_eq_v and self.kind == "full_attention" else \
                self.dense(K * H, "v_proj")(x).reshape(B, T, K, H)
            k = apply_rotary(self.norm("k_norm")(k), cos, sin)
            v = unscaled_norm(v, c.rms_norm_eps)
            if cache is not None:
                k, v, cache = write_cache(cache, k, v, positions)
        out = self.attend(q, k, v, mask, window, positions)  # (B, T, N, H)
        out = self.dense(c.hidden_size, "o_proj")(out.reshape(B, T, N * H))
        return out, cache, (k, v)


class Router(nn.Module):
    """Logits (N, E) fp32 of the residual (N, D): proj(norm(x) * scale / sqrt(D)), as
    transformers' Gemma4TextRouter; `per_expert_scale` (E,) weighs the chosen."""

    config: Gemma4Config
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        c = self.config
        D, E = x.shape[-1], c.num_experts
        scale = self.param("scale", nn.initializers.ones, (D,), self.param_dtype)
        kernel = self.param("kernel", nn.initializers.normal(c.initializer_range), (D, E),
                            self.param_dtype)
        per_expert = self.param("per_expert_scale", nn.initializers.ones, (E,), self.param_dtype)
        h = unscaled_norm(x, c.rms_norm_eps) * scale.astype(x.dtype) * jnp.asarray(
            D ** -0.5, x.dtype)
        logits = jnp.einsum("ND,DE->NE", h, kernel.astype(x.dtype)).astype(jnp.float32)
        return logits, per_expert


class DecoderLayer(Sublayer):
    norm_class: type = RMSNorm
    kind: str = "full_attention"

    @nn.compact
    def __call__(self, stream, context, positions=None, cache=None, own=None):
        c = self.config
        cos, sin, mask, window = context
        kind = base_kind(self.kind)
        x = stream["x"]
        kw = dict(config=c, dtype=self.dtype, param_dtype=self.param_dtype, norm_class=RMSNorm)
        h, cache, kv = SelfAttention(**kw, scale=1.0, kind=self.kind, name="self_attn")(
            self.norm("input_layernorm")(x), cos, sin, mask, window,
            positions, cache, stream["kv"].get(kind))
        x = x + self.norm("post_attention_layernorm")(h)
        wide = 2 if c.use_double_wide_mlp and self.kind.startswith(SHARED) else 1
        h = GatedMLP(**{**kw, "config": c.replace(intermediate_size=wide * c.intermediate_size)},
                     activation=gelu_tanh, name="mlp")(self.norm("pre_feedforward_layernorm")(x))
        if c.enable_moe_block:
            h = self.norm("post_feedforward_layernorm_1")(h) + self.norm(
                "post_feedforward_layernorm_2")(self.experts(x))
        x = x + self.norm("post_feedforward_layernorm")(h)
        out = {"x": x, "kv": stream["kv"]}
        if c.hidden_size_per_layer_input:  # own: this layer's input (B, T, P)
            g = gelu_tanh(self.dense(c.hidden_size_per_layer_input, "per_layer_input_gate")(x))
            g = self.dense(c.hidden_size, "per_layer_projection")(g * own)
            x = x + self.norm("post_per_layer_input_norm")(g)
        scalar = self.param("layer_scalar", nn.initializers.ones, (1,), self.param_dtype)
        # A buffer in transformers: read from the checkpoint, never trained.
        out["x"] = constrain(x * jax.lax.stop_gradient(scalar).astype(self.dtype),
                             P(BATCH_AXES, "sp", None))
        if kind in stream["kv"] and not self.kind.startswith(SHARED):
            out["kv"] = {**stream["kv"], kind: kv}
        return out, cache

    def experts(self, x):
        """The MoE block on the residual x (B, T, D): (B, T, D); sows its RouterStats."""
        c, mc = self.config, self.config.moe()
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        logits, per_expert = Router(c, self.param_dtype, name="router")(tokens)
        chosen = None
        if self.has_variable(moe.REPLAY, "experts"):  # routing replay (moe.replay_collection)
            chosen = self.get_variable(moe.REPLAY, "experts").reshape(B * T, -1)
        weights, chosen = moe.route(logits, mc, chosen)
        weights = weights * per_expert.astype(jnp.float32)[chosen]
        params = moe.Experts(mc, D, self.param_dtype, name="experts")()
        h = self.norm("pre_feedforward_layernorm_2")(tokens)
        out, dropped = moe.dispatch(h, weights, chosen, params, mc, self.dtype)
        self.sow("router", "stats", moe.RouterStats(
            logits, chosen, jnp.bincount(chosen.reshape(-1), length=mc.num_experts), dropped))
        return out.reshape(B, T, D).astype(self.dtype)


class Gemma4ForCausalLM(CausalLM):
    """`apply(params, input_ids)` -> logits (B, T, V); with `cache=` and `positions=`,
    `(logits, cache)` (easylm/models/decoder.py)."""

    layer = DecoderLayer
    norm = RMSNorm

    @classmethod
    def layer_kinds(cls, config: Gemma4Config) -> tuple[str, ...]:
        return tuple(SHARED + kind if shared else kind
                     for kind, shared in zip(config.layer_kinds(), config.kv_shared()))

    @classmethod
    def inv_freq(cls, config: Gemma4Config, kind: str):
        """Sliding: the default rope over head_dim. Full: transformers' proportional rope
        over global_head_dim, its first partial_rotary_factor of frequencies rotating and
        the rest 0 (cos 1, sin 0: not rotated), divided by the scaling factor."""
        if base_kind(kind) == "sliding_attention":
            H = config.head_dim
            return 1.0 / (config.rope_local_base_freq
                          ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
        H = config.global_head_dim
        angles = int(config.rope_partial_rotary_factor * H // 2)
        rotated = 1.0 / (config.rope_theta ** (jnp.arange(0, 2 * angles, 2,
                                                          dtype=jnp.float32) / H))
        inv = jnp.concatenate([rotated, jnp.zeros(H // 2 - angles, jnp.float32)])
        return inv / config.rope_scaling_factor

    @classmethod
    def window(cls, config: Gemma4Config, kind: str) -> int:
        return config.sliding_window if base_kind(kind) == "sliding_attention" else 0

    @classmethod
    def embed_scale(cls, config: Gemma4Config) -> float:
        return float(np.sqrt(config.hidden_size))

    @classmethod
    def layer_stream(cls, config: Gemma4Config, x, input_ids, dtype, param_dtype, length):
        """({"x": x, "kv": zeros (B, length, K, H) for each kind a shared layer takes},
        the per-layer inputs (L, B, T, P) or None)."""
        B, T, D = x.shape
        taken = dict.fromkeys(base_kind(k) for k in cls.layer_kinds(config) if k.startswith(SHARED))
        kv = {}
        for kind in taken:
            shape = (B, length, *config.attention_shape(kind))
            kv[kind] = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        stream = {"x": x, "kv": kv}
        p, L = config.hidden_size_per_layer_input, config.num_hidden_layers
        if not p:
            return stream, None
        init = nn.initializers.normal(config.initializer_range)
        table = nn.Embed(config.vocab_size_per_layer_input, L * p, dtype=dtype,
                         param_dtype=param_dtype, embedding_init=init,
                         name="embed_tokens_per_layer")
        tokens = table(input_ids) * jnp.asarray(np.sqrt(p), dtype)
        projected = nn.Dense(L * p, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                             kernel_init=init, name="per_layer_model_projection")(x)
        projected = RMSNorm(config.rms_norm_eps, dtype, param_dtype,
                            name="per_layer_projection_norm")(
            (projected * jnp.asarray(D ** -0.5, dtype)).reshape(B, T, L, p))
        per_layer = (projected + tokens.reshape(B, T, L, p)) * jnp.asarray(2 ** -0.5, dtype)
        return stream, jnp.moveaxis(per_layer, 2, 0)  # (L, B, T, P)

    @classmethod
    def stream_hidden(cls, config, stream):
        return stream["x"]

    @nn.compact
    def __call__(self, input_ids, positions=None, segment_ids=None, cache=None,
                 return_hidden=False, logits_at=None):
        return self.soft_cap(self.decode(input_ids, positions, segment_ids, cache,
                                         return_hidden, logits_at=logits_at),
                             cache, return_hidden)

    def soft_cap(self, out, cache, return_hidden):
        """`decode`'s output with the logits capped: c * tanh(logits / c)."""
        cap = self.config.final_logit_softcapping
        if not cap or return_hidden:
            return out
        logits, rest = (out, None) if cache is None else out
        logits = jnp.tanh(logits / cap) * cap
        return logits if cache is None else (logits, rest)

    @classmethod
    def layer_cache(cls, config: Gemma4Config, kind: str, batch_size: int, length: int, dtype):
        """Keys and values (B, S, K, H) of the kind's shape; nothing for a KV-shared layer."""
        if kind.startswith(SHARED):
            return {}
        K, H = config.attention_shape(kind)
        return {name: jnp.zeros((batch_size, length, K, H), dtype) for name in ("k", "v")}

    @classmethod
    def cache_rules(cls, config):
        return CACHE_PARTITION_RULES
