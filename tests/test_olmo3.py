"""The olmo3 family against transformers' Olmo3ForCausalLM: a tiny random directory saved
by transformers (fp32; 3 sliding layers with a window of 8 below every prompt, then a
global one with YaRN, each kind its own rotary base; q/k/v/o biases; perturbed norms and
biases) read through hf::DIR."""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax.linen as nn
import jax
import hf_parity

from easylm.models.decoder import Attention, GatedMLP
from easylm.olmo3 import hf
from easylm.olmo3.family import FAMILY
from easylm.olmo3.model import DecoderLayer, Olmo3ForCausalLM

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300


def _save(directory):
    torch.manual_seed(0)
    config = transformers.Olmo3Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, attention_bias=True,
        max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0,
                                            "factor": 4.0, "attention_factor": 1.1,
                                            "original_max_position_embeddings": 64},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    model = transformers.Olmo3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("olmo3"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _rel(config, terms=PROMPT):
    """Relative error of the logits (of their largest magnitude): per layer 8 reductions in
    sequence (q/k/v, the q and k norms over all heads, scores, their weighted sum, o, the
    post-attention norm, gate/up, down, the post-MLP norm: 8 deep, the norms beside the
    projections), then the head, each over at most max(D, F, keys) terms."""
    return fp32_rel(max(config.hidden_size, config.intermediate_size, terms),
                    8 * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


class _PreNormLayer(DecoderLayer):
    """The negative twin of post-norm: the same norms read each sublayer's input (LLaMA's
    order) instead of its output."""

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        cos, sin, mask, window = context
        kw = dict(config=c, dtype=self.dtype, param_dtype=self.param_dtype,
                  norm_class=self.norm_class)
        h, cache = Attention(**kw, qkv_bias=True, out_bias=True, qk_norm_over_heads=True,
                             name="self_attn")(
            self.norm("post_attention_layernorm")(x), cos, sin, mask, window, positions, cache)
        x = x + h
        return x + GatedMLP(**kw, name="mlp")(self.norm("post_feedforward_layernorm")(x)), cache


class _PreNorm(Olmo3ForCausalLM):
    layer = _PreNormLayer


def test_served_logprobs_of_a_long_prompt_match_transformers(saved):
    """The engine's log-probabilities of a 300-token prompt (far past the window of 8) =
    transformers', per token (measured 1e-5 of a tolerance of 1.1e-3). Twins (full
    forwards, the same tolerance): the window ignored, YaRN ignored, the sliding layers
    rotated by the global base, the norms read before each sublayer instead of after."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    # A log-probability moves by at most twice the largest logit error.
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    served = hf_parity.served_logprobs(FAMILY.bind(config), params, prompt)
    assert_close(served, expected, rel=atol, scale=1.0)
    logprobs = lambda module: hf_parity.module_logprobs(module, params, prompt)
    for twin in (config.replace(sliding_window=1000), config.replace(rope_type="default"),
                 config.replace(sliding_rope_theta=config.rope_theta)):
        assert_differs(logprobs(Olmo3ForCausalLM(twin)), expected, rel=atol, scale=1.0)
    assert_differs(logprobs(_PreNorm(config)), expected, rel=atol, scale=1.0)


def test_served_greedy_tokens_equal_transformers_generate(saved):
    """12 greedy tokens over the K/V cache (chunked prefill, prompts past the window) =
    transformers' generate."""
    _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


def test_config_json_and_counts_are_transformers(saved):
    from easylm.errors import UserError

    _, model, config, _ = saved
    assert config.layer_kinds() == ("sliding_attention",) * 3 + ("full_attention",)
    assert (config.rope_type, config.rope_factor, config.rope_attention_factor,
            config.sliding_rope_theta) == ("yarn", 4.0, 1.1, 1000.0)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(UserError, match="rope type 'linear' is not implemented"):
        FAMILY.config_class.from_hf_config({"model_type": "olmo3", "rope_scaling": {
            "rope_type": "linear", "factor": 2.0}})
    with pytest.raises(UserError, match="hidden_act='gelu' is not supported"):
        FAMILY.config_class.from_hf_config({"model_type": "olmo3", "hidden_act": "gelu"})


def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    directory, model, config, _ = saved
    hf_parity.check_training_command(FAMILY, directory, model, tmp_path, _rel(config, 32),
                                     "Olmo3ForCausalLM")


def test_export_loads_in_transformers_and_equals_served(tmp_path, saved):
    """The export = the directory (hf_parity.check_export); scanned (3 sliding + 1 full as
    one block), the same tensors."""
    from easylm.models.family import layout

    _, model, config, params = saved
    hf_parity.check_export(FAMILY, model, config, params, tmp_path, "Olmo3ForCausalLM",
                           hf.load_hf_params)
    scanned = config.replace(scan_layers=True)
    stacked = layout(FAMILY, params, scanned)
    assert set(stacked["model"]["layers"]) == {"slot0", "slot1", "slot2", "slot3"}
    written = dict(FAMILY.hf.write_params(stacked, scanned))
    for name, tensor in FAMILY.hf.write_params(params, config):
        np.testing.assert_array_equal(written[name], tensor)


def test_lora_adapter_loads_in_peft_and_equals_the_merged_export(tmp_path, saved):
    directory, _, config, params = saved
    hf_parity.check_lora_peft(FAMILY, directory, config, params, tmp_path, _rel(config, 24),
                              hf_parity.PROJECTIONS)


def test_released_shapes_count_as_their_cards():
    """The presets at Olmo-3 7B and 32B (the model cards: 7B and 32B parameters)."""
    assert FAMILY.from_preset("olmo3_7b").num_parameters() == 7_298_011_136
    assert FAMILY.from_preset("olmo3_32b").num_parameters() == 32_233_522_176
