"""The checks every family read from a tiny random transformers directory goes through
(tests/test_olmo3.py, test_smollm3.py, ...): the served log-probabilities of a long
prompt, the train command's first loss and its export, the export of the loaded
parameters, and a PEFT adapter, each against transformers."""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from numerics import assert_close


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


def reference_logprobs(model, prompt):
    """transformers' log-probabilities of prompt[1:] after prompt[:-1], and its logits."""
    logits = torch.tensor(logits_of(model, [prompt[:-1]])[0])
    logp = torch.log_softmax(logits, -1)[np.arange(len(prompt) - 1), prompt[1:]]
    return logp.numpy(), logits.numpy()


def served_logprobs(bound, params, prompt):
    """The serving engine's log-probabilities of prompt[1:] (one slot, one bucket)."""
    from easylm.serving.engine import Engine

    length = -(-len(prompt) // 64) * 64
    engine = Engine({"batch_size": 1, "seq_length": length, "min_bucket": length}, bound,
                    params)
    return engine.score([prompt[:-1]], [prompt[1:]])[0][0]


def module_logprobs(module, params, prompt):
    """A full forward's log-probabilities of prompt[1:] (a twin's: its module as it is)."""
    out = jax.jit(lambda p, x: module.apply({"params": p}, x))(params, jnp.asarray([prompt[:-1]]))
    out = np.asarray(jax.nn.log_softmax(out[0].astype(jnp.float32), -1))
    return out[np.arange(len(prompt) - 1), prompt[1:]]


def first_batch(family):
    """The train command's first batch (rows of 32, 4 a batch: cli_utils.train_losses')."""
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.training import options

    run = options.parse_flags(family, ["train", "--train_dataset.json_dataset.seq_length=32",
                                       "--train_dataset.json_dataset.batch_size=4"])
    for batch, _ in DatasetFactory.load_dataset(run.train_dataset, load_tokenizer("embedded")):
        return batch


def check_training_command(family, directory, model, tmp_path, rel, architecture):
    """`python -m easylm.train --load_checkpoint=hf::DIR`, 3 steps: step 1's logged loss =
    transformers' mean cross-entropy on the same first batch (within `rel` of the largest
    logit, twice: a log-softmax moves by at most twice the largest logit error), the loss
    falls; the run's checkpoint exported by `python -m easylm.convert_easylm_to_hf` (whose
    --verify compares its logits with transformers') loads as `architecture`."""
    from cli_utils import train_losses

    from easylm import convert_easylm_to_hf

    losses = train_losses(directory, tmp_path)
    batch = first_batch(family)
    with torch.no_grad():
        logits = model(torch.tensor(batch["input_tokens"]).long()).logits
    nll = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), torch.tensor(batch["target_tokens"]).long().flatten(),
        reduction="none")
    mask = torch.tensor(batch["loss_masks"]).flatten()
    expected = float((nll * mask).sum() / mask.sum())
    assert abs(losses[0] - expected) <= 2 * rel * float(logits.abs().max()), (losses[0], expected)
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        convert_easylm_to_hf.main(["convert", f"--output_dir={tmp_path / 'export'}",
                                   f"--load_checkpoint=params::{tmp_path}/run/checkpoints/3",
                                   f"--verify_tolerance={rel * 30.0:.3g}"])
    verified = [line for line in printed.getvalue().splitlines() if line.startswith("verify:")]
    assert verified and "vs transformers" in verified[0], printed.getvalue()
    back = getattr(transformers, architecture).from_pretrained(tmp_path / "export")
    assert type(back).__name__ == architecture


def check_export(family, model, config, params, tmp_path, architecture, read):
    """The converter's tensors and config.json load in transformers as `architecture` and
    compute the directory's logits bit for bit; `read` (DIR -> (config, params)) gives
    them back, the same config and parameters."""
    from easylm.models.hf_checkpoint import write_safetensors

    write_safetensors(family.hf.write_params(params, config), str(tmp_path))
    config.to_hf_config().save_pretrained(tmp_path)
    back = getattr(transformers, architecture).from_pretrained(tmp_path, dtype=torch.float32)
    assert type(back).__name__ == architecture
    ids = np.random.default_rng(8).integers(3, config.vocab_size, (1, 30))
    np.testing.assert_array_equal(logits_of(back.eval(), ids), logits_of(model, ids))
    again = read(str(tmp_path))
    assert again[0] == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again[1])):
        np.testing.assert_array_equal(a, b)


def check_whole_export(family, config, params, reference, model_class, tmp_path):
    """The converter's tensors and config.json load in transformers as `model_class` with
    no missing or unexpected weights, each tensor bit for bit `reference`'s (the model the
    parameters were read from: an image-text model, whose logits need its images), and
    the config reads back the same."""
    from easylm.models.hf_checkpoint import write_safetensors

    write_safetensors(((name, np.asarray(x, np.float32))
                       for name, x in family.hf.write_params(params, config)), str(tmp_path))
    config.to_hf_config().save_pretrained(tmp_path)
    model, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    theirs = dict(reference.state_dict())
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)
    assert family.hf.read_config(str(tmp_path)) == config


def check_lora_peft(family, directory, config, params, tmp_path, rel, target_modules,
                    targets=None):
    """Random adapters (drawn at 0.2, so that a misplaced one shows) on every default
    target (or `targets`, a --lora.target_modules): the PEFT directory on transformers'
    model, our adapted model, and the merged export loaded in transformers compute the
    same logits (within `rel` of the largest); twin: PEFT with the adapters disabled."""
    from peft import PeftModel

    from easylm.models.hf_checkpoint import write_safetensors
    from easylm.variants.adapters import Adapters
    from easylm.variants.lora import LoraConfig

    adapters_of = Adapters(family)
    lm = adapters_of.lora_model(config, LoraConfig(rank=4, alpha=8.0, base_dtype="fp32",
                                                   **({"target_modules": targets} if targets
                                                      else {})))
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype),
                            lm.adapter_shapes)
    ids = rng.integers(3, config.vocab_size, (1, 24))
    base = lm.store_base(params)
    ours = np.asarray(jax.jit(lambda b, a: lm.apply(b, a, jnp.asarray(ids)))(base, adapters))
    adapters_of.save_peft(str(tmp_path / "adapter"), lm, adapters, config)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(written["target_modules"]) == sorted(target_modules)
    merged = jax.tree.map(np.asarray, jax.jit(lm.merge)(base, adapters))
    (tmp_path / "merged").mkdir()
    write_safetensors(family.hf.write_params(merged, config), str(tmp_path / "merged"))
    config.to_hf_config().save_pretrained(tmp_path / "merged")
    exported = logits_of(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32).eval(), ids)
    peft = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32), str(tmp_path / "adapter")).eval()
    theirs = logits_of(peft, ids)
    assert_close(ours, theirs, rel)
    assert_close(exported, theirs, rel)
    with peft.disable_adapter():
        assert np.abs(logits_of(peft, ids) - ours).max() > 100 * rel * np.abs(theirs).max()


PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
