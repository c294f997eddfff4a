"""Data pipeline speed against raw `tokenizers` batch encoding of the same text.

    python -m easylm.data.throughput [--path=embedded] [--tokenizer=embedded] [--workers=1,2]
        [--copies=4] [--cache_processes=1,2] [--mixture=mix.json]

Raw: `Tokenizer.encode_batch_fast` over every document's text, the ceiling for any
pipeline that tokenizes on the fly. Pipeline: `DatasetFactory` with the default text
processor (BOS/EOS, loss masks), packing and batching, read for `epochs` passes over
the same file, timed from its first batch so worker start-up is not counted. Cache
build: `python -m easylm.data.cache` of the same file with each of `cache_processes`
worker processes, timed whole (worker start-up included). Cache pipeline: the same
batches read from that cache, with no tokenizer in the loop. `copies` repeats the
corpus so that start-up weighs less; `mixture` also times a mixture's pipeline.

Rust tokenizers use every core unless TOKENIZERS_PARALLELISM=false; set it to compare
one worker with one core of raw encoding.
"""

import json
import os
import sys
import tempfile
import time

from ml_collections import ConfigDict

from easylm import flags
from easylm.data.dataset import DatasetFactory
from easylm.data.sources import expand_paths
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import exit_on_user_error
from easylm.runtime import run_flags


def raw_tokens_per_second(tokenizer, texts, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        encodings = tokenizer.backend_tokenizer.encode_batch_fast(
            texts, add_special_tokens=False)
        best = min(best, time.perf_counter() - start)
    return sum(len(e.ids) for e in encodings) / best


def pipeline_tokens_per_second(tokenizer, config, num_tokens, min_seconds=2.0):
    """Reads at least num_tokens target tokens and min_seconds from the dataset config."""
    dataset = DatasetFactory.load_dataset(config, tokenizer, process_index=0,
                                          process_count=1)
    batches = iter(dataset)
    next(batches)   # start-up: worker processes, first window
    start, tokens = time.perf_counter(), 0
    while tokens < num_tokens or time.perf_counter() - start < min_seconds:
        batch, _ = next(batches)
        tokens += batch["target_tokens"].size
    seconds = time.perf_counter() - start
    dataset.close()
    return tokens / seconds


def bench_data(path="embedded", tokenizer="embedded", workers=(1, 2), seq_length=1024,
               batch_size=8, epochs=3, copies=1, cache_processes=(), mixture="", seconds=2.0):
    """Returns {'raw', 'pipeline_<w>', 'cache_build_<p>', 'cache_build_<p>_started' (after
    the workers started), 'cache_pipeline', 'mixture_pipeline': tokens/s; 'ratio_<key>':
    that / raw; 'cache_build_<p>_seconds', 'cache_build_<p>_start_seconds'}."""
    tokenizer = load_tokenizer(tokenizer)
    lines = []
    for file in expand_paths(path):
        with open(file, encoding="utf-8") as f:
            lines += [line for line in f if line.strip()]
    texts = [json.loads(line)["text"] for line in lines] * copies
    results = {"raw": raw_tokens_per_second(tokenizer, texts),
               "documents": len(texts),
               "tokens": sum(len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch_fast(
                   texts, add_special_tokens=False))}
    num_tokens = epochs * results["tokens"]
    loader = dict(seq_length=seq_length, batch_size=batch_size)
    with tempfile.TemporaryDirectory() as scratch:
        corpus = os.path.join(scratch, "corpus.jsonl")
        with open(corpus, "w", encoding="utf-8") as f:
            f.writelines(lines * copies)
        text = DatasetFactory.get_default_config({"json_dataset": dict(loader, path=corpus)})
        for w in workers:
            text.json_dataset.tokenizer_processes = w
            results[f"pipeline_{w}"] = pipeline_tokens_per_second(tokenizer, text, num_tokens,
                                                                   seconds)
        text.json_dataset.tokenizer_processes = 1
        cache = None
        for p in cache_processes:
            from easylm.data.cache import build

            cache = os.path.join(scratch, f"cache{p}")
            # About four shards per process, so that every process has work to the end.
            index = build(text, tokenizer, cache, -(-len(texts) // (4 * max(cache_processes))),
                          p, progress=False)
            took, start = index["build_seconds"], index["start_seconds"]
            results[f"cache_build_{p}_seconds"] = took
            results[f"cache_build_{p}_start_seconds"] = start
            results[f"cache_build_{p}"] = results["tokens"] / took
            results[f"cache_build_{p}_started"] = results["tokens"] / (took - start)
        if cache is not None:
            cached = DatasetFactory.get_default_config(
                {"type": "cache", "cache": dict(loader, path=cache)})
            results["cache_pipeline"] = pipeline_tokens_per_second(tokenizer, cached,
                                                                   num_tokens, seconds)
    if mixture:
        mixed = DatasetFactory.get_default_config(
            {"type": "mixture", "mixture": dict(loader, sources=mixture)})
        results["mixture_pipeline"] = pipeline_tokens_per_second(tokenizer, mixed, num_tokens,
                                                                 seconds)
    for key in list(results):
        if key.startswith(("pipeline_", "cache_pipeline", "mixture_pipeline", "cache_build_")) \
                and not key.endswith("seconds"):
            results[f"ratio_{key}"] = results[key] / results["raw"]
    return results


HELP = {
    "path": "JSON-lines data ('embedded', a path, a glob, a comma-separated list)",
    "tokenizer": run_flags.help_text("tokenizer"),
    "workers": "comma-separated tokenizer_processes values to measure",
    "seq_length": "tokens per row", "batch_size": "rows per batch",
    "epochs": "passes over the data per measurement",
    "copies": "repeat the corpus this many times (less weight on start-up)",
    "cache_processes": "comma-separated worker counts to build a token cache of the data "
                       "with, then read from it ('' = no cache)",
    "mixture": "also time a mixture: a .json/.yaml file of sources, or the JSON itself",
    "seconds": "read each pipeline for at least this long",
}


def default_config():
    return ConfigDict(dict(path="embedded", tokenizer="embedded", workers="1,2",
                           seq_length=1024, batch_size=8, epochs=3, copies=1,
                           cache_processes="1,2", mixture="", seconds=2.0))


def _counts(spec):
    return [int(w) for w in spec.split(",") if w.strip()]


@exit_on_user_error
def main(argv=None):
    usage = ("usage: python -m easylm.data.throughput [--workers=1,2] [--path=...] "
             "[--cache_processes=1,2] [--mixture=...]")
    argv = argv or sys.argv
    c = flags.parse(default_config(), HELP, argv, usage)
    r = bench_data(c.path, c.tokenizer, _counts(c.workers), c.seq_length, c.batch_size,
                   c.epochs, c.copies, _counts(c.cache_processes), c.mixture, c.seconds)
    threads = os.environ.get("TOKENIZERS_PARALLELISM", "true (default)")
    print(f"TOKENIZERS_PARALLELISM={threads}; {os.cpu_count()} CPUs; {r['documents']:,} "
          f"documents, {r['tokens']:,} tokens")
    print(f"raw tokenizers encode_batch_fast: {r['raw']:,.0f} tokens/s")
    for key, value in r.items():
        if key.startswith("pipeline_"):
            w = key.split("_")[1]
            print(f"pipeline, tokenizer_processes={w}: {value:,.0f} tokens/s "
                  f"({r['ratio_' + key]:.2f}x raw)")
        elif key.startswith("cache_build_") and key.count("_") == 2:
            p = key.split("_")[2]
            start = r[key + "_start_seconds"]
            print(f"cache build, processes={p}: {value:,.0f} tokens/s ({r['ratio_' + key]:.2f}x "
                  f"raw) in {r[key + '_seconds']:.1f} s" + (
                      f"; after the {start:.1f} s its workers took to start: "
                      f"{r[key + '_started']:,.0f} tokens/s "
                      f"({r['ratio_' + key + '_started']:.2f}x)" if start else ""))
    for key, what in (("cache_pipeline", "pipeline from the cache (no tokenizer)"),
                      ("mixture_pipeline", "pipeline over the mixture")):
        if key in r:
            print(f"{what}: {r[key]:,.0f} tokens/s ({r['ratio_' + key]:.2f}x raw)")


if __name__ == "__main__":
    main()
