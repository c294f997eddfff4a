"""Data pipeline speed against raw `tokenizers` batch encoding of the same text.

    python -m easylm.data.bench [--path=embedded] [--tokenizer=embedded] [--workers=1,2]

Raw: `Tokenizer.encode_batch_fast` over every document's text, the ceiling for any
pipeline that tokenizes on the fly. Pipeline: `DatasetFactory` with the default text
processor (BOS/EOS, loss masks), packing and batching, read for `epochs` passes over
the same file, timed from its first batch so worker start-up is not counted.

Rust tokenizers use every core unless TOKENIZERS_PARALLELISM=false; set it to compare
one worker with one core of raw encoding.
"""

import json
import os
import sys
import time

from ml_collections import ConfigDict

from easylm import flags
from easylm.data.dataset import DatasetFactory
from easylm.data.sources import expand_paths
from easylm.errors import exit_on_user_error
from easylm.tokenizer import load_tokenizer


def raw_tokens_per_second(tokenizer, texts, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        encodings = tokenizer.backend_tokenizer.encode_batch_fast(
            texts, add_special_tokens=False)
        best = min(best, time.perf_counter() - start)
    return sum(len(e.ids) for e in encodings) / best


def pipeline_tokens_per_second(tokenizer, path, workers, seq_length, batch_size,
                               num_tokens):
    config = DatasetFactory.get_default_config()
    config.json_dataset.update(path=path, seq_length=seq_length, batch_size=batch_size,
                               tokenizer_processes=workers)
    dataset = DatasetFactory.load_dataset(config, tokenizer, process_index=0,
                                          process_count=1)
    batches = iter(dataset)
    next(batches)   # start-up: worker processes, first window
    start, tokens = time.perf_counter(), 0
    while tokens < num_tokens:
        batch, _ = next(batches)
        tokens += batch["target_tokens"].size
    seconds = time.perf_counter() - start
    dataset.close()
    return tokens / seconds


def bench_data(path="embedded", tokenizer="embedded", workers=(1, 2), seq_length=1024,
               batch_size=8, epochs=3):
    """Returns {'raw': tokens/s, 'pipeline_<w>': tokens/s, 'ratio_<w>': pipeline/raw}."""
    tokenizer = load_tokenizer(tokenizer)
    texts = []
    for file in expand_paths(path):
        with open(file, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    raw = raw_tokens_per_second(tokenizer, texts)
    num_tokens = epochs * sum(
        len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch_fast(texts))
    results = {"raw": raw}
    for w in workers:
        speed = pipeline_tokens_per_second(tokenizer, path, w, seq_length, batch_size,
                                           num_tokens)
        results[f"pipeline_{w}"] = speed
        results[f"ratio_{w}"] = speed / raw
    return results


HELP = {
    "path": "JSON-lines data ('embedded', a path, a glob, a comma-separated list)",
    "tokenizer": "'embedded', a tokenizer directory, tokenizer.json or SentencePiece .model",
    "workers": "comma-separated tokenizer_processes values to measure",
    "seq_length": "tokens per row", "batch_size": "rows per batch",
    "epochs": "passes over the data per measurement",
}


def default_config():
    return ConfigDict(dict(path="embedded", tokenizer="embedded", workers="1,2",
                           seq_length=1024, batch_size=8, epochs=3))


@exit_on_user_error
def main(argv=None):
    usage = "usage: python -m easylm.data.bench [--workers=1,2] [--path=...]"
    argv = argv or sys.argv
    c = flags.parse(default_config(), HELP, argv, usage)
    results = bench_data(c.path, c.tokenizer, [int(w) for w in c.workers.split(",")],
                         c.seq_length, c.batch_size, c.epochs)
    threads = os.environ.get("TOKENIZERS_PARALLELISM", "true (default)")
    print(f"TOKENIZERS_PARALLELISM={threads}; {os.cpu_count()} CPUs")
    print(f"raw tokenizers encode_batch_fast: {results['raw']:,.0f} tokens/s")
    for key, value in results.items():
        if key.startswith("pipeline_"):
            w = key.split("_")[1]
            print(f"pipeline, tokenizer_processes={w}: {value:,.0f} tokens/s "
                  f"({results['ratio_' + w]:.2f}x raw)")


if __name__ == "__main__":
    main()
