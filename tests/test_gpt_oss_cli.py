"""gpt-oss through the public commands, from a tiny random `GptOssForCausalLM` directory
(with the embedded tokenizer, whose ids the debug preset shares): `python -m easylm.train
--load_checkpoint=hf::DIR` lowers the loss, the checkpoint served by the line the trainer
prints answers /v1/completions with transformers' greedy decoding on the export of
`python -m easylm.convert_easylm_to_hf`, which has our logits. One test: one train run,
one served model, one export (each a compile of its own)."""

import contextlib
import io
import json
import re
import shlex

import numpy as np
import torch
from fastapi.testclient import TestClient
from test_gpt_oss import hf_logits, hf_model, tiny_config, tolerance
from transformers import AutoModelForCausalLM

from easylm import convert_easylm_to_hf, flags as flag_lib, train
from easylm.data.tokenizer import load_tokenizer
from easylm.gpt_oss.family import FAMILY
from easylm.models import registry
from easylm.serving import cli as serving_cli


def serve(argv: list[str]):
    """(app, batcher) of `python -m easylm.serve ARGV`, in this process."""
    family, argv = registry.from_argv(["serve", *argv], detect=True)
    assert family is FAMILY
    config = flag_lib.parse(serving_cli.default_config(family), serving_cli.help_entries(family),
                            argv)
    return serving_cli.build(family, config)


def test_train_serve_and_export(tmp_path, capsys):
    # Two layers (sliding, full); 64 positions, YaRN over 16 of them.
    config = tiny_config(num_hidden_layers=2, max_position_embeddings=64,
                         rope_original_max_position_embeddings=16)
    hf_model(config).save_pretrained(tmp_path / "hf")
    load_tokenizer("embedded").save_pretrained(tmp_path / "hf")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(["train", f"--load_checkpoint=hf::{tmp_path / 'hf'}",
                    f"--tokenizer={tmp_path / 'hf'}", "--total_steps=6", "--log_freq=1",
                    "--train_dataset.json_dataset.seq_length=32",
                    "--train_dataset.json_dataset.batch_size=4",
                    f"--logger.output_dir={tmp_path / 'runs'}", "--compilation_cache_dir=",
                    "--dtype=fp32", "--mesh_dim=1,1,-1", "--optimizer.adamw_optimizer.lr=3e-3",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=1"])
    text = out.getvalue()
    final = text.split("checkpoint: ")[1].split()[0]
    with open(f"{final.rsplit('/checkpoints/', 1)[0]}/metrics.jsonl") as f:
        losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses

    line = next(line for line in text.splitlines() if line.startswith("serve it:"))
    argv = shlex.split(line.partition("serve it:")[2])
    assert argv[:3] == ["python", "-m", "easylm.gpt_oss.serve"]
    app, batcher = serve(argv[3:] + ["--seq_length=64", "--batch_size=2", "--mesh_dim=1,1,-1"])
    prompt = [1, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # longer than the window (4)
    try:
        client = TestClient(app, base_url="http://127.0.0.1")
        completion = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                                          "temperature": 0}).json()
    finally:
        batcher.stop()

    capsys.readouterr()
    convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{final}",
                               f"--output_dir={tmp_path / 'back'}"])
    reported = re.search(r"verify: max \|logit difference\| vs transformers = (\S+)",
                         capsys.readouterr().out)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(exported).__name__ == "GptOssForCausalLM"
    ids = np.random.RandomState(1).randint(0, config.vocab_size, (2, 32))
    theirs = hf_logits(exported, ids)
    # The converter's own check of our logits against the export's, at our tolerance.
    assert float(reported.group(1)) <= tolerance(config) * np.abs(theirs).max()
    # Negative twin: the model before training computes other logits.
    assert np.abs(hf_logits(hf_model(config), ids) - theirs).max() > \
        tolerance(config) * np.abs(theirs).max()
    with torch.no_grad():
        out = exported.generate(torch.tensor([prompt]), max_new_tokens=12,
                                do_sample=False)[0][len(prompt):].tolist()
    expected = out[:out.index(config.eos_token_id)] if config.eos_token_id in out else out
    assert completion["choices"][0]["text"] == load_tokenizer("embedded").decode(
        expected, skip_special_tokens=True)
