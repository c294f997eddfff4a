"""LoRA and QLoRA through the trainer (`python -m easylm.llama.train --lora.rank=...`):
step 0 computes the base model, only adapters train and have optimizer state, the base
(read from hf::DIR) never moves, checkpoints hold adapters and a fingerprint of the base
(megabytes, not the model), a resume on another base is refused, kill -9 and resume is
bitwise an uninterrupted run, and a QLoRA run learns as a bf16-base run does."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from cli_utils import one_line_error
from flax import traverse_util
from test_checkpoint import ENV, command, data_path, metrics, run_until  # noqa: F401
from transformers import LlamaForCausalLM as HFLlama

from easylm import flags, variants
from easylm.errors import UserError
from easylm.llama import convert_easylm_to_hf as convert, train
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.variants.adapters import Adapters
from easylm.llama.hf import load_hf_params
from easylm.llama.model import LLaMAForCausalLM
from easylm.models.decoder import stack_layers, unstack_layers
from easylm.runtime import checkpoint
from easylm.runtime.sharding import path_to_string
from easylm.serving import cli as serving_cli
from easylm.training import trainer
from easylm.training.loop import loop
from easylm.training.options import run_directory
from easylm.training.setup import start
from easylm.variants.lora import DEFAULT_TARGET_MODULES, LoraConfig

# nf4 blocks need kernels' input dimensions to be multiples of 64.
HF_SHAPE = dict(num_hidden_layers=2, rope_theta=50000.0)


def make_hf(directory, seed=0):
    torch.manual_seed(seed)
    model = HFLlama(LLaMAConfig.from_preset("debug", **HF_SHAPE).to_hf_config()).eval()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("hf") / "base")


def parse(tmp_path, *argv):
    return train.parse_flags([
        "train", "--lora.rank=4", "--total_steps=3", "--log_freq=1",
        "--train_dataset.json_dataset.seq_length=32", "--train_dataset.json_dataset.batch_size=4",
        f"--logger.output_dir={tmp_path / 'runs'}", "--logger.experiment_id=run",
        "--compilation_cache_dir=", "--dtype=fp32", "--mesh_dim=1,2,-1", *argv])


def same_bits(a, b) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(leaves_a, leaves_b))


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def directory_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(directory) for name in names)


# Arrays of a checkpoint are stored raw, one file per chunk ("0.0", "1.0", ...); everything
# else is orbax's and our metadata (JSON: the flags, shardings, checksums, the data state).
CHUNK = re.compile(r"\d+(\.\d+)*")
SCALARS = 1024   # the step, Adam's count, the RNG key: a few bytes each, padded


def array_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(directory) for name in names
               if CHUNK.fullmatch(name))


def losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def lora_run(config, checks=None):
    """Train `config`; `checks(run)` sees the run before its first step. Returns (the run,
    its state before and after, as host arrays)."""
    with contextlib.ExitStack() as cleanup:
        run = start(config, FAMILY, cleanup)
        before = jax.device_get(run.state)
        if checks is not None:
            checks(run)
        loop(run)
        return run, before, jax.device_get(run.state)


STEPS = 40


def test_qlora_starts_as_the_base_trains_adapters_only_and_learns_like_bf16(hf_dir, tmp_path,
                                                                         capsys):
    # lm_head adapted too: on a random base, the rest alone barely learns in a few steps.
    common = [f"--load_checkpoint=hf::{hf_dir}", f"--total_steps={STEPS}", "--lora.rank=8",
              "--lora.target_modules=(proj|lm_head)/kernel$", "--lora.dropout=0.05",
              "--optimizer.adamw_optimizer.lr=1e-2", "--optimizer.adamw_optimizer.end_lr=1e-2"]
    config = parse(tmp_path, *common, "--lora.base_dtype=nf4")
    lm_config = LLaMAConfig.from_preset("debug", **HF_SHAPE)
    lm = Adapters(FAMILY).lora_model(lm_config, LoraConfig.from_flags(config.lora))
    ids = np.random.RandomState(0).randint(0, 512, (2, 16))

    def checks(run):
        # Step 0: the LoRA model's logits are the base model's on the stored base, bitwise.
        base = jax.jit(lambda b: LLaMAForCausalLM(lm_config).apply(
            {"params": lm.dequantized_base(b)}, ids))(run.state.frozen["base"])
        adapted = jax.jit(lambda b, a: lm.apply(b, a, ids))(run.state.frozen["base"], run.state.params)
        assert same_bits(base, adapted)
        # Stored quantized on the devices: 4-bit values.
        q_proj = traverse_util.flatten_dict(run.state.frozen["base"], sep="/")[
            "model/layers/0/self_attn/q_proj/kernel"]
        assert q_proj.array.qvalue.dtype == jnp.uint4
        # Optimizer state exists for the adapters alone.
        moments = {path_to_string(p) for p, x in
                   jax.tree_util.tree_leaves_with_path(run.state.opt_state) if x.ndim}
        assert moments and all(p.endswith(("kernel_lora_a", "kernel_lora_b")) for p in moments)

    run, before, after = lora_run(config, checks)
    assert same_bits(after.frozen, before.frozen)  # the base never moves...
    assert not same_bits(after.params, before.params)  # ...while the adapters do
    # The checkpoint: adapters, their Adam moments and a reference to the base, not the base.
    final = os.path.join(run.run_dir, "checkpoints", str(STEPS))
    reference = checkpoint.read_metadata(final)["frozen"]
    assert reference["source"] == f"hf::{hf_dir}" and len(reference["fingerprint"]) == 16
    stored = checkpoint.stored_tree(final, "params")
    assert sorted(traverse_util.flatten_dict(stored, sep="/")) == sorted(
        traverse_util.flatten_dict(before.params, sep="/"))
    # Exact resume needs AdamW's two moments: the arrays are 3x the fp32 adapters (2x with
    # bf16 moments: the int8 test), plus the metadata; the base is not stored.
    adapters = nbytes(before.params)
    assert 3 * adapters <= array_bytes(final) <= 3 * adapters + SCALARS
    assert directory_bytes(final) - array_bytes(final) <= 256 * 1024

    # Export: a PEFT directory and a merged HF model, each verified against peft or
    # transformers by the command; the merged model is the source base (not its nf4
    # rounding) with the adapters folded in: PEFT's model of the adapter on that base.
    for mode in ("adapter", "merged"):
        convert.main(["convert", f"--load_checkpoint=params::{final}", f"--lora_mode={mode}",
                      f"--output_dir={tmp_path / mode}", "--verify_tolerance=1e-4"])
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")
    with torch.no_grad():
        merged = HFLlama.from_pretrained(tmp_path / "merged").eval()(torch.tensor(ids)).logits
    from peft import PeftModel

    with torch.no_grad():
        peft = PeftModel.from_pretrained(HFLlama.from_pretrained(hf_dir), tmp_path / "adapter")
        adapted = peft.eval()(torch.tensor(ids)).logits.numpy()
        base = HFLlama.from_pretrained(hf_dir).eval()(torch.tensor(ids)).logits.numpy()
    # fp32 logits of O(1) after two layers, summed over <= 128 terms.
    assert np.abs(merged.numpy() - adapted).max() <= 1e-4
    assert np.abs(merged.numpy() - base).max() > 100 * 1e-4  # the adapters changed something
    other = make_hf(tmp_path / "other_base", seed=1)
    capsys.readouterr()
    assert "was trained on a frozen base (hf::" in one_line_error(convert.main, [
        "convert", f"--load_checkpoint=params::{final}", "--lora_mode=merged",
        f"--output_dir={tmp_path / 'other'}", f"--lora_base=hf::{other}"], capsys)
    assert not os.path.exists(tmp_path / "other")
    # Serving: the base plus --lora_checkpoint (the run's checkpoint or the PEFT export),
    # merged as it loads.
    served = []
    for adapters in (final, tmp_path / "adapter"):
        config = flags.parse(serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY),
                             ["serve", f"--load_checkpoint=hf::{hf_dir}", "--dtype=fp32",
                              f"--lora_checkpoint={adapters}", "--pre_compile=False"])
        served.append(jax.device_get(serving_cli.load_engine(FAMILY, config)[0].params))
    assert same_bits(served[0], served[1])
    hf_params = load_hf_params(str(hf_dir), scan_layers=False)[1]
    want = jax.device_get(jax.jit(lm.merge)(hf_params, after.params))
    for a, b in zip(jax.tree.leaves(served[0]), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # W + s A B: one fp32 rounding
    assert not same_bits(served[0], hf_params)

    # Acceptance 4: QLoRA lowers the loss as LoRA on a bf16 base does (the same data and
    # seed; the mean of the last quarter of the steps, one batch each, within 10%). The
    # loss falls from ln(512) = 6.24 to about 4.8 (both bases), and nf4 stays within 5%.
    bf16, _, _ = lora_run(parse(tmp_path, *common, "--lora.base_dtype=bf16",
                                "--logger.experiment_id=bf16"))
    qlora_losses, bf16_losses = losses(run.run_dir), losses(bf16.run_dir)
    tail = lambda values: float(np.mean(values[-STEPS // 4:]))
    assert tail(bf16_losses) < 0.85 * bf16_losses[0]  # it learns...
    assert abs(tail(qlora_losses) - tail(bf16_losses)) <= 0.1 * tail(bf16_losses)  # ...alike


def test_sharded_scanned_rematerialised_chunked_accumulated_equals_plain(hf_dir, tmp_path):
    # The same QLoRA run data-parallel (8,1,1: the model whole on each device), unscanned,
    # and on a 2,2,2 mesh with scanned layers, remat, the chunked loss and 2 micro-batches:
    # each only reorders fp32 sums.
    from numerics import forward_rel

    common = [f"--load_checkpoint=hf::{hf_dir}", "--lora.rank=8", "--lora.base_dtype=nf4",
              "--optimizer.adamw_optimizer.lr=1e-3", "--train_dataset.json_dataset.batch_size=8"]
    everything = ["--mesh_dim=2,2,2", "--llama.scan_layers=True",
                  "--llama.remat_policy=nothing_saveable", "--llama.loss_chunk_size=32",
                  "--optimizer.accumulate_gradient_steps=2"]
    runs = {}
    for name, argv in (("plain", ["--mesh_dim=8,1,1"]), ("everything", everything),
                       ("seed", ["--mesh_dim=8,1,1", "--seed=1", "--total_steps=1"])):
        run, _, _ = lora_run(parse(tmp_path, *common, *argv, f"--logger.experiment_id={name}"))
        with open(os.path.join(run.run_dir, "metrics.jsonl")) as f:
            runs[name] = [json.loads(line) for line in f]
    # A mean over 256 tokens of a 2-layer forward (and, for the gradient, its backward);
    # Adam's first steps move each adapter by about lr, so 3 steps stay as close.
    rel = 2 * forward_rel(LLaMAConfig.from_preset("debug", **HF_SHAPE), 32)
    for plain, other in zip(runs["plain"], runs["everything"], strict=True):
        for key in ("loss", "gradient_norm"):
            assert other[key] == pytest.approx(plain[key], rel=rel), (plain["step"], key)
    # The negative twin: other adapters (another seed) are seen at step 1.
    assert runs["seed"][0]["gradient_norm"] != pytest.approx(runs["plain"][0]["gradient_norm"],
                                                             rel=100 * rel)


def test_an_int8_base_from_params_in_bf16_exports_both_ways(hf_dir, tmp_path):
    # As a user on a GPU would: the base converted to an easylm checkpoint (its config
    # read from it, no --llama.* flags), int8, bf16 compute; then both exports.
    from easylm.llama import convert_hf_to_easylm

    converted = tmp_path / "params"
    convert_hf_to_easylm.main(["convert", f"--hf_model={hf_dir}", f"--output_dir={converted}"])
    run, before, after = lora_run(parse(tmp_path, f"--load_checkpoint=params::{converted}",
                                        "--lora.base_dtype=int8", "--dtype=bf16",
                                        "--optimizer.state_dtype=bf16"))
    assert after.frozen["base"]["model"]["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    final = os.path.join(run.run_dir, "checkpoints", "3")
    # The moments in bf16: a checkpoint's arrays are 2x the fp32 adapters.
    adapters = nbytes(before.params)
    assert 2 * adapters <= array_bytes(final) <= 2 * adapters + SCALARS
    assert checkpoint.read_metadata(final)["frozen"]["dtype"] == "bfloat16"
    # The exports read the base again (in fp32 here), recognise it by its fingerprint and
    # verify against peft and transformers.
    for mode in ("adapter", "merged"):
        convert.main(["convert", f"--load_checkpoint=params::{final}", f"--lora_mode={mode}",
                      f"--output_dir={tmp_path / mode}", "--verify_tolerance=1e-4"])
        assert os.path.isdir(tmp_path / mode)
    # An easylm checkpoint is no base peft could load: the field is left empty.
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] is None


def test_merged_export_is_peft_on_the_source_base(hf_dir, tmp_path):
    # A LoRA run on an fp32 HF base with its base stored bf16 (one flag away from the
    # default): the merged export is the source fp32 base plus s·A·B, so PEFT's model of
    # the exported adapter on that base is the merged model, and every tensor no adapter
    # reaches is the source's, bit for bit (reading the run's bf16 base instead moved the
    # logits by 0.15 on a real model, and rounded the embeddings and norms).
    from peft import PeftModel
    from safetensors.numpy import load_file

    run, _, _ = lora_run(parse(tmp_path, f"--load_checkpoint=hf::{hf_dir}", "--lora.rank=8",
                               "--lora.base_dtype=bf16", "--total_steps=3",
                               "--optimizer.adamw_optimizer.lr=1e-2"))
    final = os.path.join(run.run_dir, "checkpoints", "3")
    for mode in ("adapter", "merged"):
        convert.main(["convert", f"--load_checkpoint=params::{final}", f"--lora_mode={mode}",
                      f"--output_dir={tmp_path / mode}", "--verify=False"])
    with open(tmp_path / "adapter" / "adapter_config.json") as f:  # peft loads it alone
        assert json.load(f)["base_model_name_or_path"] == str(hf_dir)
    source, merged = (load_file(os.path.join(d, "model.safetensors"))
                      for d in (hf_dir, tmp_path / "merged"))
    assert sorted(source) == sorted(merged)
    adapted = [name for name in source if name.endswith("_proj.weight")]
    for name in source:
        assert merged[name].dtype == np.float32, name
        assert same_bits(merged[name], source[name]) == (name not in adapted), name
    with open(tmp_path / "merged" / "config.json") as f:
        assert json.load(f)["dtype"] == "float32"
    ids = torch.tensor(np.random.RandomState(0).randint(0, 512, (2, 32)))
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(HFLlama.from_pretrained(hf_dir),
                                           tmp_path / "adapter").eval()(ids).logits.numpy()
        ours = HFLlama.from_pretrained(tmp_path / "merged").eval()(ids).logits.numpy()
        base = HFLlama.from_pretrained(hf_dir).eval()(ids).logits.numpy()
    # fp32 logits of O(1) after two layers, W + s·A·B folded in one fp32 rounding.
    assert np.abs(ours - theirs).max() <= 1e-4
    assert np.abs(ours - base).max() > 100 * 1e-4  # the negative twin: the adapters moved it


def test_lora_base_dtype_follows_dtype():
    def base_dtype(*argv):
        return variants.build(FAMILY, train.parse_flags(["train", "--lora.rank=4", *argv])).frozen.dtype

    assert base_dtype("--dtype=fp32") == "fp32"
    assert base_dtype("--dtype=bf16") == "bf16"
    assert base_dtype("--dtype=fp32", "--lora.base_dtype=bf16") == "bf16"


def test_lora_flags_name_the_run_directory_only_when_lora_is_on():
    # Runs without LoRA keep the directories they had before --lora.* existed, so the
    # same command still resumes them.
    def run_dir(*argv):
        config = train.parse_flags(["train", *argv])
        return run_directory(config, "llama", variants.unused_flags(FAMILY, config))

    assert run_dir("--lora.alpha=32", "--lora.base_dtype=nf4") == run_dir()
    assert run_dir("--lora.rank=8") != run_dir()
    assert run_dir("--lora.rank=8", "--lora.alpha=32") != run_dir("--lora.rank=8")


def test_resume_on_another_base_is_refused(tmp_path):
    base = make_hf(tmp_path / "base")
    trainer.train(parse(tmp_path, f"--load_checkpoint=hf::{base}", "--total_steps=1"), FAMILY)
    first = tmp_path / "runs" / "run" / "checkpoints" / "1"
    with pytest.raises(UserError, match=r"a LoRA run \(--lora.rank=4\) trains adapters on a "
                                        r"base: give the base as hf::, params:: or"):
        trainer.train(parse(tmp_path, f"--load_checkpoint=trainstate::{first}",
                            "--logger.experiment_id=other"), FAMILY)
    make_hf(base, seed=1)  # the base directory now holds other weights
    with pytest.raises(UserError, match=r"checkpoints/1 was trained on a frozen base \(hf::.*\) "
                                        r"with fingerprint \w+, but hf::.* now gives \w+"):
        trainer.train(parse(tmp_path, f"--load_checkpoint=hf::{base}", "--total_steps=2"),
                      FAMILY)


@pytest.mark.parametrize("argv, there, here", [
    (["--lora.rank=8"], "--lora.rank=4", "--lora.rank=8"),
    (["--lora.rank=0"], "--lora.rank=4", "--lora.rank=0"),
    (["--lora.target_modules=q_proj/kernel$"], f"--lora.target_modules={DEFAULT_TARGET_MODULES}",
     "--lora.target_modules=q_proj/kernel$"),
    (["--lora.alpha=32"], "--lora.alpha=16.0", "--lora.alpha=32.0"),
    (["--lora.base_dtype=bf16"], "--lora.base_dtype=fp32", "--lora.base_dtype=bf16"),
    (["--llama.scan_layers=True"], "--llama.scan_layers=False", "--llama.scan_layers=True"),
])
def test_resume_under_other_lora_settings_names_the_flag(lora_checkpoint, argv, there, here):
    # An intact checkpoint of a run with other settings is not damaged, and the run's
    # base has not moved: the flag that differs, recorded and given (a changed alpha would
    # load and train adapters whose effect is scaled otherwise).
    tmp_path, final = lora_checkpoint
    with pytest.raises(UserError) as error:
        trainer.train(parse(tmp_path, "--total_steps=2", "--resume=True", *argv), FAMILY)
    assert str(error.value) == (f"{final} was saved by a run with {there}, this run has "
                                f"{here}: resume with {there}, or start a new run (another "
                                f"--logger.experiment_id)")


def test_resume_of_a_full_run_as_lora_or_another_shape_is_no_damage(lora_checkpoint):
    tmp_path, final = lora_checkpoint
    # A full fine-tune's directory (a config's fixed --logger.experiment_id) under LoRA.
    trainer.train(parse(tmp_path, "--lora.rank=0", "--total_steps=1",
                        "--logger.experiment_id=full"), FAMILY)
    full = tmp_path / "runs" / "full" / "checkpoints" / "1"
    with pytest.raises(UserError, match=rf"^{full} was saved by a run with --lora.rank=0, this "
                                        r"run has --lora.rank=4: resume with --lora.rank=0"):
        trainer.train(parse(tmp_path, "--total_steps=2", "--resume=True",
                            "--logger.experiment_id=full"), FAMILY)
    # A shape no recorded setting explains: the parameter, not damage.
    with pytest.raises(UserError) as error:
        trainer.train(parse(tmp_path, "--total_steps=2", "--resume=True",
                            "--llama.num_hidden_layers=1"), FAMILY)
    assert str(error.value).startswith(f"{final} holds other parameters than this run's flags "
                                       f"describe (model/layers/1/")
    assert "damaged" not in str(error.value)


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """(tmp_path, the final checkpoint of a 1-step LoRA run on a random base, rank 4)."""
    tmp_path = tmp_path_factory.mktemp("resume")
    trainer.train(parse(tmp_path, "--total_steps=1"), FAMILY)
    return tmp_path, tmp_path / "runs" / "run" / "checkpoints" / "1"


@pytest.mark.slow
def test_sigkill_then_resume_of_a_lora_run_is_bitwise_identical(data_path, tmp_path):
    steps = 16  # test_checkpoint's run (a checkpoint every 5 steps), shorter, with LoRA
    lora = ["--lora.rank=4", "--lora.dropout=0.1"]  # dropout: the per-step RNG resumes too

    def cmd(output_dir):
        shorter = [f"--total_steps={steps}", f"--optimizer.adamw_optimizer.lr_decay_steps={steps}"]
        return [arg for arg in command(data_path, output_dir)
                if not arg.startswith(("--total_steps=", "--optimizer.adamw_optimizer.lr_decay"))
                ] + shorter + lora

    reference = subprocess.run(cmd(tmp_path / "a"), env=ENV, capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr[-3000:]
    kill_step = random.randint(6, 13)
    (tmp_path / "b").mkdir()
    code, _, _ = run_until(cmd(tmp_path / "b"), tmp_path / "b", kill_step, signal.SIGKILL)
    assert code == -signal.SIGKILL
    resumed = subprocess.run(cmd(tmp_path / "b"), env=ENV, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loading trainstate::{tmp_path}/b/run/checkpoints/" in resumed.stdout
    want, got = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert sorted(got) == list(range(1, steps + 1))
    for step, line in got.items():  # JSON floats round-trip exactly: this is bitwise
        for key in ("loss", "gradient_norm", "param_norm"):
            assert line[key] == want[step][key], (step, key, kill_step)


# ----------------------------------------- where training meets serving and evaluation

# The runs the trainer can make, each one step: (its flags beyond `parse`'s, the run whose
# final checkpoint is its base, if any). Full fine-tuning from a HF directory; scanned from
# an unscanned params:: checkpoint; LoRA (bf16 base) unscanned on that scanned checkpoint;
# QLoRA from hf::, unscanned and scanned (the command).
VARIANTS = {
    "full": (["--lora.rank=0", "--load_checkpoint=hf::{hf}"], None),
    "full-scanned": (["--lora.rank=0", "--load_checkpoint=params::{converted}",
                      "--llama.scan_layers=True"], None),
    "lora": (["--lora.rank=4", "--lora.base_dtype=bf16"], "full-scanned"),
    "qlora": (["--lora.rank=8", "--lora.base_dtype=nf4", "--load_checkpoint=hf::{hf}"], None),
    "qlora-scanned": (["--lora.rank=8", "--lora.base_dtype=nf4", "--llama.scan_layers=True",
                       "--load_checkpoint=hf::{hf}"], None),
}


@pytest.fixture(scope="module")
def trained(hf_dir, tmp_path_factory):
    """name -> (final checkpoint, {'serve it': argv, 'eval it': argv}) of each VARIANTS
    run, trained once (one step) on first use; 'converted': the base as params::."""
    import io
    import shlex

    from easylm.llama import convert_hf_to_easylm

    root = tmp_path_factory.mktemp("variants")
    converted = root / "converted"
    convert_hf_to_easylm.main(["convert", f"--hf_model={hf_dir}", f"--output_dir={converted}"])
    runs = {"converted": (str(converted), {})}

    def get(name):
        if name not in runs:
            argv, base = VARIANTS[name]
            argv = [a.format(hf=hf_dir, converted=converted) for a in argv]
            if base:
                argv.append(f"--load_checkpoint=params::{get(base)[0]}")
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                final = trainer.train(parse(root, *argv, "--total_steps=1",
                                            f"--logger.experiment_id={name}"), FAMILY)
            lines = {line.split(":", 1)[0]: shlex.split(line.split(":", 1)[1])[3:]
                     for line in out.getvalue().splitlines()
                     if line.startswith(("serve it:", "eval it:"))}
            runs[name] = (final, lines)
        return runs[name]

    return get


def is_scanned(params) -> bool:
    return "0" not in params["model"]["layers"]


def in_layout(params, scanned: bool):
    """`params` (2 layers) with their layers stacked or not (the tests' own conversion)."""
    if is_scanned(params) == scanned:
        return params
    return stack_layers(params) if scanned else unstack_layers(params)


def as_stored(directory):
    """A checkpoint's parameters on the host, in the layout it stored them in."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.device_get(checkpoint.load_params(f"params::{directory}", jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        checkpoint.stored_tree(directory, "params"))))


def load_served(argv, *extra):
    """The engine's parameters as `python -m easylm.llama.serve ARGV` loads them."""
    config = flags.parse(serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY),
                         ["serve", *argv, "--pre_compile=False", *extra])
    return serving_cli.load_engine(FAMILY, config)[0].params


# qlora-scanned extended (24.6 s of CI's summed time): in CI a scanned QLoRA run from hf::
# is served and evaluated from its printed lines as the model it trained
# (tests/test_combinations.py's next_token-mixture-qlora-True-1 and Gemma's
# next_token-chat-qlora-True-2), and the qlora case here checks the int8 line and where
# eval writes.
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.extended)
                                     if v == "qlora-scanned" else v for v in VARIANTS])
def test_the_printed_serve_and_eval_lines_load_every_variant(variant, trained, hf_dir):
    """Each run's `serve it:` line loads (and with --quantize=int8 on top), and so does its
    `eval it:` line; the served model is the one trained: the run's own parameters, or
    its adapters (read in the run's layout, served in the base's) folded into the base."""
    from easylm.llama import eval as eval_cli

    final, lines = trained(variant)
    assert sorted(lines) == ["eval it", "serve it"]
    assert lines["eval it"][-1] == "--tasks=TASKS"
    served = jax.device_get(load_served(lines["serve it"]))
    load_served(lines["serve it"], "--quantize=int8")
    config = flags.parse(eval_cli.model_config(), eval_cli.help_entries(),
                         ["eval", *lines["eval it"][:-1], "--pre_compile=False"])
    assert eval_cli.load(config).engine.params is not None
    # The eval line's results go beside the run's checkpoint (for LoRA: its adapters'),
    # as docs/evaluation.md says; 4280dbe put a LoRA run's beside the base (<base>-eval/).
    config = flags.parse(eval_cli.default_config(), eval_cli.help_entries(),
                         ["eval", *lines["eval it"]])
    assert eval_cli.output_directory(config) == final.rstrip("/") + "-eval"
    stored = as_stored(final)
    if VARIANTS[variant][0][0] == "--lora.rank=0":
        assert same_bits(served, stored)
        return
    # Served in the layout of the base it names (its config.json's, its checkpoint's).
    scanned = is_scanned(served)
    assert scanned == (variant == "lora")  # its base: the scanned full run's checkpoint
    base = (load_hf_params(str(hf_dir))[1] if variant.startswith("qlora") else
            as_stored(trained("full-scanned")[0]))
    metadata = checkpoint.read_metadata(final)
    lora = LoraConfig(**{k.split(".")[1]: v for k, v in metadata["flags"].items()
                         if k.startswith("lora.")})
    lm = Adapters(FAMILY).lora_model(LLaMAConfig(**metadata["llama_config"]).replace(scan_layers=scanned), lora)
    want = jax.device_get(jax.jit(lm.merge)(base, in_layout(stored, scanned)))
    for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # W + s A B: one fp32 rounding


def test_adapters_on_another_base_are_refused_by_serve_eval_and_convert(trained, tmp_path,
                                                                        capsys):
    """Same shapes, other weights: serve, eval and convert each refuse in one line naming
    both bases and fingerprints; the fingerprint is of the base as the run stored it (nf4),
    recomputed from the served fp32 or bf16 weights, or read again in fp16. (A scanned
    run's base, checked in the run's layout, is accepted in the test above.)"""
    from easylm.llama import eval as eval_cli, serve

    final, lines = trained("qlora")
    other = make_hf(tmp_path / "other", seed=1)
    serve_argv = [f"--load_checkpoint=hf::{other}" if a.startswith("--load_checkpoint=") else a
                  for a in lines["serve it"]]
    mismatch = (rf"{final} was trained on a frozen base \(hf::.*/base\) with fingerprint "
                rf"(\w+), but hf::{other} has fingerprint (\w+): ")
    refused = mismatch + r"serve the adapters on their base \(--load_checkpoint=hf::.*/base\)"
    for dtype in ("fp32", "bf16", "fp16"):
        with pytest.raises(UserError, match=refused) as error:
            load_served(serve_argv, f"--dtype={dtype}")
        first, second = re.search(refused, str(error.value)).groups()
        assert first == checkpoint.read_metadata(final)["frozen"]["fingerprint"] != second
    load_served(lines["serve it"], "--dtype=fp16")  # its own base, read again: accepted
    config = flags.parse(eval_cli.model_config(), eval_cli.help_entries(),
                         ["eval", *serve_argv, "--pre_compile=False"])
    with pytest.raises(UserError, match=refused):
        eval_cli.load(config)
    capsys.readouterr()
    assert re.fullmatch(mismatch + "give the run's base with --lora_base",
                        one_line_error(convert.main, [
                            "convert", f"--load_checkpoint=params::{final}", "--lora_mode=merged",
                            f"--output_dir={tmp_path / 'merged'}", f"--lora_base=hf::{other}"],
                            capsys))
    # As a command: one line, before anything is served.
    assert re.fullmatch(refused, one_line_error(serve.main, ["serve", *serve_argv], capsys))


def test_a_lora_checkpoint_given_as_load_checkpoint_names_the_base_and_the_flag(trained):
    final, _ = trained("qlora-scanned")
    base = checkpoint.read_metadata(final)["frozen"]["source"]
    for spec in (f"params::{final}", f"trainstate_params::{final}"):
        with pytest.raises(UserError, match=rf"--load_checkpoint={spec} holds adapters trained "
                                            rf"on a frozen base, not a whole model: pass the "
                                            rf"base and the adapters, --load_checkpoint={base} "
                                            rf"--lora_checkpoint={final}$"):
            load_served([f"--load_checkpoint={spec}"])


def test_params_checkpoints_load_in_either_layout(trained):
    """An unscanned params:: checkpoint served scanned and a scanned one unscanned: the same
    numbers (the trainer's side: the full-scanned and lora runs start from such ones)."""
    for name, scanned in (("converted", True), ("full-scanned", False)):
        directory = trained(name)[0]
        served = jax.device_get(load_served([f"--load_checkpoint=params::{directory}",
                                             f"--llama.scan_layers={scanned}"]))
        assert is_scanned(served) is scanned
        assert same_bits(served, in_layout(as_stored(directory), scanned))
