"""The Qwen3.5 family (easylm/qwen3_5/) against transformers' Qwen3_5ForCausalLM: config.json
both ways, parameter counts, logits through `hf::DIR`, the written-back directory, the
scanned layers, prefill then decode with the DeltaNet state in the cache, packed
documents, a training run through the command, and serving through the engine (its
greedy tokens = transformers' generate, slots reused and shared, chunked prefill).

Tolerances (tests/numerics.py): a linear layer is about eight reductions in sequence
(tests/test_gated_deltanet.py), a full one seven (q/k/v, the q/k norms, scores, their
weighted sum, o_proj), each then the MLP's two and the two norms: at most twelve per
layer, and the head; the widest over max(D, F, T, N U) terms.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from cli_utils import one_line_error, train_losses
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import prefill_program_bytes
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from easylm import train
from easylm.errors import UserError
from easylm.models import registry
from easylm.models.decoder import relayout
from easylm.qwen3_5.config import Qwen35Config, from_hf_dict
from easylm.qwen3_5.family import FAMILY
from easylm.serving import programs
from easylm.serving.cache_layout import CacheLayout
from easylm.serving.engine import Engine, Sampling

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
    losses = train_losses(hf[0], tmp_path)
    assert len(losses) == 3 and np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def objective_steps(directory, tmp_path, steps, *flags) -> list[dict]:
    """The logged steps of `python -m easylm.train --load_checkpoint=hf::DIR` with `flags`
    (fp32, lr 1e-2 from the first step), run in process."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        train.main(["train", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
                    f"--total_steps={steps}", "--log_freq=1", "--dtype=fp32",
                    "--mesh_dim=-1,1,1", "--save_model_freq=0", "--compilation_cache_dir=",
                    "--optimizer.adamw_optimizer.lr=1e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=0",
                    f"--logger.output_dir={tmp_path}", "--logger.experiment_id=run", *flags])
    with open(f"{tmp_path}/run/metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "loss" in row]


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """A directory of debug's shapes in two layers (one Gated DeltaNet, one full attention):
    less for the objectives' commands to compile."""
    directory = tmp_path_factory.mktemp("qwen3_5_two_layers")
    torch_model(FAMILY.from_preset("debug", num_hidden_layers=2,
                                   full_attention_interval=2)).save_pretrained(directory)
    return directory


def test_dpo_under_qlora_starts_at_log_2_and_moves(tmp_path, two_layers):
    """DPO with QLoRA (an nf4 base, rank-4 adapters whose B starts at zero) through the
    command: at step 1 the policy is its reference (the base), so the margin is 0 and the
    loss log 2, within a forward's rounding of the summed log-probabilities; after one
    update at lr 1e-2 the margin moves beyond that bound (the twin)."""
    pairs, beta = tmp_path / "pairs.jsonl", 0.1
    rng = np.random.RandomState(0)
    words = "the a cat dog ran sat on mat sun moon red blue big small".split()
    text = lambda n: " ".join(rng.choice(words, n))
    pairs.write_text("".join(json.dumps({"prompt": text(5), "chosen": text(6),
                                         "rejected": text(4)}) + "\n" for _ in range(16)))
    first, second = objective_steps(
        two_layers, tmp_path, 2, "--objective=dpo", "--train_dataset.preference.enabled=True",
        f"--train_dataset.json_dataset.path={pairs}", "--train_dataset.json_dataset.seq_length=32",
        "--train_dataset.json_dataset.batch_size=8", "--lora.rank=4", "--lora.base_dtype=nf4",
        f"--dpo.beta={beta}")
    # A margin is beta times a difference of two such differences of sums over a row.
    bound = beta * 4 * fp32_rel(128, 12 * 2 + 1) * max(abs(first["logps/chosen"]), abs(first["logps/rejected"]))
    assert abs(first["rewards/margin"]) <= bound, (first["rewards/margin"], bound)
    assert first["loss"] == pytest.approx(np.log(2), abs=bound)
    assert abs(second["rewards/margin"]) > bound, (second["rewards/margin"], bound)


def test_on_policy_distillation_runs_a_step(tmp_path, two_layers):
    """--objective=distill through the command, every step on the engine's own rollouts
    (--distill.lmbda=1) and the student's directory as its teacher: the step trains on
    completions the engine made (1 to 4 tokens each) and its loss is finite."""
    (step,) = objective_steps(
        two_layers, tmp_path, 1, "--objective=distill", f"--distill.teacher=hf::{two_layers}",
        "--distill.lmbda=1", "--distill.max_new_tokens=4",
        f"--train_dataset.json_dataset.path={prompts_file(tmp_path)}",
        "--train_dataset.json_dataset.seq_length=16", "--train_dataset.json_dataset.batch_size=8")
    assert step["data/distill/on_policy"] == 1.0
    assert 1 <= step["data/completions/mean_length"] <= 4 and step["loss_tokens"] > 0
    assert np.isfinite(step["loss"]) and np.isfinite(step["gradient_norm"])


def sp_steps(directory, tmp_path, name, *flags) -> list[dict]:
    """Two logged steps of `python -m easylm.train --load_checkpoint=hf::DIR` on packed rows
    of 64 (8 rows of short documents, segment ids on), fp32, lr 1e-2 from the first step."""
    import contextlib
    import io

    documents = tmp_path / "documents.jsonl"
    rng = np.random.default_rng(0)
    words = "the a cat dog ran sat on mat sun moon red blue big small happy sad tree".split()
    documents.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n"
                                 for n in rng.integers(4, 30, 200)))
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(["train", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
                    "--total_steps=2", "--log_freq=1", "--dtype=fp32", "--save_model_freq=0",
                    f"--train_dataset.json_dataset.path={documents}",
                    "--train_dataset.json_dataset.seq_length=64",
                    "--train_dataset.json_dataset.batch_size=8",
                    "--train_dataset.json_dataset.segment_ids=True", "--compilation_cache_dir=",
                    "--optimizer.adamw_optimizer.lr=1e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=0",
                    f"--logger.output_dir={tmp_path}", f"--logger.experiment_id={name}", *flags])
    with open(f"{tmp_path}/{name}/metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "loss" in row]


def test_sequence_parallel_training_equals_unsplit(tmp_path, two_layers, monkeypatch):
    """`--mesh_dim=dp=1,fsdp=2,sp=4` on packed rows of 64 (pieces of 8 places; documents of
    4 to 30 words cross them, and start inside them) = `--mesh_dim=1,8,1`: the first step's
    loss and gradient norm and the second step's loss (the ring; the DeltaNet layer is the
    same under `all_gather`, measured equal once, docs/long_context.md). Tolerance: fp32 through the two layers as REL derives it for the debug model, the
    gradient norm a backward pass (about twice the reductions) deeper. Twin: every piece
    starting from a zero state and zero conv inputs (`_mine` picking zeros), under sp."""
    from easylm.models import gated_deltanet as gdn

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    rel = fp32_rel(max(CONFIG.hidden_size, CONFIG.intermediate_size, 64, 4 * 16), 12 * 2 + 1)
    whole = sp_steps(two_layers, tmp_path, "whole", "--mesh_dim=1,8,1")
    sp = ["--mesh_dim=dp=1,fsdp=2,sp=4", "--context_parallel=ring"]
    split = sp_steps(two_layers, tmp_path, "split", *sp)
    print(f"loss {split[0]['loss']:.8g} {split[1]['loss']:.8g} (sp=4) {whole[0]['loss']:.8g} "
          f"{whole[1]['loss']:.8g} (unsplit); gradient norm {split[0]['gradient_norm']:.8g} "
          f"{whole[0]['gradient_norm']:.8g}")
    assert split[0]["loss"] == pytest.approx(whole[0]["loss"], rel=rel)
    assert split[0]["gradient_norm"] == pytest.approx(whole[0]["gradient_norm"], rel=2 * rel)
    assert split[1]["loss"] == pytest.approx(whole[1]["loss"], rel=rel)

    mine = gdn._mine
    monkeypatch.setattr(gdn, "_mine", lambda x, order: jnp.zeros_like(mine(x, order)))
    twin = sp_steps(two_layers, tmp_path, "twin", *sp)
    print(f"twin: loss {twin[0]['loss']:.8g}, gradient norm {twin[0]['gradient_norm']:.8g}")
    assert twin[0]["loss"] != pytest.approx(whole[0]["loss"], rel=rel)
    assert twin[0]["gradient_norm"] != pytest.approx(whole[0]["gradient_norm"], rel=2 * rel)


def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"the cat {i} sat on"}) + "\n"
                            for i in range(16)))
    return path


# ------------------------------------------------------------------ serving
# One engine program set for all serving tests: 2 slots of 32 positions, prompts up to 16
# tokens prefilled 8 at a time (so a prompt's state crosses a chunk), 4 decode steps.
ENGINE = {"batch_size": 2, "seq_length": 32, "min_bucket": 16, "decode_steps": 4,
          "prefill_chunk_size": 8}
PROMPT_A = [5, 77, 300, 12, 9, 450, 31, 8, 200, 64, 3, 99, 17]  # 13 tokens: two chunks
PROMPT_B = [41, 7, 260, 88, 5, 123, 19]  # 7: decoded first in the 16-position window


@pytest.fixture(scope="module")
def engine(ours):
    config, params = ours
    return Engine(ENGINE, FAMILY.bind(config), params)


def served(engine, prompt, slot, n=12, decodes=None):
    """Greedy tokens of `prompt` prefilled into `slot`, then decode calls for all slots."""
    out = engine.fetch(engine.prefill([prompt], [slot], Sampling.empty(1)))
    tokens = [int(out[0][0, 0])]
    for _ in range(decodes if decodes is not None else -(-(n - 1) // ENGINE["decode_steps"])):
        tokens += [int(t) for t in engine.fetch(engine.decode(Sampling.empty(2)))[0][:, slot]]
    return tokens[:n]


def test_served_greedy_tokens_equal_transformers_generate(hf, engine):
    """The engine (chunked prefill, the recurrent decode with the state in its cache, the
    decode windows over positions) = transformers' generate, 12 greedy tokens."""
    _, model, _, _ = hf
    for prompt in (PROMPT_A, PROMPT_B):
        engine.reset()
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                      do_sample=False)[0, len(prompt):].tolist()
        assert served(engine, prompt, slot=0) == expected, prompt


def test_a_reused_slot_starts_its_state_afresh(ours, engine, monkeypatch):
    """Slot 0 serves A, then B: B's tokens are a fresh engine's. The negative twin: an
    engine whose prompts start from the slot's last state (no reset) gives other tokens."""
    engine.reset()
    alone = served(engine, PROMPT_B, slot=0)
    engine.reset()
    served(engine, PROMPT_A, slot=0)
    assert served(engine, PROMPT_B, slot=0) == alone

    def leaking(model, layout, cache, slots, rows, length):
        fresh = model.init_cache(rows, length)
        return layout.map(lambda b, s, c, f: f if s is not None else
                          jnp.take(c, slots, axis=b, mode="clip"), cache, fresh)

    monkeypatch.setattr(programs, "prompt_cache", leaking)
    config, params = ours
    leaky = Engine(ENGINE, FAMILY.bind(config), params)
    served(leaky, PROMPT_A, slot=0)
    assert served(leaky, PROMPT_B, slot=0) != alone


def test_two_requests_in_parallel_equal_each_alone(engine):
    """A decodes alone for a call (slot 1 idle, its state garbage), then B joins in slot
    1: each gets the tokens it gets alone."""
    engine.reset()
    a_alone = served(engine, PROMPT_A, slot=0)
    engine.reset()
    b_alone = served(engine, PROMPT_B, slot=1)
    engine.reset()
    out = engine.fetch(engine.prefill([PROMPT_A], [0], Sampling.empty(1)))
    a = [int(out[0][0, 0])] + [int(t) for t in engine.fetch(engine.decode(Sampling.empty(2)))[0][:, 0]]
    out = engine.fetch(engine.prefill([PROMPT_B], [1], Sampling.empty(1)))
    b = [int(out[0][0, 0])]
    for _ in range(3):
        tokens = engine.fetch(engine.decode(Sampling.empty(2)))[0]
        a, b = a + [int(t) for t in tokens[:, 0]], b + [int(t) for t in tokens[:, 1]]
    assert a[:12] == a_alone and b[:12] == b_alone
    assert a_alone != b_alone


def _waiting_turn(engine, protect: bool):
    """Slot 0's turn ends mid-call (its last token at position 15), it waits two calls
    while slot 1 decodes, then a suffix is appended (`extend`) and it decodes on. With
    `protect`, the calls hold slot 0's state (`decode`'s ends, active); "partly": only
    while it waits. Returns (slot 0's tokens and log-probabilities after the suffix,
    its whole row, slot 1's tokens and log-probabilities)."""
    engine.reset()
    everyone = Sampling.empty(2)
    turn = [int(engine.fetch(engine.prefill([PROMPT_A], [0], Sampling.empty(1)))[0][0, 0])]
    engine.fetch(engine.prefill([PROMPT_B], [1], Sampling.empty(1)))
    ends = [15, 10 ** 6] if protect is True else None  # slot 0 live at positions 13, 14
    out = engine.fetch(engine.decode(everyone, ends=ends))
    turn += [int(t) for t in out[0][:2, 0]]  # its turn: positions 13..15
    b_ids, b_logps = [out[0][:, 1]], [out[1][:, 1]]
    waiting = np.array([False, True]) if protect else None
    for _ in range(2):  # the whole cache as the window whatever `active`: the same programs
        out = engine.fetch(engine.decode(everyone, waiting, keep=engine.seq_length))
        b_ids.append(out[0][:, 1])
        b_logps.append(out[1][:, 1])
    suffix = [9, 10, 11]  # a tool's answer
    out = engine.fetch(engine.extend([[turn[-1]] + suffix], [0], [15], Sampling.empty(1)))
    ids, logps = [int(out[0][0, 0])], [float(out[1][0, 0])]
    out = engine.fetch(engine.decode(everyone, np.array([True, False])))
    ids += [int(t) for t in out[0][:, 0]]
    logps += [float(x) for x in out[1][:, 0]]
    row = PROMPT_A + turn + suffix + ids
    return np.asarray(ids), np.asarray(logps), row, np.concatenate(b_ids), \
        np.concatenate(b_logps)


def test_a_waiting_slots_state_continues_after_its_turn(ours, engine, forward):
    """Multi-turn on a state cache: slot 0's turn ends mid-call, it waits while slot 1
    decodes, then a suffix is extended onto its cache: its next tokens are the full
    forward's greedy ones and their log-probabilities the full forward's (REL of the
    logits' scale). Slot 1's tokens and log-probabilities are bitwise those of calls that
    hold nothing (the mask leaves live slots alone). Negative twins: calls that hold
    nothing (slot 0's state runs on through garbage), and calls that hold it only while it
    waits (the rest of the call its turn ended in still moves it)."""
    config, params = ours
    ids, logps, row, b_ids, b_logps = _waiting_turn(engine, True)
    n = len(PROMPT_A) + 3 + 3  # the positions before slot 0's first new token
    full = np.asarray(jax.nn.log_softmax(forward(config, params, np.asarray([row])).logits[0]
                                         .astype(jnp.float32)))
    expected = full[np.arange(n - 1, len(row) - 1), ids]
    assert (ids == full[n - 1:len(row) - 1].argmax(-1)).all()
    scale = float(np.abs(full).max())
    assert_close(logps, expected, REL, scale)
    for twin in (False, "partly"):
        t_ids, t_logps, t_row, t_b_ids, t_b_logps = _waiting_turn(engine, twin)
        np.testing.assert_array_equal(t_b_ids, b_ids)
        np.testing.assert_array_equal(t_b_logps, b_logps)
        t_full = np.asarray(jax.nn.log_softmax(forward(config, params, np.asarray([t_row]))
                                               .logits[0].astype(jnp.float32)))
        assert_differs(t_logps, t_full[np.arange(n - 1, len(t_row) - 1), t_ids], REL, scale)


def _prompt_forward(model, params, tokens, lengths, chunk, state=True):
    fn = jax.jit(functools.partial(programs._prompt_forward, model, chunk, False,
                                   state=state))
    fresh, last, _ = fn((params, None), jnp.asarray(tokens), jnp.asarray(lengths))
    layout = CacheLayout.of(model)
    T = tokens.shape[1]
    fresh = layout.map(lambda b, s, c: np.asarray(c if s is None else
                                                  jax.lax.slice_in_dim(c, 0, T, axis=s)), fresh)
    return np.asarray(last), fresh, layout


def _states(layout, cache, row):
    """The DeltaNet states of one row."""
    return [np.take(c, row, axis=b) for b, s, c in
            zip(layout.batch, layout.length, jax.tree.leaves(cache)) if s is None]


def test_chunked_prefill_continues_the_state(ours):
    """Two prompts (16 and 11 tokens) 8 at a time = at once (last logits, keys, values and
    states), and the short one's state = its own unpadded prefill's. The negative twins: a
    prefill that drops the state between chunks; one that lets padding write the state."""
    config, params = ours
    model = FAMILY.bind(config)
    tokens = np.random.RandomState(3).randint(3, config.vocab_size, (2, 16))
    lengths = np.array([16, 11])
    whole, whole_cache, layout = _prompt_forward(model, params, tokens, lengths, 0)
    chunked, chunked_cache, _ = _prompt_forward(model, params, tokens, lengths, 8)
    assert layout.has_state and np.abs(whole).max() > 1.0
    assert_close(chunked, whole, REL)
    for c, w in zip(jax.tree.leaves(chunked_cache), jax.tree.leaves(whole_cache)):
        assert_close(c, w, REL)
    alone_last, alone, _ = _prompt_forward(model, params, tokens[1:, :11], lengths[1:], 8)
    assert_close(chunked[1], alone_last[0], REL)
    for c, a in zip(_states(layout, chunked_cache, 1), _states(layout, alone, 0)):
        assert_close(c, a, REL)

    def forgetting(params, base, rng, collections, ids, positions=None, cache=None, **kwargs):
        later = positions[0, 0] > 0  # a chunk after the first: its state zeroed
        cache = layout.map(lambda b, s, c: c if s is not None else
                           jnp.where(later, jnp.zeros_like(c), c), cache)
        return model.apply(params, base, rng, collections, ids, positions=positions,
                           cache=cache, **kwargs)
    forgot, _, _ = _prompt_forward(dataclasses.replace(model, apply=forgetting), params,
                                   tokens, lengths, 8)
    assert_differs(forgot, whole, REL)
    _, padded, _ = _prompt_forward(model, params, tokens, lengths, 8, state=False)
    assert_differs(np.concatenate([x.ravel() for x in _states(layout, padded, 1)]),
                   np.concatenate([x.ravel() for x in _states(layout, alone, 0)]), REL)


def test_serving_plan_counts_the_state_once_per_linear_layer():
    """`--plan.serve_tokens`' cache: per slot, each DeltaNet layer's conv inputs (in the
    compute dtype) and fp32 state whatever the length, plus the attention layers' keys and
    values; the whole plan against XLA's analysis of the engine's prefill (arguments +
    outputs - aliased + temporaries; 1,024 tokens in chunks of 128). Measured: planned
    6.11 MiB, XLA 5.66 MiB (1.08). The negative twin: the state counted in bf16."""
    from easylm.serving.memory import _shard_bytes, serving_bytes

    S = 1024
    config = FAMILY.from_preset("debug", max_position_embeddings=S)
    model = FAMILY.bind(config)
    sizes = {"dp": 1, "fsdp": 1, "sp": 1, "ep": 1, "mp": 1}
    kinds = config.layer_kinds()
    d = config.deltanet()
    state = (d.linear_conv_kernel_dim - 1) * d.conv_channels * 2 + (
        d.linear_num_value_heads * d.linear_key_head_dim * d.linear_value_head_dim * 4)
    for length in (S // 2, S):
        kv = 2 * length * config.num_key_value_heads * config.head_dim * 2
        expected = 2 * (kinds.count("linear_attention") * state
                        + kinds.count("full_attention") * kv)
        planned = serving_bytes(model, sizes, jnp.bfloat16, 2, length, length, 128)
        assert planned["kv cache"] == expected, (length, planned)
    cache = jax.eval_shape(lambda: model.init_cache(2, S, jnp.bfloat16))
    assert _shard_bytes(cache, model.cache_rules, sizes, jnp.bfloat16) != expected

    xla = prefill_program_bytes(model, S, 128)
    assert 0.8 < serving_bytes(model, sizes, jnp.float32, 1, S, S, 128)["total"] / xla < 1.25


def test_cache_layout_is_read_off_the_shapes_the_layers_declare(ours):
    """Keys/values and a latent (B, S, C) are positional, the DeltaNet conv inputs and
    state are per-slot states, stacked (scanned) layers only move the axes; a cache array
    with no slot axis is refused in one line."""
    config, _ = ours
    layout = CacheLayout.of(FAMILY.bind(config))
    names = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(FAMILY.bind(config).init_cache(1, 8))[0]]
    kinds = {n: s for n, s in zip(names, layout.length)}
    assert kinds["['3']['k']"] == 1 and kinds["['0'].conv"] is None
    assert kinds["['0'].recurrent"] is None and set(layout.batch) == {0}
    scanned = CacheLayout.of(FAMILY.bind(config.replace(scan_layers=True)))
    # (R, B, ...): three DeltaNet slots' conv and state, the attention slot's keys/values.
    assert set(scanned.batch) == {1}
    assert scanned.length.count(None) == 6 and scanned.length.count(2) == 2
    model = FAMILY.bind(config)
    latent = dataclasses.replace(model, init_cache=lambda b, s, dtype=None: {
        "kv": jnp.zeros((b, s, 24)), "state": jnp.zeros((b, 4, 4))})
    assert CacheLayout.of(latent) == CacheLayout((0, 0), (1, None))
    shared = dataclasses.replace(model, init_cache=lambda b, s, dtype=None: {
        "table": jnp.zeros((s, 4))})
    with pytest.raises(UserError) as e:
        CacheLayout.of(shared)
    assert "\n" not in str(e.value) and "['table']" in str(e.value), e.value
