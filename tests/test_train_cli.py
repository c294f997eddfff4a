"""`python -m easylm.llama.train`: the embedded default end to end, --help,
--flagfile, the example configs, and one clear line for each bad input."""

import glob
import json
import os
import subprocess
import sys

import jax
import pytest

from easylm import checkpoint, flags
from easylm.llama import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, cwd, env=None):
    return subprocess.run(
        [sys.executable, "-m", "easylm.llama.train", *args], cwd=cwd, capture_output=True,
        text=True, timeout=600, env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
    )


def test_embedded_default_trains_and_saves(tmp_path):
    # The README's first command, with only the step count made small.
    result = run_cli("--total_steps=4", "--log_freq=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "llama-*"))
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2, 4]  # the first step, then every 2
    assert lines[0]["tokens_per_second"] is None  # step 1 includes compilation
    for key in ("loss", "accuracy", "perplexity", "learning_rate", "gradient_norm",
                "param_norm", "tokens_seen", "tokens_per_second", "mfu"):
        assert key in lines[-1], key
    assert lines[-1]["tokens_seen"] == 4 * 16 * 256
    assert lines[-1]["mfu"] is None  # CPU: no peak FLOP/s to compare with
    assert lines[-1]["loss"] < lines[0]["loss"]
    final = os.path.join(run_dir, "checkpoints", "4")
    assert f"serve it:   python -m easylm.llama.serve --load_checkpoint=params::{final} " \
           f"--tokenizer=embedded" in result.stdout
    # CPU: no peak FLOP/s, said once in the header rather than "MFU n/a" on every step.
    header = next(line for line in result.stdout.splitlines() if " parameters | " in line)
    assert f"mesh dp=1 fsdp={jax.device_count()} mp=1 |" in header and "no MFU" in header, header
    assert not [line for line in result.stdout.splitlines()
                if line.startswith("step ") and "MFU" in line]
    assert glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    metadata = checkpoint.read_metadata(final)
    assert metadata["step"] == 4 and metadata["llama_config"]["hidden_size"] == 128
    # The saved parameters load into the model the flags describe.
    model = train.build_model(train.default_config())
    abstract = jax.eval_shape(model.init_params, jax.random.key(0))
    params = checkpoint.load_params(f"params::{final}", abstract)
    assert params["model"]["embed_tokens"]["embedding"].shape == (512, 128)


def test_bad_flag_is_one_line_without_traceback(tmp_path):
    result = run_cli("--total_steps=ten", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("error: flag --total_steps=ten: invalid literal for int() "
                             "with base 10: 'ten'\n")


def expect_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        train.main(["train", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err[len("error: "):-1]


@pytest.mark.parametrize("argv, message", [
    (["--nonexistent_flag=1"], "Unknown command line flag 'nonexistent_flag'"),
    (["--optimizer.adamw_optimizer.lr=fast"],
     "flag --optimizer.adamw_optimizer.lr=fast: could not convert string to float: 'fast'"),
    (["--optimizer.type=lion"], "--optimizer.type='lion' is not one of adamw, palm"),
    (["--mesh_dim=3,1,1"], "--mesh_dim='3,1,1': the product 3 does not match the 8 devices"),
    (["--total_steps=0"], "--total_steps must be >= 1, got 0"),
    (["--tokenizer=/no/such/tokenizer.json"],
     "tokenizer '/no/such/tokenizer.json' does not exist; expected 'embedded', a tokenizer "
     "directory, a tokenizer.json file or a SentencePiece .model file"),
    (["--llama.vocab_size=256"],
     "the model's vocabulary (--llama.vocab_size=256) is smaller than the 512 tokens of "
     "--tokenizer=embedded"),
    (["--dtype=fp8"], "--dtype='fp8' is not one of auto, fp32, bf16, fp16"),
    (["--train_dataset.json_dataset.batch_size=12"],
     "--train_dataset batch size 12 must be a multiple of the dp*fsdp=8 batch shards times "
     "--optimizer.accumulate_gradient_steps=1"),
    (["stray"], "unexpected argument 'stray'; flags look like --name=value"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys, tmp_path):
    assert expect_error([*argv, f"--logger.output_dir={tmp_path}"], capsys) == message
    assert os.listdir(tmp_path) == []  # failed before writing anything


def test_help_lists_every_flag_with_help_text(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    entries = train.help_entries()
    for name in flags.flatten(train.default_config()):
        assert f"--{name}=" in out, name
        assert entries.get(name), f"--{name} has no help text"


def test_flagfile_and_command_line(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("# a comment\n--total_steps=7\n--optimizer.adamw_optimizer.lr=0.5\n")
    config = flags.parse(train.default_config(), train.help_entries(),
                         ["train", f"--flagfile={flagfile}", "--total_steps=9", "--nologger.online"])
    assert config.total_steps == 9  # later flags win
    assert config.optimizer.adamw_optimizer.lr == 0.5
    assert config.logger.online is False


def test_embedded_flagfile_is_the_default():
    parsed = flags.parse(train.default_config(), train.help_entries(),
                         ["train", f"--flagfile={REPO}/configs/embedded.flags"])
    assert flags.flatten(parsed) == flags.flatten(train.default_config())


@pytest.mark.parametrize("path", sorted(glob.glob(f"{REPO}/configs/*.flags")))
def test_example_configs_parse(path):
    config = flags.parse(train.default_config(), train.help_entries(), ["train", f"--flagfile={path}"])
    assert config.total_steps >= 1


def test_nonfinite_loss_stops_the_run_naming_the_step(tmp_path):
    # A learning rate of 1e30 wrecks the parameters in the first update, so the
    # loss of step 2 is not finite.
    result = run_cli("--total_steps=4", "--log_freq=4", "--train_dataset.json_dataset.seq_length=32",
                     "--optimizer.adamw_optimizer.init_lr=1e30", "--optimizer.adamw_optimizer.lr=1e30",
                     "--optimizer.adamw_optimizer.clip_gradient=0", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "error: loss or gradient norm became NaN/Inf at step 2; stopping (lower the learning "
        "rate, or pass --skip_nonfinite_updates=True to skip such steps)")
    assert "Traceback" not in result.stderr
