"""gpt-oss (easylm/gpt_oss/) against transformers' GptOssForCausalLM on the same weights:
logits, cached decoding past the window, HF -> easylm -> HF bit for bit, MXFP4 experts
dequantized as transformers does, config.json in both layouts. Each parity test keeps
negative twins: the same comparison fails without the sinks, the window, the router's
bias or YaRN.

Tolerance: per layer nine reductions in sequence (q/k/v, scores, their weighted sum, o,
the router, gate/up, down, the experts' weighted sum; the sink a term of the softmax's),
then the head; the widest over the width, the expert width, the experts or the keys
(`fp32_rel`). The top-k of random router weights has no near-ties at these sizes: both
sides route every token alike (a flip would move a logit by O(1), far past it).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util
from numerics import assert_close, assert_differs, fp32_rel

from easylm.errors import UserError
from easylm.gpt_oss import hf
from easylm.gpt_oss.config import GptOssConfig, from_hf_dict
from easylm.gpt_oss.family import FAMILY
from easylm.gpt_oss.model import GptOssForCausalLM
from easylm.models import registry
from easylm.models.hf_checkpoint import HFTensors

SEQ = 16


def tiny_config(**overrides) -> GptOssConfig:
    """Three layers (sliding, full, sliding) with a window of 4 in 16 positions, YaRN
    over an original context of 8 (so that its blend and attention factor both show), and
    the SwiGLU clamped at 1 (so that the clamp bites); widths of 32, MXFP4's group."""
    fields = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  rope_factor=4.0, rope_original_max_position_embeddings=8,
                  max_position_embeddings=32, swiglu_limit=1.0, initializer_range=0.2)
    return FAMILY.from_preset("debug", **{**fields, **overrides})


def tolerance(config: GptOssConfig) -> float:
    terms = max(config.hidden_size, config.intermediate_size, config.num_local_experts, SEQ)
    return fp32_rel(terms, 9 * config.num_hidden_layers + 1)


def hf_model(config: GptOssConfig, seed: int = 0):
    """A random transformers model of `config`: biases and sinks drawn wider than its
    init, so that a dropped bias or sink shows."""
    from transformers import GptOssForCausalLM as HFModel

    torch.manual_seed(seed)
    hf_config = config.to_hf_config()
    hf_config._attn_implementation = "eager"
    model = HFModel(hf_config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                parameter.normal_(0.0, 1.0)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids))).logits.numpy()


@pytest.fixture(scope="module")
def pair():
    config = tiny_config()
    model = hf_model(config)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, SEQ))
    params = hf.from_hf(model.state_dict(), config)
    return config, model, params, ids, hf_logits(model, ids)


def ours(config, params, ids):
    # Eagerly: after the first call each op's executable is cached, and a forward of
    # another config of the same shapes takes a tenth of a second, where a jit compiles
    # each config anew in seconds.
    return np.asarray(GptOssForCausalLM(config).apply({"params": params}, jnp.asarray(ids)))


def test_logits_equal_transformers(pair):
    config, _, params, ids, theirs = pair
    assert np.abs(theirs).max() > 1  # not a degenerate model whose logits are all near 0
    assert_close(ours(config, params, ids), theirs, tolerance(config))


def test_each_difference_from_llama_is_seen(pair):
    # Negative twins: without each of gpt-oss's parts the logits move far past the
    # tolerance, so the comparison above would have caught its loss.
    config, _, params, ids, theirs = pair
    rel = tolerance(config)
    flat = traverse_util.flatten_dict(params, sep="/")

    def without(suffix, value):
        return traverse_util.unflatten_dict(
            {k: (np.full_like(v, value) if k.endswith(suffix) else v) for k, v in flat.items()},
            sep="/")

    assert_differs(ours(config, without("sinks", -1e9), ids), theirs, rel)  # sinks dropped
    assert_differs(ours(config, without("router/bias", 0.0), ids), theirs, rel)
    assert_differs(ours(config.replace(sliding_window=SEQ), params, ids), theirs, rel)
    assert_differs(ours(config.replace(rope_type="default"), params, ids), theirs, rel)
    assert_differs(ours(config.replace(swiglu_limit=1e3), params, ids), theirs, rel)  # unclamped


def test_loss_with_the_aux_term_is_transformers_outputs_loss(pair):
    """GptOssForCausalLM with labels and output_router_logits: the mean next-token loss
    plus router_aux_loss_coef x load_balancing_loss_func; the twin leaves the term out."""
    from easylm.objectives.next_token import next_token_sums

    config, model, params, ids, theirs = pair
    with torch.no_grad():
        out = model(torch.from_numpy(ids), labels=torch.from_numpy(ids),
                    output_router_logits=True)
    batch = dict(input_tokens=jnp.asarray(ids),
                 target_tokens=jnp.asarray(np.concatenate([ids[:, 1:], ids[:, :1]], axis=1)),
                 loss_masks=jnp.asarray(np.arange(SEQ) < SEQ - 1, jnp.float32)[None].repeat(2, 0))
    atol = 2 * tolerance(config) * float(np.abs(theirs).max())  # a log-softmax, averaged
    sums = next_token_sums(FAMILY.bind(config.replace(output_router_logits=True)), params,
                           batch, None)
    assert abs(float(sums.total_mean()) - float(out.loss)) <= atol
    means = sums.means()  # what the train step logs: the total, the parts beside it
    assert abs(float(means["loss"]) - float(out.loss)) <= atol
    assert abs(float(means["aux_loss"]) - float(out.aux_loss)) <= atol
    assert abs(float(means["ce_loss"]) - float(out.loss)) > atol  # the CE alone is not it
    without = next_token_sums(FAMILY.bind(config), params, batch, None)
    assert abs(float(without.total_mean()) - float(out.loss)) > atol


def test_the_scanned_pattern_is_sliding_then_full(pair):
    config = pair[0]
    assert GptOssForCausalLM.period(config) == 2
    assert GptOssForCausalLM.period(config.replace(layer_types="full_attention," * 2 +
                                                   "full_attention")) == 1


def test_router_stats_are_sown_per_layer(pair):
    config, _, params, ids, _ = pair
    logits, state = GptOssForCausalLM(config).apply({"params": params}, jnp.asarray(ids),
                                                    mutable=["router"])
    stats = jax.tree.leaves(state["router"], is_leaf=lambda x: hasattr(x, "load"))
    assert len(stats) == config.num_hidden_layers
    for s in stats:
        assert s.logits.shape == (ids.size, config.num_local_experts)
        assert int(s.load.sum()) == ids.size * config.num_experts_per_tok


def test_cached_decoding_equals_the_full_forward_past_the_window(pair):
    # One token at a time to 16 positions (4 windows): every step's logits are the full
    # forward pass's at that position.
    config, _, params, ids, theirs = pair
    model = FAMILY.bind(config)
    cache = model.init_cache(2, SEQ + 4)
    def step(params, ids, positions, cache):
        out = forward(params, ids, positions, cache)
        return out.logits, out.cache

    forward = jax.jit(lambda params, ids, positions, cache: model.forward(params, ids, positions,
                                                                          cache=cache))
    steps = []
    for t in range(SEQ):
        logits, cache = step(params, jnp.asarray(ids[:, t:t + 1]), jnp.full((2, 1), t), cache)
        steps.append(np.asarray(logits))
    decoded = np.concatenate(steps, axis=1)
    rel = tolerance(config)
    assert_close(decoded, theirs, rel)
    # Negative twin: a cache that kept every key (no window) would give the wide model's.
    assert_differs(decoded, ours(config.replace(sliding_window=SEQ), params, ids), rel)


def test_hf_to_easylm_to_hf_is_bitwise(tmp_path, pair):
    config, model, _, _, _ = pair
    model.save_pretrained(tmp_path / "hf")
    assert registry.family_of(f"hf::{tmp_path / 'hf'}") == "gpt_oss"
    read, params = hf.load_hf_params(str(tmp_path / "hf"))
    assert read == config
    stored = HFTensors(str(tmp_path / "hf"))
    written = dict(hf.to_hf(params, read))
    assert sorted(written) == sorted(stored)
    for name, tensor in written.items():
        assert tensor.dtype == stored[name].dtype
        assert tensor.tobytes() == np.ascontiguousarray(stored[name]).tobytes(), name
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    back = read.to_hf_config().to_dict()
    for key in set(saved) - {"transformers_version", "dtype"}:
        assert back[key] == saved[key], key


# ------------------------------------------------------------------ MXFP4 checkpoints


def quantize_mxfp4(weight):
    """A (E, in, out) float tensor as MXFP4 (blocks (E, out, in/32, 16), scales (E, out,
    in/32)): per 32 inputs the power of two that brings the largest to at most 6, each
    value then the nearest e2m1 code, two codes a byte (the even one low)."""
    w = np.swapaxes(np.asarray(weight, np.float32), -1, -2)  # (E, out, in)
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 6.0))
    scaled = groups / np.exp2(exponent)[..., None]
    codes = np.abs(scaled[..., None] - hf.FP4_VALUES).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).astype(np.uint8)


@pytest.fixture(scope="module")
def mxfp4_dir(pair, tmp_path_factory):
    """The tiny model saved as the released checkpoints are: experts in MXFP4."""
    from safetensors.numpy import save_file

    config, model, _, _, _ = pair
    directory = tmp_path_factory.mktemp("mxfp4")
    model.save_pretrained(directory)
    tensors = dict(HFTensors(str(directory)))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensors.pop(name))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((directory / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(saved))
    return directory, tensors


def test_mxfp4_dequantizes_as_transformers(mxfp4_dir):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, tensors = mxfp4_dir
    blocks, scales = (tensors["model.layers.0.mlp.experts.down_proj_" + s]
                      for s in ("blocks", "scales"))
    expected = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                          dtype=torch.float32).numpy()
    ours_ = hf.dequantize_mxfp4(blocks, scales)
    assert ours_.shape == expected.shape and ours_.tobytes() == expected.tobytes()
    # Negative twin: the nibbles the other way round.
    swapped = (blocks >> 4) | (blocks << 4)
    assert not np.array_equal(hf.dequantize_mxfp4(swapped, scales), expected)


def test_an_mxfp4_checkpoint_loads_as_transformers_dequantized_model(pair, mxfp4_dir):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config, model, _, ids, _ = pair
    directory, tensors = mxfp4_dir
    read, params = hf.load_hf_params(str(directory))
    assert read == config
    # transformers' model with the experts transformers dequantizes: our logits.
    state = {k: v for k, v in model.state_dict().items()}
    for name in [n[:-len("_blocks")] for n in tensors if n.endswith("_blocks")]:
        blocks, scales = tensors[name + "_blocks"], tensors[name + "_scales"]
        state[name] = convert_moe_packed_tensors(torch.from_numpy(blocks),
                                                 torch.from_numpy(scales), dtype=torch.float32)
    dequantized = hf_model(config)
    dequantized.load_state_dict(state)
    theirs = hf_logits(dequantized, ids)
    assert_close(ours(config, params, ids), theirs, tolerance(config))
    # Negative twin: the unquantized weights compute other logits than the dequantized.
    assert_differs(hf_logits(model, ids), theirs, tolerance(config))


@pytest.mark.parametrize("part", ["_scales", "_blocks"])
def test_a_missing_mxfp4_half_is_named_as_in_the_files(pair, mxfp4_dir, part):
    config = pair[0]
    lost = "model.layers.1.mlp.experts.down_proj" + part
    tensors = {name: value for name, value in mxfp4_dir[1].items() if name != lost}
    with pytest.raises(UserError, match="missing 1 tensor") as error:
        hf.from_hf(hf.Mxfp4Tensors(tensors), config)
    assert str(error.value).endswith(lost)


# ------------------------------------------------------------------ config.json


def test_config_json_in_either_layout(tmp_path, pair):
    # 5.x: rope_parameters with rope_theta inside; 4.x (the released files): rope_theta at
    # the top and rope_scaling, with the fields transformers ignores.
    config = pair[0]
    five = config.to_hf_config().to_dict()
    assert from_hf_dict(five) == config
    four = {k: v for k, v in five.items() if k != "rope_parameters"}
    rope = dict(five["rope_parameters"])
    four.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, experts_per_token=2,
                initial_context_length=8)
    assert from_hf_dict(four) == config
    # A config.json without the rope or layer_types: GptOssConfig's defaults (yarn, 32x).
    bare = {k: v for k, v in four.items() if k not in ("rope_scaling", "rope_theta",
                                                        "layer_types")}
    default = from_hf_dict(bare)
    assert (default.rope_type, default.rope_factor, default.rope_theta) == ("yarn", 32.0, 150000.0)
    assert default.layer_kinds()[:2] == ("sliding_attention", "full_attention")


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu", "hidden_act='gelu' is not supported"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope type 'linear'"),
    ("quantization_config", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ("model_type", "qwen3_moe", "model_type 'qwen3_moe' is not gpt_oss"),
])
def test_what_this_model_would_compute_differently_is_one_line(tmp_path, pair, field, value,
                                                               message):
    saved = pair[0].to_hf_config().to_dict() | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=message) as error:
        hf.hf_tensors(str(tmp_path)) if field == "quantization_config" else \
            FAMILY.hf.read_config(str(tmp_path))
    assert "\n" not in str(error.value) and "config.json" in str(error.value)


def test_presets_have_the_published_parameter_counts():
    # gpt-oss-20b's model card: 20.9B parameters, 3.6B active a token.
    config = FAMILY.from_preset("gpt_oss_20b")
    assert round(config.num_parameters() / 1e9, 1) == 20.9
    assert round(config.num_active_parameters() / 1e9, 1) == 3.6
    shapes = jax.eval_shape(GptOssForCausalLM(FAMILY.from_preset("debug")).init_params,
                            jax.random.PRNGKey(0))
    leaves = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert leaves == FAMILY.from_preset("debug").num_parameters()
