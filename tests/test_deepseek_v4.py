"""The deepseek_v4 family against transformers' DeepseekV4ForCausalLM: a tiny random
directory saved by transformers (fp32) with every special path active: one layer of each
attention type (sliding, compressed sparse with its indexer keeping 3 entries of up to
74, heavily compressed), compression rates and the window below the 300-token prompt,
hc_mult 2, a hash-routed layer, routers scaled 5x, a random correction bias, and the
sinks, position biases, norms and hyper-connection biases perturbed."""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import jax.numpy as jnp
import hf_parity

from easylm.deepseek_v4 import hf, model as v4_model
from easylm.deepseek_v4.family import FAMILY
from easylm.errors import UserError

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300


def _save(directory):
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(
        vocab_size=V, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=2, sliding_window=16, o_groups=2, o_lora_rank=8,
        # 16 indexer heads: a score of exactly 0 (all heads' relu 0), whose ties torch's
        # top-k orders its own way, is then improbable (V4 has 64).
        index_n_heads=16, index_head_dim=8, index_topk=3, max_position_embeddings=1024,
        num_nextn_predict_layers=0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("sinks", "position_bias", "base", "scale", "norm")):
                p.add_(0.3 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(5.0)
            if hasattr(layer.mlp.gate, "tid2eid"):
                layer.mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(4)[:2]
                                                          for _ in range(V)]))
            else:
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("deepseek_v4"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _rel(config, terms=PROMPT):
    """Relative error of the logits: per layer about 20 reductions in sequence (two
    hyper-connections' norm and projection each, q_a, its norm, q_b, the head norm, kv, its
    norm, the compressor's projection, gated sum and norm, the indexer's, scores, weighted
    sum, the two output projections, the router, gate/up, down) over at most max(D, keys)
    terms, then the head."""
    return fp32_rel(max(config.hidden_size, terms), 20 * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def test_config_json_and_counts_are_transformers(saved):
    _, model, config, _ = saved
    assert config.layer_kinds() == ("sliding_attention:hash_moe",
                                    "compressed_sparse_attention:moe",
                                    "heavily_compressed_attention:moe")
    assert (config.qk_rope_head_dim, config.compress_rate_csa, config.compress_rate_hca,
            config.hc_mult) == (8, 4, 8, 2)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(UserError, match="n_shared_experts=2 is not supported"):
        FAMILY.config_class.from_hf_config({"model_type": "deepseek_v4", "n_shared_experts": 2})


def test_logprobs_of_a_long_prompt_match_transformers(saved):
    """A full forward's log-probabilities of a 300-token prompt = transformers'; twins (the
    same tolerance): the indexer ignored (every visible entry kept), the hyper-connections
    collapsed to one stream (mean in, added out, no mixing)."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    lm = FAMILY.module_class
    assert_close(hf_parity.module_logprobs(lm(config), params, prompt), expected,
                 rel=atol, scale=1.0)
    assert_differs(hf_parity.module_logprobs(lm(config.replace(index_topk=10 ** 6)), params,
                                             prompt), expected, rel=atol, scale=1.0)

    def one_stream(x, fn, base, scale, c):
        C = x.shape[2]
        return (jnp.ones(x.shape[:3]), jnp.broadcast_to(jnp.eye(C), x.shape[:2] + (C, C)),
                x.mean(axis=2))

    original = v4_model.hyper_connection
    v4_model.hyper_connection = one_stream
    try:
        collapsed = hf_parity.module_logprobs(lm(config), params, prompt)
    finally:
        v4_model.hyper_connection = original
    assert_differs(collapsed, expected, rel=atol, scale=1.0)


def test_serving_is_refused_in_one_line(saved):
    _, _, config, params = saved
    with pytest.raises(UserError, match="decoding with a cache .* is not built"):
        hf_parity.served_logprobs(FAMILY.bind(config), params, _prompt(20))


@pytest.mark.extended  # ~300 s on 2 shared cores: the command compiles the 3 layers twice
def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    directory, model, config, _ = saved
    hf_parity.check_training_command(FAMILY, directory, model, tmp_path, _rel(config, 32),
                                     "DeepseekV4ForCausalLM")


def test_export_loads_in_transformers_and_equals_the_directory(tmp_path, saved):
    _, model, config, params = saved
    hf_parity.check_export(FAMILY, model, config, params, tmp_path, "DeepseekV4ForCausalLM",
                           hf.load_hf_params)


def test_the_released_shape_counts_as_its_card():
    """DeepSeek-V4-Flash: 284B parameters, 13B active (the model card)."""
    config = FAMILY.from_preset("deepseek_v4_flash")
    assert round(config.num_parameters() / 1e9) == 284
    assert round(config.num_matmul_parameters() / 1e9) == 13
