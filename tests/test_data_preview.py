"""`python -m easylm.data.preview`: marked spans, statistics, one-line errors."""

import json
import os
import subprocess
import sys

from easylm.data import DatasetFactory
from easylm.data.preview import preview
from easylm.tokenizer import load_tokenizer


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
