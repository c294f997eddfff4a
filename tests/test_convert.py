"""HF <-> easylm converters: parity, exact round trips, input formats, bad input."""

import functools
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from llama_variants import VARIANTS as LLAMA_VARIANTS, hf_variant, variant_config
from numerics import assert_close, assert_differs, forward_rel
from safetensors.numpy import load_file
from transformers import LlamaForCausalLM as HFLlama

from easylm.llama.config import LLaMAConfig
from easylm import convert_easylm_to_hf as converter
from easylm.llama.family import FAMILY
from easylm.llama.hf import load_hf_params
from easylm.llama.model import LLaMAForCausalLM

export, load_checkpoint, verify = (functools.partial(f, FAMILY) for f in (
    converter.export, converter.load_checkpoint, converter.verify))

VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(rope_scaling_type="llama3", rope_original_max_position_embeddings=16,
                        rope_theta=500000.0),
}


def make_hf(directory, dtype=torch.float32, **overrides):
    config = LLaMAConfig.from_preset("debug", initializer_range=0.2, **overrides)
    torch.manual_seed(0)
    model = HFLlama(config.to_hf_config()).to(dtype).eval()
    model.save_pretrained(directory)
    return model


def run_cli(module, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", module, *flags], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_converted_logits_match_hf(tmp_path, variant):
    hf = make_hf(tmp_path / "hf", **VARIANTS[variant])
    config, params = load_hf_params(str(tmp_path / "hf"))
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 40))
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    logits = LLaMAForCausalLM(config).apply({"params": params}, jnp.asarray(ids))
    assert_close(logits, expected, forward_rel(config, 40))  # torch vs XLA: reordered sums


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cli_round_trips_are_exact(tmp_path, dtype):
    make_hf(tmp_path / "hf", dtype=dtype, tie_word_embeddings=True)
    result = run_cli("easylm.llama.convert_hf_to_easylm", f"--hf_model={tmp_path / 'hf'}",
                     f"--output_dir={tmp_path / 'ours'}")
    assert result.returncode == 0, result.stderr
    result = run_cli("easylm.llama.convert_easylm_to_hf", f"--load_checkpoint=params::{tmp_path / 'ours'}",
                     f"--output_dir={tmp_path / 'hf2'}", "--tokenizer=")
    assert result.returncode == 0, result.stderr
    assert "verify: max |logit difference| vs transformers" in result.stdout
    # HF -> ours -> HF reproduces the original tensors exactly (names, dtypes, bits).
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "hf2" / "model.safetensors")
    assert set(original) == set(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype
        np.testing.assert_array_equal(exported[name].view(np.uint8), tensor.view(np.uint8))
    # ours -> HF -> ours is bitwise identical.
    _, ours = load_checkpoint(f"params::{tmp_path / 'ours'}")
    _, again = load_hf_params(str(tmp_path / "hf2"))
    for a, b in zip(jax_leaves(ours), jax_leaves(again)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("variant", sorted(LLAMA_VARIANTS))
def test_variant_directories_convert_both_ways_exactly(tmp_path, variant):
    # A directory as transformers writes it for Qwen2, Qwen3, Mistral, LLaMA with biases:
    # read (config.json and tensors), our logits are HF's; written back, the tensors and
    # config.json are the original's and transformers loads it as the same model.
    config = variant_config(variant)
    hf = hf_variant(config)
    hf.save_pretrained(tmp_path / "hf")
    read, params = load_hf_params(str(tmp_path / "hf"))
    assert read == config
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    ours = LLaMAForCausalLM(read).apply({"params": params}, jnp.asarray(ids))
    rel = forward_rel(config, 32)
    assert_close(ours, expected, rel)
    export(params, read, str(tmp_path / "back"))
    original, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert set(original) == set(exported)
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name].view(np.uint8), tensor.view(np.uint8))
    written = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back")]
    assert written[0] == written[1]
    # verify(): transformers' AutoModelForCausalLM on the export, (2, 32) ids as above.
    scale = float(np.abs(expected).max())
    assert verify(params, read, str(tmp_path / "back")) <= rel * scale
    # Negative twin: the same tensors read as plain LLaMA (config.json's model_type lost).
    plain = config.replace(model_type="llama", attention_bias=False, mlp_bias=False,
                           sliding_window=0)
    wrong = LLaMAForCausalLM(plain).apply({"params": _without_variant_params(params)},
                                          jnp.asarray(ids))
    assert_differs(wrong, expected, rel)


def _without_variant_params(params):
    from flax import traverse_util

    flat = traverse_util.flatten_dict(params, sep="/")
    return traverse_util.unflatten_dict(
        {k: v for k, v in flat.items() if not k.endswith(("/bias", "q_norm/weight", "k_norm/weight"))},
        sep="/")


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_sharded_safetensors_and_bin_inputs(tmp_path):
    hf = make_hf(tmp_path / "hf")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) > 1
    os.makedirs(tmp_path / "bin")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    hf.config.save_pretrained(tmp_path / "bin")
    _, reference = load_hf_params(str(tmp_path / "hf"))
    for source in ("sharded", "bin"):
        _, params = load_hf_params(str(tmp_path / source))
        for a, b in zip(jax_leaves(reference), jax_leaves(params)):
            np.testing.assert_array_equal(a, b)


def test_export_is_sharded_with_an_index_and_verifies(tmp_path):
    make_hf(tmp_path / "hf")
    config, params = load_hf_params(str(tmp_path / "hf"))
    export(params, config, str(tmp_path / "out"), max_shard_gb=100e3 / 2**30)
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1
    # verify's sequences: (2, 32) random ids; its difference is of logits whose scale we
    # measure the same way.
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    scale = float(np.abs(LLaMAForCausalLM(config).apply({"params": params}, jnp.asarray(ids))).max())
    assert verify(params, config, str(tmp_path / "out")) <= forward_rel(config, 32) * scale


def _write_bad(tmp_path, case):
    directory = tmp_path / case
    if case == "no_config":
        os.makedirs(directory)
        return directory, "no config.json; expected a Hugging Face model directory"
    make_hf(directory)
    if case == "not_llama":
        config = json.loads((directory / "config.json").read_text())
        config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        (directory / "config.json").write_text(json.dumps(config))
        return directory, "model_type 'gpt2' / architectures ['GPT2LMHeadModel'] is not a LLaMA-like causal LM"
    tensors = load_file(directory / "model.safetensors")
    from safetensors.numpy import save_file

    if case == "missing_tensors":
        del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
        save_file(tensors, directory / "model.safetensors")
        return directory, "is missing 2 tensor(s): model.layers.1.mlp.up_proj.weight, model.norm.weight"
    if case == "bad_shape":
        config = json.loads((directory / "config.json").read_text())
        config["intermediate_size"] = 96
        (directory / "config.json").write_text(json.dumps(config))
        return directory, "tensor model.layers.0.mlp.down_proj.weight has shape (64, 128), but the config implies (64, 96)"
    if case == "pickle_bin":
        os.remove(directory / "model.safetensors")
        # A .bin whose unpickling would construct an arbitrary object.
        torch.save({"model.norm.weight": torch.ones(64), "extra": LLaMAConfig()}, directory / "pytorch_model.bin")
        return directory, "refused, it needs pickle globals beyond plain tensors"
    raise AssertionError(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no_config", "not_llama", "missing_tensors", "bad_shape", "pickle_bin"])
def test_bad_input_is_one_clear_line(tmp_path, case):
    source, message = _write_bad(tmp_path, case)
    out = tmp_path / "out"
    result = run_cli("easylm.llama.convert_hf_to_easylm", f"--hf_model={source}", f"--output_dir={out}")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_bad_flags_are_one_line(tmp_path):
    result = run_cli("easylm.llama.convert_hf_to_easylm", "--hf_model=x", "--output_dri=y")
    assert (result.returncode, result.stderr) == (
        2, "error: Unknown command line flag 'output_dri'. Did you mean: output_dir ?\n")
    result = run_cli("easylm.llama.convert_easylm_to_hf", "--load_checkpoint=params::x",
                     "--output_dir=y", "--max_shard_gb=big")
    assert result.returncode == 2
    assert result.stderr == "error: flag --max_shard_gb=big: could not convert string to float: 'big'\n"
    result = run_cli("easylm.llama.convert_easylm_to_hf", "--help")
    assert result.returncode == 0 and "--verify_tolerance=0.001" in result.stdout


# ------------------------------------------ damaged files, configs this model is not


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "model"
    make_hf(directory)
    return directory


def _flip(offset):
    def damage(path):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(data)
    return damage


def _config(**changes):
    def damage(directory):
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps(config))
    return damage


def _drop(key):
    def damage(directory):
        config = json.loads((directory / "config.json").read_text())
        del config[key]
        (directory / "config.json").write_text(json.dumps(config))
    return damage


SAFETENSORS = "model.safetensors"
DAMAGED = {
    # model.safetensors: an 8-byte header length, then the JSON header, then the data.
    "flipped_header_byte": (SAFETENSORS, _flip(20), "not a readable safetensors file "
                            "(Error while deserializing header: invalid UTF-8 in header"),
    "flipped_length": (SAFETENSORS, _flip(3), "not a readable safetensors file (Error while "
                       "deserializing header: header too large)"),
    "truncated": (SAFETENSORS, lambda p: os.truncate(p, os.path.getsize(p) // 2),
                  "not a readable safetensors file (Error while deserializing header: "
                  "incomplete metadata, file not fully covered)"),
    "random_bytes": (SAFETENSORS, lambda p: p.write_bytes(np.random.RandomState(0).bytes(1000)),
                     "not a readable safetensors file (Error while deserializing header: "),
    "empty": (SAFETENSORS, lambda p: p.write_bytes(b""), "not a readable safetensors file "
              "(Error while deserializing header: header too small)"),
    "config_is_a_list": ("config.json", lambda p: p.write_text("[1, 2]"),
                         "config.json: expected a JSON object of config fields, got a list"),
    "vocab_size_is_text": (".", _config(vocab_size="abc"),
                           "config.json: vocab_size must be an integer, got 'abc'"),
    # config.json says biases, the tensors have none.
    "attention_bias_without_its_tensors": (
        ".", _config(attention_bias=True), "is missing 8 tensor(s): "
        "model.layers.0.self_attn.k_proj.bias, model.layers.0.self_attn.o_proj.bias"),
    "mlp_bias_is_text": (".", _config(mlp_bias="yes"), "config.json: mlp_bias must be true or "
                         "false, got 'yes'"),
    "not_a_llama_variant": (
        ".", _config(model_type="phi3", architectures=["Phi3ForCausalLM"]),
        "model_type 'phi3' / architectures ['Phi3ForCausalLM'] is not a LLaMA-like "
        "causal LM (expected model_type and architecture: llama (LlamaForCausalLM), qwen2 "
        "(Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), mistral (MistralForCausalLM)"),
    # A mixture of experts not built is named by the field that differs (qwen2_moe: its
    # shared expert), not taken for something it is not.
    "qwen2_moe_shared_expert": (
        ".", _config(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                     shared_expert_intermediate_size=64),
        "model_type 'qwen2_moe' is not built: its shared_expert_intermediate_size"),
    # Named as the file has them: no `architectures` here, none made up (4280dbe named
    # ['LlamaForCausalLM']).
    "gpt_oss_without_architectures": (
        ".", lambda d: (_config(model_type="gpt_oss")(d), _drop("architectures")(d)),
        "hf: model_type 'gpt_oss' is not a LLaMA-like causal LM (expected"),
    "mistral_architecture_under_llama": (
        ".", _config(architectures=["MistralForCausalLM"]),
        "model_type 'llama' / architectures ['MistralForCausalLM'] is not a LLaMA-like"),
    # Qwen2/3: layers from max_window_layers on slide; some sliding and some not is refused.
    "qwen2_window_on_some_layers": (
        ".", _config(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                     use_sliding_window=True, sliding_window=16, max_window_layers=1),
        "config.json: use_sliding_window=true with max_window_layers=1 slides 1 of 2 layers: "
        "a window on some layers only is not supported"),
    "qwen3_layer_types_mixed": (
        ".", _config(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                     use_sliding_window=True, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"]),
        "config.json: use_sliding_window=true with layer_types slides 1 of 2 layers"),
    "sliding_window_is_text": (".", _config(model_type="mistral", sliding_window="16",
                                            architectures=["MistralForCausalLM"]),
                               "config.json: sliding_window must be an integer, got '16'"),
    "gelu": (".", _config(hidden_act="gelu"), "config.json: hidden_act 'gelu' is not supported"),
    # yarn as Qwen's long-context configs give it reads; other settings of it are refused
    "yarn_rope_mscale": (".", _config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768,
                                                    "mscale": 0.707}),
                         "rope_scaling.mscale=0.707 is not supported for a LLaMA variant's "
                         "yarn rope (supported: None)"),
    "partial_rotary": (".", _config(partial_rotary_factor=0.5), "config.json: "
                       "partial_rotary_factor=0.5 (rotary embeddings on part of each head) is "
                       "not supported by this LLaMA implementation"),
    "rope_scaling_over_rope_parameters": (  # HF reads rope_scaling where both are
        ".", _config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "config.json: rope type 'dynamic' is not supported (supported: default, llama3, "
        "yarn)"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_or_foreign_inputs_are_refused_in_one_line(hf_dir, tmp_path, case, capsys):
    import shutil

    from easylm.llama import convert_hf_to_easylm

    name, damage, message = DAMAGED[case]
    source = tmp_path / "hf"
    shutil.copytree(hf_dir, source)
    damage(source / name if name != "." else source)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        convert_hf_to_easylm.main(["convert", f"--hf_model={source}", f"--output_dir={out}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {source}") and message in err, err
    assert err.count("\n") == 1
    assert not out.exists() and os.listdir(tmp_path) == ["hf"]


def test_pad_and_unk_ids_survive_both_conversions(tmp_path):
    make_hf(tmp_path / "hf", pad_token_id=0, unk_token_id=3)
    config, params = load_hf_params(str(tmp_path / "hf"))
    assert (config.pad_token_id, config.unk_token_id) == (0, 3)
    export(params, config, str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["pad_token_id"], written["unk_token_id"]) == (0, 3)
    # A checkpoint that does not record them takes the exported tokenizer's.
    bare = config.replace(pad_token_id=None, unk_token_id=None)
    export(params, bare, str(tmp_path / "with_tokenizer"), tokenizer="embedded")
    written = json.loads((tmp_path / "with_tokenizer" / "config.json").read_text())
    assert written["pad_token_id"] == 0  # the embedded tokenizer's <pad>


# ------------------------------------ the generic commands, for every family

def _assert_same_tensors(before_dir, after_dir):
    from easylm.models.hf_checkpoint import HFTensors

    before, after = HFTensors(str(before_dir)), HFTensors(str(after_dir))
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        assert before[name].tobytes() == after[name].tobytes(), name


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_generic_commands_round_trip_each_family_bitwise(tmp_path, family, capsys):
    # python -m easylm.convert_hf_to_easylm / convert_easylm_to_hf with no --family: the
    # family comes from config.json's model_type, then from the checkpoint's metadata.
    from easylm import convert_hf_to_easylm
    from easylm.runtime import checkpoint

    if family == "llama":
        make_hf(tmp_path / "hf", tie_word_embeddings=True)
    else:
        from gemma_utils import hf_model, tiny_config

        hf_model(tiny_config(num_hidden_layers=2)).save_pretrained(tmp_path / "hf")
    convert_hf_to_easylm.main(["convert", f"--hf_model={tmp_path / 'hf'}",
                               f"--output_dir={tmp_path / 'ours'}"])
    assert checkpoint.read_metadata(str(tmp_path / "ours"))["model"] == family
    converter.main(["convert", f"--load_checkpoint=params::{tmp_path / 'ours'}",
                    f"--output_dir={tmp_path / 'back'}"])
    assert "verify: max |logit difference| vs transformers" in capsys.readouterr().out
    _assert_same_tensors(tmp_path / "hf", tmp_path / "back")


def _hf_dir_of(family: str, directory):
    """A tiny HF directory of `family` whose layers do not fill a whole number of scanned
    patterns where the family has one (Gemma: sliding, global, sliding; gpt-oss: the
    same), so that the export unstacks the pattern's slots and a tail layer."""
    if family == "llama":
        make_hf(directory, num_hidden_layers=3)
    elif family == "gemma":
        from gemma_utils import hf_model, tiny_config

        hf_model(tiny_config(num_hidden_layers=3, sliding_window_pattern=2)).save_pretrained(
            directory)
    else:
        from test_gpt_oss import hf_model, tiny_config

        hf_model(tiny_config()).save_pretrained(directory)


@pytest.mark.parametrize("family", ["llama", "gemma", "gpt_oss"])
def test_a_scanned_checkpoint_of_each_family_exports_bitwise(tmp_path, family, capsys):
    # A --<family>.scan_layers=True run saves its layers stacked (a pattern of kinds: one
    # slot per kind, then the tail): the exporter writes them one by one, as they came.
    from easylm.convert_hf_to_easylm import metadata_for
    from easylm.models import registry
    from easylm.models.family import layout
    from easylm.runtime.checkpoint import save_params

    _hf_dir_of(family, tmp_path / "hf")
    kind = registry.get(family)
    config = kind.hf.read_config(str(tmp_path / "hf"))
    params = kind.hf.read_params(str(tmp_path / "hf"), config, "keep")
    scanned = config.replace(scan_layers=True)
    stacked = layout(kind, params, scanned)
    assert "0" not in stacked["model"]["layers"]  # stored stacked, as a scanned run saves
    save_params(str(tmp_path / "ours"), stacked, metadata_for(kind, scanned, "test"))
    converter.main(["convert", f"--load_checkpoint=params::{tmp_path / 'ours'}",
                    f"--output_dir={tmp_path / 'back'}"])
    assert "verify: max |logit difference| vs transformers" in capsys.readouterr().out
    _assert_same_tensors(tmp_path / "hf", tmp_path / "back")


@pytest.mark.parametrize("argv, message", [
    (["--family=gpt2"], "--family='gpt2' is not one of llama, gemma"),
    ([], "model_type 'gpt2' is not one easylm reads"),
])
def test_generic_commands_refuse_an_unknown_family_in_one_line(tmp_path, argv, message):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    result = run_cli("easylm.convert_hf_to_easylm", f"--hf_model={tmp_path / 'hf'}",
                     f"--output_dir={tmp_path / 'out'}", *argv)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    result = run_cli("easylm.convert_easylm_to_hf", f"--load_checkpoint=params::{tmp_path}",
                     f"--output_dir={tmp_path / 'back'}", *argv)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr


# Extended (20.7 s of CI's summed time): in CI a Gemma LoRA run's adapter and merged
# exports give PEFT's logits (tests/test_gemma_cli.py::test_a_lora_run_exports_a_peft_
# adapter_and_a_merged_model), and the generic exporter's merged tensors are the source's
# bit for bit where no adapter reaches (tests/test_lora_train.py::test_merged_export_is_
# peft_on_the_source_base, LLaMA). What only this adds: that tensor check on Gemma.
@pytest.mark.extended
def test_a_gemma_lora_run_exports_merged_as_peft_merges(tmp_path, capsys):
    # A LoRA run on a Gemma directory (the generic trainer), then the generic exporter's
    # --lora_mode=adapter and merged: the merged tensors are PEFT's merge_and_unload of the
    # adapter on the same base (adapted kernels within fp32 rounding of the r-term sum,
    # every other tensor bit for bit).
    from gemma_utils import hf_model, tiny_config
    from numerics import EPS32
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from easylm import train
    from easylm.data.tokenizer import load_tokenizer
    from easylm.models.hf_checkpoint import HFTensors

    hf_dir, rank, alpha = tmp_path / "hf", 4, 8.0
    hf_model(tiny_config(num_hidden_layers=2)).save_pretrained(hf_dir)
    load_tokenizer("embedded").save_pretrained(hf_dir)
    train.main(["train", f"--load_checkpoint=hf::{hf_dir}", f"--tokenizer={hf_dir}",
                "--total_steps=3", "--train_dataset.json_dataset.seq_length=32",
                "--train_dataset.json_dataset.batch_size=4", "--compilation_cache_dir=",
                f"--logger.output_dir={tmp_path / 'runs'}", "--dtype=fp32", "--mesh_dim=1,1,-1",
                "--optimizer.adamw_optimizer.lr=1e-2",
                "--optimizer.adamw_optimizer.lr_warmup_steps=1",
                f"--lora.rank={rank}", f"--lora.alpha={alpha:g}"])
    final = capsys.readouterr().out.split("checkpoint: ")[1].split()[0]
    for mode in ("adapter", "merged"):
        converter.main(["convert", f"--load_checkpoint=params::{final}",
                        f"--output_dir={tmp_path / mode}", f"--lora_mode={mode}"])
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    theirs = {name: tensor.numpy() for name, tensor in PeftModel.from_pretrained(
        base, tmp_path / "adapter").merge_and_unload().state_dict().items()}
    ours, original = HFTensors(str(tmp_path / "merged")), HFTensors(str(hf_dir))
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(name for name in theirs if name in original)
    adapted = [name for name in ours if ours[name].tobytes() != original[name].tobytes()]
    assert len(adapted) == 2 * 7  # q k v o gate up down, in each of the two layers
    for name in ours:
        if name not in adapted:
            assert ours[name].tobytes() == theirs[name].tobytes(), name
            continue
        # W + s·Σ_r b_i a_i: a reordered r-term sum moves it by at most r·eps·s·Σ|b_i a_i|,
        # the add by one more rounding of the result.
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = (adapter[f"{module}.lora_{x}.weight"] for x in "AB")
        terms = (alpha / rank) * (np.abs(b) @ np.abs(a))
        bound = (rank * terms + np.abs(original[name]) + terms).max() * EPS32
        assert np.abs(ours[name] - theirs[name]).max() <= bound, name
        # Negative twin: the base alone is not PEFT's merge.
        assert np.abs(original[name] - theirs[name]).max() > bound, name
