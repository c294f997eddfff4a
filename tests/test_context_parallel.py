"""Context parallel attention (easylm/models/context_parallel.py) against single-device
attention: the xla path of easylm/models/attention.py under the segment mask, in float64.

Meshes have the five named axes (dp, fsdp, sp, ep, mp); batch rows go over dp/fsdp/ep,
heads over mp, the sequence over sp. Every row pair is one packing of many short documents
(and padding) and one document that crosses every shard boundary.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from easylm.data.packing import segment_positions
from easylm.models import context_parallel as cp
from easylm.models.attention import segment_mask, sliding_window_mask, xla_attention

AXES = ("dp", "fsdp", "sp", "ep", "mp")
B, T, N, K, H = 2, 32, 4, 2, 8  # GQA: two query heads per key/value head
WINDOW = 5
EPS32 = float(np.finfo(np.float32).eps)
# sp -> the other axes of its 8-device mesh: batch split over fsdp or ep, heads over mp.
OTHER_AXES = {2: {"fsdp": 2, "mp": 2}, 4: {"ep": 2}, 8: {}}


def make_mesh(sp):
    sizes = {"dp": 1, "fsdp": 1, "sp": sp, "ep": 1, "mp": 1} | OTHER_AXES[sp]
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * 5)


def packed_rows(seed=0):
    """segment ids and positions (B, T): row 0 many short documents then padding (id 0);
    row 1 a 3-token document, then one document over the rest, across every boundary."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 6, size=T)
    ends = np.cumsum(lengths)
    ids = np.searchsorted(ends, np.arange(T), side="right") + 1
    ids[T - 2:] = 0  # padding at the end, as packing pads a finite stream's last row
    long_doc = np.where(np.arange(T) < 3, 1, 2)
    segments = np.stack([ids, long_doc]).astype(np.int32)
    return segments, segment_positions(segments).astype(np.int32)


def random_inputs(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)]  # q, k, v, cotangent
    return [rng.normal(size=s).astype(np.float32) for s in shapes]


def reference(q, k, v, segments, positions, dout, window):
    """(output, (dq, dk, dv)) of single-device attention in float64."""
    with jax.enable_x64(True):
        mask = segment_mask(jnp.asarray(segments))
        if window:
            mask &= sliding_window_mask(positions, positions, window)
        q, k, v, dout = (jnp.asarray(x, jnp.float64) for x in (q, k, v, dout))
        out, vjp = jax.vjp(lambda q, k, v: xla_attention(q, k, v, mask), q, k, v)
        return np.asarray(out), tuple(np.asarray(g) for g in vjp(dout))


@functools.cache
def compiled(sp, strategy, window):
    """The jitted (q, k, v, positions, segments, dout) -> (output, (dq, dk, dv)) on the sp
    mesh, compiled once for the parity, leakage and HLO tests."""
    mesh = make_mesh(sp)

    def run(q, k, v, positions, segments, dout):
        out, vjp = jax.vjp(lambda q, k, v: cp.context_parallel_attention(
            q, k, v, positions, segments, strategy=strategy, window=window, mesh=mesh), q, k, v)
        return out, vjp(dout)

    heads, places = P(("dp", "fsdp", "ep"), "sp", "mp", None), P(("dp", "fsdp", "ep"), "sp")
    q, k, v, dout = random_inputs()
    segments, positions = packed_rows()
    specs = (heads, heads, heads, places, places, heads)
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
            for x, s in zip((q, k, v, positions, segments, dout), specs)]
    return jax.jit(run).lower(*args).compile(), NamedSharding(mesh, heads)


def run_in_order(sp, strategy, window, q, k, v, segments, positions, dout, zigzag):
    """The context parallel output and gradients, in the row's own order; with `zigzag`
    the devices hold the sequence in zig-zag order (positions and segment ids follow)."""
    program, _ = compiled(sp, strategy, window)
    order = (lambda x: cp.to_zigzag(x, sp)) if zigzag else (lambda x: x)
    back = (lambda x: cp.from_zigzag(x, sp)) if zigzag else (lambda x: x)
    q, k, v, positions, segments, dout = order([q, k, v, positions, segments, dout])
    out, grads = program(q, k, v, positions, segments, dout)
    return back(np.asarray(out)), tuple(back(np.asarray(g)) for g in grads)


def tolerance(reference_array, terms):
    """fp32 against float64: each result is a sum of about `terms` rounded terms (the H-term
    score, the softmax over at most T keys; twice that in the backward), so it drifts by
    ~terms * eps * its scale."""
    return terms * EPS32 * np.abs(reference_array).max()


def max_errors(got, want):
    return [np.abs(g - w).max() for g, w in zip(got, want)]


def within(got, want):
    terms = [H + T] + [2 * (H + T)] * 3
    return all(e <= tolerance(w, n) for e, w, n in zip(max_errors(got, want), want, terms))


CASES = [(sp, strategy, 0) for sp in (2, 4, 8) for strategy in cp.STRATEGIES] + [
    (4, strategy, WINDOW) for strategy in cp.STRATEGIES]


@pytest.mark.parametrize("sp,strategy,window", CASES)
def test_equals_single_device_attention(sp, strategy, window):
    q, k, v, dout = random_inputs()
    segments, positions = packed_rows()
    out64, grads64 = reference(q, k, v, segments, positions, dout, window)
    want = [out64, *grads64]
    for zigzag in (False, True):
        out, grads = run_in_order(sp, strategy, window, q, k, v, segments, positions, dout,
                                  zigzag)
        assert within([out, *grads], want), (zigzag, max_errors([out, *grads], want))
    # Negative twins: segment ids ignored (one document per row), and the zig-zag order
    # applied to the tokens but not to their positions and segment ids.
    out, grads = run_in_order(sp, strategy, window, q, k, v, np.zeros_like(segments),
                              positions, dout, False)
    assert not within([out, *grads], want)
    program, _ = compiled(sp, strategy, window)
    moved = [cp.to_zigzag(x, sp) for x in (q, k, v, dout)]
    out, grads = program(*moved[:3], positions, segments, moved[3])
    assert not within([cp.from_zigzag(np.asarray(out), sp)], [out64])


def test_output_keeps_the_input_sharding():
    program, heads = compiled(2, "ring", 0)
    q, k, v, dout = random_inputs()
    segments, positions = packed_rows()
    out, grads = program(q, k, v, positions, segments, dout)
    for x in (out, *grads):
        assert x.sharding.is_equivalent_to(heads, x.ndim)


def test_sliding_window_twin_fails():
    """The window parity above would notice a window one position too wide."""
    q, k, v, dout = random_inputs()
    segments, positions = packed_rows()
    want = reference(q, k, v, segments, positions, dout, WINDOW)[0]
    wider = reference(q, k, v, segments, positions, dout, WINDOW + 1)[0]
    got = run_in_order(4, "ring", WINDOW, q, k, v, segments, positions, dout, True)[0]
    assert within([got], [want]) and not within([wider], [want])


def changed_elsewhere(sp, strategy, segments, positions, row, place, fed=None):
    """Perturb q, k and v of one token; return (changed outputs of other documents,
    changed outputs of its own document) in that row, run in zig-zag order with the
    segment ids `fed` (default: the true ones)."""
    fed = segments if fed is None else fed
    q, k, v, dout = random_inputs()
    before = run_in_order(sp, strategy, 0, q, k, v, fed, positions, dout, True)[0]
    for x in (q, k, v):
        x[row, place] += 1.0
    after = run_in_order(sp, strategy, 0, q, k, v, fed, positions, dout, True)[0]
    changed = (before[row] != after[row]).any(axis=(-1, -2))  # (T,)
    same_document = segments[row] == segments[row, place]
    return int(changed[~same_document].sum()), int(changed[same_document].sum())


@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_no_attention_leaks_across_documents(strategy):
    segments, positions = packed_rows()
    # A token early in a document of row 0, and one in row 1's first short document.
    place = int(np.flatnonzero(np.diff(segments[0]))[2]) + 1
    for row, p in ((0, place), (1, 1)):
        other, own = changed_elsewhere(4, strategy, segments, positions, row, p)
        assert other == 0
        assert own > 0  # the perturbation reaches its own document's later tokens
    # Negative twin: the same check with segment ids ignored finds the leak.
    flat = np.zeros_like(segments)
    other, _ = changed_elsewhere(4, strategy, segments, positions, 0, place, fed=flat)
    assert other > 0


def test_ring_passes_blocks_and_never_gathers_them():
    ring = compiled(4, "ring", 0)[0].as_text()
    assert "collective-permute" in ring and "all-gather" not in ring
    # Twin: the same inspection tells the gathering strategy apart.
    gathered = compiled(4, "all_gather", 0)[0].as_text()
    assert "all-gather" in gathered


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_zigzag_balances_causal_work(sp):
    """One causal document per row, cut into 2*sp chunks (= the ring's sub-blocks): chunk c
    sees c + 1 chunks, so device i of the zig-zag order (chunks i and 2sp-1-i) runs
    (i + 1) + (2sp - i) = 2sp + 1 products per row, and device i of the plain order
    (chunks 2i and 2i+1) runs 4i + 3."""
    rows, length = 3, 8 * sp
    positions = np.tile(np.arange(length), (rows, 1))
    segments = np.ones_like(positions)
    work = cp.block_work(*cp.to_zigzag([positions, segments], sp), sp)
    assert work.max() - work.min() <= 1
    np.testing.assert_array_equal(work, rows * (2 * sp + 1))
    plain = cp.block_work(positions, segments, sp)
    np.testing.assert_array_equal(plain, rows * (4 * np.arange(sp) + 3))
    assert plain.max() - plain.min() > 1


def test_zigzag_round_trip_and_chunks():
    x = np.arange(2 * 16).reshape(2, 16)
    np.testing.assert_array_equal(cp.from_zigzag(cp.to_zigzag(x, 4), 4), x)
    # Device 0 holds chunks 0 and 7 of 8, device 3 chunks 3 and 4.
    np.testing.assert_array_equal(cp.to_zigzag(x, 4)[0, :4], [0, 1, 14, 15])
    np.testing.assert_array_equal(cp.to_zigzag(x, 4)[0, 12:], [6, 7, 8, 9])
    with pytest.raises(ValueError, match="multiple of 2\\*sp"):
        cp.zigzag_permutation(12, 4)


def test_errors_name_what_is_wrong():
    q, k, v, _ = random_inputs()
    segments, positions = packed_rows()
    with pytest.raises(ValueError, match="strategy 'ulysses'"):
        cp.context_parallel_attention(q, k, v, positions, segments, strategy="ulysses",
                                      mesh=make_mesh(2))
    no_sp = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="axis 'sp'"):
        cp.context_parallel_attention(q, k, v, positions, segments, mesh=no_sp)


def test_ring_memory_is_below_all_gather():
    """Per device, the ring's backward holds sub-block scores (t/2 x t/2 for t = T/sp local
    places) where the gathering strategy holds (t x T): sp * 4 = 32 times fewer score bytes
    at sp = 8. Both also keep O(t * H) blocks (q, K/V, fp32 gradients), which the ring holds
    more of, so the whole temporary memory is required to be only sp times smaller, at a
    length (2048) where the scores dominate."""
    sp, length = 8, 2048
    mesh = make_mesh(sp)
    heads, places = P(("dp", "fsdp", "ep"), "sp", "mp", None), P(("dp", "fsdp", "ep"), "sp")
    shapes = [((1, length, N, 64), heads), ((1, length, K, 64), heads),
              ((1, length, K, 64), heads), ((1, length), places), ((1, length), places)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32 if len(s) == 4 else jnp.int32,
                                 sharding=NamedSharding(mesh, spec)) for s, spec in shapes]

    def temp_bytes(strategy):
        def loss(q, k, v, positions, segments):
            out = cp.context_parallel_attention(q, k, v, positions, segments,
                                                strategy=strategy, mesh=mesh)
            return jnp.sum(out ** 2)
        program = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        return program.memory_analysis().temp_size_in_bytes

    assert temp_bytes("all_gather") > sp * temp_bytes("ring")


def test_without_segment_ids_the_row_is_one_causal_document():
    q, k, v, _ = random_inputs()
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    got = jax.jit(lambda q, k, v: cp.context_parallel_attention(
        q, k, v, positions, strategy="all_gather", mesh=make_mesh(2)))(q, k, v)
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        want = np.asarray(xla_attention(q, k, v))
        # Twin: attention over the whole row, later keys included.
        unmasked = np.asarray(xla_attention(q, k, v, jnp.ones((B, T, T), bool)))
    assert np.abs(np.asarray(got) - want).max() <= tolerance(want, H + T)
    assert np.abs(np.asarray(got) - unmasked).max() > tolerance(unmasked, H + T)
