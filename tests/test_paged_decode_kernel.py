"""The batched decode kernel (easylm/models/paged_decode_kernel.py) in Pallas' TPU
interpret mode against the paged attention's XLA path (itself checked against dense
attention in test_paged_attention.py). Interpret mode runs the kernel's DMAs, semaphores
and double buffer as the TPU would order them, with uninitialised VMEM read as NaN; what
it cannot run, the bf16 uint32 split of the buffer's rows, is the TPU's only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from numerics import EPS_BF16, assert_close, assert_differs, fp32_rel

from easylm.models import paged_attention as pa, paged_decode_kernel as pdk
from easylm.models.paged_decode_kernel import batched_decode_attention

try:  # where JAX 0.10.2 keeps the interpreter's race report (private: it may move)
    import jax._src.pallas.mosaic.interpret.interpret_pallas_call as tpu_interpret
except ImportError:  # then the parity is still checked, the race report not
    tpu_interpret = None

Z, W, H = 8, 5, 128  # pages of 8, 5 a sequence, TPU-sized heads
# A key, a page, several pages, 36 and 40 keys across the 2-page (16-key) steps of
# BLOCKS; five sequences in blocks of two: the last block padded.
LENGTHS = (1, 8, 17, 36, 40)
BLOCKS = (2, 2)  # 2 sequences a block, 2 pages a sequence a step: 3 steps a block
# 4 pages a step in products of one page: a step computes only the products below a
# sequence's length (and, with a window, from its first visible key's).
PRODUCTS = (2, 4, 1)
# fp32: the same sums in another order (an online softmax over three steps, each
# rescaled once): sqrt(40 keys) or sqrt(128 head dims) rounding terms, three reductions
# in sequence (scores, softmax sum, values), relative to the largest output.
REL32 = fp32_rel(128, 3)
# bf16: both paths round the probabilities to bf16 before the values (half an ulp,
# 2^-8 relative, each; the VPU variant keeps them fp32) and the output once more; the kernel's probabilities are relative
# to a step's running maximum, the XLA path's to the sequence's, so a weight can round
# differently: a few bf16 ulps of the largest output.
REL16 = 2 * EPS_BF16


def _case(N, K, dtype, seed=0):
    rng = np.random.default_rng(seed)
    P = len(LENGTHS) * W + 1  # page 0 unused, as the engine's scratch page
    kv = jnp.asarray(rng.normal(size=(P, Z, 2 * K, H)), dtype)
    table = jnp.asarray(rng.permutation(np.arange(1, P)).reshape(len(LENGTHS), W), jnp.int32)
    q = jnp.asarray(rng.normal(size=(len(LENGTHS), N, H)), dtype)
    return q, kv, jnp.asarray(LENGTHS, jnp.int32), table


@pytest.mark.parametrize("N,K,dtype,rel,vpu,all_heads,blocks", [
    (2, 2, jnp.float32, REL32, False, False, BLOCKS),  # MHA, a product per kv head
    (4, 2, jnp.bfloat16, REL16, False, False, BLOCKS),  # GQA: G = 2
    (4, 2, jnp.bfloat16, REL16, False, False, PRODUCTS),
    (4, 2, jnp.float32, REL32, True, False, BLOCKS),  # both products on the VPU
    (4, 2, jnp.bfloat16, REL16, True, False, PRODUCTS),
    # One product over every kv head: another head's columns masked in each row.
    (2, 2, jnp.float32, REL32, False, True, BLOCKS),
    (4, 2, jnp.bfloat16, REL16, False, True, PRODUCTS),
    (6, 3, jnp.float32, REL32, False, True, PRODUCTS)])  # 3 kv heads of 2 rows
def test_kernel_is_the_xla_path(N, K, dtype, rel, vpu, all_heads, blocks):
    q, kv, lengths, table = _case(N, K, dtype)
    expected = pa.decode_attention(q, kv, lengths, table, 0.3, implementation="xla")
    # Eager DMAs (each lands when started) with race detection: a copy into the buffer a
    # step still reads, or a read before its wait, is reported.
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    out = batched_decode_attention(q, kv, lengths, table, 0.3, blocks=blocks,
                                   vpu=vpu, interpret=params, all_heads=all_heads)
    assert tpu_interpret is None or not tpu_interpret.races.races_found
    assert_close(out, expected.astype(jnp.float32), rel)
    # Negative twin: a page table one page off reads other keys.
    shifted = batched_decode_attention(q, kv, lengths, jnp.roll(table, 1, axis=1), 0.3,
                                       blocks=blocks, vpu=vpu, interpret=True,
                                       all_heads=all_heads)
    assert_differs(shifted, expected.astype(jnp.float32), rel)


def test_a_sliding_window_and_one_step_per_block():
    """A window of 6 keys (the pages it has passed not copied: a stale or zero buffer
    there, masked) and the default blocks (every page of a sequence in one step), a
    product over every kv head and one a head; twin: the window off."""
    q, kv, lengths, table = _case(4, 2, jnp.float32, seed=1)
    expected = pa.decode_attention(q, kv, lengths, table, 0.3, 6, implementation="xla")
    out = batched_decode_attention(q, kv, lengths, table, 0.3, 6, interpret=True)
    assert_close(out, expected, REL32)
    for blocks in (PRODUCTS, (2, 6, 2)):  # (2, 6, 2): a step wider than the 5-page tables
        for all_heads in (True, False):
            assert_close(batched_decode_attention(q, kv, lengths, table, 0.3, 6,
                                                  blocks=blocks, interpret=True,
                                                  all_heads=all_heads), expected, REL32)
    assert_differs(batched_decode_attention(q, kv, lengths, table, 0.3, interpret=True),
                   expected, REL32)


def test_a_product_over_every_kv_head_while_its_scores_fit(monkeypatch):
    """By default a product serves every kv head while its fp32 scores (N x keys x K)
    take at most ALL_HEADS_SCORES bytes, else one kv head at a time; never with the VPU's
    products (refused when asked)."""
    chosen = []
    kernel = pdk._kernel
    monkeypatch.setattr(pdk, "_kernel", lambda *a, d, **k: chosen.append(d.all_heads)
                        or kernel(*a, d=d, **k))
    q, kv, lengths, table = _case(4, 2, jnp.float32)
    expected = pa.decode_attention(q, kv, lengths, table, 0.3, implementation="xla")
    for limit in (4 * 8 * 2 * 4, 4 * 8 * 2 * 4 - 1):  # PRODUCTS: 8 keys a product
        monkeypatch.setattr(pdk, "ALL_HEADS_SCORES", limit)
        # a scale of its own: a new trace, not the jit cache's
        assert_close(batched_decode_attention(q, kv, lengths, table, 0.3 + limit * 1e-9,
                                              blocks=PRODUCTS, interpret=True),
                     expected, REL32)
    assert chosen == [True, False]
    with pytest.raises(ValueError, match="all_heads products are the MXU's"):
        batched_decode_attention(q, kv, lengths, table, 0.3, vpu=True, all_heads=True)


def test_decode_attention_reaches_the_kernel_by_name(monkeypatch):
    """`decode_attention(kernel="batched")` runs the kernel where one runs (here:
    INTERPRET), the XLA path where none does; an unknown kernel is refused."""
    q, kv, lengths, table = _case(2, 2, jnp.float32)
    calls = []
    monkeypatch.setattr(pa, "batched_decode_attention",
                        lambda *a, **k: calls.append(k) or batched_decode_attention(*a, **k))
    pa.decode_attention(q, kv, lengths, table, kernel="batched")
    assert calls == []  # off a TPU, interpret mode off: the XLA path
    monkeypatch.setattr(pa, "INTERPRET", True)
    expected = pa.decode_attention(q, kv, lengths, table, implementation="xla")
    for kernel in ("batched", "batched_vpu"):
        assert_close(pa.decode_attention(q, kv, lengths, table, kernel=kernel), expected,
                     REL32)
    assert [(c["interpret"], c["vpu"]) for c in calls] == [(True, False), (True, True)]
    # A head wider than BATCHED_HEAD_DIM (Mosaic refuses some on a TPU): JAX's path
    wide = [jnp.tile(x, (1,) * (x.ndim - 1) + (2,)) for x in (q, kv)]
    assert_close(pa.decode_attention(wide[0], wide[1], lengths, table, kernel="batched"),
                 pa.decode_attention(*wide, lengths, table, implementation="xla"), REL32)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="decode kernel 'fast'"):
        pa.decode_attention(q, kv, lengths, table, kernel="fast")


def test_the_tpu_variant_lowers_to_mosaic():
    """What interpret mode cannot run (the bf16 rows split as uint32 pairs) at least
    lowers: JAX exports the kernel for a TPU from the CPU (Pallas -> Mosaic; Mosaic's own
    compile runs on a TPU only), at llama_1b's decode shape in pages of 16."""
    S, N, K, H, W = 64, 16, 16, 128, 24
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        ((S, N, H), jnp.bfloat16), ((S * W, 16, 2 * K, H), jnp.bfloat16),
        ((S,), jnp.int32), ((S, W), jnp.int32)]]
    for window, vpu, all_heads in ((0, False, None), (128, False, None), (0, False, False),
                                   (0, True, False)):
        kernel = jax.jit(lambda *a, w=window, c=vpu, h=all_heads: batched_decode_attention(
            *a, H ** -0.5, w, vpu=c, all_heads=h))
        exported = jax.export.export(kernel, platforms=["tpu"])(*args)
        assert "tpu_custom_call" in exported.mlir_module()
