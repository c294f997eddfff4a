"""A decode-only paged attention kernel (Pallas, TPU) that reads several sequences' pages
per grid step, the next block's pages in flight while this block computes.

Why our own: JAX 0.10.2's ragged paged attention kernel (paged_attention.py's "rpa")
serves prefill and decode rows alike; at a decode step it computes, per sequence and kv
head, a (32 rows x keys) block of which one row is real, with its keys and values masked
element by element, and at llama_1b's batch 64 it reads K/V at 51-55% of the v5e's HBM
bandwidth whatever its block sizes (docs/benchmarks.md). Decode rows are simpler: one query
per sequence, G = N // K rows per kv head. This kernel does that and only that.

Layout (paged_attention.py's): q (S, N, H), one query per sequence at position
lengths[s] - 1; kv_pages (P, Z, 2K, H), k head j at 2j, v head j at 2j + 1; page_table
(S, W); lengths (S,). The wrapper views the pool as (P, Z * 2K, H) (the same bytes; on a
TPU no copy when 2K is a multiple of the dtype's sublane tile: 8 rows fp32, 16 bf16).

Grid (S / b, W / C), both sequential: step (i, c) attends sequences i*b .. i*b + b - 1
over their pages c*C .. c*C + C - 1 (an online softmax across c and within a step). Its
pages arrive by one DMA each into one of two VMEM buffers (b, C / u, u * Z * 2K, H), only
the pages below each sequence's length; the step first starts the copies of the next
step's pages into the other buffer, then waits for its own and computes, so the DMA
engine always has the next block's pages to move. A sequence is computed u pages (a
product, T = u * Z keys) at a time, only the products holding keys below its length: its
cost follows its keys, not the step's C * Z (on a v5e at llama_1b's batch 64, a product
a kv head: 259 us a layer against 316-323 with one product a step, and JAX's 319-325;
docs/benchmarks.md).

A product's keys and values are the buffer's even and odd rows (bf16: JAX's trick, the
buffer read as uint32 rows holding each (k, v) pair, split by shifts). By default
(`all_heads`) one product serves every kv head: the sequence's N query rows against all
T * K keys of the product in one MXU product (N x T * K fp32 scores), a row's columns of
other kv heads masked as keys past the length are (and before a sliding window, whose
passed pages are not copied), one online softmax update, times all T * K values. That
is K times the MXU's work of one product per head, but one chain of softmax steps a
product instead of K: at llama_1b's batch 64 (16 kv heads of one query each) 197 us a
layer against 259, 83% of HBM; in the cascade at GRPO's shape 168 us against 205
(docs/benchmarks.md). Otherwise per kv head: scores q.k (G x T) on the MXU and an update
each; or (`vpu`) per query on the VPU, its scores a column, in fp32.

Both buffers are zeroed at the first step: a page not copied (past a sequence's length)
then holds zeros or an earlier block's pages, never uninitialised memory whose NaN
would survive a zero probability. Pallas interpret mode (`interpret`, tests on the CPU)
runs the same steps, except that it cannot read a ref through a bitcast (JAX 0.10.2:
"'BitcastTransform' object has no attribute 'indices'"), so there bf16 rows are read with
a plain strided load; the uint32 split runs on the TPU only.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(MASK - m) is 0, never NaN
BUFFER_BYTES = 8 << 20  # one of the two K/V buffers: 8 MiB (v5e VMEM: 128 MiB)
PRODUCT_KEYS = 128  # keys per product by default: one MXU tile's width
ALL_HEADS_SCORES = 1 << 20  # all_heads by default while a product's fp32 scores fit


def default_blocks(S, W, page_bytes, page_size, seqs_per_block=2):
    """(sequences per block, pages per sequence per step, pages per product):
    `seqs_per_block` (at most S); products of PRODUCT_KEYS keys (fewer where a table has
    fewer pages or a buffer holds fewer); as many pages a step as one buffer of
    BUFFER_BYTES holds in whole products, at most the table's rounded up to a product
    (pages past the table are never copied nor computed), so a table that fits takes one
    step: a second, empty step would leave the next block's copies nothing to overlap
    (on a v5e 412-428 us a layer at 16 pages a step, against 259 at 24, llama_1b's whole
    table; docs/benchmarks.md). 2 sequences: at llama_1b's batch 64 (pages of 16, 256
    keys) 316 us a layer, against 400 at 4 and 323 at 8 (2026-12-06, before products)."""
    b = max(1, min(seqs_per_block, S))
    fits = max(1, BUFFER_BYTES // (b * page_bytes))
    u = max(1, min(PRODUCT_KEYS // page_size, W, fits))
    return b, max(u, min(-(-W // u) * u, fits // u * u)), u


def product_pages(C, Z, keys=PRODUCT_KEYS):
    """Pages per product for a given C pages a step: the most that divide C and hold at
    most `keys` keys (at least 1)."""
    return max(u for u in range(1, C + 1) if C % u == 0 and (u == 1 or u * Z <= keys))


def _head(buf, j, K, rows, packed):
    """Keys and values (rows, H) of kv head j from one sequence's buffer (rows * 2K, H)."""
    if not packed:  # fp32, or interpret mode
        return (buf[pl.ds(2 * j, rows, stride=2 * K), :],
                buf[pl.ds(2 * j + 1, rows, stride=2 * K), :])
    # bf16: uint32 row r holds bf16 rows 2r (low half: k) and 2r + 1 (high half: v); a
    # bf16 is an fp32's high half, so each split is exact.
    pairs = buf.bitcast(jnp.uint32)[pl.ds(j, rows, stride=K), :]
    k = pltpu.bitcast(pairs << 16, jnp.float32)
    v = pltpu.bitcast(pairs & jnp.uint32(0xFFFF0000), jnp.float32)
    return k.astype(buf.dtype), v.astype(buf.dtype)


class _Dims(NamedTuple):
    """The kernel's static sizes (`batched_decode_attention`): b sequences a block, C pages
    a step, u pages a product, page size Z, K kv heads, G query rows each, W pages a
    sequence."""

    b: int
    C: int
    u: int
    Z: int
    K: int
    G: int
    W: int
    scale: float
    window: int
    packed: bool
    vpu: bool
    lse: bool = False  # also write each query row's log-sum-exp
    all_heads: bool = False  # one product over every kv head (`batched_decode_attention`)


def _copies(d: _Dims, lengths_ref, table_ref, kv_hbm, buf, sems, i, c, slot, act):
    """Start or wait for (`act`) the copies of step (i, c)'s pages into buffer `slot`."""
    page_rows = d.Z * 2 * d.K

    def seq(s, _):
        length = lengths_ref[i * d.b + s]
        n = jnp.minimum(pl.cdiv(length, d.Z), d.W)  # its pages
        # A sliding window's passed pages are not read (their keys are masked).
        first = jax.lax.div(jnp.maximum(length - d.window, 0), d.Z) if d.window else 0
        for p in range(d.C):
            @pl.when((c * d.C + p < n) & (c * d.C + p >= first))
            def _():
                page = table_ref[(i * d.b + s) * d.W + c * d.C + p]
                act(pltpu.make_async_copy(
                    kv_hbm.at[page],
                    buf.at[slot, s, p // d.u, pl.ds(p % d.u * page_rows, page_rows)],
                    sems.at[slot]))
        return 0
    jax.lax.fori_loop(0, d.b, seq, 0)


def _update(m_ref, l_ref, acc_ref, s, at, scores, m_axis, values):
    """The online softmax of query rows `at` of sequence s over one step's `scores`
    (masked), reduced over `m_axis`; values(probs) -> their (n, H) weighted sum."""
    n = at.size
    m_prev = jnp.max(m_ref[s, at, :], axis=1, keepdims=True)  # (n, 1)
    l_prev = jnp.max(l_ref[s, at, :], axis=1, keepdims=True)
    m_new = jnp.max(scores, axis=m_axis, keepdims=True)
    m = jnp.maximum(m_prev, m_new if m_axis == 1 else m_new.T)
    probs = jnp.exp(scores - (m if m_axis == 1 else m.T))
    alpha = jnp.exp(m_prev - m)
    total = jnp.sum(probs, axis=m_axis, keepdims=True)
    lanes = m_ref.shape[-1]
    m_ref[s, at, :] = jnp.broadcast_to(m, (n, lanes))
    l_ref[s, at, :] = jnp.broadcast_to(
        alpha * l_prev + (total if m_axis == 1 else total.T), (n, lanes))
    acc_ref[s, at, :] = alpha * acc_ref[s, at, :] + values(probs)


def _attend(d: _Dims, lengths_ref, q_ref, key_ref, buf, state, i, c, slot):
    """Each sequence of block i over its keys of step c (in buffer `slot`), into the
    running softmax `state` (m_ref, l_ref, acc_ref): a product of u pages (T keys) at a
    time, only those holding keys below its length (and in its window)."""
    T = d.u * d.Z  # keys per product
    base = c * d.C * d.Z  # the step's first key

    def seq(s, _):
        length = lengths_ref[i * d.b + s]
        last = jnp.clip(pl.cdiv(length - base, T), 0, d.C // d.u)  # products with keys
        first = jnp.clip(jax.lax.div(jnp.maximum(length - d.window - base, 0), T), 0,
                         last) if d.window else 0

        def together(t, _):  # every kv head at once: (N, T * K) scores, rows (key, head)
            k, v = _head(buf.at[slot, s, t], 0, 1, T * d.K, d.packed)
            scores = jax.lax.dot_general(q_ref[s], k, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
            keys = length - base - t * T  # the product's keys below the length
            visible = key_ref[...] < keys  # another head's columns: never
            if d.window:
                visible &= key_ref[...] >= keys - d.window
            _update(*state, s, pl.ds(0, d.K * d.G), jnp.where(visible, scores * d.scale, MASK),
                    1, lambda p: jnp.dot(p.astype(v.dtype), v,
                                         preferred_element_type=jnp.float32))
            return 0

        def product(t, _):
            shape = (T, 1) if d.vpu else (d.G, T)
            key = base + t * T + jax.lax.broadcasted_iota(jnp.int32, shape,
                                                          0 if d.vpu else 1)
            visible = key < length
            if d.window:
                visible &= key >= length - d.window
            for j in range(d.K):
                k, v = _head(buf.at[slot, s, t], j, d.K, T, d.packed)
                if not d.vpu:  # q rows against the keys, both products on the MXU
                    q = q_ref[s, pl.ds(j * d.G, d.G), :]  # (G, H)
                    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                                 preferred_element_type=jnp.float32)
                    _update(*state, s, pl.ds(j * d.G, d.G),
                            jnp.where(visible, scores * d.scale, MASK), 1,
                            lambda p, v=v: jnp.dot(p.astype(v.dtype), v,
                                                   preferred_element_type=jnp.float32))
                    continue
                for g in range(d.G):  # one query: its scores a column, products on the VPU
                    q = q_ref[s, pl.ds(j * d.G + g, 1), :].astype(jnp.float32)  # (1, H)
                    scores = jnp.sum(k.astype(jnp.float32) * q, axis=1, keepdims=True)
                    _update(*state, s, pl.ds(j * d.G + g, 1),
                            jnp.where(visible, scores * d.scale, MASK), 0,
                            lambda p, v=v: jnp.sum(p * v.astype(jnp.float32), axis=0,
                                                   keepdims=True))
            return 0
        jax.lax.fori_loop(first, last, together if d.all_heads else product, 0)
        return 0
    jax.lax.fori_loop(0, d.b, seq, 0)


def _kernel(lengths_ref, table_ref, q_ref, kv_hbm, *refs, d: _Dims):
    key_ref, refs = (refs[0], refs[1:]) if d.all_heads else (None, refs)
    o_ref, lse_ref = refs[0], refs[1] if d.lse else None
    buf, sems, m_ref, l_ref, acc_ref = refs[1 + d.lse:]
    i, c = pl.program_id(0), pl.program_id(1)
    blocks, chunks = pl.num_programs(0), pl.num_programs(1)
    step = i * chunks + c
    slot = step % 2
    copies = functools.partial(_copies, d, lengths_ref, table_ref, kv_hbm, buf, sems)

    @pl.when(step == 0)
    def _():
        for half in (0, 1):
            def zero(s, _, half=half):  # one sequence's rows of one buffer at a time
                for t in range(d.C // d.u):
                    buf[half, s, t] = jnp.zeros(buf.shape[3:], buf.dtype)
                return 0
            jax.lax.fori_loop(0, d.b, zero, 0)
        copies(i, c, slot, lambda x: x.start())

    @pl.when(step + 1 < blocks * chunks)
    def _():  # the next step's pages, into the other buffer
        last = c + 1 == chunks
        copies(jnp.where(last, i + 1, i), jnp.where(last, 0, c + 1), 1 - slot,
               lambda x: x.start())

    copies(i, c, slot, lambda x: x.wait())

    @pl.when(c == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, MASK)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    longest = lengths_ref[i * d.b]
    for s in range(1, d.b):
        longest = jnp.maximum(longest, lengths_ref[i * d.b + s])

    @pl.when(c * d.C * d.Z < longest)  # some sequence of the block has keys in this step
    def _():
        _attend(d, lengths_ref, q_ref, key_ref, buf, (m_ref, l_ref, acc_ref), i, c, slot)

    @pl.when(c == chunks - 1)
    def _():
        l = jnp.max(l_ref[...], axis=-1, keepdims=True)
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0, 1.0, l)).astype(o_ref.dtype)
        if d.lse:  # in the scaled scores' units; MASK for a row that saw no key
            l = l_ref[...]
            lse_ref[...] = jnp.where(l > 0, m_ref[...] + jnp.log(jnp.where(l > 0, l, 1.0)),
                                     MASK)


def _dims(S, N, H, kv_pages, W, scale, sliding_window, blocks, vpu, interpret, lse,
          all_heads) -> _Dims:
    """`batched_decode_attention`'s arguments checked, its blocks and form chosen."""
    _, Z, K2, _ = kv_pages.shape
    K = K2 // 2
    if kv_pages.dtype.itemsize not in (2, 4):
        raise ValueError(f"the batched decode kernel reads fp32 or bf16 pages, not "
                         f"{kv_pages.dtype}")
    b, C, *u = blocks or default_blocks(S, W, Z * K2 * H * kv_pages.dtype.itemsize, Z)
    u = u[0] if u else product_pages(C, Z)
    if C % u:
        raise ValueError(f"blocks={blocks}: {u} pages a product do not divide {C} a step")
    if all_heads is None:
        all_heads = not vpu and N * u * Z * K * 4 <= ALL_HEADS_SCORES
    if all_heads and vpu:
        raise ValueError("the batched decode kernel's all_heads products are the MXU's, "
                         "not vpu's")
    return _Dims(b, C, u, Z, K, N // K, W, scale, sliding_window,
                 packed=kv_pages.dtype.itemsize == 2 and not interpret, vpu=vpu, lse=lse,
                 all_heads=all_heads)


def _head_keys(d: _Dims, N: int):
    """(N, u * Z * K) int32: for row n and column (key t, kv head j) of an all-heads
    product's scores, t where j is row n's kv head, else 2^30 (never below a length)."""
    column, row = np.arange(d.u * d.Z * d.K), np.arange(N)
    return jnp.asarray(np.where(column % d.K == row[:, None] // d.G, column // d.K, 1 << 30),
                       jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "blocks", "vpu",
                                             "interpret", "lse", "all_heads"))
def batched_decode_attention(q, kv_pages, lengths, page_table, scale: float,
                             sliding_window: int = 0, blocks: tuple[int, ...] | None = None,
                             vpu: bool = False, interpret=False, lse: bool = False,
                             all_heads: bool | None = None):
    """(S, N, H) attention outputs of one query per sequence (module docstring), q at
    position lengths[s] - 1 seeing keys 0..lengths[s] - 1 (the last `sliding_window`
    only, when set); with `lse`, also each row's log-sum-exp of its scaled scores (S, N)
    fp32 (MASK where a sequence has no key), which merges two attentions over disjoint
    keys (`paged_attention.shared_prefix_attention`). A sequence's N rows may be any
    number of queries: kv head j serves rows j * N / K .. (j + 1) * N / K - 1 (a group
    of sequences' queries over their shared pages). `blocks`: (sequences per block,
    pages per sequence per step[, pages per product]: `product_pages` when left out);
    None: `default_blocks`. A step computes a sequence's products only up to its
    length, so its time follows the keys it holds, not the step's width. `vpu`: both
    products on the VPU, one query at a time (its scores a column: elementwise products
    summed over the lanes, then the values weighted and summed over the keys) instead of
    the MXU's (G, keys) row block, whose one real row pays for a whole weight tile; on a
    v5e slower (docs/benchmarks.md). `all_heads`: a product over every kv head at once
    (module docstring); None: where not `vpu` and a product's fp32 scores (N x keys x
    K) take at most ALL_HEADS_SCORES bytes. `interpret`: True or a
    `pltpu.InterpretParams` runs the kernel in Pallas' TPU interpret mode (any backend;
    tests)."""
    S, N, H = q.shape
    P, Z, K2, _ = kv_pages.shape
    d = _dims(S, N, H, kv_pages, page_table.shape[1], scale, sliding_window, blocks, vpu,
              interpret, lse, all_heads)
    b, C, u = d.b, d.C, d.u
    pad = -S % b  # padded sequences: no keys, no copies, their rows dropped
    q_ = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    lengths_ = jnp.pad(lengths.astype(jnp.int32), (0, pad))
    table = jnp.pad(page_table.astype(jnp.int32), ((0, pad), (0, 0))).reshape(-1)
    kernel = functools.partial(_kernel, d=d)
    keys = [_head_keys(d, N)] if d.all_heads else []
    buffer_bytes = 2 * b * C * Z * K2 * H * kv_pages.dtype.itemsize
    rows = pl.BlockSpec((b, N, H), lambda i, c, *_: (i, 0, 0))
    lanes = pl.BlockSpec((b, N, 128), lambda i, c, *_: (i, 0, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q_.shape, q.dtype),
                   *([jax.ShapeDtypeStruct((S + pad, N, 128), jnp.float32)] if lse else [])),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=((S + pad) // b, pl.cdiv(d.W, C)),
            in_specs=[rows, pl.BlockSpec(memory_space=pl.ANY),
                      *[pl.BlockSpec(x.shape, lambda i, c, *_: (0, 0)) for x in keys]],
            out_specs=(rows, *([lanes] if lse else [])),
            scratch_shapes=[pltpu.VMEM((2, b, C // u, u * Z * K2, H), kv_pages.dtype),
                            pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((b, N, 128), jnp.float32),  # running max
                            pltpu.VMEM((b, N, 128), jnp.float32),  # running sum
                            pltpu.VMEM((b, N, H), jnp.float32)]),  # running output
        compiler_params=pltpu.CompilerParams(
            # Sequential: a step starts the next one's copies.
            dimension_semantics=("arbitrary", "arbitrary"),
            vmem_limit_bytes=min(buffer_bytes + (32 << 20), 100 << 20)),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
    )(lengths_, table, q_, kv_pages.reshape(P, Z * K2, H), *keys)
    return (out[0][:S], out[1][:S, :, 0]) if lse else out[0][:S]
