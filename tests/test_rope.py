"""Rotary frequencies (easylm/models/rope.py) against transformers' rope init functions,
and a LLaMA variant with a yarn rope (Qwen's long-context configs) against transformers'
logits.

Tolerances: an inverse frequency is a handful of fp32 operations (a power, a quotient, a
blend), each correctly rounded or within an ulp in both libraries: a few ulps, 8 * eps
relative. A wrong blend (truncate flipped, a beta off) moves some frequency by far more.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from llama_variants import hf_variant
from numerics import EPS32, assert_close, assert_differs, forward_rel

from easylm.errors import UserError
from easylm.llama.config import LLaMAConfig
from easylm.llama.hf import from_hf
from easylm.llama.model import LLaMAForCausalLM
from easylm.models import rope

FEW_ULPS = 8 * EPS32
# gpt-oss's settings (truncate off), Qwen's (only factor and the original context), and
# DeepSeek's mscale pair; the head dims of gpt-oss (64) and Qwen (128).
YARN_CASES = {
    "gpt_oss": dict(rope_theta=150000.0, head_dim=64, factor=32.0, beta_fast=32.0,
                    beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    "qwen": dict(rope_theta=1_000_000.0, head_dim=128, factor=4.0,
                 original_max_position_embeddings=32768),
    "mscale": dict(rope_theta=10000.0, head_dim=64, factor=40.0, mscale=1.0,
                   mscale_all_dim=0.707, original_max_position_embeddings=4096),
    "attention_factor": dict(rope_theta=10000.0, head_dim=32, factor=8.0,
                             attention_factor=1.25, original_max_position_embeddings=2048),
}


def transformers_yarn(fields):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "yarn", **{k: v for k, v in fields.items() if k != "head_dim"}}
    config = LlamaConfig(hidden_size=fields["head_dim"] * 4, num_attention_heads=4,
                         head_dim=fields["head_dim"], max_position_embeddings=131072,
                         rope_parameters=parameters)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    return inv_freq.numpy(), factor


def ours(fields):
    fields = dict(fields)
    theta, dim = fields.pop("rope_theta"), fields.pop("head_dim")
    return rope.yarn(theta, dim, **fields)


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_equals_transformers(case):
    fields = YARN_CASES[case]
    expected, expected_factor = transformers_yarn(fields)
    inv_freq, factor = ours(fields)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == expected.shape
    np.testing.assert_allclose(inv_freq, expected, rtol=FEW_ULPS, atol=0)
    assert factor == pytest.approx(expected_factor, rel=FEW_ULPS)
    if case == "qwen":  # the ends of the blend are YaRN's: some kept, some slowed, some between
        default, _ = rope.default(fields["rope_theta"], fields["head_dim"])
        ratio = default / inv_freq
        assert ratio[0] == pytest.approx(1) and ratio[-1] == pytest.approx(fields["factor"])
        assert np.any((ratio > 1.01) & (ratio < fields["factor"] * 0.99))


def test_yarn_negative_twins():
    # The comparison above fails on a blend rounded the other way or a beta off.
    fields = YARN_CASES["gpt_oss"]
    expected, _ = transformers_yarn(fields)
    for wrong in (dict(truncate=True), dict(beta_fast=16.0), dict(factor=16.0)):
        inv_freq, _ = ours({**fields, **wrong})
        assert np.max(np.abs(inv_freq - expected) / expected) > 1e3 * FEW_ULPS


def test_default_equals_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    expected = LlamaRotaryEmbedding(config).inv_freq.numpy()
    inv_freq, factor = rope.default(500000.0, 64)
    np.testing.assert_allclose(inv_freq, expected, rtol=FEW_ULPS, atol=0)
    assert factor == 1.0


# ------------------------------------------------------------ LLaMA variants with yarn

# Qwen's long-context config.json: a yarn rope_scaling with factor and original context
# only. A small original context so that the blend slows frequencies the tests' 32
# positions turn through, and the attention factor (0.1 ln 4 + 1) scales every score.
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.fixture(scope="module")
def qwen_yarn():
    hf_config = LLaMAConfig.from_preset("debug", model_type="qwen2", initializer_range=0.2,
                                        rope_theta=10000.0).to_hf_config().to_dict()
    hf_config["rope_parameters"] = {**QWEN_YARN, "rope_theta": 10000.0}
    config = LLaMAConfig.from_hf_config(hf_config)
    model = hf_variant(config)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).logits.numpy()
    return config, from_hf(model.state_dict(), config), ids, expected


def test_llama_reads_yarn_and_matches_transformers(qwen_yarn):
    config, params, ids, expected = qwen_yarn
    assert config.rope_scaling_type == "yarn" and config.rope_scaling_factor == 4.0
    assert config.rope_original_max_position_embeddings == 16
    # The config written back is one transformers reads as the same rope.
    written = config.to_hf_config().rope_parameters
    assert {k: written[k] for k in QWEN_YARN} == QWEN_YARN
    rel = forward_rel(config, ids.shape[1])
    assert np.abs(expected).max() > 1
    logits = LLaMAForCausalLM(config).apply({"params": params}, jnp.asarray(ids))
    assert_close(logits, expected, rel)
    # Negative twins: the plain rope; yarn's frequencies without its attention factor.
    plain = LLaMAForCausalLM(config.replace(rope_scaling_type="none"))
    assert_differs(plain.apply({"params": params}, jnp.asarray(ids)), expected, rel)

    class NoFactor(LLaMAForCausalLM):
        @classmethod
        def rope_attention_factor(cls, config, kind):
            return 1.0

    assert_differs(NoFactor(config).apply({"params": params}, jnp.asarray(ids)), expected, rel)


def test_llama_refuses_yarn_settings_it_does_not_implement():
    hf = LLaMAConfig.from_preset("debug").to_hf_config().to_dict()
    hf["rope_parameters"] = {**QWEN_YARN, "rope_theta": 10000.0, "beta_fast": 8}
    with pytest.raises(UserError, match="beta_fast=8"):
        LLaMAConfig.from_hf_config(hf)
