"""The Gated DeltaNet layer (Qwen3.5, Qwen3-Next): linear attention with a recurrent state.

Per value head the state S (H, U) is a fast-weight memory from keys to values. Each token
decays it, corrects what it predicts for the token's key towards the token's value, and
reads it with the query:

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,    o_t = S_t^T q_t

with q, k L2-normalised (q also times H^-0.5), g = -exp(A_log) * softplus(a + dt_bias) <= 0
and beta = sigmoid(b). Before that, q, k and v pass a causal depthwise conv1d of width W
with SiLU; after, each head's output is RMS-normalised and gated by silu(z), then
projected back to D. This is what transformers' `Qwen3_5GatedDeltaNet` and
`Qwen3NextGatedDeltaNet` compute (`torch_chunk_gated_delta_rule` for prefill,
`torch_recurrent_gated_delta_rule` for a decoded token), with the same parameter names.

Two forms, same numbers: `chunked` (training, prefill) cuts the sequence into chunks of C
and carries S from chunk to chunk in a `lax.scan`, all work inside a chunk being matmuls
(the WY/UT form of DeltaNet, as flash-linear-attention and transformers do it);
`recurrent` (decode) is one scan step per token. The state all serving needs is
`DeltaNetState`: the last W - 1 conv inputs and S in fp32, passed in and returned, so a
prefill followed by decoding continues exactly.

Projections: Qwen3.5 keeps four (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`);
Qwen3-Next fuses them into two (`in_proj_qkvz`, `in_proj_ba`) whose columns are grouped
per key head: [q_k, k_k, v_k, z_k] and [b_k, a_k] with v_k, z_k, b_k, a_k the G value
heads sharing key head k. `fused_projections` picks the layout.

Packed documents and padding (`segment_ids` (B, T): 1, 2, ... per document, 0 padding, as
easylm's packer writes them): a token whose document differs from the previous real
token's starts afresh, both the recurrent state and the conv window, exactly as if the
document were alone in its row. Padding tokens are transparent: their inputs are zeroed
(as transformers zeroes the hidden states under its attention mask, so left padding
equals a fresh start) and they neither decay nor write the state, so a right-padded
prefill hands decoding the state of its last real token. A state passed in continues
the call's first document. Padding is expected at a row's ends; a gap inside a document
would enter its conv window as zeros.

Shape letters: B batch, T positions, D width, K key heads, N value heads (the state's
heads), G = N // K value heads per key head, H key head dim, U value head dim, F conv
channels (2 K H + N U), W conv width, C chunk length, M chunks.
"""

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError
from easylm.models.context_parallel import (
    BATCH_AXES,
    SP,
    from_zigzag,
    piece_table,
    sequence_shards,
    to_zigzag,
)

# The delta rule's products accumulate into a state carried across the whole sequence, so
# they run at full fp32 precision even where a backend would default fp32 matmuls to
# bf16 passes (TPU) or TF32 (GPU); they are small next to the projections.
HIGHEST = jax.lax.Precision.HIGHEST
FORMS = ("auto", "chunked", "recurrent")


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The fields of a transformers Qwen3.5 / Qwen3-Next config this layer reads."""

    hidden_size: int  # D
    linear_num_key_heads: int  # K
    linear_num_value_heads: int  # N
    linear_key_head_dim: int  # H
    linear_value_head_dim: int  # U
    linear_conv_kernel_dim: int = 4  # W
    rms_norm_eps: float = 1e-6
    fused_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a "
                             f"multiple of linear_num_key_heads={self.linear_num_key_heads}")
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim}: the conv "
                             "state holds kernel - 1 >= 1 inputs")

    @property
    def conv_channels(self) -> int:  # F
        c = self
        return (2 * c.linear_num_key_heads * c.linear_key_head_dim
                + c.linear_num_value_heads * c.linear_value_head_dim)


class DeltaNetState(NamedTuple):
    """One Gated DeltaNet layer's serving state: a constant size whatever the length."""

    conv: jax.Array  # (B, W - 1, F) the last conv inputs, compute dtype
    recurrent: jax.Array  # (B, N, H, U) fp32

    @classmethod
    def init(cls, batch: int, config: GatedDeltaNetConfig, dtype=jnp.float32):
        c = config
        return cls(
            conv=jnp.zeros((batch, c.linear_conv_kernel_dim - 1, c.conv_channels), dtype),
            recurrent=jnp.zeros((batch, c.linear_num_value_heads, c.linear_key_head_dim,
                                 c.linear_value_head_dim), jnp.float32))


# ------------------------------------------------------------------ documents


def documents(segment_ids, B: int, T: int):
    """(real (B, T) bool, run (B, T) int32): which tokens are not padding, and a document
    counter that steps at each real token whose document differs from the previous real
    token's. Padding takes its neighbours' run (the previous real token's, or for leading
    padding the first real token's), so it never starts a document itself."""
    if segment_ids is None:
        return jnp.ones((B, T), bool), jnp.zeros((B, T), jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    real = segment_ids > 0
    first = jnp.take_along_axis(segment_ids, jnp.argmax(real, axis=1)[:, None], axis=1)
    last_real = jax.lax.cummax(jnp.where(real, jnp.arange(T), -1), axis=1)
    doc = jnp.where(last_real >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(last_real, 0),
                                                        axis=1), first)
    steps = jnp.concatenate([jnp.zeros((B, 1), bool), doc[:, 1:] != doc[:, :-1]], axis=1)
    return real, jnp.cumsum(steps, axis=1, dtype=jnp.int32)


# ------------------------------------------------------------------ conv


def causal_conv(x, kernel, conv_state, real, run):
    """SiLU(depthwise causal conv) of x (B, T, F) with kernel (W, F), continuing from
    conv_state (B, W - 1, F); a tap reaching into another document reads zero.
    Returns (out (B, T, F) in x's dtype, the new conv state)."""
    W = kernel.shape[0]
    x_all = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # (B, W - 1 + T, F)
    run_all = jnp.concatenate([jnp.repeat(run[:, :1], W - 1, axis=1), run], axis=1)
    return conv_taps(x_all, run_all, run, kernel), next_conv_state(x_all, run_all, real, W)


def conv_taps(x_all, run_all, run, kernel):
    """SiLU(sum_i kernel[i] x_all[t + i]) for x_all (B, W - 1 + T, F), the W - 1 inputs
    before the first token then the T tokens', a tap whose run differs from the token's
    read as zero. Out (B, T, F) in x_all's dtype."""
    W = kernel.shape[0]
    T = run.shape[1]
    out = jnp.zeros((*run.shape, x_all.shape[-1]), jnp.float32)
    for i in range(W):  # W shifted slices, W ~ 4
        same = (run_all[:, i:i + T] == run)[..., None]
        out = out + jnp.where(same, x_all[:, i:i + T], 0).astype(jnp.float32) * kernel[i]
    return nn.silu(out).astype(x_all.dtype)


def next_conv_state(x_all, run_all, real, W: int):
    """The last W - 1 inputs up to the last real token, those of earlier documents zeroed
    (what a fresh start of that document would hold)."""
    B = x_all.shape[0]
    real_all = jnp.concatenate([jnp.ones((B, W - 1), bool), real], axis=1)
    last = jnp.max(jnp.where(real_all, jnp.arange(real_all.shape[1]), 0), axis=1)  # (B,)
    idx = last[:, None] - (W - 2) + jnp.arange(W - 1)  # (B, W - 1)
    window = jnp.take_along_axis(x_all, idx[..., None], axis=1)
    same = jnp.take_along_axis(run_all, idx, axis=1) == jnp.take_along_axis(
        run_all, last[:, None], axis=1)
    return jnp.where(same[..., None], window, 0)


# ------------------------------------------------------------------ the delta rule


def recurrent_rule(q, k, v, g, beta, state, run):
    """The gated delta rule one token at a time. q, k (B, T, N, H) normalised and scaled;
    v (B, T, N, U); g, beta (B, T, N); state (B, N, H, U); all fp32.
    Returns (out (B, T, N, U), final state)."""
    reset = jnp.concatenate([jnp.zeros_like(run[:, :1], bool), run[:, 1:] != run[:, :-1]], 1)

    def step(S, inputs):
        q_t, k_t, v_t, g_t, beta_t, reset_t = inputs
        S = jnp.where(reset_t[:, None, None, None], 0.0, S) * jnp.exp(g_t)[..., None, None]
        predicted = jnp.einsum("BNHU,BNH->BNU", S, k_t, precision=HIGHEST)
        delta = (v_t - predicted) * beta_t[..., None]
        S = S + jnp.einsum("BNH,BNU->BNHU", k_t, delta, precision=HIGHEST)
        return S, jnp.einsum("BNHU,BNH->BNU", S, q_t, precision=HIGHEST)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset)]
    state, out = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(out, 0, 1), state


def to_chunks(x, C: int, mode: str = "constant"):
    """(B, T, ...) -> (M, B, C, ...), T padded to M * C (zeros, or `mode` of jnp.pad)."""
    B, T = x.shape[:2]
    pad = -T % C
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode=mode)
    return jnp.moveaxis(x.reshape(B, (T + pad) // C, C, *x.shape[2:]), 1, 0)


def unit_lower_inverse(a):
    """(I + strictly lower part of a)^-1 for a (..., C, C), by matmuls only: the inverses
    of the diagonal blocks of 1, 2, 4, ... rows, each pair of blocks P, Q joined by
    [[P, 0], [-Q A_21 P, Q]] (recursive triangular inversion, as flash-linear-attention's
    `solve_tril` merges its blocks). Not `lax.linalg.triangular_solve`: on XLA:CPU that is
    a LAPACK call that hands batches to the intra-op thread pool and waits for them, which
    deadlocks once every pool thread runs a device's program (a batch split over 8 CPU
    devices, more than one row each)."""
    C = a.shape[-1]
    size = 1 << max(C - 1, 0).bit_length()  # C padded to a power of two with identity rows
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, size - C)] * 2)
    blocks = jnp.ones((*a.shape[:-2], size, 1, 1), a.dtype)  # (..., blocks, s, s)
    s = 1
    while s < size:
        n = size // (2 * s)
        rows = np.arange(n)[:, None] * 2 * s + s + np.arange(s)  # each pair's lower half
        cols = rows - s
        lower = a[..., rows[:, :, None], cols[:, None, :]]  # (..., n, s, s): A_21 per pair
        P, Q = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        joined = -jnp.matmul(Q, jnp.matmul(lower, P, precision=HIGHEST), precision=HIGHEST)
        blocks = jnp.concatenate([
            jnp.concatenate([P, jnp.zeros_like(P)], axis=-1),
            jnp.concatenate([joined, Q], axis=-1)], axis=-2)  # (..., n, 2s, 2s)
        s *= 2
    return blocks[..., 0, :C, :C]


def chunk_terms(q, k, v, g, beta, run, run_before):
    """Everything about one chunk that does not need the state, for all chunks at once.
    q, k (M, B, C, N, H); v (M, B, C, N, U); g, beta (M, B, C, N); run (M, B, C);
    run_before (M, B) the run of the token before each chunk (whose state enters it)."""
    C = q.shape[2]
    cum = jnp.cumsum(g, axis=2)  # log of the decay from the chunk's start to each token
    # i sees j's write iff j <= i in the same document: the decay between them, else 0.
    same = (run[:, :, :, None] == run[:, :, None, :]) & jnp.tril(jnp.ones((C, C), bool))
    gap = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # (M, B, Ci, Cj, N)
    decay = jnp.exp(jnp.where(same[..., None], gap, -jnp.inf))
    reads = (run == run_before[:, :, None])[..., None]  # tokens the entering state reaches
    run_last = run[:, :, -1:]
    writes = (run == run_last)[..., None]  # tokens whose writes survive to the chunk's end
    k_beta = k * beta[..., None]
    # The UT transform: (I + strictly lower (beta k k^T * decay))^-1 turns C sequential
    # delta-rule updates into matmuls (transformers' torch_chunk_gated_delta_rule).
    system = jnp.einsum("MBINH,MBJNH->MBNIJ", k_beta, k, precision=HIGHEST)
    inverse = unit_lower_inverse(system * jnp.moveaxis(decay, -1, 2))  # (M, B, N, C, C)
    solve = lambda rhs: jnp.einsum("MBNIJ,MBJNX->MBNIX", inverse, rhs, precision=HIGHEST)
    values = solve(v * beta[..., None])  # (M, B, N, C, U)
    k_decayed = solve(k_beta * jnp.where(reads, jnp.exp(cum), 0)[..., None])  # (M, B, N, C, H)
    intra = jnp.einsum("MBINH,MBJNH->MBNIJ", q, k, precision=HIGHEST) * jnp.moveaxis(decay, -1, 2)
    q_decayed = q * jnp.where(reads, jnp.exp(cum), 0)[..., None]
    k_to_end = k * jnp.where(writes, jnp.exp(cum[:, :, -1:] - cum), 0)[..., None]
    carry = jnp.exp(cum[:, :, -1]) * (run_last == run_before[:, :, None])  # (M, B, N)
    return values, k_decayed, intra, q_decayed, k_to_end, carry


def chunked_rule(q, k, v, g, beta, state, run, chunk_size: int):
    """`recurrent_rule`'s result, a chunk of `chunk_size` tokens per scan step."""
    T = q.shape[1]
    # Tokens padded past T neither decay nor write, and stay in the last document.
    q, k, v, g, beta = (to_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    run = to_chunks(run, chunk_size, mode="edge")
    run_before = jnp.concatenate([run[:1, :, 0], run[:-1, :, -1]], axis=0)  # (M, B)
    terms = chunk_terms(q, k, v, g, beta, run, run_before)

    def step(S, chunk):
        values, k_decayed, intra, q_decayed, k_to_end, carry = chunk
        v_new = values - jnp.einsum("BNCH,BNHU->BNCU", k_decayed, S, precision=HIGHEST)
        out = (jnp.einsum("BCNH,BNHU->BCNU", q_decayed, S, precision=HIGHEST)
               + jnp.einsum("BNIJ,BNJU->BINU", intra, v_new, precision=HIGHEST))
        S = (S * carry[..., None, None]
             + jnp.einsum("BCNH,BNCU->BNHU", k_to_end, v_new, precision=HIGHEST))
        return S, out

    state, out = jax.lax.scan(step, state, terms)  # out (M, B, C, N, U)
    M, B, C, N, U = out.shape
    out = jnp.moveaxis(out, 0, 1).reshape(B, M * C, N, U)[:, :T]
    return out, state


def delta_rule(q, k, v, g, beta, state, run, recurrent: bool, chunk_size: int):
    """L2-normalise q, k (B, T, K, H) and share each key head with its G value heads,
    scale q by H^-0.5, and run the rule in fp32 over v (B, T, N, U), g, beta (B, T, N)."""
    q, k = normalised(q, k, v.shape[2])
    args = (q, k, v.astype(jnp.float32), g, beta, state, run)
    return recurrent_rule(*args) if recurrent else chunked_rule(*args, chunk_size)


def normalised(q, k, N: int):
    """q, k (B, T, K, H) L2-normalised in fp32 (transformers' (flash-linear-attention's)
    eps inside the square root), each key head repeated for its N // K value heads, q
    times H^-0.5."""
    def l2norm(x):
        x = x.astype(jnp.float32)
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    G = N // k.shape[2]
    q, k = (jnp.repeat(l2norm(x), G, axis=2) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k


# ------------------------------------------------------------------ the sequence split over 'sp'
#
# Under a mesh with sp > 1 a row is cut into 2 sp pieces of L = T / (2 sp) places, each
# device holding two (`context_parallel.piece_table`: zig-zag i and 2 sp - 1 - i, or 2i and
# 2i + 1 in the row's order). Per piece the rule is affine in the state entering it,
# S_out = M S_in + C and out = out_0 + R S_in (M (H, H), R (L, H) per value head), and
# per column of S: one pass of the rule over v with H zero columns appended, from the
# state [0 | I], gives [C | M] as its final state and [out_0 | R] as its output. The
# devices all-gather every piece's (M, C), compose them in the row's order (each
# device alike: 2 sp - 1 small matmuls) for the state entering each of its pieces, and add
# R S_in. The conv reads the last W - 1 inputs of the piece before (an all-gather of
# every piece's). Documents restart across pieces as inside one: the document counter is
# the whole row's (`split_documents`), and a piece whose first token's differs from the
# last token's of the piece before enters from zeros.


def split_documents(segment_ids, B: int, T: int, order: str):
    """`documents` of rows whose places are in `order` (`zigzag` or `rows`), split over sp:
    computed over each row in its own order, returned in the given one."""
    sp = sequence_shards()
    if segment_ids is None or order != "zigzag":
        return documents(segment_ids, B, T)
    return to_zigzag(documents(from_zigzag(jnp.asarray(segment_ids), sp), B, T), sp)


def _pieces(x):
    """A device's (b, 2 L, ...) -> (2 b, L, ...): its two pieces stacked on the batch."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, 2, t // 2, *x.shape[2:]), 1, 0).reshape(
        2 * b, t // 2, *x.shape[2:])


def _unpieces(x):
    """The inverse of `_pieces`."""
    b, L = x.shape[0] // 2, x.shape[1]
    return jnp.moveaxis(x.reshape(2, b, *x.shape[1:]), 0, 1).reshape(b, 2 * L, *x.shape[2:])


def _gathered_in_row_order(tree, order: str):
    """Each device's (2 b, ...) per piece, all-gathered over sp -> (2 sp, b, ...): every
    piece of the row, first to last."""
    sp = jax.lax.axis_size(SP)
    where = np.argsort(piece_table(sp, order).ravel())  # device * 2 + slot of each piece

    def arrange(x):  # (sp, 2 b, ...) -> (2 sp, b, ...)
        return x.reshape(2 * sp, x.shape[1] // 2, *x.shape[2:])[where]
    return jax.tree.map(arrange, jax.lax.all_gather(tree, SP))


def _mine(x, order: str):
    """(2 sp, b, ...) per piece of the row -> (2 b, ...) this device's two, stacked."""
    table = jnp.asarray(piece_table(jax.lax.axis_size(SP), order))
    x = jnp.take(x, table[jax.lax.axis_index(SP)], axis=0)
    return x.reshape(-1, *x.shape[2:])


def _split_call(local, args, specs, out_spec):
    """`local` under shard_map over the current mesh: the batch of every (B, T, ...) array
    over the batch axes, T over sp; heads whole."""
    names = jax.sharding.get_abstract_mesh().axis_names
    batch = tuple(a for a in BATCH_AXES if a in names) or None

    def spec(ndim):
        return P() if ndim is None else P(batch, SP, *(None,) * (ndim - 2))
    return jax.shard_map(local, in_specs=tuple(spec(n) for n in specs),
                         out_specs=spec(out_spec))(*args)


def check_split(T: int, width: int):
    """A UserError unless each of the 2 sp pieces of a row of T holds the conv's W - 1."""
    sp = sequence_shards()
    if T // (2 * sp) < width - 1:
        raise UserError(f"Gated DeltaNet under sp={sp}: rows of {T} tokens cut into "
                        f"{2 * sp} pieces of {T // (2 * sp)}, shorter than the conv's "
                        f"{width - 1} inputs of the piece before (linear_conv_kernel_dim="
                        f"{width}); give longer rows or a smaller sp")


def split_causal_conv(x, kernel, run, order: str):
    """`causal_conv`'s output for x (B, T, F), run (B, T) split over sp in `order`: each
    piece reads the last W - 1 inputs (and runs) of the piece before it in the row."""
    W = kernel.shape[0]

    def local(x, run, kernel):
        xs, runs = _pieces(x), _pieces(run)  # (2 b, L, F), (2 b, L)
        tails = _gathered_in_row_order((xs[:, -(W - 1):], runs[:, -(W - 1):]), order)
        # The piece before each: none before the first (zeros, in no document).
        before_x, before_run = (jnp.concatenate([jnp.full_like(t[:1], fill), t[:-1]])
                                for t, fill in zip(tails, (0, -1)))
        x_all = jnp.concatenate([_mine(before_x, order), xs], axis=1)
        run_all = jnp.concatenate([_mine(before_run, order), runs], axis=1)
        return _unpieces(conv_taps(x_all, run_all, runs, kernel))

    return _split_call(local, (x, run, kernel), (3, 2, None), 3)


def split_delta_rule(q, k, v, g, beta, run, order: str, recurrent: bool, chunk_size: int):
    """`delta_rule`'s output from zeros for q, k (B, T, K, H), v (B, T, N, U), g, beta, run
    (B, T, ...) split over sp in `order`."""
    N, H, U = v.shape[2], q.shape[3], v.shape[3]
    q, k = normalised(q, k, N)

    def local(q, k, v, g, beta, run):
        q, k, g, beta, run = (_pieces(x) for x in (q, k, g, beta, run))
        v = _pieces(v.astype(jnp.float32))
        b2 = v.shape[0]
        v = jnp.concatenate([v, jnp.zeros((*v.shape[:3], H), v.dtype)], axis=-1)
        start = jnp.concatenate([jnp.zeros((b2, N, H, U)),
                                 jnp.broadcast_to(jnp.eye(H), (b2, N, H, H))], axis=-1)
        # The scan's carry varies over the mesh axes as the pieces do.
        start = jax.lax.pcast(start, tuple(jax.typeof(v).manual_axis_type.varying),
                              to="varying")
        args = (q, k, v, g, beta, start, run)
        out, final = recurrent_rule(*args) if recurrent else chunked_rule(*args, chunk_size)
        M, C = final[..., U:], final[..., :U]  # (2 b, N, H, H), (2 b, N, H, U)
        M, C, first, last = _gathered_in_row_order((M, C, run[:, 0], run[:, -1]), order)
        S, entering = jnp.zeros(C.shape[1:]), []
        for p in range(M.shape[0]):  # the state entering each piece, in the row's order
            if p:
                same = (first[p] == last[p - 1])[:, None, None, None]
                S = jnp.where(same, jnp.einsum("BNHJ,BNJU->BNHU", M[p - 1], S,
                                               precision=HIGHEST) + C[p - 1], 0.0)
            entering.append(S)
        entering = _mine(jnp.stack(entering), order)  # (2 b, N, H, U)
        out = out[..., :U] + jnp.einsum("BLNH,BNHU->BLNU", out[..., U:], entering,
                                        precision=HIGHEST)
        return _unpieces(out)

    return _split_call(local, (q, k, v, g, beta, run), (4, 4, 4, 3, 3, 2), 4)


# ------------------------------------------------------------------ the layer


class CausalConv(nn.Module):
    """The depthwise conv's kernel (W, F) (transformers' conv1d.weight (F, 1, W), squeezed
    and transposed), applied by `causal_conv`."""

    width: int
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, conv_state, real, run, order: str | None = None):
        F = x.shape[-1]
        kernel = self.param("kernel", conv_init, (self.width, F), self.param_dtype)
        if order is not None:  # the sequence split over sp: no state in or out
            return split_causal_conv(x, kernel.astype(jnp.float32), run, order), None
        return causal_conv(x, kernel.astype(jnp.float32), conv_state, real, run)


class GatedRMSNorm(nn.Module):
    """transformers' RMSNormGated: w * x / rms(x), cast to the compute dtype, times silu(z)
    in fp32, cast back. Its weight is used as is (no 1 + w)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, z):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        x = weight.astype(self.dtype) * x32.astype(self.dtype)
        return (x.astype(jnp.float32) * nn.silu(z.astype(jnp.float32))).astype(self.dtype)


class GatedDeltaNet(nn.Module):
    """x (B, T, D) -> (out (B, T, D), the new `DeltaNetState`).

    `state` None starts from zeros; `segment_ids` (B, T) marks documents and padding (see
    the module docstring). `form`: `chunked`, `recurrent`, or `auto` (recurrent for a
    single token, chunked otherwise). `order` (`zigzag` or `rows`, the places' order):
    T is split over the mesh's 'sp' (training, scoring; see "the sequence split over
    'sp'"), no state passed in, None returned for it."""

    config: GatedDeltaNetConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    form: str = "auto"
    chunk_size: int = 64

    @nn.compact
    def __call__(self, x, state: DeltaNetState | None = None, segment_ids=None,
                 order: str | None = None):
        c = self.config
        if self.form not in FORMS:
            raise ValueError(f"form {self.form!r}; expected one of {', '.join(FORMS)}")
        B, T, _ = x.shape
        K, N = c.linear_num_key_heads, c.linear_num_value_heads
        H, U = c.linear_key_head_dim, c.linear_value_head_dim
        if order is not None:
            if state is not None:
                raise ValueError("a state passed in with the sequence split over sp")
            check_split(T, c.linear_conv_kernel_dim)
            real, run = split_documents(segment_ids, B, T, order)
        else:
            if state is None:
                state = DeltaNetState.init(B, c, self.dtype)
            real, run = documents(segment_ids, B, T)
        x = jnp.where(real[..., None], x, 0).astype(self.dtype)
        qkv, z, b, a = self.project(x)  # (B, T, F), (B, T, N, U), (B, T, N), (B, T, N)
        qkv, conv_state = CausalConv(c.linear_conv_kernel_dim, self.param_dtype,
                                     name="conv1d")(qkv, state and state.conv, real, run,
                                                    order)
        q, k, v = jnp.split(qkv, [K * H, 2 * K * H], axis=-1)
        q, k, v = q.reshape(B, T, K, H), k.reshape(B, T, K, H), v.reshape(B, T, N, U)

        A_log = self.param("A_log", a_log_init, (N,), self.param_dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (N,), self.param_dtype)
        g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        # Padding neither decays nor writes the state.
        g, beta = jnp.where(real[..., None], g, 0.0), jnp.where(real[..., None], beta, 0.0)
        recurrent = self.form == "recurrent" or (self.form == "auto" and T == 1)
        if order is not None:
            out = split_delta_rule(q, k, v, g, beta, run, order, recurrent, self.chunk_size)
        else:
            out, recurrent_state = delta_rule(q, k, v, g, beta, state.recurrent, run,
                                              recurrent, self.chunk_size)  # (B, T, N, U) fp32
        out = GatedRMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype, name="norm")(
            out.astype(self.dtype), z)
        out = self.dense(c.hidden_size, "out_proj")(out.reshape(B, T, N * U))
        if order is not None:
            return out, None
        return out, DeltaNetState(conv_state.astype(state.conv.dtype), recurrent_state)

    def dense(self, features, name):
        return nn.Dense(features, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.config.initializer_range),
                        name=name)

    def project(self, x):
        """(qkv (B, T, F) with columns [q | k | v], z (B, T, N, U), b, a (B, T, N))."""
        c = self.config
        B, T, _ = x.shape
        K, N = c.linear_num_key_heads, c.linear_num_value_heads
        H, U, G = c.linear_key_head_dim, c.linear_value_head_dim, N // K
        if not c.fused_projections:
            return (self.dense(2 * K * H + N * U, "in_proj_qkv")(x),
                    self.dense(N * U, "in_proj_z")(x).reshape(B, T, N, U),
                    self.dense(N, "in_proj_b")(x), self.dense(N, "in_proj_a")(x))
        qkvz = self.dense(2 * K * H + 2 * N * U, "in_proj_qkvz")(x).reshape(B, T, K, -1)
        q, k, v, z = jnp.split(qkvz, np.cumsum([H, H, G * U]), axis=-1)  # per key head
        ba = self.dense(2 * N, "in_proj_ba")(x).reshape(B, T, K, 2 * G)
        b, a = ba[..., :G].reshape(B, T, N), ba[..., G:].reshape(B, T, N)
        qkv = jnp.concatenate([q.reshape(B, T, K * H), k.reshape(B, T, K * H),
                               v.reshape(B, T, N * U)], axis=-1)
        return qkv, z.reshape(B, T, N, U), b, a


def conv_init(key, shape, dtype):
    """torch's Conv1d default: uniform within 1/sqrt(fan-in), the fan-in W per channel."""
    bound = 1.0 / np.sqrt(shape[0])
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def a_log_init(key, shape, dtype):
    """transformers' A_log: log of A ~ uniform(0.01, 16) (kept away from 0)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)
