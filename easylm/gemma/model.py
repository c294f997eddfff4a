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

Layers are not scanned: sliding and global layers differ (window, rotary base), and a
scan would carry both as per-layer inputs; Gemma 3's depths (18 to 62) compile in
seconds unscanned.

Decoding passes a key/value cache (`init_cache`), one {"k", "v"} (B, S, K, H) per layer:
each call writes its keys/values at their `positions` and attends over the whole cache
under a positions-aware causal mask, a sliding layer's also holding the window. The
cache keeps every position (no rolling buffer): the memory of a model without windows.

Shape letters: B batch, T positions, S cache positions, D width, F MLP width,
V vocabulary, N query heads, K key/value heads, H head dim.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from easylm.gemma.config import GemmaConfig
from easylm.models import remat
from easylm.models.attention import attention, segment_mask, sliding_window_mask
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


CACHE_SPEC = P(BATCH_AXES, None, "mp", None)  # (B, S, K, H): heads on 'mp'
CACHE_PARTITION_RULES = ((r"(^|/)(k|v)$", CACHE_SPEC),)


def rotary_embedding(positions, theta: float, scaling: float, head_dim: int, dtype):
    """cos, sin (B, T, H) for positions (B, T): HF's default rope, with linear scaling
    (inverse frequencies divided by `scaling`)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions[..., None].astype(jnp.float32) * (inv_freq / scaling)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rotary(x, cos, sin):
    """Rotate (B, T, heads, H) by the half-split convention of HF's rotate_half."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


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


class _Layer(nn.Module):
    config: GemmaConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    def dense(self, features, name):
        return nn.Dense(features, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.config.initializer_range),
                        name=name)

    def norm(self, name):
        return RMSNorm(self.config.rms_norm_eps, self.dtype, self.param_dtype, name=name)


class Attention(_Layer):
    sliding: bool = False

    @nn.compact
    def __call__(self, x, cos, sin, mask, positions, cache):
        c = self.config
        B, T, _ = x.shape
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = self.dense(N * H, "q_proj")(x).reshape(B, T, N, H)
        k = self.dense(K * H, "k_proj")(x).reshape(B, T, K, H)
        v = self.dense(K * H, "v_proj")(x).reshape(B, T, K, H)
        q, k = self.norm("q_norm")(q), self.norm("k_norm")(k)  # per head, before rotary
        q = constrain(apply_rotary(q, cos, sin), P(BATCH_AXES, None, "mp", None))
        k = constrain(apply_rotary(k, cos, sin), P(BATCH_AXES, None, "mp", None))
        v = constrain(v, P(BATCH_AXES, None, "mp", None))
        if cache is not None:
            # Write this call's keys/values at their positions; attend over all S.
            rows = jnp.arange(B)[:, None]
            k = cache["k"].at[rows, positions].set(k.astype(cache["k"].dtype))  # (B, S, K, H)
            v = cache["v"].at[rows, positions].set(v.astype(cache["v"].dtype))
            cache = {"k": constrain(k, CACHE_SPEC), "v": constrain(v, CACHE_SPEC)}
            k, v = k.astype(self.dtype), v.astype(self.dtype)
        # Without a mask (plain causal) the kernel applies the window; a mask holds it.
        window = c.sliding_window if self.sliding and mask is None else 0
        out = attention(q, k, v, mask, c.attention, window,
                        scale=float(c.query_pre_attn_scalar) ** -0.5)  # (B, T, N, H)
        out = checkpoint_name(out, "attention_out")
        return self.dense(c.hidden_size, "o_proj")(out.reshape(B, T, N * H)), cache


class MLP(_Layer):
    @nn.compact
    def __call__(self, x):
        F = self.config.intermediate_size
        gate, up = self.dense(F, "gate_proj")(x), self.dense(F, "up_proj")(x)
        h = constrain(nn.gelu(gate, approximate=True) * up, P(BATCH_AXES, None, "mp"))  # (B, T, F)
        return self.dense(self.config.hidden_size, "down_proj")(h)


class DecoderLayer(_Layer):
    sliding: bool = False

    @nn.compact
    def __call__(self, x, cos, sin, mask, positions=None, cache=None):
        kw = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
        h, cache = Attention(**kw, sliding=self.sliding, name="self_attn")(
            self.norm("input_layernorm")(x), cos, sin, mask, positions, cache)
        x = x + self.norm("post_attention_layernorm")(h)
        h = MLP(**kw, name="mlp")(self.norm("pre_feedforward_layernorm")(x))
        x = x + self.norm("post_feedforward_layernorm")(h)
        return constrain(x, P(BATCH_AXES, None, None)), cache


def _layer_class(config: GemmaConfig):
    if config.remat_policy == "none":
        return DecoderLayer
    return nn.remat(DecoderLayer, policy=remat.POLICIES[config.remat_policy])


class DecoderStack(_Layer):
    """The layers, named model/layers/<i>/... like HF's model.layers.<i>; each takes its
    type's rotary table and mask."""

    @nn.compact
    def __call__(self, x, rope, masks, positions, cache):
        layer = _layer_class(self.config)
        new_cache = {}
        for i, kind in enumerate(self.config.layer_kinds()):
            x, new_cache[str(i)] = layer(self.config, self.dtype, self.param_dtype,
                                         sliding=kind == "sliding_attention", name=str(i))(
                x, *rope[kind], masks[kind], positions, None if cache is None else cache[str(i)])
        return x, (None if cache is None else new_cache)


class GemmaModel(_Layer):
    @nn.compact
    def __call__(self, input_ids, positions, segment_ids, cache):
        c = self.config
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                         param_dtype=self.param_dtype,
                         embedding_init=nn.initializers.normal(c.initializer_range),
                         name="embed_tokens")
        # sqrt(D) in the compute dtype, as HF casts it (bf16 rounds sqrt(2560) to 50.5).
        x = embed(input_ids) * jnp.asarray(np.sqrt(c.hidden_size), self.dtype)
        x = constrain(x, P(BATCH_AXES, None, None))  # (B, T, D)
        rope = {
            "full_attention": rotary_embedding(positions, c.rope_theta, c.rope_scaling_factor,
                                               c.head_dim, self.dtype),
            "sliding_attention": rotary_embedding(positions, c.rope_local_base_freq, 1.0,
                                                  c.head_dim, self.dtype),
        }
        masks = self._masks(positions, segment_ids, cache)
        x, cache = DecoderStack(c, self.dtype, self.param_dtype, name="layers")(
            x, rope, masks, positions, cache)
        return self.norm("norm")(x), cache

    def _masks(self, positions, segment_ids, cache):
        """Each layer type's (B, T, S) mask, or None (plain causal: the kernel's own)."""
        c = self.config
        mask = None if segment_ids is None else segment_mask(segment_ids)
        key_positions = positions  # (B, S)
        if cache is not None:
            # Query at position p sees cache slots 0..p.
            S = jax.tree_util.tree_leaves(cache)[0].shape[-3]
            key_positions = jnp.arange(S)[None, :]
            mask = key_positions[:, None, :] <= positions[:, :, None]
        sliding = mask
        if mask is not None and c.sliding_window:
            sliding = mask & sliding_window_mask(positions, key_positions, c.sliding_window)
        return {"full_attention": mask, "sliding_attention": sliding}


class GemmaForCausalLM(nn.Module):
    """`apply(params, input_ids)` -> logits (B, T, V) in the compute dtype; with `cache=`
    (from `init_cache`) and `positions=`, `(logits, cache)`."""

    config: GemmaConfig
    dtype: jnp.dtype = jnp.float32  # compute
    param_dtype: jnp.dtype = jnp.float32  # storage

    @nn.compact
    def __call__(self, input_ids, positions=None, segment_ids=None, cache=None,
                 return_hidden=False):
        B, T = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids (packed documents) cannot be used with a cache")
        model = GemmaModel(self.config, self.dtype, self.param_dtype, name="model")
        hidden, new_cache = model(input_ids, positions, segment_ids, cache)  # (B, T, D)
        if return_hidden:  # for losses that apply the head themselves (lm_head_weight)
            return hidden
        if self.config.tie_word_embeddings:
            embedding = self.variables["params"]["model"]["embed_tokens"]["embedding"]
            logits = hidden @ embedding.astype(self.dtype).T
        else:
            logits = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype,
                              param_dtype=self.param_dtype,
                              kernel_init=nn.initializers.normal(self.config.initializer_range),
                              name="lm_head")(hidden)
        logits = constrain(logits, P(BATCH_AXES, None, "mp"))
        return logits if cache is None else (logits, new_cache)

    def init_cache(self, batch_size: int, length: int, dtype=None):
        c = self.config
        shape = (batch_size, length, c.num_key_value_heads, c.head_dim)
        return {str(i): {name: jnp.zeros(shape, dtype or self.dtype) for name in ("k", "v")}
                for i in range(c.num_hidden_layers)}

    def init_params(self, rng, seq_length: int = 8):
        """Parameters only (a pure function of rng; run it sharded)."""
        return self.init(rng, jnp.zeros((1, seq_length), jnp.int32))["params"]


def lm_head_weight(params, config: GemmaConfig):
    """The output projection (D, V): the embedding when tied, else lm_head's kernel."""
    if config.tie_word_embeddings:
        return params["model"]["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]
