"""Optimizers: the schedules' closed forms, the weight-decay mask, clipping, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from easylm import optimizers
from easylm.errors import UserError

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
    ({"type": "sgd"}, "--optimizer.type='sgd' is not one of adamw, palm"),
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
