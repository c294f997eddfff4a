import dataclasses

import jax
import pytest
import torch
from ml_collections import ConfigDict
from transformers import LlamaForCausalLM as HFLlama

from easylm.errors import UserError
from easylm.llama.config import LLAMA_PRESETS, LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.model import LLaMAForCausalLM


@pytest.mark.parametrize("name", sorted(LLAMA_PRESETS))
def test_parameter_count_matches_hf(name):
    config = LLaMAConfig.from_preset(name)
    shapes = jax.eval_shape(LLaMAForCausalLM(config).init_params, jax.random.PRNGKey(0))
    ours = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
    with torch.device("meta"):  # shapes only, nothing allocated
        hf = HFLlama(config.to_hf_config())
    theirs = sum(p.numel() for p in hf.parameters())
    assert ours == theirs == config.num_parameters()


def test_published_shapes():
    # Spot checks against the published parameter counts.
    billions = {name: LLaMAConfig.from_preset(name).num_parameters() / 1e9 for name in LLAMA_PRESETS}
    assert round(billions["llama_7b"], 2) == 6.74
    assert round(billions["llama2_70b"], 1) == 69.0
    assert round(billions["llama3_8b"], 2) == 8.03
    assert round(billions["llama3.2_1b"], 2) == 1.24
    assert round(billions["llama3.2_3b"], 2) == 3.21
    # The benchmark shape: 1.18 B matmul parameters.
    assert round(LLaMAConfig.from_preset("llama_1b").num_matmul_parameters() / 1e9, 2) == 1.18


@pytest.mark.parametrize("name", ["debug", "llama2_70b", "llama3.2_1b"])
def test_hf_config_round_trip(name):
    config = LLaMAConfig.from_preset(name)
    assert LLaMAConfig.from_hf_config(config.to_hf_config()) == config
    assert LLaMAConfig.from_hf_config(config.to_hf_config().to_dict()) == config


def test_legacy_hf_config_dict():
    # config.json files written before transformers 5 keep rope settings at the top level.
    legacy = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  rope_theta=500000.0, tie_word_embeddings=True,
                  rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=8192))
    config = LLaMAConfig.from_hf_config(legacy)
    assert config.rope_theta == 500000.0 and config.rope_scaling_type == "llama3"
    assert config.rope_scaling_factor == 32.0 and config.head_dim == 64


def test_overrides_and_flags():
    config = LLaMAConfig.from_preset("llama3_8b", max_position_embeddings=4096)
    assert config.max_position_embeddings == 4096 and config.hidden_size == 4096
    flags = FAMILY.flag_config("llama2_7b")
    flags.num_hidden_layers = 4
    config = FAMILY.model_config(ConfigDict(dict(llama=flags)))
    assert config.num_hidden_layers == 4 and config.rms_norm_eps == 1e-5
    assert set(flags.keys()) == {"base_model"} | {f.name for f in dataclasses.fields(LLaMAConfig)}


def test_unknown_preset_is_one_clear_error():
    with pytest.raises(UserError, match=r"unknown llama preset 'llama4_8b'; known presets: debug, embedded, llama_1b"):
        LLaMAConfig.from_preset("llama4_8b")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "not a multiple of llama.num_key_value_heads=4"),
        (dict(attention="flash"), "llama.attention='flash' is not one of auto, xla, dot_product, cudnn"),
        (dict(remat_policy="full"), "llama.remat_policy='full' is not one of none"),
        (dict(hidden_size=0), "llama.hidden_size must be >= 1, got 0"),
        (dict(hidden_sise=8), "unknown llama config field"),
    ],
)
def test_bad_fields(overrides, message):
    with pytest.raises(UserError, match=message):
        LLaMAConfig.from_preset("debug", **overrides)


def test_non_llama_hf_config_rejected():
    with pytest.raises(UserError, match="model_type 'mistral' is not a LLaMA model"):
        LLaMAConfig.from_hf_config(dict(model_type="mistral", vocab_size=8, hidden_size=8,
                                        intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=1))
