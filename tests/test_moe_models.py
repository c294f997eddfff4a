"""Qwen3-MoE and Mixtral as LLaMA variants: logits and the training loss with
the load-balancing term against transformers' Qwen3MoeForCausalLM and MixtralForCausalLM
on the same weights, the name map both ways, and what is refused.

Tolerances (tests/numerics.py): a layer of these models has the dense LLaMA layer's
reductions (`forward_rel`) plus two: the router's matmul over D and the weighted sum of
the K chosen experts' outputs. Routing picks the top K of E probabilities, so a rounding
flip would change a token's experts; the models are random (initializer_range 0.2) and
the routers' gaps far above fp32 rounding, which the negative twins' margins show."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from llama_variants import hf_variant
from numerics import assert_close, assert_differs, fp32_rel, logprob_tolerance
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from easylm import model_flags
from easylm.errors import UserError
from easylm.llama import hf
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.objectives.next_token import next_token_sums

T = 16  # positions; Mixtral's window (6) is shorter
CASES = {
    "qwen3_moe_norm": dict(model_type="qwen3_moe", norm_topk_prob=True, head_dim=32),
    "qwen3_moe": dict(model_type="qwen3_moe", norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral", sliding_window=6, intermediate_size=32,
                    moe_intermediate_size=0, norm_topk_prob=True),
}


def moe_config(name: str, **overrides) -> LLaMAConfig:
    fields = dict(vocab_size=64, initializer_range=0.2, router_aux_loss_coef=0.1,
                  output_router_logits=True, **CASES[name])
    return LLaMAConfig.from_preset("debug_moe", **{**fields, **overrides})


def moe_rel(config) -> float:
    """`forward_rel` with the router's and the combine's reductions in each layer."""
    terms = max(config.hidden_size, config.moe_intermediate_size, T)
    per_layer = (7 if config.qk_norm else 6) + 2
    return fp32_rel(terms, per_layer * config.num_hidden_layers + 1)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, config, the transformers model, its save_pretrained directory, ids)."""
    config = moe_config(request.param)
    model = hf_variant(config)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, T))
    return request.param, config, model, directory, ids


def ours(config, params, ids):
    return np.asarray(FAMILY.bind(config).forward(params, jnp.asarray(ids)).logits)


def test_logits_match_transformers_and_the_twins_differ(case):
    name, config, model, directory, ids = case
    read, params = hf.load_hf_params(str(directory))
    assert read == config
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    rel = moe_rel(config)
    assert_close(ours(config, params, ids), theirs, rel)
    # Negative twins: the other renormalisation (Mixtral always renormalises: its window
    # off instead), and one expert more per token.
    if name == "mixtral":
        twin = config.replace(sliding_window=0)
    else:
        twin = config.replace(norm_topk_prob=not config.norm_topk_prob)
    assert_differs(ours(twin, params, ids), theirs, rel)
    assert_differs(ours(config.replace(num_experts_per_tok=3), params, ids), theirs, rel)


def test_loss_with_the_aux_term_is_transformers_outputs_loss(case):
    """Qwen3MoeForCausalLM / MixtralForCausalLM with labels and output_router_logits:
    mean next-token loss + router_aux_loss_coef x load_balancing_loss_func over every
    position's router logits. Ours: the last position predicts nothing (mask 0) but is
    routed, as there. The twin leaves the aux term out."""
    _, config, model, directory, ids = case
    _, params = hf.load_hf_params(str(directory))
    with torch.no_grad():
        out = model(torch.tensor(ids), labels=torch.tensor(ids), output_router_logits=True)
    batch = dict(input_tokens=jnp.asarray(ids),
                 target_tokens=jnp.asarray(np.concatenate([ids[:, 1:], ids[:, :1]], axis=1)),
                 loss_masks=jnp.asarray(np.arange(T) < T - 1, jnp.float32)[None].repeat(2, 0))
    scale = float(np.abs(out.logits.numpy()).max())
    atol = logprob_tolerance(config, T, scale) * (moe_rel(config) / fp32_rel(1))
    sums = next_token_sums(FAMILY.bind(config), params, batch, None)
    assert abs(float(sums.total_mean()) - float(out.loss)) <= atol
    means = sums.means()  # what the train step logs
    assert abs(float(means["loss"]) - float(out.loss)) <= atol
    assert abs(float(means["aux_loss"]) - float(out.aux_loss)) <= atol
    # Negative twin: the cross-entropy alone, logged beside it, is not outputs.loss.
    assert abs(float(means["ce_loss"]) - float(out.loss)) > atol
    assert abs(float(means["ce_loss"]) + config.router_aux_loss_coef * float(out.aux_loss)
               - float(out.loss)) <= atol
    without = next_token_sums(FAMILY.bind(config.replace(output_router_logits=False)), params,
                              batch, None)
    assert abs(float(without.total_mean()) - float(out.loss)) > atol


def test_hf_to_easylm_to_hf_is_bitwise_and_fused_tensors_read_the_same(case):
    """Per-expert tensors (what transformers 5.24's save_pretrained writes, and
    transformers 4 held) read and written back bit for bit; transformers 5's in-memory
    fused layout (experts.gate_up_proj, experts.down_proj) reads to the same parameters;
    scanned layers compute the same logits."""
    _, config, model, directory, ids = case
    _, params = hf.load_hf_params(str(directory))
    saved = load_file(str(directory / "model.safetensors"))
    written = dict(hf.to_hf(params, config))
    assert sorted(written) == sorted(saved)
    assert all(np.array_equal(written[key], saved[key]) for key in saved)
    assert any(".experts.gate_up_proj" in key for key in model.state_dict())
    fused = hf.from_hf({k: v.numpy() for k, v in model.state_dict().items()}, config)
    assert jax.tree.all(jax.tree.map(np.array_equal, fused, params))
    scanned = config.replace(scan_layers=True)
    _, stacked = hf.load_hf_params(str(directory), scan_layers=True)
    assert_close(ours(scanned, stacked, ids), ours(config, params, ids), moe_rel(config))


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="deepseek_v2", kv_lora_rank=512),
     "model_type 'deepseek_v2' is not built: its kv_lora_rank"),
    (dict(model_type="qwen2_moe"), "model_type 'qwen2_moe' is not built: its shared_expert"),
    (dict(model_type="qwen3_next"), "model_type 'qwen3_next' is not built: its layer_types"),
    (dict(mlp_only_layers="1"), "mlp_only_layers must be a list of layer indices"),
    (dict(decoder_sparse_step=0), "llama.decoder_sparse_step must be >= 1"),
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"], router_jitter_noise=0.1),
     "router_jitter_noise=0.1"),
])
def test_moe_layouts_not_built_are_one_line_naming_the_field(tmp_path, changes, message):
    moe_config("qwen3_moe").to_hf_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    import json

    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(UserError, match=f"^{path}: {message}") as error:
        hf.read_hf_config(str(tmp_path))
    assert "\n" not in str(error.value)
    from easylm.models import registry

    if "qwen3_next" in message:  # the generic commands read it with the Qwen3.5 family
        assert registry.family_of(f"hf::{tmp_path}") == "qwen3_5"
    elif "not built" in message:  # the generic commands' choice of family says the same
        with pytest.raises(UserError, match=f"^{path}: {message}"):
            registry.family_of(f"hf::{tmp_path}")


def test_dense_layers_among_the_experts_serve_and_export_as_transformers(tmp_path):
    """Qwen3-MoE with decoder_sparse_step=2 and mlp_only_layers=[1] (layers 0, 1, 2 a gated
    MLP of intermediate_size, layer 3 experts), saved by transformers: the serving engine's
    log-probabilities = transformers' (a log-probability moves by twice the logits' error,
    `moe_rel`), also with scanned layers (one repeat of the 4-layer pattern); the twin
    skips the dense MLPs (their down_proj zeroed). The export writes the file's tensors
    back bit for bit and config.json's layout."""
    import json

    from easylm.serving.engine import Engine

    config = moe_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                        mlp_only_layers="1")
    assert config.layer_kinds() == ("dense", "dense", "dense", "full_attention")
    model = hf_variant(config)
    model.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["decoder_sparse_step"], written["mlp_only_layers"]) == (2, [1])
    read, params = hf.load_hf_params(str(tmp_path / "hf"))
    assert read == config
    assert read.num_parameters() == sum(p.numel() for p in model.parameters())
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, 2 * T + 1)
    with torch.no_grad():
        logits = model(torch.tensor(tokens[None, :-1])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[np.arange(2 * T), tokens[1:]].numpy()
    atol = 2 * moe_rel(config) * float(logits.abs().max())

    def served(config, p):
        engine = Engine({"batch_size": 1, "seq_length": 64}, FAMILY.bind(config), p)
        return engine.score([tokens[:-1].tolist()], [tokens[1:].tolist()])[0][0]

    assert_close(served(config, params), expected, rel=atol, scale=1.0)
    scanned = config.replace(scan_layers=True)
    stacked = hf.load_hf_params(str(tmp_path / "hf"), scan_layers=True)[1]
    assert sorted(stacked["model"]["layers"]) == ["slot0", "slot1", "slot2", "slot3"]
    assert_close(served(scanned, stacked), expected, rel=atol, scale=1.0)
    from easylm.variants.lora import flat, nested

    skipped = nested({path: jnp.zeros_like(x) if path.endswith("mlp/down_proj/kernel") else x
                      for path, x in flat(params).items()})
    assert_differs(served(config, skipped), expected, rel=atol, scale=1.0)
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for tree, layout in ((params, config), (stacked, scanned)):
        back = dict(hf.to_hf(tree, layout))
        assert sorted(back) == sorted(saved)
        assert all(np.array_equal(back[key], saved[key]) for key in saved)
    written = config.to_hf_config()
    assert (written.decoder_sparse_step, written.mlp_only_layers) == (2, [1])


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_train_serve_and_export_through_the_public_commands(variant, tmp_path, capsys):
    """`python -m easylm.train --load_checkpoint=hf::DIR` on a tiny random Qwen3-MoE (or
    Mixtral, its window shorter than the rows) lowers the loss and logs the router's numbers; the checkpoint its serve line names answers
    /v1/completions with transformers' greedy continuation of the export that
    `python -m easylm.convert_easylm_to_hf` writes (which it verifies against our
    logits). In process, as the commands run them."""
    from fastapi.testclient import TestClient

    from easylm import convert_easylm_to_hf, flags, train
    from easylm.data.tokenizer import load_tokenizer
    from easylm.serving import cli as serving_cli

    mixtral = dict(model_type="mixtral", sliding_window=8, intermediate_size=32,
                   moe_intermediate_size=0)
    config = LLaMAConfig.from_preset("debug_moe", **(mixtral if variant == "mixtral" else {}))
    torch.manual_seed(0)
    hf_variant(config).save_pretrained(tmp_path / "hf")
    lr = "--optimizer.adamw_optimizer.lr=3e-3"
    train.main(["train", f"--load_checkpoint=hf::{tmp_path / 'hf'}", "--total_steps=4",
                "--log_freq=1", "--train_dataset.json_dataset.seq_length=16",
                "--train_dataset.json_dataset.batch_size=8", "--compilation_cache_dir=",
                f"--logger.output_dir={tmp_path / 'runs'}", lr])
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    losses = [float(line.split("loss ")[1].split()[0]) for line in steps]
    assert losses[-1] < losses[0] and "aux_loss" in steps[0] and "expert load" in steps[0]
    final = out.split("--load_checkpoint=params::")[1].split()[0]

    convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{final}",
                               f"--output_dir={tmp_path / 'export'}"])
    assert "verify: max |logit difference| vs transformers" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")

    argv = ["serve", f"--load_checkpoint=params::{final}", "--tokenizer=embedded",
            "--seq_length=32", "--batch_size=1", "--mesh_dim=1,-1,1"]
    app, batcher = serving_cli.build(FAMILY, flags.parse(serving_cli.default_config(FAMILY),
                                                         serving_cli.help_entries(FAMILY), argv))
    prompt = [1, 7, 8, 9, 10]
    try:
        response = TestClient(app, base_url="http://127.0.0.1").post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                     "temperature": 0}).json()
    finally:
        batcher.stop()
    with torch.no_grad():
        ids = exported.eval().generate(torch.tensor([prompt]), max_new_tokens=6,
                                       do_sample=False)[0][len(prompt):].tolist()
    ids = ids[:ids.index(config.eos_token_id)] if config.eos_token_id in ids else ids
    text = load_tokenizer("embedded").decode(ids, skip_special_tokens=True)
    assert response["choices"][0]["text"] == text


def test_a_train_step_over_ep_equals_one_over_fsdp():
    """--mesh_dim=dp=1,fsdp=2,ep=4 (each device 2 of the 8 experts, pairs exchanged by
    all-to-all) and --mesh_dim=1,8,1 (every device all experts): the same step's loss,
    router losses, expert load, gradient norm and updated parameters."""
    from test_trainer import Runner, constant_lr_optimizer, make_batch

    from easylm import variants
    from ml_collections import ConfigDict

    flags = model_flags.flag_config(FAMILY, "debug_moe")
    flags.num_hidden_layers = 1  # two compiles of a sharded step: one layer's worth
    model = variants.build(FAMILY, ConfigDict(dict(llama=flags, dtype="fp32",
                                                   param_dtype="fp32")))
    batch = make_batch(batch_size=8, seq_length=T)
    # ... and with the sequence split over sp=2 too (context parallelism: each device
    # routes the tokens it holds).
    steps = [Runner(model, constant_lr_optimizer(1e-2), mesh, devices=8).step(batch)
             for mesh in ("dp=1,fsdp=2,ep=4", "dp=1,fsdp=2,sp=2,ep=2", "1,8,1")]
    # The loss is ~ln 512 and the aux term ~1: the forward pass's error relative to them.
    rel = 2 * moe_rel(LLaMAConfig.from_preset("debug_moe", num_hidden_layers=1))
    for step in steps[:2]:
        for key in ("loss", "ce_loss", "aux_loss", "z_loss", "gradient_norm", "param_norm"):
            assert step[key] == pytest.approx(steps[-1][key], rel=rel), key
        for key in ("moe_load_max", "moe_load_min", "moe_dropped"):
            assert step[key] == steps[-1][key], key
