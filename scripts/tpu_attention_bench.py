"""Attention forward+backward on one TPU chip, bf16: splash (easylm/models/splash.py)
against the XLA paths (jax.nn.dot_product_attention's XLA implementation, and easylm's
einsum reference `xla`), all through `easylm.models.attention.attention`. One JSON line a
measurement. Run from the repository root on the TPU machine:

    python scripts/tpu_attention_bench.py [--quick]

FLOPs counted as the issue counts them: causal forward+backward = 3.5 x 2 B N T^2 H
(forward 2 matmuls, backward 5, over half the square). A shape whose XLA path does not fit
prints its error's first line instead.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models import attention as attention_lib, splash

SHAPES = [(8, 16, 2048, 128), (2, 16, 8192, 128), (1, 16, 32768, 128)]


def step(implementation, window=0):
    def loss(q, k, v, dout):
        out = attention_lib.attention(q, k, v, None, implementation, window)
        return jnp.sum(out.astype(jnp.float32) * dout)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(implementation, shape, window=0, repeats=10, **extra):
    B, N, T, H = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (B, T, N, H), jnp.bfloat16) for key in keys)
    dout = dout.astype(jnp.float32)
    record = {"implementation": implementation, "shape_BNTH": list(shape), "window": window,
              **extra}
    try:
        fn = step(implementation, window)
        jax.block_until_ready(fn(q, k, v, dout))
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(q, k, v, dout)
        jax.block_until_ready(out)
        ms = (time.perf_counter() - start) / repeats * 1e3
        visible = T * T / 2 if not window else T * min(window, T)
        flop = 3.5 * 2 * 2 * B * N * visible * H
        record |= {"ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1)}
    except Exception as error:  # out of memory: say so and go on
        record["error"] = str(error).splitlines()[0][:300]
    print(json.dumps(record), flush=True)
    return record


def main(argv):
    print(json.dumps({"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}))
    quick = "--quick" in argv
    base = SHAPES[0]
    splash_ms = measure("splash", base)
    xla_ms = measure("dot_product", base)
    measure("xla", base)
    if "ms" in splash_ms and "ms" in xla_ms:
        print(json.dumps({"speedup_splash_over_dot_product": round(xla_ms["ms"] / splash_ms["ms"], 2)}))
    for shape in SHAPES[1:]:
        measure("splash", shape)
    if quick:
        return
    measure("splash", base, window=512)
    for blocks in [(1024, 512, 256, 128), (256, 128)]:
        splash.BLOCKS = blocks
        measure("splash", base, blocks=blocks[0])
        measure("splash", SHAPES[1], blocks=blocks[0])
    measure("dot_product", SHAPES[1])


if __name__ == "__main__":
    main(sys.argv[1:])
