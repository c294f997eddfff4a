"""The Qwen3.5 family (easylm/qwen3_5/) against transformers' Qwen3_5ForCausalLM: config.json
both ways, parameter counts, logits through `hf::DIR`, the written-back directory, the
scanned layers, prefill then decode with the DeltaNet state in the cache, packed
documents, and a training run through the command.

Tolerances (tests/numerics.py): a linear layer is about eight reductions in sequence
(tests/test_gated_deltanet.py), a full one seven (q/k/v, the q/k norms, scores, their
weighted sum, o_proj), each then the MLP's two and the two norms: at most twelve per
layer, and the head; the widest over max(D, F, T, N U) terms.
"""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from cli_utils import one_line_error
from numerics import assert_close, assert_differs, fp32_rel
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from easylm import train
from easylm.errors import UserError
from easylm.models import registry
from easylm.models.decoder import relayout
from easylm.qwen3_5.config import Qwen35Config, from_hf_dict
from easylm.qwen3_5.family import FAMILY
from easylm.serving.engine import Engine

T = 40  # past the conv window, under one DeltaNet chunk; the chunked form has its own tests
CONFIG = FAMILY.from_preset("debug")
REL = fp32_rel(max(CONFIG.hidden_size, CONFIG.intermediate_size, T, 4 * 16),
               12 * CONFIG.num_hidden_layers + 1)


def torch_model(config: Qwen35Config):
    """transformers' model of `config`, random, its norms away from their init (1 + w with
    w = 0 would hide a norm read as w) and a mild decay, so the state carries."""
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config.to_hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.1).log())
            elif name.endswith("dt_bias"):
                p.normal_()
            elif p.ndim == 2:
                p.normal_(0.0, 0.08)  # logits of a few units: a bug moves them visibly
    return model


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids))).logits.numpy()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(directory saved by transformers, its model, ids (2, T), its logits)."""
    directory = tmp_path_factory.mktemp("qwen3_5") / "hf"
    model = torch_model(CONFIG)
    model.save_pretrained(directory)
    ids = np.random.RandomState(0).randint(3, CONFIG.vocab_size, (2, T))
    return directory, model, ids, torch_logits(model, ids)


@pytest.fixture(scope="module")
def ours(hf):
    """(config, params) read through the family's adapter, the `hf::DIR` path."""
    config = FAMILY.hf.read_config(str(hf[0]))
    return config, FAMILY.hf.read_params(str(hf[0]), config)


@pytest.fixture(scope="module")
def forward():
    """One jitted forward per config (compiles dominate this file's time)."""
    cache = {}

    def run(config, params, ids, **kwargs):
        if config not in cache:
            cache[config] = jax.jit(FAMILY.bind(config).forward)
        return cache[config](params, jnp.asarray(ids), **kwargs)
    return run


def test_config_json_as_transformers_reads_it():
    """An empty config.json is transformers' defaults; a multimodal one is read for its
    text_config; the written config.json reads back to the same config."""
    ours = from_hf_dict({"model_type": "qwen3_5_text"}).to_hf_config().to_dict()
    theirs = Qwen3_5TextConfig().to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "layer_types",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "rope_parameters",
                "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps"):
        assert ours[key] == theirs[key], key
    text = json.loads(CONFIG.to_hf_config().to_json_string())
    assert from_hf_dict(text) == CONFIG
    multimodal = {"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text"}}
    assert from_hf_dict(multimodal) == CONFIG
    # The negative twin: another interval is read as such.
    assert from_hf_dict({**text, "layer_types": None, "full_attention_interval": 2}) != CONFIG


def test_what_it_would_compute_differently_is_one_line(tmp_path, capsys):
    for model_type in ("qwen3_5_moe_text", "qwen3_5_moe"):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        error = one_line_error(train.main, ["train", f"--load_checkpoint=hf::{tmp_path / model_type}"],
                               capsys)
        assert f"model_type {model_type!r} is not built: its num_experts" in error
    text = json.loads(CONFIG.to_hf_config().to_json_string())
    for key, value in (("hidden_act", "gelu"), ("attention_bias", True)):
        (tmp_path / "config.json").write_text(json.dumps({**text, key: value}))
        error = one_line_error(train.main, ["train", f"--load_checkpoint=hf::{tmp_path}"], capsys)
        assert f"{key}={value!r} is not supported" in error
    assert registry.family_of(f"hf::{tmp_path}") == "qwen3_5"


def test_a_multimodal_directory_is_read_for_its_text_model(tmp_path, hf, ours, capsys):
    """`qwen3_5`'s tensors under model.language_model.*, beside a vision tower and an MTP
    head that are not loaded (and the read says so): the text model's parameters."""
    from easylm.models.hf_checkpoint import HFTensors, write_safetensors

    tensors = HFTensors(str(hf[0]))
    renamed = [(name.replace("model.", "model.language_model.", 1), tensors[name])
               for name in tensors]
    extra = [("model.visual.patch_embed.weight", np.ones((2, 2), np.float32)),
             ("mtp.fc.weight", np.ones((2, 2), np.float32))]
    write_safetensors(renamed + extra, str(tmp_path))
    text = json.loads(CONFIG.to_hf_config().to_json_string())
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False}))
    assert registry.family_of(f"hf::{tmp_path}") == "qwen3_5"
    params = FAMILY.hf.read_params(str(tmp_path), FAMILY.hf.read_config(str(tmp_path)))
    assert "vision tower (model.visual.*) is not loaded" in capsys.readouterr().err
    jax.tree.map(np.testing.assert_array_equal, params, ours[1])
    del renamed[0]  # the negative twin: a tensor missing is named
    write_safetensors(renamed + extra, str(tmp_path))
    with pytest.raises(UserError, match="is missing 1 tensor"):
        FAMILY.hf.read_params(str(tmp_path), CONFIG)


def test_parameter_counts_match_transformers_and_the_cards(hf, ours):
    """num_parameters = transformers' model of the same config (the debug one built, the
    published ones on the meta device), and the published sizes round to their cards'
    (the text model alone: the cards' 9B and 27B include a ~0.4B vision tower)."""
    assert CONFIG.num_parameters() == sum(p.numel() for p in hf[1].parameters())
    assert CONFIG.num_parameters() == sum(x.size for x in jax.tree.leaves(ours[1]))
    for name, billions in (("qwen3_5_9b", 9), ("qwen3_5_27b", 27)):
        config = FAMILY.from_preset(name)
        with torch.device("meta"):
            model = Qwen3_5ForCausalLM(config.to_hf_config())
        assert config.num_parameters() == sum(p.numel() for p in model.parameters()), name
        assert round(config.num_parameters() / 1e9) == billions, config.num_parameters()
        assert config.num_matmul_parameters() < config.num_parameters()


def test_logits_match_transformers(hf, ours, forward):
    """hf::DIR read by the family = transformers' logits; a rotary over whole heads (not
    their first quarter) is caught by the same comparison."""
    _, _, ids, expected = hf
    config, params = ours
    assert config == CONFIG
    assert_close(forward(config, params, ids).logits, expected, REL)
    wrong = config.replace(partial_rotary_factor=1.0)
    assert_differs(forward(wrong, params, ids).logits, expected, REL)


def test_scanned_layers_equal_unscanned(hf, ours, forward):
    _, _, ids, expected = hf
    config, params = ours
    scanned = config.replace(scan_layers=True)
    logits = forward(scanned, relayout(params, True, 4), ids).logits
    assert_close(logits, expected, REL)


def test_written_back_directory_loads_in_transformers(tmp_path, hf, ours):
    from easylm.models.hf_checkpoint import write_safetensors

    _, _, ids, expected = hf
    config, params = ours
    write_safetensors(FAMILY.hf.write_params(params, config), str(tmp_path))
    config.to_hf_config().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    np.testing.assert_array_equal(torch_logits(model, ids), expected)  # the same tensors


def test_prefill_then_decode_equals_the_full_forward(hf, ours):
    """28 tokens prefilled (the DeltaNet layers' chunked form), then 12 decoded one at a
    time (their recurrent form, the state carried in the cache) = the full forward."""
    _, _, ids, expected = hf
    config, params = ours
    model = FAMILY.bind(config)
    step = jax.jit(model.forward)
    B, P = ids.shape[0], 28
    positions = np.broadcast_to(np.arange(T), ids.shape)
    out = step(params, jnp.asarray(ids[:, :P]), jnp.asarray(positions[:, :P]),
               cache=model.init_cache(B, T))
    logits, cache = [out.logits], out.cache
    for t in range(P, T):
        out = step(params, jnp.asarray(ids[:, t:t + 1]), jnp.asarray(positions[:, t:t + 1]),
                   cache=cache)
        logits.append(out.logits)
        cache = out.cache
    decoded = np.concatenate(logits, axis=1)
    assert_close(decoded, expected, REL)
    assert_differs(decoded[:, P:], expected[:, P - 1:T - 1], REL)  # one position off


def test_packed_documents_are_independent(hf, ours, forward):
    """A row packing two documents (segment ids 1, 2; positions restarting) = each alone:
    the DeltaNet state and conv window restart at the boundary; without the segment ids
    the second document reads the first."""
    _, _, ids, _ = hf
    config, params = ours
    a, b = ids[0, :15], ids[1, :T - 15]
    row = np.concatenate([a, b])[None]
    segments = np.array([[1] * 15 + [2] * (T - 15)])
    positions = np.concatenate([np.arange(15), np.arange(T - 15)])[None]
    packed = forward(config, params, row, positions=jnp.asarray(positions),
                     segment_ids=jnp.asarray(segments)).logits
    alone = forward(config, params, b[None]).logits
    assert_close(packed[:, 15:], alone, REL)
    leaked = forward(config, params, row, positions=jnp.asarray(positions)).logits
    assert_differs(leaked[:, 15:], alone, REL)


def test_training_through_the_command_lowers_the_loss(tmp_path, hf):
    """hf::DIR trained by `python -m easylm.train`. The warmup's first step has lr 0, so
    step 3's loss is the first after an update; measured: 6.435, 6.494, 6.144, where the
    same run at lr 0 gives 6.435, 6.494, 6.575 (step 3's batch is not the easier one)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(["train", f"--load_checkpoint=hf::{hf[0]}", "--tokenizer=embedded",
                    "--total_steps=3", "--log_freq=1", "--dtype=fp32", "--mesh_dim=1,1,-1",
                    "--train_dataset.json_dataset.seq_length=32",
                    "--train_dataset.json_dataset.batch_size=4", "--compilation_cache_dir=",
                    f"--logger.output_dir={tmp_path}", "--logger.experiment_id=run",
                    "--optimizer.adamw_optimizer.lr=1e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=1", "--save_model_freq=0"])
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
    assert len(losses) == 3 and np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_serving_is_refused_in_one_line(ours):
    """The engine would carry one request's DeltaNet state into the next slot's request:
    refused, naming why, before anything compiles."""
    config, params = ours
    with pytest.raises(UserError) as e:
        Engine({"batch_size": 2, "seq_length": 64}, FAMILY.bind(config), params)
    assert "\n" not in str(e.value) and "recurrent state" in str(e.value), e.value
