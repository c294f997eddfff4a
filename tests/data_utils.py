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
