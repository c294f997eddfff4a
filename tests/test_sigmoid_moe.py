"""DeepSeek-V3's routing and shared experts (easylm/models/sigmoid_moe.py) against
transformers' DeepseekV3MoE, with its router perturbed far from uniform and a non-zero
correction bias so that every part of the choice decides some token's experts.

Tolerance (tests/numerics.py): the router's logits are one reduction over D, and a choice
that close to a tie does not occur with these seeds (the chosen experts are compared
exactly); the output is the gate/up projections (D terms), down (F), the weighted sum over
K choices, and beside it the shared MLP (D, then its width): 4 reductions in sequence.
The negative twins (the bias ignored, the group limit ignored, the bias weighting as well
as picking) change some tokens' experts, which moves their output by its own size.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P
from numerics import EPS32, assert_close, assert_differs, fp32_rel

from easylm.models.sigmoid_moe import (
    BIAS,
    PARTITION_RULES,
    SigmoidMoE,
    SigmoidMoEConfig,
    sigmoid_route,
)
from easylm.runtime.sharding import BATCH_AXES, make_mesh, match_partition_rules, named_shardings

N_TOKENS = (2, 24)
CASES = {"norm_topk": dict(norm_topk_prob=True), "raw_topk": dict(norm_topk_prob=False)}


def hf_moe(**changes):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8,
                              n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=2,
                              routed_scaling_factor=2.5, vocab_size=32, num_hidden_layers=1,
                              **changes)
    torch.manual_seed(0)
    module = DeepseekV3MoE(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (1.0 if p is module.gate.weight else 0.3))
        module.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    return config, module


def ours_config(config) -> SigmoidMoEConfig:
    return SigmoidMoEConfig(num_experts=config.n_routed_experts,
                            num_experts_per_tok=config.num_experts_per_tok,
                            intermediate_size=config.moe_intermediate_size,
                            norm_topk_prob=config.norm_topk_prob, n_group=config.n_group,
                            topk_group=config.topk_group,
                            routed_scaling_factor=config.routed_scaling_factor,
                            n_shared_experts=config.n_shared_experts)


def variables(module):
    """transformers' tensors as our variables: the fused gate_up (E, 2F, D) split into
    (E, D, F) stacks, linear weights transposed into kernels."""
    t = {k: v.numpy() for k, v in module.state_dict().items()}
    F = t["experts.down_proj"].shape[-1]
    gate_up = t["experts.gate_up_proj"].transpose(0, 2, 1)  # (E, D, 2F)
    shared = {name: {"kernel": t[f"shared_experts.{name}.weight"].T}
              for name in ("gate_proj", "up_proj", "down_proj")}
    params = {"router": {"kernel": t["gate.weight"].T},
              "experts": {"gate_proj": gate_up[..., :F], "up_proj": gate_up[..., F:],
                          "down_proj": t["experts.down_proj"].transpose(0, 2, 1)},
              "shared_experts": shared}
    bias = {"e_score_correction_bias": t["gate.e_score_correction_bias"]}
    return jax.tree.map(jnp.asarray, {"params": params, BIAS: bias})


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """(our config, variables, x, transformers' output, its chosen experts)."""
    config, module = hf_moe(**CASES[request.param])
    x = np.random.RandomState(0).randn(*N_TOKENS, config.hidden_size).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.tensor(x)).numpy()
        _, _, chosen = module.gate(torch.tensor(x))
    return ours_config(config), variables(module), x, expected, chosen.numpy()


def rel(config: SigmoidMoEConfig) -> float:
    return fp32_rel(max(16, config.n_shared_experts * config.intermediate_size), 4)


def run(config, variables, x):
    return SigmoidMoE(config).apply(variables, jnp.asarray(x))


def test_matches_transformers(case):
    config, variables, x, expected, chosen = case
    out, stats = run(config, variables, x)
    np.testing.assert_array_equal(np.sort(stats.experts, axis=-1), np.sort(chosen, axis=-1))
    assert_close(out, expected, rel(config))


def test_negative_twins(case):
    config, variables, x, expected, _ = case
    no_bias = jax.tree.map(jnp.zeros_like, variables[BIAS])
    assert_differs(run(config, {**variables, BIAS: no_bias}, x)[0], expected, rel(config))
    no_groups = dataclasses.replace(config, n_group=1, topk_group=1)
    assert_differs(run(no_groups, variables, x)[0], expected, rel(config))


def test_the_bias_picks_but_does_not_weigh(case):
    config, variables, x, _, _ = case
    logits = jnp.asarray(x.reshape(-1, 16)) @ variables["params"]["router"]["kernel"]
    bias = variables[BIAS]["e_score_correction_bias"]
    weights, experts = sigmoid_route(logits, bias, config)
    scores = jax.nn.sigmoid(logits)
    plain = jnp.take_along_axis(scores, experts, axis=-1)
    if config.norm_topk_prob:
        plain = plain / plain.sum(-1, keepdims=True)
    # The same few fp32 operations in the same order, but for transformers' 1e-20.
    np.testing.assert_allclose(weights, plain * config.routed_scaling_factor, rtol=4 * EPS32)
    # Every chosen expert lies in one of each token's topk_group groups.
    groups = np.asarray(experts) // (config.num_experts // config.n_group)
    assert max(len(set(row)) for row in groups) <= config.topk_group
    biased = jnp.take_along_axis(scores + bias, experts, axis=-1)
    assert not np.allclose(weights, biased * config.routed_scaling_factor)


def test_replayed_experts_keep_their_weights(case):
    config, variables, x, _, _ = case
    logits = jnp.asarray(x.reshape(-1, 16)) @ variables["params"]["router"]["kernel"]
    bias = variables[BIAS]["e_score_correction_bias"]
    weights, experts = sigmoid_route(logits, bias, config)
    recorded = experts.at[0].set(-1)  # a row recorded as none is routed as usual
    replayed, replayed_experts = sigmoid_route(logits, bias, config, recorded)
    np.testing.assert_array_equal(replayed_experts, experts)
    np.testing.assert_array_equal(replayed, weights)


def test_router_and_bias_stay_fp32():
    config = SigmoidMoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=4,
                              n_group=2, topk_group=1, n_shared_experts=1)
    module = SigmoidMoE(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    variables = jax.eval_shape(module.init, jax.random.PRNGKey(0),
                               jnp.zeros((1, 4, 16), jnp.bfloat16))
    assert variables["params"]["router"]["kernel"].dtype == jnp.float32
    assert variables[BIAS]["e_score_correction_bias"].dtype == jnp.float32
    assert variables["params"]["experts"]["gate_proj"].dtype == jnp.bfloat16
    assert "e_score_correction_bias" not in str(jax.tree_util.tree_structure(
        variables["params"]))  # out of the optimizer's reach


def test_config_refuses_groups_that_cannot_hold_the_choice():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SigmoidMoEConfig(num_experts=8, num_experts_per_tok=5, intermediate_size=4,
                         n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="groups of two"):
        SigmoidMoEConfig(num_experts=8, num_experts_per_tok=1, intermediate_size=4, n_group=8)


def test_expert_parallel_equals_one_device(case):
    """The routed experts split over ep=4 (two a device) and the batch over fsdp=2: the
    block's output as on one device (moe.py's dispatch, shared by this block)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    config, variables, x, _, _ = case
    x = x.reshape(8, -1, x.shape[-1])  # a row for each of the 8 batch shards
    one, _ = run(config, variables, x)
    mesh = make_mesh("fsdp=2,ep=4")
    specs = match_partition_rules(PARTITION_RULES, variables)
    sharded = jax.device_put(variables, named_shardings(mesh, specs))
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(BATCH_AXES)))
    with jax.set_mesh(mesh):
        step = jax.jit(lambda v, x: run(config, v, x)[0]).lower(sharded, xs).compile()
        split = step(sharded, xs)
    assert "all-to-all" in step.as_text()
    assert_close(split, one, rel(config))
