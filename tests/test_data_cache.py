"""Token caches: the batches of on-the-fly processing, a killed build that finishes the
same, uint32 vocabularies, fsspec URLs, and one clear line for every damaged cache."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import fsspec
import numpy as np
import pytest
from data_utils import assert_same, load, read
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from easylm.data import DatasetFactory, cache as cache_module
from easylm.data.cache import build
from easylm.data.cache_reader import CacheSource, verify
from easylm.data.embedded.stories import documents
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError

T, B = 32, 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"fields": "[prompt],answer"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """EasyLM prompt/answer lines, one malformed and one with an empty answer, one long."""
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    texts = list(documents(30, seed=6))
    texts[3] = " ".join(texts[:6])
    lines = [json.dumps({"prompt": f"Story {i}:", "answer": " " + t}) for i, t in
             enumerate(texts)]
    lines[8] = '{"prompt": "broken'
    lines[12] = json.dumps({"prompt": "", "answer": ""})
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def built(sft, tokenizer, tmp_path_factory):
    output = tmp_path_factory.mktemp("built") / "cache"
    build(text_config(sft), tokenizer, str(output), shard_size=7, progress=False)
    return output


def text_config(path, **loader):
    return DatasetFactory.get_default_config({"text_processor": FIELDS, "json_dataset": dict(
        dict(path=str(path), seq_length=T, batch_size=B, tokenizer_parallel_batch_size=8,
             tokenizer_parallel_chunk_size=4), **loader)})


def cache_config(path, text_processor=FIELDS, **loader):
    return DatasetFactory.get_default_config({
        "type": "cache", "text_processor": text_processor,
        "cache": dict(dict(path=str(path), seq_length=T, batch_size=B), **loader)})


def checksums(directory):
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
            for name in sorted(os.listdir(directory))}


def test_cache_gives_the_batches_of_on_the_fly_processing(sft, built, tokenizer):
    index = json.loads((built / "index.json").read_text())
    assert (index["documents"], index["skipped"], len(index["shards"]), index["dtype"]) == (
        30, 2, 5, "uint16")
    loader = dict(shuffle=True, segment_ids=True, seed=5)
    n = 40        # past one epoch of the 30 documents
    expected = read(load(text_config(sft, **loader), tokenizer), n)
    assert_same(expected, read(load(cache_config(built, **loader), tokenizer), n))
    assert_same(expected, read(load(cache_config(built, **loader), tokenizer, 2), n))
    # The comparison sees order: another seed's batches differ.
    other = read(load(cache_config(built, **dict(loader, seed=6)), tokenizer), n)
    assert any((x["input_tokens"] != y["input_tokens"]).any() for x, y in zip(expected, other))
    # A run may switch from the text to its cache on resume and continue exactly.
    [text] = load(text_config(sft, **loader), tokenizer)
    got = read([text], 15)
    state = json.loads(json.dumps(text.get_state_dict()))
    cached = load(cache_config(built, **loader), tokenizer, 2)
    for d in cached:
        d.load_state_dict(state)
    assert_same(expected, got + read(cached, n - 15))


def test_no_tokenizer_runs_while_reading_a_cache(built, tokenizer, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized while reading a cache")

    monkeypatch.setattr("easylm.data.text.TextProcessor.process", refuse)
    assert len(read(load(cache_config(built), tokenizer), 5)) == 5


def test_killed_build_finishes_with_the_checksums_of_an_uninterrupted_one(
        sft, built, tokenizer, tmp_path, monkeypatch):
    output = tmp_path / "cache"
    write = fsspec.implementations.local.LocalFileSystem.pipe_file

    class Killed(BaseException):
        pass

    def killed_mid_file(self, path, value, *args, **kwargs):
        if path.endswith("shard-00002.masks.npy"):
            write(self, path, value[:len(value) // 2])   # half written, then the kill
            raise Killed()
        return write(self, path, value, *args, **kwargs)

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "pipe_file",
                        killed_mid_file)
    with pytest.raises(Killed):
        build(text_config(sft), tokenizer, str(output), shard_size=7, progress=False)
    monkeypatch.undo()
    assert not (output / "index.json").exists() and (output / "shard-00001.json").exists()
    with pytest.raises(UserError) as e:
        CacheSource(str(output))
    assert str(e.value) == (f"token cache {output} is not finished (no index.json); run "
                            f"python -m easylm.data.cache again with the same flags to "
                            f"finish it")
    # A finished shard damaged since is rebuilt too; the others are kept.
    tokens = output / "shard-00000.tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[:-3])
    index = build(text_config(sft), tokenizer, str(output), shard_size=7, progress=False)
    assert index["built_shards"] == 4     # shards 0, 2, 3, 4 of 5
    assert checksums(output) == checksums(built)
    # Built with other settings into the same directory: refused, named.
    with pytest.raises(UserError) as e:
        build(text_config(sft), tokenizer, str(output), shard_size=8, progress=False)
    assert str(e.value) == (f"{output} holds a cache build with other settings (shard_size "
                            f"was 7, now 8); use another --output, or delete it")


@pytest.mark.slow
def test_cli_builds_with_worker_processes_and_verifies(sft, built, tmp_path, capsys):
    output = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "easylm.data.cache", f"--output={output}", "--processes=2",
         "--shard_size=7", f"--train_dataset.json_dataset.path={sft}",
         "--train_dataset.text_processor.fields=[prompt],answer"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{output}: 5 shards (5 built now, 2 processes), 30 "
                                  f"documents (2 skipped), ")
    assert done.stderr.startswith(f"shard 1: skipped 2 documents (kept empty), the first: "
                                  f"{sft}:9: ") and done.stderr.count("\n") == 1
    assert checksums(output) == checksums(built)
    cache_module.main(["cache", f"--output={output}", "--verify"])
    assert capsys.readouterr().out.endswith("sizes, shapes and checksums match the index\n")
    data = bytearray((output / "shard-00003.tokens.npy").read_bytes())
    data[-1] ^= 1     # same size, other content: only the checksum sees it
    (output / "shard-00003.tokens.npy").write_bytes(bytes(data))
    with pytest.raises(SystemExit) as e:
        cache_module.main(["cache", f"--output={output}", "--verify"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: token cache {output}: shard-00003.tokens.npy has sha256 ")
    assert err.endswith("...; rebuild the cache\n") and err.count("\n") == 1


def damaged(built, tmp_path, change):
    copy = tmp_path / "damaged"
    shutil.copytree(built, copy)
    change(copy)
    return copy


def edit_index(edit):
    def change(directory):
        index = json.loads((directory / "index.json").read_text())
        edit(index)
        (directory / "index.json").write_text(json.dumps(index))
    return change


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "shard-00001.masks.npy").unlink(),
     "token cache {d}: shard file shard-00001.masks.npy is missing"),
    (lambda d: (d / "shard-00001.tokens.npy").write_bytes(
        (d / "shard-00001.tokens.npy").read_bytes()[:100]),
     "token cache {d}: shard-00001.tokens.npy has 100 bytes, the index says {size} "
     "(truncated or replaced; rebuild the shard, check with --verify)"),
    (edit_index(lambda i: i.update(num_documents=31)),
     "token cache {d}: its shards hold 30 documents, the index says 31"),
    (edit_index(lambda i: i["shards"][0].update(tokens=i["shards"][0]["tokens"] + 1)),
     "token cache {d}: shard-00000.tokens.npy holds ({n},) uint16, the index says ({n1},) "
     "uint16; rebuild the cache"),
    (lambda d: (d / "index.json").write_text("{"),
     "token cache {d}: index.json is not a valid index; rebuild it with python -m "
     "easylm.data.cache"),
])
def test_damaged_caches_are_one_line_each(built, tmp_path, tokenizer, change, message):
    index = json.loads((built / "index.json").read_text())
    directory = damaged(built, tmp_path, change)
    with pytest.raises(UserError) as e:
        read(load(cache_config(directory), tokenizer), 1)
    assert str(e.value) == message.format(
        d=directory, size=index["shards"][1]["files"]["tokens"]["bytes"],
        n=index["shards"][0]["tokens"], n1=index["shards"][0]["tokens"] + 1)


def test_a_run_that_tokenizes_differently_is_refused(built, tokenizer, tmp_path):
    with pytest.raises(UserError) as e:
        load(cache_config(built, text_processor={}), tokenizer)
    assert str(e.value) == (f"token cache {built} was built with text_processor.fields="
                            f"'[prompt],answer' but this run has text_processor.fields='text'; "
                            f"pass the same --train_dataset.text_processor.* flags, or rebuild "
                            f"the cache")
    other = load_tokenizer("embedded")
    other.add_tokens(["<|tool|>"], special_tokens=True)
    with pytest.raises(UserError) as e:
        load(cache_config(built), other)
    built_sha = json.loads((built / "index.json").read_text())["tokenizer"]["sha256"]
    assert str(e.value).startswith(f"token cache {built} was built with another tokenizer "
                                   f"(sha256 '{built_sha}', this run's --tokenizer has '")
    with pytest.raises(UserError) as e:
        load(cache_config(built, strict=True), tokenizer)
    assert str(e.value) == (f"token cache {built} skipped 2 bad documents when it was built, "
                            f"and this run has strict=True")
    for directory, message in ((tmp_path, f"{tmp_path} is not a token cache (no index.json); "
                                          f"build one with python -m easylm.data.cache"),
                               ("", "--train_dataset.type=cache needs cache.path (a directory "
                                    "written by python -m easylm.data.cache)")):
        with pytest.raises(UserError) as e:
            load(cache_config(directory), tokenizer)
        assert str(e.value) == message


def test_large_vocabulary_without_bos_is_cached_as_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>"] + words)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                  eos_token="</s>")
    rng = np.random.default_rng(0)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 20))}) + "\n"
                            for _ in range(12)))
    text = DatasetFactory.get_default_config({
        "text_processor": {"add_bos_token": "false"},
        "json_dataset": dict(path=str(path), seq_length=T, batch_size=2, shuffle=True)})
    index = build(text, big, str(tmp_path / "cache"), shard_size=5, progress=False)
    assert index["dtype"] == "uint32"
    cached = cache_config(tmp_path / "cache", {"add_bos_token": "false"}, batch_size=2,
                          shuffle=True)
    expected = read(load(text, big), 10)
    assert max(int(b["input_tokens"].max()) for b in expected) > 1 << 16
    assert_same(expected, read(load(cached, big), 10))


def test_fsspec_urls(built, sft, tokenizer):
    expected = read(load(cache_config(built), tokenizer), 6)
    assert_same(expected, read(load(cache_config(f"file://{built}"), tokenizer), 6))
    build(text_config(sft), tokenizer, "memory://easylm-cache/c", shard_size=7, progress=False)
    assert_same(expected, read(load(cache_config("memory://easylm-cache/c"), tokenizer), 6))
    verify("memory://easylm-cache/c")
