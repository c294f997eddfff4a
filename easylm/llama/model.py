"""The LLaMA causal language model in Flax (LLaMA 1, 2, 3 and 3.2), and the variants
that differ from it by a switch of `LLaMAConfig`: Qwen2/2.5, Qwen3 and Mistral.

Parameter names follow Hugging Face's `LlamaForCausalLM` (and its Qwen2, Qwen3 and
Mistral twins), so converting a checkpoint is a table lookup (see `easylm/llama/hf.py`):

    model/embed_tokens/embedding                 (V, D)
    model/layers/<i>/input_layernorm/weight      (D,)
    model/layers/<i>/self_attn/q_proj/kernel     (D, N*H)   k_proj, v_proj: (D, K*H)
    model/layers/<i>/self_attn/o_proj/kernel     (N*H, D)
    model/layers/<i>/self_attn/q_proj/bias       (N*H,)     with qkv_bias; k, v: (K*H,)
    model/layers/<i>/self_attn/o_proj/bias       (D,)       with attention_bias
    model/layers/<i>/self_attn/q_norm/weight     (H,)       with qk_norm (Qwen3); k_norm
    model/layers/<i>/post_attention_layernorm/weight
    model/layers/<i>/mlp/gate_proj/kernel        (D, F)     up_proj (D, F), down_proj (F, D)
    model/layers/<i>/mlp/gate_proj/bias          (F,)       with mlp_bias; up (F,), down (D,)
    model/norm/weight                            (D,)
    lm_head/kernel                               (D, V)     absent with tied embeddings

With `scan_layers=True` the layers are one stacked module: `model/layers/...`
with a leading layer axis of size L.

Decoding passes a key/value cache (`init_cache`): each layer's keys and values
(B, S, K, H) for S cache positions, laid out like the layers (one entry per
layer, or stacked on a leading L axis when scanned). Each call writes its
tokens' keys/values at their `positions` and attends over the whole cache
under a positions-aware causal mask, so every batch row can be at its own
length (continuous batching). A sliding window (Mistral) is part of that mask:
keys older than the window are masked in the full cache.

Shape letters: B batch, T positions, S cache positions, D width, F MLP width,
V vocabulary, N query heads, K key/value heads, H head dim, L layers.
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from easylm.llama.config import LLaMAConfig
from easylm.models import remat
from easylm.models.attention import attention, segment_mask, sliding_window_mask
from easylm.runtime.sharding import BATCH_AXES, constrain

# Parameter partition rules: the one place that says how LLaMA is sharded.
PARTITION_RULES = (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"mlp/(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"mlp/down_proj/kernel", P("mp", "fsdp")),
    # Biases are split like their kernel's output dimension.
    (r"self_attn/(q_proj|k_proj|v_proj)/bias", P("mp")),
    (r"self_attn/o_proj/bias", P("fsdp")),
    (r"mlp/(gate_proj|up_proj)/bias", P("mp")),
    (r"mlp/down_proj/bias", P("fsdp")),
    (r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)/weight", P(None)),
    (r"model/norm/weight", P(None)),
    (r"lm_head/kernel", P("fsdp", "mp")),
)

# The key/value cache (B, S, K, H): batch split like activations, heads on 'mp'
# like the k/v projections that fill it.
CACHE_SPEC = P(BATCH_AXES, None, "mp", None)
CACHE_PARTITION_RULES = ((r"(^|/)(k|v)$", CACHE_SPEC),)


def rope_frequencies(config: LLaMAConfig) -> jnp.ndarray:
    """Inverse frequencies (H/2,), with Llama-3 frequency scaling when configured."""
    H = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if config.rope_scaling_type != "llama3":
        return inv_freq
    factor = config.rope_scaling_factor
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    old_context = config.rope_original_max_position_embeddings
    wavelength = 2 * np.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, and the band
    # between is interpolated smoothly.
    scaled = jnp.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return jnp.where(in_band, smoothed, scaled)


def rotary_embedding(positions, config: LLaMAConfig, dtype):
    """cos, sin of shape (B, T, H) for integer positions (B, T)."""
    angles = positions[..., None].astype(jnp.float32) * rope_frequencies(config)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rotary(x, cos, sin):
    """Rotate (B, T, heads, H) by the half-split convention HF LLaMA uses."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return weight.astype(self.dtype) * x32.astype(self.dtype)


class _Layer(nn.Module):
    config: LLaMAConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    def dense(self, features, name, bias=False):
        return nn.Dense(
            features, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(self.config.initializer_range), name=name,
        )

    def norm(self, name):
        return RMSNorm(self.config.rms_norm_eps, self.dtype, self.param_dtype, name=name)

    def kernels(self, x, names_and_features, bias=False):
        """x @ [W_1 | W_2 | ...] (+ [b_1 | b_2 | ...]) as one matmul, split back into one
        output per kernel. The kernels are the `self.dense(features, name, bias)` ones
        (same names, shapes and initial values), concatenated in the compute dtype at
        each call: one wider matmul reads x once and, in the backward pass, sums x's
        gradient in one contraction instead of adding several."""
        init = nn.initializers.normal(self.config.initializer_range)
        D = x.shape[-1]
        weights = [_DenseParams((D, f), init, bias, self.param_dtype, name=name)()
                   for name, f in names_and_features]
        kernel = jnp.concatenate([w.astype(self.dtype) for w, _ in weights], axis=1)
        out = jnp.einsum("BTD,DF->BTF", x.astype(self.dtype), kernel)
        if bias:
            out = out + jnp.concatenate([b.astype(self.dtype) for _, b in weights])
        edges = np.cumsum([f for _, f in names_and_features])[:-1]
        return jnp.split(out, edges, axis=-1)


class _DenseParams(nn.Module):
    """The parameters of an `nn.Dense` (same names, shapes and initialisers): (kernel,
    bias or None)."""

    shape: tuple
    initializer: Callable
    use_bias: bool
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        kernel = self.param("kernel", self.initializer, self.shape, self.param_dtype)
        if not self.use_bias:
            return kernel, None
        return kernel, self.param("bias", nn.initializers.zeros_init(), self.shape[-1:],
                                  self.param_dtype)


class Attention(_Layer):
    @nn.compact
    def __call__(self, x, cos, sin, mask, positions, cache):
        c = self.config
        B, T, _ = x.shape
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if c.fused_qkv:
            q, k, v = self.kernels(x, [("q_proj", N * H), ("k_proj", K * H), ("v_proj", K * H)],
                                   c.qkv_bias)
        else:
            q, k, v = (self.dense(N * H, "q_proj", c.qkv_bias)(x),
                       self.dense(K * H, "k_proj", c.qkv_bias)(x),
                       self.dense(K * H, "v_proj", c.qkv_bias)(x))
        q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
        if c.qk_norm:  # Qwen3: each head's query and key RMS-normalised, before rotary
            q, k = self.norm("q_norm")(q), self.norm("k_norm")(k)
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
        # Without a mask (plain causal) the kernel applies the window itself.
        window = c.sliding_window if mask is None else 0
        out = attention(q, k, v, mask, c.attention, window)  # (B, T, N, H)
        out = checkpoint_name(out, "attention_out")
        out = self.dense(c.hidden_size, "o_proj", c.attention_bias)(out.reshape(B, T, N * H))
        return out, cache


class MLP(_Layer):
    @nn.compact
    def __call__(self, x):
        F = self.config.intermediate_size
        bias = self.config.mlp_bias
        if self.config.fused_mlp:
            gate, up = self.kernels(x, [("gate_proj", F), ("up_proj", F)], bias)
        else:
            gate, up = self.dense(F, "gate_proj", bias)(x), self.dense(F, "up_proj", bias)(x)
        h = nn.silu(gate) * up
        h = constrain(h, P(BATCH_AXES, None, "mp"))  # (B, T, F)
        return self.dense(self.config.hidden_size, "down_proj", bias)(h)


class DecoderLayer(_Layer):
    @nn.compact
    def __call__(self, x, cos, sin, mask, positions=None, cache=None):
        kw = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
        h, cache = Attention(**kw, name="self_attn")(
            self.norm("input_layernorm")(x), cos, sin, mask, positions, cache)
        x = x + h
        x = x + MLP(**kw, name="mlp")(self.norm("post_attention_layernorm")(x))
        x = constrain(x, P(BATCH_AXES, None, None))
        return x, cache  # (carry, output) so that nn.scan can stack the caches


def _layer_class(config: LLaMAConfig):
    if config.remat_policy == "none":
        return DecoderLayer
    return nn.remat(
        DecoderLayer, policy=remat.POLICIES[config.remat_policy], prevent_cse=not config.scan_layers
    )


class DecoderStack(_Layer):
    """Unscanned layers, named model/layers/<i>/... like HF's model.layers.<i>."""

    @nn.compact
    def __call__(self, x, cos, sin, mask, positions, cache):
        layer = _layer_class(self.config)
        new_cache = {}
        for i in range(self.config.num_hidden_layers):
            x, new_cache[str(i)] = layer(self.config, self.dtype, self.param_dtype, name=str(i))(
                x, cos, sin, mask, positions, None if cache is None else cache[str(i)])
        return x, (None if cache is None else new_cache)


class LLaMAModel(_Layer):
    @nn.compact
    def __call__(self, input_ids, positions, segment_ids, cache):
        c = self.config
        embed = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
            embedding_init=nn.initializers.normal(c.initializer_range), name="embed_tokens",
        )
        # The lookup (and, in the backward pass, the scatter into the table) happens
        # where the table's D is split: over 'fsdp', batch over 'dp' only. Then an
        # all-to-all splits the batch over ('dp', 'fsdp') as everywhere else. Going
        # straight from the batch split to the table's D split would make XLA gather
        # the whole (B, T, D) gradient on every device when dp > 1.
        x = constrain(embed(input_ids), P("dp", None, "fsdp"))
        x = constrain(x, P(BATCH_AXES, None, None))  # (B, T, D)
        cos, sin = rotary_embedding(positions, c, self.dtype)
        mask = None if segment_ids is None else segment_mask(segment_ids)
        key_positions = positions  # (B, S)
        if cache is not None:
            # Query at position p sees cache slots 0..p: (B, T, S).
            S = jax.tree_util.tree_leaves(cache)[0].shape[-3]
            key_positions = jnp.arange(S)[None, :]
            mask = key_positions[:, None, :] <= positions[:, :, None]
        if c.sliding_window and mask is not None:
            # ... and, in the window, only the last `sliding_window` of them.
            mask = mask & sliding_window_mask(positions, key_positions, c.sliding_window)
        if c.scan_layers:
            # One layer scanned L times: model/layers/... with a leading layer axis.
            stack = nn.scan(
                _layer_class(c),
                variable_axes={"params": 0},
                # 'dropout': each layer its own key when one is given (LoRA's adapter
                # dropout, easylm/variants/lora.py); a scan passes no stream it does not name.
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0),
                length=c.num_hidden_layers,
            )
            x, cache = stack(c, self.dtype, self.param_dtype, name="layers")(
                x, cos, sin, mask, positions, cache)
        else:
            x, cache = DecoderStack(c, self.dtype, self.param_dtype, name="layers")(
                x, cos, sin, mask, positions, cache)
        return self.norm("norm")(x), cache


class LLaMAForCausalLM(nn.Module):
    """`apply(params, input_ids)` -> logits (B, T, V) in the compute dtype.

    With `cache=` (from `init_cache`) and `positions=` it returns `(logits, cache)`
    with this call's keys/values written into the cache.
    """

    config: LLaMAConfig
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
        model = LLaMAModel(self.config, self.dtype, self.param_dtype, name="model")
        hidden, new_cache = model(input_ids, positions, segment_ids, cache)  # (B, T, D)
        if return_hidden:  # for losses that apply the head themselves (lm_head_weight)
            return hidden
        if self.config.tie_word_embeddings:
            embedding = self.variables["params"]["model"]["embed_tokens"]["embedding"]
            logits = hidden @ embedding.astype(self.dtype).T
        else:
            logits = nn.Dense(
                self.config.vocab_size, use_bias=False, dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=nn.initializers.normal(self.config.initializer_range),
                name="lm_head",
            )(hidden)
        logits = constrain(logits, P(BATCH_AXES, None, "mp"))
        return logits if cache is None else (logits, new_cache)

    def init_cache(self, batch_size: int, length: int, dtype=None):
        """Zeros for `length` cache positions, shaped like the layers (see module doc)."""
        c = self.config
        shape = (batch_size, length, c.num_key_value_heads, c.head_dim)

        def kv(*layers):
            return {name: jnp.zeros((*layers, *shape), dtype or self.dtype) for name in ("k", "v")}

        if c.scan_layers:
            return kv(c.num_hidden_layers)
        return {str(i): kv() for i in range(c.num_hidden_layers)}

    def init_params(self, rng, seq_length: int = 8):
        """Parameters only (pure function of rng; wrap with `sharding.init_sharded`)."""
        ids = jnp.zeros((1, seq_length), jnp.int32)
        return self.init(rng, ids)["params"]


def stack_layers(params, num_layers: int):
    """Unscanned params (model/layers/<i>/...) -> scanned (model/layers/... with axis L)."""
    layers = params["model"]["layers"]
    def stack(*xs):  # numpy stays on the host (converters), jax arrays stay jax
        return np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)

    stacked = jax.tree_util.tree_map(stack, *[layers[str(i)] for i in range(num_layers)])
    return {**params, "model": {**params["model"], "layers": stacked}}


def unstack_layers(params, num_layers: int):
    """Scanned params -> unscanned, the inverse of `stack_layers`."""
    stacked = params["model"]["layers"]
    layers = {str(i): jax.tree_util.tree_map(lambda x: x[i], stacked) for i in range(num_layers)}
    return {**params, "model": {**params["model"], "layers": layers}}


def layers_scanned(tree) -> bool | None:
    """Whether `tree` (parameters, adapters, or a checkpoint's stored tree: anything keyed
    like the parameters) holds its layers stacked (scanned), one by one, or has none."""
    layers = tree.get("model", {}).get("layers") if hasattr(tree, "get") else None
    if not layers:
        return None
    return not all(str(name).isdigit() for name in layers)


def relayout(tree, scanned: bool | None):
    """`tree` with its layers stacked (`scanned`) or one by one, whichever it holds now:
    the one conversion between the two layouts (checkpoints, bases and adapters are read
    in the layout they were stored in; None keeps it)."""
    have = layers_scanned(tree)
    if scanned is None or have is None or have == scanned:
        return tree
    if scanned:
        return stack_layers(tree, len(tree["model"]["layers"]))
    return unstack_layers(tree, jax.tree_util.tree_leaves(tree["model"]["layers"])[0].shape[0])


def lm_head_weight(params, config: LLaMAConfig):
    """The output projection (D, V): lm_head's kernel, or the embedding when tied."""
    if config.tie_word_embeddings:
        return params["model"]["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]
