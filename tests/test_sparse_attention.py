"""DeepSeek sparse attention (easylm/models/sparse_attention.py) through its two families,
deepseek_v32 (DeepSeek-V3.2) and glm_moe_dsa (GLM-5), against transformers 5.25: tiny
random directories saved by transformers (fp32; MLA with a q latent, an indexer keeping
16 keys of a 300-token prompt, its k_norm perturbed, 2 expert groups, a dense first
layer, the routers scaled 5x and a random correction bias; GLM-5's third layer shares
the second's keys) read through hf::DIR.

Ties: the indexer's scores are sums over heads of w * relu(q.k), exactly 0 where every
head's q.k <= 0; torch.topk and lax.top_k break such ties differently. With 32 indexer
heads no boundary of these prompts falls on a tie (measured in float64: the smallest
relative gap at the top-k boundary is ~5e-6, well above the fp32 error of the scores);
with 8 heads and a perturbed k_norm bias, several did.
"""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import hf_parity

from easylm.models import registry

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300
TOPK = 16  # below the prompt, and below the greedy test's 13 + 12 tokens
ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM",
                 "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def _save(name, directory):
    torch.manual_seed(0)
    fields = dict(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                  topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                  max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, index_topk=TOPK, index_n_heads=32,
                  index_head_dim=16)
    if name == "glm_moe_dsa":
        model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(
            **fields, indexer_types=["full", "full", "shared"]))
    else:
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**fields))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "k_norm.weight" in key:
                p.add_(0.3 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.mul_(5.0)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8))
    model.eval().save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def saved(request, tmp_path_factory):
    name = request.param
    directory = str(tmp_path_factory.mktemp(name))
    model = _save(name, directory)
    family = registry.get(registry.family_of(f"hf::{directory}"))
    assert family.name == name
    config = family.hf.read_config(directory)
    return family, directory, model, config, family.hf.read_params(directory, config)


def _rel(config, terms=PROMPT):
    """Relative error of the logits: per layer 11 reductions in sequence (DeepSeek-V3's:
    the q latent and its norm, q_b, the kv latent and its norm, kv_b, scores, their
    weighted sum, o; the router, gate/up, down) over at most max(D, F, keys) terms, then
    the head. The indexer only chooses keys: with no tie at the boundary (module
    docstring) it adds no error."""
    return fp32_rel(max(config.hidden_size, config.intermediate_size, terms),
                    11 * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def test_served_logprobs_of_a_long_prompt_match_transformers(saved):
    """The engine's log-probabilities of a 300-token prompt (the indexer's keys cached) =
    transformers'; twin (a full forward, the same tolerance): the indexer ignored, every
    query attending to all its keys."""
    family, _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    assert_close(hf_parity.served_logprobs(family.bind(config), params, prompt), expected,
                 rel=atol, scale=1.0)
    dense = family.module_class(config.replace(index_topk=PROMPT))
    assert_differs(hf_parity.module_logprobs(dense, params, prompt), expected, rel=atol,
                   scale=1.0)


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_served_greedy_tokens_equal_transformers_generate(saved):
    family, _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, family.bind(config), params)


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    """Rows of 32 > the 16 keys kept: the loss is the sparse model's."""
    family, directory, model, config, _ = saved
    hf_parity.check_training_command(family, directory, model, tmp_path, _rel(config, 32),
                                     ARCHITECTURES[family.name])


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_export_loads_in_transformers_and_equals_served(tmp_path, saved):
    family, _, model, config, params = saved
    read = lambda d: (family.hf.read_config(d), family.hf.read_params(d, config))
    hf_parity.check_export(family, model, config, params, tmp_path, ARCHITECTURES[family.name],
                           read)


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_lora_through_the_command_exports_a_peft_adapter_equal_to_the_merged(tmp_path, saved,
                                                                          monkeypatch):
    """test_deepseek_v3's LoRA check on a DSA directory: 2 steps of `python -m easylm.train
    --lora.*` on MLA's projections, the MLPs and the routed experts (the indexer is not a
    target: it gets no gradient); the PEFT adapter on transformers' base = the merged export
    (tolerance as there); twin: the base alone."""
    from test_deepseek_v3 import MLA_TARGETS, lora_logprobs

    _, directory, _, config, _ = saved
    before, peft, merged = lora_logprobs(
        tmp_path, directory, MLA_TARGETS,
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
         "up_proj", "down_proj"], monkeypatch)
    rel = 2 * fp32_rel(max(config.hidden_size, config.intermediate_size, 40),
                       14 * config.num_hidden_layers + 1)
    scale = float(np.abs(merged).max())
    assert_close(peft, merged, rel, scale)
    assert_differs(before, merged, rel, scale)


@pytest.mark.parametrize("name,preset", [("deepseek_v32", "deepseek_v3_2"),
                                         ("glm_moe_dsa", "glm_5")])
def test_the_planners_few_layers_of_a_released_shape_keep_one_dense_layer(name, preset):
    """The planner traces 1 and 2 layers (`shard_variant`): with 3 dense layers first in
    the preset, the few layers are checked as 1 dense first, not refused (they were)."""
    config = registry.get(name).from_preset(preset)
    assert config.first_k_dense_replace == 3
    for layers in (1, 2):
        assert config.shard_variant(layers, 1).layer_kinds()[0] == "dense"
    assert config.shard_variant(2, 1).layer_kinds()[1] == "moe"
