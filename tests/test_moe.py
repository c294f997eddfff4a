"""The sparse MoE block (easylm/models/moe.py) against transformers' own MoE modules, a
dense reference, and itself split over 8 devices.

Tolerances: the block's output is k weighted expert outputs, each three reductions deep
(gate/up over D, down over F, the weighted sum); in fp32 that is `fp32_rel(max(D, F), 3)`
of the magnitude carried (numerics.py). The router's top-k on random weights has no
near-ties at these sizes, so both sides pick the same experts.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P
from numerics import EPS32, assert_close, assert_differs, fp32_rel

from easylm.models import moe
from easylm.models.moe import MoEConfig, SparseMoE
from easylm.runtime.sharding import BATCH_AXES, make_mesh, match_partition_rules, named_shardings

B, T, D, F, E, K = 2, 8, 16, 24, 8, 2
REL = fp32_rel(max(D, F), 3)


def tensor(x):
    return torch.from_numpy(np.asarray(x, np.float32))


def randomize(module, seed=0):
    """Every parameter of a torch module normal with std 1/sqrt(fan-in): outputs O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            std = 1 / np.sqrt(p.shape[-1]) if p.ndim > 1 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module


def hidden(seed=1):
    return np.random.RandomState(seed).randn(B, T, D).astype(np.float32)


def run(config, params, x):
    y, stats = SparseMoE(config).apply({"params": params}, jnp.asarray(x))
    return np.asarray(y), stats


def mixtral_like(block_class, hf_config):
    """A random HF Mixtral-style block (router `gate`, fused experts), its output on
    `hidden()`, and its weights in our layout."""
    block = randomize(block_class(hf_config)).eval()
    x = hidden()
    with torch.no_grad():
        expected = block(tensor(x)).numpy()
    params = mixtral_like_params(block.gate.weight, block.experts.gate_up_proj,
                                 block.experts.down_proj)
    return x, expected, params


def mixtral_like_params(gate, gate_up, down):
    """HF's fused (E, 2F, D) gate_up and (E, D, F) down, router (E, D) -> ours."""
    gate_up, down = gate_up.detach().numpy(), down.detach().numpy()
    return {"router": {"kernel": gate.detach().numpy().T},
            "experts": {"gate_proj": gate_up[:, :F].transpose(0, 2, 1),
                        "up_proj": gate_up[:, F:].transpose(0, 2, 1),
                        "down_proj": down.transpose(0, 2, 1)}}


# ------------------------------------------------------------------ transformers parity


def test_mixtral_block():
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_config = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                              num_experts_per_tok=K)
    x, expected, params = mixtral_like(MixtralSparseMoeBlock, hf_config)
    config = MoEConfig(E, K, F, norm_topk_prob=True)
    y, stats = run(config, params, x)
    assert_close(y, expected, REL)
    assert int(stats.dropped) == 0 and int(stats.load.sum()) == B * T * K
    # Negative twin: top-k off by one (k=3) moves the output by about its own size.
    assert_differs(run(dataclasses.replace(config, num_experts_per_tok=K + 1), params, x)[0],
                   expected, REL)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block(norm_topk_prob):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                               num_experts_per_tok=K, norm_topk_prob=norm_topk_prob)
    x, expected, params = mixtral_like(Qwen3MoeSparseMoeBlock, hf_config)
    config = MoEConfig(E, K, F, norm_topk_prob=norm_topk_prob)
    assert_close(run(config, params, x)[0], expected, REL)
    # Negative twin: the other renormalisation.
    wrong = dataclasses.replace(config, norm_topk_prob=not norm_topk_prob)
    assert_differs(run(wrong, params, x)[0], expected, REL)


def test_gpt_oss_block():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig

    hf_config = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                             num_experts_per_tok=K, swiglu_limit=1.0)
    block = randomize(gpt_oss.GptOssMLP(hf_config)).eval()
    x = hidden() * 3  # big enough that the clamp at 1.0 bites
    with torch.no_grad():
        expected = block(tensor(x))
        expected = (expected[0] if isinstance(expected, tuple) else expected).numpy()
    ex = {k: v.detach().numpy() for k, v in block.experts.named_parameters()}
    params = {"router": {"kernel": block.router.weight.detach().numpy().T,
                         "bias": block.router.bias.detach().numpy()},
              "experts": {"gate_proj": ex["gate_up_proj"][..., ::2],
                          "up_proj": ex["gate_up_proj"][..., 1::2],
                          "gate_proj_bias": ex["gate_up_proj_bias"][:, ::2],
                          "up_proj_bias": ex["gate_up_proj_bias"][:, 1::2],
                          "down_proj": ex["down_proj"],
                          "down_proj_bias": ex["down_proj_bias"]}}
    config = MoEConfig(E, K, F, router="topk_softmax", router_bias=True, expert_bias=True,
                       swiglu_limit=hf_config.swiglu_limit, swiglu_alpha=hf_config.swiglu_alpha)
    assert_close(run(config, params, x)[0], expected, REL)
    # Negative twins: the router's bias dropped; the clamp off.
    no_bias = params | {"router": params["router"] | {"bias": np.zeros(E, np.float32)}}
    assert_differs(run(config, no_bias, x)[0], expected, REL)
    assert_differs(run(dataclasses.replace(config, swiglu_limit=100.0), params, x)[0],
                   expected, REL)


def test_load_balancing_loss_equals_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    rng = np.random.RandomState(0)
    layers = [rng.randn(B * T, E).astype(np.float32) * 2 for _ in range(3)]
    mask = (rng.rand(B, T) > 0.3).astype(np.float32)
    for m in (None, mask):
        expected = float(load_balancing_loss_func(tuple(tensor(x) for x in layers), E, K,
                                                  None if m is None else tensor(m)))
        got = float(moe.load_balancing_loss(layers, K, None if m is None else m.reshape(-1)))
        # A sum of E products of means over 3*B*T rows: one reduction of that many terms.
        assert abs(got - expected) <= fp32_rel(3 * B * T, 2) * expected
    # Negative twin: the mask ignored.
    assert abs(float(moe.load_balancing_loss(layers, K)) - expected) > fp32_rel(3 * B * T, 2)
    # No token counted (a GRPO step whose completions were all masked): 0 and a gradient
    # of 0, not NaN.
    value, grad = jax.value_and_grad(lambda x: moe.load_balancing_loss(
        [x], K, jnp.zeros(B * T)))(jnp.asarray(layers[0]))
    assert float(value) == 0.0 and not np.abs(np.asarray(grad)).any()


def test_z_loss():
    logits = np.random.RandomState(0).randn(4, E).astype(np.float32)
    expected = np.mean(np.log(np.exp(logits.astype(np.float64)).sum(-1)) ** 2)
    assert abs(float(moe.router_z_loss(logits)) - expected) <= 8 * EPS32 * expected


def test_load_metrics_over_layers():
    logits = np.random.RandomState(0).randn(2, 6, E).astype(np.float32)
    stats = [moe.RouterStats(jnp.asarray(l), None, jnp.asarray(load), jnp.asarray(d))
             for l, load, d in zip(logits, ([3, 0, 9, 0, 0, 0, 0, 0], [1, 2, 3, 1, 1, 1, 1, 2]),
                                   (0, 4))]
    metrics = moe.load_metrics(stats, K)
    assert float(metrics["moe_load_max"]) == 9 and float(metrics["moe_load_min"]) == 0
    assert int(metrics["moe_dropped"]) == 4
    assert float(metrics["moe_aux_loss"]) == float(moe.load_balancing_loss(logits, K))
    assert float(metrics["moe_z_loss"]) == float(moe.router_z_loss(logits))


# ------------------------------------------------------------------ dispatch


def dense_reference(config, params, x, keep=None):
    """Every token through every expert (einsum), weighted by its routing weights spread
    over E (zero for experts not chosen, or not kept): what dispatch must equal."""
    shape = np.shape(x)
    x = jnp.asarray(x).reshape(-1, D)
    logits = x @ params["router"]["kernel"]
    weights, experts = moe.route(logits, config)
    if keep is not None:
        weights = jnp.where(keep, weights, 0)
    combine = jnp.einsum("NK,NKE->NE", weights, jax.nn.one_hot(experts, E))
    ex = params["experts"]
    h = jax.nn.silu(jnp.einsum("ND,EDF->NEF", x, ex["gate_proj"])) * jnp.einsum(
        "ND,EDF->NEF", x, ex["up_proj"])
    out = jnp.einsum("NEF,EFD->NED", h, ex["down_proj"])
    return jnp.einsum("NE,NED->ND", combine, out).reshape(shape)


def init(config, seed=0):
    params = SparseMoE(config).init(jax.random.PRNGKey(seed), jnp.zeros((B, T, D)))["params"]
    # Router weights large enough that routing is decided, not near-uniform.
    return jax.tree.map(lambda p: p * 20, params)


def test_permute_gradient_is_the_inverse_gather():
    """The dispatch's permutation (`moe._permute`) carries its own gradient, the inverse
    permutation's gather, in place of autodiff's scatter-add: the same numbers exactly
    (each row moves once, no sums), and a wrong inverse is seen (negative twin)."""
    rows = jnp.asarray(hidden().reshape(-1, D))
    order = jnp.asarray(np.random.default_rng(1).permutation(rows.shape[0]))
    inverse = jnp.argsort(order)
    cotangent = jnp.cos(jnp.arange(rows.size, dtype=jnp.float32)).reshape(rows.shape)
    _, ours = jax.vjp(lambda r: moe._permute(r, order, inverse), rows)
    _, autodiff = jax.vjp(lambda r: r[order], rows)
    np.testing.assert_array_equal(ours(cotangent)[0], autodiff(cotangent)[0])
    _, wrong = jax.vjp(lambda r: moe._permute(r, order, order), rows)
    assert_differs(wrong(cotangent)[0], autodiff(cotangent)[0], REL)


def test_dropless_equals_dense_reference_forward_and_gradient():
    config = MoEConfig(E, K, F)
    params, x = init(config), jnp.asarray(hidden())
    y, _ = run(config, params, x)
    expected = dense_reference(config, params, x)
    assert_close(y, expected, REL)

    def loss(f):
        return lambda p, x: jnp.sum(f(p, x) * jnp.cos(jnp.arange(D)))

    grads = jax.grad(loss(lambda p, x: SparseMoE(config).apply({"params": p}, x)[0]),
                     (0, 1))(params, x)
    dense = jax.grad(loss(lambda p, x: dense_reference(config, p, x)), (0, 1))(params, x)
    # Backward: one more reduction deep, over the N*K rows for the weight gradients.
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(dense)):
        assert_close(g, r, fp32_rel(max(D, F, B * T * K), 4))
    # Negative twin: a wrong group size (one row moved to the next expert) is seen.
    _, experts = moe.route(x.reshape(-1, D) @ params["router"]["kernel"], config)
    order, _, sizes = moe._sort_pairs(experts, jnp.ones(experts.shape, bool), E)
    rows = x.reshape(-1, D)[order // K]
    good = moe.expert_mlp(rows, params["experts"], sizes, config, jnp.float32)
    bad = moe.expert_mlp(rows, params["experts"], sizes.at[0].add(-1).at[1].add(1), config,
                         jnp.float32)
    assert_differs(bad, good, REL)


def test_all_tokens_to_one_expert_drops_nothing():
    config = MoEConfig(E, K, F)
    params = init(config)
    # A router bias-free way to send everything to experts 0 and 1: a huge kernel column.
    kernel = np.zeros((D, E), np.float32)
    kernel[:, 0], kernel[:, 1] = 100, 50
    x = np.abs(hidden())
    params = params | {"router": {"kernel": jnp.asarray(kernel)}}
    y, stats = run(config, params, x)
    assert list(np.asarray(stats.load)) == [B * T, B * T] + [0] * (E - 2)
    assert int(stats.dropped) == 0
    assert_close(y, dense_reference(config, params, x), REL)


def test_capacity_factor_drops_past_capacity():
    config = MoEConfig(E, K, F, capacity_factor=1.0)
    params, x = init(config), hidden()
    N = B * T
    cap = moe.capacity(config, N)
    assert cap == N * K // E
    weights, experts = moe.route(jnp.asarray(x).reshape(N, D) @ params["router"]["kernel"],
                                 config)
    experts = np.asarray(experts)
    # Which pairs fit, by hand: first choices before second choices, tokens in order.
    keep, taken = np.zeros((N, K), bool), np.zeros(E, int)
    for slot in range(K):
        for n in range(N):
            e = experts[n, slot]
            keep[n, slot] = taken[e] < cap
            taken[e] += 1
    assert (~keep).sum() > 0, "the test needs an expert over capacity"
    y, stats = run(config, params, x)
    assert int(stats.dropped) == (~keep).sum()
    assert_close(y, dense_reference(config, params, x, jnp.asarray(keep)), REL)
    # Negative twin: with nothing dropped the output is not the same.
    assert_differs(y, dense_reference(config, params, x), REL)


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax"])
def test_routing_replay_uses_the_recorded_experts(router):
    config = MoEConfig(E, K, F, router=router, norm_topk_prob=False)
    params, x = init(config), jnp.asarray(hidden())
    block = SparseMoE(config)
    y, stats = block.apply({"params": params}, x)
    recorded = stats.experts.reshape(B, T, K)
    # Replaying the block's own choices is the same computation.
    assert np.array_equal(block.apply({"params": params}, x, recorded)[0], y)
    # After an update that changes some choices, replay keeps the recorded experts and
    # weighs them by the new router: the dense reference over those experts.
    moved = jax.tree.map(lambda p: p, params)
    moved["router"]["kernel"] = params["router"]["kernel"] + 0.5 * jax.random.normal(
        jax.random.PRNGKey(7), params["router"]["kernel"].shape)
    fresh, fresh_stats = block.apply({"params": moved}, x)
    assert not np.array_equal(fresh_stats.experts, stats.experts), "no choice changed"
    replayed, replay_stats = block.apply({"params": moved}, x, recorded)
    assert np.array_equal(replay_stats.experts, stats.experts)
    logits = x.reshape(-1, D) @ moved["router"]["kernel"]
    weights, _ = moe.route(logits, config, stats.experts)
    combine = jnp.einsum("NK,NKE->NE", weights, jax.nn.one_hot(stats.experts, E))
    ex = moved["experts"]
    xs = x.reshape(-1, D)
    h = jax.nn.silu(jnp.einsum("ND,EDF->NEF", xs, ex["gate_proj"])) * jnp.einsum(
        "ND,EDF->NEF", xs, ex["up_proj"])
    expected = jnp.einsum("NE,NED->ND", combine, jnp.einsum("NEF,EFD->NED", h, ex["down_proj"]))
    assert_close(replayed, expected.reshape(B, T, D), REL)
    # Negative twin: routing afresh is not the replay.
    assert_differs(fresh, expected.reshape(B, T, D), REL)
    # The router still gets a gradient through the replayed weights.
    grad = jax.grad(lambda p: jnp.sum(block.apply({"params": p}, x, recorded)[0] ** 2))(moved)
    assert float(jnp.abs(grad["router"]["kernel"]).max()) > 0


# ------------------------------------------------------------------ expert parallelism


@pytest.mark.parametrize("mesh_dim,skewed", [
    ("fsdp=4,ep=2", False), ("fsdp=2,ep=4", False), ("ep=8", False), ("fsdp=8", False),
    ("fsdp=2,ep=4", True)])
def test_expert_parallel_equals_one_device(mesh_dim, skewed):
    """Output and gradients on 8 devices equal one device's; `skewed`: every token to
    experts 0 and 1, both on the first ep device (the worst case the dropless buffers are
    sized for): nothing dropped, still equal."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    config = MoEConfig(E, K, F)
    params = init(config)
    x = jnp.asarray(np.random.RandomState(2).randn(8, 4, D).astype(np.float32))  # 8 rows
    if skewed:
        kernel = np.zeros((D, E), np.float32)
        kernel[:, 0], kernel[:, 1] = 100, 50
        params, x = params | {"router": {"kernel": jnp.asarray(kernel)}}, jnp.abs(x)

    def loss(p, x):
        y, stats = SparseMoE(config).apply({"params": p}, x)
        return jnp.sum(y * jnp.cos(jnp.arange(D))), (y, stats.dropped)

    (l1, (y1, _)), g1 = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
    mesh = make_mesh(mesh_dim)
    specs = match_partition_rules(moe.PARTITION_RULES, params)
    sharded = jax.device_put(params, named_shardings(mesh, specs))
    xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True)).lower(sharded, xs)
        step = step.compile()
        (l2, (y2, dropped)), g2 = step(sharded, xs)
    # The tokens travel to their experts' devices only when experts are split.
    assert ("all-to-all" in step.as_text()) == (mesh.shape["ep"] > 1)
    assert int(dropped) == 0
    assert_close(y2, y1, REL)
    assert abs(float(l2) - float(l1)) <= fp32_rel(B * T * D, 4) * float(jnp.abs(y1).sum())
    for g, r in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        if skewed and not np.any(r):  # an expert no token reached: no gradient either
            np.testing.assert_array_equal(g, 0)
        else:
            assert_close(g, r, fp32_rel(max(D, F, B * T * K), 4))


# ------------------------------------------------ megablox (Pallas interpret mode on CPU)


def grouped_inputs(seed=3, rows=48, sizes=(5, 0, 9, 13, 2, 0, 7, 4)):
    """Rows (rows, D) with groups of `sizes` (summing to less than `rows`: the rest belong
    to no group, as capacity-dropped pairs and tile padding do) and stacks (E, D, F)."""
    rng = np.random.RandomState(seed)
    return (jnp.asarray(rng.randn(rows, D), jnp.float32),
            jnp.asarray(rng.randn(E, D, F) / np.sqrt(D), jnp.float32),
            jnp.asarray(sizes, jnp.int32))


def test_megablox_gmm_equals_ragged_dot_forward_and_gradients():
    """megablox's gmm (its custom VJP: gmm, the transposed gmm, tgmm) = ragged_dot, rows past
    the groups zero in the output and in their gradient; the same sums in another order:
    fp32, one reduction over D forward, over D or F (dx) and the rows (dw) backward."""
    x, w, sizes = grouped_inputs()
    tiling = moe._tiling(x.shape[0], D, F)
    cot = jnp.cos(jnp.arange(x.shape[0] * F)).reshape(-1, F)

    def loss(f):
        return lambda x, w, sizes: jnp.sum(f(x, w, sizes) * cot)

    kernel = lambda x, w, s: moe.gmm(x, w, s, jnp.float32, tiling)  # noqa: E731
    ragged = lambda x, w, s: jax.lax.ragged_dot(x, w, s)  # noqa: E731
    out, expected = kernel(x, w, sizes), ragged(x, w, sizes)
    assert_close(out, expected, fp32_rel(D))
    np.testing.assert_array_equal(out[int(sizes.sum()):], 0)
    grads = jax.grad(loss(kernel), (0, 1))(x, w, sizes)
    reference = jax.grad(loss(ragged), (0, 1))(x, w, sizes)
    for g, r in zip(grads, reference):
        assert_close(g, r, fp32_rel(max(D, F, x.shape[0])))
    np.testing.assert_array_equal(grads[0][int(sizes.sum()):], 0)
    # Negative twin: group sizes shifted by one (a row given to the next expert) is seen.
    shifted = sizes.at[0].add(-1).at[2].add(1)
    assert_differs(kernel(x, w, shifted), expected, fp32_rel(D))
    assert_differs(jax.grad(loss(kernel), 1)(x, w, shifted), reference[1],
                   fp32_rel(max(D, F, x.shape[0])))


def moe_matmul_parity(config, params, x, rel_out, rel_grad):
    """SparseMoE with moe_matmul=megablox = with ragged_dot: output and gradients."""
    def loss(config):
        def f(p, x):
            y, stats = SparseMoE(config).apply({"params": p}, x)
            return jnp.sum(y * jnp.cos(jnp.arange(D))), (y, stats.dropped)
        return jax.value_and_grad(f, (0, 1), has_aux=True)

    (_, (y1, d1)), g1 = loss(dataclasses.replace(config, matmul="ragged_dot"))(params, x)
    (_, (y2, d2)), g2 = loss(dataclasses.replace(config, matmul="megablox"))(params, x)
    assert int(d1) == int(d2)
    assert_close(y2, y1, rel_out)
    for g, r in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert_close(g, r, rel_grad)
    return y1, y2


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_sparse_moe_megablox_equals_ragged_dot(capacity_factor):
    """The whole block (sort, three grouped matmuls, combine), dropless and with pairs
    dropped past capacity (rows past the groups: the kernel leaves them unwritten)."""
    config = MoEConfig(E, K, F, capacity_factor=capacity_factor)
    y1, _ = moe_matmul_parity(config, init(config), jnp.asarray(hidden()), REL,
                              fp32_rel(max(D, F, B * T * K), 4))
    assert_differs(y1, dense_reference(config, init(config, seed=1), hidden()), REL)


def test_sparse_moe_megablox_with_lora_adapters_equals_ragged_dot():
    """LoRA on the experts (adapters beside the stacks, moe.EXPERT_ADAPTERS) keeps its
    numbers and its adapters' gradients under megablox; negative twin: the adapters
    dropped changes the output."""
    config = MoEConfig(E, K, F)
    params = init(config)
    rng, R = np.random.RandomState(5), 4
    adapters = {"gate_up_proj_lora_a": rng.randn(E, D, R) / np.sqrt(D),
                "gate_up_proj_lora_b": rng.randn(E, R, 2 * F) / np.sqrt(R),
                "down_proj_lora_a": rng.randn(E, F, R) / np.sqrt(F),
                "down_proj_lora_b": rng.randn(E, R, D) / np.sqrt(R)}
    params = params | {"experts": params["experts"] | jax.tree.map(
        lambda a: jnp.asarray(a, jnp.float32), adapters)}
    x = jnp.asarray(hidden())
    _, y2 = moe_matmul_parity(config, params, x, fp32_rel(max(D, F), 5),
                              fp32_rel(max(D, F, B * T * K), 6))
    plain = run(dataclasses.replace(config, matmul="megablox"), init(config), x)[0]
    assert_differs(plain, y2, fp32_rel(max(D, F), 5))


@pytest.mark.parametrize("mesh_dim", ["fsdp=2,ep=4"])
def test_expert_parallel_megablox_equals_one_device_ragged_dot(mesh_dim):
    """Experts split over 'ep' (tokens sent with all_to_all), each device's grouped matmul
    through megablox: output and gradients equal one device's ragged_dot."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    config = MoEConfig(E, K, F)
    params = init(config)
    x = jnp.asarray(np.random.RandomState(2).randn(8, 4, D).astype(np.float32))

    def loss(config):
        def f(p, x):
            return jnp.sum(SparseMoE(config).apply({"params": p}, x)[0] * jnp.cos(
                jnp.arange(D)))
        return jax.value_and_grad(f, (0, 1))

    l1, g1 = loss(dataclasses.replace(config, matmul="ragged_dot"))(params, x)
    mesh = make_mesh(mesh_dim)
    sharded = jax.device_put(params, named_shardings(
        mesh, match_partition_rules(moe.PARTITION_RULES, params)))
    xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
    with jax.set_mesh(mesh):
        l2, g2 = jax.jit(loss(dataclasses.replace(config, matmul="megablox")))(sharded, xs)
    assert abs(float(l2) - float(l1)) <= fp32_rel(B * T * D, 4) * float(abs(l1) + 1)
    for g, r in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert_close(g, r, fp32_rel(max(D, F, B * T * K), 4))


def test_moe_matmul_flag_is_checked():
    from easylm.errors import UserError
    from easylm.llama.config import LLaMAConfig

    from easylm.deepseek_v3.config import DeepseekV3Config

    for config_class in (LLaMAConfig, DeepseekV3Config):
        with pytest.raises(UserError, match="moe_matmul='cutlass' is not one of"):
            config_class(moe_matmul="cutlass")
    assert moe.matmul_kind("auto") == "ragged_dot"  # measured faster on a v5e (docs/moe.md)
