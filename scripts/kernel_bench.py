"""Forward+backward timings of the kernels behind two implementation flags, one JSON
line each (run by scripts/tpu_bench.sh; any backend, meant for a TPU):

    python scripts/kernel_bench.py grouped_matmul   # moe_matmul: megablox vs ragged_dot
    python scripts/kernel_bench.py attention        # attention: splash vs xla (if built)

grouped_matmul times (on a device; scripts/bench_moe.py compares ragged_dot with a dense
einsum on CPU) the experts' three grouped matmuls (gate, up, down) and their
gradients through `moe.expert_mlp` in bf16, the rows routed evenly at random, at the
small MoE's shape (d 1024, 32 experts top-8, expert width 768, 16k tokens) and at 128
experts d 2048; TFLOP/s counts 3 matmuls x 3 (forward, dx, dw) x 2 M D F.
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


if __name__ == "__main__":
    {"grouped_matmul": grouped_matmul, "attention": attention}[sys.argv[1]]()
