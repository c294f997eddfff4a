"""The Gemma 3 model against transformers' Gemma3ForCausalLM on the same weights: logits,
cached decoding past the window, HF -> easylm -> HF bit for bit, config.json in both
layouts, sharded = one device. Each parity test keeps negative twins: the same
comparison fails when one of Gemma's switches is dropped."""

import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gemma_utils import SEQ, forward_rel, hf_logits, hf_model, params_of, tiny_config
from numerics import assert_close, assert_differs

from easylm.errors import UserError
from easylm.gemma.config import from_hf_dict
from easylm.gemma.family import FAMILY
from easylm.gemma.hf import load_hf_params, text_tower, to_hf
from easylm.gemma.model import GemmaForCausalLM, partition_rules
from easylm.models.hf_checkpoint import HFTensors
from easylm.objectives.next_token import next_token_sums
from easylm.runtime.sharding import (
    BATCH_AXES,
    init_sharded,
    make_mesh,
    match_partition_rules,
    named_shardings,
)


@pytest.fixture(scope="module")
def pair():
    config = tiny_config()
    model = hf_model(config)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, SEQ))
    return config, model, params_of(model, config), ids, hf_logits(model, ids)


@functools.cache
def _forward(config):
    return jax.jit(lambda params, ids, **kwargs: GemmaForCausalLM(config).apply(
        {"params": params}, ids, **kwargs))


def ours(config, params, ids, **kwargs):
    return np.asarray(_forward(config)(params, jnp.asarray(ids), **kwargs))


@pytest.mark.parametrize("attention", ["xla", "dot_product"])
def test_logits_equal_transformers(pair, attention):
    config, _, params, ids, theirs = pair
    assert np.abs(theirs).max() > 1  # not a degenerate model whose logits are all near 0
    assert_close(ours(config.replace(attention=attention), params, ids), theirs,
                 forward_rel(config, SEQ))


def test_each_switch_is_seen(pair):
    # Negative twins: without each of Gemma's differences from LLaMA the logits move far
    # beyond the tolerance, so the comparison above would have caught its loss.
    config, model, params, ids, theirs = pair
    rel = forward_rel(config, SEQ)
    for wrong in (dict(sliding_window=0),  # window off
                  dict(rope_local_base_freq=config.rope_theta),  # one rope base for all
                  dict(rope_scaling_factor=1.0),  # no linear scaling of the global layers
                  dict(query_pre_attn_scalar=float(config.head_dim)),  # 1/sqrt(H) scores
                  dict(layer_types="full_attention," * 3 + "full_attention")):  # no sliding
        assert_differs(ours(config.replace(**wrong), params, ids), theirs, rel)
    # RMSNorm as x * w (LLaMA's): our (1 + w) on weights one lower computes exactly that.
    minus_one = jax.tree_util.tree_map_with_path(
        lambda path, x: x - 1 if "norm" in jax.tree_util.keystr(path) else x, params)
    assert_differs(ours(config, minus_one, ids), theirs, rel)
    # q/k norm off, and the embedding unscaled: transformers' model without them.
    no_qk_norm = copy.deepcopy(model)
    for layer in no_qk_norm.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
    unscaled = copy.deepcopy(model)
    unscaled.model.embed_tokens.embed_scale.fill_(1.0)
    for twin in (no_qk_norm, unscaled):
        assert_differs(ours(config, params, ids), hf_logits(twin, ids), rel)


def test_cached_decoding_equals_the_full_forward_past_the_window(pair):
    # A 6-token prompt, then one token at a time to 40 positions, 5 windows: every
    # step's logits are the full forward pass's at that position.
    config, _, params, ids, theirs = pair
    model = FAMILY.bind(config)
    cache = model.init_cache(2, SEQ + 8)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    def step(params, ids, positions, cache):
        out = forward(params, ids, positions, cache)
        return out.logits, out.cache

    forward = jax.jit(lambda params, ids, positions, cache: model.forward(params, ids, positions,
                                                                          cache=cache))
    logits, cache = step(params, jnp.asarray(ids[:, :6]), positions, cache)
    steps = [np.asarray(logits)]
    for t in range(6, SEQ):
        logits, cache = step(params, jnp.asarray(ids[:, t:t + 1]), jnp.full((2, 1), t), cache)
        steps.append(np.asarray(logits))
    decoded = np.concatenate(steps, axis=1)
    rel = forward_rel(config, SEQ)
    assert_close(decoded, theirs, rel)
    # Negative twin: the cache without the window sees keys the full pass does not.
    cache = FAMILY.bind(config).init_cache(2, SEQ + 8)
    wide = FAMILY.bind(config.replace(sliding_window=0))
    positions = jnp.broadcast_to(jnp.arange(SEQ), (2, SEQ))
    full = np.asarray(wide.forward(params, jnp.asarray(ids), positions, cache=cache).logits)
    assert_differs(full[:, -1], theirs[:, -1], rel, np.abs(theirs).max())


def test_packed_documents_attend_within_their_own(pair):
    # Two documents in one row (segment ids, positions from 0 in each) = each alone.
    config, _, params, ids, _ = pair
    first, second = ids[0, :24], ids[1, :16]
    packed = np.concatenate([first, second])[None]
    segments = np.array([[1] * 24 + [2] * 16])
    positions = np.concatenate([np.arange(24), np.arange(16)])[None]
    both = ours(config, params, packed, positions=jnp.asarray(positions),
                segment_ids=jnp.asarray(segments))
    rel = forward_rel(config, SEQ)
    alone = np.concatenate([ours(config, params, first[None]),
                            ours(config, params, second[None])], axis=1)
    assert_close(both, alone, rel)


def test_hf_to_easylm_to_hf_is_bitwise(tmp_path, pair):
    config, model, _, _, _ = pair
    model.save_pretrained(tmp_path / "hf")
    read, params = load_hf_params(str(tmp_path / "hf"))
    assert read == config.replace(initializer_range=read.initializer_range)
    stored = HFTensors(str(tmp_path / "hf"))
    written = dict(to_hf(params, read))
    assert sorted(written) == sorted(stored)  # tied: no lm_head on either side
    for name, tensor in written.items():
        assert tensor.dtype == stored[name].dtype
        assert tensor.tobytes() == np.ascontiguousarray(stored[name]).tobytes(), name
    # The config transformers writes back is the one it wrote.
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    back = read.to_hf_config().to_dict()
    for key in set(saved) - {"transformers_version", "dtype"}:
        assert back[key] == saved[key], key


def test_config_json_in_either_layout_and_the_text_tower_of_gemma3(tmp_path):
    # 5.x: rope_parameters per layer type and layer_types; 4.x: rope_theta,
    # rope_local_base_freq, rope_scaling and sliding_window_pattern; the multimodal
    # config's text_config with Gemma3TextConfig's defaults for what it leaves out.
    new = tiny_config(layer_types="", sliding_window_pattern=3, num_hidden_layers=6)
    five = new.to_hf_config().to_dict()
    four = {k: v for k, v in five.items() if k not in ("rope_parameters", "layer_types")}
    four.update(rope_theta=new.rope_theta, rope_local_base_freq=new.rope_local_base_freq,
                rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window_pattern=3)
    assert from_hf_dict(five).layer_kinds() == from_hf_dict(four).layer_kinds() == (
        "sliding_attention", "sliding_attention", "full_attention") * 2
    strip = lambda c: c.replace(layer_types="", sliding_window_pattern=3)  # noqa: E731
    assert strip(from_hf_dict(five)) == strip(from_hf_dict(four)) == strip(new)
    text = from_hf_dict({"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}})
    assert text == FAMILY.from_preset("gemma3_4b", vocab_size=262208,
                                      max_position_embeddings=131072)
    # A multimodal directory's text tensors, in both layouts, the vision tower left out.
    tensors = {"model.language_model.norm.weight": 1, "language_model.model.embed_tokens.weight": 2,
               "language_model.lm_head.weight": 3, "vision_tower.vision_model.x.weight": 4,
               "model.multi_modal_projector.mm_input_projection_weight": 5}
    tower = text_tower(tensors)
    assert dict(tower) == {"model.norm.weight": 1, "model.embed_tokens.weight": 2,
                           "lm_head.weight": 3}


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "gemma2", r"model_type 'gemma2' is not a Gemma 3 model"),
    ("final_logit_softcapping", 30.0, r"final_logit_softcapping=30.0 is not supported"),
    ("attn_logit_softcapping", 50.0, r"attn_logit_softcapping=50.0 is not supported"),
    ("use_bidirectional_attention", True, r"use_bidirectional_attention=True is not supported"),
    ("hidden_activation", "gelu", r"hidden_activation='gelu' is not supported"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                            "rope_theta": 1e6}},
     r"rope_parameters gives the full_attention layers rope type 'yarn', which is not "
     r"implemented"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, r"rope_scaling gives the "
                                                              r"full_attention layers rope type"),
    ("layer_types", ["sliding_attention", "chunked_attention"], r"layer_types must be a list"),
    ("num_hidden_layers", "4", r"num_hidden_layers must be an integer, got '4'"),
])
def test_what_this_model_would_compute_differently_is_one_line(tmp_path, field, value, message):
    hf = tiny_config().to_hf_config().to_dict()
    hf[field] = value
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UserError, match=rf"^{tmp_path}/config.json: {message}") as error:
        FAMILY.hf.read_config(str(tmp_path))
    assert "\n" not in str(error.value)


def test_presets_have_the_published_parameter_counts():
    # Gemma 3's model cards: 270M (268M), 1B (1,000M); the 4B's text tower 3.88B of its 4.3B.
    counts = {name: FAMILY.from_preset(name).num_parameters()
              for name in ("gemma3_270m", "gemma3_1b", "gemma3_4b")}
    assert round(counts["gemma3_270m"] / 1e6) == 268
    assert round(counts["gemma3_1b"] / 1e6) == 1000
    assert round(counts["gemma3_4b"] / 1e7) == 388
    config = tiny_config()
    shapes = jax.eval_shape(GemmaForCausalLM(config).init_params, jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(shapes)) == config.num_parameters()


def _loss_and_grads(module, params, ids):
    def loss_fn(params):
        logp = jax.nn.log_softmax(module.apply({"params": params}, ids)[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    return jax.value_and_grad(loss_fn)(params)


def test_the_vocabulary_is_split_when_every_usual_mp_divides_it():
    from jax.sharding import PartitionSpec as P

    for vocab_size, spec in ((512, P("mp", "fsdp")), (262208, P("mp", "fsdp")),
                             (300, P(None, ("fsdp", "mp")))):
        config = tiny_config(vocab_size=vocab_size)
        shapes = jax.eval_shape(GemmaForCausalLM(config).init_params, jax.random.key(0))
        specs = match_partition_rules(partition_rules(config), shapes)
        assert specs["model"]["embed_tokens"]["embedding"] == spec


@pytest.fixture(scope="module")
def single_device():
    # 300 rows divide no 'mp' of 8: the rules split the width instead. Two layers, one
    # sliding and one global.
    config = tiny_config(vocab_size=300, initializer_range=0.1, num_hidden_layers=2)
    module = GemmaForCausalLM(config)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (8, 16))
    params = jax.device_put(module.init_params(jax.random.key(0)), jax.devices()[0])
    loss, grads = jax.jit(_loss_and_grads, static_argnums=0)(module, params, ids)
    return config, ids, loss, grads, float(np.abs(ours(config, params, ids)).max())


@pytest.mark.parametrize("mesh_dim", ["1,1,8", "2,2,2"])
def test_sharded_equals_single_device(single_device, mesh_dim):
    from jax.sharding import NamedSharding, PartitionSpec as P

    from easylm.runtime.sharding import path_to_string

    config, ids, loss, grads, scale = single_device
    module = GemmaForCausalLM(config)
    mesh = make_mesh(mesh_dim)
    rules = partition_rules(config)
    sharded = init_sharded(module.init_params, rules, mesh, jax.random.key(0))
    specs = match_partition_rules(rules, sharded)
    batch = jax.device_put(ids, NamedSharding(mesh, P(BATCH_AXES, None)))
    with jax.set_mesh(mesh):
        step = jax.jit(_loss_and_grads, static_argnums=0,
                       out_shardings=(NamedSharding(mesh, P()), named_shardings(mesh, specs)))
        loss2, grads2 = step(module, sharded, batch)
    # Sharded matmuls add their partial sums in other orders: the loss within twice the
    # largest logit error, the gradients within the backward pass's depth.
    rel = forward_rel(config, ids.shape[1])
    assert abs(float(loss2) - float(loss)) <= 2 * rel * scale
    for (path, g), g2 in zip(jax.tree_util.tree_leaves_with_path(grads),
                             jax.tree_util.tree_leaves(grads2)):
        assert_close(np.asarray(g2), np.asarray(g), 2 * rel, err_msg=path_to_string(path))


def test_the_chunked_loss_is_the_plain_loss(pair):
    # --gemma.loss_chunk_size: the head applied 16 positions at a time, the same sums.
    config, _, params, ids, theirs = pair
    ids = ids[:, :33]
    batch = {"input_tokens": jnp.asarray(ids[:, :-1]), "target_tokens": jnp.asarray(ids[:, 1:]),
             "loss_masks": jnp.ones(ids[:, 1:].shape, jnp.float32)}
    plain = jax.jit(functools.partial(next_token_sums, FAMILY.bind(config)))(
        params, batch, jax.random.key(0), None)
    chunked = jax.jit(functools.partial(next_token_sums,
                                        FAMILY.bind(config.replace(loss_chunk_size=16))))(
        params, batch, jax.random.key(0), None)
    # A sum of 64 token losses, each within twice the largest logit error.
    atol = ids[:, 1:].size * 2 * forward_rel(config, SEQ) * float(np.abs(theirs).max())
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(chunked)):
        assert abs(float(a) - float(b)) <= atol


def test_config_json_without_a_key_reads_as_transformers_reads_it(tmp_path):
    """Every key of a saved gemma3_text config.json, dropped one at a time, reads as
    Gemma3TextConfig reads the file (its full to_dict(), every field written)."""
    from transformers import Gemma3TextConfig

    tiny_config().to_hf_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())

    def outcome(hf):
        try:
            return from_hf_dict(hf)
        except UserError as e:
            return str(e)

    wrong = []
    for key in sorted(set(saved) - {"model_type"}):
        without = {k: v for k, v in saved.items() if k != key}
        try:
            theirs = Gemma3TextConfig.from_dict(without).to_dict()
        except Exception:  # transformers refuses the file (26 layers, 4 layer_types)
            continue
        if outcome(without) != outcome(theirs):
            wrong.append(key)
    assert wrong == []
