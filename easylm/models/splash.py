"""JAX's Pallas splash attention kernel (jax.experimental.pallas.ops.tpu.splash_attention)
behind attention.py's signature: q (B, T, N, H), k, v (B, T, K, H), segment ids (B, T) or
None, a window, a scale, sinks (N,), a soft cap; the same numbers as `xla_attention`.

How each of attention.py's inputs reaches the kernel:
    causal          `CausalMask` (T, T): blocks above the diagonal are skipped
    window W        `LocalMask` window (W - 1, 0): key s seen from t iff t - W < s <= t;
                    blocks outside the band are skipped
    segment ids     the kernel's `SegmentIds(q, kv)`, ANDed with the mask above: nothing
                    crosses documents (no (B, T, T) mask is built)
    GQA             the kernel's own: k, v (K, T, H) with N a multiple of K, query head n
                    reads kv head n // G; K/V are never repeated
    sinks (gpt-oss) the kernel's own `sinks` (N,) (0.10.2 takes them: the running max
                    starts at the sink and its exp joins the denominator; their gradient is
                    the kernel's too)
    soft cap        the kernel's `attn_logits_soft_cap`
    scale           q times `scale` before the kernel (it scales nothing itself), as the
                    xla path does
The kernel is per row: vmapped over B. Under a mesh with more than one device it runs in
`shard_map` (rows over the batch axes, heads over 'mp'), as MaxText runs it: a Pallas
call is not partitioned by XLA.

Tiling: the kernel needs T a multiple of its blocks, which are multiples of 128 (the lane
width). Rows are padded at the end to a multiple of 128; a padded key comes after every
real query, so the causal mask hides it, and the padded queries' rows are dropped. Blocks
are the largest of 512, 256, 128 that divide the padded length (512 is MaxText's v5e
default).

Where it runs: on TPU; elsewhere only in Pallas interpret mode (`INTERPRET`, set from
EASYLM_PALLAS_INTERPRET=1 or by tests), a slow emulation for correctness tests.
Not here: a cache's (B, T, S) mask (decode, chunked prefill: attention.py gives those to
the XLA path) and context parallelism (sp > 1: the ring and all-gather kernels; why,
and what each would need: docs/long_context.md).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError

# Pallas interpret mode: the kernel emulated on any backend (tests; slow).
INTERPRET = os.environ.get("EASYLM_PALLAS_INTERPRET", "") == "1"
LANES = 128  # the kernel's kv blocks are multiples of this
BLOCKS = (512, 256, 128)
BATCH_AXES = ("dp", "fsdp", "ep")


def available() -> bool:
    """Whether the kernel can run here: on TPU, or anywhere in interpret mode."""
    return INTERPRET or jax.default_backend() == "tpu"


def check_available(flag: str):
    """The config's check of attention=splash: one line naming `flag` where it cannot run."""
    if not available():
        raise UserError(f"{flag}=splash needs a TPU (JAX's Pallas splash kernel); this is "
                        f"{jax.default_backend()} (use auto, or EASYLM_PALLAS_INTERPRET=1 "
                        "for its slow emulation)")


def padded_length(T: int) -> int:
    return -(-T // LANES) * LANES


def block_sizes(T: int) -> sa.BlockSizes:
    """The same block for every pass, the largest of BLOCKS that divides `T` (padded)."""
    b = next(b for b in BLOCKS if T % b == 0)
    return sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                         block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)


def _kernel(N: int, T: int, window: int, soft_cap: float | None):
    """The kernel for one row of N query heads over T places (built per trace: it holds
    the mask's block tables as arrays)."""
    if window:
        mask = sa.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
    else:
        mask = sa.CausalMask((T, T))
    return sa.make_splash_mha(sa.MultiHeadMask([mask] * N), block_sizes=block_sizes(T),
                              head_shards=1, q_seq_shards=1,
                              attn_logits_soft_cap=soft_cap or None, interpret=INTERPRET)


def _local(q, k, v, segment_ids, sinks, window: int, soft_cap: float | None):
    """One device's rows: q (b, T, n, H), k, v (b, T, k, H), segment ids (b, T) or None."""
    B, T, N, H = q.shape
    pad = padded_length(T) - T
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).swapaxes(1, 2)
               for x in (q, k, v))  # (B, heads, T', H)
    kernel = _kernel(N, T + pad, window, soft_cap)
    if segment_ids is None:
        out = jax.vmap(lambda q, k, v: kernel(q, k, v, None, sinks))(q, k, v)
    else:
        # Padding gets id -1: a padded query sees only padded keys (never an empty row).
        ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, sa.SegmentIds(s, s), sinks))(
            q, k, v, ids)
    return out.swapaxes(1, 2)[:, :T]


def splash_attention(q, k, v, segment_ids=None, window: int = 0, scale: float | None = None,
                     sinks=None, soft_cap: float | None = None):
    """Causal self-attention (inside each document when `segment_ids` (B, T) are given, over
    the last `window` keys when > 0) through the splash kernel; q (B, T, N, H), k, v
    (B, T, K, H) -> (B, T, N, H)."""
    check_available("attention")
    H = q.shape[-1]
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    q = q * jnp.asarray(scale, q.dtype)
    sinks = None if sinks is None else sinks.astype(jnp.float32)

    def local(q, k, v, segment_ids, sinks):
        return _local(q, k, v, segment_ids, sinks, window, soft_cap)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(q, k, v, segment_ids, sinks)
    batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names) or None
    heads = "mp" if "mp" in mesh.axis_names else None
    spec = P(batch, None, heads, None)
    return jax.shard_map(
        local, mesh=mesh, check_vma=False,
        in_specs=(spec, spec, spec, None if segment_ids is None else P(batch, None),
                  None if sinks is None else P(heads)),
        out_specs=spec)(q, k, v, segment_ids, sinks)
