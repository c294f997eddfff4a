"""The deepseek_v3 family against transformers' DeepseekV3ForCausalLM: a tiny random
directory saved by transformers (q_lora_rank set or null, YaRN with mscale, n_group > 1,
a dense first layer, a correction bias far from zero) read through hf::DIR."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from easylm.deepseek_v3.family import FAMILY  # noqa: E402
from easylm.deepseek_v3 import hf  # noqa: E402
from easylm.deepseek_v3.model import DeepseekV3ForCausalLM  # noqa: E402

T = 24


def _save(directory, q_lora_rank):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
        max_position_embeddings=256, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        initializer_range=0.2)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        for layer in model.model.layers[1:]:  # a bias that changes choices
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8))
    model.save_pretrained(directory)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module", params=[12, None], ids=["q_lora", "q_proj"])
def saved(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ds"))
    model = _save(directory, request.param)
    ids = np.random.default_rng(0).integers(0, 96, (2, T))
    config, params = hf.load_hf_params(directory)
    return directory, model, ids, config, params


def _tolerance(reference):
    # fp32 through 3 layers: a few hundred ulps of the logits' magnitude.
    return 512 * np.finfo(np.float32).eps * float(np.abs(reference).max())


def test_logits_match_transformers(saved):
    _, model, ids, config, params = saved
    ref = _logits(model, ids)
    ours = np.asarray(DeepseekV3ForCausalLM(config).apply({"params": params}, jnp.asarray(ids)))
    tol = _tolerance(ref)
    np.testing.assert_allclose(ours, ref, atol=tol, rtol=0)
    # Negative twins: the correction bias ignored, the group limit ignored.
    unbiased = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "e_score_correction_bias" in str(p) else x, params)
    off = np.asarray(DeepseekV3ForCausalLM(config).apply({"params": unbiased}, jnp.asarray(ids)))
    assert np.abs(off - ref).max() > 100 * tol
    ungrouped = config.replace(topk_group=config.n_group)
    off = np.asarray(DeepseekV3ForCausalLM(ungrouped).apply({"params": params},
                                                           jnp.asarray(ids)))
    assert np.abs(off - ref).max() > 100 * tol
