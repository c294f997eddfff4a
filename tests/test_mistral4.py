"""Mistral Small 4's text model (`mistral4`: DeepSeek-V3's MLA and experts with a softmax
router and Llama 4's query scale) read by the deepseek_v3 family through hf::DIR, against
transformers' Mistral4ForCausalLM: a tiny random directory saved by transformers (fp32; a
q latent, YaRN over an original context of 64 so that the query scale steps up three times
in the prompt, 2 expert groups, a dense first layer, the routers scaled 5x)."""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_parity

from easylm.deepseek_v3 import hf
from easylm.deepseek_v3.family import FAMILY

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300


def _save(directory):
    torch.manual_seed(0)
    config = transformers.Mistral4Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                             original_max_position_embeddings=64, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                             llama_4_scaling_beta=0.5))
    model = transformers.Mistral4ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.mul_(5.0)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("mistral4"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _rel(config, terms=PROMPT):
    """Relative error of the logits: per layer 11 reductions in sequence (the q latent and
    its norm, q_b, the kv latent and its norm, kv_b, scores, their weighted sum, o; the
    router, gate/up, down) over at most max(D, F, keys) terms, then the head."""
    return fp32_rel(max(config.hidden_size, config.intermediate_size, terms),
                    11 * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def test_config_json_is_read_as_transformers_reads_it(saved):
    from easylm.models import registry

    directory, model, config, _ = saved
    assert registry.family_of(f"hf::{directory}") == "deepseek_v3"
    assert (config.model_type, config.llama_4_scaling_beta, config.moe().router) == (
        "mistral4", 0.5, "softmax")
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    released = FAMILY.from_preset("mistral_small_4")  # Mistral-Small-4-119B-2603
    assert round(released.num_parameters() / 1e9) == 119


def test_served_logprobs_of_a_long_prompt_match_transformers(saved):
    """The engine's log-probabilities of a 300-token prompt = transformers'; twin (a full
    forward, the same tolerance): Llama 4's query scale left out."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    assert_close(hf_parity.served_logprobs(FAMILY.bind(config), params, prompt), expected,
                 rel=atol, scale=1.0)
    unscaled = FAMILY.module_class(config.replace(llama_4_scaling_beta=0.0))
    assert_differs(hf_parity.module_logprobs(unscaled, params, prompt), expected, rel=atol,
                   scale=1.0)


def test_served_greedy_tokens_equal_transformers_generate(saved):
    _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


@pytest.mark.extended  # ~80 s on two cores: CI runs this module's parity tests
def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    directory, model, config, _ = saved
    hf_parity.check_training_command(FAMILY, directory, model, tmp_path, _rel(config, 32),
                                     "Mistral4ForCausalLM")


def test_export_loads_in_transformers_and_equals_served(tmp_path, saved):
    _, model, config, params = saved
    hf_parity.check_export(FAMILY, model, config, params, tmp_path, "Mistral4ForCausalLM",
                           hf.load_hf_params)


@pytest.mark.extended  # two train runs' compiles and peft: ~3 min on two shared cores
def test_lora_through_the_command_exports_a_peft_adapter_equal_to_the_merged(tmp_path, saved,
                                                                          monkeypatch):
    """test_deepseek_v3's LoRA check on a Mistral 4 directory (its tolerance: 14 reductions
    a layer with the adapters'); twin: the base alone."""
    from test_deepseek_v3 import MLA_TARGETS, lora_logprobs

    directory, _, config, _ = saved
    before, peft, merged = lora_logprobs(
        tmp_path, directory, MLA_TARGETS,
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
         "up_proj", "down_proj"], monkeypatch, transformers.Mistral4ForCausalLM)
    rel = 2 * fp32_rel(max(config.hidden_size, config.intermediate_size, 40),
                       14 * config.num_hidden_layers + 1)
    scale = float(np.abs(merged).max())
    assert_close(peft, merged, rel, scale)
    assert_differs(before, merged, rel, scale)
