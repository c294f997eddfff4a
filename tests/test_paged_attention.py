"""The paged attention wrapper (easylm/models/paged_attention.py): its XLA path against
dense attention over each sequence's pages and JAX's own reference of the kernel, and
the kernel itself in Pallas' TPU interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, assert_differs

from easylm.models import paged_attention as pa

# fp32 against float64: rounding of fp32 sums over <= 32 keys and head dim 32, ~1e-6
# relative to the largest output; 1e-5 leaves room.
REL = 1e-5


def _case(seed=0, N=4, K=2, H=32, Z=8, P=20, W=4, q_lens=(1, 3, 1, 5), kv_lens=(5, 17, 32, 9)):
    """Random pages, each sequence's page table a random choice of distinct pages (page 0
    unused, like the engine's scratch page), ragged queries."""
    rng = np.random.default_rng(seed)
    kv = jnp.asarray(rng.normal(size=(P, Z, 2 * K, H)), jnp.float32)
    table = np.stack([rng.permutation(np.arange(1, P))[:W] for _ in q_lens]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(int(cu[-1]), N, H)), jnp.float32)
    return q, kv, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table), jnp.asarray(cu), \
        jnp.array([len(q_lens)], jnp.int32)


def _dense(q, kv, kv_lens, table, cu, scale, window=0):
    """Per sequence, in float64 numpy: its pages laid out densely, its queries the last
    q_len positions, each seeing keys up to itself (and only the last `window`)."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    N, K = q.shape[1], kv.shape[2] // 2
    outs = []
    for s in range(table.shape[0]):
        L, n = int(kv_lens[s]), int(cu[s + 1] - cu[s])
        pages = kv[np.asarray(table[s])].reshape(-1, 2 * K, kv.shape[-1])[:L]
        k = np.repeat(pages[:, 0::2], N // K, axis=1)  # (L, N, H)
        v = np.repeat(pages[:, 1::2], N // K, axis=1)
        scores = np.einsum("tnh,snh->nts", q[int(cu[s]):int(cu[s + 1])], k) * scale
        position = L - n + np.arange(n)[:, None]
        key = np.arange(L)[None, :]
        visible = (key <= position) & ((key > position - window) if window else True)
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        outs.append(np.einsum("nts,snh->tnh", probs, v))
    return np.concatenate(outs)


@pytest.mark.parametrize("window", [0, 6])
def test_xla_path_is_dense_attention_over_each_sequences_pages(window):
    q, kv, kv_lens, table, cu, num = _case()
    out = pa.ragged_paged_attention(q, kv, kv_lens, table, cu, num, 0.3, window,
                                    implementation="xla")
    assert_close(out, _dense(q, kv, kv_lens, table, cu, 0.3, window), REL)
    # Negative twin: a page table one page off reads other keys.
    shifted = jnp.roll(table, 1, axis=1)
    assert_differs(pa.ragged_paged_attention(q, kv, kv_lens, shifted, cu, num, 0.3, window,
                                             implementation="xla"), out, REL)


@pytest.mark.extended  # the reference runs op by op, per sequence: ~30 s on the CPU
def test_xla_path_is_the_kernels_reference():
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    q, kv, kv_lens, table, cu, num = _case(seed=1)
    out = pa.ragged_paged_attention(q, kv, kv_lens, table, cu, num, 0.2, implementation="xla")
    assert_close(out, rpa.ref_ragged_paged_attention(q, kv, kv_lens, table, cu, num,
                                                     sm_scale=0.2), REL)


def test_decode_attention_is_one_query_per_sequence():
    q, kv, kv_lens, table, cu, num = _case(q_lens=(1, 1, 1, 1))
    out = pa.decode_attention(q, kv, kv_lens, table, 0.3, implementation="xla")
    assert_close(out, _dense(q, kv, kv_lens, table, cu, 0.3), REL)
    assert_differs(pa.decode_attention(q, kv, kv_lens - 1, table, 0.3, implementation="xla"),
                   out, REL)


@pytest.mark.extended  # ~15 s to reach the interpreter's failure; a release run flags a fix
@pytest.mark.xfail(strict=True, raises=jax.errors.JaxRuntimeError,
                   reason="JAX 0.10.2's Pallas TPU interpreter cannot run the kernel: its "
                          "strided load of a reshaped VMEM ref fails in the interpreter's "
                          "callback ('ReshapeTransform' object has no attribute 'indices'); "
                          "checked on the TPU instead (scripts/paged_attention_check.py)")
def test_kernel_in_interpret_mode_is_the_xla_path():
    from jax.experimental.pallas import tpu as pltpu

    q, kv, kv_lens, table, cu, num = _case(H=128, Z=16, P=12, W=2, kv_lens=(5, 17, 32, 9))
    expected = pa.ragged_paged_attention(q, kv, kv_lens, table, cu, num, 0.3,
                                         implementation="xla")
    with pltpu.force_tpu_interpret_mode():
        out = pa.ragged_paged_attention(q, kv, kv_lens, table, cu, num, 0.3,
                                        implementation="kernel", block_sizes=(1, 8))
    assert_close(out, expected, REL)
