"""Shared pieces of the data tests: simulated processes, global batches, equality."""

import numpy as np
import pytest

from easylm.data import DatasetFactory
from easylm.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded tokenizer (BOS 1, EOS 2); import it into a test module to use it."""
    return load_tokenizer("embedded")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def load(cfg, tokenizer, processes=1, **kwargs):
    """One dataset per simulated process."""
    return [DatasetFactory.load_dataset(cfg, tokenizer, process_index=p,
                                        process_count=processes, **kwargs)
            for p in range(processes)]


def read(datasets, n, with_metrics=False):
    """n global batches: the processes' rows, concatenated in process order (and, with
    with_metrics, each process's metrics of the last one)."""
    iterators = [iter(d) for d in datasets]
    out, metrics = [], None
    for _ in range(n):
        parts = [next(it) for it in iterators]
        out.append({k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]})
        metrics = [m for _, m in parts]
    for it in iterators:
        it.close()
    return (out, metrics) if with_metrics else out


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def dataset_flags_of_each_type(directory, tokenizer, section="train_dataset"):
    """{type: the --<section>.* flags of tiny real data of that type}: a JSON-lines file, a
    save_to_disk directory of the same documents, a token cache built from the file, and
    a mixture of two JSON-lines files."""
    import json

    import datasets

    from easylm.data.cache import build
    from easylm.data.embedded.stories import documents

    texts = list(documents(24, seed=7))
    paths = []
    for name, part in (("a", texts[:12]), ("b", texts[12:])):
        paths.append(directory / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    datasets.Dataset.from_list([{"text": t} for t in texts]).save_to_disk(
        str(directory / "saved"))
    build(DatasetFactory.get_default_config({"json_dataset": {"path": str(paths[0])}}),
          tokenizer, str(directory / "cache"), progress=False)
    mixture = directory / "mix.json"
    mixture.write_text(json.dumps([{"name": "a", "weight": 0.5, "path": str(paths[0])},
                                   {"name": "b", "weight": 0.5, "path": str(paths[1])}]))
    return {"json": [f"--{section}.json_dataset.path={paths[0]}"],
            "huggingface": [f"--{section}.type=huggingface",
                            f"--{section}.huggingface_dataset.path={directory / 'saved'}"],
            "cache": [f"--{section}.type=cache", f"--{section}.cache.path={directory / 'cache'}"],
            "mixture": [f"--{section}.type=mixture", f"--{section}.mixture.sources={mixture}"]}
