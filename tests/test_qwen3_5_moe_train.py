"""Qwen3.5-MoE trained through `python -m easylm.train` (run in this process) beyond the
one-device step tests/test_qwen3_5_moe.py checks: its experts split over `ep`, on a tiny
random directory transformers saved (fp32, routers perturbed so that routing is decided
well above rounding).

Tolerances: tests/test_qwen3_5_moe.py's `rel_of` (the layers' reductions, the router's
and the experts' combine), twice for a loss or gradient norm as tests/test_moe_models.py
derives it for LLaMA's MoE over `ep`.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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

    def loss(p):
        return float(next_token_sums(model, p, batch, None).total_mean())

    rolled = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.roll(x, 1, axis=0) if "experts" in jax.tree_util.keystr(path)
        and "shared" not in jax.tree_util.keystr(path) else x, params)
    assert loss(params) == pytest.approx(ep["loss"], rel=rel)  # the command's batch
    assert abs(loss(rolled) - ep["loss"]) > rel * ep["loss"]
