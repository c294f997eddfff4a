"""Qwen3.5-MoE (`qwen3_5_moe_text`) and Qwen3-Next (`qwen3_next`) in the Qwen3.5 family
against transformers' Qwen3_5MoeForCausalLM and Qwen3NextForCausalLM, each on a tiny random
directory transformers saved (fp32, routers perturbed so that routing is decided well
above rounding): config.json both ways and the parameter counts, a 300-token prompt's
log-probabilities served by the engine, 12 greedy tokens served after a chunked prefill
= `generate`, step 1's loss through the train command = transformers' loss with the
load-balancing term on the same batch, and the exported directory.

Tolerances (tests/numerics.py): tests/test_qwen3_5.py's twelve reductions per layer, plus
the router's and the combine of the chosen and shared experts' outputs; the widest over
max(D, F, T, N U) terms. A log-probability moves by at most twice the largest logit
error.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from cli_utils import one_line_error, train_losses
from numerics import assert_close, assert_differs, fp32_rel
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

from easylm import train
from easylm.models import registry
from easylm.models.hf_checkpoint import write_safetensors
from easylm.qwen3_5.config import from_hf_dict
from easylm.qwen3_5.family import FAMILY
from easylm.serving import scoring
from easylm.serving.engine import Engine, Sampling

T = 300  # the scored prompt: past several DeltaNet chunks (64) and prefill chunks (128)
ENGINE = {"batch_size": 1, "seq_length": 320, "decode_steps": 4, "prefill_chunk_size": 128}
CASES = ("debug_moe", "debug_next")


def rel_of(config) -> float:
    terms = max(config.hidden_size, config.moe_intermediate_size,
                config.shared_expert_intermediate_size, T,
                config.linear_num_value_heads * config.linear_value_head_dim)
    return fp32_rel(terms, 14 * config.num_hidden_layers + 1)


def torch_model(config):
    """transformers' model of `config`, random: norms away from their init, a mild decay,
    weights of 0.08 (logits of a few units) and routers of 0.3 (gaps between experts' logits
    far above fp32 rounding)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config.to_hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.1).log())
            elif name.endswith("dt_bias"):
                p.normal_()
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif p.ndim >= 2:
                p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="module", params=CASES)
def saved(request, tmp_path_factory):
    """(config, transformers' model, its directory, our params read from it, an engine)."""
    config = FAMILY.from_preset(request.param, output_router_logits=True,
                                router_aux_loss_coef=0.1)
    model = torch_model(config)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    read = FAMILY.hf.read_config(str(directory))
    params = FAMILY.hf.read_params(str(directory), read)
    return read, model, directory, params, Engine(ENGINE, FAMILY.bind(read), params)


def torch_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()


PROMPT = [int(t) for t in np.random.RandomState(0).randint(3, 512, T)]


def test_config_json_and_parameter_counts(saved):
    config, model, directory, params, _ = saved
    assert registry.family_of(f"hf::{directory}") == "qwen3_5"
    assert config == FAMILY.from_preset(config.model_type.replace("qwen3_5_moe_text", "debug_moe")
                                        .replace("qwen3_next", "debug_next"),
                                        output_router_logits=True, router_aux_loss_coef=0.1)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    assert config.num_parameters() == sum(x.size for x in jax.tree.leaves(params))
    assert config.num_active_parameters() < config.num_parameters()


def test_published_sizes_count_as_transformers_and_their_cards():
    for name, total, active in (("qwen3_5_35b_a3b", 35, 3), ("qwen3_next_80b_a3b", 80, 3)):
        config = FAMILY.from_preset(name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config.to_hf_config())
        assert config.num_parameters() == sum(p.numel() for p in model.parameters()), name
        assert round(config.num_parameters() / 1e9) == total
        assert int(config.num_active_parameters() / 1e9) == active  # "A3B": 3.5 and 3.9


def test_served_logprobs_of_a_long_prompt_equal_transformers(saved):
    """The engine's prompt log-probabilities (OpenAI echo) of 300 tokens = transformers'.
    The twin: the shared expert's gate read as a constant 1/2 (its weight zeroed)."""
    config, model, _, params, engine = saved
    expected = torch_logprobs(model, PROMPT)
    ((served, _),) = scoring.prompt_logprobs(engine, [PROMPT])
    expected_targets = expected[np.arange(T - 1), PROMPT[1:]]
    atol = 2 * rel_of(config) * float(np.abs(torch_model_logits(model, PROMPT)).max())
    assert_close(np.array(served[1:]), expected_targets, 1.0, scale=atol)
    gateless = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "shared_expert_gate" in jax.tree_util.keystr(p) else x,
        params)
    twin = jax.nn.log_softmax(FAMILY.bind(config).forward(
        gateless, jnp.asarray([PROMPT])).logits[0], -1)
    assert_differs(np.asarray(twin)[np.arange(T - 1), PROMPT[1:]], expected_targets, 1.0,
                   scale=atol)


def torch_model_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_served_greedy_tokens_equal_generate(saved):
    """12 greedy tokens after the 300-token prompt (prefilled 128 at a time, the DeltaNet
    state carried from chunk to chunk) and after a 13-token one, decoded with the recurrent
    form and the experts = transformers' generate."""
    _, model, _, _, engine = saved
    for prompt in (PROMPT, PROMPT[:13]):
        engine.reset()
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                      do_sample=False)[0, len(prompt):].tolist()
        out = engine.fetch(engine.prefill([prompt], [0], Sampling.empty(1)))
        tokens = [int(out[0][0, 0])]
        for _ in range(3):
            tokens += [int(t) for t in engine.fetch(engine.decode(Sampling.empty(1)))[0][:, 0]]
        assert tokens[:12] == expected, prompt


def test_training_through_the_command_starts_at_transformers_loss(tmp_path, saved):
    """Step 1's loss = transformers' outputs.loss (cross-entropy + 0.1 x
    load_balancing_loss_func) on the command's first batch; the twin: the cross-entropy
    alone. Qwen3-Next runs `python -m easylm.train --load_checkpoint=hf::DIR` for 3 steps
    (its logged step-1 loss, and the loss falls); Qwen3.5-MoE, whose layers differ only in
    the unfused projections the dense Qwen3.5 test trains through the command, runs the
    next-token objective that command's step runs, at a third of the compile time."""
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.objectives.next_token import next_token_sums

    config, model, directory, params, _ = saved
    data = DatasetFactory.get_default_config()
    data.json_dataset.seq_length, data.json_dataset.batch_size = 32, 4
    batch, _ = next(iter(DatasetFactory.load_dataset(data, load_tokenizer("embedded"))))
    if config.model_type == "qwen3_next":
        losses = train_losses(directory, tmp_path)
        assert len(losses) == 3 and np.all(np.isfinite(losses)) and losses[-1] < losses[0]
        first = losses[0]
    else:
        arrays = {k: jnp.asarray(v) for k, v in batch.items()}
        first = float(next_token_sums(FAMILY.bind(config), params, arrays, None).total_mean())
    with torch.no_grad():
        out = model(torch.tensor(batch["input_tokens"]).long(), output_router_logits=True)
    nll = torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1), torch.tensor(batch["target_tokens"]).long().flatten(),
        reduction="none")
    mask = torch.tensor(batch["loss_masks"]).flatten()
    ce = float((nll * mask).sum() / mask.sum())
    aux = float(load_balancing_loss_func(out.router_logits, config.num_experts,
                                         config.num_experts_per_tok))
    atol = 2 * rel_of(config) * float(out.logits.abs().max())
    assert abs(first - (ce + 0.1 * aux)) <= atol, (first, ce, aux)
    assert abs(first - ce) > atol


def test_export_reloads_in_transformers_as_served(tmp_path, saved):
    config, _, _, params, engine = saved
    write_safetensors(FAMILY.hf.write_params(params, config), str(tmp_path))
    config.to_hf_config().save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == config.to_hf_config().architectures[0]
    ((served, _),) = scoring.prompt_logprobs(engine, [PROMPT])
    theirs = torch_logprobs(reloaded, PROMPT)[np.arange(T - 1), PROMPT[1:]]
    atol = 2 * rel_of(config) * float(np.abs(torch_model_logits(reloaded, PROMPT)).max())
    assert_close(np.array(served[1:]), theirs, 1.0, scale=atol)


def test_what_it_does_not_build_is_one_line(tmp_path, capsys):
    text = json.loads(FAMILY.from_preset("debug_next").to_hf_config().to_json_string())
    for key, value in (("decoder_sparse_step", 2), ("mlp_only_layers", [1])):
        (tmp_path / "config.json").write_text(json.dumps({**text, key: value}))
        error = one_line_error(train.main, ["train", f"--load_checkpoint=hf::{tmp_path}"],
                               capsys)
        assert f"{key}=" in error and "is not supported" in error, error
    assert from_hf_dict(text).model_type == "qwen3_next"
    moe = json.loads(FAMILY.from_preset("debug_moe").to_hf_config().to_json_string())
    multimodal = {"model_type": "qwen3_5_moe", "text_config": moe}
    assert from_hf_dict(multimodal) == from_hf_dict(moe)
    with pytest.raises(Exception, match="norm_topk_prob=False"):
        FAMILY.from_preset("debug_moe", norm_topk_prob=False)


def test_lora_on_the_deltanet_projections_exports_adapter_equal_to_merged(tmp_path):
    """LoRA through the train command on Qwen3-Next's attention and fused DeltaNet
    projections (PEFT's names: in_proj_qkvz, in_proj_ba, out_proj, ...): the PEFT adapter
    on transformers' base = the merged export; the twin: the base without it."""
    import contextlib
    import io

    from peft import PeftModel

    from easylm import convert_easylm_to_hf
    from easylm.data.tokenizer import load_tokenizer

    config = FAMILY.from_preset("debug_next")
    torch_model(config).save_pretrained(tmp_path / "hf")
    load_tokenizer("embedded").save_pretrained(tmp_path / "hf")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(["train", f"--load_checkpoint=hf::{tmp_path / 'hf'}",
                    f"--tokenizer={tmp_path / 'hf'}", "--total_steps=3",
                    "--train_dataset.json_dataset.seq_length=32",
                    "--train_dataset.json_dataset.batch_size=4", "--compilation_cache_dir=",
                    f"--logger.output_dir={tmp_path / 'runs'}", "--dtype=fp32",
                    "--mesh_dim=1,1,-1", "--optimizer.adamw_optimizer.lr=1e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=1", "--lora.rank=4",
                    "--lora.alpha=8", ("--lora.target_modules=(q_proj|k_proj|v_proj|o_proj|"
                                       "in_proj_qkvz|in_proj_ba|out_proj)/kernel$")])
    final = out.getvalue().split("checkpoint: ")[1].split()[0]
    for mode in ("adapter", "merged"):
        convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{final}",
                                   f"--output_dir={tmp_path / mode}", f"--lora_mode={mode}",
                                   "--verify=False"])
    targets = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(targets["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"])
    ids = torch.tensor(np.random.RandomState(2).randint(3, config.vocab_size, (2, 80)))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        before = base(ids).logits.numpy()
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits.numpy()
        merged = merged.eval()(ids).logits.numpy()
    rel = fp32_rel(max(config.hidden_size, config.intermediate_size, 80, 64),
                   14 * config.num_hidden_layers + 1)
    assert_close(merged, peft, rel)
    assert_differs(before, peft, rel)  # the adapters moved the logits


def test_a_qwen3_6_multimodal_directory_serves_its_text_tower_as_transformers(saved, tmp_path):
    """Qwen3.6 (Qwen3.6-35B-A3B) ships as `qwen3_5_moe`, Qwen3_5MoeForConditionalGeneration:
    transformers 5.25 has no Qwen3.6 class or config field, so 3.6 differs from 3.5 in its
    weights, not its config's shape. A tiny such directory saved by transformers (a vision
    tower of one block, the text model the fixture's) is read through hf::DIR for its text
    tower: the same config and parameters, bit for bit, as the text directory, and
    transformers' multimodal model gives the text model's logits on text, so the served
    log-probabilities are those the test above holds to transformers. Twin: a text tensor
    changed in the directory is read as changed."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config, model, _, params, _ = saved
    if config.model_type != "qwen3_5_moe_text":
        pytest.skip("Qwen3-Next has no multimodal checkpoint")
    text = model.config.to_dict()
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4,
                  temporal_patch_size=2, out_hidden_size=config.hidden_size)
    whole = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False)).eval()
    whole.model.language_model.load_state_dict(model.model.state_dict())
    whole.lm_head.load_state_dict(model.lm_head.state_dict())
    whole.save_pretrained(tmp_path)
    assert registry.family_of(f"hf::{tmp_path}") == "qwen3_5"
    read = FAMILY.hf.read_config(str(tmp_path))
    assert read == config
    jax.tree.map(np.testing.assert_array_equal, FAMILY.hf.read_params(str(tmp_path), read),
                 params)
    with torch.no_grad():  # 40 tokens: the same modules, so equal to the bit
        logits = whole(torch.tensor([PROMPT[:40]])).logits[0].numpy()
    np.testing.assert_array_equal(logits, torch_model_logits(model, PROMPT[:40]))
    with torch.no_grad():
        whole.model.language_model.layers[0].mlp.shared_expert_gate.weight.mul_(2.0)
    whole.save_pretrained(tmp_path)
    changed = FAMILY.hf.read_params(str(tmp_path), read)
    assert not np.array_equal(
        changed["model"]["layers"]["0"]["mlp"]["shared_expert_gate"]["kernel"],
        params["model"]["layers"]["0"]["mlp"]["shared_expert_gate"]["kernel"])
