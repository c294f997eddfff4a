"""`python -m easylm.data.preview`: marked spans, statistics, one-line errors."""

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from easylm.data import DatasetFactory
from easylm.data.preview import preview
from easylm.data.tokenizer import load_tokenizer


def sft_file(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "What does a cat say?", "answer": "Meow."}) + "\n")
    return path


def test_preview_marks_spans_without_loss(tmp_path):
    config = DatasetFactory.get_default_config({
        "text_processor": {"fields": "[prompt],answer"},
        "json_dataset": {"path": str(sft_file(tmp_path)), "seq_length": 16, "batch_size": 2}})
    tokenizer = load_tokenizer("embedded")
    text = preview(config, tokenizer, num_examples=1, num_batches=2)
    lines = text.splitlines()
    assert "[[<s>What does a cat say?]]Meow.</s>" in lines
    assert "2 batches of 2 x 16 tokens" in lines
    prompt, answer = (len(tokenizer.encode(t, add_special_tokens=False))
                      for t in ("What does a cat say?", "Meow."))
    document_tokens, loss = 1 + prompt + answer + 1, answer + 1
    assert f"({document_tokens} tokens, {loss} with loss)" in lines


def run_cli(*flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "easylm.data.preview", *flags],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
def test_cli(tmp_path):
    path = sft_file(tmp_path)
    done = run_cli(f"--train_dataset.json_dataset.path={path}",
                   "--train_dataset.text_processor.fields=[prompt],answer",
                   "--train_dataset.json_dataset.seq_length=8", "--num_batches=1")
    assert done.returncode == 0, done.stderr
    assert "[[<s>What does a cat say?]]Meow.</s>" in done.stdout
    failed = run_cli(f"--train_dataset.json_dataset.path={tmp_path}/none.jsonl")
    assert failed.returncode == 2
    assert failed.stderr.strip() == f"error: data file '{tmp_path}/none.jsonl' does not exist"


def test_skipped_counts_only_the_documents_the_shown_batches_read(tmp_path):
    # 40 documents of 1 row each, one malformed line near the end: the loader reads (and
    # skips) it while preparing the first batch, but the first batch does not reach it.
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(40)]
    lines[30] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    tokenizer = load_tokenizer("embedded")
    seq_length = len(tokenizer.encode("document number 10")) + 1  # a document fills a row

    def skipped(batches):
        config = DatasetFactory.get_default_config({
            "text_processor": {"fields": "text"},
            "json_dataset": {"path": str(path), "seq_length": seq_length, "batch_size": 2}})
        text = preview(config, tokenizer, num_examples=0, num_batches=batches)
        return next(line for line in text.splitlines() if line.startswith("documents skipped"))

    assert skipped(1).startswith("documents skipped: 0 ")
    assert skipped(20).startswith("documents skipped: 1 ")  # 40 rows: past line 31


def test_documents_are_counted_not_the_bos_tokens_of_a_chat_template(tmp_path):
    # SmolLM2's template starts every turn with its BOS (<|im_start|>); here <s> does that.
    template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    path = tmp_path / "chat.jsonl"
    conversations = [[{"role": "user", "content": f"What is {i} plus {i}?"},
                      {"role": "assistant", "content": f"It is {2 * i}."}] for i in range(3)]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    tokenizer = load_tokenizer("embedded")
    seq_length, batches = 24, 3
    config = DatasetFactory.get_default_config({
        "text_processor": {"chat": True, "chat_template": template},
        "json_dataset": {"path": str(path), "seq_length": seq_length, "batch_size": 1}})
    lines = preview(config, tokenizer, num_examples=0, num_batches=batches).splitlines()
    # The one row reads the conversations in turn, epoch after epoch; a conversation
    # starts in the inputs when its first token is among the first `batches * seq_length`.
    documents = [tokenizer.encode(tokenizer.apply_chat_template(
        m, chat_template=template, tokenize=False), add_special_tokens=False)
        for m in conversations]
    inputs = batches * seq_length
    starts = np.cumsum([0] + [len(d) for d in documents] * batches)
    expected = int((starts < inputs).sum())
    bos_in_inputs = sum(documents * batches, [])[:inputs].count(tokenizer.bos_token_id)
    assert bos_in_inputs > expected  # what the preview used to report
    assert f"documents started in inputs: {expected}" in lines


def test_grpo_prompts_show_as_the_sampler_gets_them_and_long_ones_are_counted(tmp_path, capsys):
    from cli_utils import one_line_error

    from easylm.data.preview import main

    assert one_line_error(main, ["preview", "--completion_tokens=-1"], capsys) == \
        "--completion_tokens must be >= 0, got -1"

    rows = [{"prompt": "What is 2 + 3?", "answer": "5"},
            {"prompt": "word " * 40, "answer": "x"},  # longer than the row leaves it
            {"messages": [{"role": "user", "content": "Name a colour."}], "answer": "red"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = load_tokenizer("embedded")
    first = [tokenizer.bos_token_id, *tokenizer.encode("What is 2 + 3?", add_special_tokens=False)]
    chat = tokenizer.encode(tokenizer.apply_chat_template(
        rows[2]["messages"], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    argv = ["preview", "--tokenizer=embedded", f"--train_dataset.json_dataset.path={path}",
            "--train_dataset.json_dataset.seq_length=32", "--completion_tokens=8",
            "--train_dataset.json_dataset.batch_size=1", "--num_batches=2",
            "--train_dataset.json_dataset.shuffle=False"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        main(argv)
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["--- prompt 0", tokenizer.decode(first),
                         f"({len(first)} tokens; to the rewards: {{'answer': '5'}})"]
    assert lines[5].startswith("(skipped: ") and "longer than the 24 a row leaves" in lines[5]
    assert f"({len(chat)} tokens; to the rewards: {{'answer': 'red'}})" in lines
    assert lines[-3:] == [
        "2 batches of 1 prompts; a row is 32 tokens: the prompt (at most 24) and up to 8 "
        "completion tokens",
        f"prompts: 2, tokens per prompt: mean {(len(first) + len(chat)) / 2:.1f}, longest "
        f"{max(len(first), len(chat))}",
        "prompts skipped: 1 of the first 3 examples"]
