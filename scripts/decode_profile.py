"""Where a decode step's time goes: the engine's decode calls timed per cache window,
back to back (the device alone, no host between calls) and one call at a time (what
the host adds), then a few traced with the profiler and summarised
(easylm/runtime/profiling.py).

    python scripts/decode_profile.py --base_model=llama_1b --batches=1,64 --out=DIR

One JSON line per batch: per window, ms per step (device-bound) and ms per step with a
host read after each call; the weights' bytes over 819 GB/s for comparison; the trace's
top HLO ops.
"""

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.runtime import profiling
from easylm.serving import engine as engine_lib


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base_model", default="debug")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt_length", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--page_size", type=int, default=0)
    parser.add_argument("--decode_from_pages", action="store_true",
                        help="the engine's --decode_from_pages (with --page_size)")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    model = FAMILY.bind(LLaMAConfig.from_preset(args.base_model), jnp.bfloat16, jnp.bfloat16)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    for batch in map(int, args.batches.split(",")):
        S = args.prompt_length + args.new_tokens
        engine = engine_lib.Engine({"batch_size": batch, "seq_length": S,
                                    "min_bucket": args.prompt_length,
                                    "page_size": args.page_size,
                                    "decode_from_pages": args.decode_from_pages},
                                   model, params)
        line = engine.warmup(sample=(False,), score=False)
        print(line, flush=True)
        sampling = engine_lib.Sampling.empty(batch)
        rng = np.random.default_rng(batch)
        prompts = rng.integers(3, model.vocab_size, (batch, args.prompt_length)).tolist()
        row = {"batch": batch, "weights_gb": weight_bytes / 1e9,
               "weights_ms_at_819": weight_bytes / 819e9 * 1e3, "windows": {}}
        steps = engine.config.decode_steps
        for length in engine.decode_buckets:
            engine.reset()
            engine.fetch(engine.prefill(prompts, list(range(batch)), sampling))
            engine.positions[:] = min(args.prompt_length, length - steps)
            jax.block_until_ready(engine._decode(sampling, length))
            start = time.perf_counter()
            outs = [engine._decode(sampling, length) for _ in range(args.calls)]
            jax.block_until_ready(outs)
            device = (time.perf_counter() - start) / (args.calls * steps) * 1e3
            start = time.perf_counter()
            for _ in range(args.calls):
                engine.fetch(engine._decode(sampling, length))
            synced = (time.perf_counter() - start) / (args.calls * steps) * 1e3
            row["windows"][length] = {"device_ms_per_step": device, "synced_ms_per_step": synced}
            print(json.dumps({"batch": batch, "window": length, **row["windows"][length]}),
                  flush=True)
        length = engine.decode_buckets[len(engine.decode_buckets) // 2]
        trace_dir = tempfile.mkdtemp()
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready([engine._decode(sampling, length) for _ in range(2)])
        try:
            summary = profiling.summarize_trace(trace_dir, 2 * steps)
            row["profile_window"] = length
            row["profile"] = {k: v for k, v in summary.items() if k != "trace"}
        except Exception as e:  # a summary is a bonus: the timings stand without it
            row["profile_error"] = repr(e)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(os.path.join(args.out, f"decode_profile_b{batch}.json"), "w") as f:
                json.dump(row, f)


if __name__ == "__main__":
    main()
