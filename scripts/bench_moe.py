"""The MoE block's grouped matmuls (`jax.lax.ragged_dot` over tokens sorted by expert)
against a dense per-expert einsum doing the same FLOPs, as a ratio in one run.

    JAX_PLATFORMS=cpu python scripts/bench_moe.py --tokens=2048 --hidden=256 --ffn=512

Both sides run the experts' gate/up/down matmuls (SwiGLU) on N*K rows: ragged_dot on the
rows as routed (group sizes from a random router, so uneven), the einsum on (E, N*K/E, D)
blocks (perfectly balanced: a capacity-factor-1 layout without the dispatch). A ratio
above 1 is what dropless grouping costs over an ideal dense layout on this backend. On
XLA:CPU `ragged_dot` has no grouped kernel: it lowers to a dense dot per group with masking,
so CPU ratios say nothing of a GPU's or TPU's (measure those on the device).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models import moe


def timed(fn, *args, iters):
    jax.block_until_ready(fn(*args))  # compile
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--iters", type=int, default=5)
    a = parser.parse_args(argv)
    N, D, F, E, K = a.tokens, a.hidden, a.ffn, a.experts, a.top_k
    if N * K % E:
        parser.error("--tokens * --top_k must be a multiple of --experts")
    dtype = jnp.dtype(a.dtype)
    config = moe.MoEConfig(E, K, F)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"gate_proj": jax.random.normal(keys[0], (E, D, F), dtype) / np.sqrt(D),
              "up_proj": jax.random.normal(keys[1], (E, D, F), dtype) / np.sqrt(D),
              "down_proj": jax.random.normal(keys[2], (E, F, D), dtype) / np.sqrt(F)}
    x = jax.random.normal(keys[3], (N, D), dtype)
    _, experts = moe.route(jax.random.normal(keys[4], (N, E)), config)
    order, sizes = moe._sort_pairs(experts, jnp.ones(experts.shape, bool), E)
    rows = x[order // K]  # (N*K, D) sorted by expert
    blocks = rows.reshape(E, N * K // E, D)  # the same rows, as equal blocks

    def ragged(p, rows):
        return moe.expert_mlp(rows, p, sizes, config, dtype)

    def dense(p, blocks):
        h = jax.nn.silu(jnp.einsum("ECD,EDF->ECF", blocks, p["gate_proj"])) * jnp.einsum(
            "ECD,EDF->ECF", blocks, p["up_proj"])
        return jnp.einsum("ECF,EFD->ECD", h, p["down_proj"])

    def with_grad(f):
        return jax.jit(jax.grad(lambda p, r: jnp.sum(f(p, r).astype(jnp.float32) ** 2),
                                argnums=(0, 1)))

    flops = 2 * 3 * N * K * D * F
    print(f"{jax.devices()[0].platform}: N={N} D={D} F={F} E={E} K={K} {a.dtype}; "
          f"group sizes {np.asarray(sizes).tolist()}")
    for name, r, d, mult in (("forward", jax.jit(ragged), jax.jit(dense), 1),
                             ("forward+backward", with_grad(ragged), with_grad(dense), 3)):
        t_ragged = timed(r, params, rows, iters=a.iters)
        t_dense = timed(d, params, blocks, iters=a.iters)
        print(f"{name:>16}: ragged_dot {t_ragged * 1e3:8.2f} ms "
              f"({mult * flops / t_ragged / 1e9:6.1f} GFLOP/s), dense einsum "
              f"{t_dense * 1e3:8.2f} ms ({mult * flops / t_dense / 1e9:6.1f} GFLOP/s), "
              f"ratio ragged/dense {t_ragged / t_dense:.2f}")


if __name__ == "__main__":
    main()
