"""What the batcher's scheduling costs: --decode_steps, scoring and long prompts next to
generation.

    python scripts/bench_serving_batcher.py --what=steps                # the debug preset
    python scripts/bench_serving_batcher.py --hidden_size=256 --layers=4  # steps, scoring
    python scripts/bench_serving_batcher.py --what=long_prompt --seq_length=8448 \
        --long_prompt=8192 --prefill_chunk_size=512

steps    tokens/s of one batch of greedy requests at several --decode_steps, every
         engine in this process and timed in turns (so the ratios share the machine's
         load), and when a stream's first two events arrive.
scoring  a 4-token greedy request alone, next to a 100-window rolling log-likelihood
         job scored in chunks (`Batcher.score`, what the server does), and next to the
         same job run in one piece (`Batcher.run`, what the server did before).
long_prompt  --batch - 1 greedy streams running; a --long_prompt-token prompt arrives:
         the largest gap between two events (tokens) of a stream, and the streams'
         tokens/s, while it is prefilled (submitted to its first token) against the
         same streams before it came, and its time to first token.

Prints one line per measurement (medians of --repeats), ratios included.
"""

import argparse
import statistics
import threading
import time

import jax
import numpy as np

from easylm.data.tokenizer import load_tokenizer
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.serving import engine as engine_lib, scoring
from easylm.serving.batcher import Batcher, Generation, SamplingParams


def model(args):
    shape = {"max_position_embeddings": max(512, args.seq_length)}
    if args.hidden_size:
        shape.update(hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 8 // 3,
                     num_attention_heads=4, num_key_value_heads=4)
    if args.layers:
        shape.update(num_hidden_layers=args.layers)
    config = LLaMAConfig.from_preset("debug", **shape)
    fns = FAMILY.bind(config)
    return fns, jax.jit(fns.init_params)(jax.random.PRNGKey(0))


def batcher(fns, params, args, decode_steps):
    config = {"batch_size": args.batch, "seq_length": args.seq_length,
              "decode_steps": decode_steps, "min_bucket": args.seq_length}
    return Batcher(engine_lib.Engine(config, fns, params)).start()


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def steps(args, fns, params, tokenizer):
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 500, args.seq_length // 2).tolist() for _ in range(args.batch)]
    greedy = SamplingParams(max_tokens=args.seq_length // 2, temperature=0.0)
    batchers = {n: batcher(fns, params, args, n) for n in (1, 4, 8, 16)}
    times = {n: [] for n in batchers}
    for b in batchers.values():
        b.generate(prompts, greedy, tokenizer)  # compile
    for _ in range(args.repeats):
        for n, b in batchers.items():
            times[n].append(timed(lambda: b.generate(prompts, greedy, tokenizer)))
    tokens = args.batch * greedy.max_tokens
    for n in batchers:
        print(f"decode_steps={n:<2d}  {tokens / statistics.median(times[n]):8.0f} tokens/s  "
              f"{statistics.median(times[8]) / statistics.median(times[n]):.2f}x of decode_steps=8")
    stream = batchers[8]
    stream.generate(prompts[:1], greedy, tokenizer)  # compile the one-row prefill
    for _ in range(args.repeats):
        stamps, done = [], threading.Event()

        def on_event(event):
            stamps.append((time.perf_counter(), len(event.tokens)))
            if event.finish_reason:
                done.set()

        start = time.perf_counter()
        stream.submit(Generation(prompts[0], greedy, tokenizer, on_event))
        done.wait()
        print(f"stream at decode_steps=8: first event after {1e3 * (stamps[0][0] - start):.1f} ms "
              f"({stamps[0][1]} token), second after {1e3 * (stamps[1][0] - start):.1f} ms "
              f"({stamps[1][1]} tokens)")
    for b in batchers.values():
        b.stop()


def scoring_next_to_generation(args, fns, params, tokenizer):
    b = batcher(fns, params, args, 8)
    text = np.random.RandomState(0).randint(3, 500, 100 * args.seq_length).tolist()
    job = scoring.loglikelihood_rolling_job(args.seq_length, 1, [text])
    request = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = [1, 5, 6, 7]

    def alone():
        return timed(lambda: b.generate([prompt], request, tokenizer))

    def next_to_job(chunked: bool):
        running = b.score(job.tokens, job.targets) if chunked else b.run(scoring.run, b.engine, job)
        while not chunked and not running.running():  # the job has the batcher's thread
            time.sleep(0.001)
        took = alone()
        running.result()
        return took

    alone(), b.score(job.tokens[:1], job.targets[:1]).result()  # compile
    rows = [(alone(), next_to_job(True), next_to_job(False)) for _ in range(args.repeats)]
    a, c, w = (statistics.median(x) for x in zip(*rows))
    print(f"{len(job.tokens)} windows of {args.seq_length}: a 4-token request alone {a:.3f} s; "
          f"next to the job in chunks {c:.3f} s ({c / a:.1f}x); in one piece {w:.3f} s "
          f"({w / a:.1f}x)")
    b.stop()


def long_prompt_next_to_streams(args, fns, params, tokenizer):
    config = {"batch_size": args.batch, "seq_length": args.seq_length, "decode_steps": 8,
              "min_bucket": 16, "prefill_chunk_size": args.prefill_chunk_size}
    engine = engine_lib.Engine(config, fns, params)
    engine.compile_decode(engine_lib.Sampling.empty(args.batch))  # every decode window
    engine.reset()
    b = Batcher(engine).start()
    rng = np.random.RandomState(0)
    long = [1] + rng.randint(3, 500, args.long_prompt - 1).tolist()
    short = [[1] + rng.randint(3, 500, 15).tolist() for _ in range(args.batch - 1)]
    first = SamplingParams(max_tokens=2, temperature=0.0)
    b.generate([long] + short, first, tokenizer)  # compile, the decode windows too
    stream = SamplingParams(max_tokens=args.seq_length - 16, temperature=0.0)  # cancelled
    for _ in range(args.repeats):
        stamps = [[] for _ in short]
        gens = [Generation(p, stream, tokenizer, lambda e, s=s: s.append((time.perf_counter(), len(e.tokens))))
                for p, s in zip(short, stamps)]
        for g in gens:
            b.submit(g)
        while not all(len(s) > 2 for s in stamps):  # every stream decoding
            time.sleep(0.005)
        time.sleep(args.steady)  # the streams alone: the baseline
        arrived, first_token = time.perf_counter(), threading.Event()
        b.submit(Generation(long, first, tokenizer, lambda e: first_token.set()))
        first_token.wait()
        done = time.perf_counter()
        for g in gens:
            b.cancel(g)

        def window(start, end):  # (largest gap in s, stream tokens/s) within [start, end]
            gaps, tokens = [], 0
            for s in stamps:
                inside = [t for t, _ in s if start <= t <= end]
                before = [t for t, _ in s if t < start][-1:]
                gaps += np.diff(before + inside + [end]).tolist()
                tokens += sum(n for t, n in s if start <= t <= end)
            return max(gaps), tokens / (end - start)

        alone = window(arrived - args.steady, arrived)
        during = window(arrived, done)
        print(f"{len(short)} streams; a {len(long)}-token prompt in chunks of "
              f"{args.prefill_chunk_size}: first token after {done - arrived:.2f} s; largest "
              f"gap between a stream's tokens {1e3 * during[0]:.0f} ms ({1e3 * alone[0]:.0f} ms "
              f"before it came), streams {during[1]:.0f} tokens/s ({alone[1]:.0f} before)")
        while any(g.finish_reason is None for g in gens):
            time.sleep(0.005)
    b.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("steps", "scoring", "both", "long_prompt"),
                        default="both")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_length", type=int, default=256)
    parser.add_argument("--hidden_size", type=int, default=0, help="0: the debug preset's")
    parser.add_argument("--layers", type=int, default=0, help="0: the debug preset's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long_prompt", type=int, default=8192, help="long_prompt's length")
    parser.add_argument("--prefill_chunk_size", type=int, default=512, help="for long_prompt")
    parser.add_argument("--steady", type=float, default=1.0,
                        help="long_prompt: seconds of the streams alone, the baseline")
    args = parser.parse_args()
    fns, params = model(args)
    tokenizer = load_tokenizer("embedded")
    if args.what in ("steps", "both"):
        steps(args, fns, params, tokenizer)
    if args.what in ("scoring", "both"):
        scoring_next_to_generation(args, fns, params, tokenizer)
    if args.what == "long_prompt":
        long_prompt_next_to_streams(args, fns, params, tokenizer)


if __name__ == "__main__":
    main()
