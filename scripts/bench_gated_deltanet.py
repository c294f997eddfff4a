"""Chunked vs token-by-token Gated DeltaNet on one CPU row: same outputs, time, memory.

    JAX_PLATFORMS=cpu python scripts/bench_gated_deltanet.py [--length 2048]

One layer of Qwen3.5's linear-attention shape scaled down (value heads 2 x key heads,
head dims 64), fp32, batch 1: the forward's median wall time over a few runs after the
compile, XLA's temporary bytes for each program, and the largest output difference; the
same for a training step's forward and backward (the gradient of the outputs' sum).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig

CONFIG = GatedDeltaNetConfig(hidden_size=256, linear_num_key_heads=4, linear_num_value_heads=8,
                             linear_key_head_dim=64, linear_value_head_dim=64)


def timed(fn, *args, repeats: int = 5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args()
    x = jax.random.normal(jax.random.PRNGKey(0), (1, args.length, CONFIG.hidden_size))
    params = GatedDeltaNet(CONFIG).init(jax.random.PRNGKey(1), x[:, :8])["params"]
    for step in ("forward", "forward+backward"):
        results = {}
        for form in ("chunked", "recurrent"):
            def forward(p, x, form=form):
                return GatedDeltaNet(CONFIG, form=form).apply({"params": p}, x)[0]
            fn = jax.jit(forward if step == "forward" else jax.grad(lambda p, x, f=forward:
                                                                     f(p, x).sum(), 1))
            temp = fn.lower(params, x).compile().memory_analysis().temp_size_in_bytes
            results[form] = (timed(fn, params, x), temp, fn(params, x))
        for form, (seconds, temp, _) in results.items():
            print(f"{step:16s} {form:9s} {seconds * 1e3:8.1f} ms   temp {temp / 2**20:6.1f} MiB")
        chunked, recurrent = results["chunked"], results["recurrent"]
        difference = float(jnp.abs(chunked[2] - recurrent[2]).max())
        size = float(jnp.abs(recurrent[2]).max())
        print(f"{step}: token-by-token / chunked time {recurrent[0] / chunked[0]:.2f}x, max "
              f"|difference| {difference:.2g} of values up to {size:.2g}")


if __name__ == "__main__":
    main()
