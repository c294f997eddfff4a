"""Shared-prefix (cascade) decode attention: a group's shared pages read once for all its
members' queries, each sequence's own keys after them, merged by log-sum-exp
(`paged_attention.shared_prefix_attention`), against plain paged decode attention; the
kernel's log-sum-exp output in Pallas interpret mode; the page book's groups; the engine
with `--prefix_groups` against the dense engine."""

import jax.numpy as jnp
import numpy as np
import pytest

from easylm.models.paged_attention import (SharedPrefix, decode_attention,
                                           shared_prefix_attention, xla_decode_attention)
from easylm.models.paged_decode_kernel import batched_decode_attention
from easylm.serving.pages import PageBook

Z, W, K, H = 4, 6, 2, 16  # page size, pages a sequence, kv heads, head dim


def _setup(dtype, N=4, seed=0):
    """A pool where sequences 0-2 share 2 pages (8 positions) and 3-4 share 1, sequence 5
    shares nothing: each holds its own pages after the shared ones."""
    rng = np.random.default_rng(seed)
    P = 40
    pool = jnp.asarray(rng.normal(size=(P, Z, 2 * K, H)), dtype)
    groups = [([0, 1, 2], [1, 2]), ([3, 4], [3])]
    free = iter(range(4, P))
    table = np.zeros((6, W), np.int32)
    lengths = np.array([9, 14, 21, 5, 17, 11], np.int32)
    shared = np.zeros(6, np.int32)
    for slots, pages in groups:
        for b in slots:
            table[b, :len(pages)] = pages
            shared[b] = len(pages) * Z
    for b in range(6):
        for p in range(shared[b] // Z, -(-lengths[b] // Z)):
            table[b, p] = next(free)
    M = 4  # 3 groups, one unused; members padded with 6 (none)
    prefix = SharedPrefix(
        table=jnp.asarray([[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0], [0] * W], jnp.int32),
        length=jnp.asarray([8, 4, 0], jnp.int32),
        members=jnp.asarray([[0, 1, 2, 6], [3, 4, 6, 6], [6] * M], jnp.int32),
        group=jnp.asarray([0, 0, 0, 1, 1, 0], jnp.int32),
        member=jnp.asarray([0, 1, 2, 0, 1, 0], jnp.int32),
        shared=jnp.asarray(shared))
    q = jnp.asarray(rng.normal(size=(6, N, H)), dtype)
    return q, pool, jnp.asarray(lengths), jnp.asarray(table), prefix


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_shared_prefix_equals_plain_decode_attention(dtype, tol):
    q, pool, lengths, table, prefix = _setup(dtype)
    want = decode_attention(q, pool, lengths, table, implementation="xla")
    got = shared_prefix_attention(q, pool, lengths, table, prefix, implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    # Twin: sequence 1 read as the group's member 0 takes sequence 0's prefix scores.
    wrong = SharedPrefix(**{**vars(prefix), "member": prefix.member.at[1].set(0)})
    bad = shared_prefix_attention(q, pool, lengths, table, wrong, implementation="xla")
    assert np.abs(np.asarray(bad, np.float32)[1] - np.asarray(want, np.float32)[1]).max() > 10 * tol


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_the_kernels_log_sum_exp_is_the_xla_paths(dtype, tol):
    """The kernel (interpret mode) with `lse`, against `xla_decode_attention`, for plain
    sequences (G = 2 rows a kv head) and for groups (4 members x 2 rows a kv head)."""
    q, pool, lengths, table, prefix = _setup(dtype)
    scale = 1 / np.sqrt(H)
    for args in ((q, pool, lengths, table),
                 (jnp.tile(q[:3], (1, 4, 1)), pool, prefix.length, prefix.table)):
        out, lse = batched_decode_attention(*args, scale, blocks=(2, 2), interpret=True,
                                            lse=True)
        want_out, want_lse = xla_decode_attention(*args, scale)
        live = np.asarray(args[2]) > 0  # a group of no keys: its rows are unused
        np.testing.assert_allclose(np.asarray(out, np.float32)[live],
                                   np.asarray(want_out, np.float32)[live], atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(want_lse)[live],
                                   atol=1e-4, rtol=1e-4)
    # Twin: the lse of one page less differs.
    _, short = batched_decode_attention(q, pool, lengths - Z, table, scale, blocks=(2, 2),
                                        interpret=True, lse=True)
    _, want_lse = xla_decode_attention(q, pool, lengths, table, scale)
    assert np.abs(np.asarray(short) - np.asarray(want_lse)).min() > 1e-3


def test_shared_prefix_through_the_kernel_in_interpret_mode():
    q, pool, lengths, table, prefix = _setup(jnp.float32)
    want = decode_attention(q, pool, lengths, table, implementation="xla")
    got = shared_prefix_attention(q, pool, lengths, table, prefix, implementation="kernel")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_the_page_book_groups_slots_by_their_shared_pages():
    book = PageBook(slots=6, length=W * Z, page_size=Z, pages=40)
    for b in (0, 3, 5):
        assert book.reserve(b, 10)
    book.share(1, book.table[0, :2].tolist())
    book.share(2, book.table[0, :2].tolist())
    book.share(4, book.table[3, :1].tolist())
    for b in (1, 2, 4):
        assert book.reserve(b, 12)
    p = book.shared_groups(groups=3, members=4)
    assert p["length"].tolist() == [8, 4, 0]
    assert p["members"].tolist() == [[0, 1, 2, 6], [3, 4, 6, 6], [6] * 4]
    assert p["shared"].tolist() == [8, 8, 8, 4, 4, 0]
    assert p["table"][0, :2].tolist() == book.table[0, :2].tolist()
    assert p["group"].tolist()[:5] == [0, 0, 0, 1, 1]
    assert p["member"].tolist()[:5] == [0, 1, 2, 0, 1]
    # One group allowed: the larger one (3 members x 2 pages) is kept, the other unshared.
    one = book.shared_groups(groups=1, members=2)
    assert one["members"].tolist() == [[0, 1]]
    assert one["shared"].tolist() == [8, 8, 0, 0, 0, 0]


def test_the_tpu_variant_lowers_to_mosaic(monkeypatch):
    """The cascade through the kernel, exported for a TPU from the CPU (Pallas -> Mosaic;
    Mosaic's own compile runs on a TPU only) at GRPO's qwen3_0.6b rollout shape: 64 rows
    in 8 groups, pages of 16, bf16 (the uint32 row split interpret mode cannot run)."""
    import jax

    from easylm.models import paged_attention

    monkeypatch.setattr(paged_attention, "kernel_available", lambda: True)
    B, N, K, H, W, E = 64, 16, 8, 128, 48, 8
    i32 = jnp.int32
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        ((B, N, H), jnp.bfloat16), ((B * W, 16, 2 * K, H), jnp.bfloat16), ((B,), i32),
        ((B, W), i32)]]
    prefix = SharedPrefix(*[jax.ShapeDtypeStruct(shape, i32) for shape in [
        (E, W), (E,), (E, B), (B,), (B,), (B,)]])
    exported = jax.export.export(jax.jit(lambda *a: shared_prefix_attention(
        *a, kernel="batched")), platforms=["tpu"])(*args, prefix)
    assert exported.mlir_module().count("tpu_custom_call") >= 2
