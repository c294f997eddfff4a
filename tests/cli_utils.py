"""Shared by the command-line tests: a user error is one `error:` line and exit status 2;
a short training run of a HF directory through the command."""

import contextlib
import io
import json
import os
import re

import pytest


def xla_flags(devices: int) -> str:
    """This session's XLA_FLAGS (conftest.py's compile flags kept) with `devices` host
    devices: for the commands a test starts on another mesh."""
    return re.sub(r"--xla_force_host_platform_device_count=\d+",
                  f"--xla_force_host_platform_device_count={devices}", os.environ["XLA_FLAGS"])


def one_line_error(main, argv: list[str], capsys) -> str:
    """Run `main(argv)` expecting a user error; its message without `error: `."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err[len("error: "):-1]


def train_losses(directory, output_dir) -> list[float]:
    """The logged losses of 3 steps of `python -m easylm.train --load_checkpoint=hf::DIR`
    (fp32, rows of 32, lr 1e-2 after one warm-up step at 0), run in process."""
    from easylm import train

    with contextlib.redirect_stdout(io.StringIO()):
        train.main(["train", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
                    "--total_steps=3", "--log_freq=1", "--dtype=fp32", "--mesh_dim=1,1,-1",
                    "--train_dataset.json_dataset.seq_length=32",
                    "--train_dataset.json_dataset.batch_size=4", "--compilation_cache_dir=",
                    f"--logger.output_dir={output_dir}", "--logger.experiment_id=run",
                    "--optimizer.adamw_optimizer.lr=1e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=1", "--save_model_freq=0"])
    with open(f"{output_dir}/run/metrics.jsonl") as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]
