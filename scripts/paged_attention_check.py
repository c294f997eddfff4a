"""On a TPU: easylm.models.paged_attention's kernel path (JAX's ragged paged attention)
against its XLA path, and both timed, for a decode step's shapes.

    python scripts/paged_attention_check.py --batch=64 --heads=16 --kv_heads=16 \
        --head_dim=128 --page_size=16 --length=256 --max_length=384

Prints one JSON line: the largest difference relative to the outputs' largest value,
and ms per call of each path (one layer's attention; a decode step runs one per layer).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models import paged_attention as pa


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("batch", 64), ("heads", 16), ("kv_heads", 16), ("head_dim", 128),
                          ("page_size", 16), ("length", 256), ("max_length", 384),
                          ("calls", 20)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    B, Z = args.batch, args.page_size
    W = -(-args.max_length // Z)
    P = B * W + 1
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.normal(size=(P, Z, 2 * args.kv_heads, args.head_dim)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(B, args.heads, args.head_dim)), jnp.bfloat16)
    table = jnp.asarray(1 + rng.permutation(P - 1)[:B * W].reshape(B, W), jnp.int32)
    lengths = jnp.asarray(rng.integers(args.length // 2, args.length + 1, B), jnp.int32)
    row = {"shape": vars(args), "kv_bytes_read": int(lengths.sum()) * 2 * args.kv_heads
           * args.head_dim * 2}
    outs = {}
    for impl in ("xla", "kernel"):
        fn = jax.jit(lambda q, kv, lengths, table, impl=impl: pa.decode_attention(
            q, kv, lengths, table, implementation=impl))
        outs[impl] = np.asarray(fn(q, kv, lengths, table), np.float32)
        start = time.perf_counter()
        jax.block_until_ready([fn(q, kv, lengths, table) for _ in range(args.calls)])
        row[f"{impl}_ms"] = (time.perf_counter() - start) / args.calls * 1e3
    scale = float(np.abs(outs["xla"]).max())
    row["max_rel_diff"] = float(np.abs(outs["kernel"] - outs["xla"]).max()) / scale
    row["kernel_gb_per_s"] = row["kv_bytes_read"] / row["kernel_ms"] / 1e6
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
