"""Gemma 3 through the public commands, from a tiny random `Gemma3ForCausalLM` directory
(with the embedded tokenizer, whose ids the debug preset shares): fine-tuning lowers the
loss, the printed serve line answers an OpenAI-style chat request and decodes past the
window as transformers' generate on the export, which has our logits; hf -> easylm -> hf
through the converters is bitwise; a LoRA run exports a PEFT adapter and a merged model
with our logits, and its printed serve line decodes as the merged model."""

import json
import shlex

import jax
import numpy as np
import pytest
import torch
from cli_utils import one_line_error
from fastapi.testclient import TestClient
from gemma_utils import forward_rel, hf_logits, hf_model, params_of, tiny_config
from numerics import assert_close, assert_differs
from transformers import AutoModelForCausalLM

from easylm import model_flags
from easylm import flags as flag_lib
from easylm.data.tokenizer import load_tokenizer
from easylm.gemma import convert_easylm_to_hf, convert_hf_to_easylm, train
from easylm.gemma.family import FAMILY
from easylm.gemma.model import GemmaForCausalLM
from easylm.models import registry
from easylm.models.hf_checkpoint import HFTensors
from easylm.runtime import checkpoint
from easylm.serving import cli as serving_cli


def cli_config():
    """tests/gemma_utils.py's model with two layers, one sliding and one global: what the
    commands see of Gemma, at half the compile time of four."""
    return tiny_config(num_hidden_layers=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma") / "hf"
    hf_model(cli_config()).save_pretrained(directory)
    load_tokenizer("embedded").save_pretrained(directory)
    return directory


def train_argv(tmp_path, hf_dir, steps=6, lr=3e-3, tokenizer=None) -> list[str]:
    return ["train", f"--load_checkpoint=hf::{hf_dir}", f"--tokenizer={tokenizer or hf_dir}",
            f"--total_steps={steps}", "--log_freq=1", "--train_dataset.json_dataset.seq_length=32",
            "--train_dataset.json_dataset.batch_size=4", f"--logger.output_dir={tmp_path / 'runs'}",
            "--compilation_cache_dir=", "--dtype=fp32", "--mesh_dim=1,1,-1",
            f"--optimizer.adamw_optimizer.lr={lr}", "--optimizer.adamw_optimizer.lr_warmup_steps=1"]


def serve(argv: list[str]):
    """(app, batcher) of `python -m easylm.serve ARGV`, in this process."""
    family, argv = registry.from_argv(["serve", *argv], detect=True)
    assert family is FAMILY
    config = flag_lib.parse(serving_cli.default_config(family), serving_cli.help_entries(family),
                            argv)
    return serving_cli.build(family, config)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hf_dir):
    """The train command's output: (final checkpoint, its stdout)."""
    import contextlib
    import io

    tmp_path = tmp_path_factory.mktemp("run")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(train_argv(tmp_path, hf_dir))
    text = out.getvalue()
    return text.split("checkpoint: ")[1].split()[0], text


def test_fine_tuning_a_directory_lowers_the_loss(trained):
    final, _ = trained
    lines = (checkpoint.read_metadata(final), final.rsplit("/checkpoints/", 1)[0])
    metadata, run_dir = lines
    assert metadata["model"] == "gemma" and metadata["gemma_config"]["query_pre_attn_scalar"] == 24
    with open(f"{run_dir}/metrics.jsonl") as f:
        losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses


def test_the_printed_serve_line_answers_and_the_export_is_transformers_model(tmp_path, trained,
                                                                              capsys):
    # The trained checkpoint served by the line the trainer printed: a chat request (the
    # tokenizer's template, BOS once) and greedy decoding past the window; then exported,
    # transformers loads it with our logits and its generate() gives the served tokens.
    final, text = trained
    line = next(line for line in text.splitlines() if line.startswith("serve it:"))
    argv = shlex.split(line.partition("serve it:")[2])
    assert argv[:3] == ["python", "-m", "easylm.gemma.serve"]
    app, batcher = serve(argv[3:] + ["--seq_length=64", "--batch_size=2", "--mesh_dim=1,1,-1"])
    messages = [{"role": "user", "content": "Tell me a story."}]
    prompt = [1, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # longer than the window (8)
    try:
        client = TestClient(app, base_url="http://127.0.0.1")
        chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6,
                                                         "temperature": 0})
        completion = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                                          "temperature": 0}).json()
    finally:
        batcher.stop()
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["object"] == "chat.completion"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert 1 <= body["usage"]["completion_tokens"] <= 6
    tokenizer = load_tokenizer("embedded")
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert rendered.count(tokenizer.bos_token_id) == 1
    assert body["usage"]["prompt_tokens"] == len(rendered)

    convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{final}",
                               f"--output_dir={tmp_path / 'back'}"])
    assert "verify: max |logit difference| vs transformers" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    config = model_flags.recorded_config(FAMILY, f"params::{final}")
    params = checkpoint.load_params(f"params::{final}", jax.eval_shape(
        GemmaForCausalLM(config).init_params, jax.random.key(0)))
    ids = np.random.RandomState(1).randint(0, config.vocab_size, (2, 32))
    theirs = hf_logits(exported, ids)
    ours = GemmaForCausalLM(config).apply({"params": params}, ids)
    assert_close(ours, theirs, forward_rel(config, 32))
    # Negative twin: the model before training computes other logits.
    assert_differs(hf_logits(hf_model(cli_config()), ids), theirs, forward_rel(config, 32))
    with torch.no_grad():
        out = exported.generate(torch.tensor([prompt]), max_new_tokens=12,
                                do_sample=False)[0][len(prompt):].tolist()
    expected = out[:out.index(config.eos_token_id)] if config.eos_token_id in out else out
    assert completion["choices"][0]["text"] == tokenizer.decode(expected,
                                                                skip_special_tokens=True)


def test_converters_round_trip_bitwise(tmp_path, hf_dir):
    convert_hf_to_easylm.main(["convert", f"--hf_model={hf_dir}",
                               f"--output_dir={tmp_path / 'easylm'}"])
    convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{tmp_path / 'easylm'}",
                               f"--output_dir={tmp_path / 'back'}"])
    before, after = HFTensors(str(hf_dir)), HFTensors(str(tmp_path / "back"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype
        assert before[name].tobytes() == after[name].tobytes(), name
    config = json.loads((hf_dir / "config.json").read_text())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in back.items() if k != "initializer_range"} == \
        {k: v for k, v in config.items() if k != "initializer_range"}


def test_bad_input_is_one_line(tmp_path, hf_dir, capsys):
    (tmp_path / "gemma2").mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "gemma2" / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    message = one_line_error(train.main, train_argv(tmp_path, tmp_path / "gemma2", steps=1,
                                                          tokenizer="embedded"), capsys)
    assert message == (f"{tmp_path / 'gemma2' / 'config.json'}: model_type 'gemma2' is not a "
                       f"Gemma 3 model (supported: gemma3_text, and the text tower of gemma3)")
    (tmp_path / "soft").mkdir()
    (tmp_path / "soft" / "config.json").write_text(json.dumps({**config,
                                                              "final_logit_softcapping": 30.0}))
    message = one_line_error(convert_hf_to_easylm.main, [
        "convert", f"--hf_model={tmp_path / 'soft'}", f"--output_dir={tmp_path / 'out'}"], capsys)
    assert message == (f"{tmp_path / 'soft' / 'config.json'}: final_logit_softcapping=30.0 is "
                       f"not supported (this Gemma 3 model implements "
                       f"final_logit_softcapping=None)")


def test_a_lora_run_exports_a_peft_adapter_and_a_merged_model(tmp_path, hf_dir, capsys):
    # LoRA on every projection (PEFT's q_proj ... down_proj): a few steps from hf::DIR, then
    # the adapter loads with peft onto transformers' model of the base, and the merged
    # export loads in transformers, both with our logits.
    from peft import PeftModel

    from easylm.variants.adapters import Adapters
    from easylm.variants.lora_variant import read_adapters

    train.main(train_argv(tmp_path, hf_dir, steps=3, lr=1e-2) + ["--lora.rank=4",
                                                                  "--lora.alpha=8"])
    printed = capsys.readouterr().out
    final = printed.split("checkpoint: ")[1].split()[0]
    serve_line = next(line for line in printed.splitlines() if line.startswith("serve it:"))
    for mode in ("adapter", "merged"):
        # The command's own --verify is what the lines below do; once is enough.
        convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{final}",
                                   f"--output_dir={tmp_path / mode}", f"--lora_mode={mode}",
                                   "--verify=False"])
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    config = cli_config()
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = np.random.RandomState(2).randint(0, config.vocab_size, (2, 32))
    before = hf_logits(base, ids)
    peft = hf_logits(PeftModel.from_pretrained(base, tmp_path / "adapter").eval(), ids)
    merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                        dtype=torch.float32).eval()
    merged = hf_logits(merged_model, ids)
    lora, adapters, _ = read_adapters(final, load_peft=None)  # a run's checkpoint
    lm = Adapters(FAMILY).lora_model(config, lora)
    ours = np.asarray(lm.apply(lm.store_base(params_of(hf_model(config), config)), adapters, ids))
    rel = forward_rel(config, 32)
    assert_close(ours, peft, rel)
    assert_close(merged, peft, rel)
    assert_differs(before, peft, rel)  # the adapters moved the logits

    # The printed serve line: the adapters folded into their base as it loads; greedy
    # tokens as the merged model's.
    argv = shlex.split(serve_line.partition("serve it:")[2])[3:]
    assert f"--lora_checkpoint={final}" in argv
    app, batcher = serve(argv + ["--seq_length=32", "--batch_size=1", "--mesh_dim=1,1,-1"])
    try:
        response = TestClient(app, base_url="http://127.0.0.1").post("/v1/completions", json={
            "prompt": [1, 7, 8, 9], "max_tokens": 4, "temperature": 0}).json()
    finally:
        batcher.stop()
    ids = [1, 7, 8, 9]
    for _ in range(4):
        ids.append(int(np.argmax(hf_logits(merged_model, [ids])[0, -1])))
    expected = ids[4:ids.index(2, 4)] if 2 in ids[4:] else ids[4:]
    assert response["choices"][0]["text"] == load_tokenizer("embedded").decode(
        expected, skip_special_tokens=True)


def test_scanned_layers_train_as_the_unscanned_and_a_resume_across_is_refused(
        tmp_path, tmp_path_factory, capsys):
    # Five layers, pattern (sliding, global): two scanned repeats and one layer after them.
    import contextlib
    import io

    from test_checkpoint import metrics

    config = tiny_config(num_hidden_layers=5)
    directory = tmp_path_factory.mktemp("gemma5") / "hf"
    hf_model(config).save_pretrained(directory)
    load_tokenizer("embedded").save_pretrained(directory)
    runs = {}
    for scan in (False, True):
        argv = [*train_argv(tmp_path / f"scan{scan}", directory, steps=3),
                "--logger.experiment_id=run", f"--gemma.scan_layers={scan}"]
        with contextlib.redirect_stdout(io.StringIO()):
            train.main(argv)
        runs[scan] = metrics(tmp_path / f"scan{scan}" / "runs")
        assert sorted(runs[scan]) == [1, 2, 3]
    # The first step is one forward and backward pass on the same weights and batch: the
    # scan reorders no sum, but XLA fuses a scanned body otherwise, so each logit may
    # round differently, by the forward pass's relative bound; the mean loss and the
    # gradient norm (sums of such terms) then within that relative bound too.
    rel = forward_rel(config, 32)
    for name in ("loss", "gradient_norm"):
        assert runs[True][1][name] == pytest.approx(runs[False][1][name], rel=rel, abs=0)
    # Later steps follow from Adam updates of lr 3e-3 on such gradients: they stay alike
    # (a wrong scan, a layer dropped or a slot reordered, moves the first loss by far more).
    for step in (2, 3):
        assert runs[True][step]["loss"] == pytest.approx(runs[False][step]["loss"], rel=1e-3)
    # The unscanned run's trainstate does not resume scanned: refused by the flag, in one line.
    argv = [*train_argv(tmp_path / "scanFalse", directory, steps=4),
            "--logger.experiment_id=run", "--gemma.scan_layers=True"]
    capsys.readouterr()  # the runs' warnings
    error = one_line_error(train.main, argv, capsys)
    assert "--gemma.scan_layers" in error, error
