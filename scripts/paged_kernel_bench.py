"""JAX's ragged paged attention kernel alone, at a decode step's shape: microseconds per
layer call and the K/V bandwidth it reaches, per page size and block sizes.

    python scripts/paged_kernel_bench.py --batch=64 --heads=16 --kv_heads=16 \
        --context=256 --seq_length=384 --page_sizes=16,32,64,128 --queries_per_block=0,8,16

One query per sequence (a decode step), every sequence `context` keys (its pages spread
over the pool at random), `layers` calls chained in one program (each call's output is
the next one's query) so the time is the device's. A JSON line per setting; the K/V
bytes a call must read over 819 GB/s (the v5e's HBM) for comparison.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models.paged_attention import decode_attention, ragged_paged_attention


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=16)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--seq_length", type=int, default=384)
    parser.add_argument("--page_sizes", default="16,32,64,128")
    parser.add_argument("--queries_per_block", default="0",
                        help="comma-separated; 0: the engine's (paged_attention.decode_attention)")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    B, N, K, H = args.batch, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    kv_bytes = B * args.context * 2 * K * H * 2
    for Z in map(int, args.page_sizes.split(",")):
        W = -(-args.seq_length // Z)
        P = B * W
        pool = jax.random.normal(jax.random.PRNGKey(0), (P, Z, 2 * K, H), jnp.bfloat16)
        table = jnp.asarray(rng.permutation(P).reshape(B, W), jnp.int32)
        lengths = jnp.full((B,), args.context, jnp.int32)
        q = jax.random.normal(jax.random.PRNGKey(1), (B, N, H), jnp.bfloat16)
        for bq in map(int, args.queries_per_block.split(",")):
            blocks = None if bq == 0 else (W, bq)

            @jax.jit
            def chain(q, pool, table, lengths):
                def layer(_, q):
                    if blocks is None:
                        return decode_attention(q, pool, lengths, table)
                    return ragged_paged_attention(
                        q, pool, lengths, table, jnp.arange(B + 1, dtype=jnp.int32),
                        jnp.array([B], jnp.int32), block_sizes=blocks)
                return jax.lax.fori_loop(0, args.layers, layer, q)

            try:
                jax.block_until_ready(chain(q, pool, table, lengths))
                start = time.perf_counter()
                for _ in range(args.calls):
                    out = chain(q, pool, table, lengths)
                jax.block_until_ready(out)
                us = (time.perf_counter() - start) / (args.calls * args.layers) * 1e6
                row = {"page_size": Z, "queries_per_block": bq or "engine", "us_per_layer": us,
                       "kv_gb_per_s": kv_bytes / us / 1e3,
                       "us_at_819": kv_bytes / 819e9 * 1e6}
            except Exception as e:  # a block size the kernel refuses: say so, go on
                row = {"page_size": Z, "queries_per_block": bq, "error": repr(e)[:300]}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
