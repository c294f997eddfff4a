"""The trainer's logs: metrics.jsonl rows (their time, NaN kept), the printed summary line
and the progress bar's fields; TensorBoard event files (--logger.tensorboard) read back
with TensorBoard's own reader: every logged scalar at its step, the flags as text, resume, other processes, a real run."""

import glob
import json
import math
import os
import time

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from easylm.llama import train
from easylm.training import logger
from easylm.training.logger import format_metrics, progress_postfix

STEP = {"loss": 2.5, "accuracy": 0.4, "learning_rate": 1e-3, "gradient_norm": 0.7}


def test_summary_shows_mfu_only_when_known():
    cpu = format_metrics(25, {**STEP, "tokens_per_second": 3637.0, "mfu": None})
    assert cpu == ("step 25 | loss 2.5000 | acc 0.400 | lr 1.00e-03 | grad_norm 0.700 | "
                   "tokens/s 3,637")
    gpu = format_metrics(25, {**STEP, "tokens_per_second": 69012.0, "mfu": 0.571})
    assert gpu.endswith("tokens/s 69,012 | MFU 57.1%")


def test_a_grpo_step_shows_its_reward_completion_length_and_kl():
    grpo = {"loss": 0.01, "reward": 0.625, "completions/mean_length": 7.5, "kl": 0.0031,
            "learning_rate": 1e-3, "gradient_norm": 0.7, "tokens_per_second": 2727.0}
    assert format_metrics(2, grpo) == ("step 2 | loss 0.0100 | reward 0.625 | length 7.5 | "
                                       "kl 3.10e-03 | lr 1.00e-03 | grad_norm 0.700 | "
                                       "tokens/s 2,727")
    assert format_metrics(2, {"eval_loss": 0.01, "eval_reward": 0.5}) == \
        "step 2 | eval loss 0.0100 | reward 0.500"


def test_a_mixture_of_experts_step_shows_the_total_loss_then_its_parts():
    moe = {"loss": 2.53, "ce_loss": 2.5, "aux_loss": 1.5, "z_loss": 0.25, "accuracy": 0.4,
           "moe_load_min": 3.0, "moe_load_max": 9.0, "moe_dropped": 0.0}
    assert format_metrics(3, moe) == (
        "step 3 | loss 2.5300 | ce_loss 2.5000 | aux_loss 1.500 | z_loss 0.250 | acc 0.400 | "
        "expert load min 3 | max 9 | dropped 0 | tokens/s n/a (compiling)")
    assert format_metrics(3, {"eval_loss": 2.53, "eval_ce_loss": 2.5, "eval_aux_loss": 1.5}) \
        == "step 3 | eval loss 2.5300 | ce_loss 2.5000 | aux_loss 1.500"


def test_first_step_says_it_compiles_instead_of_zero_tokens_per_second():
    first = {**STEP, "tokens_per_second": None, "mfu": None}
    assert format_metrics(1, first).endswith("tokens/s n/a (compiling)")
    assert progress_postfix(first) == {"loss": "2.5000", "tokens/s": "compiling"}
    assert progress_postfix({**STEP, "tokens_per_second": 3637.4}) == {
        "loss": "2.5000", "tokens/s": "3,637"}


@pytest.fixture(autouse=True)
def no_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")


def read_events(directory) -> tuple[dict, dict]:
    """({tag: [(step, value)]}, {tag: [text]}) as TensorBoard shows them."""
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in events.Tags()["scalars"]}
    texts = {tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
             for tag in events.Tags()["tensors"]}
    return scalars, texts


def make_logger(run_dir, start_step=0, **config):
    return logger.Logger(logger.get_default_config({"tensorboard": True, **config}), str(run_dir),
                         {"total_steps": 4, "optimizer.lr": 0.003}, 4, start_step)


def close_to_float32(scalars: dict, expected: dict):
    """TensorBoard stores float32: each logged number, rounded so, at its steps."""
    assert set(scalars) == set(expected)
    for tag, points in expected.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        for (_, a), (_, b) in zip(got, points):
            assert (math.isnan(a) and math.isnan(b)) or a == np.float32(b), (tag, a, b)


def test_every_logged_number_is_a_scalar_at_its_step(tmp_path):
    log = make_logger(tmp_path)
    log.log(1, {"loss": 2.5, "tokens_per_second": None, "mfu": None, "learning_rate": 1e-3},
            echo=False)
    log.log(2, {"loss": np.float32(2.25), "tokens_per_second": 1234.5, "tokens_seen": 8192,
                "data/epoch": np.int64(0), "learning_rate": 2e-3}, echo=False)
    log.log(2, {"eval_loss": 2.75, "eval_accuracy": 0.125}, echo=False)
    log.log(3, {"gradient_norm": float("nan"), "note": "not a number", "skipped": True},
            echo=False)
    log.close()
    scalars, texts = read_events(tmp_path)
    close_to_float32(scalars, {
        "loss": [(1, 2.5), (2, 2.25)], "gradient_norm": [(3, float("nan"))],
        "learning_rate": [(1, 1e-3), (2, 2e-3)], "tokens_per_second": [(2, 1234.5)],
        "tokens_seen": [(2, 8192)], "data/epoch": [(2, 0)], "eval_loss": [(2, 2.75)],
        "eval_accuracy": [(2, 0.125)]})
    assert texts["flags/text_summary"] == ["    --total_steps=4\n    --optimizer.lr=0.003"]


def test_resume_replaces_what_the_dead_run_logged_after_the_checkpoint(tmp_path):
    first = make_logger(tmp_path)
    for step in range(1, 5):
        first.log(step, {"loss": float(step)}, echo=False)
    first.close()
    resumed = make_logger(tmp_path, start_step=2)  # the checkpoint was at step 2
    for step in (3, 4, 5):
        resumed.log(step, {"loss": 10.0 * step}, echo=False)
    resumed.close()
    scalars, _ = read_events(tmp_path)
    assert scalars["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(line["step"], line["loss"]) for line in lines] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


def test_other_processes_write_only_with_log_all_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    quiet = make_logger(tmp_path / "quiet")
    quiet.log(1, {"loss": 1.0}, echo=False)
    quiet.close()
    assert not os.path.exists(tmp_path / "quiet")
    log = logger.Logger(logger.get_default_config({"tensorboard": True}), str(tmp_path / "all"),
                        {}, 4, 0, all_processes=True)
    log.log(1, {"loss": 1.0}, echo=False)
    log.close()
    assert read_events(tmp_path / "all" / "process1")[0] == {"loss": [(1, 1.0)]}
    assert not glob.glob(str(tmp_path / "all" / "events.*"))  # process 0's place


def test_a_training_run_logs_every_metric_to_tensorboard(tmp_path):
    train.main(["train", "--total_steps=4", "--log_freq=1", "--eval_freq=2", "--eval_steps=1",
                "--llama.num_hidden_layers=1", "--train_dataset.json_dataset.batch_size=8",
                "--train_dataset.json_dataset.seq_length=32",
                "--eval_dataset.json_dataset.batch_size=8",
                "--eval_dataset.json_dataset.seq_length=32", "--logger.tensorboard=True",
                f"--logger.output_dir={tmp_path}", "--logger.experiment_id=run"])
    expected = {}
    for line in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")):
        for key, value in line.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault(key, []).append((line["step"], value))
    assert [s for s, _ in expected["loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in expected["eval_loss"]] == [2, 4]
    scalars, texts = read_events(tmp_path / "run")
    close_to_float32(scalars, expected)
    assert "    --logger.tensorboard=True" in texts["flags/text_summary"][0].split("\n")


def test_rows_carry_their_wall_clock_time_and_nan_is_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    log = logger.Logger(logger.get_default_config(), str(tmp_path), {}, total_steps=2)
    before = time.time()
    log.log(1, {"loss": 2.5, "learning_rate": 1e-3})
    log.log(2, {"loss": float("nan"), "learning_rate": float("nan"), "gradient_norm": float("inf")})
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1, 2]
    assert before <= rows[0]["time"] <= rows[1]["time"] <= time.time()
    assert rows[1]["loss"] == "nan"  # JSON has no NaN: kept as text
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1 | loss 2.5000 | lr 1.00e-03")
    assert out[1].startswith("step 2 | loss nan | lr nan | grad_norm inf")
