"""LoRA and QLoRA through the trainer (`python -m easylm.llama.train --lora.rank=...`):
step 0 computes the base model, only adapters train and have optimizer state, the base
(read from hf::DIR) never moves, checkpoints hold adapters and a fingerprint of the base
(megabytes, not the model), a resume on another base is refused, kill -9 and resume is
bitwise an uninterrupted run, and a QLoRA run learns as a bf16-base run does."""

import contextlib
import os
import random
import signal
import subprocess

import jax
import numpy as np
import pytest
import torch
from flax import traverse_util
from transformers import LlamaForCausalLM as HFLlama

from test_checkpoint import ENV, TOTAL_STEPS, command, metrics, run_until

from easylm import checkpoint, trainer
from easylm.errors import UserError
from easylm.llama import train
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.model import LLaMAForCausalLM
from easylm.sharding import path_to_string

# nf4 blocks need kernels' input dimensions to be multiples of 64.
HF_SHAPE = dict(initializer_range=0.2, num_hidden_layers=2, rope_theta=50000.0)


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


@pytest.mark.parametrize("base_dtype", ["fp32", "nf4"])
def test_step0_is_the_base_and_only_adapters_train(hf_dir, tmp_path, base_dtype):
    config = parse(tmp_path, f"--load_checkpoint=hf::{hf_dir}", f"--lora.base_dtype={base_dtype}",
                   "--lora.dropout=0.1")
    assert config.optimizer.adamw_optimizer.lr == 2e-4  # LoRA's default from a base
    with contextlib.ExitStack() as cleanup:
        run = trainer.start(config, FAMILY, cleanup)
        frozen = jax.device_get(run.state.frozen)
        adapters = jax.device_get(run.state.params)
        # Step 0: the LoRA model's logits are the base model's on the stored base, bitwise.
        ids = np.random.RandomState(0).randint(0, 512, (2, 16))
        lm_config = LLaMAConfig.from_preset("debug", **HF_SHAPE)
        from easylm.llama.lora import lora_model
        from easylm.lora import LoraConfig

        lm = lora_model(lm_config, LoraConfig.from_flags(config.lora))
        base = jax.jit(lambda b: LLaMAForCausalLM(lm_config).apply(
            {"params": lm.dequantized_base(b)}, ids))(run.state.frozen)
        adapted = jax.jit(lambda b, a: lm.apply(b, a, ids))(run.state.frozen, run.state.params)
        assert same_bits(base, adapted)
        if base_dtype == "nf4":  # stored quantized on the devices: 4-bit values
            qvalues = [x for p, x in traverse_util.flatten_dict(frozen, sep="/").items()
                       if "q_proj" in p]
            assert any(getattr(x, "array", None) is not None for x in qvalues)
        # Optimizer state exists for the adapters alone.
        moments = {path_to_string(p) for p, x in
                   jax.tree_util.tree_leaves_with_path(run.state.opt_state) if x.ndim}
        assert moments and all(p.endswith(("kernel_lora_a", "kernel_lora_b")) for p in moments)
        step = trainer.loop(run)
        after = jax.device_get(run.state)
    assert step == 3
    assert same_bits(after.frozen, frozen)  # the base never moves...
    assert not same_bits(after.params, adapters)  # ...while the adapters do
    # The checkpoint: adapters, their Adam moments and a reference to the base, not the base.
    final = os.path.join(run.run_dir, "checkpoints", "3")
    reference = checkpoint.read_metadata(final)["frozen"]
    assert reference["source"] == f"hf::{hf_dir}" and len(reference["fingerprint"]) == 16
    stored = checkpoint.stored_tree(final, "params")
    assert sorted(traverse_util.flatten_dict(stored, sep="/")) == sorted(
        traverse_util.flatten_dict(adapters, sep="/"))
    metadata_allowance = 256 * 1024  # orbax's JSON files, the flags, the data state
    assert directory_bytes(final) <= 3 * nbytes(adapters) + metadata_allowance


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


def test_sigkill_then_resume_of_a_lora_run_is_bitwise_identical(data_path, tmp_path):
    lora = ["--lora.rank=4", "--lora.dropout=0.1"]  # dropout: the per-step RNG resumes too
    reference = subprocess.run(command(data_path, tmp_path / "a") + lora, env=ENV,
                               capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr[-3000:]
    kill_step = random.randint(6, 30)
    code, _, _ = run_until(command(data_path, tmp_path / "b") + lora, tmp_path / "b", kill_step,
                           signal.SIGKILL)
    assert code == -signal.SIGKILL
    resumed = subprocess.run(command(data_path, tmp_path / "b") + lora, env=ENV,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loading trainstate::" in resumed.stdout
    want, got = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert sorted(got) == list(range(1, TOTAL_STEPS + 1))
    for step, line in got.items():  # JSON floats round-trip exactly: this is bitwise
        for key in ("loss", "gradient_norm", "param_norm"):
            assert line[key] == want[step][key], (step, key, kill_step)
