"""DeepSeek-V4's model on the shared decoder (easylm/models/decoder.py), as transformers
5.25's modeling_deepseek_v4.py computes it. Without a cache a dense reference: every query
is scored against all T tokens and all compressed entries and masked where transformers
masks; with `query_block` b, b queries at a time over the tokens their windows reach and
the entries (`Attention.blocked`: (N, b, b + window - 1 + W) scores, not (N, T, T + W)).
Served, `topk_attention` (auto: with a cache) gathers each query's keys instead: its
window and its kept entries (`Attention.gathered`, sparse_attention's Selection and
attend_rows; docs/model.md counts what it saves).

Served (a cache, `layer_cache`), every array is positional (B, S, ...), so the engine's
generic code slices, pages and writes it by position with no state per slot: the shared
key/value head of each token; for a compressed layer, each token's compressor projections
(kv, and the gate with its position bias: the windows still open) and, at each position
p, the entry of the window ending at p, which a query sees from p on when (p + 1) is a
multiple of m (its garbage at the other positions is never read); for CSA the indexer's
compressor alike. Entry w thus sits at position (w + 1) m - 1, and "visible" is the causal
mask. What it costs against W = S / m entries and a window: docs/model.md.

Shape letters: B batch, T tokens, D width, N heads, H head width (keys = values), R rotary
dims (the last R of each head, rotated in interleaved pairs), W compressed entries, m
tokens an entry compresses, C streams (hc_mult), I / M the indexer's head width / heads,
G output groups, E experts, K experts a token takes.

The residual is C streams x (B, T, C, D) (the embedding copied C times). Each layer:

    post, comb, u = hc(x, hc_attn_*)                  # hyper-connection, below
    x = post * attn(attn_norm(u)) + comb^T x          # x[k] += sum_j comb[j, k] x[j]
    post, comb, u = hc(x, hc_ffn_*)
    x = post * ffn(ffn_norm(u)) + comb^T x

hc: f = rms(x flattened to C*D) @ fn^T -> (pre C, post C, comb C*C); pre = sigmoid(f s0 +
b) + eps, post = 2 sigmoid(f s1 + b), comb = softmax_rows(f s2 + b) + eps, then Sinkhorn:
columns, then (rows, columns) hc_sinkhorn_iters - 1 times, each divided by its sum + eps;
u = sum_j pre_j x_j. After the layers: pre from hc_head (sigmoid + eps), u = sum pre x, norm.

attn (every type): q_res = q_norm(wq_a u); q = rms(wq_b q_res) per head (no weight),
rotated; kv = norm(wkv u) (B, T, H), rotated: one head that is key and value. Keys: the T
tokens under the sliding-window causal mask (i - window < j <= i) and, for the
compressed types, the W = T // m compressed entries after them. Logits q.k / sqrt(H), a
learned sink logit per head joins the softmax and is dropped; out = p @ v, its rotary
dims rotated back (-sin, the query's position); grouped output: each of G groups of
heads through its own block of wo_a (N H / G -> o_lora_rank), then wo_b.

Compressor of m (HCA, heavily compressed): per window of m tokens, entry =
norm(sum_t softmax_t(wgate u + ape) * wkv u) rotated at position w m (compressed base).
CSA (m = compress_rate_csa): wkv, wgate give 2H: entry w mixes window w-1's first H
(the overlap) and window w's last H over 2m slots. Entry w is visible to token i when
(w + 1) m <= i + 1. CSA's lightning indexer keeps index_topk of the visible entries:
its own CSA compressor at width I gives keys k_w; score(i, w) = sum_h (weights_proj u /
sqrt(M))_h relu(q_h . k_w) / sqrt(I), q = wq_b q_res (M heads of I, rotated); the top
index_topk visible (all visible where fewer).

ffn: scores s = sqrtsoftplus(u @ gate) (or sigmoid/softmax); experts: top-K of s + bias
(moe) or tid2eid[token] (hash_moe); weights = s of those / their sum * routed_scaling_factor;
experts silu(min(g, l)) * clip(up, -l, l); plus one shared expert, clamped alike.

Parameter names are the checkpoint's (as transformers' save_pretrained writes them:
attn/wq_a, attn/compressor/ape, ffn/gate, hc_attn_fn, ...; easylm/deepseek_v4/hf.py). A
packed row (segment ids) masks the window and the compressed entries by document (an
entry is visible where the tokens it compresses are all in the query's document).
"""

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.deepseek_v4.config import DeepseekV4Config
from easylm.models import moe, sparse_attention
from easylm.models.decoder import CausalLM, FP32ScaledRMSNorm, Sublayer
from easylm.models.sparse_attention import Selection, use_gather
from easylm.runtime.sharding import BATCH_AXES, constrain

PARTITION_RULES = moe.PARTITION_RULES + (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"lm_head/kernel", P("fsdp", "mp")),
    (r"ffn/gate/(kernel|bias|tid2eid)$", P()),
    (r"shared_experts/(w1|w3)/kernel$", P("fsdp", "mp")),
    (r"shared_experts/w2/kernel$", P("mp", "fsdp")),
    (r"attn/.*kernel$", P("fsdp", None)),
    (r"(ape|attn_sink|weight|hc_\w+)$", P()),
)
# Every cache array is (B, S, width): split over the batch like activations.
CACHE_RULES = ((r".", P(BATCH_AXES, None, None)),)
SCORE = {"sqrtsoftplus": lambda x: jnp.sqrt(jax.nn.softplus(x)), "sigmoid": jax.nn.sigmoid,
         "softmax": lambda x: jax.nn.softmax(x, axis=-1)}


def rotate(x, cos, sin):
    """x (B, T, heads, H) with its last R dims rotated in interleaved pairs by cos, sin
    (B, T, R/2), in fp32 (transformers' V4 rotary)."""
    R = 2 * cos.shape[-1]
    c = jnp.repeat(cos, 2, axis=-1)[:, :, None, :]
    s = jnp.repeat(sin, 2, axis=-1)[:, :, None, :]
    r = x[..., -R:].astype(jnp.float32)
    turned = jnp.stack([-r[..., 1::2], r[..., 0::2]], axis=-1).reshape(r.shape)
    return jnp.concatenate([x[..., :-R], (r * c + turned * s).astype(x.dtype)], axis=-1)


def angles(positions, inv_freq):
    a = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return jnp.cos(a), jnp.sin(a)


def unweighted_rms(x, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def hyper_connection(x, fn, base, scale, c: DeepseekV4Config):
    """(post (B, T, C), comb (B, T, C, C), u (B, T, D)) of streams x (B, T, C, D)."""
    B, T, C, D = x.shape
    f = unweighted_rms(x.reshape(B, T, C * D).astype(jnp.float32), c.rms_norm_eps)
    f = f @ fn.astype(jnp.float32).T
    pre_w, post_w, comb_w = jnp.split(f, [C, 2 * C], axis=-1)
    pre_b, post_b, comb_b = jnp.split(base.astype(jnp.float32), [C, 2 * C])
    pre = jax.nn.sigmoid(pre_w * scale[0] + pre_b) + c.hc_eps
    post = 2 * jax.nn.sigmoid(post_w * scale[1] + post_b)
    comb = jax.nn.softmax(comb_w.reshape(B, T, C, C) * scale[2] + comb_b.reshape(C, C),
                          axis=-1) + c.hc_eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + c.hc_eps)
    for _ in range(c.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + c.hc_eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + c.hc_eps)
    u = (pre[..., None] * x).sum(axis=2).astype(x.dtype)
    return post, comb, u


class Compressor(Sublayer):
    """u (B, T, D) -> (entries (B, W, width), W = T // rate, rotated at w * rate; None).
    With a cache (`compressor_cache`), the entries at position resolution instead: this
    call's projections (its pending windows) written at `positions`, and at every position
    p of the call the entry of the window ending at p (the one a query sees from p on when
    p + 1 is a multiple of the rate; elsewhere never read): (all S entries, the cache)."""

    rate: int = 4
    width: int = 0
    overlap: bool = False  # CSA's: each entry also reads the window before

    @nn.compact
    def __call__(self, u, inv_freq, positions=None, cache=None):
        B, T, _ = u.shape
        m, h, k = self.rate, self.width, 2 if self.overlap else 1
        kv = self.dense(k * h, "wkv")(u)  # (B, T, k h)
        ape = self.param("ape", nn.initializers.zeros, (m, k * h), jnp.float32)
        gate = self.dense(k * h, "wgate")(u).astype(jnp.float32)
        if cache is not None:
            return self.cached(kv, gate + ape[positions % m], inv_freq, positions, cache)
        W = T // m
        kv = kv[:, :W * m].reshape(B, W, m, k * h)
        gate = gate[:, :W * m].reshape(B, W, m, k * h) + ape
        if self.overlap:  # window w-1's first h beside window w's last h: 2m slots
            shift = lambda t, fill: jnp.concatenate(
                [jnp.full_like(t[:, :1], fill), t[:, :-1]], axis=1)
            kv = jnp.concatenate([shift(kv[..., :h], 0.0), kv[..., h:]], axis=2)
            gate = jnp.concatenate([shift(gate[..., :h], -jnp.inf), gate[..., h:]], axis=2)
        return self.pool(kv, gate, jnp.broadcast_to(jnp.arange(W) * m, (B, W)), inv_freq), None

    def pool(self, kv, gate, at, inv_freq):
        """Windows kv, gate (B, W, slots, h) -> entries (B, W, h) rotated at `at` (B, W)."""
        weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
        entries = FP32ScaledRMSNorm(self.config.rms_norm_eps, self.dtype, self.param_dtype,
                                    name="norm")((kv * weights).sum(axis=2))
        cos, sin = angles(at, inv_freq)
        return rotate(entries[:, :, None, :], cos, sin)[:, :, 0]

    def cached(self, kv, gate, inv_freq, positions, cache):
        m, h, k = self.rate, self.width, 2 if self.overlap else 1
        rows = jnp.arange(kv.shape[0])[:, None]
        cache = dict(cache, kv=cache["kv"].at[rows, positions].set(kv.astype(cache["kv"].dtype)),
                     gate=cache["gate"].at[rows, positions].set(gate))
        # The k m tokens up to each position p (B, T, k m); before position 0: none (a
        # gate of -inf: CSA's first entry has no window before it).
        slots = positions[..., None] - k * m + 1 + jnp.arange(k * m)
        at = jnp.maximum(slots, 0)
        take = jax.vmap(lambda c, i: c[i])  # (S, k h), (T, k m) -> (T, k m, k h)
        kv_w = take(cache["kv"], at).astype(kv.dtype)
        gate_w = jnp.where((slots >= 0)[..., None], take(cache["gate"], at), -jnp.inf)
        if self.overlap:  # window w-1's first h beside window w's last h
            kv_w = jnp.concatenate([kv_w[:, :, :m, :h], kv_w[:, :, m:, h:]], axis=2)
            gate_w = jnp.concatenate([gate_w[:, :, :m, :h], gate_w[:, :, m:, h:]], axis=2)
        entries = self.pool(kv_w, gate_w, positions + 1 - m, inv_freq)  # (B, T, h)
        cache["entries"] = cache["entries"].at[rows, positions].set(
            entries.astype(cache["entries"].dtype))
        return cache["entries"].astype(kv.dtype), cache


def compressor_cache(batch: int, length: int, width: int, overlap: bool, dtype) -> dict:
    """A compressor's cache, all positional (B, S, ...): each token's projections (the
    pending windows: kv, and the gate in fp32 with its position bias added) and the entry
    of the window ending at each position."""
    k = 2 if overlap else 1
    return {"kv": jnp.zeros((batch, length, k * width), dtype),
            "gate": jnp.zeros((batch, length, k * width), jnp.float32),
            "entries": jnp.zeros((batch, length, width), dtype)}


class Indexer(Sublayer):
    """The lightning indexer: (the visible entries each query keeps (a `Selection` of k
    among W, or with a cache among the S entries at position resolution), the cache)."""

    @nn.compact
    def __call__(self, u, q_res, cos, sin, inv_freq, visible, positions=None, cache=None):
        c = self.config
        B, T, _ = u.shape
        M, I = c.index_n_heads, c.index_head_dim
        keys, cache = Compressor(c, self.dtype, self.param_dtype, rate=c.compress_rate_csa,
                                 width=I, overlap=True, name="compressor")(
            u, inv_freq, positions, cache)  # (B, W or S, I)
        q = rotate(self.dense(M * I, "wq_b")(q_res).reshape(B, T, M, I), cos, sin)
        heads = self.dense(M, "weights_proj")(u).astype(jnp.float32) * M ** -0.5
        # The top k by index, not by a threshold: relu leaves ties (at 0) that a threshold
        # would all keep; ties go to the lower index (jax's top_k, as torch's on CPU), and
        # entries at position resolution keep the entries' order. `visible` may be
        # `EntryBlocks`: then block by block of queries (sparse_attention.select).
        return sparse_attention.select(q.astype(jnp.float32), keys.astype(jnp.float32), heads,
                                       visible, c.index_topk), cache


class EntryBlocks(NamedTuple):
    """Which compressed entries (W of `rate` tokens) queries see without a cache, made
    `block` query rows at a time (sparse_attention.select and `Attention.blocked` take it
    as sparse_attention.QueryBlocks): entry w from token (w + 1) rate - 1 on, and in a
    packed row only within its document (`first` (B, W): the segment id of the first token
    it reads; `segment_ids` (B, T) the queries'; None: one document)."""

    block: int
    rate: int
    segment_ids: jax.Array | None = None
    first: jax.Array | None = None

    def rows(self, start, segment_ids, W: int):
        """(B or 1, block, W) bool for queries start .. start + block - 1 (`segment_ids`
        (B, block) theirs)."""
        t = start + jnp.arange(self.block)
        seen = ((jnp.arange(W)[None, :] + 1) * self.rate <= t[:, None] + 1)[None]
        if segment_ids is None:
            return seen
        return seen & (self.first[:, None, :] == segment_ids[:, :, None])


def sink_attention(q, kv, mask, sink, dtype):
    """q (B, T, N, H) over keys that are their values kv (B, S, H) under mask (B or 1, T,
    S), the sink logits (N,) in the softmax and dropped: (B, T, N, H), scores in fp32."""
    B, T, N, H = q.shape
    logits = jnp.einsum("BTNH,BSH->BNTS", q.astype(jnp.float32),
                        kv.astype(jnp.float32)) * H ** -0.5
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    sink = jnp.broadcast_to(sink[None, :, None, None], (B, N, T, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("BNTS,BSH->BTNH", probs.astype(dtype), kv.astype(dtype))


class Attention(Sublayer):
    attention_type: str = "sliding_attention"

    @nn.compact
    def __call__(self, u, cos, sin, inv_freq, segment_ids, positions=None, cache=None):
        c = self.config
        B, T, _ = u.shape
        N, H, G = c.num_attention_heads, c.head_dim, c.o_groups
        norm = lambda name: FP32ScaledRMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype,
                                              name=name)
        q_res = norm("q_norm")(self.dense(c.q_lora_rank, "wq_a")(u))
        q = unweighted_rms(self.dense(N * H, "wq_b")(q_res).reshape(B, T, N, H), c.rms_norm_eps)
        q = rotate(q, cos, sin)
        kv = rotate(norm("norm")(self.dense(H, "wkv")(u))[:, :, None, :], cos, sin)[:, :, 0]
        if cache is None:  # the T tokens, by document (by blocks of queries: `blocked`'s)
            keys = queries = jnp.arange(T)[None, :]
            same = (jnp.ones((B, T, T), bool) if segment_ids is None else
                    segment_ids[:, :, None] == segment_ids[:, None, :])
        else:  # the cache's S positions (written first), by position
            cache = dict(cache)
            at = jnp.arange(B)[:, None]
            cache["kv"] = cache["kv"].at[at, positions].set(kv.astype(cache["kv"].dtype))
            kv = cache["kv"].astype(kv.dtype)
            keys, queries = jnp.arange(kv.shape[1])[None, :], positions
            same = True
        mask = same & (keys[:, None, :] <= queries[:, :, None]) & (
            queries[:, :, None] - keys[:, None, :] < c.sliding_window)  # (B, T, S)
        block = min(c.query_block, T) if cache is None else 0
        entries = picked = visible = None
        if c.compress_rate(self.attention_type):
            entries, visible, picked, cache = self.compressed(
                u, q_res, cos, sin, inv_freq, segment_ids, positions, keys, queries, cache,
                block)
        sink = self.param("attn_sink", nn.initializers.zeros, (N,), jnp.float32)
        if block:
            out = self.blocked(q, kv, entries, visible, picked, segment_ids, sink, block)
        elif self.gathers(kv.shape[1], entries is not None, picked, cache):
            out = self.gathered(q, kv, entries, picked, positions, sink)
        else:
            if entries is not None:
                kv = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
                mask = jnp.concatenate([mask, visible], axis=-1)
            out = sink_attention(q, kv, mask, sink, self.dtype)
        out = rotate(out, cos, -sin).reshape(B, T, G, N * H // G)
        wo_a = _Kernel((N * H // G, G * c.o_lora_rank), c.initializer_range, self.param_dtype,
                       name="wo_a")()
        out = jnp.einsum("BTGJ,JGR->BTGR", out,
                         wo_a.astype(self.dtype).reshape(N * H // G, G, c.o_lora_rank))
        return self.dense(c.hidden_size, "wo_b")(out.reshape(B, T, G * c.o_lora_rank)), cache

    def window(self, S: int) -> int:
        return min(self.config.sliding_window, S)

    def gathers(self, S: int, compressed: bool, picked, cache) -> bool:
        """`topk_attention`'s choice (sparse_attention.use_gather), served only: without a
        cache (training, a full forward) always the mask. Served (keys at position
        resolution), the masked form scores all S cached positions, and S more for a
        compressed type; the gather reads the window and the kept entries (CSA: k; HCA: all
        S / m), the same multiply-adds a key in both forms."""
        m = self.config.compress_rate(self.attention_type)
        kept = 0 if not compressed else picked.top.shape[-1] if picked is not None else S // m
        return cache is not None and use_gather(
            self.config.topk_attention, cache,
            lambda: self.window(S) + kept < S * (1 + compressed))

    def gathered(self, q, kv, entries, picked, positions, sink):
        """The served sparse form: each query's window of cached keys and its compressed
        entries (CSA: the indexer's `picked`; HCA: every entry position (w + 1) m - 1, those
        past the query invisible) gathered and attended over with the sinks
        (sparse_attention.attend_rows): (B, T, N, H)."""
        B, S, H = kv.shape
        selections = [(kv, Selection.window(positions, self.window(S)))]
        if entries is not None:
            if picked is None:  # HCA: every entry
                m = self.config.compress_rate(self.attention_type)
                top = jnp.broadcast_to((jnp.arange(S // m) + 1) * m - 1,
                                       (*positions.shape, S // m))
                picked = Selection(top, top <= positions[..., None])
            selections.append((entries, picked))
        rows = jnp.concatenate([sparse_attention.gather_rows(a, keys).astype(self.dtype)
                                for a, keys in selections], axis=2)
        valid = jnp.concatenate([keys.valid for _, keys in selections], axis=-1)
        return sparse_attention.attend_rows(q.astype(jnp.float32), rows, valid, H ** -0.5, sink)

    def blocked(self, q, kv, entries, seen: EntryBlocks | None, picked, segment_ids, sink,
                block: int):
        """The masked form without a cache, `block` queries at a time (`query_block`;
        sparse_attention.by_query_blocks, each block under jax.checkpoint: the backward pass
        recomputes it): a block's queries over the L = block + window - 1 tokens their
        windows reach and the compressed entries (CSA: the indexer's `picked`; HCA: the
        visible ones, `seen`), (N, block, L + W) scores at once instead of (N, T, T + W):
        (B, T, N, H)."""
        B, T, N, H = q.shape
        window = self.config.sliding_window
        L = min(T, block + window - 1)

        def one(start, q, segments, picked):
            first = jnp.clip(start - window + 1, 0, T - L)  # the window's first token
            keys = jax.lax.dynamic_slice_in_dim(kv, first, L, axis=1)
            t, s = start + jnp.arange(block)[:, None], first + jnp.arange(L)[None, :]
            mask = jnp.broadcast_to(((s <= t) & (t - s < window))[None], (B, block, L))
            if segments is not None:
                mask &= segments[:, :, None] == jax.lax.dynamic_slice_in_dim(
                    segment_ids, first, L, axis=1)[:, None, :]
            if entries is not None:
                W = entries.shape[1]
                kept = seen.rows(start, segments, W) if picked is None else picked.mask(W)
                keys = jnp.concatenate([keys, entries.astype(keys.dtype)], axis=1)
                mask = jnp.concatenate([mask, jnp.broadcast_to(kept, (B, block, W))], axis=-1)
            return sink_attention(q, keys, mask, sink, self.dtype)

        return sparse_attention.by_query_blocks(jax.checkpoint(one, prevent_cse=False), block,
                                                (q, segment_ids, picked))

    def compressed(self, u, q_res, cos, sin, inv_freq, segment_ids, positions, keys, queries,
                   cache, block: int = 0):
        """(the compressed entries (B, W or S, H), which each query sees (B, T, W or S);
        with `block` (no cache) `EntryBlocks` instead, the indexer's `Selection` (CSA; else
        None), the cache). Their parameters are made also when T < m (no entry then)."""
        c = self.config
        B, T, _ = u.shape
        m = c.compress_rate(self.attention_type)
        csa = self.attention_type == "compressed_sparse_attention"
        compressor = Compressor(c, self.dtype, self.param_dtype, rate=m, width=c.head_dim,
                                overlap=csa, name="compressor")
        if cache is None:
            entries, _ = compressor(u, inv_freq)
            W = entries.shape[1]
            first = None  # the entry's tokens all in the query's document
            if segment_ids is not None:
                first = segment_ids[:, jnp.maximum(jnp.arange(W) - csa, 0) * m]
            visible = EntryBlocks(block or T, m, segment_ids, first)
            if not block:
                visible = jnp.broadcast_to(visible.rows(0, segment_ids, W), (B, T, W))
        else:  # the entry of the window ending at key position s, seen from s on
            entries, cache["compressor"] = compressor(u, inv_freq, positions,
                                                      cache["compressor"])
            visible = (keys[:, None, :] <= queries[:, :, None]) & (
                (keys[:, None, :] + 1) % m == 0)
        picked = None
        if csa:
            picked, indexed = Indexer(c, self.dtype, self.param_dtype, name="indexer")(
                u, q_res, cos, sin, inv_freq, visible, positions,
                None if cache is None else cache["indexer"])
            if not block:
                visible = picked.mask(visible.shape[-1])
            if cache is not None:
                cache["indexer"] = indexed
        return entries, visible, picked, cache


def layer_cache(c: DeepseekV4Config, attention: str, batch: int, length: int, dtype) -> dict:
    """A layer's cache, every array positional (B, S, ...): the shared key/value head of
    each token (the window reads the last sliding_window of them) and, for a compressed
    type, its compressor's (`compressor_cache`) and, for CSA, its indexer's."""
    cache = {"kv": jnp.zeros((batch, length, c.head_dim), dtype)}
    if c.compress_rate(attention):
        csa = attention == "compressed_sparse_attention"
        cache["compressor"] = compressor_cache(batch, length, c.head_dim, csa, dtype)
        if csa:
            cache["indexer"] = compressor_cache(batch, length, c.index_head_dim, True, dtype)
    return cache


def _kernel(c):
    return nn.initializers.normal(c.initializer_range)


class _Kernel(nn.Module):
    """wo_a's kernel (N H / G, G o_lora_rank): G blocks side by side (block-diagonal)."""

    shape: tuple
    initializer_range: float
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        return self.param("kernel", nn.initializers.normal(self.initializer_range), self.shape,
                          self.param_dtype)


class MoE(Sublayer):
    """u (B, T, D), ids (B, T) -> (y (B, T, D), moe.RouterStats)."""

    hashed: bool = False

    @nn.compact
    def __call__(self, u, ids):
        c, mc = self.config, self.config.moe()
        B, T, D = u.shape
        E, K = c.n_routed_experts, c.num_experts_per_tok
        tokens = u.reshape(B * T, D)
        gate = _Gate(c, self.hashed, name="gate")
        logits, bias, table = gate(D)
        logits = tokens.astype(jnp.float32) @ logits  # (N, E)
        scores = SCORE[c.scoring_func](logits)
        if self.hashed:  # a frozen token -> experts table
            experts = jnp.round(jax.lax.stop_gradient(table)).astype(jnp.int32)[ids.reshape(-1)]
        else:
            experts = jax.lax.top_k(scores + jax.lax.stop_gradient(bias), K)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        weights = weights * c.routed_scaling_factor
        params = moe.Experts(mc, D, self.param_dtype, name="experts")()
        out, dropped = moe.dispatch(tokens, weights, experts, params, mc, self.dtype)
        shared = _Shared(c, self.dtype, self.param_dtype, name="shared_experts")(u)
        stats = moe.RouterStats(logits, experts, jnp.bincount(experts.reshape(-1), length=E),
                                dropped)
        return out.reshape(B, T, D).astype(self.dtype) + shared, stats


class _Gate(nn.Module):
    """The router's kernel (D, E) fp32, and the correction bias (E,) that picks (moe) or the
    token -> experts table (V, K) (hash_moe, integers carried as floats): neither gets a
    gradient."""

    config: DeepseekV4Config
    hashed: bool

    @nn.compact
    def __call__(self, D):
        c = self.config
        kernel = self.param("kernel", _kernel(c), (D, c.n_routed_experts), jnp.float32)
        if self.hashed:
            table = self.param("tid2eid", lambda key, shape: jax.random.randint(
                key, shape, 0, c.n_routed_experts).astype(jnp.float32),
                (c.vocab_size, c.num_experts_per_tok))
            return kernel, None, table
        return kernel, self.param("bias", nn.initializers.zeros, (c.n_routed_experts,),
                                  jnp.float32), None


class _Shared(Sublayer):
    @nn.compact
    def __call__(self, u):
        L, F = self.config.swiglu_limit, self.config.moe_intermediate_size
        gate = jnp.minimum(self.dense(F, "w1")(u), L)
        up = jnp.clip(self.dense(F, "w3")(u), -L, L)
        return self.dense(u.shape[-1], "w2")(nn.silu(gate) * up)


class DecoderLayer(Sublayer):
    kind: str = "sliding_attention:moe"

    @nn.compact
    def __call__(self, stream, context, positions=None, cache=None):
        c = self.config
        attention, mlp = self.kind.split(":")
        cos, sin, segment_ids = context
        x, ids = stream["x"], stream["ids"]
        C, D = c.hc_mult, c.hidden_size
        norm = lambda name: FP32ScaledRMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype,
                                              name=name)

        def hc(name):
            fn = self.param(f"hc_{name}_fn", _kernel(c), ((2 + C) * C, C * D), jnp.float32)
            base = self.param(f"hc_{name}_base", nn.initializers.zeros, ((2 + C) * C,),
                              jnp.float32)
            scale = self.param(f"hc_{name}_scale", nn.initializers.ones, (3,), jnp.float32)
            return hyper_connection(x, fn, base, scale, c)

        def mix(post, comb, out):
            return (post.astype(x.dtype)[..., None] * out[:, :, None, :]
                    + jnp.einsum("BTjk,BTjD->BTkD", comb.astype(x.dtype), x))

        inv_freq = c.inv_freq(attention)
        post, comb, u = hc("attn")
        out, cache = Attention(c, self.dtype, self.param_dtype, attention_type=attention,
                               name="attn")(norm("attn_norm")(u), cos, sin, inv_freq,
                                            segment_ids, positions, cache)
        x = mix(post, comb, out)
        post, comb, u = hc("ffn")
        out, stats = MoE(c, self.dtype, self.param_dtype, hashed=mlp == "hash_moe",
                         name="ffn")(norm("ffn_norm")(u), ids)
        self.sow("router", "stats", stats)
        x = constrain(mix(post, comb, out), P(BATCH_AXES, None, None, None))
        return {"x": x, "ids": ids}, cache


class _HyperHead(nn.Module):
    """The streams (B, T, C, D) -> (B, T, D): weighted by sigmoid(rms(x) @ hc_fn^T s + b)."""

    config: DeepseekV4Config

    @nn.compact
    def __call__(self, x):
        c = self.config
        B, T, C, D = x.shape
        fn = self.param("hc_fn", _kernel(c), (C, C * D), jnp.float32)
        base = self.param("hc_base", nn.initializers.zeros, (C,), jnp.float32)
        scale = self.param("hc_scale", nn.initializers.ones, (1,), jnp.float32)
        f = unweighted_rms(x.reshape(B, T, C * D).astype(jnp.float32), c.rms_norm_eps) @ fn.T
        pre = jax.nn.sigmoid(f * scale + base) + c.hc_eps
        return (pre[..., None] * x).sum(axis=2).astype(x.dtype)


class DeepseekV4ForCausalLM(CausalLM):
    layer = DecoderLayer
    norm = FP32ScaledRMSNorm

    @classmethod
    def rotary(cls, config: DeepseekV4Config, kind: str, positions, dtype):
        """cos, sin (B, T, R/2): one per interleaved pair, in fp32."""
        return angles(positions, config.inv_freq(kind.split(":")[0]))

    @classmethod
    def layer_context(cls, config, kind: str, context, segment_ids):
        # The attention masks by document itself (its compressed entries too): the segment
        # ids in place of the decoder's mask and window.
        return context.cos, context.sin, segment_ids

    @classmethod
    def layer_stream(cls, config, x, input_ids, dtype, param_dtype, length: int):
        B, T, D = x.shape
        streams = jnp.broadcast_to(x[:, :, None, :], (B, T, config.hc_mult, D))
        return {"x": streams, "ids": input_ids}, None

    @classmethod
    def stream_hidden(cls, config, stream):
        # Called inside the backbone (model/): the head is its model/hc_head.
        return _HyperHead(config, name="hc_head")(stream["x"])

    @classmethod
    def layer_cache(cls, config, kind: str, batch_size: int, length: int, dtype):
        return layer_cache(config, kind.split(":")[0], batch_size, length, dtype)

    @classmethod
    def cache_rules(cls, config):
        return CACHE_RULES
