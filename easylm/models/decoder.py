"""The decoder every family shares: embed -> layers (one by one, or scanned) -> norm ->
head, the key/value cache, the two layouts of the layers, and the sublayers families
compute alike (rotary attention, the gated MLP).

A family subclasses `CausalLM` and gives its layer (`layer`: a module called as
`layer(config, dtype, param_dtype, kind=...)(x, context, positions, cache) -> (x, cache)`),
its norm, and a few class methods: each layer's kind (`layer_kinds`: LLaMA's are all
alike, Gemma's 5 sliding then 1 global), each kind's rotary frequencies (and YaRN's
attention factor, easylm/models/rope.py) and window, and an embedding scale. Its config
has the fields read here: vocab_size, hidden_size, num_hidden_layers, num_key_value_heads,
head_dim, initializer_range, rms_norm_eps, tie_word_embeddings, remat_policy, scan_layers.

Parameter names follow Hugging Face's (`model/embed_tokens`, `model/layers/<i>/...`,
`model/norm`, `lm_head`), so converting is a table lookup. Scanned (`scan_layers`), the
layers repeat a pattern of `period` kinds R times and are stored stacked with a leading
axis of R: with a period of one as `model/layers/...`, else one stack per place in the
pattern, `model/layers/slot<j>/...`, and the L - R * period layers left over after the
repeats as `model/tail<i>/...` (MaxText scans Gemma's pattern the same way). Where the
repeats' kinds change part way (Gemma 4's KV-shared layers after the ones that make
keys/values), each run of like repeats is a scanned block of its own, the one starting at
layer s stored as `model/layers_from<s>/...` (`scan_blocks`).

Decoding passes a cache (`init_cache`) laid out like the layers: each layer's entry, as
its kind declares it (`CausalLM.layer_cache`; an attention layer's keys and values
(B, S, K, H)). Each call writes its tokens' keys/values at their `positions` and
attends over the whole cache under a positions-aware causal mask (a sliding window or a
chunk is part of that mask), so every row can be at its own length (continuous batching).

Shape letters: B batch, T positions, S cache positions, D width, F MLP width,
V vocabulary, N query heads, K key/value heads, H head dim, L layers, R repeats.
"""

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from easylm.models import remat
from easylm.models.context_parallel import SplitSequence
from easylm.models.paged_attention import PagedKV
from easylm.errors import UserError
from easylm.models.attention import (
    BidirectionalBlocks,
    attention,
    chunked_mask,
    dense_mask,
    holds_window,
    same_block,
    sliding_window_mask,
)
from easylm.runtime.sharding import BATCH_AXES, PARAMETER_AXES, constrain

# The key/value cache (B, S, K, H): batch split like activations, heads on 'mp' like the
# k/v projections that fill it.
CACHE_SPEC = P(BATCH_AXES, None, "mp", None)
# "kv": keys and values interleaved in one page pool (serving/pages.py's kernel layout).
CACHE_PARTITION_RULES = ((r"(^|/)(k|v|kv)$", CACHE_SPEC),)
# Activations (B, T, ...) split their T over 'sp' (context parallelism; size 1 otherwise).
HEADS = P(BATCH_AXES, "sp", "mp", None)  # (B, T, heads, H)


def rotary_embedding(positions, inv_freq, dtype, scale: float = 1.0):
    """cos, sin (B, T, H) for integer positions (B, T) and inverse frequencies (H/2,),
    times `scale` in fp32 before the cast (YaRN's attention factor, easylm/models/rope.py).
    No frequencies (a NoPE kind: `CausalLM.inv_freq` None): (None, None), no rotation."""
    if inv_freq is None:
        return None, None
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def apply_rotary(x, cos, sin):
    """Rotate (B, T, heads, H) by the half-split convention of HF's rotate_half. cos and
    sin narrower than H (R < H) rotate the first R dims and pass the rest (transformers'
    partial rotary, which takes R from cos the same way). None (a NoPE layer's): x as it is."""
    if cos is None:
        return x
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return jnp.concatenate([apply_rotary(x[..., :R], cos, sin), x[..., R:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class RMSNorm(nn.Module):
    """w * x / rms(x): normalised in fp32, cast to the compute dtype, then scaled (HF LLaMA);
    with `scale_in_fp32` (`FP32ScaledRMSNorm`), scaled in fp32 and then cast (HF gpt-oss,
    OLMo 3)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    scale_in_fp32 = False  # a class setting, not a field

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if self.scale_in_fp32:
            return (weight.astype(jnp.float32) * x32).astype(self.dtype)
        return weight.astype(self.dtype) * x32.astype(self.dtype)


class FP32ScaledRMSNorm(RMSNorm):
    """(w * x / rms(x)) in fp32, then cast: transformers' norm of gpt-oss and OLMo 2/3."""

    scale_in_fp32 = True


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


class Sublayer(nn.Module):
    """What a layer's parts build with: dense projections and the family's norm."""

    config: Any
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    norm_class: type = RMSNorm

    def dense(self, features, name, bias=False):
        return NamedDense(features, use_bias=bias, dtype=self.dtype,
                          param_dtype=self.param_dtype,
                          kernel_init=nn.initializers.normal(self.config.initializer_range),
                          name=name)

    def norm(self, name):
        return self.norm_class(self.config.rms_norm_eps, self.dtype, self.param_dtype, name=name)

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
        return [checkpoint_name(part, name) for part, (name, _) in
                zip(jnp.split(out, edges, axis=-1), names_and_features)]


class NamedDense(nn.Dense):
    """nn.Dense whose output carries its name (`checkpoint_name`, e.g. "q_proj"): what the
    remat policies that keep some projections' outputs (easylm/models/remat.py) select."""

    def __call__(self, x):
        return checkpoint_name(super().__call__(x), self.name)


def length_axes(init_cache) -> list[tuple[int, ...]]:
    """Per array of the cache `init_cache(batch, length)` makes (`jax.tree.leaves` order):
    the axes that grow with its length: one for a positional array (an attention layer's
    keys and values (B, S, K, H), a latent (B, S, 1, C + R)), none for a slot's state
    (Gated DeltaNet's). The one rule by which the decoder reads a cache's length
    (`cache_length`: its masks) and the serving engine slices and writes positions
    (`CacheLayout`): what each layer's `layer_cache` declares by its shapes, whatever it
    names its arrays."""
    short, long = (jax.tree.leaves(jax.eval_shape(lambda: init_cache(2, n))) for n in (8, 16))
    return [tuple(i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y)
            for a, b in zip(short, long)]


def cache_length(lm, config, cache) -> int:
    """S, the positions `cache` (laid out as `init_cache(lm, config, ...)`) holds: the
    length of its first positional array (`length_axes`); 0 when it holds only state
    (no attention layer: nothing reads the mask)."""
    paged = [x for x in jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, PagedKV))
             if isinstance(x, PagedKV)]
    if paged:  # a decode step straight from the page pool: each table's reach
        return paged[0].length
    axes = length_axes(lambda batch, length: init_cache(lm, config, batch, length, jnp.float32))
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == len(axes), (len(leaves), len(axes))
    return next((leaf.shape[grown[0]] for leaf, grown in zip(leaves, axes) if grown), 0)


def write_cache(cache, k, v, positions):
    """(k, v) over all S cache positions (B, S, K, H) in the compute dtype, and the cache
    with this call's keys/values (B, T, K, H) written at their `positions` (B, T); a
    `PagedKV` cache (the serving engine's pages) is written in place and read back whole."""
    if isinstance(cache, PagedKV):
        cache = cache.write(k, v, positions)
        k_all, v_all = cache.gather()
        return k_all.astype(k.dtype), v_all.astype(v.dtype), cache
    rows = jnp.arange(k.shape[0])[:, None]
    k_all = cache["k"].at[rows, positions].set(k.astype(cache["k"].dtype))
    v_all = cache["v"].at[rows, positions].set(v.astype(cache["v"].dtype))
    cache = {"k": constrain(k_all, CACHE_SPEC), "v": constrain(v_all, CACHE_SPEC)}
    return k_all.astype(k.dtype), v_all.astype(v.dtype), cache


class Attention(Sublayer):
    """q, k, v projections (fused or not, with or without biases), optional q/k norms (per
    head, or with `qk_norm_over_heads` over all heads' q (N*H) and k (K*H) at once, OLMo
    2/3's), rotary (none where cos is None: a NoPE layer), the cache write, attention
    (scaled by `scale`, 1/sqrt(H) when None), and the output projection."""

    fused: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    qk_norm_over_heads: bool = False
    scale: float | None = None

    @staticmethod
    def init_cache(config, batch_size: int, length: int, dtype):
        """An attention layer's cache: keys and values (B, S, K, H), zeros."""
        shape = (batch_size, length, config.num_key_value_heads, config.head_dim)
        return {name: jnp.zeros(shape, dtype) for name in ("k", "v")}

    @nn.compact
    def __call__(self, x, cos, sin, mask, window, positions, cache):
        c = self.config
        B, T, _ = x.shape
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self.fused:
            q, k, v = self.kernels(x, [("q_proj", N * H), ("k_proj", K * H), ("v_proj", K * H)],
                                   self.qkv_bias)
        else:
            q, k, v = (self.dense(N * H, "q_proj", self.qkv_bias)(x),
                       self.dense(K * H, "k_proj", self.qkv_bias)(x),
                       self.dense(K * H, "v_proj", self.qkv_bias)(x))
        if self.qk_norm_over_heads:  # the whole (N*H,) query and (K*H,) key, before rotary
            q, k = self.norm("q_norm")(q), self.norm("k_norm")(k)
        q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
        if self.qk_norm:  # each head's query and key normalised, before rotary
            q, k = self.norm("q_norm")(q), self.norm("k_norm")(k)
        q = constrain(apply_rotary(q, cos, sin), HEADS)
        k = constrain(apply_rotary(k, cos, sin), HEADS)
        v = constrain(v, HEADS)
        if self.reads_pages(cache, mask):  # a decode step: one query per sequence
            cache = cache.write(k, v, positions)
            out = cache.attend(q, positions, self.scale, window)
        else:
            if cache is not None:
                k, v, cache = write_cache(cache, k, v, positions)
            out = self.attend(q, k, v, mask, window, positions)  # (B, T, N, H)
        out = checkpoint_name(out, "attention_out")
        out = self.dense(c.hidden_size, "o_proj", self.out_bias)(out.reshape(B, T, N * H))
        return out, cache

    def reads_pages(self, cache, mask) -> bool:
        """Whether this call attends straight from the serving engine's pages
        (`paged_attention.PagedKV`, the ragged paged attention kernel on a TPU): one query
        per sequence under the cache's causal mask and the layer's window, with the shared
        softmax (`attend` not overridden: gpt-oss's sinks are not the kernel's). Otherwise
        a `PagedKV` is read back whole (`write_cache`) and attended as a dense cache."""
        return (isinstance(cache, PagedKV) and isinstance(mask, jax.Array)
                and mask.shape[1] == 1 and type(self).attend is Attention.attend)

    def attend(self, q, k, v, mask, window, positions):
        """The configured kernel over q (B, T, N, H), k, v (B, S, K, H), or context
        parallelism's when the sequence is split over 'sp'; a family whose softmax differs
        (gpt-oss's sinks) overrides this."""
        if isinstance(mask, SplitSequence):  # the sequence split over 'sp'
            refuse_splash_split(self.config.attention)
            return mask.attention(q, k, v, positions, window, self.scale)
        # Without a (B, T, S) mask (causal, or segment ids) the kernel applies the window.
        return attention(q, k, v, mask, self.config.attention,
                         0 if holds_window(mask) else window, scale=self.scale)


def refuse_splash_split(implementation: str):
    """attention=splash under sp > 1: the ring and all-gather kernels are not splash's."""
    if implementation == "splash":
        raise UserError("attention=splash under context parallelism (a mesh with sp > 1): "
                        "the ring and all-gather kernels run there, not splash; use "
                        "attention=auto or sp=1")


class GatedMLP(Sublayer):
    """down(act(gate(x)) * up(x)), gate and up fused into one matmul or not."""

    activation: Callable = nn.silu
    fused: bool = False
    bias: bool = False

    @nn.compact
    def __call__(self, x):
        F = self.config.intermediate_size
        if self.fused:
            gate, up = self.kernels(x, [("gate_proj", F), ("up_proj", F)], self.bias)
        else:
            gate, up = self.dense(F, "gate_proj", self.bias)(x), self.dense(F, "up_proj",
                                                                              self.bias)(x)
        h = constrain(self.activation(gate) * up, P(BATCH_AXES, "sp", "mp"))  # (B, T, F)
        return self.dense(self.config.hidden_size, "down_proj", self.bias)(h)


def pattern_period(kinds) -> int:
    """The length n of the shortest pattern the layer kinds repeat: its R = L // n whole
    repeats alike, and the tail past them either under two or more repeats (Gemma 4's
    last layer, always full) or the pattern's start cut short (Gemma 3's 26 layers: 4 x 6
    and 2 sliding); L, one block scanned once, when no shorter one does (layers of
    experts after the dense first ones)."""
    L = len(kinds)
    for n in range(1, L + 1):
        R = L // n
        if all(kinds[i] == kinds[i % n] for i in range(R * n)) and (
                R >= 2 or all(kinds[i] == kinds[i - n] for i in range(n, L))):
            return n
    return L


def period(config) -> int:
    """The length of the pattern the layers repeat (what a scan stacks), from the config's
    layer kinds (each family's layers: `ModelConfig.layer_kinds`)."""
    return max(1, pattern_period(config.layer_kinds()))


def scan_blocks(lm: type, config) -> tuple[tuple[int, int], ...]:
    """(first layer, repeats) of each scanned block: the pattern's whole repeats, cut where
    the kinds of one repeat differ from the one before (Gemma 4's KV-shared layers: their
    kinds are their own); one block of all the repeats for every other family."""
    kinds, n = lm.layer_kinds(config), period(config)
    blocks = []
    for r in range(len(kinds) // n):
        if blocks and kinds[r * n:(r + 1) * n] == kinds[(r - 1) * n:r * n]:
            blocks[-1][1] += 1
        else:
            blocks.append([r * n, 1])
    return tuple(map(tuple, blocks))


def block_name(start: int) -> str:
    """Where the scanned block from layer `start` is stored under model/."""
    return "layers" if start == 0 else f"layers_from{start}"


def _scanned_layers(lm: type, config) -> int:
    """How many layers the scanned blocks hold (the rest is the tail)."""
    n = period(config)
    return len(lm.layer_kinds(config)) // n * n


def _layer_class(lm: type, config):
    if config.remat_policy == "none":
        return lm.layer
    return nn.remat(lm.layer, policy=remat.POLICIES[config.remat_policy],
                    prevent_cse=not config.scan_layers)


class _Block(nn.Module):
    """One repeat of the pattern: the layers of its `kinds`, named slot<j> (a scan's body)."""

    config: Any
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    lm: type
    kinds: tuple

    @nn.compact
    def __call__(self, x, contexts, positions, cache, own=None):
        layer, new_cache = _layer_class(self.lm, self.config), {}
        for j, kind in enumerate(self.kinds):
            x, new_cache[f"slot{j}"] = layer(self.config, self.dtype, self.param_dtype, kind=kind,
                                             name=f"slot{j}")(
                x, contexts[kind], positions, None if cache is None else cache[f"slot{j}"],
                *_own_input(own, j))
        return x, (None if cache is None else new_cache)


def _own_input(inputs, i) -> tuple:
    """The extra argument a layer is called with: its own slice of the layers' inputs
    (`CausalLM.layer_stream`), none where the family has none."""
    return () if inputs is None else (jax.tree.map(lambda u: u[i], inputs),)


def _per_repeat(inputs, start: int, repeats: int, n: int):
    """The layers' own inputs (L, ...) of the block from layer `start` as its scan's
    per-repeat input: (R, n, ...), or (R, ...) for a period of one."""
    shape = (repeats, n) if n > 1 else (repeats,)
    return jax.tree.map(lambda u: u[start:start + repeats * n].reshape(*shape, *u.shape[1:]),
                        inputs)


class _Layers(nn.Module):
    """The layers one by one, named layers/<i>/... like HF's model.layers.<i>."""

    config: Any
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    lm: type

    @nn.compact
    def __call__(self, x, contexts, positions, cache, inputs=None):
        layer, new_cache = _layer_class(self.lm, self.config), {}
        for i, kind in enumerate(self.lm.layer_kinds(self.config)):
            x, new_cache[str(i)] = layer(self.config, self.dtype, self.param_dtype, kind=kind,
                                         name=str(i))(
                x, contexts[kind], positions, None if cache is None else cache[str(i)],
                *_own_input(inputs, i))
        return x, (None if cache is None else new_cache)


@struct.dataclass
class LayerContext:
    """What the decoder hands a layer of one kind (`CausalLM.layer_context` may turn it
    into what a non-attention kind reads): the rotary's cos and sin (B, T, R) (None for a
    NoPE kind), the mask (None: causal; (B, T) segment ids; (B, T, S) with a cache; a
    `SplitSequence` under sp) and the kind's sliding window (0: none), computed once here
    from the layer kinds (`CausalLM.window`). It unpacks as `cos, sin, mask, window`."""

    cos: Any
    sin: Any
    mask: Any
    window: int = struct.field(pytree_node=False, default=0)

    def __iter__(self):
        return iter((self.cos, self.sin, self.mask, self.window))


class _Backbone(nn.Module):
    """model/...: the embedding, the layers and the final norm; hidden states (B, T, D)."""

    config: Any
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    lm: type

    @nn.compact
    def __call__(self, input_ids, positions, segment_ids, cache, embeddings=None,
                 rope_positions=None, blocks=None):
        c, lm = self.config, self.lm
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                         param_dtype=self.param_dtype,
                         embedding_init=nn.initializers.normal(c.initializer_range),
                         name="embed_tokens")
        # The lookup (and, in the backward pass, the scatter into the table) happens
        # where the table's D is split: over PARAMETER_AXES ('fsdp' and 'sp'), batch over
        # the axes that replicate the table ('dp', 'ep'), and the ids split the same way.
        # Then two all-to-alls, one mesh axis each, split the batch over BATCH_AXES and T
        # over 'sp' as everywhere else. Going there in one move (or with the ids split
        # over the batch) makes XLA build the whole (B, T, D) output or gradient on every
        # device (when dp > 1, or under sp with fsdp > 1).
        x = embed(constrain(input_ids, P(("dp", "ep"), None)))
        scale = lm.embed_scale(c)
        if scale is not None:  # in the compute dtype, as HF casts it
            x = x * jnp.asarray(scale, self.dtype)
        x = constrain(x, P(("dp", "ep"), None, PARAMETER_AXES))
        x = constrain(x, P(BATCH_AXES, None, "sp"))
        x = constrain(x, P(BATCH_AXES, "sp", None))  # (B, T, D)
        if embeddings is not None:  # (values (B, T, D), where (B, T)): an image's, say
            values, where = embeddings
            x = jnp.where(where[..., None], values.astype(x.dtype), x)
        length = x.shape[1] if cache is None else cache_length(lm, c, cache)
        x, inputs = lm.layer_stream(c, x, input_ids, self.dtype, self.param_dtype, length)
        contexts = self.contexts(positions, segment_ids, cache, rope_positions, blocks)
        if c.scan_layers:
            x, cache = self.scanned(x, contexts, positions, cache, inputs)
        else:
            x, cache = _Layers(c, self.dtype, self.param_dtype, lm, name="layers")(
                x, contexts, positions, cache, inputs)
        x = lm.stream_hidden(c, x)
        return lm.norm(c.rms_norm_eps, self.dtype, self.param_dtype, name="norm")(x), cache

    def contexts(self, positions, segment_ids, cache, rope_positions=None, blocks=None):
        """Each layer kind's `LayerContext`: without a cache the mask is None (plain
        causal) or the segment ids (B, T), and the kernel applies the kind's window (no
        (B, T, T) mask: splash takes segment ids); with a cache, a (B, T, S) mask by
        position that holds the window; under a mesh with sp > 1 a `SplitSequence`
        (segment ids, no mask) instead. The rotary reads `rope_positions` where given
        (`CausalLM.rotary`), else `positions`. `blocks` (B, T): the tokens of one block
        (an image's) see each other both ways in the kinds `CausalLM.bidirectional` names
        (attention.BidirectionalBlocks; with a cache, the call's own tokens)."""
        c, lm = self.config, self.lm
        rope_positions = positions if rope_positions is None else rope_positions
        # A parameter init's (1, 8) dummy need not split: the parameters are the same.
        split = None if self.is_initializing() else SplitSequence.if_split(
            positions, segment_ids, cache)
        bidirectional = {kind for kind in lm.layer_kinds(c)
                         if blocks is not None and lm.bidirectional(c, kind)}
        if split is not None and bidirectional:
            raise UserError("bidirectional attention among an image's tokens under context "
                            "parallelism (a mesh with sp > 1) is not supported; use sp=1")
        if split is not None:  # no (B, T, T) mask: the window is the kind's, applied there
            if any(lm.chunk(c, kind) for kind in lm.layer_kinds(c)):
                raise UserError("chunked local attention under context parallelism (a mesh "
                                "with sp > 1) is not built: the ring and all-gather kernels "
                                "take no chunk; use sp=1")
            return {kind: lm.layer_context(c, kind, LayerContext(*lm.rotary(
                        c, kind, rope_positions, self.dtype), split, lm.window(c, kind)),
                        segment_ids)
                    for kind in dict.fromkeys(lm.layer_kinds(c))}
        mask = segment_ids  # (B, T) or None
        key_positions = positions  # (B, S)
        if cache is not None:
            # Query at position p sees cache slots 0..p: (B, T, S).
            S = cache_length(lm, c, cache)
            key_positions = jnp.arange(S)[None, :]
            mask = key_positions[:, None, :] <= positions[:, :, None]
        contexts = {}
        for kind in dict.fromkeys(lm.layer_kinds(c)):
            window = lm.window(c, kind)
            kind_mask = mask
            if kind in bidirectional and cache is None:
                kind_mask = BidirectionalBlocks(blocks, segment_ids)
            elif kind in bidirectional:  # the call's tokens' blocks, by cache position
                rows = jnp.arange(blocks.shape[0])[:, None]
                key_blocks = jnp.full(mask.shape[::2], -1, blocks.dtype).at[
                    rows, positions].set(blocks)
                kind_mask = mask | same_block(blocks, key_blocks)
            if window and cache is not None:  # ... and only the last `window` of them
                kind_mask = kind_mask & sliding_window_mask(positions, key_positions, window)
            chunk = lm.chunk(c, kind)
            if chunk:  # ... of the query's chunk: always a (B, T, S) mask
                kind_mask = dense_mask(kind_mask, positions.shape[1], key_positions.shape[1],
                                       window) & chunked_mask(positions, key_positions, chunk)
            contexts[kind] = lm.layer_context(c, kind, LayerContext(*lm.rotary(
                c, kind, rope_positions, self.dtype), kind_mask, window), segment_ids)
        return contexts

    def scanned(self, x, contexts, positions, cache, inputs=None):
        """Each block's R repeats of the pattern as one scanned module (layers/..., then
        layers_from<s>/...), then the tail. The layers' own inputs (L, ...) go in as the
        scan's per-repeat input, (R, n, ...), beside the cache."""
        c, lm = self.config, self.lm
        kinds, n = lm.layer_kinds(c), period(c)
        new_cache = {}
        for start, repeats in scan_blocks(lm, c):
            name = block_name(start)
            if n == 1:
                body = _layer_class(lm, c)
                args = dict(kind=kinds[start])
                contexts_in = contexts[kinds[start]]
            else:
                body, contexts_in = _Block, contexts
                args = dict(lm=lm, kinds=kinds[start:start + n])
            own = () if inputs is None else (_per_repeat(inputs, start, repeats, n),)
            stack = nn.scan(
                # 'router': what a mixture-of-experts layer sows (moe.RouterStats), per layer;
                # 'routing': the choices it replays (moe.replay_collection), per layer;
                # 'indexer': a sparse attention layer's KL loss (sparse_attention.py).
                body, variable_axes={"params": 0, "router": 0, "routing": 0, "indexer": 0},
                # 'dropout': each layer its own key when one is given (LoRA's adapter
                # dropout, easylm/variants/lora.py); a scan passes no stream it does not name.
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast, 0) + (0,) * len(own), length=repeats)
            x, new_cache[name] = stack(c, self.dtype, self.param_dtype, **args, name=name)(
                x, contexts_in, positions, None if cache is None else cache[name], *own)
        tail = _layer_class(lm, c)
        for i in range(_scanned_layers(lm, c), len(kinds)):
            x, new_cache[f"tail{i}"] = tail(c, self.dtype, self.param_dtype, kind=kinds[i],
                                            name=f"tail{i}")(
                x, contexts[kinds[i]], positions, None if cache is None else cache[f"tail{i}"],
                *_own_input(inputs, i))
        return x, (None if cache is None else new_cache)


class CausalLM(nn.Module):
    """`apply(params, input_ids)` -> logits (B, T, V) in the compute dtype; with `cache=`
    (from `init_cache`) and `positions=`, `(logits, cache)` with this call's keys/values
    written; with `return_hidden=True` the final norm's output (B, T, D) instead of logits
    (for losses that apply the head themselves, `head_weight`). With a cache, `segment_ids`
    only mark padding (0; any other id: the call's one document): attention reads the
    cache by position, a recurrent layer leaves its state as it is over padding (the
    serving engine's right-padded prompts). `Model.forward`
    (easylm/models/family.py) turns each into one `ForwardOut`.

    What a layer caches while decoding is the layer's to declare: `layer_cache` (zeros
    for one layer of a kind) and `cache_rules` (how they are sharded); by default an
    attention layer's keys and values (`Attention.init_cache`)."""

    config: Any
    dtype: jnp.dtype = jnp.float32  # compute
    param_dtype: jnp.dtype = jnp.float32  # storage

    layer = None  # the family's decoder layer (see the module docstring); not fields
    norm = RMSNorm

    @classmethod
    def layer_kinds(cls, config) -> tuple[str, ...]:
        """Each layer's kind: its config's (`ModelConfig.layer_kinds`); a family whose
        layers of one kind differ in how they are built (Gemma 4's KV-shared ones) marks
        them here, the pattern (`period`) staying the config's."""
        return config.layer_kinds()

    @classmethod
    def inv_freq(cls, config, kind: str):
        """Rotary inverse frequencies (H/2,) of a layer of `kind`; None: the kind has no
        rotary (NoPE: SmolLM3's every 4th layer, Llama 4's global ones)."""
        raise NotImplementedError

    @classmethod
    def rope_attention_factor(cls, config, kind: str) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor; 1: none)."""
        return 1.0

    @classmethod
    def rotary(cls, config, kind: str, positions, dtype):
        """cos, sin (B, T, R) of a layer of `kind` at `positions` (B, T): by default
        `rotary_embedding` of `inv_freq`, scaled by `rope_attention_factor`. A family whose
        rotary reads more than one position a token (Qwen3.5's multimodal rotary over
        time, height and width) takes its own positions (B, T, A) here."""
        return rotary_embedding(positions, cls.inv_freq(config, kind), dtype,
                                cls.rope_attention_factor(config, kind))

    @classmethod
    def window(cls, config, kind: str) -> int:
        """A sliding window of a layer of `kind` (0: none)."""
        return 0

    @classmethod
    def bidirectional(cls, config, kind: str) -> bool:
        """Whether in a layer of `kind` the tokens of one block (an image's: `decode`'s
        `blocks`) see each other both ways (Gemma 4's sliding layers); else causal."""
        return False

    @classmethod
    def chunk(cls, config, kind: str) -> int:
        """Chunked local attention of a layer of `kind`: its chunk of positions (0: none;
        Llama 4's attention_chunk_size, easylm/models/attention.py)."""
        return 0

    @classmethod
    def embed_scale(cls, config) -> float | None:
        return None

    @classmethod
    def layer_context(cls, config, kind: str, context, segment_ids):
        """What a layer of `kind` is called with as its context: by default the
        decoder's `LayerContext` (cos, sin, mask, window); a kind that reads the documents
        themselves (a recurrent state that restarts at each) adds `segment_ids` (B, T) or
        None."""
        return context

    @classmethod
    def layer_stream(cls, config, x, input_ids, dtype, param_dtype, length: int):
        """(what the layers pass from one to the next, what each layer takes for itself),
        from the embedded tokens x (B, T, D): by default (x, None). A family whose layers
        pass on more (Gemma 4's keys/values for its KV-shared layers) returns a tree holding
        x, of one structure and shape from layer to layer (a scan carries it; `length` is
        the positions attended over, T or the cache's S); one whose layers each take an
        input of their own (Gemma 4's per-layer inputs) returns those as a tree with the
        layer axis first (L, ...), and each layer is called with its slice as a fifth
        argument. Modules made here are the backbone's (model/<name>)."""
        return x, None

    @classmethod
    def stream_hidden(cls, config, stream):
        """The hidden states (B, T, D) in what the last layer passed on (modules made here
        are the backbone's, as in `layer_stream`)."""
        return stream

    @nn.compact
    def __call__(self, input_ids, positions=None, segment_ids=None, cache=None,
                 return_hidden=False, logits_at=None):
        return self.decode(input_ids, positions, segment_ids, cache, return_hidden,
                           logits_at=logits_at)

    def decode(self, input_ids, positions=None, segment_ids=None, cache=None,
               return_hidden=False, embeddings=None, rope_positions=None, blocks=None,
               logits_at=None):
        """The body of `__call__` (called from a compact method), with what a multimodal
        model adds: `embeddings` (values (B, T, D), where (B, T)) in place of the tokens'
        where `where` holds, `rope_positions` for the rotary (`rotary`), and `blocks`
        (B, T) the block (an image) each token is in, -1 for none, for the kinds of
        layers in which a block's tokens see each other both ways (`bidirectional`).
        `logits_at` (B,): the one position of each row to make logits at, (B, 1, V) (the
        serving engine's prefill and extend read only each row's last token: (B, T, V)
        logits of a long prompt batch would be most of its memory)."""
        B, T = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        model = _Backbone(self.config, self.dtype, self.param_dtype, type(self), name="model")
        hidden, new_cache = model(input_ids, positions, segment_ids, cache, embeddings,
                                  rope_positions, blocks)  # (B, T, D)
        if return_hidden:
            return hidden if cache is None else (hidden, new_cache)
        sequence_axis = "sp"
        if logits_at is not None:
            hidden, sequence_axis = hidden[jnp.arange(B), logits_at][:, None], None
        if self.config.tie_word_embeddings:
            embedding = self.variables["params"]["model"]["embed_tokens"]["embedding"]
            logits = hidden @ embedding.astype(self.dtype).T
        else:
            logits = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype,
                              param_dtype=self.param_dtype,
                              kernel_init=nn.initializers.normal(self.config.initializer_range),
                              name="lm_head")(hidden)
        logits = constrain(logits, P(BATCH_AXES, sequence_axis, "mp"))
        return logits if cache is None else (logits, new_cache)

    @classmethod
    def layer_cache(cls, config, kind: str, batch_size: int, length: int, dtype):
        """One layer's cache of `kind` for `length` positions: zeros."""
        return Attention.init_cache(config, batch_size, length, dtype)

    @classmethod
    def cache_rules(cls, config):
        """How the cache's arrays are sharded: (regex on a path, PartitionSpec)."""
        return CACHE_PARTITION_RULES

    def init_cache(self, batch_size: int, length: int, dtype=None):
        """Zeros for `length` cache positions, laid out like the layers (stacked for a
        scan as the parameters are)."""
        return init_cache(type(self), self.config, batch_size, length, dtype or self.dtype)

    def init_params(self, rng, seq_length: int = 8):
        """Parameters only (a pure function of rng; run it sharded)."""
        return self.init(rng, jnp.zeros((1, seq_length), jnp.int32))["params"]


def cache_reach(lm, config) -> int:
    """How far back any layer of the family class `lm` reads its cache: the largest of its
    layers' sliding windows, or 0 (the whole history) when some layer has none (a global
    layer, a recurrent or latent one)."""
    windows = [lm.window(config, kind) for kind in lm.layer_kinds(config)]
    return max(windows) if windows and all(windows) else 0


def init_cache(lm, config, batch_size: int, length: int, dtype):
    """`CausalLM.init_cache` of the family class `lm`: each layer's `layer_cache`, laid out
    like the layers."""
    kinds = lm.layer_kinds(config)

    def entry(kind, *stacked):
        one = jax.eval_shape(lambda: lm.layer_cache(config, kind, batch_size, length, dtype))
        return jax.tree.map(lambda x: jnp.zeros((*stacked, *x.shape), x.dtype), one)

    if not config.scan_layers:
        return {str(i): entry(kind) for i, kind in enumerate(kinds)}
    n, cache = period(config), {}
    for start, repeats in scan_blocks(lm, config):
        cache[block_name(start)] = (
            entry(kinds[start], repeats) if n == 1 else
            {f"slot{j}": entry(kinds[start + j], repeats) for j in range(n)})
    return {**cache, **{f"tail{i}": entry(kinds[i])
                        for i in range(_scanned_layers(lm, config), len(kinds))}}


def head_weight(params, config):
    """The output projection (D, V): lm_head's kernel, or the embedding when tied."""
    if config.tie_word_embeddings:
        return params["model"]["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]


# ----------------------------------------------------------- the two layouts of the layers

def layers_scanned(tree) -> bool | None:
    """Whether `tree` (parameters, adapters, or a checkpoint's stored tree: anything keyed
    like the parameters) holds its layers stacked (scanned), one by one, or has none."""
    layers = tree.get("model", {}).get("layers") if hasattr(tree, "get") else None
    if not layers:
        return None
    return not all(str(name).isdigit() for name in layers)


def _stack(*xs):  # numpy stays on the host (converters), jax arrays stay jax
    return np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)


def stack_layers(tree, n: int = 1, blocks=None):
    """Layers one by one (model/layers/<i>/...) -> scanned: a pattern of period `n`
    repeated, stacked per block of `blocks` ((first layer, repeats) each, `scan_blocks`;
    None: one block of all the whole repeats), see the module docstring. A block none of
    whose layers the tree holds (adapters on k_proj, which KV-shared layers lack) is left
    out."""
    model = dict(tree["model"])
    layers = model.pop("layers")
    num_layers = 1 + max(int(i) for i in layers)
    blocks = blocks or ((0, num_layers // n),)

    def slot(start, repeats, j):
        return jax.tree_util.tree_map(
            _stack, *[layers[str(start + r * n + j)] for r in range(repeats)])

    for start, repeats in blocks:
        if str(start) not in layers:
            continue
        model[block_name(start)] = (slot(start, repeats, 0) if n == 1 else
                                    {f"slot{j}": slot(start, repeats, j) for j in range(n)})
    end = blocks[-1][0] + blocks[-1][1] * n
    for i in range(end, num_layers):
        model[f"tail{i}"] = layers[str(i)]
    return {**tree, "model": model}


def _blocks_of(model) -> dict:
    """{first layer: a scanned block's tree} of a scanned model/ tree."""
    return {0 if key == "layers" else int(key[len("layers_from"):]): block
            for key, block in model.items()
            if key == "layers" or str(key).startswith("layers_from")}


def _block_period(block) -> int:
    return len(block) if all(str(key).startswith("slot") for key in block) else 1


def _block_repeats(block) -> int:
    return jax.tree_util.tree_leaves(block)[0].shape[0]


def unstack_layers(tree):
    """Scanned -> layers one by one: the inverse of `stack_layers`."""
    model, layers = dict(tree["model"]), {}
    for start, block in _blocks_of(model).items():
        model.pop(block_name(start))
        n = _block_period(block)
        parts = [block[f"slot{j}"] for j in range(n)] if n > 1 else [block]
        for r in range(_block_repeats(block)):
            for j in range(n):
                layers[str(start + r * n + j)] = jax.tree_util.tree_map(
                    lambda x, r=r: x[r], parts[j])
    for key in [key for key in model if str(key).startswith("tail")]:
        layers[key[len("tail"):]] = model.pop(key)
    layers = {key: layers[key] for key in sorted(layers, key=int)}
    return {**tree, "model": {**model, "layers": layers}}


def relayout_like(tree, like):
    """`tree` in the layout `like` (a tree keyed like it) has."""
    scanned = layers_scanned(like)
    if not scanned:
        return relayout(tree, scanned)
    blocks = _blocks_of(like["model"])
    n = _block_period(blocks[0])
    return relayout(tree, scanned, n, tuple((start, _block_repeats(block))
                                            for start, block in sorted(blocks.items())))


def relayout(tree, scanned: bool | None, n: int = 1, blocks=None):
    """`tree` with its layers stacked (`scanned`, with `stack_layers`' n and blocks) or one
    by one, whichever it holds now: the one conversion between the two layouts
    (checkpoints, bases and adapters are read in the layout they were stored in; None
    keeps it)."""
    have = layers_scanned(tree)
    if scanned is None or have is None or have == scanned:
        return tree
    return stack_layers(tree, n, blocks) if scanned else unstack_layers(tree)
