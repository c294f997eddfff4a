"""The train and eval steps on synthetic batches: learning, accumulation, sharding,
loss masks, mixed precision, the NaN guard."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import ConfigDict
from numerics import (assert_close, assert_differs, forward_rel, fp32_rel,
                      newton_schulz64, newton_schulz_growth)

from easylm import model_flags
from easylm import variants
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.objectives.next_token import LossSums, NextToken
from easylm.runtime import compilation
from easylm.runtime.compilation import setup_compilation
from easylm.runtime.sharding import BATCH_AXES, make_mesh
from easylm.training import optimizers
from easylm.training.state import init_state
from easylm.training.step import make_eval_step, make_train_step

# The debug model's forward pass at 32 positions, as a relative tolerance; at
# initialisation its logits (|logit| < 1) are far smaller than the loss (ln 512), so twice
# the logits' error bound, relative to the loss, bounds the loss's (and the norms').
REL = forward_rel(LLaMAConfig.from_preset("debug"), 32)


def llama_flags(updates=None):
    """The --llama.* flag tree of the debug preset, with `updates`."""
    flags = model_flags.flag_config(FAMILY, "debug")
    flags.update(updates or {})
    return flags


def debug_model(dtype="fp32", param_dtype="fp32", **llama):
    config = ConfigDict(dict(llama=llama_flags(llama), dtype=dtype,
                             param_dtype=param_dtype))
    return variants.build(FAMILY, config)


def constant_lr_optimizer(lr=1e-2, **overrides):
    config = optimizers.get_default_config({"adamw_optimizer": dict(
        init_lr=lr, lr=lr, end_lr=lr, lr_warmup_steps=1, lr_decay_steps=100, **overrides)})
    return optimizers.get_optimizer(config)


def sgd(lr):
    """Plain SGD: parameters move by exactly lr * gradient, so parameter equality
    is gradient equality (Adam's first step, g/|g|, would hide a wrong scale)."""
    return optax.sgd(lr), optax.constant_schedule(lr)


def make_batch(batch_size=16, seq_length=32, seed=0, vocab=512):
    tokens = np.random.default_rng(seed).integers(3, vocab, (batch_size, seq_length + 1))
    return dict(input_tokens=tokens[:, :-1].astype(np.int32),
                target_tokens=tokens[:, 1:].astype(np.int32),
                loss_masks=np.ones((batch_size, seq_length), np.float32))


class Runner:
    """A jitted train step on a mesh, fed numpy batches, as the loop does it."""

    def __init__(self, model, tx_schedule, mesh_dim="1,1,1", devices=1, accumulate=1, seed=0,
                 loss_fn=None):
        tx, schedule = tx_schedule
        loss_fn = loss_fn or NextToken(model).loss_fn
        self.mesh = make_mesh(mesh_dim, jax.devices()[:devices])  # one device compiles fastest
        self.batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES))
        with jax.set_mesh(self.mesh):
            self.initial = init_state(model, tx, self.mesh, seed)
            shardings = jax.tree.map(lambda x: x.sharding, self.initial)
            self.step_fn = jax.jit(
                make_train_step(loss_fn, tx, schedule, seed, accumulate,
                                getattr(model.router_loss, "bias_update_rate", 0.0)),
                in_shardings=(shardings, self.batch_sharding),
                out_shardings=(shardings, NamedSharding(self.mesh, P())),
                donate_argnums=(0,),
            )
            self.eval_fn = jax.jit(make_eval_step(loss_fn))
        self.reset()

    def reset(self):
        """Back to the initial state, without compiling anything again."""
        self.state = jax.tree.map(jnp.copy, self.initial)  # the step donates its input

    def step(self, batch):
        with jax.set_mesh(self.mesh):
            self.state, metrics = self.step_fn(self.state, jax.device_put(batch, self.batch_sharding))
        return {k: float(v) for k, v in metrics.items()}

    def evaluate(self, batch):
        zeros = LossSums(*(jnp.zeros((), jnp.float32),) * 3)
        with jax.set_mesh(self.mesh):
            return self.eval_fn(self.state.params, jax.device_put(batch, self.batch_sharding), zeros,
                                self.state.frozen)


@pytest.fixture(scope="module")
def runner():
    """The debug model in fp32 with AdamW at lr 1e-2 on one device, compiled once."""
    runner = Runner(debug_model(), constant_lr_optimizer(1e-2))
    yield runner


def test_debug_model_learns_fixed_data(runner):
    runner.reset()
    batch = make_batch()
    losses = [runner.step(batch)["loss"] for _ in range(30)]
    assert losses[0] == pytest.approx(np.log(512), abs=0.1)  # uniform at initialisation
    assert losses[-1] < 1.5, losses  # memorised: from 6.24 to well under a quarter
    assert int(runner.state.step) == 30


def test_accumulated_gradients_equal_one_big_batch():
    # One update from a batch of 32 split into 4 micro-batches of 8 equals one update
    # from the same 32 rows at once (fp32, batch split over 2 fsdp devices).
    batch = make_batch(batch_size=32, seq_length=16)
    updates, metrics = [], []
    for accumulate in (1, 4):
        runner = Runner(debug_model(), sgd(1.0), "1,2,1", devices=2, accumulate=accumulate)
        metrics.append(runner.step(batch))
        # SGD at lr 1: the update is minus the gradient, summed over micro-batches or not.
        updates.append(jax.tree.map(lambda p, p0: np.asarray(p) - np.asarray(p0),
                                    runner.state.params, runner.initial.params))
    for a, b in zip(jax.tree.leaves(updates[0]), jax.tree.leaves(updates[1])):
        assert_close(b, a, 2 * REL)  # backward: the depth twice
    assert metrics[1]["loss_tokens"] == 32 * 16
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=2 * REL)
    assert metrics[1]["gradient_norm"] == pytest.approx(metrics[0]["gradient_norm"], rel=2 * REL)


@pytest.mark.parametrize("mesh_dim", ["2,2,2", "fsdp=2,ep=2,mp=2"])
def test_sharded_steps_equal_single_device(runner, mesh_dim):
    # After the first step only the loss is compared: Adam's first update (about
    # lr * sign(g)) turns float noise in near-zero gradients into visible changes.
    # ep splits the batch like dp for a model without experts.
    batch = make_batch()
    sharded = Runner(debug_model(), constant_lr_optimizer(1e-2), mesh_dim, devices=8)
    runner.reset()
    a, b = sharded.step(batch), runner.step(batch)
    for key in ("loss", "accuracy", "gradient_norm", "param_norm"):
        assert a[key] == pytest.approx(b[key], rel=2 * REL), key
    assert sharded.step(batch)["loss"] == pytest.approx(runner.step(batch)["loss"], rel=2 * REL)


def muon_optimizer(lr=1e-2):
    config = optimizers.get_default_config({"type": "muon", "adamw_optimizer": dict(
        init_lr=lr, lr=lr, end_lr=lr, lr_warmup_steps=1, lr_decay_steps=100, weight_decay=0.0)})
    return optimizers.get_optimizer(config)


def _muon_updates(runner, lr):
    """The first step's update of each Muon-owned matrix, over lr: -0.2 sqrt(max(m, n))
    times the orthogonalized gradient (no weight decay)."""
    labels = optimizers.muon_labels(optimizers.get_default_config().muon_optimizer.adamw_parameters)
    moved = jax.tree.map(lambda p, p0: (np.asarray(p, np.float64) - np.asarray(p0)) / lr,
                         runner.state.params, runner.initial.params)
    return [u for u, label in zip(jax.tree.leaves(moved), jax.tree.leaves(labels(moved)))
            if label == "muon"]


def _orthogonalized(g, blocks=1):
    """Muon's first update from gradient g in float64, each (m, n) matrix of a stack on its
    own; blocks=2: each of its 2x2 blocks on its own, as a Muon that orthogonalized every
    device's shard locally would (the bug the sharded test's twin stands for)."""
    m, n = g.shape[-2:]
    stack = g.reshape(-1, m, n)
    out = np.empty_like(stack)
    for i, j in itertools.product(range(blocks), repeat=2):
        rows = slice(i * m // blocks, (i + 1) * m // blocks)
        cols = slice(j * n // blocks, (j + 1) * n // blocks)
        for e in range(len(stack)):
            out[e, rows, cols] = newton_schulz64(stack[e, rows, cols])
    return -0.2 * np.sqrt(max(m, n)) * out.reshape(g.shape)


def _momentum(runner) -> list:
    """Muon's momentum of each matrix it owns: after one step, (1 - beta) x the gradient."""
    is_muon = lambda x: isinstance(x, optax.contrib.MuonState)
    state, = [x for x in jax.tree.leaves(runner.state.opt_state, is_leaf=is_muon) if is_muon(x)]
    return [np.asarray(mu, np.float64) for mu in jax.tree.leaves(state.mu)]


def test_sharded_accumulated_muon_equals_single_device_and_a_shard_local_one_would_not():
    # One MoE layer on 8 devices (its matrices split over fsdp and mp, its experts over
    # ep) with the batch in 2 micro-batches, against one device and one batch. The
    # gradients differ by float noise (2 REL, as above); Newton-Schulz amplifies a
    # relative error by at most its slope to the fifth.
    llama = model_flags.flag_config(FAMILY, "debug_moe")
    llama.num_hidden_layers = 1
    model = variants.build(FAMILY, ConfigDict(dict(llama=llama, dtype="fp32", param_dtype="fp32")))
    lr, batch, beta = 1e-2, make_batch(), 0.95
    rel = newton_schulz_growth() * 2 * forward_rel(
        LLaMAConfig.from_preset("debug_moe", num_hidden_layers=1), 32)
    single = Runner(model, muon_optimizer(lr))
    sharded = Runner(model, muon_optimizer(lr), "fsdp=2,ep=2,mp=2", devices=8, accumulate=2)
    single.step(batch), sharded.step(batch)
    updates = [_muon_updates(single, lr), _muon_updates(sharded, lr)]
    assert len(updates[0]) == 7  # q, k, v, o and the 3 expert stacks
    for one, eight, mu in zip(*updates, _momentum(single)):
        g = mu / (1 - beta)
        assert_close(one, _orthogonalized(g), rel)
        assert_close(eight, one, rel)
        assert_differs(eight, _orthogonalized(g, blocks=2), rel)


def test_masked_tokens_do_not_count(runner):
    batch = make_batch()
    batch["loss_masks"][:, :16] = 0.0
    changed = {k: v.copy() for k, v in batch.items()}
    changed["target_tokens"][:, :16] = 7  # only masked positions differ
    a, b = runner.evaluate(batch), runner.evaluate(changed)
    assert float(a.tokens) == 16 * 16
    assert float(a.loss) == float(b.loss) and float(a.correct) == float(b.correct)
    full = runner.evaluate(make_batch())
    assert float(full.tokens) == 16 * 32 and float(full.loss) != float(a.loss)


def test_eval_step_matches_train_step_loss(runner):
    runner.reset()
    batch = make_batch()
    sums = runner.evaluate(batch)
    metrics = runner.step(batch)  # reports the loss before its own update
    # Two programs (the train step also differentiates) over the same forward pass.
    assert float(sums.loss / sums.tokens) == pytest.approx(metrics["loss"], rel=2 * REL)
    assert float(sums.correct / sums.tokens) == pytest.approx(metrics["accuracy"], rel=2 * REL)


def test_bf16_compute_keeps_fp32_parameters(runner):
    batch = make_batch()
    runs = {}
    runner.reset()
    for dtype, run in (("fp32", runner), ("bf16", Runner(debug_model("bf16"), constant_lr_optimizer(1e-2)))):
        runs[dtype] = [run.step(batch)["loss"] for _ in range(2)]
        assert {x.dtype for x in jax.tree.leaves(run.state.params)} == {jnp.dtype("float32")}
    # The bf16 forward's logits are within sqrt(13) bf16 ulps (2.8e-2) of their scale, and
    # at initialisation that scale is far below the loss: 2e-2 of the loss is loose.
    np.testing.assert_allclose(runs["bf16"], runs["fp32"], rtol=2e-2)
    assert runs["bf16"] != runs["fp32"]  # really computed in bf16


def test_bf16_parameters_and_moments_learn_like_fp32(runner):
    # The memory option for big models on one device: 2-byte parameters, gradients
    # and Adam moments, with fp32 optimizer math.
    batch = make_batch()
    runner.reset()
    reference = [runner.step(batch)["loss"] for _ in range(20)]
    tx = optimizers.get_optimizer(optimizers.get_default_config({
        "state_dtype": "bf16", "adamw_optimizer": dict(
            init_lr=1e-2, lr=1e-2, end_lr=1e-2, lr_warmup_steps=1, lr_decay_steps=100)}))
    low = Runner(debug_model("bf16", param_dtype="bf16"), tx)
    losses = [low.step(batch)["loss"] for _ in range(20)]
    leaves = jax.tree.leaves((low.state.params, low.state.opt_state))
    assert {str(x.dtype) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {"bfloat16"}
    assert losses[-1] < 0.6 * losses[0]
    # Learning curves, not parity: 20 steps of bf16 rounding compound through the
    # updates, so only the curve's course is compared (while it falls by 40% or more).
    np.testing.assert_allclose(losses, reference, rtol=0.05, atol=0.05)


def test_stochastic_rounding_trains_sharded_bf16_parameters(runner):
    # The optimizer state gains a scalar counter (replicated by the partition rules);
    # parameters sharded over two devices draw their rounding noise in their shards.
    batch = make_batch()
    runner.reset()
    reference = [runner.step(batch)["loss"] for _ in range(10)]
    tx = optimizers.get_optimizer(optimizers.get_default_config({
        "stochastic_rounding": True, "adamw_optimizer": dict(
            init_lr=1e-2, lr=1e-2, end_lr=1e-2, lr_warmup_steps=1, lr_decay_steps=100)}))
    low = Runner(debug_model("bf16", param_dtype="bf16"), tx, mesh_dim="1,2,1", devices=2)
    losses = [low.step(batch)["loss"] for _ in range(10)]
    assert int(low.state.opt_state.count) == 10
    assert {str(x.dtype) for x in jax.tree.leaves(low.state.params)} == {"bfloat16"}
    assert losses[-1] < 0.6 * losses[0]
    np.testing.assert_allclose(losses, reference, rtol=0.05, atol=0.05)  # curves, as above


def test_metrics_report_schedule_and_norms(runner):
    runner.reset()
    before = jax.tree.map(np.asarray, runner.state.params)
    metrics = runner.step(make_batch())
    assert metrics["learning_rate"] == pytest.approx(1e-2)
    # exp in fp32 turns the loss's rounding (an ulp) into |loss| ulps of the perplexity.
    assert metrics["perplexity"] == pytest.approx(np.exp(metrics["loss"]),
                                                  rel=(1 + metrics["loss"]) * fp32_rel(1))
    leaves = jax.tree.leaves(jax.tree.map(np.asarray, runner.state.params))
    expected_norm = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in leaves))
    # A sum of squares of every parameter, in fp32 on the device.
    assert metrics["param_norm"] == pytest.approx(
        expected_norm, rel=fp32_rel(sum(x.size for x in leaves)))
    assert 0 < metrics["gradient_norm"] < 100
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(runner.state.params)))


def test_nonfinite_step_is_skipped_and_named():
    model = debug_model()

    def poisoned_loss(params, batch, rng, frozen):  # NaN whenever the batch says so
        sums = NextToken(model).loss_fn(params, batch, rng, frozen)
        return sums._replace(loss=sums.loss * batch["poison"][0, 0])

    runner = Runner(model, constant_lr_optimizer(), loss_fn=poisoned_loss)
    good = dict(make_batch(), poison=np.ones((16, 1), np.float32))
    bad = dict(good, poison=np.full((16, 1), np.nan, np.float32))
    runner.step(good)
    before = jax.tree.map(np.asarray, runner.state.params)
    metrics = runner.step(bad)
    assert np.isnan(metrics["loss"])
    assert metrics["skipped_updates"] == 1 and metrics["first_nonfinite_step"] == 2
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(runner.state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))  # the update was not applied
    metrics = runner.step(good)
    assert np.isfinite(metrics["loss"]) and metrics["first_nonfinite_step"] == 2
    assert int(runner.state.step) == 3


def test_gpu_xla_flags_are_added_on_gpu_hosts_but_never_over_the_users(monkeypatch):
    monkeypatch.setattr(compilation, "_gpu_plugin_installed", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x")
    setup_compilation("")
    flags = os.environ["XLA_FLAGS"].split()
    assert flags == ["--xla_gpu_enable_triton_gemm=true", "--xla_dump_to=/tmp/x",
                     "--xla_gpu_enable_latency_hiding_scheduler=true"]

    monkeypatch.setattr(compilation, "_gpu_plugin_installed", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "")
    setup_compilation("")
    assert os.environ["XLA_FLAGS"] == ""
