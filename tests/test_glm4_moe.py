"""The glm4_moe family against transformers' Glm4MoeForCausalLM: a tiny random directory
saved by transformers (fp32; partial rotary, q/k norms, attention biases, 2 expert
groups, a dense first layer, a router far from uniform and a correction bias far from
zero) read through hf::DIR."""

import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import jax.numpy as jnp

from easylm.glm4_moe import hf
from easylm.glm4_moe.family import FAMILY

PROMPT = 300


def _save(directory):
    torch.manual_seed(0)
    config = transformers.Glm4MoeConfig(
        vocab_size=512, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=True, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        initializer_range=0.2, num_nextn_predict_layers=1)
    model = transformers.Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
        for layer in model.model.layers[1:]:  # a router far from uniform, a bias that picks
            layer.mlp.gate.weight.mul_(5.0)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("glm"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _logprob_atol(config, logits, terms=1):
    """A log-probability moves by at most twice the largest logit error: fp32 sums in
    another order, per layer 8 reductions in sequence (q/k/v, q/k norms, scores, their
    weighted sum, o, the router, gate/up, down) over the widest of them, then the head."""
    rel = fp32_rel(max(config.hidden_size, config.intermediate_size, logits.shape[-2]),
                   8 * config.num_hidden_layers + 1)
    return terms * 2 * rel * float(np.abs(logits).max())


def _unbiased(params):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "e_score_correction_bias" in str(p) else x, params)


def test_config_json_is_read_as_transformers_reads_it(saved, capsys):
    directory, model, config, _ = saved
    from easylm.models import sigmoid_moe_decoder

    sigmoid_moe_decoder._TOLD.clear()  # said once a process: the module fixture was read before
    FAMILY.hf.read_config(directory)
    assert "1 multi-token-prediction layer(s) are not loaded" in capsys.readouterr().err
    assert (config.rotary_dim(), config.num_key_value_heads, config.use_qk_norm,
            config.attention_bias, config.n_group) == (8, 2, True, True, 2)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


def test_served_logprobs_of_a_long_prompt_match_transformers(saved):
    """The serving engine's log-probabilities of a 300-token prompt = transformers'; the
    twin ignores the correction bias."""
    from easylm.serving.engine import Engine

    _, model, config, params = saved
    tokens = np.random.default_rng(0).integers(0, 512, PROMPT + 1)
    with torch.no_grad():
        logits = model(torch.tensor(tokens[None, :-1])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[np.arange(PROMPT), tokens[1:]].numpy()
    atol = _logprob_atol(config, logits.numpy())

    def served(p):
        engine = Engine({"batch_size": 1, "seq_length": 512}, FAMILY.bind(config), p)
        return engine.score([tokens[:-1].tolist()], [tokens[1:].tolist()])[0][0]

    assert_close(served(params), expected, rel=atol, scale=1.0)
    assert_differs(served(_unbiased(params)), expected, rel=atol, scale=1.0)


def test_served_greedy_tokens_equal_transformers_generate(saved):
    """The engine over the K/V cache = transformers' generate, 12 greedy tokens."""
    _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


def test_export_reloads_in_transformers_with_the_same_logprobs(tmp_path, saved):
    from easylm.models.hf_checkpoint import write_safetensors

    _, model, config, params = saved
    write_safetensors(FAMILY.hf.write_params(params, config), str(tmp_path))
    config.to_hf_config().save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(back).__name__ == "Glm4MoeForCausalLM"
    ids = torch.tensor(np.random.default_rng(1).integers(0, 512, (2, 24)))
    with torch.no_grad():
        np.testing.assert_array_equal(back.eval()(ids).logits.numpy(), model(ids).logits.numpy())
    again = hf.load_hf_params(str(tmp_path))[1]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_lora_peft_adapter_on_transformers_base_equals_the_merged_export(tmp_path, saved,
                                                                        monkeypatch):
    """Adapters (drawn at 0.2, so that a misplaced one shows) on every default target:
    q/k/v/o, the dense and shared-expert MLPs, the routed experts (PEFT's
    target_parameters). Their PEFT directory loaded by peft onto transformers' base = the
    merged parameters written back and loaded by transformers (the dense and shared MLPs'
    gate_proj, up_proj, down_proj loaded as written: peft 0.21 would move them onto the
    fused experts, tests/test_deepseek_v3.py's `lora_logprobs` says why). The twin: the
    base alone."""
    from peft import PeftModel
    from peft.utils import transformers_weight_conversion

    from easylm.models.hf_checkpoint import write_safetensors
    from easylm.variants.adapters import Adapters
    from easylm.variants.lora import LoraConfig, flat, nested

    monkeypatch.setattr(transformers_weight_conversion, "_convert_peft_config_moe",
                        lambda config, model: None)
    directory, model, config, params = saved
    assert "lora" in FAMILY.variants  # --lora.* trains it (as tests/test_deepseek_v3.py's)
    family_adapters = Adapters(FAMILY)
    lm = family_adapters.lora_model(config, LoraConfig(rank=2, alpha=4.0))
    leaves = flat(lm.adapter_shapes)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapters = nested({path: 0.2 * jax.random.normal(key, leaf.shape)
                       for key, (path, leaf) in zip(keys, leaves.items())})
    family_adapters.save_peft(str(tmp_path / "adapter"), lm, adapters, config)
    (tmp_path / "merged").mkdir()
    write_safetensors(FAMILY.hf.write_params(lm.merge(lm.store_base(params), adapters), config),
                      str(tmp_path / "merged"))
    config.to_hf_config().save_pretrained(tmp_path / "merged")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(written["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                                  "q_proj", "up_proj", "v_proj"]
    assert len(written["target_parameters"]) == 2 * (config.num_hidden_layers
                                                     - config.first_k_dense_replace)
    ids = torch.tensor(np.random.default_rng(2).integers(0, 512, (2, 40)))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        before = torch.log_softmax(model(ids).logits, -1).numpy()
        merged = torch.log_softmax(merged(ids).logits, -1).numpy()
        base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base.eval(), tmp_path / "adapter").eval()
        peft = torch.log_softmax(peft(ids).logits, -1).numpy()
    # Both transformers' sums, x A B beside x W instead of folded in: `_logprob_atol`'s
    # reductions, two more a layer for the adapters.
    atol = _logprob_atol(config, merged, terms=2)
    np.testing.assert_allclose(peft, merged, atol=atol, rtol=0)
    assert np.abs(before - peft).max() > 100 * atol


# ------------------------------------------------ aux-loss-free balancing in training

RATE = 1e-2  # the bias moves this much a step: larger than the logits' rounding, so a
# choice it changes changes visibly


def _train(directory, output_dir):
    """`python -m easylm.train` on hf::DIR, 3 steps, the biases moving, a checkpoint each
    step (all kept), run in process."""
    from easylm import train

    with contextlib.redirect_stdout(io.StringIO()):
        train.main(["train", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
                    "--total_steps=3", "--log_freq=1", "--dtype=fp32", "--mesh_dim=1,1,-1",
                    "--train_dataset.json_dataset.seq_length=32",
                    "--train_dataset.json_dataset.batch_size=4", "--compilation_cache_dir=",
                    f"--logger.output_dir={output_dir}", "--logger.experiment_id=run",
                    "--optimizer.adamw_optimizer.lr=1e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=1", "--save_model_freq=1",
                    "--checkpointer.keep=3", f"--glm4_moe.routed_bias_update_rate={RATE}",
                    ])


def _checkpoint_params(output_dir, step, config):
    from easylm.runtime import checkpoint

    abstract = jax.eval_shape(FAMILY.bind(config).init_params, jax.random.key(0))
    directory = os.path.join(output_dir, "run", "checkpoints", str(step))
    return jax.tree.map(np.asarray, checkpoint.load_params(f"params::{directory}", abstract))


def _biases(params):
    return np.stack([np.asarray(leaf) for path, leaf in
                     jax.tree_util.tree_flatten_with_path(params)[0]
                     if "e_score_correction_bias" in str(path[-1])])


@pytest.fixture(scope="module")
def balanced(saved, tmp_path_factory):
    directory, _, config, _ = saved
    output_dir = str(tmp_path_factory.mktemp("balanced"))
    _train(directory, output_dir)
    config = config.replace(routed_bias_update_rate=RATE)
    with open(os.path.join(output_dir, "run", "metrics.jsonl")) as f:
        logged = [row for row in map(json.loads, f) if "loss" in row]
    return output_dir, config, logged


def test_step_one_loss_of_the_train_command_is_transformers_loss(saved, balanced):
    """`python -m easylm.train --load_checkpoint=hf::DIR`: step 1's logged loss =
    transformers' mean cross-entropy on the same first batch (the biases move only after
    the step)."""
    _, model, config, _ = saved
    _, _, logged = balanced
    batch = next(_batches())
    with torch.no_grad():
        logits = model(torch.tensor(batch["input_tokens"]).long()).logits
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                            torch.tensor(batch["target_tokens"]).long().flatten(),
                                            reduction="none")
    mask = torch.tensor(batch["loss_masks"]).flatten()
    expected = float((nll * mask).sum() / mask.sum())
    loss = logged[0]["loss"]
    assert abs(loss - expected) <= _logprob_atol(config, logits.numpy()), (loss, expected)
    assert np.all(np.isfinite([row["loss"] for row in logged]))


def _batches():
    """The train command's batches (rows of 32, 4 a batch), in its order."""
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.training import options

    run = options.parse_flags(FAMILY, ["train", "--train_dataset.json_dataset.seq_length=32",
                                       "--train_dataset.json_dataset.batch_size=4"])
    for batch, _ in DatasetFactory.load_dataset(run.train_dataset, load_tokenizer("embedded")):
        yield batch


def test_the_bias_moves_by_the_sign_of_each_steps_load(saved, balanced):
    """After each of 3 steps each layer's correction bias = the step before's + rate *
    sign(mean load - load), the load the step's forward pass routed (its max and min are
    the logged moe_load_max / moe_load_min); the weights train beside it."""
    _, _, _, before = saved
    output_dir, config, logged = balanced
    model = FAMILY.bind(config)
    routed = jax.jit(lambda p, ids, segments: model.forward(
        p, ids, segment_ids=segments, router_stats=True).router_stats.load)
    moved = 0
    for step, batch in zip((1, 2, 3), _batches()):
        load = np.asarray(routed(before, batch["input_tokens"], batch.get("segment_ids")),
                          np.float32)
        assert (logged[step - 1]["moe_load_max"], logged[step - 1]["moe_load_min"]) == \
            (load.max(), load.min())
        after = _checkpoint_params(output_dir, step, config)
        expected = _biases(before) + np.float32(RATE) * np.sign(
            load.mean(axis=-1, keepdims=True) - load)
        np.testing.assert_array_equal(_biases(after), expected)
        moved += int(np.any(_biases(after) != _biases(before)))
        before = after
    assert moved == 3 and len(logged) == 3


def test_resuming_from_step_two_moves_the_bias_bit_for_bit(saved, balanced, tmp_path):
    """The run's directory with its step-3 checkpoint gone (a kill -9 after step 2's
    save), run again: step 3 resumes from step 2 and gives the uninterrupted run's
    parameters, biases included, bit for bit."""
    output_dir, config, _ = balanced
    copy = tmp_path / "copy"
    shutil.copytree(output_dir, copy)
    shutil.rmtree(copy / "run" / "checkpoints" / "3")
    _train(saved[0], str(copy))
    resumed = _checkpoint_params(str(copy), 3, config)
    expected = _checkpoint_params(output_dir, 3, config)
    assert np.any(_biases(expected) != _biases(_checkpoint_params(output_dir, 2, config)))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)
