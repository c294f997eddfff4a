"""Multi-head latent attention (easylm/models/mla.py) against transformers'
DeepseekV3Attention, and its latent cache: expanded = absorbed, prefill then decode =
one full forward.

Tolerances (tests/numerics.py): the longest chain of reductions in sequence is q_a_proj
(D terms), q_a_layernorm (Q), q_b_proj (Q), the scores (H), the softmax's sum (S), the
weighted sum of values (S), o_proj (N * V): 7 reductions over at most max(D, N * V, ...)
terms. Absorbing reorders one more sum (the scores' P terms become a sum over C of sums
over P), so the two cache forms compare at 8; gradients run the chain back again and
sum the weights' over the B * T rows, 2 * 7 + 1. bf16 rounds each of those steps' inputs and
outputs to half a bf16 ulp; those errors add as a random walk: sqrt(depth) * EPS_BF16.
A real bug (rotary on the wrong dimensions, mscale dropped, the rope key lost from the
cache) moves the output by a sizeable fraction of itself.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from numerics import EPS_BF16, assert_close, assert_differs, fp32_rel

from easylm.models.decoder import rotary_embedding
from easylm.models.mla import LatentCache, MLAConfig, MultiHeadLatentAttention

B, T, D = 2, 40, 64  # T past the original context below, where YaRN's blend matters
DEPTH = 7
GRAD_WEIGHTS = np.random.RandomState(1).randn(B, T, D).astype(np.float32)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
            mscale=0.9, mscale_all_dim=0.7)
CASES = {
    "q_lora_yarn_interleave": dict(q_lora_rank=24, rope_parameters=YARN, rope_interleave=True,
                                   attention_bias=True),
    "q_proj_yarn_halves": dict(q_lora_rank=None, rope_parameters=YARN, rope_interleave=False),
    "q_lora_plain_rope": dict(q_lora_rank=24, rope_interleave=True,
                              rope_parameters=dict(rope_type="default", rope_theta=500.0)),
}


def hf_config(**changes):
    from transformers import DeepseekV3Config

    fields = dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=4,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                  max_position_embeddings=64, vocab_size=32, num_hidden_layers=1,
                  attn_implementation="eager")
    return DeepseekV3Config(**{**fields, **changes})


def hf_attention(config):
    """DeepseekV3Attention with random weights, its latent norms' weights off 1."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    torch.manual_seed(0)
    module = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return module


def hf_forward(module, config, x, grad_weights=None):
    """The output (B, T, D); with `grad_weights` (B, T, D) the gradients of
    sum(output * grad_weights) by parameter name instead."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    hidden = torch.tensor(x)
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = DeepseekV3RotaryEmbedding(config)(hidden, positions)
    future = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
    mask = torch.zeros(x.shape[1], x.shape[1]).masked_fill(future, torch.finfo(torch.float32).min)
    with torch.set_grad_enabled(grad_weights is not None):
        out, _ = module(hidden, (cos, sin), mask[None, None])
    if grad_weights is None:
        return out.numpy()
    module.zero_grad()
    (out * torch.tensor(grad_weights)).sum().backward()
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def flax_params(module, tensors=None):
    """transformers' tensors (the module's, or `tensors` by the same names) under our
    names: a Linear's weight transposed as a kernel."""
    params = {}
    for name, tensor in (tensors or module.state_dict()).items():
        layer, leaf = name.rsplit(".", 1)
        if leaf == "weight" and "layernorm" not in layer:
            leaf, tensor = "kernel", tensor.T
        params.setdefault(layer, {})[leaf] = jnp.asarray(tensor.numpy())
    return params


def ours(config: MLAConfig, params, x, dtype=jnp.float32, module=MultiHeadLatentAttention,
         **kwargs):
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    inv_freq, factor = config.rope()
    cos, sin = rotary_embedding(positions, inv_freq, dtype, factor)
    out, _ = module(config, dtype, **kwargs).apply({"params": params}, jnp.asarray(x, dtype),
                                                   cos, sin, positions)
    return out.astype(jnp.float32)


@functools.cache
def hf_case(name: str):
    """(name, our config, our params, x, transformers' output, and its gradients of
    sum(output * GRAD_WEIGHTS) as our parameters)."""
    config = hf_config(**CASES[name])
    module = hf_attention(config)
    x = np.random.RandomState(0).randn(B, T, config.hidden_size).astype(np.float32)
    ours_config = MLAConfig.from_hf(config.to_dict(), attention="xla")
    expected = hf_forward(module, config, x)
    grads = flax_params(module, hf_forward(module, config, x, GRAD_WEIGHTS))
    return name, ours_config, flax_params(module), x, expected, grads


@pytest.fixture(params=sorted(CASES))
def case(request):
    return hf_case(request.param)


def rel(config: MLAConfig, depth: int = DEPTH) -> float:
    c = config
    terms = max(c.hidden_size, c.q_lora_rank or 0, c.kv_lora_rank, T,
                c.num_attention_heads * c.v_head_dim)
    return fp32_rel(terms, depth)


def test_matches_transformers(case):
    name, config, params, x, expected, _ = case
    if name == "q_proj_yarn_halves":
        assert "q_proj" in params and "q_a_proj" not in params
    # Both kernels: the value heads, narrower than the query/key ones, are padded for them.
    for kernel in ("xla", "dot_product"):
        assert_close(ours(dataclasses.replace(config, attention=kernel), params, x), expected,
                     rel(config), err_msg=kernel)


def ours_grads(config, params, x, module=MultiHeadLatentAttention):
    loss = lambda p: jnp.sum(ours(config, p, x, module=module) * GRAD_WEIGHTS)
    return jax.jit(jax.grad(loss))(params)


def test_gradients_match_transformers():
    # Backward: the forward's chain again in reverse, and the weights' gradients one
    # more sum over the B * T rows. One case, the one with every projection and bias
    # (a backward pass costs a compilation per case).
    _, config, params, x, _, expected = hf_case("q_lora_yarn_interleave")
    tolerance = fp32_rel(max(B * T, config.hidden_size), 2 * DEPTH + 1)
    grads = ours_grads(config, params, x)
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads),
                                 jax.tree.leaves(expected)):
        assert_close(got, want, tolerance, err_msg=jax.tree_util.keystr(path))
    wrong = ours_grads(config, params, x, RopeOnTheNopePart)["q_b_proj" if config.q_lora_rank
                                                             else "q_proj"]["kernel"]
    assert_differs(wrong, (expected["q_b_proj" if config.q_lora_rank else "q_proj"]["kernel"]),
                   tolerance)


class RopeOnTheNopePart(MultiHeadLatentAttention):
    def split_query(self, q):
        R = self.config.qk_rope_head_dim
        return q[..., R:], q[..., :R]


def test_negative_twins(case):
    # The comparison above fails on rotary over the wrong query dimensions, pairs read
    # as halves (or halves as pairs), and for YaRN the mscale corrections dropped.
    _, config, params, x, expected, _ = case
    assert_differs(ours(config, params, x, module=RopeOnTheNopePart), expected, rel(config))
    flipped = dataclasses.replace(config, rope_interleave=not config.rope_interleave)
    assert_differs(ours(flipped, params, x), expected, rel(config))
    if config.yarn:
        yarn = dict(config.yarn)
        for wrong in (dict(mscale_all_dim=None), dict(mscale=None, mscale_all_dim=None)):
            no_mscale = dataclasses.replace(config, yarn=tuple(sorted({**yarn, **wrong}.items())))
            assert no_mscale.softmax_scale != config.softmax_scale
            assert_differs(ours(no_mscale, params, x), expected, rel(config))


def test_bf16_runs_close(case):
    _, config, params, x, expected, _ = case
    half = ours(config, params, x, jnp.bfloat16)
    assert_close(half, expected, np.sqrt(DEPTH) * EPS_BF16)
    assert_differs(half, expected, rel(config))  # really computed in bf16


# ------------------------------------------------------------------ the latent cache


def with_cache(config, params, x, start, cache, absorb, dtype=jnp.float32):
    """x's positions start.. through the module with `cache`: (out, cache)."""
    positions = jnp.broadcast_to(jnp.arange(start, start + x.shape[1]), x.shape[:2])
    inv_freq, factor = config.rope()
    cos, sin = rotary_embedding(positions, inv_freq, dtype, factor)
    out, cache = MultiHeadLatentAttention(config, dtype, absorb=absorb).apply(
        {"params": params}, jnp.asarray(x, dtype), cos, sin, positions, cache=cache)
    return np.asarray(out, np.float32), cache


def prefill_then_decode(config, params, x, steps, dtype=jnp.float32):
    """x's first T - steps positions at once (expanded), then one at a time (absorbed):
    the outputs (B, T, D) and the cache."""
    prompt = x.shape[1] - steps
    cache = LatentCache.init(config, x.shape[0], x.shape[1], dtype)
    out, cache = with_cache(config, params, x[:, :prompt], 0, cache, None, dtype)
    assert not MultiHeadLatentAttention(config).absorbs(prompt, cache)
    outs = [out]
    for t in range(prompt, x.shape[1]):
        assert MultiHeadLatentAttention(config).absorbs(1, cache)
        out, cache = with_cache(config, params, x[:, t:t + 1], t, cache, None, dtype)
        outs.append(out)
    return np.concatenate(outs, axis=1), cache


def test_cache_holds_the_latent():
    config = MLAConfig.from_hf(hf_config(q_lora_rank=24, rope_parameters=YARN).to_dict())
    cache = LatentCache.init(config, batch=3, length=10, dtype=jnp.bfloat16)
    assert config.cache_width == config.kv_lora_rank + config.qk_rope_head_dim == 40
    assert cache.kv.shape == (3, 10, 1, 40)
    assert cache.bytes_per_token == 40 * 2
    # DeepSeek-V3's sizes: 576 values a token and layer, against N * (P + R + V) expanded.
    v3 = MLAConfig(hidden_size=7168, num_attention_heads=128, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536)
    assert v3.cache_width == 576
    assert 128 * (v3.qk_head_dim + v3.v_head_dim) == 40960


@pytest.mark.parametrize("kernel", ["xla", "dot_product"])
def test_absorbed_equals_expanded(case, kernel):
    _, config, params, x, _, _ = case
    config = dataclasses.replace(config, attention=kernel)
    cache = LatentCache.init(config, B, T)
    expanded, cache_e = with_cache(config, params, x, 0, cache, absorb=False)
    absorbed, cache_a = with_cache(config, params, x, 0, cache, absorb=True)
    np.testing.assert_array_equal(cache_e.kv, cache_a.kv)  # the same rows written
    assert_close(absorbed, expanded, rel(config, DEPTH + 1))
    # ... and a latent cache that lost its rope keys decodes to something else.
    lost = cache_a.kv.at[..., config.kv_lora_rank:].set(0)
    wrong, _ = with_cache(config, params, x[:, -1:], T - 1, LatentCache(lost), absorb=True)
    assert_differs(wrong, expanded[:, -1:], rel(config, DEPTH + 1))


def test_prefill_then_decode_equals_full_forward(case):
    _, config, params, x, expected, _ = case
    decoded, cache = prefill_then_decode(config, params, x, steps=4)
    assert_close(decoded, expected, rel(config, DEPTH + 1))
    # The last token decoded one position early (its rotary off by one, and the key
    # before it overwritten) must not pass.
    shifted, _ = with_cache(config, params, x[:, -1:], T - 2, cache, absorb=True)
    assert_differs(shifted, expected[:, -1:], rel(config, DEPTH + 1))


def test_bf16_cache_decodes_close():
    """The serving form: bf16 compute, a bf16 latent cache, decode absorbed (one case:
    bf16 compiles its own kernels)."""
    _, config, params, x, expected, _ = hf_case("q_lora_yarn_interleave")
    decoded, cache = prefill_then_decode(config, params, x, steps=4, dtype=jnp.bfloat16)
    assert cache.kv.dtype == jnp.bfloat16 and cache.bytes_per_token == 2 * config.cache_width
    assert_close(decoded, expected, np.sqrt(DEPTH + 1) * EPS_BF16)


def test_from_hf_reads_deepseek_v3s_config_json():
    """DeepSeek-V3's released config.json: rope_scaling (the pre-5 name) with `type`, the
    theta at the top level, mscale = mscale_all_dim (the rotary factor is then 1 and only
    the softmax scale grows)."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    scaling = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}
    hf = dict(hidden_size=7168, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000,
              rope_scaling=scaling, max_position_embeddings=163840)
    config = MLAConfig.from_hf(hf)
    inv_freq, factor = config.rope()
    assert inv_freq.shape == (32,) and factor == 1.0
    expected = yarn_apply_mscale({**scaling, "rope_type": "yarn"}, 192 ** -0.5)
    assert config.softmax_scale == pytest.approx(expected, rel=1e-15)
    assert config.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
