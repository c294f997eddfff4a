"""Qwen3.5-MoE trained through `python -m easylm.train` (run in this process) beyond the
one-device step tests/test_qwen3_5_moe.py checks: its experts split over `ep`, on a tiny
random directory transformers saved (fp32, routers perturbed so that routing is decided
well above rounding).

Tolerances: tests/test_qwen3_5_moe.py's `rel_of` (the layers' reductions, the router's
and the experts' combine), twice for a loss or gradient norm as tests/test_moe_models.py
derives it for LLaMA's MoE over `ep`.
"""

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grpo import task  # noqa: F401 (a fixture: prompts and the parity reward)
from test_qwen3_5_moe import rel_of, torch_model

from easylm import train
from easylm.qwen3_5.family import FAMILY

ROWS, LENGTH = 8, 32  # the batch the steps below train on


def tiny_moe():
    """debug_moe's shapes in two layers (one Gated DeltaNet, one full attention), 4 experts
    2 a token, the load-balancing term on."""
    return FAMILY.from_preset("debug_moe", num_hidden_layers=2, full_attention_interval=2,
                              output_router_logits=True, router_aux_loss_coef=0.1)


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    torch_model(tiny_moe()).save_pretrained(path)
    return path


def one_step(directory, output_dir, mesh_dim, capsys) -> dict:
    """Step 1's logged metrics of the train command on `mesh_dim`, and its mesh line."""
    train.main(["train", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
                "--total_steps=1", "--log_freq=1", "--dtype=fp32", f"--mesh_dim={mesh_dim}",
                f"--train_dataset.json_dataset.seq_length={LENGTH}",
                f"--train_dataset.json_dataset.batch_size={ROWS}", "--compilation_cache_dir=",
                f"--logger.output_dir={output_dir}", "--logger.experiment_id=run",
                "--save_model_freq=0"])
    with open(f"{output_dir}/run/metrics.jsonl") as f:
        (line,) = [row for row in map(json.loads, f) if "loss" in row]
    return line, capsys.readouterr().out


def test_a_step_over_ep_equals_one_over_fsdp(directory, tmp_path, capsys):
    """--mesh_dim=dp=1,fsdp=2,ep=4 (each device one of the 4 experts, tokens exchanged by
    all-to-all) and --mesh_dim=1,8,1 (every device all experts): the same step-1 loss, its
    terms, gradient norm and expert load. The twin: the experts rolled by one along E (each
    token's pairs computed by another expert, what a wrong expert-to-device map computes)
    move the loss of that batch by more than the tolerance."""
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.objectives.next_token import next_token_sums

    ep, out = one_step(directory, tmp_path / "ep", "dp=1,fsdp=2,ep=4", capsys)
    assert "mesh dp=1 fsdp=2 ep=4" in out
    fsdp, _ = one_step(directory, tmp_path / "fsdp", "1,8,1", capsys)
    config = FAMILY.hf.read_config(str(directory))
    rel = 2 * rel_of(config)
    for key in ("loss", "ce_loss", "aux_loss", "gradient_norm", "param_norm"):
        assert ep[key] == pytest.approx(fsdp[key], rel=rel), key
    for key in ("moe_load_max", "moe_load_min", "moe_dropped"):
        assert ep[key] == fsdp[key], key

    data = DatasetFactory.get_default_config()
    data.json_dataset.seq_length, data.json_dataset.batch_size = LENGTH, ROWS
    batch, _ = next(iter(DatasetFactory.load_dataset(data, load_tokenizer("embedded"))))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    params = FAMILY.hf.read_params(str(directory), config)
    model = FAMILY.bind(config)

    # One compile for both parameter sets (run eagerly, each of the layers' operations
    # compiled on its own: ~5x the time).
    loss_of = jax.jit(lambda p: next_token_sums(model, p, batch, None).total_mean())

    def loss(p):
        return float(loss_of(p))

    rolled = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.roll(x, 1, axis=0) if "experts" in jax.tree_util.keystr(path)
        and "shared" not in jax.tree_util.keystr(path) else x, params)
    assert loss(params) == pytest.approx(ep["loss"], rel=rel)  # the command's batch
    assert abs(loss(rolled) - ep["loss"]) > rel * ep["loss"]


# Extended (66 s of CI's summed time): in CI the same command's SIGKILL-resume with replay
# is bitwise on LLaMA's MoE (tests/test_routing_replay.py::test_sigkill_then_resume_with_
# replay_is_bitwise), the hang's cause (a LAPACK call in the DeltaNet) is refused by
# tests/test_gated_deltanet.py::test_the_chunked_form_calls_no_lapack, and a DeltaNet model
# samples rollouts in tests/test_grpo_tools.py::test_a_recurrent_state_model_continues_its_
# turns. What only this adds: the three together, on eight devices.
@pytest.mark.extended
@pytest.mark.slow  # three interpreters, the first compiling: ~75 s on two cores
def test_grpo_with_replay_killed_then_resumed_is_bitwise(directory, task, tmp_path):
    """`python -m easylm.train --objective=grpo --grpo.routing_replay=True` (tests/
    test_routing_replay.py's command: 8 prompts x 2 completions, a checkpoint at step 2) on
    --mesh_dim=8,1,1, its 16 rollout rows two a device (what hung on XLA:CPU while the
    DeltaNet's UT solve was a LAPACK call), killed (SIGKILL) once step 2 is logged and
    saved, then the same command: step 3 is bitwise the uninterrupted run's (loss, gradient
    norm, reward, the sampler-trainer figures), so the rollouts after the resume and their
    recorded choices were the same. The three runs share a compilation cache, so only the
    first compiles."""
    from cli_utils import xla_flags
    from test_checkpoint import ENV, metrics, run_until
    from test_routing_replay import STEPS, grpo_argv

    def argv(output_dir):
        flags = grpo_argv(directory, task, output_dir)[1:] + [
            "--mesh_dim=8,1,1", f"--compilation_cache_dir={tmp_path / 'compiled'}"]
        return [sys.executable, "-m", "easylm.train", *flags]

    env = dict(ENV, XLA_FLAGS=xla_flags(8),
               PYTHONPATH=os.pathsep.join([ENV["PYTHONPATH"], os.path.dirname(task[0])]))
    whole = subprocess.run(argv(tmp_path / "whole"), env=env, capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr[-2000:]
    expected = metrics(tmp_path / "whole")
    assert sorted(expected) == list(range(1, STEPS + 1))

    code, _, _ = run_until(argv(tmp_path), tmp_path, 2, signal.SIGKILL, env)
    assert code == -signal.SIGKILL
    resumed = subprocess.run(argv(tmp_path), env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"steps 2 -> {STEPS}" in resumed.stdout  # resumed, not started over
    got = metrics(tmp_path)
    for key in ("loss", "gradient_norm", "reward", "data/rollout/sampler_logp_diff_max",
                "data/rollout/sampler_logp_diff_mean"):
        assert got[STEPS][key] == expected[STEPS][key], key
