"""`python -m easylm.llama.train`: the embedded default end to end, --help,
--flagfile, the example configs, and one clear line for each bad input."""

import glob
import json
import logging
import os
import subprocess
import sys
import time

import jax
import pytest
from fastapi.testclient import TestClient

from easylm import flags, variants
from easylm.llama import train
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.runtime import checkpoint
from easylm.serving import cli as serving_cli
from easylm.training import optimizers
from easylm.training.options import run_directory, warn_about_the_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, cwd, env=None):
    return subprocess.run(
        [sys.executable, "-m", "easylm.llama.train", *args], cwd=cwd, capture_output=True,
        text=True, timeout=600, env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
    )


@pytest.mark.slow
def test_embedded_default_trains_and_saves(tmp_path):
    # The README's first command, with only the step count made small.
    before = time.time()
    result = run_cli("--total_steps=4", "--log_freq=2", cwd=tmp_path,
                     env={"WANDB_MODE": "offline"})
    after = time.time()
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "llama-*"))
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2, 4]  # the first step, then every 2
    times = [line["time"] for line in lines]  # wall-clock seconds, as written
    assert before < times[0] <= times[1] <= times[2] < after
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
    model = variants.build(FAMILY, train.default_config())
    abstract = jax.eval_shape(model.init_params, jax.random.key(0))
    params = checkpoint.load_params(f"params::{final}", abstract)
    assert params["model"]["embed_tokens"]["embedding"].shape == (512, 128)
    # The command it printed serves that checkpoint: its flags as printed, in-process,
    # answering one request.
    (printed,) = [line for line in result.stdout.splitlines() if line.startswith("serve it:")]
    words = printed.split()[2:]
    assert words[:3] == ["python", "-m", "easylm.llama.serve"]
    served = flags.parse(serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY),
                         ["serve", *words[3:]])
    app, batcher = serving_cli.build(FAMILY, served)
    try:
        assert batcher.engine.model.config == metadata["llama_config"] | {"remat_policy": "none"}
        response = TestClient(app, base_url="http://127.0.0.1").post(
            "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4,
                                     "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
    finally:
        batcher.stop()


@pytest.mark.slow
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
    (["--optimizer.type=lion"], "--optimizer.type='lion' is not one of adamw, palm, muon"),
    (["--optimizer.type=muon", "--optimizer.muon_optimizer.ns_steps=0"],
     "--optimizer.muon_optimizer.ns_steps must be >= 1, got 0"),
    (["--optimizer.type=muon", "--optimizer.muon_optimizer.adamw_parameters=layers,embed,head"],
     "--optimizer.type=muon: --optimizer.muon_optimizer.adamw_parameters leaves Muon no "
     "matrix to train (that is --optimizer.type=adamw)"),
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
    # Each of these used to train, or end in a traceback.
    (["--optimizer.adamw_optimizer.lr=nan"],
     "--optimizer.adamw_optimizer.lr must be a finite number >= 0, got nan"),
    (["--optimizer.adamw_optimizer.lr=-1e-3"],
     "--optimizer.adamw_optimizer.lr must be a finite number >= 0, got -0.001"),
    (["--train_dataset.json_dataset.seq_length=1024"],
     "--train_dataset.json_dataset.seq_length=1024 is above the model's "
     "max_position_embeddings=512: lower --train_dataset.json_dataset.seq_length, or raise "
     "--llama.max_position_embeddings if the model can take longer rows"),
    (["--llama.loss_chunk_size=100"],
     "--llama.loss_chunk_size=100 must divide the rows' length, "
     "--train_dataset.json_dataset.seq_length=256"),
    (["--train_dataset.text_processor.fields=text,<|99999|>"],
     "<|99999|> in text_processor.fields: token id 99999 is outside the tokenizer's 512 "
     "tokens (ids 0 to 511)"),
    (["--llama.model_type=qwen3_moe", "--llama.num_experts=6",
      "--llama.moe_intermediate_size=32", "--mesh_dim=dp=1,fsdp=2,ep=4"],
     "--llama.num_experts=6 experts cannot be split over ep=4 of --mesh_dim=dp=1,fsdp=2,ep=4: "
     "give a number of experts that ep divides, or another ep"),
    (["--context_parallel=ring"],
     "--context_parallel=ring does nothing on --mesh_dim=1,-1,1, which does not split the "
     "sequence (sp=1): add sp=N to --mesh_dim, or leave --context_parallel unset"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys, tmp_path):
    assert expect_error([*argv, f"--logger.output_dir={tmp_path}"], capsys) == message
    assert os.listdir(tmp_path) == []  # failed before writing anything


def alternating_lines(path):
    """200 lines, every other one malformed: rows of an even batch size starve."""
    with open(path, "w") as f:
        for i in range(200):
            f.write("{bad json\n" if i % 2 == 0 else json.dumps({"text": f"line {i}"}) + "\n")
    return path


@pytest.mark.parametrize("case", ["eval_without_data", "output_dir_in_proc",
                                  "output_dir_under_a_file", "starved_rows"])
def test_bad_run_setup_is_one_clear_line(case, capsys, tmp_path, monkeypatch):
    # The skip warnings before the error line are the pipeline's usual ones, not under test
    # (and the root logger's handler may hold an earlier test's closed stream).
    monkeypatch.setattr(logging.getLogger("easylm.data.dataset"), "disabled", True)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b c"}\n')
    argv, message = {
        "eval_without_data": (
            [f"--train_dataset.json_dataset.path={data}", "--eval_freq=10"],
            "--eval_freq=10 evaluates on --eval_dataset, which is not set (it would be the "
            "embedded demo corpus, not your data): set --eval_dataset.json_dataset.path (or "
            "--eval_dataset.type=huggingface and its huggingface_dataset.path), or --eval_freq=0"),
        "output_dir_in_proc": (
            ["--logger.output_dir=/proc/easylm", "--logger.experiment_id=run"],
            "cannot create the run directory /proc/easylm/run (from --logger.output_dir): "
            "No such file or directory"),
        "output_dir_under_a_file": (
            [f"--logger.output_dir={data}/runs", "--logger.experiment_id=run"],
            f"cannot create the run directory {data}/runs/run (from --logger.output_dir): "
            f"Not a directory"),
        "starved_rows": (
            [f"--train_dataset.json_dataset.path={alternating_lines(data)}",
             f"--logger.output_dir={tmp_path}/runs"],
            "no usable document for row 0 of the batch: it reads documents 0, 8, 16, ... of "
            "each epoch (25 of the 200), and all were skipped ("),
    }[case]
    error = expect_error([*argv, "--total_steps=1", "--compilation_cache_dir="], capsys)
    assert error.startswith(message), error
    if case == "starved_rows":  # the data is blamed: its file, line and the skip count
        assert f"skips so far, the first: {data}:1: malformed JSON" in error
        assert error.endswith("): fix the data, or set shuffle=True so that every row draws "
                              "from all documents")
    assert os.listdir(tmp_path) in (["data.jsonl"], ["data.jsonl", "runs"])


def test_bad_eval_harness_is_one_line_before_training(capsys, tmp_path):
    """The tasks and their flags are checked at the start, not at the first evaluation."""
    tasks = os.path.join(REPO, "tests", "eval_tasks")
    for argv, message in [
        (["--eval_harness.tasks=tiny_mc", "--eval_harness.freq=0"],
         "--eval_harness.freq must be >= 1 with --eval_harness.tasks, got 0"),
        (["--eval_harness.tasks=tiny_mc", "--eval_harness.include_path=/no/such/dir"],
         "--eval_harness.include_path='/no/such/dir' is not a directory"),
        (["--eval_harness.tasks=tiny_gen", f"--eval_harness.include_path={tasks}",
          "--eval_harness.seq_length=12"],
         "task tiny_gen's max_gen_toks=12 leaves no room for a prompt in "
         "--eval_harness.seq_length=12"),
        (["--eval_harness.tasks=tiny_mcc", f"--eval_harness.include_path={tasks}"],
         f"unknown task 'tiny_mcc': not among lm-eval's tasks or --eval_harness.include_path="
         f"{tasks}; did you mean tiny_mc"),
    ]:
        error = expect_error([*argv, f"--logger.output_dir={tmp_path}", "--total_steps=1",
                              "--compilation_cache_dir="], capsys)
        assert error.startswith(message), error
        assert os.listdir(tmp_path) == []  # before the run directory exists


def help_output(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        train.main(["train", *argv])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_flag_with_help_text(capsys):
    out = help_output(["--helpfull"], capsys)
    entries = train.help_entries()
    # eval_dataset's flags are train_dataset's: listed once, with those that differ.
    assert "eval_dataset: the same flags as train_dataset.* (--eval_dataset.NAME)" in out
    for name in flags.flatten(train.default_config()):
        listed = name.replace("eval_dataset.", "train_dataset.", 1)
        assert f"--{name}=" in out or f"--{listed}=" in out, name
        assert entries.get(name), f"--{name} has no help text"
    assert entries["llama.remat_policy"].startswith("recompute activations in the backward "
                                                    "pass to save memory: none, ")


def test_help_leads_with_purpose_an_example_and_the_common_flags(capsys):
    out = help_output(["--help"], capsys)
    lines = out.splitlines()
    assert lines[0].startswith("Train a llama model") and "python -m easylm.llama.train --" in lines[2]
    listed = [line.split("=")[0].strip() for line in lines if line.startswith("  --")]
    assert listed[:3] == ["--load_checkpoint", "--llama.base_model", "--tokenizer"]
    assert len(listed) < 25 and lines[-1].endswith("flags: --helpfull")


def test_flagfile_and_command_line(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("# a comment\n--total_steps=7\n--optimizer.adamw_optimizer.lr=0.5\n")
    config = flags.parse(train.default_config(), train.help_entries(),
                         ["train", f"--flagfile={flagfile}", "--total_steps=9", "--nologger.online"])
    assert config.total_steps == 9  # later flags win
    assert config.optimizer.adamw_optimizer.lr == 0.5
    assert config.logger.online is False


def test_embedded_flagfile_is_the_default():
    parsed = train.parse_flags(["train", f"--flagfile={REPO}/configs/embedded.flags"])
    assert flags.flatten(parsed) == flags.flatten(train.parse_flags(["train"]))


@pytest.mark.parametrize("path", sorted(glob.glob(f"{REPO}/configs/*.flags")))
def test_example_configs_parse(path):
    config = train.parse_flags(["train", f"--flagfile={path}"])
    assert config.total_steps >= 1


def schedule_of(config) -> tuple:
    c = config.optimizer.adamw_optimizer
    return c.lr, c.end_lr, c.lr_warmup_steps, c.lr_decay_steps


def test_the_demos_settings_belong_to_the_demo_run_only(tmp_path):
    # The embedded demo: no data and no checkpoint given.
    demo = train.parse_flags(["train"])
    rows = demo.train_dataset.json_dataset
    assert (demo.total_steps, rows.seq_length, rows.batch_size) == (200, 256, 16)
    assert schedule_of(demo) == (3e-3, 3e-4, 20, 200)
    assert demo.eval_dataset.json_dataset.seq_length == 256  # eval rows like the train rows
    # Its schedule follows --total_steps (it used to end at 2.7e-3 of the 3e-3 peak).
    assert schedule_of(train.parse_flags(["train", "--total_steps=60"])) == (3e-3, 3e-4, 6, 60)
    # One's own data: the usual defaults; 1024-token rows do not fit the embedded
    # preset's 512 positions, so rows default to 512.
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b c"}\n')
    own = train.parse_flags(["train", f"--train_dataset.json_dataset.path={data}"])
    rows = own.train_dataset.json_dataset
    assert (own.total_steps, rows.seq_length, rows.batch_size) == (10000, 512, 8)
    assert schedule_of(own) == (3e-4, 3e-5, 1000, 10000)
    # Fine-tuning a pretrained checkpoint: a fine-tuning learning rate; the rows the
    # checkpoint's model takes.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(LLaMAConfig.from_preset(
        "debug", max_position_embeddings=4096).to_hf_config().to_dict()))
    tuned = train.parse_flags(["train", f"--load_checkpoint=hf::{hf}", "--total_steps=50",
                               f"--train_dataset.json_dataset.path={data}"])
    assert tuned.train_dataset.json_dataset.seq_length == 1024
    assert schedule_of(tuned) == (2e-5, 2e-6, 5, 50)
    # Flags given always win.
    given = train.parse_flags(["train", f"--load_checkpoint=hf::{hf}", "--total_steps=50",
                               "--optimizer.adamw_optimizer.lr=1e-4",
                               "--optimizer.adamw_optimizer.lr_decay_steps=40",
                               "--train_dataset.json_dataset.seq_length=2048"])
    assert schedule_of(given) == (1e-4, 1e-5, 5, 40)   # the decay ends at a tenth of any peak
    low = train.parse_flags(["train", f"--load_checkpoint=hf::{hf}", "--total_steps=50",
                             "--optimizer.adamw_optimizer.lr=5e-7"])   # DPO's: below 2e-6
    assert schedule_of(low) == (5e-7, 5e-8, 5, 50)
    _, schedule = optimizers.get_optimizer(low.optimizer)
    assert float(schedule(50)) < float(schedule(5)) == pytest.approx(5e-7)
    assert given.train_dataset.json_dataset.seq_length == 2048


def test_schedule_warnings_name_the_flags():
    config = train.parse_flags(["train", "--load_checkpoint=params::/some/model",
                                "--total_steps=200", "--optimizer.adamw_optimizer.lr=3e-3",
                                "--optimizer.adamw_optimizer.lr_decay_steps=400"])
    _, schedule = optimizers.get_optimizer(config.optimizer)
    printed = []
    warn_about_the_schedule(config, schedule, printed.append)
    assert printed == [
        "warning: fine-tuning params::/some/model at a peak learning rate of 0.003, above the "
        "0.0001 a pretrained model usually tolerates (full fine-tuning uses about 1e-5 to "
        "5e-5): lower --optimizer.adamw_optimizer.lr if the loss rises",
        f"note: --optimizer.adamw_optimizer.lr_decay_steps=400 but --total_steps=200: the run "
        f"ends at a learning rate of {float(schedule(200)):.3g} (end_lr=0.0003)"]
    printed.clear()
    warn_about_the_schedule(train.parse_flags(["train"]), schedule, printed.append)
    assert printed == []  # the demo from scratch: neither


@pytest.mark.slow
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


@pytest.mark.parametrize("argv, old_id", [
    ([], "llama-3c8434a5"),  # the embedded demo, as the README shows it
    (["--train_dataset.json_dataset.path=data.jsonl", "--lora.rank=16",
      "--load_checkpoint=hf::/models/base"], "llama-30ada2a6"),
    (["--objective=grpo", "--train_dataset.json_dataset.path=prompts.jsonl"], "llama-b3986fa2"),
])
def test_redefaulted_flags_keep_the_directories_runs_had(argv, old_id):
    # The ids these commands got before --train_dataset.text_processor.add_bos_token and
    # --lora.base_dtype defaulted to auto (computed by the code at cac0ba9), and before
    # --lora.target_modules' default took the expert stacks too, and before the
    # weight-decay exclusions' default named DeepSeek-V3's routing bias and Gemma 4's
    # layer_scalar, and before GRPO's dynamic sampling, multi-turn and pages flags (computed at 77b6cac): the same command still
    # resumes its run; a setting that trains otherwise is another run.
    def run_id(*extra):
        config = train.parse_flags(["train", *argv, *extra])
        return os.path.basename(run_directory(config, "llama",
                                              variants.unused_flags(FAMILY, config)))

    assert run_id() == old_id
    assert run_id("--train_dataset.text_processor.add_bos_token=false") != old_id
    # Muon's flags, added later, count only when Muon trains.
    assert run_id("--optimizer.muon_optimizer.momentum=0.9") == old_id
    assert run_id("--optimizer.type=muon") != run_id("--optimizer.type=muon",
                                                     "--optimizer.muon_optimizer.momentum=0.9")
    if "--objective=grpo" in argv:  # dynamic sampling's flags, added later
        assert run_id("--grpo.max_sampling_rounds=4") == old_id
        assert run_id("--grpo.dynamic_sampling=True") != old_id
        assert run_id("--grpo.max_turns=4", "--grpo.tool_timeout=10") == old_id  # multi-turn's
        assert run_id("--grpo.max_turns=2") != old_id
        # The decode kernel's default, now ours, reads as JAX's: the rows to float rounding
        assert run_id("--grpo.decode_kernel=rpa") == old_id
        assert run_id("--grpo.decode_kernel=batched_vpu") != old_id
    if "--lora.rank=16" in argv:
        assert run_id("--lora.target_modules=q_proj/kernel$") != old_id


def test_lora_runs_recorded_with_the_old_default_modules_resume_under_the_new_one():
    from easylm.variants.lora import DEFAULT_TARGET_MODULES, DENSE_TARGET_MODULES
    from easylm.variants.lora_variant import LORA

    def settings(modules):
        return LORA.state_settings({"lora.rank": 4, "lora.target_modules": modules})

    assert settings(DENSE_TARGET_MODULES) == settings(DEFAULT_TARGET_MODULES)
    assert settings("q_proj/kernel$") != settings(DEFAULT_TARGET_MODULES)
