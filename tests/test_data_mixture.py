"""Mixtures: shares by weight, determinism, exact resume with a JSONL source and a token
cache over a change of process count, weight changes, counters, one line per bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from data_utils import assert_same, load, read

from easylm.data import DatasetFactory, merge_state_dicts
from easylm.data.cache import build
from easylm.data.embedded.stories import documents
from easylm.data.preview import main as preview_main
from easylm.data.reader import prepare_records
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError

T, B = 32, 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer):
    """Three JSON-lines sources (one with prompt/answer fields) and a token cache."""
    root = tmp_path_factory.mktemp("mixture")
    texts = list(documents(46, seed=4))
    texts[5] = " ".join(texts[:5])   # several rows long
    for name, part in (("a", texts[:20]), ("b", texts[20:34]), ("c", texts[34:])):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t, "prompt": "Tell a story.", "answer": t})
                         + "\n" for t in part)
    build({"json_dataset": {"path": str(root / "c.jsonl")}}, tokenizer, str(root / "cache"),
          shard_size=16, progress=False)
    return root


def sources(root, weights=(0.5, 0.3, 0.2), **extra):
    return [dict(name="a", weight=weights[0], path=str(root / "a.jsonl"), **extra),
            dict(name="b", weight=weights[1], path=str(root / "b.jsonl"),
                 text_processor={"fields": "[prompt],answer"}),
            dict(name="c", weight=weights[2], type="cache", path=str(root / "cache"))]


def config(spec, **loader):
    loader = dict(dict(sources=spec if isinstance(spec, str) else json.dumps(spec),
                       seq_length=T, batch_size=B, tokenizer_parallel_batch_size=8,
                       tokenizer_parallel_chunk_size=4), **loader)
    return DatasetFactory.get_default_config({"type": "mixture", "mixture": loader})


def test_shares_follow_the_weights_and_the_seed_fixes_the_sequence(data, tokenizer):
    [dataset] = load(config(sources(data), shuffle=True, seed=7), tokenizer)
    order, n = dataset.order, 20_000
    slots = np.arange(n)
    which, inner = order.locate(slots)
    shares = np.bincount(which, minlength=3) / n
    np.testing.assert_allclose(shares, [0.5, 0.3, 0.2], atol=0.01)
    # Stratified, not drawn independently: over 200,000 documents no prefix strays further
    # than the spread inside one block (~30 documents); independent draws stray by
    # ~sqrt(n w (1 - w)) ~ 200 and more as n grows.
    many, _ = order.locate(np.arange(10 * n))
    counts = np.stack([np.cumsum(many == k) for k in range(3)], 1)
    expected = np.arange(1, 10 * n + 1)[:, None] * np.array([0.5, 0.3, 0.2])
    assert np.abs(counts - expected).max() <= 40
    # Each source is read in its own order, every document once per pass: 0, 1, 2, ...
    for k in range(3):
        np.testing.assert_array_equal(inner[which == k], np.arange((which == k).sum()))
    # The records come from those sources' files.
    records = order.read(slots[:2000])
    names = [os.path.basename(r[1].split(":")[0]) if r[1] else "cache" for r in records]
    assert names == [("a.jsonl", "b.jsonl", "cache")[k] for k in which[:2000]]
    # The same seed gives the same sequence; another seed another one.
    [again] = load(config(sources(data), shuffle=True, seed=7), tokenizer)
    np.testing.assert_array_equal(again.order.locate(slots)[0], which)
    [other] = load(config(sources(data), shuffle=True, seed=8), tokenizer)
    assert (other.order.locate(slots)[0] != which).mean() > 0.3
    # The same sources as a YAML file of {"sources": [...]} are the same mixture.
    import yaml

    (data / "mix.yaml").write_text(yaml.safe_dump({"sources": sources(data)}))
    [from_yaml] = load(config(str(data / "mix.yaml"), shuffle=True, seed=7), tokenizer)
    np.testing.assert_array_equal(from_yaml.order.locate(slots)[0], which)


def test_one_or_two_processes_give_the_same_global_batches(data, tokenizer):
    cfg = config(sources(data), shuffle=True, segment_ids=True)
    one = read(load(cfg, tokenizer), 12)
    two = read(load(cfg, tokenizer, processes=2), 12)
    assert_same(one, two)


@pytest.mark.parametrize("before, after", [(1, 1), (2, 1), (1, 2)])
def test_resume_gives_the_uninterrupted_batches(data, tokenizer, before, after):
    cfg = config(sources(data)[1:], shuffle=True, segment_ids=True, seed=3)  # JSONL + cache
    n, m = 9, 35     # 44 batches of 4 x 32: past the end of both sources
    expected, [metrics] = read(load(cfg, tokenizer), n + m, with_metrics=True)
    assert metrics["source/b/epoch"] >= 1 and metrics["source/c/epoch"] >= 1
    first = load(cfg, tokenizer, before)
    got = read(first, n)
    state = json.loads(json.dumps(merge_state_dicts([d.get_state_dict() for d in first])))
    second = load(cfg, tokenizer, after)
    for d in second:
        d.load_state_dict(state)
    rest, resumed = read(second, m, with_metrics=True)
    assert_same(expected, got + rest)
    # The counters continue too: summed over the processes they are the uninterrupted ones.
    for key in ("source/b/tokens", "source/b/documents", "source/c/tokens"):
        assert sum(r[key] for r in resumed) == metrics[key]


def test_counters_count_each_sources_targets_and_finished_documents(data, tokenizer):
    cfg = config(sources(data), batch_size=1)
    [dataset] = load(cfg, tokenizer)
    n = 40
    _, [metrics] = read([dataset], n, with_metrics=True)
    # Walk the one stream by hand: document lengths in slot order, sources by locate.
    order = dataset.order
    which, _ = order.locate(np.arange(200))
    lengths = [len(doc[0]) for doc in prepare_records(order.read(np.arange(200)),
                                                      dataset.processor)]
    # The stream's tokens 1..n*T were targets (token 0 is none); after n rows it stands at
    # n*T, so the documents ending by then are finished.
    tokens, finished, start = np.zeros(3, int), np.zeros(3, int), 0
    for k, length in zip(which, lengths):
        end = start + length
        tokens[k] += max(0, min(end, n * T + 1) - max(start, 1))
        finished[k] += end <= n * T
        start = end
    assert tokens.sum() == n * T
    for k, name in enumerate("abc"):
        assert metrics[f"source/{name}/tokens"] == tokens[k]
        assert metrics[f"source/{name}/documents"] == finished[k]


def test_changed_weights_on_resume_continue_each_source(data, tokenizer):
    cfg = config(sources(data), shuffle=True)
    [first] = load(cfg, tokenizer)
    read([first], 6)
    state = json.loads(json.dumps(first.get_state_dict()))
    old = first.order
    [second] = load(config(sources(data, weights=(0.1, 0.1, 0.8)), shuffle=True), tokenizer)
    second.load_state_dict(state)
    start = 1 + max(slot for slot, _ in state["streams"].values())
    new = second.order
    assert [s.start for s in new.segments] == [0, start]
    slots = np.arange(start + 6000)
    before, after = old.locate(slots), new.locate(slots)
    # What rows had begun is mapped as before...
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x[:start], y[:start])
    # ...and afterwards each source goes on with its next document: none twice, none left out.
    which, inner = after
    for k in range(3):
        np.testing.assert_array_equal(inner[which == k], np.arange((which == k).sum()))
    shares = np.bincount(which[start:], minlength=3) / 6000
    np.testing.assert_allclose(shares, [0.1, 0.1, 0.8], atol=0.01)
    # The changed state resumes exactly in turn.
    expected = read([second], 8)
    [third] = load(config(sources(data, weights=(0.1, 0.1, 0.8)), shuffle=True), tokenizer)
    third.load_state_dict(state)
    assert_same(expected, read([third], 8))


def test_eval_mixture_is_one_pass_over_every_source(data, tokenizer):
    [dataset] = load(config(sources(data)), tokenizer, for_eval=True)
    batches = [b for b, _ in dataset]
    targets = sum(int(b["loss_masks"].sum()) for b in batches)
    expected = 0
    for name, fields in (("a", "text"), ("b", "answer"), ("c", "text")):
        with open(data / f"{name}.jsonl") as f:
            for line in f:
                text = json.loads(line)[fields]
                expected += len(tokenizer.encode(text, add_special_tokens=False)) + 1  # EOS
    assert targets == expected


def test_bad_mixtures_are_one_line_each(data, tokenizer, tmp_path):
    spec = sources(data)
    cases = [
        ([dict(spec[0], weight=-0.5)] + spec[1:],
         "source 0 ('a'): weight -0.5 is negative or not finite"),
        ([dict(s, weight=0) for s in spec], "the weights sum to 0; give at least one source "
                                            "a positive weight"),
        ([dict(spec[0], wieght=1)], "source 0 ('a'): unknown key 'wieght' for a json source; "
                                    "expected some of name, type, weight, repeat, "
                                    "text_processor, path"),
        ([spec[0], dict(spec[1], name="a")], "two sources are named 'a'; names must differ"),
        ([dict(spec[0], text_processor={"add_eos_token": "no"})],
         None),   # checked at load: a type error names the option
        ([], "expected a non-empty list of sources (or {\"sources\": [...]})"),
    ]
    for entries, message in cases:
        with pytest.raises(UserError) as e:
            load(config(entries), tokenizer)
        if message is None:
            assert str(e.value) == ("mixture source 'a': text_processor: add_eos_token must "
                                    "be bool, got 'no'")
        else:
            assert str(e.value) == f"--train_dataset.mixture.sources: {message}"
    (tmp_path / "mix.json").write_text('[{"path": "a.jsonl",\n "weight": }]')
    with pytest.raises(UserError) as e:
        load(config(str(tmp_path / "mix.json")), tokenizer)
    assert str(e.value) == (f"{tmp_path}/mix.json: malformed JSON (Expecting value at line 2 "
                            f"column 12)")
    with pytest.raises(UserError) as e:
        load(config(str(tmp_path / "none.yaml")), tokenizer)
    assert str(e.value) == f"mixture file '{tmp_path}/none.yaml' does not exist"


def test_a_source_that_runs_dry_without_repeat_stops_with_one_line(data, tokenizer):
    spec = sources(data)
    spec[0]["repeat"] = False    # a: 20 documents, about half of every slot
    [dataset] = load(config(spec, batch_size=2), tokenizer)
    with pytest.raises(UserError) as e:
        read([dataset], 200)
    assert str(e.value).startswith("mixture source 'a' ran dry: its 20 documents are used up "
                                   "and it has repeat=false (making batch ")
    # Until then it served every batch: the error names the first one it could not make.
    made = int(str(e.value).rsplit(" ", 1)[1].rstrip(")")) - 1
    [again] = load(config(spec, batch_size=2), tokenizer)
    assert len(read([again], made)) == made > 10


def test_state_mismatches_are_one_line(data, tokenizer, tmp_path):
    [dataset] = load(config(sources(data)), tokenizer)
    read([dataset], 2)
    state = dataset.get_state_dict()
    [fewer] = load(config(sources(data)[:2]), tokenizer)
    with pytest.raises(UserError) as e:
        fewer.load_state_dict(state)
    assert str(e.value) == ("the data state was saved with mixture sources ['a', 'b', 'c'] "
                            "but this run has ['a', 'b']")
    (tmp_path / "a.jsonl").write_text((data / "a.jsonl").read_text() * 2)
    grown = sources(data)
    grown[0]["path"] = str(tmp_path / "a.jsonl")
    [changed] = load(config(grown), tokenizer)
    with pytest.raises(UserError) as e:
        changed.load_state_dict(state)
    assert str(e.value) == ("the data changed: mixture source 'a' had 20 documents when the "
                            "state was saved, it now has 40")
    plain = DatasetFactory.load_dataset(DatasetFactory.get_default_config(
        {"json_dataset": dict(path=str(data / "a.jsonl"), seq_length=T, batch_size=B)}),
        tokenizer, process_index=0, process_count=1)
    with pytest.raises(UserError) as e:
        plain.load_state_dict(state)
    assert str(e.value) == ("the data state was saved from a mixture but this run's dataset "
                            "is not one")


@pytest.mark.slow
def test_preview_cli_shows_sources_and_rejects_bad_weights(data, tmp_path, capsys):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps(sources(data)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    done = subprocess.run(
        [sys.executable, "-m", "easylm.data.preview", "--train_dataset.type=mixture",
         f"--train_dataset.mixture.sources={mix}", "--train_dataset.mixture.seq_length=32",
         "--num_examples=6", "--num_batches=4"], capture_output=True, text=True, env=env,
        timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert {line.split("(source ")[-1] for line in lines if "(source " in line} <= {
        "a)", "b)", "c)"}
    assert any(line.startswith("[[<s>Tell a story.]]") for line in lines)   # b's fields
    tokens = [int(line.split()[5]) for line in lines if line.startswith("source ")]
    assert len(tokens) == 3 and sum(tokens) == 4 * 8 * 32
    mix.write_text(json.dumps(sources(data, weights=(1, -1, 1))))
    with pytest.raises(SystemExit) as e:
        preview_main(["preview", "--train_dataset.type=mixture",
                      f"--train_dataset.mixture.sources={mix}"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: {mix}: source 1 ('b'): weight -1 is negative "
                                       f"or not finite\n")
