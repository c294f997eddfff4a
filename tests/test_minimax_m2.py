"""The minimax_m2 family against transformers' MiniMaxM2ForCausalLM: a tiny random
directory saved by transformers (fp32; partial rotary 0.5, q/k norms over all heads
perturbed, the routers scaled 5x and a random correction bias) read through hf::DIR."""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import jax.numpy as jnp
import hf_parity

from easylm.minimax_m2 import hf
from easylm.minimax_m2.family import FAMILY

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300


def _save(directory):
    torch.manual_seed(0)
    config = transformers.MiniMaxM2Config(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})
    model = transformers.MiniMaxM2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        for layer in model.model.layers:  # a router far from uniform, a bias that picks
            layer.mlp.gate.weight.mul_(5.0)
            layer.mlp.e_score_correction_bias.copy_(torch.randn(8))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("minimax_m2"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _rel(config, terms=PROMPT):
    """Relative error of the logits: per layer 9 reductions in sequence (q/k/v, the q and
    k norms over all heads, scores, their weighted sum, o, the router, gate/up, down, the
    weighted sum of the chosen experts) over at most max(D, keys) terms, then the head."""
    return fp32_rel(max(config.hidden_size, terms), 9 * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def _unbiased(params):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "e_score_correction_bias" in str(p) else x, params)


def test_config_json_and_counts_are_transformers(saved):
    from easylm.errors import UserError

    _, model, config, _ = saved
    assert (config.rotary_dim(), config.n_routed_experts, config.moe_intermediate_size,
            config.n_shared_experts) == (8, 8, 32, 0)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    for key, value in (("router_jitter_noise", 0.1), ("output_router_logits", True)):
        with pytest.raises(UserError, match=f"{key}={value!r} is not supported"):
            FAMILY.config_class.from_hf_config({"model_type": "minimax_m2", key: value})
    # The released files give rotary_dim (64 of 128) rather than partial_rotary_factor.
    released = FAMILY.config_class.from_hf_config({"model_type": "minimax_m2",
                                                   "rotary_dim": 64, "head_dim": 128})
    assert released.rotary_dim() == 64


def test_served_logprobs_of_a_long_prompt_match_transformers(saved):
    """The engine's log-probabilities of a 300-token prompt = transformers'; twins (full
    forwards, the same tolerance): the correction bias dropped, rotary on every dim."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    assert_close(hf_parity.served_logprobs(FAMILY.bind(config), params, prompt), expected,
                 rel=atol, scale=1.0)
    lm = FAMILY.module_class
    assert_differs(hf_parity.module_logprobs(lm(config), _unbiased(params), prompt), expected,
                   rel=atol, scale=1.0)
    assert_differs(hf_parity.module_logprobs(lm(config.replace(partial_rotary_factor=1.0)),
                                             params, prompt), expected, rel=atol, scale=1.0)


def test_served_greedy_tokens_equal_transformers_generate(saved):
    _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    directory, model, config, _ = saved
    hf_parity.check_training_command(FAMILY, directory, model, tmp_path, _rel(config, 32),
                                     "MiniMaxM2ForCausalLM")


def test_export_loads_in_transformers_and_equals_served(tmp_path, saved):
    _, model, config, params = saved
    hf_parity.check_export(FAMILY, model, config, params, tmp_path, "MiniMaxM2ForCausalLM",
                           hf.load_hf_params)


def test_lora_adapter_loads_in_peft_and_equals_the_merged_export(tmp_path, saved):
    """Adapters on q/k/v/o and the routed experts (PEFT's target_parameters)."""
    directory, _, config, params = saved
    hf_parity.check_lora_peft(FAMILY, directory, config, params, tmp_path, _rel(config, 24),
                              ["k_proj", "o_proj", "q_proj", "v_proj"])


def test_the_released_shape_counts_as_its_card():
    """MiniMax-M2: 230B parameters, 10B active (the model card)."""
    config = FAMILY.from_preset("minimax_m2")
    assert round(config.num_parameters() / 1e9) == 229
    assert round(config.num_matmul_parameters() / 1e9) == 10
