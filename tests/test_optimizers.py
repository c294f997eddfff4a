"""Optimizers: the schedules' closed forms, the weight-decay mask, clipping, errors; Muon
against a float64 transcription of its update."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from easylm.errors import UserError
from easylm.runtime.sharding import path_to_string
from easylm.training import optimizers
from numerics import (assert_close, assert_differs, fp32_rel, newton_schulz64,
                      newton_schulz_growth)

PARAMS = {
    "model": {
        "embed_tokens": {"embedding": jnp.full((4, 3), 2.0)},
        "layers": {"0": {"input_layernorm": {"weight": jnp.full((3,), 2.0)},
                         "mlp": {"up_proj": {"kernel": jnp.full((3, 5), 2.0)}}}},
        "norm": {"weight": jnp.full((3,), 2.0)},
    },
    "lm_head": {"kernel": jnp.full((3, 4), 2.0)},
}


def adamw_config(**overrides):
    return optimizers.get_default_config({"type": "adamw", "adamw_optimizer": overrides})


def test_adamw_schedule_matches_closed_form():
    init, peak, end, warmup, decay = 1e-5, 1e-3, 1e-4, 100, 1100
    schedule = optimizers.adamw_schedule(adamw_config(
        init_lr=init, lr=peak, end_lr=end, lr_warmup_steps=warmup, lr_decay_steps=decay
    ).adamw_optimizer)
    assert float(schedule(0)) == pytest.approx(init, rel=1e-5)  # fp32 arithmetic
    assert float(schedule(50)) == pytest.approx(init + 0.5 * (peak - init), rel=1e-5)
    assert float(schedule(warmup)) == pytest.approx(peak, rel=1e-5)
    # Cosine: end + (peak - end) * (1 + cos(pi * t)) / 2 for t in [0, 1] after warmup.
    for step in (350, 600, 850):
        t = (step - warmup) / (decay - warmup)
        expected = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5)
    assert float(schedule(600)) == pytest.approx((peak + end) / 2, rel=1e-5)  # mid-decay
    assert float(schedule(decay)) == pytest.approx(end, rel=1e-5)
    assert float(schedule(decay + 5000)) == pytest.approx(end, rel=1e-5)


def test_palm_schedule_is_constant_then_inverse_sqrt():
    config = optimizers.get_default_config({"palm_optimizer": dict(lr=1e-2, lr_warmup_steps=10000)})
    schedule = optimizers.palm_schedule(config.palm_optimizer)
    assert float(schedule(0)) == pytest.approx(1e-2)
    assert float(schedule(10000)) == pytest.approx(1e-2)
    assert float(schedule(40000)) == pytest.approx(1e-2 * math.sqrt(10000 / 40000))


def _one_update(config, grads):
    tx, _ = optimizers.get_optimizer(config)
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    return optax.apply_updates(PARAMS, updates)


def test_adamw_weight_decay_skips_norms_and_embeddings():
    lr, wd = 0.1, 0.5
    config = adamw_config(init_lr=lr, lr=lr, end_lr=lr, lr_warmup_steps=1, lr_decay_steps=10,
                          weight_decay=wd, weight_decay_exclusions="norm,embed")
    # Zero gradients: Adam's step is 0, so any change is weight decay alone.
    new = _one_update(config, jax.tree.map(jnp.zeros_like, PARAMS))
    np.testing.assert_array_equal(new["model"]["embed_tokens"]["embedding"], 2.0)
    np.testing.assert_array_equal(new["model"]["layers"]["0"]["input_layernorm"]["weight"], 2.0)
    np.testing.assert_array_equal(new["model"]["norm"]["weight"], 2.0)
    np.testing.assert_allclose(new["model"]["layers"]["0"]["mlp"]["up_proj"]["kernel"],
                               2.0 * (1 - lr * wd), rtol=1e-6)
    np.testing.assert_allclose(new["lm_head"]["kernel"], 2.0 * (1 - lr * wd), rtol=1e-6)


def test_palm_weight_decay_is_lr_squared_and_masked():
    c = 3.0
    config = optimizers.get_default_config({"type": "palm", "palm_optimizer": dict(
        lr=0.1, lr_warmup_steps=10, weight_decay=c, weight_decay_exclusions="norm,embed")})
    new = _one_update(config, jax.tree.map(jnp.zeros_like, PARAMS))
    np.testing.assert_array_equal(new["model"]["norm"]["weight"], 2.0)
    np.testing.assert_array_equal(new["model"]["embed_tokens"]["embedding"], 2.0)
    np.testing.assert_allclose(new["lm_head"]["kernel"], 2.0 * (1 - c * 0.1 ** 2), rtol=1e-6)


def _two_updates(config, grads):
    tx, _ = optimizers.get_optimizer(config)
    params, state = PARAMS, tx.init(PARAMS)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_gradient_is_clipped_to_global_norm():
    # Adam ignores a constant gradient scale, so clipping shows only when it changes
    # one step's gradient relative to another's: a norm-50 then a norm-0.5 gradient,
    # clipped at 1, must act like the first one rescaled by hand to norm 1.
    rng = np.random.default_rng(0)
    g = []
    for norm in (50.0, 0.5):
        gi = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), PARAMS)
        scale = norm / optax.tree.norm(gi)
        g.append(jax.tree.map(lambda x: x * scale, gi))
    hand_clipped = [jax.tree.map(lambda x: x / 50.0, g[0]), g[1]]
    constant = dict(init_lr=0.1, lr=0.1, end_lr=0.1, lr_warmup_steps=1, lr_decay_steps=10,
                    weight_decay=0.0)
    clipped = _two_updates(adamw_config(clip_gradient=1.0, **constant), g)
    by_hand = _two_updates(adamw_config(clip_gradient=0.0, **constant), hand_clipped)
    unclipped = _two_updates(adamw_config(clip_gradient=0.0, **constant), g)
    for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(by_hand)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    differences = [float(jnp.abs(a - b).max())
                   for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(unclipped))]
    assert max(differences) > 1e-2


def test_bf16_momentum_keeps_first_moment_in_bf16():
    tx, _ = optimizers.get_optimizer(adamw_config(bf16_momentum=True))
    mu_dtypes = {x.dtype for x in jax.tree.leaves(tx.init(PARAMS)) if x.ndim > 0}
    assert mu_dtypes == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}  # mu bf16, nu fp32


@pytest.mark.parametrize("config, message", [
    ({"type": "sgd"}, "--optimizer.type='sgd' is not one of adamw, palm, muon"),
    ({"type": "muon", "muon_optimizer": dict(momentum=1.0)},
     "--optimizer.muon_optimizer.momentum must be in [0, 1), got 1.0"),
    ({"type": "muon", "muon_optimizer": dict(ns_steps=0)},
     "--optimizer.muon_optimizer.ns_steps must be >= 1, got 0"),
    ({"type": "muon", "muon_optimizer": dict(rms_scale=-0.2)},
     "--optimizer.muon_optimizer.rms_scale must be a finite number >= 0, got -0.2"),
    ({"type": "muon", "adamw_optimizer": dict(lr=float("nan"))},
     "--optimizer.adamw_optimizer.lr must be a finite number >= 0, got nan"),
    ({"type": "muon", "muon_optimizer": dict(adamw_parameters="embed,[")},
     "--optimizer.muon_optimizer.adamw_parameters: bad regex '[': unterminated character "
     "set at position 0"),
    ({"accumulate_gradient_steps": 0},
     "--optimizer.accumulate_gradient_steps must be >= 1, got 0"),
    ({"adamw_optimizer": dict(lr_warmup_steps=10, lr_decay_steps=10)},
     "--optimizer.adamw_optimizer.lr_decay_steps=10 must exceed lr_warmup_steps=10"),
    ({"adamw_optimizer": dict(weight_decay_exclusions="norm,(")},
     "weight_decay_exclusions: bad regex '(': missing ), unterminated subpattern at position 0"),
])
def test_bad_optimizer_config_is_one_clear_error(config, message):
    with pytest.raises(UserError) as e:
        optimizers.get_optimizer(optimizers.get_default_config(config))
    assert str(e.value) == message


def _run(tx, params, steps=5, seed=0):
    """`steps` updates with random gradients; the final parameters and state."""
    state = tx.init(params)
    for i in range(steps):
        grads = jax.tree.map(  # bf16-representable, so fp32 and bf16 runs see the same
            lambda p: jax.random.normal(jax.random.key(seed + i), p.shape).astype(
                jnp.bfloat16).astype(p.dtype), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _floating_dtypes(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bf16_parameters_get_fp32_optimizer_math():
    config = adamw_config(lr=1e-2, init_lr=1e-2, lr_warmup_steps=1, lr_decay_steps=10)
    tx, _ = optimizers.get_optimizer(config)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    params, state = _run(tx, bf16, steps=1)
    assert _floating_dtypes(state) == {"float32"}  # moments are fp32, not bf16
    assert _floating_dtypes(params) == {"bfloat16"}
    # One update equals the fp32 optimizer's on the same (upcast) numbers, rounded once.
    reference, _ = optimizers._optimizer(config)
    expected, _ = _run(reference, jax.tree.map(lambda x: x.astype(jnp.float32), bf16), steps=1)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))


@pytest.mark.parametrize("kind", ["adamw", "palm"])
def test_bf16_state_tracks_fp32_state(kind):
    config = optimizers.get_default_config({"type": kind, "state_dtype": "bf16"})
    config.adamw_optimizer.update(lr_warmup_steps=1, lr_decay_steps=10, lr=1e-2, b2=0.95)
    config.palm_optimizer.update(lr_warmup_steps=1)
    low, _ = optimizers.get_optimizer(config)
    config.state_dtype = "fp32"
    high, _ = optimizers.get_optimizer(config)
    params_low, state_low = _run(low, PARAMS)
    params_high, state_high = _run(high, PARAMS)
    assert _floating_dtypes(state_low) == {"bfloat16"}
    assert _floating_dtypes(state_high) == {"float32"}
    # Stored moments are the fp32 ones to bf16 precision, and so are the parameters.
    for got, want in zip(jax.tree.leaves(state_low), jax.tree.leaves(state_high)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=1e-6)
    moved = [np.abs(np.asarray(h) - np.asarray(p)).max()
             for h, p in zip(jax.tree.leaves(params_high), jax.tree.leaves(PARAMS))]
    for got, want, scale in zip(jax.tree.leaves(params_low), jax.tree.leaves(params_high), moved):
        assert scale > 0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.05 * scale)


def test_bad_state_dtype_is_named():
    config = optimizers.get_default_config({"state_dtype": "fp8"})
    with pytest.raises(UserError, match=r"^--optimizer.state_dtype='fp8' is not one of fp32, bf16$"):
        optimizers.get_optimizer(config)


def _bf16_neighbours(value):
    """The bf16 numbers just below and above |value| (same sign as value), as fp32."""
    lo = np.float32(np.asarray(jnp.asarray(value, jnp.float32).astype(jnp.bfloat16), np.float32))
    if abs(lo) > abs(value):  # rounded away from zero: step one bf16 back
        lo = (np.array(lo).view(np.uint32) - np.uint32(0x10000)).view(np.float32)
    hi = (np.array(lo).view(np.uint32) + np.uint32(0x10000)).view(np.float32)
    return float(lo), float(hi)


@pytest.mark.parametrize("value", [1 + 0.3 * 2**-7, -(0.02 + 0.8 * 2**-13), 3.1e-7])
def test_stochastic_rounding_is_unbiased(value):
    n = 200_000
    lo, hi = _bf16_neighbours(value)
    assert abs(lo) < abs(value) < abs(hi)
    got = np.asarray(optimizers.round_bf16_stochastically(
        jnp.full((n,), value, jnp.float32), jax.random.key(0)), np.float32)
    assert set(np.unique(got).tolist()) == {lo, hi}  # only the two neighbours
    up = (value - lo) / (hi - lo)  # probability of the far neighbour
    assert np.mean(got == hi) == pytest.approx(up, abs=4 * math.sqrt(up * (1 - up) / n))
    assert np.mean(got.astype(np.float64)) == pytest.approx(value, abs=4 * abs(hi - lo) / math.sqrt(n))


def test_stochastic_rounding_keeps_representable_and_special_values():
    exact = jnp.asarray([0.0, -0.0, 1.0, -2.5, 2.0**-20, 2.0**127, jnp.inf, -jnp.inf], jnp.float32)
    got = optimizers.round_bf16_stochastically(exact, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(exact.astype(jnp.bfloat16), np.float32))
    assert np.isnan(np.asarray(optimizers.round_bf16_stochastically(
        jnp.asarray([jnp.nan]), jax.random.key(1)), np.float32)).all()


def test_stochastic_rounding_lets_small_updates_accumulate():
    # Adam moves every weight by ~lr per step: 1e-3 is under half a bf16 step at 2.0
    # (2^-7), so rounding to nearest loses every update; stochastic rounding follows fp32.
    config = adamw_config(init_lr=1e-3, lr=1e-3, end_lr=1e-3, lr_warmup_steps=1, lr_decay_steps=100)
    params = {"w": jnp.full((64, 64), 2.0)}
    grads = {"w": jnp.ones((64, 64))}

    def run(stochastic, dtype, steps=40):
        config.stochastic_rounding = stochastic
        tx, _ = optimizers.get_optimizer(config)
        p = jax.tree.map(lambda x: x.astype(dtype), params)
        state = tx.init(p)
        update = jax.jit(tx.update)
        for _ in range(steps):
            updates, state = update(grads, state, p)
            p = optax.apply_updates(p, updates)
        return np.asarray(p["w"], np.float32), p["w"].dtype

    reference, _ = run(False, jnp.float32)
    moved = 2.0 - reference.mean()
    assert moved > 0.03  # several bf16 steps (2^-6 = 0.0156 at 2.0)
    nearest, dtype = run(False, jnp.bfloat16)
    assert dtype == jnp.bfloat16 and (nearest == 2.0).all()  # every update lost
    stochastic, dtype = run(True, jnp.bfloat16)
    assert dtype == jnp.bfloat16
    # Unbiased on average; each weight random-walks about it (no gradient feedback here).
    assert abs(stochastic.mean() - reference.mean()) < 0.05 * moved
    same, _ = run(True, jnp.float32)
    np.testing.assert_array_equal(same, reference)  # fp32 parameters: a no-op


def test_stochastic_rounding_rejects_fp16_parameters():
    tx, _ = optimizers.get_optimizer(optimizers.get_default_config({"stochastic_rounding": True}))
    with pytest.raises(UserError, match=r"^--optimizer.stochastic_rounding supports bf16 and fp32 "
                                        r"parameters, got fp16 ones$"):
        tx.init({"w": jnp.ones(3, jnp.float16)})


# ------------------------------------------------------------------------------ Muon
# Muon's matrices (a tall one, whose iteration runs on its transpose; an expert stack,
# orthogonalized per expert) beside what AdamW keeps (embedding, head, norm, router).
MUON_SHAPES = {
    "lm_head": {"kernel": (8, 16)},
    "model": {"embed_tokens": {"embedding": (16, 8)},
              "layers": {"0": {"input_layernorm": {"weight": (8,)},
                               "mlp": {"experts": {"up_proj": (3, 8, 12)},
                                       "router": {"kernel": (8, 3)}},
                               "self_attn": {"o_proj": {"kernel": (12, 8)}}}}},
}
MUON_LEAVES = ("model/layers/0/mlp/experts/up_proj", "model/layers/0/self_attn/o_proj/kernel")


def _random_tree(seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32),
                        MUON_SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def _leaf(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return np.asarray(tree, np.float64)


def muon_config(kind="muon", lr=0.05, wd=0.1, **muon):
    return optimizers.get_default_config({"type": kind, "muon_optimizer": muon, "adamw_optimizer":
        dict(init_lr=lr, lr=lr, end_lr=lr, lr_warmup_steps=1, lr_decay_steps=10,
             weight_decay=wd, weight_decay_exclusions="norm,embed", clip_gradient=0.0)})


def muon_params64(p, grads, lr, wd, beta=0.95, rms=0.2, steps=5, per_matrix=True):
    """A Muon-owned parameter after one update per gradient: Nesterov momentum with
    optax's bias correction, orthogonalized (each trailing (m, n) matrix of a stack on
    its own, or with per_matrix=False the whole stack as one (E*m, n) matrix: the bug the
    twin shows), scaled to RMS `rms`, plus decoupled weight decay."""
    p, mu = np.asarray(p, np.float64), 0.0
    m, n = p.shape[-2:]
    for t, g in enumerate(grads, 1):
        mu = beta * mu + (1 - beta) * g
        nesterov = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t)
        if per_matrix:
            o = np.stack([newton_schulz64(x, steps) for x in nesterov.reshape(-1, m, n)])
        else:
            o = newton_schulz64(nesterov.reshape(-1, n), steps)
        p = p - lr * (rms * np.sqrt(max(m, n)) * o.reshape(p.shape) + wd * p)
    return p


def _muon_run(config, params, grads):
    tx, _ = optimizers.get_optimizer(config)
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def ns_rel(m: int, n: int, steps: int = 5) -> float:
    """fp32 tolerance of Muon's update relative to its largest entry: each Newton-Schulz
    step is three reductions in sequence (x x^T over n terms, A A and B x over m) after a
    norm over m*n, each step amplifying what comes in by at most the iteration's slope."""
    return newton_schulz_growth(steps) * fp32_rel(max(m, n), 3 * steps + 1)


def test_muon_matches_a_float64_transcription_and_its_twins_do_not():
    params, lr, wd = _random_tree(0), 0.05, 0.1
    grads = [_random_tree(1), _random_tree(2)]  # two steps: the momentum is exercised
    got = _muon_run(muon_config(lr=lr, wd=wd), params, grads)
    for path in MUON_LEAVES:
        p0, gs = _leaf(params, path), [_leaf(g, path) for g in grads]
        rel = ns_rel(*p0.shape[-2:])
        moved = _leaf(got, path) - p0
        assert_close(moved, muon_params64(p0, gs, lr, wd) - p0, rel, err_msg=path)
        # Negative twins: one Newton-Schulz step fewer; an expert stack as one matrix.
        assert_differs(moved, muon_params64(p0, gs, lr, wd, steps=4) - p0, rel)
        if p0.ndim == 3:
            assert_differs(moved, muon_params64(p0, gs, lr, wd, per_matrix=False) - p0, rel)
    # Moonlight's scale: one step's update (less weight decay) has RMS about 0.2 lr in
    # each matrix (Newton-Schulz leaves singular values in about [0.7, 1.2], not 1).
    one = _muon_run(muon_config(lr=lr, wd=wd), params, grads[:1])
    for path in MUON_LEAVES:
        update = (_leaf(one, path) - _leaf(params, path) * (1 - lr * wd)) / lr
        assert 0.7 * 0.2 < np.sqrt(np.mean(update ** 2)) < 1.2 * 0.2, path


def test_muon_leaves_embeddings_head_norms_and_router_to_adamw_unchanged():
    # What Muon does not own is trained exactly as --optimizer.type=adamw trains it.
    params, grads = _random_tree(0), [_random_tree(1), _random_tree(2)]
    muon = _muon_run(muon_config(), params, grads)
    adamw = _muon_run(muon_config("adamw"), params, grads)
    flat = lambda tree: {path_to_string(k): np.asarray(v)
                         for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    muon, adamw = flat(muon), flat(adamw)
    for path in muon:
        if path in MUON_LEAVES:
            assert np.abs(muon[path] - adamw[path]).max() > 1e-3, path
        else:
            np.testing.assert_array_equal(muon[path], adamw[path], err_msg=path)


def test_muon_split_goes_by_name_and_rank():
    labels = optimizers.muon_labels(optimizers.get_default_config().muon_optimizer.adamw_parameters)
    shapes = {  # scanned layers make a norm 2-D; gpt_oss's expert biases and sinks too
        "model/layers/input_layernorm/weight": (2, 8), "model/layers/self_attn/sinks": (2, 4),
        "model/layers/mlp/experts/down_proj_bias": (2, 4, 8), "model/layers/mlp/router/kernel":
        (2, 8, 4), "model/embed_tokens/embedding": (16, 8), "lm_head/kernel": (8, 16),
        "model/norm/weight": (8,), "model/layers/self_attn/q_proj/kernel": (2, 8, 8),
        "model/layers/mlp/experts/down_proj": (2, 4, 16, 8), "scale": (3,),
        "model/layers/self_attn/q_proj/kernel_lora_a": (8, 2),
    }
    tree = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}
    got = labels(tree)
    muon = {"model/layers/self_attn/q_proj/kernel", "model/layers/mlp/experts/down_proj",
            "model/layers/self_attn/q_proj/kernel_lora_a"}
    assert got == {k: "muon" if k in muon else "adamw" for k in shapes}


def test_muon_states_its_split_and_refuses_one_that_leaves_it_nothing():
    params = _random_tree(0)
    line = optimizers.describe(muon_config(), params)
    # o_proj 12*8 + experts 3*8*12 = 384 in Muon; head, embedding, norm, router the rest.
    assert line.startswith("muon: 384 parameters in 2 tensors | adamw: 288 parameters in "
                           "4 tensors")
    assert optimizers.describe(muon_config("adamw"), params) is None
    with pytest.raises(UserError, match=r"^--optimizer.type=muon: --optimizer.muon_optimizer."
                                        r"adamw_parameters leaves Muon no matrix to train"):
        optimizers.describe(muon_config(adamw_parameters="."), params)


def test_muon_state_is_one_buffer_per_matrix():
    # Muon keeps one momentum per matrix it owns, AdamW two moments per parameter.
    params = _random_tree(0)
    tx, _ = optimizers.get_optimizer(muon_config())
    state_size = sum(x.size for x in jax.tree.leaves(tx.init(params)) if x.ndim > 0)
    assert state_size == 384 + 2 * 288 + 3  # + Muon's three Newton-Schulz coefficients
