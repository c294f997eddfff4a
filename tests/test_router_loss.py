"""A mixture of experts' router terms in the preference (DPO, SimPO, ORPO) and GRPO
objectives (easylm/objectives/router_loss.py), as next-token training adds them: the
loss with the terms minus the loss without is router_aux_loss_coef x transformers'
`load_balancing_loss_func` of the forward's router logits over the rows' real tokens
(prompt and response; the right padding left out as transformers' attention mask does).

Tolerance: the two sides are fp32 sums of the same N x E products, each over the L*N
routed tokens (fp32_rel of that many terms); the loss difference also carries the
objective's own loss (~1) twice, one ulp of it each."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from ml_collections import ConfigDict
from numerics import EPS32, assert_close, assert_differs, fp32_rel
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.objectives import grpo, preference
from easylm.objectives.router_loss import RouterSums

B, T, COEF = 4, 12, 0.3


@pytest.fixture(scope="module")
def moe():
    """(model with its router terms, the same without, params, the rows' real-token mask)."""
    config = LLaMAConfig.from_preset("debug_moe", num_hidden_layers=2, vocab_size=64,
                                     initializer_range=0.2, output_router_logits=True,
                                     router_aux_loss_coef=COEF)
    model = FAMILY.bind(config)
    assert model.router_loss.aux_coef == COEF
    return model, dataclasses.replace(model, router_loss=None), \
        jax.jit(model.init_params)(jax.random.PRNGKey(0))


def rows_with_padding(n, seed=0):
    """(input ids, targets, loss masks) (n, T): a prompt, a response with loss, padding."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, 64, (n, T + 1))
    masks = np.zeros((n, T), np.float32)
    for i in range(n):
        prompt, end = rng.randint(2, 5), rng.randint(6, T - 1)
        masks[i, prompt:end] = 1.0
        ids[i, end + 1:] = 0
    return ids[:, :-1], ids[:, 1:], masks


def transformers_aux(model, params, tokens, masks, with_mask=True):
    """transformers' load-balancing loss of our forward's router logits, attention mask
    the positions up to each row's last target."""
    stats = model.forward(params, jnp.asarray(tokens), router_stats=True).router_stats
    fed = (np.cumsum(masks[:, ::-1], axis=1)[:, ::-1] > 0).astype(np.int64)
    logits = tuple(torch.from_numpy(np.array(x)) for x in stats.logits)
    config = model.config
    return float(load_balancing_loss_func(logits, config["num_experts"],
                                          config["num_experts_per_tok"],
                                          torch.from_numpy(fed) if with_mask else None))


def check(with_terms, without, aux, aux_unmasked, tokens):
    """The loss with the terms minus without is COEF x aux within: the aux loss's sums over
    the L x `tokens` routed tokens (two in sequence: counts and probabilities), and one
    ulp of each loss the subtraction reads."""
    assert isinstance(with_terms, RouterSums) and not isinstance(without, RouterSums)
    total = float(with_terms.loss / with_terms.count)
    difference = total - float(without.loss / without.count)
    atol = fp32_rel(2 * tokens, 2) * COEF * aux + 2 * EPS32 * (abs(total) + COEF * aux)
    assert_close(difference, COEF * aux, atol, scale=1.0)
    # Negative twin: the padding counted (no attention mask) moves the term.
    assert_differs(difference, COEF * aux_unmasked, atol, scale=1.0)
    means = with_terms.means()
    assert float(means["aux_loss"]) == pytest.approx(aux, rel=atol)
    # What a log step shows: `loss` is the total the gradient sees, the objective's own
    # loss beside it under its name (the dense-like model's whole loss).
    assert_close(float(means["loss"]), total, atol, scale=1.0)
    part = float(means[with_terms.PART])
    assert_close(part, float(without.means()["loss"]), atol, scale=1.0)
    assert_differs(part, total, atol, scale=1.0)  # negative twin: the part alone differs


@pytest.mark.parametrize("objective", preference.OBJECTIVES)
def test_preference_adds_the_router_terms(moe, objective):
    model, dense_like, params = moe
    tokens, targets, masks = rows_with_padding(2 * B)
    batch = {}
    for side, rows in (("chosen", slice(0, None, 2)), ("rejected", slice(1, None, 2))):
        batch.update({f"{side}_input_tokens": jnp.asarray(tokens[rows]),
                      f"{side}_target_tokens": jnp.asarray(targets[rows]),
                      f"{side}_loss_masks": jnp.asarray(masks[rows])})
    reference = params if objective in preference.NEEDS_REFERENCE else None

    def loss(m, router):
        policy = lambda p, rows: preference.row_logps(m, p, rows, router_stats=router)  # noqa
        ref = None if reference is None else (
            lambda _, rows: preference.row_logps(m, reference, rows))
        loss_fn = preference.make_loss_fn(objective, None, policy, ref,
                                          m.router_loss if router else None)
        return loss_fn(params, batch, None)  # eagerly: one compile per op, shared

    aux = transformers_aux(model, params, tokens, masks)
    unmasked = transformers_aux(model, params, tokens, masks, with_mask=False)
    check(loss(model, True), loss(dense_like, False), aux, unmasked, tokens.size)


def test_grpo_adds_the_router_terms(moe):
    model, dense_like, params = moe
    G = 2
    tokens, targets, masks = rows_with_padding(B * G, seed=1)
    batch = {"input_tokens": tokens, "target_tokens": targets, "loss_masks": masks}
    batch = {k: jnp.asarray(v.reshape(B, G, T)) for k, v in batch.items()}
    batch["advantages"] = jnp.asarray(np.random.RandomState(2).randn(B, G), jnp.float32)
    batch["valid"] = jnp.ones((B, G), jnp.float32)

    def loss(m):
        config = ConfigDict({"grpo": grpo.get_default_config().to_dict(), "seed": 0})
        objective = grpo.GRPOObjective(m, config, None)
        return objective.loss_fn(params, batch, None, {})

    aux = transformers_aux(model, params, tokens, masks)
    unmasked = transformers_aux(model, params, tokens, masks, with_mask=False)
    check(loss(model), loss(dense_like), aux, unmasked, tokens.size)


def test_routing_replay_is_refused_on_a_dense_model(moe):
    model, dense_like, _ = moe
    config = ConfigDict({"grpo": grpo.get_default_config({"routing_replay": True}).to_dict(),
                         "seed": 0})
    with pytest.raises(grpo.UserError, match="--grpo.routing_replay=True replays a mixture "
                       "of experts' routing: the llama model has no routers"):
        grpo.GRPOObjective(dense_like, config, None)
    grpo.GRPOObjective(model, config, None)  # the MoE model takes it
