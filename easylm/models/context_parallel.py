"""Context parallelism: attention with the sequence split over the mesh axis 'sp'.

Each of the sp devices holds T/sp places of every row, consecutive in the order the row
is given (its queries and its keys/values); batch rows are split over the batch axes (dp, fsdp, ep), heads over mp.
Two strategies compute the same numbers as `attention.xla_attention` under a segment mask:

    ring        K/V blocks (with their positions and segment ids) go round the sp devices
                with `ppermute`, sp - 1 hops; each device folds every block into an
                online softmax (running max, denominator and output in fp32). The backward
                pass is a second ring (`custom_vjp`): the blocks go round again with their
                gradients, which arrive home after sp hops. A device holds a few K/V
                blocks of T/sp places and scores of (T/sp/parts)^2, never the whole K/V.
    all_gather  K/V, positions and segment ids gathered over sp (per layer), then
                ordinary masked attention (`attention.attention`) for the local queries:
                one collective, (T/sp) x T scores per device.

Which keys a query sees is decided from positions and segment ids only, never from where a
token sits: key s is visible from query t iff seg[s] == seg[t], pos[s] <= pos[t] and, with
a window W, pos[s] > pos[t] - W. Packed rows restart positions at each document
(data/packing.py), so inside a document this is the causal mask, and across documents
nothing is visible. This needs what packing gives: each document of a row its own
segment id (padding, id 0, sees only padding) and positions increasing inside a
document. The sequence can therefore be put in any order; `to_zigzag` puts it in
the order that gives every device equal causal work (device i holds chunks i and 2sp-1-i
of 2sp), and `from_zigzag` undoes it. Positions, segment ids, targets and loss masks are
permuted with the tokens; a per-token loss summed over the row does not care about order.

The ring skips (with `lax.cond`) any pair of sub-blocks in which no query sees a key, so
under zig-zag order each device runs the same number of block products
(`block_work` counts them); rows with no visible key in a block add nothing (their
probabilities are set to exactly 0, never exp of a huge negative difference).

A model's attention layer calls it with its rotated q, k and v, and the batch's positions
and segment ids (which, unlike a (B, T, T) mask, split over 'sp' like the tokens):

    out = context_parallel_attention(q, k, v, positions, segment_ids, strategy="ring",
                                     window=config.sliding_window, scale=scale)

Shape letters as in attention.py: B batch, T query places, S key places, N query heads,
K key/value heads, G = N // K, H head dim; lower-case b, t, s for a device's local share.
"""

import contextlib
import contextvars
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError
from easylm.models.attention import attention, sliding_window_mask

SP = "sp"
BATCH_AXES = ("dp", "fsdp", "ep")  # the batch dimension is split over all three
HEADS = "mp"
STRATEGIES = ("ring", "all_gather")
# The default: the ring holds (T/sp/2)^2 scores per block pair where all_gather holds
# (T/sp) x T, so it is the one that fits the longest rows (the table in docs/long_context.md).
DEFAULT_STRATEGY = "ring"
_NEG = jnp.finfo(jnp.float32).min


# ------------------------------------------------------------------ order of the sequence


def zigzag_permutation(T: int, sp: int) -> np.ndarray:
    """(T,) source index of each place in zig-zag order: the row cut into 2*sp chunks,
    device i holding chunks i and 2*sp-1-i, so an early (cheap) and a late (expensive)
    causal chunk."""
    if T % (2 * sp):
        raise ValueError(f"zig-zag order needs the sequence length {T} to be a multiple "
                         f"of 2*sp = {2 * sp}")
    chunks = np.arange(T).reshape(2 * sp, T // (2 * sp))
    return np.concatenate([chunks[[i, 2 * sp - 1 - i]].ravel() for i in range(sp)])


def to_zigzag(tree, sp: int):
    """Every array of `tree` (tokens, positions, segment ids, targets, masks: (B, T, ...))
    put in zig-zag order along T."""
    def permute(x):
        return x[:, zigzag_permutation(x.shape[1], sp)]
    return jax.tree_util.tree_map(permute, tree)


def from_zigzag(tree, sp: int):
    """The inverse of `to_zigzag`: arrays back in the row's own order."""
    def unpermute(x):
        return x[:, np.argsort(zigzag_permutation(x.shape[1], sp))]
    return jax.tree_util.tree_map(unpermute, tree)


# ------------------------------------------------------------------ masks and block work


def visible(q_positions, q_segments, k_positions, k_segments, window: int = 0):
    """(b, t) and (b, s) positions and segment ids -> (b, t, s) bool: the key is in the
    query's document, not after it, and (window > 0) among its last `window` positions."""
    mask = k_segments[:, None, :] == q_segments[:, :, None]
    mask &= k_positions[:, None, :] <= q_positions[:, :, None]
    if window:
        mask &= sliding_window_mask(q_positions, k_positions, window)
    return mask


def block_work(positions, segment_ids, sp: int, parts: int = 2, window: int = 0) -> np.ndarray:
    """(sp,) how many (query sub-block, key sub-block) products each device runs in the
    ring: pairs with at least one visible key, summed over rows. positions, segment_ids
    (B, T) in the order the devices hold them; each device's T/sp places are cut into
    `parts` sub-blocks, as `ring_attention` cuts them."""
    B, T = positions.shape
    blocks = sp * parts
    mask = np.asarray(visible(positions, segment_ids, positions, segment_ids, window))
    pairs = mask.reshape(B, blocks, T // blocks, blocks, T // blocks).any(axis=(2, 4))
    return pairs.sum(axis=(0, 2)).reshape(sp, parts).sum(axis=1)


# ------------------------------------------------------------------ the ring


class _Keys(NamedTuple):
    """A block of keys and values and where they are: k, v (b, s, K, H); positions,
    segments (b, s)."""
    k: jax.Array
    v: jax.Array
    positions: jax.Array
    segments: jax.Array


def _split(tree, parts: int):
    """A tree of (b, t, ...) arrays -> `parts` trees of (b, t/parts, ...)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    pieces = [jnp.split(x, parts, axis=1) for x in leaves]
    return [treedef.unflatten([p[i] for p in pieces]) for i in range(parts)]


def _concat(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=1), *trees)


def _scores(q, keys: _Keys, mask):
    """q (b, t, K, G, H), already scaled -> fp32 scores (b, t, K, G, s), masked ones at
    the fp32 minimum."""
    s = jnp.einsum("BTKGH,BSKH->BTKGS", q, keys.k, preferred_element_type=jnp.float32)
    return jnp.where(mask[:, :, None, None, :], s, _NEG)


def _pass_on(tree, sp: int):
    """Each device's blocks to the next device of the ring."""
    return jax.lax.ppermute(tree, SP, [(i, (i + 1) % sp) for i in range(sp)])


def _over_pairs(update, carry_q, carry_k, queries, keys, window):
    """Apply `update(q_i, k_j, mask, acc_q_i, acc_k_j) -> (acc_q_i, acc_k_j)` to every
    pair of query and key sub-blocks in which some query sees some key."""
    carry_q, carry_k = list(carry_q), list(carry_k)
    for i, q in enumerate(queries):
        for j, k in enumerate(keys):
            mask = visible(q["positions"], q["segments"], k.positions, k.segments, window)
            carry_q[i], carry_k[j] = jax.lax.cond(
                jnp.any(mask), partial(update, q, k, mask), lambda a, b: (a, b),
                carry_q[i], carry_k[j])
    return carry_q, carry_k


def _forward_update(q, keys, mask, state, unused):
    """Fold one key block into one query block's online softmax: state (m, l, acc) with
    m, l (b, t, K, G) the running max and denominator, acc (b, t, K, G, H), all fp32."""
    m, l, acc = state
    s = _scores(q["q"], keys, mask)
    m_new = jnp.maximum(m, s.max(axis=-1))
    # exp(s - m_new) is exactly 0 for a masked key only if m_new is a real score; a row
    # with no visible key yet has m_new at the minimum, so the mask zeroes it explicitly.
    p = jnp.where(mask[:, :, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1)
    pv = jnp.einsum("BTKGS,BSKH->BTKGH", p.astype(keys.v.dtype), keys.v,
                    preferred_element_type=jnp.float32)
    return (m_new, l, acc * correction[..., None] + pv), unused


def _ring_forward(q, keys: _Keys, sp: int, parts: int, window: int):
    """q (b, t, K, G, H) scaled -> (out (b, t, K, G, H) fp32, log-sum-exp (b, t, K, G))."""
    queries = _split({"q": q, "positions": keys.positions, "segments": keys.segments}, parts)
    b, t, K, G, H = q.shape
    tp = t // parts
    states = [(jnp.full((b, tp, K, G), _NEG), jnp.zeros((b, tp, K, G)),
               jnp.zeros((b, tp, K, G, H))) for _ in range(parts)]
    nothing = [None] * parts

    def fold(states, keys):
        return _over_pairs(_forward_update, states, nothing, queries, _split(keys, parts),
                           window)[0]

    def hop(carry, _):
        states, keys = carry
        # The next block is sent before this one is folded in: independent, so the
        # transfer can overlap the block's compute.
        return (fold(states, keys), _pass_on(keys, sp)), None

    (states, keys), _ = jax.lax.scan(hop, (states, keys), length=sp - 1)
    m, l, acc = _concat(fold(states, keys))
    # Every query sees at least itself; l = 0 only for a row fed no visible key at all
    # (its output is 0 where a plain softmax would average every value).
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out, m + jnp.log(jnp.where(l > 0, l, 1.0))


def _backward_update(q, keys, mask, dq, dkv):
    """One block pair's share of the gradients (flash attention's backward): p from the
    saved log-sum-exp, dS = P * (dP - rowsum(dO * O))."""
    dk, dv = dkv
    s = _scores(q["q"], keys, mask)
    p = jnp.where(mask[:, :, None, None, :], jnp.exp(s - q["lse"][..., None]), 0.0)
    dout = q["dout"]
    dv = dv + jnp.einsum("BTKGS,BTKGH->BSKH", p.astype(dout.dtype), dout,
                         preferred_element_type=jnp.float32)
    dp = jnp.einsum("BTKGH,BSKH->BTKGS", dout, keys.v, preferred_element_type=jnp.float32)
    ds = p * (dp - q["delta"][..., None])
    dq = dq + jnp.einsum("BTKGS,BSKH->BTKGH", ds.astype(keys.k.dtype), keys.k,
                         preferred_element_type=jnp.float32)
    dk = dk + jnp.einsum("BTKGS,BTKGH->BSKH", ds.astype(q["q"].dtype), q["q"],
                         preferred_element_type=jnp.float32)
    return dq, (dk, dv)


def _ring_backward(q, keys: _Keys, out, lse, dout, sp: int, parts: int, window: int):
    """Gradients (fp32) w.r.t. the scaled q (b, t, K, G, H) and the local k, v."""
    delta = jnp.einsum("BTKGH,BTKGH->BTKG", dout, out, preferred_element_type=jnp.float32)
    queries = _split({"q": q, "positions": keys.positions, "segments": keys.segments,
                      "lse": lse, "dout": dout, "delta": delta}, parts)
    dqs = [jnp.zeros(x["q"].shape, jnp.float32) for x in queries]
    dkv = (jnp.zeros(keys.k.shape, jnp.float32), jnp.zeros(keys.v.shape, jnp.float32))

    def fold(dqs, keys, dkv):
        dqs, dkvs = _over_pairs(_backward_update, dqs, _split(dkv, parts), queries,
                                _split(keys, parts), window)
        return dqs, _concat(dkvs)

    def hop(carry, _):
        dqs, keys, dkv = carry
        dqs, dkv = fold(dqs, keys, dkv)
        # A block's gradient travels with it; the block itself can leave before the fold.
        return (dqs, _pass_on(keys, sp), _pass_on(dkv, sp)), None

    (dqs, keys, dkv), _ = jax.lax.scan(hop, (dqs, keys, dkv), length=sp - 1)
    dqs, dkv = fold(dqs, keys, dkv)
    dk, dv = _pass_on(dkv, sp)  # the last hop brings every block's gradient home
    return jnp.concatenate(dqs, axis=1), dk, dv


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, positions, segments, sp, parts, window):
    out, _ = _ring_forward(q, _Keys(k, v, positions, segments), sp, parts, window)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, positions, segments, sp, parts, window):
    out, lse = _ring_forward(q, _Keys(k, v, positions, segments), sp, parts, window)
    out = out.astype(q.dtype)  # kept as returned: rowsum(dO * O) is of what the caller saw
    return out, (q, k, v, positions, segments, out, lse)


def _ring_bwd(sp, parts, window, residuals, dout):
    q, k, v, positions, segments, out, lse = residuals
    dq, dk, dv = _ring_backward(q, _Keys(k, v, positions, segments), out, lse, dout,
                                sp, parts, window)
    zero = np.zeros(positions.shape, jax.dtypes.float0)  # integer inputs: no gradient
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero, zero


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, positions, segment_ids, window: int = 0,
                   scale: float | None = None, parts: int = 2):
    """Inside `shard_map` over 'sp': the local queries q (b, t, N, H) against every
    device's keys, k, v (b, t, K, H) local, positions and segment ids (b, t) local.
    Each device's t places are cut into `parts` sub-blocks, the unit of skipped work."""
    b, t, N, H = q.shape
    K = k.shape[2]
    if t % parts:
        raise ValueError(f"the local sequence length {t} must be a multiple of parts={parts}")
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    q = (q * jnp.asarray(scale, q.dtype)).reshape(b, t, K, N // K, H)
    sp = jax.lax.axis_size(SP)
    out = _ring(q, k, v, positions, segment_ids, sp, parts, window)
    return out.reshape(b, t, N, H)


def all_gather_attention(q, k, v, positions, segment_ids, window: int = 0,
                         scale: float | None = None, implementation: str = "auto"):
    """Inside `shard_map` over 'sp': local queries against the K/V of the whole sequence,
    gathered here (the gradient of the gather is a reduce-scatter back to the owners)."""
    gather = partial(jax.lax.all_gather, axis_name=SP, axis=1, tiled=True)
    mask = visible(positions, segment_ids, gather(positions), gather(segment_ids), window)
    return attention(q, gather(k), gather(v), mask, implementation, scale=scale)


# ------------------------------------------------------------------ from a model


def context_parallel_attention(q, k, v, positions, segment_ids=None, *, strategy: str = "ring",
                               window: int = 0, scale: float | None = None, mesh=None,
                               parts: int = 2):
    """Attention over sequences split on 'sp'. q (B, T, N, H), k, v (B, T, K, H),
    positions and segment_ids (B, T) (None: one document), all global arrays whose T is
    split over 'sp', B over the mesh's batch axes and heads over 'mp'. Returns the
    attention output (B, T, N, H) split the same way. `mesh`: the current mesh if None.
    The places may be in any order (zig-zag for balance) as long as positions say where
    each token is."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context parallel strategy {strategy!r}; expected one of "
                         f"{', '.join(STRATEGIES)}")
    names = (mesh or jax.sharding.get_abstract_mesh()).axis_names
    if SP not in names:
        raise ValueError(f"context parallel attention needs a mesh axis {SP!r}; the mesh "
                         f"has {names}")
    if segment_ids is None:
        segment_ids = jnp.zeros(positions.shape, jnp.int32)
    batch = tuple(a for a in BATCH_AXES if a in names) or None
    heads = HEADS if HEADS in names else None
    heads_spec, place_spec = P(batch, SP, heads, None), P(batch, SP)
    if strategy == "ring":
        local = partial(ring_attention, window=window, scale=scale, parts=parts)
    else:
        local = partial(all_gather_attention, window=window, scale=scale)
    # check_vma off: the ring's custom_vjp builds its own collectives, which the
    # varying-axes checker cannot see through.
    return jax.shard_map(local, mesh=mesh, check_vma=False,
                         in_specs=(heads_spec,) * 3 + (place_spec,) * 2,
                         out_specs=heads_spec)(q, k, v, positions, segment_ids)


# ------------------------------------------------------------------ in the decoder


_strategy = contextvars.ContextVar("context_parallel_strategy", default=DEFAULT_STRATEGY)


@contextlib.contextmanager
def use_strategy(strategy: str):
    """The strategy a decoder traced inside this block uses under a mesh with sp > 1
    (`--context_parallel`; the trainer wraps its loss in it)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context parallel strategy {strategy!r}; expected one of "
                         f"{', '.join(STRATEGIES)}")
    token = _strategy.set(strategy)
    try:
        yield
    finally:
        _strategy.reset(token)


_whole_rows = contextvars.ContextVar("allow_whole_rows", default=False)


@contextlib.contextmanager
def allow_whole_rows():
    """Rows that do not split over 'sp' run attention over whole rows inside this block
    (traced in it): for a caller that scores texts of any length on a training mesh (the
    engine of an in-training evaluation), where refusing would stop the run."""
    token = _whole_rows.set(True)
    try:
        yield
    finally:
        _whole_rows.reset(token)


ORDERS = ("zigzag", "rows")
_order = contextvars.ContextVar("sequence_order", default="zigzag")


@contextlib.contextmanager
def use_order(order: str):
    """The order the places of a row are in for a decoder traced inside this block under a
    mesh with sp > 1: `zigzag` (`to_zigzag`, what the trainer gives and the default) or
    `rows` (the row's own order). Attention does not care (it reads positions); a layer
    that carries state along the row (Gated DeltaNet) does."""
    if order not in ORDERS:
        raise ValueError(f"sequence order {order!r}; expected one of {', '.join(ORDERS)}")
    token = _order.set(order)
    try:
        yield
    finally:
        _order.reset(token)


def piece_table(sp: int, order: str) -> np.ndarray:
    """(sp, 2): the row's pieces (its 2*sp equal parts, 0 first) each device holds, in the
    order it holds them: zig-zag i and 2*sp-1-i, in row order 2i and 2i+1."""
    i = np.arange(sp)
    if order == "zigzag":
        return np.stack([i, 2 * sp - 1 - i], axis=1)
    return np.stack([2 * i, 2 * i + 1], axis=1)


def current_strategy() -> str:
    """The strategy `use_strategy` set (the default outside one)."""
    return _strategy.get()


def sequence_shards() -> int:
    """How many ways the current mesh splits the sequence (1: no mesh, or no 'sp')."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or SP not in mesh.axis_names else mesh.shape[SP]


@struct.dataclass
class SplitSequence:
    """What a decoder layer gets in place of a (B, T, S) mask when the sequence is split
    over 'sp': the segment ids (B, T) (None: one document per row), split like the tokens,
    and the strategy; its attention then calls `context_parallel_attention`."""

    segment_ids: Any
    strategy: str = struct.field(pytree_node=False, default=DEFAULT_STRATEGY)
    order: str = struct.field(pytree_node=False, default="zigzag")  # of the places: ORDERS

    @classmethod
    def if_split(cls, positions, segment_ids, cache):
        """One under a mesh with sp > 1 and no cache (training, scoring), else None:
        attention over whole rows. Rows that do not split over the mesh are a UserError
        (whole rows would give the right numbers but none of the memory sp is there to
        save), unless the caller said it takes any length (`allow_whole_rows`)."""
        sp = sequence_shards()
        if cache is not None or sp == 1:
            return None
        mesh = jax.sharding.get_abstract_mesh()
        batch = int(np.prod([mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names]))
        B, T = positions.shape
        if B % batch or T % (2 * sp):
            if _whole_rows.get():
                return None
            raise UserError(f"a forward of {B} rows of {T} tokens under a mesh with sp={sp} "
                            f"needs T a multiple of 2*sp = {2 * sp} and B of the batch axes' "
                            f"{batch} (pad the rows, or run without sp)")
        return cls(segment_ids, current_strategy(), _order.get())

    def attention(self, q, k, v, positions, window: int, scale: float | None):
        return context_parallel_attention(q, k, v, positions, self.segment_ids,
                                          strategy=self.strategy, window=window, scale=scale)
