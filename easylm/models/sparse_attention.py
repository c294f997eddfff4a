"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) on multi-head latent attention
(mla.py), as transformers 5.25's `DeepseekV32Attention` / `GlmMoeDsaAttention` compute it
(the reference: the indexer's top-k a mask over full attention) and, where it pays, by
gathering only the kept keys (serving).

Each layer's lightning indexer scores every visible key for every query, cheaply:

    q = wq_b(q_latent)            (B, T, H, K)   H indexer heads of K dims; q_latent is
                                                 MLA's q_a_layernorm(q_a_proj(x))
    k = k_norm(wk(x))             (B, S, K)      one key a token (a LayerNorm, eps 1e-6)
    rotary on the first R dims of q and k (R = MLA's qk_rope_head_dim, its cos and sin;
    half-split for DeepSeek-V3.2, interleaved pairs for GLM-5: `rope_interleave`)
    w = weights_proj(x) / sqrt(H) (B, T, H)      in fp32, as transformers keeps it
    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(K))

and the `topk` visible keys of highest score are the only ones MLA attends to (all of them
while a query sees fewer). GLM-5's "shared" layers (`shared_topk` kinds) have no indexer:
they attend to the keys the last full layer chose, which the layers pass on beside x
(`SparseMLACausalLM.layer_stream`). The choice gets no gradient (transformers computes the
indexer under no_grad); the indexer trains on its own loss, below.

The indexer's KL loss (DeepSeek-V3.2's report; a config's `indexer_loss_coef` > 0, in
training: without a cache). For each query t, p_t = MLA's attention probabilities summed
over its N heads and L1-normalized (no gradient), and the layer's loss is the mean over
the queries of KL(p_t || softmax(I_t)), I the indexer's scores (`indexer_kl`):
    dense    over every visible key: p_t the dense attention's (the warm-up stage;
             the family then leaves everything but the indexers untrained)
    sparse   over the kept keys S_t only: p_t the attention MLA computes over them, I_t
             renormalized over S_t (the sparse stage)
The indexer's inputs (x, q_latent) are detached, so that the KL trains only the indexer
and the LM loss none of it. Each layer sows its KL (`self.sow(INDEXER_COLLECTION, ...)`,
moe.py's router statistics' way), whole or block by block inside `by_query_blocks`; the
next-token objective adds coef x the mean over layers (objectives/indexer_loss.py).
Serving computes none of it (a cache); a forward that does not ask for it (scoring) drops
what the layers sow, and XLA what computes it.

Serving: the indexer's keys are one more positional cache array per layer,
`IndexedLatentCache.index_k` (B, S, K) beside the latent (B, S, 1, C + R); the engine
learns its axes from `init_cache` shapes like any other. Shared layers cache the latent
only.

Two ways to attend over the kept keys, equal up to summation order (`topk_attention`,
a config field: auto, gather, mask):
    mask     full MLA over all S keys under the mask of the kept ones, as transformers
             computes it (absorbed or expanded, as MLA picks: mla.py)
    gather   each query's k kept rows of the latent gathered (B, T, k, C + R) and attended
             over in MLA's absorbed form (`gathered_attention`): k keys instead of S
`auto` gathers where there is a cache (serving: decode, extend, each prefill chunk) and
`gather_pays` counts fewer multiply-adds than the masked form; without a cache (training,
a full forward) it masks. There the absorbed form costs 2C + R multiply-adds a head and
pair against the expanded P + R + V (1088 against 320 at DeepSeek-V3.2's shape), so the
gather counts fewer only past T ~ 3.4 k (~7,000 tokens a row), where the rows it holds for
the backward pass, T * k * (C + R), are 16 GB bf16 a layer and more: a fused kernel's
job (FlashMLA's sparse prefill), not XLA's gather.

The indexer itself still scores all S keys (H * K multiply-adds a pair, 64 x 128 for
DeepSeek-V3.2; fp8 on the released kernels): docs/families.md gives the arithmetic.

Training by blocks of queries (`query_block` b, a config field; 0: all at once). Without
a cache the masked form makes, per layer, the indexer's per-head scores (T, H, S) and
its (T, S) scores and mask, and MLA's (N, T, S) scores and probabilities, which the
backward pass keeps: at DeepSeek-V3.2's shape (N = 128, H = 64) 512 GiB of fp32 scores
a layer and row at T = S = 32k, 8 TiB at 128k. With b > 0 the queries go b at a time
(`by_query_blocks`, a lax.map): each block's indexer scores and top-k (`select`: the
same lax.top_k over the same rows, so the same keys) and its masked attention over all
S keys (`blocked_attention`, each block under jax.checkpoint: the backward pass
recomputes a block instead of keeping its scores), so no more than (N, b, S) and (b, H,
S) exist at once: at b = 128, 2 GiB and 1 GiB fp32 at 32k, 8 and 4 GiB at 128k. Kept
across blocks: the choice, (T, k) positions (320 MiB at 32k), and what both forms keep
(the expanded keys and values, (S, N, P + R + V)). The same multiply-adds as the masked
form, plus the attention's forward once more in the backward pass; no FLOP is saved:
attending over the k kept keys only (FLOP-sparse training) needs a fused kernel, as
above. Off by default: not yet timed on the TPU (a loop of smaller matmuls, and the
recomputation), so a run turns it on where memory asks for it (the planner's answer).

DeepSeek-V4's served attention (easylm/deepseek_v4/model.py) takes the same pieces: its
indexer's pick is a `Selection` (`Selection.best`), its sliding window one too
(`Selection.window`), and `gather_rows` / `attend_rows` (with its sinks) attend over them.

Shape letters: B batch, T queries, S keys, D width, Q q_lora_rank, H indexer heads, K
indexer head dim, R rotary dims, C MLA's latent, k the keys a query keeps (min(topk, S)),
W = C + R a cached row.
"""

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError
from easylm.models import sigmoid_moe_decoder
from easylm.models.attention import attention, dense_mask
from easylm.models.context_parallel import SplitSequence
from easylm.models.decoder import apply_rotary
from easylm.models.mla import LatentCache, LatentRotary, MLAConfig, MultiHeadLatentAttention
from easylm.runtime.sharding import BATCH_AXES, constrain

SHARED = "_shared_topk"  # suffix of a layer kind that reuses the last full layer's choice
TOPK_ATTENTION = ("auto", "gather", "mask")  # the module docstring's two ways, or counted
# The config field `query_block`'s help (the module docstring: training by blocks of queries)
QUERY_BLOCK_HELP = ("without a cache (training, scoring), the masked attention and the "
                    "indexer's top-k this many queries at a time, each block recomputed in "
                    "the backward pass: memory O(heads x block x keys) a layer, not O(heads "
                    "x queries x keys); 0: all at once")
INDEXER_LOSSES = ("dense", "sparse")  # the module docstring's two stages of the KL loss
INDEXER_COLLECTION = "indexer"  # what each layer sows its KL into (family.Model.forward)
INDEXER_NORM_EPS = 1e-6  # transformers' k_norm: nn.LayerNorm(K, eps=1e-6)
PARTITION_RULES = (
    (r"indexer/(wq_b|wk|weights_proj)/kernel", P("fsdp", None)),
    (r"indexer/k_norm/(weight|bias)", P(None)),
)
CACHE_RULES = ((r"(^|/)kv$", P(BATCH_AXES, None, None, None)),
               (r"(^|/)index_k$", P(BATCH_AXES, None, None)))


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    q_lora_rank: int
    n_heads: int
    head_dim: int
    rope_dim: int  # MLA's qk_rope_head_dim: the first dims of a head that rotary turns
    topk: int
    rope_interleave: bool = False  # GLM-5: rotary pairs (x0, x1), ...; DeepSeek-V3.2: halves
    initializer_range: float = 0.02
    loss: str = ""  # the indexer's KL loss without a cache (INDEXER_LOSSES); "": none


class IndexedLatentCache(NamedTuple):
    """Per layer: MLA's latent (B, S, 1, C + R) (mla.LatentCache's) and the indexer's keys
    (B, S, K), rotated."""

    kv: jax.Array
    index_k: jax.Array

    @classmethod
    def init(cls, mla, indexer: IndexerConfig, batch: int, length: int, dtype=jnp.float32):
        return cls(LatentCache.init(mla, batch, length, dtype).kv,
                   jnp.zeros((batch, length, indexer.head_dim), dtype))

    def write(self, kv, positions):
        """MLA's rows (B, T, 1, C + R) at `positions` (B, T)."""
        return self._replace(kv=LatentCache(self.kv).write(kv, positions).kv)

    def write_index(self, k, positions):
        """The indexer's keys (B, T, K) at `positions` (B, T)."""
        rows = jnp.arange(k.shape[0])[:, None]
        return self._replace(index_k=self.index_k.at[rows, positions].set(
            k.astype(self.index_k.dtype)))


class Selection(NamedTuple):
    """The keys each query keeps: `top` (B, T, k) their positions (k = min(topk, S)) and
    `valid` (B, T, k) whether each is visible. A query that sees fewer than k keys still
    gets k positions, its invisible ones last (scored -inf), as torch.topk gives them; the
    mask transformers builds from them keeps only the visible ones."""

    top: jax.Array
    valid: jax.Array

    def mask(self, S: int):
        """(B, T, S) bool: the kept visible keys."""
        B, T, _ = self.top.shape
        return jnp.zeros((B, T, S), bool).at[
            jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], self.top].set(self.valid)

    @classmethod
    def best(cls, scores, visible, k: int):
        """The k keys of highest `scores` (B, T, S) among the `visible` (B or 1, T, S), ties
        to the lower position (jax's top_k, as torch's on CPU)."""
        visible = jnp.broadcast_to(visible, scores.shape)
        if not k:  # no key yet (DeepSeek-V4: no compressed entry before m tokens)
            return cls(jnp.zeros((*scores.shape[:2], 0), jnp.int32), visible[..., :0])
        _, top = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
        return cls(top, jnp.take_along_axis(visible, top, axis=-1))

    @classmethod
    def window(cls, positions, width: int):
        """The `width` positions up to each query's (B, T) (its sliding window), those
        before position 0 invisible."""
        top = positions[..., None] - width + 1 + jnp.arange(width)
        return cls(jnp.maximum(top, 0), top >= 0)


def gather_rows(kv, selection: Selection):
    """Each query's kept rows of kv (B, S, W): (B, T, k, W). A position past S (a padded
    or idle row's window: the engine's decode reads a prefix of the cache) reads row S - 1,
    not take_along_axis's NaN fill, which would reach the row's output through its 0 weight."""
    B, T, k = selection.top.shape
    rows = jnp.take_along_axis(kv, selection.top.reshape(B, T * k, 1), axis=1, mode="clip")
    return rows.reshape(B, T, k, kv.shape[-1])


def attend_rows(q, rows, valid, scale: float, sink=None):
    """q (B, T, N, W) over its own rows (B, T, k, W), which are its keys and values, the
    `valid` (B, T, k) ones only: (B, T, N, W). attention.xla_attention's arithmetic (q
    scaled in its dtype, scores in fp32, invisible ones at fp32's min, probabilities cast to
    the values' dtype); `sink` (N,), fp32: a logit per head that joins the softmax and is
    dropped (DeepSeek-V4's)."""
    q = q * jnp.asarray(scale, q.dtype)
    scores = jnp.einsum("BTNW,BTkW->BTNk", q, rows, preferred_element_type=jnp.float32)
    scores = jnp.where(valid[:, :, None], scores, jnp.finfo(jnp.float32).min)
    if sink is not None:
        sink = jnp.broadcast_to(sink[:, None].astype(jnp.float32), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("BTNk,BTkW->BTNW", probs.astype(rows.dtype), rows)


def gathered_attention(q, kv, selection: Selection, scale: float):
    """q (B, T, N, W) over each query's kept rows of kv (B, S, 1, W), the rows its keys
    and values: (B, T, N, W) (`attend_rows`), so it equals the masked form but for the
    order of the sums."""
    return attend_rows(q, gather_rows(kv[:, :, 0], selection), selection.valid, scale)


def use_gather(mode: str, cache, pays) -> bool:
    """`TOPK_ATTENTION`'s choice: gather or mask as told; auto: gather with a cache where
    `pays()` (the gather counts fewer multiply-adds: `gather_pays` for MLA)."""
    if mode != "auto":
        return mode == "gather"
    return cache is not None and pays()


def gather_pays(mla: MLAConfig, T: int, S: int, k: int, dense_absorbs: bool) -> bool:
    """Whether T queries over k gathered keys each (absorbed) count fewer multiply-adds
    than the masked form over all S keys (absorbed, or expanded: MLA's choice). The
    indexer, the same in both, is left out; so are the memory footprints (the gather holds
    T * k rows of W, the masked form N * T * S scores and, expanded, S * N * (P + V))."""
    C, R, N = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.num_attention_heads
    P, V = mla.qk_nope_head_dim, mla.v_head_dim
    if dense_absorbs:  # the same form over S keys
        return k < S
    pair = N * (2 * C + R)  # absorbed: a score over C + R and a value over C, per head
    fold = T * N * C * (P + V)  # the queries and outputs through kv_b_proj's halves
    expanded = S * N * C * (P + V) + T * S * N * (P + R + V)
    return k < S and T * k * pair + fold < expanded


class QueryBlocks(NamedTuple):
    """A call without a cache (T == S) taken `block` queries at a time (`query_block`, the
    module docstring): the mask as the decoder gives it, causal within `segment_ids` (B,
    T), the documents of a packed row, or causal (None), made one block of rows at a time."""

    block: int
    segment_ids: jax.Array | None = None

    def rows(self, start, segment_ids, S: int):
        """(B or 1, block, S) bool: what queries start .. start + block - 1 see;
        `segment_ids` (B, block) theirs (a padded row's are its last real row's)."""
        t = start + jnp.arange(self.block)
        causal = (jnp.arange(S)[None, :] <= t[:, None])[None]
        if segment_ids is None:
            return causal
        return causal & (segment_ids[:, :, None] == self.segment_ids[:, None, :])


class BlockedKeys(NamedTuple):
    """The kept keys (`selection`, (B, T, k)) attended `block` queries at a time, each
    block's (B, block, S) mask made from its rows and dropped (`by_query_blocks`)."""

    selection: Selection
    block: int


def by_query_blocks(fn, block: int, rows: tuple):
    """fn(start, *rows of `block` queries) -> a tree of (B, block, ...), over T queries one
    block after another (jax.lax.map): `rows` a tuple of trees of (B, T, ...) arrays (None
    leaves allowed). The last block is padded with copies of the last row, whose results
    are cut off (so they reach no gradient). Returns fn's tree at (B, T, ...)."""
    T = jax.tree.leaves(rows)[0].shape[1]
    n = -(-T // block)
    pad = n * block - T

    def split(a):  # (B, T, ...) -> (n, B, block, ...)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), mode="edge")
        return jnp.moveaxis(a.reshape(a.shape[0], n, block, *a.shape[2:]), 1, 0)

    def join(a):  # (n, B, block, ...) -> (B, T, ...)
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape(a.shape[0], n * block, *a.shape[3:])[:, :T]

    out = jax.lax.map(lambda xs: fn(xs[0], *xs[1]),
                      (jnp.arange(n) * block, jax.tree.map(split, rows)))
    return jax.tree.map(join, out)


def index_scores(q, k, weights):
    """The indexer's scores (B, T, S) of queries q (B, T, H, K) (rotated), keys k (B, S, K)
    and head weights (B, T, H) (already / sqrt(H)), in fp32."""
    scores = jax.nn.relu(jnp.einsum("BTHK,BSK->BTHS", q, k) * q.shape[-1] ** -0.5)
    return jnp.einsum("BTH,BTHS->BTS", weights, scores)


class IndexerTarget(NamedTuple):
    """The keys MLA attends to (a (B, T, S) mask or `BlockedKeys`) and what the indexer's
    KL loss reads beside them: the indexer's rotated queries (B, T, H, K), keys (B, S, K)
    and head weights (B, T, H) (their gradient the loss's), the `visible` keys ((B or 1,
    T, S) bool, or the `QueryBlocks` they come from), `form` (INDEXER_LOSSES) and
    `counted` (B, T): the queries the mean counts (a packed row's padding, segment 0, not)."""

    keys: object
    index: tuple
    visible: object
    form: str
    counted: jax.Array

    def attend(self, q, k, v, implementation: str, scale: float):
        """MLA's attention of q (B, T, N, W) over k, v (B, S, N, W) under `keys` and the
        indexer's loss: (out (B, T, N, W), the mean KL over the counted queries)."""
        if not isinstance(self.keys, BlockedKeys):
            out = attention(q, k, v, self.keys, implementation, scale=scale)
            kl = indexer_kl(q, k, scale, *self.index, self.visible, self.keys, self.form)
        else:
            S = k.shape[1]
            iq, ik, weights = self.index

            def block(start, q, selection, iq, weights, segment_ids):
                kept = selection.mask(S)
                visible = self.visible.rows(start, segment_ids, S)
                return (attention(q, k, v, kept, implementation, scale=scale),
                        indexer_kl(q, k, scale, iq, ik, weights, visible, kept, self.form))

            out, kl = by_query_blocks(
                jax.checkpoint(block, prevent_cse=False), self.keys.block,
                (q, self.keys.selection, iq, weights, self.visible.segment_ids))
        counted = jnp.broadcast_to(self.counted, kl.shape).astype(jnp.float32)
        return out, jnp.sum(kl * counted) / jnp.maximum(jnp.sum(counted), 1.0)


def indexer_kl(q, k, scale: float, iq, ik, weights, visible, kept, form: str):
    """Each query's KL(p || softmax(I)) (B, T), the indexer's loss (DeepSeek-V3.2's
    report): p the main attention's probabilities, summed over its N heads and
    L1-normalized (no gradient), I `index_scores`, both over the `visible` keys (form
    dense: the dense attention's p) or over the `kept` ones only (sparse: the attention MLA
    computes, and I renormalized over the same keys). q (B, T, N, W), k (B, S, N, W) as
    MLA attends with them; iq, ik, weights the indexer's (`index_scores`)."""
    allowed = jnp.broadcast_to(visible, kept.shape) & (kept if form == "sparse" else True)
    low = jnp.finfo(jnp.float32).min
    logits = jnp.einsum("BTNW,BSNW->BNTS", *jax.lax.stop_gradient((q, k)),
                        preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(allowed[:, None], logits, low), axis=-1)
    p = jax.lax.stop_gradient(probs.sum(1) / probs.shape[1])  # (B, T, S), rows sum to 1
    log_q = jax.nn.log_softmax(jnp.where(allowed, index_scores(iq, ik, weights), low), -1)
    terms = p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q)
    return jnp.sum(jnp.where(allowed & (p > 0), terms, 0.0), axis=-1)


def select(q, k, weights, visible, topk: int) -> Selection:
    """The `topk` visible keys of highest `index_scores`. `visible` (B or 1, T, S) bool, or
    `QueryBlocks` (or what has its `block`, `segment_ids` and `rows`: DeepSeek-V4's
    compressed entries, easylm/deepseek_v4/model.py's `EntryBlocks`): then the scores,
    the visible rows and the top-k are made one block of queries at a time, (B, block,
    H, S) and (B, block, S) at most, never (B, T, S); the same `lax.top_k` on the same
    rows, so the same keys. The choice gets no gradient either way (stop_gradient:
    nothing of it is kept for the backward pass)."""
    k_ = min(topk, k.shape[1])
    if not hasattr(visible, "rows"):  # an array
        return Selection.best(index_scores(q, k, weights), visible, k_)
    q, k, weights = jax.lax.stop_gradient((q, k, weights))
    S = k.shape[1]

    def block(start, q, weights, segment_ids):
        return Selection.best(index_scores(q, k, weights),
                              visible.rows(start, segment_ids, S), k_)

    return by_query_blocks(block, visible.block, (q, weights, visible.segment_ids))


def blocked_attention(q, k, v, keys: BlockedKeys, implementation: str, scale: float):
    """attention.attention(q, k, v, keys.selection.mask(S)) one block of queries at a time,
    each block under jax.checkpoint, so that neither pass holds more than one block's
    (B, N, block, S) scores and (B, block, S) mask: q (B, T, N, H), k, v (B, S, N, H)."""
    S = k.shape[1]

    def block(start, q, selection):
        return attention(q, k, v, selection.mask(S), implementation, scale=scale)

    return by_query_blocks(jax.checkpoint(block, prevent_cse=False), keys.block,
                           (q, keys.selection))


class LayerNorm(nn.Module):
    """transformers' nn.LayerNorm under its names (weight, bias), in fp32."""

    eps: float
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * weight + bias


def rotate(x, cos, sin, interleave: bool):
    """Rotary on the first R dims of (B, T, heads, K) (R = cos's width); interleaved pairs
    are first laid out as halves (the layout transformers' rotation returns too)."""
    R = cos.shape[-1]
    turned, rest = x[..., :R], x[..., R:]
    if interleave:
        turned = jnp.concatenate([turned[..., 0::2], turned[..., 1::2]], axis=-1)
    return jnp.concatenate([apply_rotary(turned, cos, sin), rest], axis=-1)


class Indexer(nn.Module):
    """(x (B, T, D), q_latent (B, T, Q), cos, sin (B, T, R), positions (B, T), visible
    (B or 1, T, S) bool or `QueryBlocks`, cache) -> (each query's top-k visible keys
    (`Selection`), cache with this call's keys written, (q, k, weights) as
    `index_scores` takes them: what the KL loss trains through)."""

    config: IndexerConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def dense(self, features: int, name: str):
        return nn.Dense(features, use_bias=False, dtype=jnp.float32,
                        param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.config.initializer_range),
                        name=name)

    @nn.compact
    def __call__(self, x, q_latent, cos, sin, positions, visible, cache=None):
        c = self.config
        B, T, _ = x.shape
        H, K = c.n_heads, c.head_dim
        x32, cos, sin = (a.astype(jnp.float32) for a in (x, cos, sin))
        q = self.dense(H * K, "wq_b")(q_latent.astype(jnp.float32)).reshape(B, T, H, K)
        k = LayerNorm(INDEXER_NORM_EPS, self.param_dtype, name="k_norm")(
            self.dense(K, "wk")(x32))  # (B, T, K)
        q = rotate(q, cos, sin, c.rope_interleave)
        k = rotate(k[:, :, None], cos, sin, c.rope_interleave)[:, :, 0]
        if cache is not None:
            cache = cache.write_index(k, positions)
            k = cache.index_k.astype(jnp.float32)  # (B, S, K)
        weights = self.dense(H, "weights_proj")(x32) * H ** -0.5  # (B, T, H)
        return select(q, k, weights, visible, c.topk), cache, (q, k, weights)


class SparseLatentAttention(MultiHeadLatentAttention):
    """MLA over the keys an indexer selects: (x, cos, sin, positions, mask, cache,
    selected) -> (out, cache, selected (`Selection`)). With `indexer` None (a shared layer)
    the keys are `selected`, the last full layer's. `gather`: `TOPK_ATTENTION`'s choice;
    `query_block`: the masked form without a cache `query_block` queries at a time (0:
    all at once; the module docstring)."""

    indexer: IndexerConfig | None = None
    gather: str = "auto"
    query_block: int = 0

    @nn.compact
    def __call__(self, x, cos, sin, positions, mask=None, cache=None, selected=None):
        if isinstance(mask, SplitSequence):
            raise UserError("DeepSeek sparse attention under context parallelism (a mesh "
                            "with sp > 1) is not built: its indexer scores every key of the "
                            "sequence; use sp=1")
        T = x.shape[1]
        S = T if cache is None else cache.kv.shape[1]
        blocked = (self.query_block and cache is None and not use_gather(self.gather, None, None)
                   and (mask is None or getattr(mask, "ndim", 0) == 2))  # causal, segment ids
        visible = QueryBlocks(min(self.query_block, T), mask) if blocked else \
            dense_mask(mask, T, S)
        q_latent = self.query_latent(x)
        # The KL loss (training: no cache) trains the indexer alone: its inputs detached,
        # so that the LM loss reaches none of it and the KL nothing else.
        loss = self.indexer.loss if self.indexer is not None and cache is None else ""
        if self.indexer is not None:
            inputs = jax.lax.stop_gradient((x, q_latent)) if loss else (x, q_latent)
            selected, cache, index = Indexer(self.indexer, self.dtype, self.param_dtype,
                                             name="indexer")(*inputs, cos, sin, positions,
                                                             visible, cache)
        if blocked:
            keys = BlockedKeys(selected, visible.block)
        elif self.gathers(T, S, selected.top.shape[-1], cache):
            keys = selected
        else:
            keys = selected.mask(S)
        if loss:
            counted = mask > 0 if getattr(mask, "ndim", 0) == 2 else jnp.ones((1, T), bool)
            keys = IndexerTarget(keys, index, visible, loss, counted)
        out, cache = self.attend(x, q_latent, cos, sin, positions, keys, cache)
        return out, cache, selected

    def gathers(self, T: int, S: int, k: int, cache) -> bool:
        return use_gather(self.gather, cache, lambda: gather_pays(
            self.config, T, S, k, MultiHeadLatentAttention.absorbs(self, T, cache)))

    def absorbs(self, T: int, cache, mask=None) -> bool:
        return isinstance(mask, Selection) or super().absorbs(T, cache, mask)

    def latent_attention(self, q, kv, mask):
        if isinstance(mask, Selection):
            return gathered_attention(q, kv, mask, self.config.softmax_scale)
        return super().latent_attention(q, kv, mask)

    def expanded_attention(self, q, k, v, mask):
        if isinstance(mask, IndexerTarget):  # what training adds: moe.py's router stats' way
            out, kl = mask.attend(q, k, v, self.config.attention, self.config.softmax_scale)
            self.sow(INDEXER_COLLECTION, "kl", kl)
            return out
        if isinstance(mask, BlockedKeys):
            return blocked_attention(q, k, v, mask, self.config.attention,
                                     self.config.softmax_scale)
        return super().expanded_attention(q, k, v, mask)


def mlp_kind(kind: str) -> str:
    return kind.removesuffix(SHARED)


class DecoderLayer(sigmoid_moe_decoder.DecoderLayer):
    """x + sparse MLA(norm(x)), then x + MLP(norm(x)) (dense or experts). Where the model
    has shared layers, x comes and goes as (x, the last full layer's selection)."""

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        cos, sin, mask, _ = context  # MLA has no window
        x, selected = x if isinstance(x, tuple) else (x, None)
        own = None if self.kind.endswith(SHARED) else c.indexer()
        h, cache, selected = SparseLatentAttention(
            c.mla(), self.dtype, self.param_dtype, indexer=own, gather=c.topk_attention,
            query_block=c.query_block, name="self_attn")(
            self.norm("input_layernorm")(x), cos, sin, positions, mask, cache, selected)
        x = x + h
        x = x + self.feed_forward(self.norm("post_attention_layernorm")(x), mlp_kind(self.kind))
        x = constrain(x, P(BATCH_AXES, None, None))
        return ((x, selected) if c.shares_topk() else x), cache


class SparseMLACausalLM(LatentRotary, sigmoid_moe_decoder.SigmoidMoECausalLM):
    """The causal LM of DSA layers. Its config gives `mla()`, `indexer()` and
    `shared_topk()` (per layer: reuses the last full layer's choice), `shares_topk()`."""

    layer = DecoderLayer

    @classmethod
    def layer_kinds(cls, config):
        return tuple(kind + (SHARED if shared else "") for kind, shared in
                     zip(config.layer_kinds(), config.shared_topk()))

    @classmethod
    def layer_cache(cls, config, kind: str, batch_size: int, length: int, dtype):
        if kind.endswith(SHARED):
            return LatentCache.init(config.mla(), batch_size, length, dtype)
        return IndexedLatentCache.init(config.mla(), config.indexer(), batch_size, length,
                                       dtype)

    @classmethod
    def cache_rules(cls, config):
        return CACHE_RULES

    @classmethod
    def layer_stream(cls, config, x, input_ids, dtype, param_dtype, length: int):
        """x, or (x, no key selected yet) where layers share a choice."""
        if not config.shares_topk():
            return x, None
        shape = (*x.shape[:2], min(config.index_topk, length))  # (B, T, k)
        return (x, Selection(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool))), None

    @classmethod
    def stream_hidden(cls, config, stream):
        return stream[0] if isinstance(stream, tuple) else stream
