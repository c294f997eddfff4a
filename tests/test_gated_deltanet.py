"""The Gated DeltaNet layer against transformers' Qwen3.5 and Qwen3-Next modules, and its
forms (chunked, recurrent, prefill then decode) against each other.

Tolerances (tests/numerics.py): a layer output is about eight reductions in sequence (the
input projection over D, the conv over W, the L2 norm over H, the UT solve over a chunk,
the state's sum over all T earlier tokens, its read over H, the gated norm over U, the
output projection over N U), the widest over T, so `fp32_rel(max(D, T, N U), 8)`
relative to the output's magnitude; bf16 rounds each of those eight stages' results to
2^-7 relative (`EPS_BF16`), errors that add as a random walk: sqrt(8) EPS_BF16.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from numerics import EPS_BF16, assert_close, assert_differs, fp32_rel
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from easylm.models import gated_deltanet as gdn
from easylm.models.gated_deltanet import DeltaNetState, GatedDeltaNet, GatedDeltaNetConfig

# GQA-style heads: two value heads per key head. T = 100 is past one chunk of 64 and not a
# multiple of it.
SIZES = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
             num_hidden_layers=4)
B, T = 2, 100
REL = fp32_rel(max(32, T, 4 * 8), depth=8)
LAYOUTS = {"separate": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet),
           "fused": (Qwen3NextConfig, Qwen3NextGatedDeltaNet)}


def torch_layer(layout: str):
    """A transformers layer with random weights, its decay mild (A in [0.01, 0.1], not up
    to 16 as at init) so the state carries information across chunks, and the norm's
    weight away from ones."""
    config_class, layer_class = LAYOUTS[layout]
    torch.manual_seed(0)
    layer = layer_class(config_class(**SIZES), layer_idx=0).eval()
    with torch.no_grad():
        layer.A_log.copy_(torch.empty(layer.num_v_heads).uniform_(0.01, 0.1).log())
        layer.dt_bias.normal_()
        layer.norm.weight.normal_(1.0, 0.2)
    return layer


def flax_params(layer) -> dict:
    """transformers' names -> ours: Linear weights (out, in) become kernels (in, out), the
    conv's (F, 1, W) a kernel (W, F); the rest as they are."""
    params = {}
    for name, value in layer.state_dict().items():
        value = value.detach().numpy()
        if name == "conv1d.weight":
            params["conv1d"] = {"kernel": value[:, 0, :].T}
        elif name.startswith("in_proj") or name.startswith("out_proj"):
            params[name.split(".")[0]] = {"kernel": value.T}
        elif name == "norm.weight":
            params["norm"] = {"weight": value}
        else:
            params[name] = value
    return params


def flax_config(layout: str) -> GatedDeltaNetConfig:
    fields = {k: v for k, v in SIZES.items() if k != "num_hidden_layers"}
    return GatedDeltaNetConfig(**fields, rms_norm_eps=1e-6, fused_projections=layout == "fused")


def inputs(length: int = T, seed: int = 0):
    return np.random.RandomState(seed).randn(B, length, SIZES["hidden_size"]).astype(np.float32)


def run(layout, params, x, state=None, segment_ids=None, **module_fields):
    layer = GatedDeltaNet(flax_config(layout), **module_fields)
    apply = jax.jit(lambda p, x, s, seg: layer.apply({"params": p}, x, s, seg))
    return apply(params, jnp.asarray(x), state, segment_ids)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pair(request):
    """(layout, transformers layer, our params, x, transformers' output)."""
    layer = torch_layer(request.param)
    x = inputs()
    with torch.no_grad():
        expected = layer(torch.from_numpy(x)).numpy()
    return request.param, layer, flax_params(layer), x, expected


def test_parameters_match_transformers_names_and_shapes(pair):
    layout, _, params, x, _ = pair
    ours = GatedDeltaNet(flax_config(layout)).init(jax.random.PRNGKey(0), jnp.asarray(x[:, :4]))
    shapes = jax.tree.map(np.shape, ours["params"])
    assert shapes == jax.tree.map(np.shape, params)


def test_matches_transformers(pair):
    layout, _, params, x, expected = pair
    out, _ = run(layout, params, x)
    assert_close(out, expected, REL)


@pytest.mark.parametrize("bug", ["conv dropped", "decay dropped"])
def test_matches_transformers_negative_twin(pair, bug, monkeypatch):
    """The same comparison fails on a real bug in the layer."""
    layout, _, params, x, expected = pair
    if bug == "conv dropped":
        monkeypatch.setattr(gdn, "causal_conv",
                            lambda x, kernel, state, real, run: (jax.nn.silu(x), state))
    else:
        rule = gdn.delta_rule
        monkeypatch.setattr(gdn, "delta_rule",
                            lambda q, k, v, g, *rest: rule(q, k, v, 0 * g, *rest))
    out, _ = run(layout, params, x)
    assert_differs(out, expected, REL)
