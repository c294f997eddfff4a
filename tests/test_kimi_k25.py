"""Kimi K2.5's text model (`kimi_k25`: a DeepSeek-V3 text model beside a vision tower) read
by the deepseek_v3 family through hf::DIR, against transformers'
Kimi_K25ForConditionalGeneration on text: a tiny random directory saved by transformers
(fp32; MLA with a q latent, 2 expert groups, a dense first layer, the routers scaled 5x and
a random correction bias)."""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import jax.numpy as jnp
import hf_parity

from easylm.deepseek_v3 import hf
from easylm.deepseek_v3.family import FAMILY

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300


def _save(directory):
    torch.manual_seed(0)
    text = dict(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, max_position_embeddings=512, initializer_range=0.2,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.Kimi_K25Config(
        text_config=text, projection_hidden_size=32, tie_word_embeddings=False,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2))
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for layer in model.model.language_model.layers[1:]:
            layer.mlp.gate.weight.mul_(5.0)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("kimi"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _rel(config, terms=PROMPT):
    """Relative error of the logits: per layer 8 reductions in sequence (the q latent and
    its norm, q_b, the kv latent and its norm, kv_b, scores, their weighted sum, o; the
    router, gate/up, down) over at most max(D, F, keys) terms, then the head."""
    return fp32_rel(max(config.hidden_size, config.intermediate_size, terms),
                    11 * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def test_the_text_model_is_read_and_the_tower_left_out_in_one_line(tmp_path, capsys):
    _save(str(tmp_path))
    config, _ = hf.load_hf_params(str(tmp_path))
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "vision tower and its projector not loaded" in out, out
    assert (config.kv_lora_rank, config.n_group, config.tie_word_embeddings) == (32, 2, False)
    from easylm.models import registry

    assert registry.family_of(f"hf::{tmp_path}") == "deepseek_v3"


def test_served_logprobs_of_a_long_prompt_match_transformers(saved):
    """The engine's log-probabilities of a 300-token prompt = transformers' text-only
    forward of the multimodal model; twin: the routers' correction bias dropped."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    bound = FAMILY.bind(config)
    assert_close(hf_parity.served_logprobs(bound, params, prompt), expected, rel=atol, scale=1.0)
    unbiased = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "e_score_correction_bias" in str(p) else x, params)
    assert_differs(hf_parity.module_logprobs(FAMILY.module_class(config), unbiased, prompt),
                   expected, rel=atol, scale=1.0)


def test_served_greedy_tokens_equal_transformers_generate(saved):
    _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    """The train command on the kimi_k25 directory; its export is the DeepSeek-V3 text model
    (DeepseekV3ForCausalLM), verified against transformers by the converter."""
    directory, model, config, _ = saved
    hf_parity.check_training_command(FAMILY, directory, model, tmp_path, _rel(config, 32),
                                     "DeepseekV3ForCausalLM")


def test_export_is_the_text_model_with_its_logits(tmp_path, saved):
    """The loaded parameters written back load in transformers as DeepseekV3ForCausalLM
    and compute the multimodal model's text logits; read back, bit for bit."""
    from easylm.models.hf_checkpoint import write_safetensors

    _, model, config, params = saved
    write_safetensors(FAMILY.hf.write_params(params, config), str(tmp_path))
    config.to_hf_config().save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    ids = np.asarray([_prompt(30, 8)])
    ref = hf_parity.logits_of(model, ids)
    assert_close(hf_parity.logits_of(back.eval(), ids), ref, _rel(config, 30))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf.load_hf_params(str(tmp_path))[1])):
        np.testing.assert_array_equal(a, b)
