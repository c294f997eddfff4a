"""Forward+backward timings of the kernels behind two implementation flags, one JSON
line each (run by scripts/tpu_bench.sh; any backend, meant for a TPU):

    python scripts/kernel_bench.py grouped_matmul   # moe_matmul: megablox vs ragged_dot
    python scripts/kernel_bench.py attention        # attention: splash vs xla (if built)
    python scripts/kernel_bench.py moe_layer        # where one MoE layer's time goes

grouped_matmul times (on a device; scripts/bench_moe.py compares ragged_dot with a dense
einsum on CPU) the experts' three grouped matmuls (gate, up, down) and their
gradients through `moe.expert_mlp` in bf16, the rows routed evenly at random, at the
small MoE's shape (d 1024, 32 experts top-8, expert width 768, 16k tokens) and at 128
experts d 2048; TFLOP/s counts 3 matmuls x 3 (forward, dx, dw) x 2 M D F.

moe_layer times the parts of one small-MoE layer's experts block, forward and backward
(bf16, 16k tokens, d 1024, 32 experts top 8, width 768): the router and `route`, the sort,
the grouped matmuls, the whole dispatch (`moe.moe_local`), and the dispatch as it was
before 2026-12-06 (a gather whose gradient is a scatter-add, and a scatter to put the rows
back).
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_moe import timed  # scripts/, beside this one

from easylm.models import moe

def grouped_matmul():
    for tokens, D, F, E, K in ((16384, 1024, 768, 32, 8), (16384, 2048, 768, 128, 8)):
        M = tokens * K
        keys = iter(jax.random.split(jax.random.key(0), 5))
        sizes = jnp.bincount(jax.random.randint(next(keys), (M,), 0, E), length=E)
        x = jax.random.normal(next(keys), (M, D), jnp.bfloat16)  # made on the device
        params = {name: jax.random.normal(next(keys), shape, jnp.bfloat16) / np.sqrt(shape[1])
                  for name, shape in (("gate_proj", (E, D, F)), ("up_proj", (E, D, F)),
                                      ("down_proj", (E, F, D)))}
        results = {}
        # megablox at moe.MEGABLOX_TILE (row tile, largest D/F tile), then other tiles.
        runs = [("ragged_dot", moe.MEGABLOX_TILE)] + [("megablox", tile) for tile in (
            moe.MEGABLOX_TILE, (128, 128), (256, 128), (1024, 256), (1024, 1024))]
        for kind, tile in runs:
            moe.MEGABLOX_TILE = tile  # read by moe._tiling as the step is traced
            config = moe.MoEConfig(E, K, F, matmul=kind)

            def loss(params, x):
                return jnp.sum(moe.expert_mlp(x, params, sizes, config, jnp.bfloat16)
                               .astype(jnp.float32))

            step = jax.jit(jax.grad(loss, (0, 1)))
            try:
                seconds = timed(step, params, x, iters=10)
            except Exception as e:  # a tile the kernel refuses: say so, go on
                print(json.dumps({"bench": "grouped_matmul_fwd_bwd", "matmul": kind,
                                  "tile": tile, "failed": str(e)[:200]}), flush=True)
                continue
            flops = 3 * 3 * 2 * M * D * F
            results[kind, tile] = seconds
            print(json.dumps({"bench": "grouped_matmul_fwd_bwd", "matmul": kind, "rows": M,
                              "D": D, "F": F, "experts": E, "ms": round(seconds * 1e3, 2),
                              "tflops": round(flops / seconds / 1e12, 1),
                              "tiling": None if kind == "ragged_dot" else moe._tiling(M, D, F),
                              "device": jax.devices()[0].device_kind}), flush=True)
        moe.MEGABLOX_TILE = runs[0][1]
        best = min((seconds, tile) for (kind, tile), seconds in results.items()
                   if kind == "megablox")
        print(json.dumps({"bench": "grouped_matmul_speedup", "experts": E, "D": D,
                          "best_megablox_tile": best[1], "megablox_over_ragged_dot": round(
                              results["ragged_dot", runs[0][1]] / best[0], 3)}))


def attention():
    from easylm.models.attention import attention as attend
    from easylm.models.config import ATTENTION_IMPLEMENTATIONS

    if "splash" not in ATTENTION_IMPLEMENTATIONS:
        print(json.dumps({"bench": "attention", "skipped": "no attention=splash in this tree"}))
        return
    for B, N, T, H in ((8, 16, 2048, 128), (2, 16, 8192, 128)):
        q, k, v = (jax.random.normal(key, (B, T, N, H), jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(0), 3))
        for kind in ("splash", "xla"):
            step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(  # noqa: B023
                attend(q, k, v, None, kind).astype(jnp.float32)), (0, 1, 2)))
            try:
                seconds = timed(step, q, k, v, iters=10)
            except Exception as e:  # the XLA path at 8192 may not fit: say so, go on
                print(json.dumps({"bench": "attention_fwd_bwd", "attention": kind,
                                  "shape": [B, N, T, H], "failed": str(e)[:200]}))
                continue
            flops = 3.5 * 4 * B * N * T * T * H / 2  # causal: half; fwd 2 matmuls, bwd 5
            print(json.dumps({"bench": "attention_fwd_bwd", "attention": kind,
                              "shape": [B, N, T, H], "ms": round(seconds * 1e3, 2),
                              "tflops": round(flops / seconds / 1e12, 1)}), flush=True)


def _scatter_dispatch(x, weights, experts, params, config, dtype):
    """moe.moe_local as it was at 0486088 (dropless): x[order // K], whose gradient XLA
    writes as a scatter-add, and rows put back in token order with a scatter."""
    K = config.num_experts_per_tok
    order = jnp.argsort(experts.reshape(-1), stable=True)
    sizes = jnp.bincount(experts.reshape(-1), length=config.num_experts)
    rows = moe.expert_mlp(x[order // K], params, sizes, config, dtype)
    unsorted = jnp.zeros_like(rows).at[order].set(rows).reshape(x.shape[0], K, -1)
    return jnp.einsum("nK,nKD->nD", weights.astype(rows.dtype), unsorted)


def moe_layer(N=16384, D=1024, F=768, E=32, K=8):
    keys = iter(jax.random.split(jax.random.key(0), 6))
    x = jax.random.normal(next(keys), (N, D), jnp.bfloat16)
    router = jax.random.normal(next(keys), (D, E), jnp.float32) * 0.02
    params = {name: jax.random.normal(next(keys), shape, jnp.bfloat16) / np.sqrt(shape[1])
              for name, shape in (("gate_proj", (E, D, F)), ("up_proj", (E, D, F)),
                                  ("down_proj", (E, F, D)))}
    config = moe.MoEConfig(E, K, F, matmul="ragged_dot")
    logits = jnp.einsum("ND,DE->NE", x.astype(jnp.float32), router)
    weights, experts = moe.route(logits, config)
    sizes = jnp.bincount(experts.reshape(-1), length=E)
    sorted_x = x[jnp.argsort(experts.reshape(-1), stable=True) // K]
    bf16 = jnp.bfloat16

    def total(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)),
                                tuple(range(2))))

    def routed(x, router):
        logits = jnp.einsum("ND,DE->NE", x.astype(jnp.float32), router)
        return moe.route(logits, config)[0]

    def sort(experts):
        order, inverse, sizes = moe._sort_pairs(experts, jnp.ones(experts.shape, bool), E)
        return order + inverse + sizes.sum()

    def dispatch(x, params):
        return moe.moe_local(x, weights, experts, params, config, bf16)[0]

    def grouped(x, params):
        return moe.expert_mlp(x, params, sizes, config, bf16)

    parts = [
        ("router_and_route", total(routed), (x, router)),
        ("sort_and_inverse", jax.jit(sort), (experts,)),
        ("grouped_matmuls", total(grouped), (sorted_x, params)),
        ("dispatch", total(dispatch), (x, params)),
        ("dispatch_scatter_0486088", total(lambda x, p: _scatter_dispatch(
            x, weights, experts, p, config, bf16)), (x, params)),
    ]
    for name, fn, args in parts:
        try:
            seconds = timed(fn, *args, iters=10)
        except Exception as e:
            print(json.dumps({"bench": "moe_layer_fwd_bwd", "part": name,
                              "failed": str(e)[:300]}), flush=True)
            continue
        print(json.dumps({"bench": "moe_layer_fwd_bwd", "part": name, "tokens": N, "D": D,
                          "F": F, "experts": E, "top_k": K, "ms": round(seconds * 1e3, 2)}),
              flush=True)


if __name__ == "__main__":
    {"grouped_matmul": grouped_matmul, "attention": attention,
     "moe_layer": moe_layer}[sys.argv[1]](*map(int, sys.argv[2:]))  # moe_layer N D F E K
