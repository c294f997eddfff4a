"""Attention over a paged key/value cache: JAX's ragged paged attention kernel on a TPU,
an XLA path with the same numbers elsewhere.

The kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`, the one vLLM's TPU
backend grew from) reads each sequence's keys and values straight from its pages, only
its own length of them, so a decode step reads the K/V it attends and no more: a dense
cache window reads every slot's whole window. Its layout, taken as is here:

    q            (T, N, H)       the queries of all sequences, concatenated (ragged: a
                                 decode row gives one, a prefill chunk many)
    kv_pages     (P, Z, 2K, H)   keys and values of one layer interleaved on the head
                                 axis (k head j at 2j, v head j at 2j + 1)
    kv_lens      (S,) int32      keys each sequence holds, its new tokens' included
    page_indices (S, W) int32    each sequence's pages in order
    cu_q_lens    (S + 1,) int32  where each sequence's queries start in q
    num_seqs     (1,) int32      sequences in use (the rest is padding)

A sequence's queries are its last q_len positions: query i of sequence s sits at position
kv_lens[s] - q_len + i and sees keys 0..itself (and, with a sliding window W, only the
last W of them). Scores are q.k times `scale` (1/sqrt(H) when None). Rows past num_seqs
and queries past cu_q_lens[num_seqs] come back as zeros on the XLA path (the kernel
leaves them unspecified: callers drop them).

What the kernel cannot take stays on the dense path (easylm/models/attention.py): a
softmax sink (gpt-oss), a latent cache (MLA: DeepSeek), keys and values shared from
another layer (Gemma 4), a recurrent state (Gated DeltaNet), a chunked or bidirectional
mask. Shape letters: T queries, N query heads, K kv heads, G = N // K, H head dim,
P pages, Z page size, S sequences, W pages per sequence.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models.paged_decode_kernel import MASK, batched_decode_attention

IMPLEMENTATIONS = ("auto", "xla", "kernel")
# Decode kernels (the engine's --decode_kernel): JAX's ragged paged attention, or ours
# that reads several sequences' pages per step (paged_decode_kernel.py), its products on
# the MXU or (batched_vpu) on the VPU.
DECODE_KERNELS = ("rpa", "batched", "batched_vpu")
# The largest head dim ours takes: on a v5e it compiles and equals the XLA path at 64 and
# 128 (bf16 and fp32 pages, with and without a window), and Mosaic refuses fp32 pages of
# 256 ("the last dim size is not 128" in a strided load). A larger head decodes with
# JAX's kernel, and a group's shared pages (which need ours) with the XLA path.
BATCHED_HEAD_DIM = 128
# Pallas interpret mode for the batched kernel off a TPU (EASYLM_PALLAS_INTERPRET=1, as
# splash.py, or tests; slow). JAX 0.10.2's interpreter cannot run the rpa kernel
# (tests/test_paged_attention.py).
INTERPRET = os.environ.get("EASYLM_PALLAS_INTERPRET", "") == "1"


def combine(k_pages, v_pages):
    """(..., K, H) keys and values -> the kernel's (..., 2K, H), interleaved: pages
    (P, Z, K, H) -> (P, Z, 2K, H), and alike with any leading axes."""
    *lead, K, H = k_pages.shape
    return jnp.stack([k_pages, v_pages], axis=-2).reshape(*lead, 2 * K, H)


def split(kv_pages):
    """`combine`'s inverse: (keys, values), each (..., K, H)."""
    return kv_pages[..., 0::2, :], kv_pages[..., 1::2, :]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["table", "length", "members", "group", "member", "shared"],
                   meta_fields=[])
@dataclasses.dataclass
class SharedPrefix:
    """Groups of decoding sequences whose leading pages are the same pages (GRPO's
    completions of one prompt, requests on one cached system prompt): the groups' keys
    are read once a group, its members' queries together (`shared_prefix_attention`).
    E groups of at most M members, B sequences; a group past the last used has length 0.

    table (E, W) each group's pages; length (E,) the positions they hold (whole pages);
    members (E, M) its sequences (B: none); group, member (B,) each sequence's group and
    place in it; shared (B,) the positions of its keys its group serves (0: none)."""

    table: jax.Array
    length: jax.Array
    members: jax.Array
    group: jax.Array
    member: jax.Array
    shared: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kv", "table", "prefix"],
                   meta_fields=["kernel"])
@dataclasses.dataclass
class PagedKV:
    """One attention layer's cache entry when the serving engine decodes straight from its
    page pool (easylm/serving/pages.py): the layer's pages `kv` (P, Z, 2K, H) (`combine`'s
    layout) and each sequence's page table (B, W). Sequence b's position p lives at offset
    p % Z of page table[b, p // Z]. `decoder.write_cache` writes into it and reads it back
    as a dense (B, W * Z) cache (any layer's attention); `decoder.Attention` attends over
    it with `decode_attention` instead (one query per sequence, no copy of the cache)
    through `kernel` (`DECODE_KERNELS`), and with `prefix` (`SharedPrefix`) a group's
    shared pages once for all its members."""

    kv: jax.Array
    table: jax.Array
    kernel: str = "batched"
    prefix: SharedPrefix | None = None

    @property
    def length(self) -> int:
        """W * Z: the positions a sequence's table reaches."""
        return self.table.shape[-1] * self.kv.shape[-3]

    def write(self, k, v, positions) -> "PagedKV":
        """Keys and values (B, T, K, H) written at `positions` (B, T) of each sequence's
        pages (a position past the table's reach: at its last page)."""
        Z, W = self.kv.shape[1], self.table.shape[1]
        page = self.table[jnp.arange(k.shape[0])[:, None], jnp.minimum(positions // Z, W - 1)]
        kv = self.kv.at[page, positions % Z].set(combine(k, v).astype(self.kv.dtype))
        return PagedKV(kv, self.table, self.kernel, self.prefix)

    def gather(self):
        """Keys and values (B, W * Z, K, H): each sequence's pages in order, as a dense
        cache holds them."""
        B, W = self.table.shape
        pages = self.kv[self.table].reshape(B, self.length, *self.kv.shape[2:])
        return split(pages)

    def attend(self, q, positions, scale: float | None = None, sliding_window: int = 0):
        """q (B, 1, N, H) at `positions` (B, 1), its own keys written (`write`): the
        attention outputs (B, 1, N, H), each query seeing keys 0..its position."""
        if self.prefix is not None and not sliding_window:
            return shared_prefix_attention(q[:, 0], self.kv, positions[:, 0] + 1, self.table,
                                           self.prefix, scale, self.kernel)[:, None]
        return decode_attention(q[:, 0], self.kv, positions[:, 0] + 1, self.table, scale,
                                sliding_window, kernel=self.kernel)[:, None]


def kernel_available() -> bool:
    return jax.default_backend() == "tpu"


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                           scale: float | None = None, sliding_window: int = 0,
                           soft_cap: float | None = None, implementation: str = "auto",
                           block_sizes: tuple[int, int] | None = None):
    """(T, N, H) attention outputs (module docstring); `implementation` auto: the kernel
    on a TPU, else xla. `block_sizes`: the kernel's (kv pages, queries) per block (None:
    JAX's table tuned per TPU generation)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"paged attention implementation {implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    if implementation == "kernel" or (implementation == "auto" and kernel_available()):
        from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

        return rpa.ragged_paged_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=scale,
            sliding_window=sliding_window or None, soft_cap=soft_cap,
            **({} if block_sizes is None else dict(num_kv_pages_per_block=block_sizes[0],
                                                   num_queries_per_block=block_sizes[1])))
    return xla_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                               scale, sliding_window, soft_cap)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap"))
def xla_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                        scale: float, sliding_window: int = 0, soft_cap: float | None = None):
    """The kernel's numbers in plain XLA: each query gathers its sequence's pages (all W
    of them, masked past its position), scores in fp32, softmax, values in their dtype;
    the kernel's own reference (`ref_ragged_paged_attention`) does the same per sequence."""
    T, N, H = q.shape
    _, Z, K2, _ = kv_pages.shape
    K = K2 // 2
    S, W = page_indices.shape
    t = jnp.arange(T)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, S - 1)  # (T,)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + (t - cu_q_lens[seq])  # (T,)
    real = (seq < num_seqs[0]) & (t < cu_q_lens[num_seqs[0]])
    pages = kv_pages[page_indices[seq]]  # (T, W, Z, 2K, H)
    kv = pages.reshape(T, W * Z, K2, H)
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]  # (T, W*Z, K, H) each
    key = jnp.arange(W * Z)[None, :]
    visible = key <= position[:, None]
    if sliding_window:
        visible &= key > position[:, None] - sliding_window
    qg = q.reshape(T, K, N // K, H)
    scores = jnp.einsum("TKGH,TSKH->TKGS", qg, k, preferred_element_type=jnp.float32) * scale
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("TKGS,TSKH->TKGH", probs, v).reshape(T, N, H).astype(q.dtype)
    return jnp.where(real[:, None, None], out, jnp.zeros_like(out))


def decode_attention(q, kv_pages, lengths, page_table, scale: float | None = None,
                     sliding_window: int = 0, implementation: str = "auto",
                     kernel: str = "batched"):
    """One query per sequence (a decode step): q (B, N, H) at position lengths[b] - 1 of
    sequence b, whose keys 0..lengths[b] - 1 its pages hold (its own written before the
    call); (B, N, H). `kernel` batched or batched_vpu: paged_decode_kernel's where a
    kernel runs (a TPU, or INTERPRET) and H <= BATCHED_HEAD_DIM, else JAX's kernel's
    path (rpa: its kernel on a TPU, the same XLA path elsewhere)."""
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {kernel!r} is not one of {DECODE_KERNELS}")
    B = q.shape[0]
    if _kernel_runs(kernel, implementation, q.shape[-1]):
        scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
        return batched_decode_attention(q, kv_pages, lengths, page_table, float(scale),
                                        sliding_window, vpu=kernel == "batched_vpu",
                                        interpret=not kernel_available())
    return ragged_paged_attention(
        q, kv_pages, lengths.astype(jnp.int32), page_table.astype(jnp.int32),
        jnp.arange(B + 1, dtype=jnp.int32), jnp.array([B], jnp.int32), scale,
        sliding_window, implementation=implementation)


def _kernel_runs(kernel: str, implementation: str, head_dim: int) -> bool:
    """Whether decode attends with paged_decode_kernel's kernel (a TPU, or INTERPRET;
    heads of at most BATCHED_HEAD_DIM)."""
    return kernel != "rpa" and implementation != "xla" and head_dim <= BATCHED_HEAD_DIM and (
        implementation == "kernel" or kernel_available() or INTERPRET)


@functools.partial(jax.jit, static_argnames=("scale",))
def xla_decode_attention(q, kv_pages, lengths, page_table, scale: float):
    """`batched_decode_attention(..., lse=True)`'s numbers in XLA: (S, N, H) outputs and
    (S, N) fp32 log-sum-exps of one sequence's N query rows (kv head j's rows j * N / K ..)
    over its keys 0..lengths[s] - 1 (MASK for a sequence with none)."""
    S, N, H = q.shape
    _, Z, K2, _ = kv_pages.shape
    K, W = K2 // 2, page_table.shape[1]
    kv = kv_pages[page_table].reshape(S, W * Z, K2, H)
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]
    visible = jnp.arange(W * Z)[None, :] < lengths[:, None]  # (S, W*Z)
    scores = jnp.einsum("SKGH,SLKH->SKGL", q.reshape(S, K, N // K, H), k,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None], scores, MASK)
    m = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - m)
    total = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("SKGL,SLKH->SKGH", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32) / total
    lse = jnp.where(visible.any(-1)[:, None, None, None], m + jnp.log(total), MASK)
    return out.reshape(S, N, H).astype(q.dtype), lse.reshape(S, N)


def shared_prefix_attention(q, kv_pages, lengths, page_table, prefix: SharedPrefix,
                            scale: float | None = None, kernel: str = "batched",
                            implementation: str = "auto", blocks=None):
    """`decode_attention`'s outputs (B, N, H), a group's shared pages read once: each group
    attends its members' queries over its pages as one sequence whose rows are theirs
    (kv head j's rows together), each sequence its own keys past them (its table from its
    first unshared page), and the two merge by their log-sum-exps (cascade attention).
    At GRPO's 8 completions of a 512-token prompt, 256 tokens each, a step reads the
    prompts' keys once instead of 8 times: 3.3x fewer K/V bytes mid-rollout (8x at its
    first step, 2.4x at its last). The kernel (`kernel` batched or batched_vpu, where it
    runs; `blocks`: its (sequences a block, pages a step[, pages a product]) for both
    calls, None: its defaults) or the XLA path off a TPU."""
    B, N, H = q.shape
    _, Z, K2, _ = kv_pages.shape
    K, W = K2 // 2, page_table.shape[1]
    E, M = prefix.members.shape
    scale = float(1.0 / np.sqrt(H) if scale is None else scale)

    def attend(q, lengths, table):
        lengths, table = lengths.astype(jnp.int32), table.astype(jnp.int32)
        if _kernel_runs(kernel, implementation, H):
            return batched_decode_attention(q, kv_pages, lengths, table, scale,
                                            blocks=blocks, vpu=kernel == "batched_vpu",
                                            interpret=not kernel_available(), lse=True)
        return xla_decode_attention(q, kv_pages, lengths, table, scale)

    def by_head(x):  # (E, M, K, G, ...) -> (E, K * M * G, ...): kv head j's rows together
        x = x.reshape(E, M, K, N // K, *x.shape[3:])
        return jnp.swapaxes(x, 1, 2).reshape(E, K * M * (N // K), *x.shape[4:])

    def by_member(x):  # `by_head`'s inverse: (E, M, N, ...)
        x = x.reshape(E, K, M, N // K, *x.shape[2:])
        return jnp.swapaxes(x, 1, 2).reshape(E, M, N, *x.shape[4:])
    out_g, lse_g = attend(by_head(q[jnp.clip(prefix.members, 0, B - 1)]), prefix.length,
                          prefix.table)
    at = (prefix.group, prefix.member)
    out1, lse1 = by_member(out_g)[at], by_member(lse_g)[at]
    lse1 = jnp.where(prefix.shared[:, None] > 0, lse1, MASK)
    start = (prefix.shared // Z)[:, None]
    own = jnp.take_along_axis(page_table, jnp.minimum(jnp.arange(W)[None] + start, W - 1), 1)
    out2, lse2 = attend(q, lengths - prefix.shared, own)
    lse = jnp.logaddexp(lse1, lse2)
    out = (out1.astype(jnp.float32) * jnp.exp(lse1 - lse)[..., None]
           + out2.astype(jnp.float32) * jnp.exp(lse2 - lse)[..., None])
    return out.astype(q.dtype)
