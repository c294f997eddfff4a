"""The pipeline end to end: exact resume, per-process shares, eval padding, bad input."""

import itertools
import json
import logging
import re

import jax
import numpy as np
import pytest
from data_utils import assert_same, load, read

from easylm.data import DatasetFactory, make_global_batch, merge_state_dicts
from easylm.data.embedded.stories import documents
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError
from easylm.runtime.sharding import make_mesh

T, B = 32, 4


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture
def data(tmp_path):
    """Two files of short stories and one document several rows long."""
    texts = list(documents(40, seed=1))
    texts[7] = " ".join(texts[:6])
    for i, part in enumerate((texts[:25], texts[25:])):
        with open(tmp_path / f"part{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in part)
    return tmp_path, texts


def config(path, **loader):
    loader = dict(dict(path=str(path), seq_length=T, batch_size=B,
                       tokenizer_parallel_batch_size=8, tokenizer_parallel_chunk_size=4),
                  **loader)
    return DatasetFactory.get_default_config({"json_dataset": loader})


@pytest.mark.parametrize("shuffle, segment_ids, before, after", [
    (False, False, 1, 1),
    (True, True, 1, 1),
    (True, False, 2, 1),
    (False, True, 1, 2),
    (True, False, 2, 2),
])
def test_resume_gives_the_uninterrupted_batches(data, tokenizer, shuffle, segment_ids,
                                                before, after):
    cfg = config(data[0] / "*.jsonl", shuffle=shuffle, segment_ids=segment_ids, seed=3)
    n, m = 7, 30     # 37 batches of 4 x 32 run past the end of the data: two epochs
    expected = read(load(cfg, tokenizer), n + m)
    first = load(cfg, tokenizer, before)
    got = read(first, n)
    state = merge_state_dicts([d.get_state_dict() for d in first])
    state = json.loads(json.dumps(state))      # what a checkpoint stores
    second = load(cfg, tokenizer, after)
    for d in second:
        d.load_state_dict(state)
    got += read(second, m)
    assert_same(expected, got)
    assert state["batches"] == n


def test_resume_with_tokenizer_worker_processes(data, tokenizer):
    cfg = config(data[0] / "*.jsonl", shuffle=True)
    expected = read(load(cfg, tokenizer), 12)
    cfg.json_dataset.tokenizer_processes = 2
    [dataset] = load(cfg, tokenizer)
    got = read([dataset], 5)
    [resumed] = load(cfg, tokenizer)
    resumed.load_state_dict(dataset.get_state_dict())
    assert_same(expected, got + read([resumed], 7))


def test_batches_and_metrics(data, tokenizer):
    [dataset] = load(config(data[0] / "*.jsonl", segment_ids=True), tokenizer)
    batch, metrics = next(iter(dataset))
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "input_tokens": ((B, T), "int32"), "target_tokens": ((B, T), "int32"),
        "loss_masks": ((B, T), "float32"), "segment_ids": ((B, T), "int32"),
        "positions": ((B, T), "int32")}
    np.testing.assert_array_equal(batch["input_tokens"][:, 1:], batch["target_tokens"][:, :-1])
    assert metrics["dataset_total_tokens"] == B * T and metrics["dataset_epoch"] == 0
    dataset.close()


def test_process_shares_are_disjoint_and_cover_the_data(data, tokenizer):
    cfg = config(data[0] / "*.jsonl", shuffle=True)
    shares = []
    for dataset in load(cfg, tokenizer, processes=2):
        seen = []
        read_slots = dataset.order.read
        dataset.order.read = lambda slots, **kw: (seen.extend(slots), read_slots(slots, **kw))[1]
        read([dataset], 15)
        shares.append({int(s) for s in seen if s < 40})   # slots of the first epoch
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(range(40))


def test_eval_is_one_padded_pass_with_equal_lengths(data, tokenizer):
    path, texts = data
    cfg = config(path / "*.jsonl")
    expected_loss_tokens = sum(len(tokenizer.encode(t, add_special_tokens=False)) + 1
                               for t in texts)    # text and EOS; BOS gets no loss
    passes = {}
    for processes in (1, 2):
        datasets = load(cfg, tokenizer, processes, for_eval=True)
        per_process = [[b for b, _ in d] for d in datasets]
        assert len({len(batches) for batches in per_process}) == 1
        batches = [{k: np.concatenate([p[i][k] for p in per_process]) for k in
                    per_process[0][i]} for i in range(len(per_process[0]))]
        assert sum(b["loss_masks"].sum() for b in batches) == expected_loss_tokens
        last = batches[-1]
        assert (last["loss_masks"] == 0).any() and (last["target_tokens"][
            last["loss_masks"] == 0] == tokenizer.pad_token_id).any()
        passes[processes] = batches
    assert_same(passes[1], passes[2])
    # A second pass reads the same data again.
    [dataset] = load(cfg, tokenizer, for_eval=True)
    assert_same(passes[1], [b for b, _ in dataset])


def test_long_document_is_split_not_dropped(tmp_path, tokenizer):
    text = " ".join(documents(8, seed=2))
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": text}) + "\n")
    [dataset] = load(config(tmp_path / "long.jsonl", batch_size=1), tokenizer, for_eval=True)
    targets = np.concatenate([b["target_tokens"][b["loss_masks"] > 0] for b, _ in dataset])
    assert targets.tolist() == tokenizer.encode(text, add_special_tokens=False) + [2]
    assert len(targets) > 5 * T


def write_lines(path, lines):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


BAD_LINES = [b'{"text": "Tom had two nuts."}', b'{"text": ', b'{"text": "caf\xe9"}',
             b"", b'{"text": ""}', b'{"text": "Mia had one cake."}']


def test_bad_lines_are_skipped_with_warnings(tmp_path, tokenizer, caplog):
    path = write_lines(tmp_path / "bad.jsonl", BAD_LINES)
    [dataset] = load(config(path, batch_size=1, seq_length=4), tokenizer)
    with caplog.at_level(logging.WARNING, logger="easylm.data.dataset"):
        batches = [m for _, m in itertools.islice(dataset, 6)]
    messages = sorted({r.getMessage() for r in caplog.records})
    assert messages == [f"skipped {path}:2: malformed JSON (Expecting value at column 10)",
                        f"skipped {path}:3: not valid UTF-8 (byte 0xe9 at column 14)",
                        f"skipped {path}:5: empty text"]
    assert batches[-1]["dataset_skipped_documents"] >= 3


@pytest.mark.parametrize("bad, message", [
    (BAD_LINES[1], "malformed JSON (Expecting value at column 10)"),
    (BAD_LINES[2], "not valid UTF-8 (byte 0xe9 at column 14)"),
    (BAD_LINES[4], "empty text"),
])
def test_strict_fails_naming_file_and_line(tmp_path, tokenizer, bad, message):
    path = write_lines(tmp_path / "bad.jsonl", [BAD_LINES[0], bad, BAD_LINES[5]])
    [dataset] = load(config(path, batch_size=1, seq_length=4, strict=True), tokenizer)
    with pytest.raises(UserError) as e:
        list(itertools.islice(dataset, 20))
    assert str(e.value) == f"{path}:2: {message}"


def test_missing_field_fails_naming_field_and_line(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", [b'{"text": "a"}', b'{"txt": "b"}'])
    [dataset] = load(config(path, batch_size=1, seq_length=4), tokenizer)
    with pytest.raises(UserError) as e:
        next(iter(dataset))
    assert str(e.value) == (f"{path}:2: missing field 'text' (fields='text'); the example "
                            f"has: txt")


def test_no_usable_documents(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", [b"{", b'{"text": ""}'])
    [dataset] = load(config(path, batch_size=1, seq_length=4), tokenizer)
    with pytest.raises(UserError) as e:
        next(iter(dataset))
    # How many skips the windows read ahead varies; the first is always line 1.
    assert re.fullmatch(re.escape("no usable document in a whole epoch of 2: all were skipped (")
                        + r"\d+" + re.escape(f" skips so far, the first: {path}:1: malformed JSON "
                                              f"(Expecting property name enclosed in double quotes "
                                              f"at column 2)): fix the data"), str(e.value)), e.value


def test_file_errors(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    cases = {
        str(tmp_path / "nothing*.jsonl"): f"no files match '{tmp_path}/nothing*.jsonl'",
        str(tmp_path / "empty.jsonl"): f"data file '{tmp_path}/empty.jsonl' is empty",
        str(tmp_path / "gone.jsonl"): f"data file '{tmp_path}/gone.jsonl' does not exist",
        str(tmp_path): f"'{tmp_path}' is a directory; give files or a glob like "
                       f"{tmp_path}/*.jsonl",
    }
    for path, message in cases.items():
        with pytest.raises(UserError) as e:
            load(config(path), tokenizer)
        assert str(e.value) == message


def test_config_and_state_errors(data, tokenizer):
    with pytest.raises(UserError) as e:
        load(config(data[0] / "*.jsonl", batch_size=6), tokenizer, processes=4)
    assert str(e.value) == "batch_size=6 is not divisible by the 4 processes"
    with pytest.raises(UserError) as e:
        DatasetFactory.load_dataset(DatasetFactory.get_default_config({"type": "csv"}),
                                    tokenizer)
    assert str(e.value) == ("unknown dataset type 'csv'; expected json, huggingface, cache, "
                            "mixture")
    first = load(config(data[0] / "*.jsonl"), tokenizer, processes=2)
    [other] = load(config(data[0] / "*.jsonl", batch_size=8), tokenizer)
    with pytest.raises(UserError) as e:
        other.load_state_dict(first[0].get_state_dict())
    assert str(e.value) == ("the data state was saved with batch_size=4 but this run has "
                            "batch_size=8")
    [single] = load(config(data[0] / "*.jsonl"), tokenizer)
    with pytest.raises(UserError) as e:
        single.load_state_dict(first[0].get_state_dict())
    assert str(e.value).startswith("the data state has no position for rows [2, 3]")


def test_fsspec_url(data, tokenizer):
    import fsspec

    path, _ = data
    with fsspec.open("memory://easylm-test/part0.jsonl", "wb") as f:
        f.write((path / "part0.jsonl").read_bytes())
    local = read(load(config(path / "part0.jsonl"), tokenizer), 3)
    remote = read(load(config("memory://easylm-test/*.jsonl"), tokenizer), 3)
    assert_same(local, remote)


def test_chat_dataset(tmp_path, tokenizer):
    conversation = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": conversation}) + "\n")
    cfg = config(tmp_path / "chat.jsonl", batch_size=1, seq_length=64)
    cfg.text_processor.chat = True
    [dataset] = load(cfg, tokenizer, for_eval=True)
    [batch] = [b for b, _ in dataset]
    trained = batch["target_tokens"][batch["loss_masks"] > 0]
    assert tokenizer.decode(trained) == "Hello.</s>\n"


def test_huggingface_sources(data, tokenizer, tmp_path):
    import datasets

    path, texts = data
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(saved))
    reference = read(load(config(path / "*.jsonl", shuffle=True), tokenizer), 12)
    loader = dict(seq_length=T, batch_size=B, shuffle=True, tokenizer_parallel_batch_size=8)
    for source in (dict(path=str(saved)),
                   dict(path="json", data_files=f"{path}/part0.jsonl,{path}/part1.jsonl")):
        cfg = DatasetFactory.get_default_config(
            {"type": "huggingface", "huggingface_dataset": dict(loader, **source)})
        assert_same(reference, read(load(cfg, tokenizer), 12))
    cfg = DatasetFactory.get_default_config(
        {"type": "huggingface", "huggingface_dataset": {"path": "nobody/nothing"}})
    with pytest.raises(UserError) as e:   # tests run offline: not in the cache
        load(cfg, tokenizer)
    assert str(e.value) == ("cannot load huggingface_dataset.path='nobody/nothing' (name='', "
                            "split='train'): Couldn't reach 'nobody/nothing' on the Hub "
                            "(OfflineModeIsEnabled)")


def test_huggingface_streaming_resumes_exactly(data, tokenizer):
    path, _ = data
    cfg = DatasetFactory.get_default_config({"type": "huggingface", "huggingface_dataset": dict(
        path="json", data_files=f"{path}/part0.jsonl,{path}/part1.jsonl", streaming=True,
        shuffle=True, shuffle_buffer_size=16, seq_length=T, batch_size=B,
        tokenizer_parallel_batch_size=8)})
    expected = read(load(cfg, tokenizer), 30)
    first = load(cfg, tokenizer, processes=2)
    got = read(first, 25)        # into the second epoch: the epoch size is known
    state = merge_state_dicts([d.get_state_dict() for d in first])
    assert state["num_documents"] == 40
    [second] = load(cfg, tokenizer)
    second.load_state_dict(state)
    assert_same(expected, got + read([second], 5))


def split_over_dp_fsdp(x, mesh) -> bool:
    """Rows split over ('dp', 'fsdp'), the rest whole: the batch axes (dp, fsdp, ep) place
    it so when ep is 1."""
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("dp", "fsdp")))
    return x.sharding.is_equivalent_to(rows, x.ndim)


def test_make_global_batch(data, tokenizer):
    [dataset] = load(config(data[0] / "*.jsonl", batch_size=8), tokenizer)
    batch = read([dataset], 1)[0]
    mesh = make_mesh("2,2,2")
    global_batch = make_global_batch(batch, mesh)
    for k, v in batch.items():
        assert global_batch[k].shape == v.shape
        assert split_over_dp_fsdp(global_batch[k], mesh)
        np.testing.assert_array_equal(np.asarray(global_batch[k]), v)
    # Rank-1 leaves (a preference batch's precomputed reference log-probabilities, (b,))
    # split the same way.
    per_pair = make_global_batch({"logps": np.arange(8, dtype=np.float32)}, mesh)["logps"]
    assert split_over_dp_fsdp(per_pair, mesh)
    np.testing.assert_array_equal(np.asarray(per_pair), np.arange(8))


def test_placed_batches_arrive_on_devices_and_the_state_counts_only_those_taken(data, tokenizer):
    cfg = config(data[0] / "*.jsonl", batch_size=8, shuffle=True)
    expected = read(load(cfg, tokenizer), 10)
    mesh = make_mesh("2,2,2")
    [dataset] = load(cfg, tokenizer)
    placed = dataset.iterate(place=lambda batch: make_global_batch(batch, mesh))
    got = [next(placed)[0] for _ in range(4)]
    for batch in got:
        assert isinstance(batch["input_tokens"], jax.Array)
        assert split_over_dp_fsdp(batch["input_tokens"], mesh)
    state = dataset.get_state_dict()  # the thread may have placed more by now
    placed.close()
    assert state["batches"] == 4
    [resumed] = load(cfg, tokenizer)
    resumed.load_state_dict(state)
    assert_same(expected, [jax.tree.map(np.asarray, b) for b in got] + read([resumed], 6))


def test_every_flag_has_help():
    from easylm.flags import flatten

    assert set(flatten(DatasetFactory.get_default_config())) == set(DatasetFactory.HELP)


def test_an_eval_set_of_the_wrong_kind_is_refused_when_loaded(data, tmp_path, tokenizer):
    from easylm.llama import train

    # DPO with a text eval set: every example would be skipped, the evaluation empty.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}?", "chosen": "yes",
                                         "rejected": "no"}) + "\n" for i in range(3)))
    text = data[0] / "part1.jsonl"
    flags = train.parse_flags(["train", "--llama.base_model=debug", "--objective=dpo",
                               f"--train_dataset.json_dataset.path={pairs}",
                               f"--eval_dataset.json_dataset.path={text}", "--eval_freq=1"])
    with pytest.raises(UserError) as e:
        DatasetFactory.load_dataset(flags.eval_dataset, tokenizer, for_eval=True, pairs=True,
                                    process_index=0, process_count=1)
    assert str(e.value) == (f"--eval_dataset has no usable example: all 15 were skipped, the "
                            f"first: {text}:1: missing field 'prompt'; the example has: text")
    # Next-token training with an eval set of pairs: a missing text field is an error
    # (not a skip), now also when the eval set is loaded.
    with pytest.raises(UserError, match=f"^{pairs}:1: missing field 'text'"):
        load(config(pairs), tokenizer, for_eval=True)


def test_an_eval_set_whose_first_windows_are_bad_still_loads(data, tmp_path, tokenizer):
    path = tmp_path / "late.jsonl"   # 70 bad lines: past the first window of 64 examples
    path.write_text('{"text": \n' * 70 + json.dumps({"text": data[1][0]}) + "\n")
    [dataset] = load(config(path), tokenizer, for_eval=True)
    assert sum(batch["loss_masks"].sum() for batch, _ in dataset) == \
        len(tokenizer.encode(data[1][0], add_special_tokens=False)) + 1   # the text and EOS
