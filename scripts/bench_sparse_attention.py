"""DeepSeek sparse attention, one layer's attention step over a long cache: the masked
form (full MLA over every cached key, the indexer's top-k a mask) against the gathered
one (only the kept keys' latents), `--deepseek_v32.topk_attention=mask|gather`, in one
process, as a ratio (easylm/models/sparse_attention.py).

    python scripts/bench_sparse_attention.py --cases=decode:32:32768,extend:1:32768:256
    python scripts/bench_sparse_attention.py --cases=train:1:2048:256

A case `train:batch:queries:block` times one layer's training gradient without a cache,
the masked form all queries at once against `block` at a time (`query_block`), with
XLA's compiled temporaries of each (not yet run on the TPU; at V3.2's shape the whole
form's (128, T, T) fp32 scores alone are 2 GiB at T = 2048, 8 GiB at 4096).

Each case `kind:batch:cache[:queries]` runs `SparseLatentAttention` at DeepSeek-V3.2's
shape (the `deepseek_v3_2` preset: 128 heads, latent 512 + 64, indexer 64 x 128, top-k
2048), bf16, over a full cache of random rows, queries at the cache's last positions;
the cache is donated and passed back, as the engine does. Prints one JSON line a case
(and writes them to --out): the median of --iters calls of each form, their ratio, and
the FLOP and byte counts of both (attention and indexer, not the projections).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models import registry
from easylm.models.decoder import rotary_embedding
from easylm.models.sparse_attention import IndexedLatentCache, SparseLatentAttention


def counts(config, T: int, S: int, gather: bool) -> dict:
    """Per row: attention and indexer FLOPs (absorbed for decode and the gather; expanded
    for a masked chunk, as MLA picks) and the cache bytes read (bf16)."""
    mla = config.mla()
    C, R, N = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.num_attention_heads
    P, V, k = mla.qk_nope_head_dim, mla.v_head_dim, min(config.index_topk, S)
    indexer = 2 * T * S * config.index_n_heads * config.index_head_dim
    absorbs = T * (2 * C - P - V) < C * (P + V)
    if gather or absorbs:
        keys = k if gather else S
        flops = 2 * T * keys * N * (2 * C + R) + 2 * T * N * C * (P + V)
        latent = (T * k if gather else S) * (C + R) * 2
    else:
        flops = 2 * S * N * C * (P + V) + 2 * T * S * N * (P + R + V)
        latent = S * (C + R) * 2
    return {"flops": flops + indexer, "bytes": latent + S * config.index_head_dim * 2}


def run_case(config, params_of, kind: str, B: int, S: int, T: int, iters: int) -> dict:
    dtype = jnp.bfloat16
    positions = jnp.broadcast_to(S - T + jnp.arange(T, dtype=jnp.int32), (B, T))
    inv_freq, factor = config.mla().rope()
    cos, sin = rotary_embedding(positions, jnp.asarray(inv_freq), dtype, factor)
    mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, config.hidden_size), dtype)
    times, out = {}, {}
    for mode in ("mask", "gather"):
        module = SparseLatentAttention(config.mla(), dtype, dtype, indexer=config.indexer(),
                                       gather=mode)
        params = params_of(module, x, cos, sin, positions, mask)
        cache = IndexedLatentCache.init(config.mla(), config.indexer(), B, S, dtype)
        keys = jax.random.split(jax.random.PRNGKey(2))
        cache = cache._replace(kv=jax.random.normal(keys[0], cache.kv.shape, dtype),
                               index_k=jax.random.normal(keys[1], cache.index_k.shape, dtype))

        def step(params, cache, module=module):
            y, cache, _ = module.apply({"params": params}, x, cos, sin, positions, mask, cache)
            return y, cache

        step = jax.jit(step, donate_argnums=1)
        y, cache = step(params, cache)  # compile
        y.block_until_ready()
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            y, cache = step(params, cache)
            y.block_until_ready()
            samples.append(time.perf_counter() - start)
        times[mode] = float(np.median(samples))
        out[mode] = y
        del cache
    same = float(jnp.max(jnp.abs(out["mask"].astype(jnp.float32)
                                 - out["gather"].astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(out["mask"].astype(jnp.float32))))
    dense, sparse = counts(config, T, S, False), counts(config, T, S, True)
    return {"case": kind, "batch": B, "cache": S, "queries": T,
            "mask_ms": times["mask"] * 1e3, "gather_ms": times["gather"] * 1e3,
            "speedup": times["mask"] / times["gather"],
            "flops_ratio": dense["flops"] / sparse["flops"],
            "bytes_ratio": dense["bytes"] / sparse["bytes"],
            "max_abs_difference": same, "max_abs_output": scale,
            "device": jax.devices()[0].device_kind}


def run_train_case(config, params_of, B: int, T: int, block: int, iters: int) -> dict:
    """One layer's training step without a cache (forward and gradient of the parameters
    and the input), all T queries at once against `block` at a time (`query_block`):
    their times and XLA's compiled temporaries."""
    dtype = jnp.bfloat16
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    inv_freq, factor = config.mla().rope()
    cos, sin = rotary_embedding(positions, jnp.asarray(inv_freq), dtype, factor)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, config.hidden_size), dtype)
    times, temp, out = {}, {}, {}
    for name, b in (("whole", 0), ("blocks", block)):
        module = SparseLatentAttention(config.mla(), dtype, dtype, indexer=config.indexer(),
                                       gather="mask", query_block=b)
        params = params_of(module, x, cos, sin, positions, None)

        def loss(params, x, module=module):
            y = module.apply({"params": params}, x, cos, sin, positions)[0]
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        temp[name] = step.lower(params, x).compile().memory_analysis().temp_size_in_bytes
        grads = step(params, x)
        jax.block_until_ready(grads)
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(step(params, x))
            samples.append(time.perf_counter() - start)
        times[name], out[name] = float(np.median(samples)), grads[1]
    same = float(jnp.max(jnp.abs(out["whole"].astype(jnp.float32)
                                 - out["blocks"].astype(jnp.float32))))
    return {"case": "train", "batch": B, "queries": T, "query_block": block,
            "whole_ms": times["whole"] * 1e3, "blocks_ms": times["blocks"] * 1e3,
            "whole_temp_gib": temp["whole"] / 2 ** 30, "blocks_temp_gib": temp["blocks"] / 2 ** 30,
            "max_abs_difference_dx": same, "device": jax.devices()[0].device_kind}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="decode:32:32768,extend:1:32768:256")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="")
    parser.add_argument("--preset", default="deepseek_v3_2", help="debug: a CPU smoke run")
    args = parser.parse_args()
    config = registry.get("deepseek_v32").from_preset(args.preset)
    cached = {}

    def params_of(module, x, cos, sin, positions, mask):  # one set for both forms
        if "params" not in cached:  # without a cache: the expanded form makes kv_b_proj
            cached["params"] = jax.jit(lambda: module.init(
                jax.random.PRNGKey(0), x, cos, sin, positions)["params"])()
        return cached["params"]

    for case in args.cases.split(","):
        kind, B, S, *T = case.split(":")
        if kind == "train":  # train:batch:queries:block
            result = run_train_case(config, params_of, int(B), int(S), int(T[0]), args.iters)
        else:
            result = run_case(config, params_of, kind, int(B), int(S), int(T[0]) if T else 1,
                              args.iters)
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
