"""LoRA and QLoRA on a mixture of experts' stacks: per-expert adapters inside the
grouped matmul, the router losses kept under LoRA, PEFT's `target_parameters` export and
import on transformers' fused expert tensors (Qwen3-MoE, Mixtral, gpt-oss), the merged
export, nf4 expert stacks, and a run through `python -m easylm.train`.

Tolerances: the models' own (tests/test_moe_models.py's `moe_rel`, tests/test_gpt_oss.py's
`tolerance`) with two more reductions a layer for the adapters' x A and (x A) B; the
negative twins (a PEFT file with its expert lora_B columns in the other order, nf4's
rounding) move the logits by far more, as the assertions show. Adapters are drawn at 0.2
so that a misplaced one stands out of a random model's logits."""

import json

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from llama_variants import hf_variant
from numerics import assert_close, assert_differs, fp32_rel
from test_gpt_oss import hf_model as gpt_oss_hf_model, tiny_config as gpt_oss_config
from test_moe_models import moe_config, moe_rel

from easylm.models.family import torch_reference
from easylm.gpt_oss import hf as gpt_oss_hf
from easylm.gpt_oss.family import FAMILY as GPT_OSS
from easylm.llama import hf as llama_hf
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY as LLAMA
from easylm.objectives.next_token import next_token_sums
from easylm.variants.adapters import Adapters
from easylm.variants.lora import LoraConfig, flat, nested

T = 16


def random_adapters(lm, seed: int = 1):
    """Every A and B drawn N(0, 0.2): an adapter that is dropped or misplaced shows."""
    leaves = flat(lm.adapter_shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return nested({path: 0.2 * jax.random.normal(key, leaf.shape)
                   for key, (path, leaf) in zip(keys, leaves.items())})


def lora_rel(rel: float, config) -> float:
    return rel + fp32_rel(max(config.hidden_size, 4), 2 * config.num_hidden_layers)


# --------------------------------------------------------------------- the families

def qwen3_moe():
    config = moe_config("qwen3_moe", num_hidden_layers=1)
    model = hf_variant(config)
    return LLAMA, config, model, llama_hf.from_hf(model.state_dict(), config), moe_rel(config)


def mixtral():
    config = moe_config("mixtral", num_hidden_layers=1)
    model = hf_variant(config)
    return LLAMA, config, model, llama_hf.from_hf(model.state_dict(), config), moe_rel(config)


def gpt_oss():
    from test_gpt_oss import tolerance

    config = gpt_oss_config(num_hidden_layers=2)
    model = gpt_oss_hf_model(config)
    return GPT_OSS, config, model, gpt_oss_hf.from_hf(model.state_dict(), config), \
        tolerance(config)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def case(request):
    """(name, family, config, transformers model, our params, tolerance, Adapters,
    LoraModel of rank 2, ids)."""
    family, config, model, params, rel = globals()[request.param]()
    adapters = Adapters(family)
    lm = adapters.lora_model(config, LoraConfig(rank=2, alpha=4.0))
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, T))
    return request.param, family, config, model, params, lora_rel(rel, config), adapters, lm, ids


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def expert_b_layout_twin(directory, twin_dir, experts: int):
    """A copy of a PEFT directory with each expert lora_B's columns taken expert-major
    (e*r + j) where PEFT reads them rank-major (j*E + e): the likeliest layout slip."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(directory, twin_dir)
    tensors = load_file(f"{directory}/adapter_model.safetensors")
    for name, b in tensors.items():
        if ".experts." in name and ".lora_B." in name:
            out, re_ = b.shape[0], b.shape[1] // experts
            tensors[name] = np.ascontiguousarray(
                b.reshape(out, experts, re_).transpose(0, 2, 1).reshape(out, -1))
    save_file(tensors, f"{twin_dir}/adapter_model.safetensors")


def test_peft_loads_the_exported_experts_with_our_logits_and_so_does_the_merge(case, tmp_path):
    """Experts are adapted by default (both fused targets, every layer); the PEFT export
    (target_parameters) loaded by `peft.PeftModel` on the transformers model gives our
    logits, and so does transformers on the merged weights (W_e + s A_e B_e); the adapters
    read back bitwise. Negative twin (on one family: the layout code is shared): the
    export with its expert lora_B columns in the other order."""
    from peft import PeftModel

    name, family, config, model, params, rel, adapters, lm, ids = case
    experts = sorted({p.split("/", 3)[-1] for p in lm.targets if "/experts/" in p})
    assert experts == ["mlp/experts/down_proj", "mlp/experts/gate_up_proj"]
    assert any(p.endswith("q_proj/kernel") for p in lm.targets)
    base, trained = lm.store_base(params), random_adapters(lm)
    ours = np.asarray(lm.apply(base, trained, jnp.asarray(ids)))
    adapters.save_peft(str(tmp_path / "peft"), lm, jax.device_get(trained), config)
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert len(written["target_parameters"]) == 2 * config.num_hidden_layers
    E = lm.adapter_shapes["model"]["layers"]["0"]["mlp"]["experts"][
        "down_proj_lora_a"].shape[0]
    expert_b_layout_twin(tmp_path / "peft", tmp_path / "twin", E)  # the layout is shared
    checks = [("peft", assert_close)] + [("twin", assert_differs)] * (name == "qwen3_moe")
    for directory, check in checks:
        peft_model = PeftModel.from_pretrained(model, str(tmp_path / directory)).eval()
        try:
            check(hf_logits(peft_model, ids), ours, rel)
        finally:
            peft_model.unload()  # the shared transformers model without adapters again
    merged = torch_reference(family, config, jax.device_get(lm.merge(base, trained)))
    assert_close(hf_logits(merged, ids), ours, rel)
    lora, back = adapters.load_peft(str(tmp_path / "peft"), config)
    assert (lora.rank, lora.alpha) == (2, 4.0)
    for path, x in flat(trained).items():
        np.testing.assert_array_equal(flat(back)[path], np.asarray(x), err_msg=path)


def test_the_router_losses_apply_under_lora():
    """The LoRA model keeps its base's router losses: with its adapters off its loss is
    the base model's, auxiliary term included (the twin: that term is far from 0; before,
    a LoRA run had no router terms at all)."""
    family, config, _, params, _ = qwen3_moe()
    lm = Adapters(family).lora_model(config, LoraConfig(rank=2))
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, T))
    full = family.bind(config.replace(output_router_logits=True, router_aux_loss_coef=0.1))
    from easylm.variants.lora_variant import Host, lora_variant

    host = Host(name=family.name, rules=full.partition_rules, head_weight=None,
                loss_chunk_size=0, matmul_parameters=0)
    lora = lora_variant(full, lm, host, "", None)
    assert lora.router_loss == full.router_loss and lora.router_loss.aux_coef > 0
    batch = {"input_tokens": jnp.asarray(ids[:, :-1]), "target_tokens": jnp.asarray(ids[:, 1:]),
             "loss_masks": jnp.ones((2, T - 1))}
    base = lm.store_base(params)
    off = lm.adapters_off(random_adapters(lm))
    ours = next_token_sums(lora, off, batch, None, base=base)
    with_aux = next_token_sums(full, params, batch, None)
    assert float(ours.loss) == pytest.approx(float(with_aux.loss), rel=1e-6)
    assert float(ours.router_loss) == pytest.approx(float(with_aux.router_loss), rel=1e-6)
    assert float(ours.router_loss) > 1e-3 * float(ours.loss)


def test_nf4_expert_stacks_are_dequantized_in_the_layer():
    """--lora.base_dtype=nf4 stores the expert stacks 4-bit (values uint4, one scale per 64
    inputs of an output, as the kernels') and the model computes on them dequantized: the
    QLoRA forward equals the float model on the dequantized base (merged), whose stacks
    the nf4 rounding moved far from the original (the twin)."""
    config = moe_config("qwen3_moe", num_hidden_layers=1, moe_intermediate_size=64)
    lm = Adapters(LLAMA).lora_model(config, LoraConfig(rank=2, base_dtype="nf4"))
    params = LLAMA.bind(config).init_params(jax.random.key(0))
    base = lm.store_base(params)
    stacks = base["model"]["layers"]["0"]["mlp"]["experts"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        E, inputs, outputs = params["model"]["layers"]["0"]["mlp"]["experts"][name].shape
        assert stacks[name].array.qvalue.dtype == jnp.uint4
        assert stacks[name].array.scale.shape == (E, inputs // 64, outputs)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (2, T)))
    adapters = random_adapters(lm)
    ours = lm.apply(base, adapters, ids)
    reference = LLAMA.bind(config).forward(lm.merge(base, adapters), ids).logits
    rel = lora_rel(moe_rel(config), config)
    assert_close(ours, reference, rel)
    dequantized = lm.dequantized_base(base)["model"]["layers"]["0"]["mlp"]["experts"]
    assert_differs(dequantized["down_proj"],
                   params["model"]["layers"]["0"]["mlp"]["experts"]["down_proj"], rel)


def dot_shapes(fn, *args) -> set:
    """Output shapes of every dot_general (ragged_dot's too) `fn` traces to, nested
    jaxprs (scan, jit, custom_vjp) included."""
    shapes = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if "dot" in eqn.primitive.name:
                shapes.update(tuple(v.aval.shape) for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes


def test_no_per_expert_delta_is_formed_in_a_forward():
    """The adapted forward computes x A_e then (x A_e) B_e on the rows: no matmul gives an
    (E, D, 2F) or (E, F, D) delta. Twin: merging does form them, and the check sees it."""
    config = moe_config("qwen3_moe", num_hidden_layers=1)
    lm = Adapters(LLAMA).lora_model(config, LoraConfig(rank=2))
    base = jax.eval_shape(lm.store_base, LLAMA.bind(config).init_params(jax.random.key(0)))
    adapters = lm.adapter_shapes
    E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
    deltas = {(E, D, 2 * F), (E, F, D)}
    ids = jnp.zeros((2, T), jnp.int32)
    assert not deltas & dot_shapes(lambda b, a: lm.apply(b, a, ids), base, adapters)
    assert deltas <= dot_shapes(lm.merge, base, adapters)


def test_qlora_through_the_public_commands_lowers_the_loss_and_exports(tmp_path, capsys):
    """`python -m easylm.train --load_checkpoint=hf::DIR --lora.rank=4
    --lora.base_dtype=nf4` on a tiny random Qwen3-MoE lowers the loss, logging the router
    terms; `convert_easylm_to_hf --lora_mode=adapter` writes the PEFT directory with the
    experts in target_parameters and verifies it with peft. In process."""
    from easylm import convert_easylm_to_hf, train

    config = LLaMAConfig.from_preset("debug_moe", moe_intermediate_size=64)
    torch.manual_seed(0)
    hf_variant(config).save_pretrained(tmp_path / "hf")
    train.main(["train", f"--load_checkpoint=hf::{tmp_path / 'hf'}", "--lora.rank=4",
                "--lora.base_dtype=nf4", "--total_steps=4", "--log_freq=1",
                "--train_dataset.json_dataset.seq_length=16",
                "--train_dataset.json_dataset.batch_size=8", "--compilation_cache_dir=",
                f"--logger.output_dir={tmp_path / 'runs'}",
                "--optimizer.adamw_optimizer.lr=3e-2"])
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    losses = [float(line.split("loss ")[1].split()[0]) for line in steps]
    assert losses[-1] < losses[0] and "aux_loss" in steps[0]
    final = out.split("--lora_checkpoint=")[1].split()[0]
    convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{final}",
                               "--lora_mode=adapter", f"--output_dir={tmp_path / 'adapter'}"])
    assert "verify: max |logit difference| vs peft" in capsys.readouterr().out
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in written["target_parameters"]
