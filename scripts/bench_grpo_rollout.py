"""GRPO's rollout phase against the serving engine's own batched generation.

    python scripts/bench_grpo_rollout.py                       # the debug preset, 64 rows
    python scripts/bench_grpo_rollout.py --hidden_size=256 --layers=4 --rows=128

Both generate `--rows` completions of exactly `--new_tokens` sampled tokens (no stop
token, so both do the same work) from prompts of `--prompt_tokens`, on one engine shape
(batch_size = rows, seq_length = prompt + new tokens):

rollout  easylm.objectives.rollouts.generate: one prefill, then decode calls over the whole
         cache, each dispatched before the previous one's tokens are read (what every
         GRPO step runs)
batcher  easylm.serving.batcher.Batcher.generate: the server's continuous batching over
         the same requests, all queued before it starts

Each is timed --repeats times after a warm-up (compilation), in turns so that both see
the machine's load alike; prints the medians in tokens/s and their ratio (acceptance:
rollout >= 0.8 x batcher).

    python scripts/bench_grpo_rollout.py --what=sharing --base_model=qwen3_0.6b \
        --dtype=bf16 --rows=64 --group=8 --prompt_tokens=512 --new_tokens=256

--what=sharing times the rollout alone with the engine's share_prompts on and off: rows
/ group prompts, each repeated `group` times as GRPO's groups are (on: each prompt
prefilled once and its cache copied; off: every copy prefilled).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.data.tokenizer import load_tokenizer
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.objectives.rollouts import generate, sampling_keys
from easylm.serving import engine as engine_lib
from easylm.serving.batcher import Batcher, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden_size", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--what", choices=("batcher", "sharing"), default="batcher")
    parser.add_argument("--base_model", default="debug", help="a LLaMA-family preset")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--group", type=int, default=1, help="completions per prompt")
    args = parser.parse_args()
    shape = {}
    if args.hidden_size:
        shape.update(hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 8 // 3,
                     num_attention_heads=4, num_key_value_heads=4)
    if args.layers:
        shape.update(num_hidden_layers=args.layers)
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    model = FAMILY.bind(LLaMAConfig.from_preset(args.base_model, **shape), dtype, dtype)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    seq_length = args.prompt_tokens + args.new_tokens
    config = {"batch_size": args.rows, "seq_length": seq_length,
              "min_bucket": args.prompt_tokens}
    rng = np.random.default_rng(0)
    distinct = [[1, *rng.integers(3, 512, args.prompt_tokens - 1).tolist()]
                for _ in range(args.rows // args.group)]
    prompts = [prompt for prompt in distinct for _ in range(args.group)]
    tokens = args.rows * args.new_tokens
    if args.what == "sharing":
        return sharing(args, config, model, params, prompts, tokens)

    engine = engine_lib.Engine(config, model, params)
    sampling = engine_lib.Sampling.empty(args.rows)
    sampling.keys[:] = sampling_keys(0, 0, 0, 0, args.rows)
    sampling.temperature[:] = 1.0

    def rollout():
        engine.reset()
        out, _ = generate(engine, prompts, sampling, args.new_tokens, eos_id=None)
        assert sum(map(len, out)) == tokens

    batcher = Batcher(engine_lib.Engine(config, model, params)).start()
    tokenizer = load_tokenizer("embedded")
    request = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0)

    def batched():
        out = batcher.generate(prompts, request, tokenizer)
        assert sum(len(g.tokens) for g in out) == tokens

    times = {"rollout": [], "batcher": []}
    try:
        rollout(), batched()  # compile
        for _ in range(args.repeats):
            for name, fn in (("rollout", rollout), ("batcher", batched)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    finally:
        batcher.stop()
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    print(f"{args.rows} rows x {args.new_tokens} new tokens after {args.prompt_tokens}, "
          f"{jax.devices()[0].platform}: rollout {rates['rollout']:,.0f} tokens/s, batcher "
          f"{rates['batcher']:,.0f} tokens/s, ratio {rates['rollout'] / rates['batcher']:.2f}")


def sharing(args, config, model, params, prompts, tokens):
    """Rollout tokens/s with share_prompts on and off (medians of --repeats after the
    engine's warm-up), timed in turns on one engine (the flag is read at each prefill:
    the same programs serve both)."""
    began = time.perf_counter()
    engine = engine_lib.Engine(config, model, params)
    print(engine.warmup(sample=(True,), score=False), flush=True)
    sampling = engine_lib.Sampling.empty(args.rows)
    sampling.keys[:] = sampling_keys(0, 0, 0, 0, args.rows)
    sampling.temperature[:] = 1.0
    times, prefilled = {True: [], False: []}, {}

    def rollout(share):
        engine.reset()
        engine.config.share_prompts = share
        out, _ = generate(engine, prompts, sampling, args.new_tokens, eos_id=None)
        assert sum(map(len, out)) == tokens
        prefilled[share] = engine.prompt_tokens["prefilled"]

    for share in (True, False):
        rollout(share)  # untimed
        print(f"share_prompts={share}: a first rollout done {time.perf_counter() - began:.1f}s "
              f"after the engine's start", flush=True)
    for _ in range(args.repeats):
        for share in (True, False):
            start = time.perf_counter()
            rollout(share)
            times[share].append(time.perf_counter() - start)
    rates = {share: tokens / statistics.median(t) for share, t in times.items()}
    print(f"{args.base_model} {args.dtype}, {args.rows // args.group} prompts x {args.group} "
          f"completions of {args.new_tokens} tokens after {args.prompt_tokens}, "
          f"{jax.devices()[0].platform}: sharing on {rates[True]:,.0f} tokens/s "
          f"({prefilled[True]:,} prompt tokens prefilled), off {rates[False]:,.0f} tokens/s "
          f"({prefilled[False]:,}), ratio {rates[True] / rates[False]:.2f}")


if __name__ == "__main__":
    main()
