import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from ml_collections import ConfigDict
from transformers import AutoModelForCausalLM

from easylm import model_flags
from easylm.errors import UserError
from easylm.llama.config import ARCHITECTURES, HF_DEFAULTS, LLAMA_PRESETS, LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.model import LLaMAForCausalLM


@pytest.mark.parametrize("name", sorted(LLAMA_PRESETS))
def test_parameter_count_matches_hf(name):
    config = LLaMAConfig.from_preset(name)
    # Scanned: the same parameters stacked, traced as one layer (seconds faster at 80 layers).
    shapes = jax.eval_shape(LLaMAForCausalLM(config.replace(scan_layers=True)).init_params,
                            jax.random.PRNGKey(0))
    ours = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
    with torch.device("meta"):  # shapes only, nothing allocated
        hf = AutoModelForCausalLM.from_config(config.to_hf_config())  # the variant's class
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
    # The LLaMA variants against their model cards' totals and non-embedding counts (Qwen
    # publish both; Mistral 7B: 7.24B), within the cards' last digit (they truncate:
    # Qwen2.5-7B's 7,615,616,512 is "7.61B").
    published = {"qwen2.5_0.5b": (0.49, 0.36), "qwen2.5_1.5b": (1.54, 1.31),
                 "qwen2.5_7b": (7.61, 6.53), "qwen3_0.6b": (0.6, 0.44), "qwen3_1.7b": (1.7, 1.4),
                 "qwen3_4b": (4.0, 3.6), "qwen3_8b": (8.2, 6.95), "mistral_7b": (7.24, None)}
    for name, (total, body) in published.items():
        config = LLaMAConfig.from_preset(name)
        embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
        for ours, card in ((billions[name], total), ((config.num_parameters() - embeddings) / 1e9, body)):
            digits = len(str(card).split(".")[1]) if card is not None else 0
            assert card is None or abs(ours - card) < 10 ** -digits, (name, ours, card)
    # Mixtures of experts against their cards' totals and active counts: Qwen3-30B-A3B
    # "30.5B, 3.3B activated", Mixtral-8x7B 46.7B, 12.9B active per token.
    for name, (total, active) in {"qwen3_30b_a3b": (30.5, 3.3),
                                  "mixtral_8x7b": (46.7, 12.9)}.items():
        config = LLaMAConfig.from_preset(name)
        # Within the cards' last digit (3,353.0M active is Qwen's "3.3B").
        assert abs(config.num_parameters() / 1e9 - total) < 0.1, name
        assert abs(config.num_active_parameters() / 1e9 - active) < 0.1, name
    # The benchmark shape: 1.18 B matmul parameters.
    assert round(LLaMAConfig.from_preset("llama_1b").num_matmul_parameters() / 1e9, 2) == 1.18


@pytest.mark.parametrize("name", ["debug", "llama2_70b", "llama3.2_1b", "qwen2.5_0.5b",
                                  "qwen3_8b", "mistral_7b"])
def test_hf_config_round_trip(name):
    config = LLaMAConfig.from_preset(name)
    assert LLaMAConfig.from_hf_config(config.to_hf_config()) == config
    assert LLaMAConfig.from_hf_config(config.to_hf_config().to_dict()) == config


@pytest.mark.parametrize("changes", [dict(attention_bias=True, mlp_bias=True),
                                     dict(model_type="qwen2", sliding_window=32),
                                     dict(model_type="qwen3", attention_bias=True, sliding_window=8)])
def test_switches_round_trip(changes):
    config = LLaMAConfig.from_preset("debug", **changes)
    hf = config.to_hf_config()
    assert hf.architectures == [ARCHITECTURES[config.model_type][0]]
    assert LLaMAConfig.from_hf_config(hf.to_dict()) == config


def test_qwen_config_json_as_transformers_4_wrote_it():
    # Qwen2.5-0.5B's config.json (transformers 4.43): rope_theta at the top level, a
    # sliding window that use_sliding_window switches off.
    legacy = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
                  hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  max_window_layers=21, rope_theta=1000000.0, rms_norm_eps=1e-06,
                  sliding_window=32768, use_sliding_window=False, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151643, hidden_act="silu")
    assert LLaMAConfig.from_hf_config(legacy) == LLaMAConfig.from_preset("qwen2.5_0.5b")
    # The same with every layer sliding (max_window_layers 0) has the window.
    sliding = LLaMAConfig.from_hf_config({**legacy, "use_sliding_window": True, "max_window_layers": 0})
    assert sliding.sliding_window == 32768


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
    flags = model_flags.flag_config(FAMILY, "llama2_7b")
    flags.num_hidden_layers = 4
    config = model_flags.model_config(FAMILY, ConfigDict(dict(llama=flags)))
    assert config.num_hidden_layers == 4 and config.rms_norm_eps == 1e-5
    assert set(flags.keys()) == {"base_model"} | {f.name for f in dataclasses.fields(LLaMAConfig)}


def test_unknown_preset_is_one_clear_error():
    with pytest.raises(UserError, match=r"unknown llama preset 'llama4_8b'; known presets: debug, embedded, llama_1b"):
        LLaMAConfig.from_preset("llama4_8b")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "--llama.num_key_value_heads=4 must divide num_attention_heads=6"),
        (dict(attention="flash"), "llama.attention='flash' is not one of auto, xla, dot_product, cudnn"),
        (dict(remat_policy="full"), "llama.remat_policy='full' is not one of none"),
        (dict(hidden_size=0), "llama.hidden_size must be >= 1, got 0"),
        (dict(hidden_sise=8), "unknown llama config field"),
        (dict(model_type="gemma"), "llama.model_type='gemma' is not one of llama, qwen2, qwen3, mistral"),
        (dict(sliding_window=16), "llama.sliding_window=16 is not part of model_type 'llama' "
                                  r"\(transformers' LlamaForCausalLM has no such switch\); it is "
                                  "part of qwen2, qwen3, mistral"),
        (dict(model_type="qwen3", mlp_bias=True), "llama.mlp_bias=True is not part of model_type 'qwen3'"),
        (dict(model_type="mistral", sliding_window=-1), "llama.sliding_window must be >= 0"),
    ],
)
def test_bad_fields(overrides, message):
    with pytest.raises(UserError, match=message):
        LLaMAConfig.from_preset("debug", **overrides)


def test_non_llama_hf_config_rejected():
    with pytest.raises(UserError, match="model_type 'gemma' is not a LLaMA variant "
                                        r"\(supported: llama, qwen2, qwen3, mistral, smollm3, qwen3_moe, "
                                        r"mixtral\)"):
        LLaMAConfig.from_hf_config(dict(model_type="gemma", vocab_size=8, hidden_size=8,
                                        intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=1))


# ---------------------------------------------- config.json read as transformers reads it

_HF_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
               "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig",
               "smollm3": "SmolLM3Config"}


def _hf_class(model_type):
    import transformers

    return getattr(transformers, _HF_CLASSES[model_type])


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_hf_defaults_are_the_transformers_class_defaults(model_type):
    class_defaults = {f.name: f.default for f in dataclasses.fields(_hf_class(model_type))}
    ours = HF_DEFAULTS[model_type]
    assert {name: class_defaults.get(name, ours[name]) for name in ours} == ours


class _Recording(dict):
    """A config.json dict that notes every key read from it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def _saved_config_json(config, tmp_path, **changes):
    """config.json as transformers saves `config`'s variant, with `changes` on top."""
    config.to_hf_config().save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        return {**json.load(f), **changes}


# Each variant as its saved config.json, every value read off its class default where the
# variant has that field (so that a dropped key changes something); Qwen also without
# layer_types, as transformers 4 wrote it (then max_window_layers decides).
_SAVED = {
    "llama": dict(changes=dict(attention_bias=True, mlp_bias=True, head_dim=32,
                               tie_word_embeddings=True, pad_token_id=0, bos_token_id=5,
                               eos_token_id=6, rms_norm_eps=1e-5, max_position_embeddings=64)),
    "mistral": dict(changes=dict(model_type="mistral", sliding_window=12, num_key_value_heads=2)),
    "qwen2": dict(changes=dict(model_type="qwen2", sliding_window=12, num_key_value_heads=2)),
    "qwen3": dict(changes=dict(model_type="qwen3", sliding_window=12, head_dim=32)),
    "qwen2_legacy": dict(changes=dict(model_type="qwen2", sliding_window=12), drop=["layer_types"]),
    "qwen3_moe": dict(changes=dict(model_type="qwen3_moe", sliding_window=12, head_dim=32,
                                   num_experts=4, num_experts_per_tok=3,
                                   moe_intermediate_size=24, norm_topk_prob=True,
                                   output_router_logits=True, router_aux_loss_coef=0.01)),
    "mixtral": dict(changes=dict(model_type="mixtral", sliding_window=12, num_key_value_heads=2,
                                 num_experts=4, num_experts_per_tok=1, norm_topk_prob=True,
                                 output_router_logits=True, router_aux_loss_coef=0.01)),
}


@pytest.mark.parametrize("case", sorted(_SAVED))
def test_config_json_without_a_key_reads_as_transformers_reads_it(case, tmp_path):
    """Every key the reader reads, dropped from a saved config.json one at a time, gives
    the model transformers' class builds from the same file (read back through its full
    to_dict(), where every field is written). Fails on 4280dbe for Mistral's and Qwen's
    absent sliding_window (no window; transformers' 4096), Mistral's absent
    num_key_value_heads and max_position_embeddings, Qwen3's absent head_dim, Qwen's
    absent bos/eos ids, and every absent shape key (a KeyError there)."""
    spec = _SAVED[case]
    config = LLaMAConfig.from_preset("debug", **spec["changes"])
    saved = _saved_config_json(config, tmp_path)
    for key in spec.get("drop", []):
        del saved[key]
    recording = _Recording(saved)
    assert LLaMAConfig.from_hf_config(recording) == config
    keys = sorted((recording.read & set(saved)) - {"model_type"})
    assert {"vocab_size", "hidden_size", "num_key_value_heads", "rms_norm_eps"} <= set(keys)
    wrong = []
    for key in keys:
        without = {k: v for k, v in saved.items() if k != key}
        try:
            theirs = _hf_class(config.model_type).from_dict(without).to_dict()
        except Exception:  # transformers refuses the file (32 layers, 2 layer_types)
            continue
        if _outcome(without) != _outcome(theirs):
            wrong.append(key)
    assert wrong == []


def _outcome(hf: dict):
    """The config read, or the refusal (a default that does not fit the rest, e.g.
    Mistral's 8 kv heads beside 4 query heads, is refused either way)."""
    try:
        return LLaMAConfig.from_hf_config(hf)
    except (UserError, KeyError) as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("model_type, drop, extra", [
    ("mistral", "sliding_window", {}),
    ("qwen2", "sliding_window", dict(use_sliding_window=True, max_window_layers=0)),
    ("qwen3", "sliding_window", dict(use_sliding_window=True, max_window_layers=0)),
])
def test_absent_window_gives_transformers_logits_past_4096(model_type, drop, extra, tmp_path):
    """A config.json without `sliding_window` slides 4096 positions in transformers; so
    here, 4,200 positions in (the old reading, no window, is the negative twin)."""
    from llama_variants import hf_variant
    from numerics import assert_close, assert_differs, forward_rel

    from easylm.llama.hf import load_hf_params

    T = 4200
    config = LLaMAConfig.from_preset("debug", model_type=model_type, sliding_window=4096,
                                     max_position_embeddings=8192, vocab_size=64,
                                     num_hidden_layers=1, initializer_range=0.2)
    model = hf_variant(config)
    model.save_pretrained(tmp_path)
    saved = {**json.load(open(tmp_path / "config.json")), **extra}
    del saved[drop]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(saved, f)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (1, T))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(
            torch.tensor(ids)).logits.numpy()
    read, params = load_hf_params(str(tmp_path))
    assert read.sliding_window == 4096
    logits = LLaMAForCausalLM(read).apply({"params": params}, jnp.asarray(ids))
    rel = forward_rel(read, T)
    assert_close(logits[:, 4096:], expected[:, 4096:], rel)
    no_window = LLaMAForCausalLM(read.replace(sliding_window=0)).apply({"params": params},
                                                                        jnp.asarray(ids))
    assert_differs(no_window[:, 4096:], expected[:, 4096:], rel)
