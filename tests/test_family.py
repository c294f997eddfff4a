"""The model-family boundary: nothing generic imports a family, and a second family
(tests/toy_family.py) trains, resumes, serves, plans and benches through the generic
code unchanged."""

import ast
import json
import pathlib
import re

import jax
import numpy as np
import pytest
import toy_family
from cli_utils import one_line_error
from fastapi.testclient import TestClient

from easylm import model_flags
from easylm import bench, flags as flag_lib, plan
from easylm.errors import UserError
from easylm.models import registry
from easylm.runtime import checkpoint
from easylm.serving import cli as serving_cli
from easylm.serving.batcher import SamplingParams
from easylm.training import trainer
from easylm.training.options import default_config, family_run_defaults, help_entries

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "easylm"
# The families' packages. Modules outside a family's package allowed to import it: none.
# The generic commands reach each family through easylm/models/registry.py, which names it
# by string and imports it lazily; one family never imports another.
FAMILY_PACKAGES = tuple(dict.fromkeys(  # qwen3_5_vl lives in qwen3_5's package
    module.split(".")[1] for module in registry.FAMILIES.values()))
ENTRY_POINTS: set[str] = set()
TOY = toy_family.FAMILY


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("family", FAMILY_PACKAGES)
def test_nothing_outside_a_family_imports_it(family):
    assert (PACKAGE / family / "family.py").is_file()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        if relative.startswith(f"easylm/{family}/") or relative in ENTRY_POINTS:
            continue
        bad = {m for m in imported_modules(path)
               if m == f"easylm.{family}" or m.startswith(f"easylm.{family}.")}
        offenders += [f"{relative}: {m}" for m in sorted(bad)]
    assert offenders == []


def test_the_import_check_sees_every_import_form(tmp_path):
    # The negative twin: each way of importing the family is caught.
    source = tmp_path / "m.py"
    source.write_text("import easylm.llama.model\nfrom easylm.llama import train\n"
                      "from easylm import llama\ndef f():\n    from easylm.llama.family import FAMILY\n")
    found = {m for m in imported_modules(source) if m.startswith("easylm.llama")}
    assert found == {"easylm.llama.model", "easylm.llama", "easylm.llama.train",
                     "easylm.llama.family", "easylm.llama.family.FAMILY"}


def test_the_registry_imports_families_lazily_and_names_bad_ones():
    assert registry.get("llama").name == "llama"
    assert registry.get("toy_family:FAMILY") is TOY
    family, rest = registry.from_argv(["prog", "--family=toy_family:FAMILY", "--x=1"])
    assert family is TOY and rest == ["prog", "--x=1"]
    names = ", ".join(registry.FAMILIES)  # llama, gemma, ...: every registered family
    assert names.startswith("llama, gemma, gpt_oss, ")
    with pytest.raises(UserError, match=rf"^--family='gpt' is not one of {names} "
                                        r"\(or MODULE:ATTRIBUTE\)$"):
        registry.get("gpt")
    with pytest.raises(UserError, match=r"is not a ModelFamily$"):
        registry.get("toy_family:ToyConfig")


def test_the_generic_commands_take_the_family_of_what_they_load(tmp_path, capsys):
    """`python -m easylm.train|serve|eval` pick the family from hf::DIR's model_type (each
    LLaMA variant's is llama's), from an easylm checkpoint's metadata, or --family."""
    from easylm import serve, train
    from easylm.llama.config import ARCHITECTURES

    llama = registry.get("llama")
    for model_type in ARCHITECTURES:
        hf = tmp_path / model_type
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps({"model_type": model_type}))
        family, rest = registry.from_argv(["prog", f"--load_checkpoint=hf::{hf}"], detect=True)
        assert family is llama and rest == ["prog", f"--load_checkpoint=hf::{hf}"]
    # Not detected unless asked (every command asks: train, serve, eval, plan, bench, doctor,
    # convert).
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    argv = ["prog", f"--load_checkpoint=hf::{tmp_path / 'gpt2'}"]
    assert registry.from_argv(argv)[0] is llama
    message = one_line_error(train.main, argv, capsys)
    assert message == (f"{tmp_path / 'gpt2' / 'config.json'}: model_type 'gpt2' is not one "
                       f"easylm reads (llama: {', '.join(ARCHITECTURES)}; gemma: gemma3_text, "
                       f"gemma3; gpt_oss: gpt_oss; qwen3_5: qwen3_5_text, qwen3_5, qwen3_5_moe_text, "
                       f"qwen3_5_moe, qwen3_next; deepseek_v3: "
                       f"deepseek_v3, kimi_k25, mistral4; glm4_moe: glm4_moe; gemma4: gemma4_text, gemma4; "
                       f"olmo3: olmo3; minimax_m2: minimax_m2; qwen3_5_vl: qwen3_5, qwen3_5_moe; "
                       f"gemma4_vl: gemma4; deepseek_v32: deepseek_v32; glm_moe_dsa: glm_moe_dsa; "
                       f"llama4: llama4_text; deepseek_v4: deepseek_v4)")
    for model_type in ("gemma3_text", "gemma3"):  # gemma3: the text tower of the multimodal
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        family, _ = registry.from_argv(["prog", f"--load_checkpoint=hf::{tmp_path / model_type}"],
                                       detect=True)
        assert family is registry.get("gemma")
    # What the file lacks is the family's reader's to say; --family overrides it all.
    assert registry.from_argv(["prog", f"--load_checkpoint=hf::{tmp_path}"], True)[0] is llama
    assert registry.from_argv([*argv, "--family=toy_family:FAMILY"], True)[0] is TOY
    message = one_line_error(serve.main, ["serve", "--family=gpt"], capsys)
    assert message == (f"--family='gpt' is not one of {', '.join(registry.FAMILIES)} "
                       f"(or MODULE:ATTRIBUTE)")


def _tiny_hf_directory(name, directory, **changes):
    """config.json of family `name`'s tiny preset (all plan and doctor read of it)."""
    family = registry.get(name)
    config = family.from_preset(family.tiny_preset or family.default_preset, **changes)
    hf = config.to_hf_config()
    if name == "deepseek_v3":  # a multi-token-prediction layer, said once per command
        hf.num_nextn_predict_layers = 1
    hf.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", [name for name in registry.FAMILIES
                                  if not registry.get(name).not_in_commands])
def test_plan_and_doctor_read_every_familys_hf_directory(name, tmp_path, capsys):
    from easylm import doctor

    for main, command in ((plan.main, ["plan", "--plan.device_memory_gib=1"]),
                          (doctor.main, ["doctor", f"--logger.output_dir={tmp_path}",
                                         f"--compilation_cache_dir={tmp_path / 'cache'}"])):
        directory = _tiny_hf_directory(name, tmp_path / command[0])
        with pytest.raises(SystemExit) as e:
            main([*command, f"--load_checkpoint=hf::{directory}", "--mesh_dim=1,-1,1",
                  "--train_dataset.json_dataset.seq_length=32",
                  "--train_dataset.json_dataset.batch_size=8"])
        out, err = capsys.readouterr()
        assert e.value.code == 0, err
        if main is plan.main:
            assert out.startswith(f"plan: hf::{directory} ("), out
        notes = [line for line in err.splitlines() if "multi-token-prediction" in line]
        assert len(notes) == (name == "deepseek_v3"), err  # was 2 or 3 times


def test_plan_refuses_the_mesh_the_trainer_refuses(tmp_path, capsys):
    """Gemma 4's 6 experts over ep=4: the trainer's line, from the planner too."""
    directory = _tiny_hf_directory("gemma4", tmp_path, enable_moe_block=True, num_experts=6,
                                   top_k_experts=2, moe_intermediate_size=16)
    message = one_line_error(plan.main, [
        "plan", f"--load_checkpoint=hf::{directory}", "--mesh_dim=dp=1,fsdp=2,ep=4",
        "--plan.num_devices=8", "--train_dataset.json_dataset.batch_size=8"], capsys)
    assert message.startswith("--gemma4.num_experts=6 experts cannot be split over ep=4 of "
                              "--mesh_dim=dp=1,fsdp=2,ep=4"), message


# ------------------------------------------------- the second family, end to end


def train_flags(tmp_path, *argv):
    return flag_lib.parse(default_config(TOY), help_entries(TOY), [
        "train", "--train_dataset.json_dataset.seq_length=32",
        "--train_dataset.json_dataset.batch_size=8", "--log_freq=1", "--mesh_dim=1,-1,1",
        "--optimizer.adamw_optimizer.lr=1e-2", "--optimizer.adamw_optimizer.lr_warmup_steps=1",
        "--optimizer.adamw_optimizer.lr_decay_steps=6",
        # The three runs compile the same programs: the later ones read them from here.
        f"--compilation_cache_dir={tmp_path / 'cache'}", f"--logger.output_dir={tmp_path}",
        *argv], derived=family_run_defaults(TOY))


def losses(run_dir) -> dict[int, float]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines) if "loss" in row}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 steps at once, and 3 then 3 more resumed from the 3rd step's checkpoint."""
    tmp_path = tmp_path_factory.mktemp("toy")
    whole = trainer.train(train_flags(tmp_path, "--total_steps=6",
                                      "--logger.experiment_id=whole"), TOY)
    first = train_flags(tmp_path, "--total_steps=3", "--logger.experiment_id=split")
    trainer.train(first, TOY)
    resumed = trainer.train(train_flags(tmp_path, "--total_steps=6",
                                        "--logger.experiment_id=split"), TOY)
    return tmp_path, whole, resumed


def test_a_second_family_trains_and_resumes_exactly(trained):
    tmp_path, whole, resumed = trained
    metadata = checkpoint.read_metadata(whole)
    assert metadata["model"] == "toy" and metadata["toy_config"]["hidden_size"] == 32
    uninterrupted, split = losses(tmp_path / "whole"), losses(tmp_path / "split")
    assert sorted(uninterrupted) == list(range(1, 7))
    assert uninterrupted[6] < uninterrupted[1]  # it learns
    # Resume = uninterrupted: same device, same programs, so bit for bit.
    assert [split[s] for s in range(4, 7)] == [uninterrupted[s] for s in range(4, 7)]


def test_a_checkpoint_names_its_family_to_the_generic_commands(trained):
    _, whole, _ = trained
    for flag, spec in (("--load_checkpoint", f"params::{whole}"), ("--lora_checkpoint", whole)):
        # The toy family is not registered by name: its checkpoint says so, in one line.
        names = ", ".join(registry.FAMILIES)
        with pytest.raises(UserError, match=rf"^{spec}: its metadata names model 'toy', "
                                            rf"which is not one of {names}; pass "
                                            rf"--family=MODULE:ATTRIBUTE$"):
            registry.from_argv(["prog", f"{flag}={spec}"], detect=True)
    family, _ = registry.from_argv(["prog", "--family=toy_family:FAMILY",
                                    f"--load_checkpoint=params::{whole}"], detect=True)
    assert family is TOY


def test_a_second_family_serves_its_checkpoint(trained):
    _, whole, _ = trained
    config = flag_lib.parse(serving_cli.default_config(TOY), serving_cli.help_entries(TOY), [
        "serve", f"--load_checkpoint=params::{whole}", "--seq_length=32", "--batch_size=2",
        "--decode_steps=4"])
    app, batcher = serving_cli.build(TOY, config)
    try:
        engine = batcher.engine
        # The engine's cached decode agrees with the model's uncached forward.
        prompt = [1, 40, 41, 42]
        ids = list(prompt)
        # One program for every length: causal attention makes the padding invisible.
        forward = jax.jit(lambda tokens: engine.model.forward(engine.params, tokens).logits)
        for _ in range(6):
            padded = np.zeros((1, 16), np.int32)
            padded[0, :len(ids)] = ids
            ids.append(int(np.argmax(forward(padded)[0, len(ids) - 1])))
        generated = batcher.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0),
                                     serving_cli_tokenizer())[0]
        expected = ids[len(prompt):]
        stop = [i for i, t in enumerate(expected) if t == 2]
        assert generated.tokens == expected[:stop[0] + 1] if stop else expected
        response = TestClient(app, base_url="http://127.0.0.1").post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(prompt)
    finally:
        batcher.stop()


def serving_cli_tokenizer():
    from easylm.data.tokenizer import load_tokenizer

    return load_tokenizer("embedded")


def test_a_second_family_plans_and_benches(tmp_path):
    config = flag_lib.parse(plan.default_config(TOY), plan.help_entries(TOY), [
        "plan", "--train_dataset.json_dataset.seq_length=32",
        "--train_dataset.json_dataset.batch_size=4", "--plan.device_memory_gib=1"])
    text, fits = plan.report(config, TOY, num_devices=1, num_processes=1, budget=2 ** 30)
    assert fits and text.startswith("plan: tiny, 0.1M parameters, 2 layers | 1 devices")
    estimate = plan.estimate(config, TOY, num_devices=1)
    params = jax.eval_shape(model_flags.build(TOY, config).init_params, jax.random.key(0))
    assert estimate.parameters == sum(x.size * 4 for x in jax.tree.leaves(params))
    assert estimate.activations > 0
    config = flag_lib.parse(bench.train_config(TOY), bench._train_help(TOY), [
        "bench", "--seq_length=16", "--batch_size=8", "--steps=1", "--warmup_steps=1",
        "--mesh_dim=1,-1,1"])
    row = bench.bench_train(config, TOY)
    assert row["model"] == "tiny" and row["parameters"] == \
        model_flags.build(TOY, config).num_parameters
    assert row["tokens_per_second"] > 0 and len(row["losses"]) == 2


@pytest.mark.parametrize("model_type, why", [("llama4", "vision tower")])
def test_the_late_2026_types_not_built_are_refused_by_what_differs(tmp_path, model_type, why):
    """hf::DIR of a model_type near a family's that it does not build: one line naming what
    that model computes differently (not 'not one easylm reads')."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(UserError, match=rf"model_type '{model_type}' is not built: its "
                                        rf"{re.escape(why)}"):
        registry.family_of(f"hf::{tmp_path}")
