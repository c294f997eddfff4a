"""`python -m easylm.llama.eval`: a trained checkpoint evaluated on local tasks, results
written beside it, lm-eval's `--model easylm` registration, and one line per bad input."""

import glob
import json
import os
import re
import subprocess
import sys

import jax
import pytest
from cli_utils import one_line_error
from serving_utils import make_tokenizer, tiny_config

from easylm.errors import UserError
from easylm.evaluation import harness_flags
from easylm.llama import eval as eval_cli
from easylm.llama.model import LLaMAForCausalLM
from easylm.runtime import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS", "HF_HUB_OFFLINE", "WANDB_MODE")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(params:: checkpoint directory, tokenizer directory) as the trainer writes them."""
    root = tmp_path_factory.mktemp("eval-cli")
    config = tiny_config(hidden_size=32, intermediate_size=64)
    params = jax.jit(LLaMAForCausalLM(config).init_params)(jax.random.PRNGKey(3))
    directory = checkpoint.save_params(str(root / "checkpoints" / "7"), params,
                                       {"model": "llama", "llama_config": config.to_dict()})
    make_tokenizer().save_pretrained(root / "tokenizer")
    return directory, str(root / "tokenizer")


@pytest.mark.slow
def test_evaluates_a_checkpoint_and_writes_results_beside_it(trained):
    directory, tokenizer = trained
    result = subprocess.run(
        [sys.executable, "-m", "easylm.llama.eval", f"--load_checkpoint=params::{directory}",
         f"--tokenizer={tokenizer}", "--tasks=tiny_mc,tiny_rolling", "--include_path=tests/eval_tasks",
         "--limit=4", "--num_fewshot=1", "--log_samples", "--bootstrap_iters=0",
         "--seq_length=64", "--min_bucket=64", "--mesh_dim=1,-1,1"],
        cwd=REPO, env={**os.environ, **ENV, "PYTHONPATH": REPO}, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "|tiny_mc " in result.stdout and "|acc_norm" in result.stdout  # lm-eval's table
    out = directory + "-eval"
    (path,) = glob.glob(f"{out}/results_*.json")
    assert f"results: {path}" in result.stdout
    results = json.load(open(path))
    assert 0 <= results["results"]["tiny_mc"]["acc,none"] <= 1
    assert results["results"]["tiny_rolling"]["bits_per_byte,none"] > 0
    assert results["n-shot"]["tiny_mc"] == 1
    assert results["n-samples"]["tiny_mc"] == {"original": 8, "effective": 4}
    assert results["config"]["model"] == "easylm"
    assert results["config"]["model_args"]["load_checkpoint"] == f"params::{directory}"
    for task, requests_per_doc in (("tiny_rolling", 1), ("tiny_mc", 3)):
        (samples,) = glob.glob(f"{out}/samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in open(samples)]
        assert len(rows) == 4 and all(len(r["resps"]) == requests_per_doc for r in rows)
    # One shot: each multiple-choice prompt starts with another document and its answer.
    assert rows[0]["arguments"][0][0].count("\n\n") == 1
    # The checkpoint still loads (the results sit beside it, not in it).
    checkpoint.check_checkpoint_dir(directory)


def test_registered_as_lm_eval_model_easylm(trained):
    import lm_eval.api.registry

    import easylm.llama.lm_eval_model  # noqa: F401

    directory, tokenizer = trained
    cls = lm_eval.api.registry.get_model("easylm")
    lm = cls.create_from_arg_string(
        f"load_checkpoint=params::{directory},tokenizer={tokenizer},seq_length=48,max_gen_toks=7",
        {"batch_size": 4, "max_batch_size": None, "device": None})  # what simple_evaluate adds
    assert (lm.engine.seq_length, lm.engine.batch_size, lm.max_length) == (48, 4, 48)
    assert lm.max_gen_toks == 7
    assert lm.stop_token_ids == {2}
    assert lm_eval.api.registry.get_model("hf").__name__ == "HFLM"  # lm-eval's own still there
    with pytest.raises(UserError, match="Unknown command line flag 'pretrained'"):
        cls.create_from_arg_obj({"pretrained": "x"})


def expect_error(argv, capsys) -> str:
    return one_line_error(eval_cli.main, ["eval", *argv], capsys)


def test_bad_input_is_one_line(trained, tmp_path, capsys, monkeypatch):
    directory, tokenizer = trained
    monkeypatch.chdir(REPO)
    # An empty datasets cache, as on a fresh machine: building a task's split draws no bar.
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    local = ["--include_path=tests/eval_tasks", f"--tokenizer={tokenizer}"]
    good = [f"--load_checkpoint=params::{directory}", *local]
    assert expect_error(["--tasks=tiny_mc"], capsys).startswith("--load_checkpoint is required")
    assert expect_error(good, capsys).startswith("--tasks is required")
    assert expect_error([*good, "--tasks=tiny_mc", "--limit=0"], capsys) == \
        "--limit must be > 0, got 0.0"
    assert expect_error([*good, "--tasks=tiny_mc,tiny_mcq"], capsys) == (
        "unknown task 'tiny_mcq': not among lm-eval's tasks or --include_path=tests/eval_tasks; "
        "did you mean tiny_mc, tinyArc, tiny_gen?")
    # A generating task's room for a prompt, before any task runs (as the trainer's hook).
    assert expect_error([*good, "--tasks=tiny_mc,tiny_gen", "--seq_length=12",
                         f"--output_dir={tmp_path}"], capsys) == (
        "task tiny_gen's max_gen_toks=12 leaves no room for a prompt in --seq_length=12")
    missing = str(tmp_path / "nothing")
    assert "nothing" in expect_error([f"--load_checkpoint=params::{missing}", *local,
                                      "--tasks=tiny_mc"], capsys)
    assert not os.path.exists(missing + "-eval")  # failed before writing anything
    assert expect_error([f"--load_checkpoint=hf::{missing}", *local, "--tasks=tiny_mc"],
                        capsys).startswith(missing)
    # Without lm-eval: the line says how to install it.
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "lm_eval", None)  # as if not installed
        patch.delitem(sys.modules, "easylm.evaluation.harness")
        message = expect_error([*good, "--tasks=tiny_mc"], capsys)
        assert re.fullmatch(r"the Python package 'lm_eval' is not installed \(needed by "
                            r"easylm/evaluation/harness\.py:\d+\); install the eval extra: "
                            r'pip install -e "\.\[eval\]"', message), message
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert expect_error([*good, "--tasks=tiny_mc", f"--output_dir={blocked}/out"], capsys) == (
        f"cannot write the results into {blocked}/out: {blocked} is not a directory")


def test_the_flags_it_shares_with_the_trainers_hook_read_the_same():
    # --batch_size is also the engine's (the server's text); eval's is the hook's.
    shared = ("batch_size", "max_gen_toks", "num_fewshot", "limit", "include_path")
    entries = eval_cli.help_entries()
    assert {name: entries[name] for name in shared} == \
        {name: harness_flags.HELP[name] for name in shared}
