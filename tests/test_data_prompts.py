"""Prompt rows for GRPO (easylm/data/prompts.py): text and chat prompts tokenized as the
rollouts need them, the other fields kept, bad lines skipped with file and line, and the
exact resumable state of the data pipeline."""

import json
import logging
import re

import numpy as np
import pytest

from easylm.data import DatasetFactory
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def dataset(path, tokenizer, completion_tokens=8, batch_size=2, **loader):
    config = DatasetFactory.get_default_config({"json_dataset": dict(
        path=str(path), batch_size=batch_size, seq_length=32, **loader)})
    return DatasetFactory.load_dataset(config, tokenizer, prompts=completion_tokens,
                                       process_index=0, process_count=1)


def write(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def test_text_and_chat_prompts_keep_their_fields(tokenizer, tmp_path, caplog):
    chat = [{"role": "user", "content": "two plus two?"}]
    path = write(tmp_path / "p.jsonl", [
        {"prompt": "two plus two?", "answer": "4"},
        {"messages": chat, "answer": "4", "level": 1},
        {"text": "no prompt here"},
        {"prompt": "two " * 30, "answer": "long"},
    ])
    data = dataset(path, tokenizer)
    with caplog.at_level(logging.WARNING, logger="easylm.data.dataset"):
        batch, metrics = next(data.iterate())
    data.close()
    text_ids = [tokenizer.bos_token_id] + tokenizer("two plus two?", add_special_tokens=False)[
        "input_ids"]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    lengths = batch["prompt_lengths"].tolist()
    assert lengths == [len(text_ids), len(chat_ids)]
    assert batch["prompt_tokens"][0, :lengths[0]].tolist() == text_ids
    assert batch["prompt_tokens"][1, :lengths[1]].tolist() == chat_ids
    assert list(batch["examples"]) == [{"prompt": "two plus two?", "answer": "4"},
                                       {"prompt": chat, "messages": chat, "answer": "4",
                                        "level": 1}]
    assert metrics["dataset_skipped_documents"] >= 2
    assert "p.jsonl:3: missing field 'prompt'" in caplog.text
    assert re.search(r"p\.jsonl:4: the prompt is \d+ tokens, longer than the 24 a row leaves "
                     r"it \(seq_length - --grpo\.max_new_tokens\)", caplog.text)


def test_state_resumes_at_the_next_prompt(tokenizer, tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": f"number {i}", "i": i} for i in range(9)])
    first = dataset(path, tokenizer, shuffle=True)
    batches = first.iterate()
    for _ in range(3):
        next(batches)
    state = json.loads(json.dumps(first.get_state_dict()))
    expected = [[e["i"] for e in next(batches)[0]["examples"]] for _ in range(3)]
    first.close()
    resumed = dataset(path, tokenizer, shuffle=True)
    resumed.load_state_dict(state)
    batches = resumed.iterate()
    assert [[e["i"] for e in next(batches)[0]["examples"]] for _ in range(3)] == expected
    assert state["prompts"] is True
    # A state saved from text is refused, and this one by a text dataset.
    text = DatasetFactory.load_dataset(DatasetFactory.get_default_config({"json_dataset": dict(
        path=str(path), batch_size=2, seq_length=32, shuffle=True)}),
        tokenizer, process_index=0, process_count=1)
    with pytest.raises(UserError, match="saved from prompts"):
        text.load_state_dict(state)


def test_an_eval_pass_pads_its_last_rows(tokenizer, tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": f"number {i}"} for i in range(3)])
    config = DatasetFactory.get_default_config({"json_dataset": dict(
        path=str(path), batch_size=2, seq_length=24)})
    batches = list(DatasetFactory.load_dataset(config, tokenizer, for_eval=True, prompts=8,
                                               process_index=0, process_count=1))
    assert [b["prompt_lengths"].astype(bool).tolist() for b, _ in batches] == \
        [[True, True], [True, False]]
    assert batches[1][0]["examples"][1] is None
    assert np.all(batches[1][0]["prompt_tokens"][1] == tokenizer.pad_token_id)
