"""`--load_checkpoint=hf::DIR` in the trainer: fine-tuning a Hugging Face directory is one
command. The first step's loss is HF's loss on the same batch, the parameters land in
their shards unchanged, and bad directories or flags give one line."""

import json
import os

import jax
import numpy as np
import pytest
import torch
from flax import traverse_util
from numerics import assert_close, assert_differs, forward_rel
from transformers import LlamaForCausalLM as HFLlama

from easylm import flags, variants
from easylm.data import DatasetFactory
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError
from easylm.llama import train
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.hf import load_hf_params
from easylm.runtime import checkpoint
from easylm.training import trainer


def make_hf(directory):
    """A random GQA model with tied embeddings, unlike the `embedded` preset's shape."""
    config = LLaMAConfig.from_preset("debug", initializer_range=0.2, num_hidden_layers=3,
                                     num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                     tie_word_embeddings=True, rope_theta=50000.0)
    torch.manual_seed(0)
    model = HFLlama(config.to_hf_config()).eval()
    model.save_pretrained(directory)
    return model


def hf_config_of(model) -> LLaMAConfig:
    return LLaMAConfig.from_hf_config(model.config)


def parse(tmp_path, *argv, steps=1, lr=0.0):
    return flags.parse(train.default_config(), train.help_entries(), run_argv(tmp_path, steps, lr)
                       + list(argv))


def run_argv(tmp_path, steps=1, lr=0.0) -> list[str]:
    """A short fp32 run's flags; lr 0 (the default): the updates leave the parameters as
    loaded."""
    return ["train", f"--total_steps={steps}", "--log_freq=1",
            "--train_dataset.json_dataset.seq_length=32",
            "--train_dataset.json_dataset.batch_size=4", f"--logger.output_dir={tmp_path / 'runs'}",
            "--compilation_cache_dir=", "--dtype=fp32", "--mesh_dim=1,1,-1",
            f"--optimizer.adamw_optimizer.init_lr={lr}", f"--optimizer.adamw_optimizer.lr={lr}",
            f"--optimizer.adamw_optimizer.end_lr={lr}"]


def metrics(final) -> list[dict]:
    """The run's logged metrics, one dict a logged step."""
    with open(os.path.join(os.path.dirname(os.path.dirname(final)), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("mesh_dim,scan", [("1,1,-1", False), ("2,2,2", True)])
def test_first_loss_is_hf_loss_and_params_load_unchanged(tmp_path, mesh_dim, scan):
    hf = make_hf(tmp_path / "hf")
    config = parse(tmp_path, f"--load_checkpoint=hf::{tmp_path / 'hf'}", f"--mesh_dim={mesh_dim}",
                   f"--llama.scan_layers={scan}")
    final = trainer.train(config, FAMILY)

    # The loss logged for step 1 is HF's mean cross-entropy on the first batch.
    dataset = DatasetFactory.load_dataset(config.train_dataset, load_tokenizer("embedded"))
    batch, _ = next(iter(dataset))
    with torch.no_grad():
        logits = hf(torch.tensor(batch["input_tokens"]).long()).logits
    nll = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), torch.tensor(batch["target_tokens"]).long().flatten(), reduction="none")
    mask = torch.tensor(batch["loss_masks"]).flatten()
    expected = float((nll * mask).sum() / mask.sum())
    (line,) = metrics(final)
    assert line["step"] == 1
    # A mean of token losses, each off by at most twice the largest logit error.
    atol = 2 * forward_rel(hf_config_of(hf), 32) * float(logits.abs().max())
    assert abs(line["loss"] - expected) <= atol

    # The checkpoint records HF's shape and holds HF's tensors bit for bit.
    metadata = checkpoint.read_metadata(final)
    recorded = metadata["llama_config"]
    assert (recorded["num_hidden_layers"], recorded["num_key_value_heads"],
            recorded["tie_word_embeddings"], recorded["rope_theta"]) == (3, 2, True, 50000.0)
    llama_config, expected_params = load_hf_params(str(tmp_path / "hf"), scan_layers=scan)
    model = variants.build(FAMILY, config)
    abstract = jax.eval_shape(model.init_params, jax.random.key(0))
    params = checkpoint.load_params(f"params::{final}", abstract)
    ours = traverse_util.flatten_dict(jax.device_get(params), sep="/")
    theirs = traverse_util.flatten_dict(expected_params, sep="/")
    assert ours.keys() == theirs.keys()
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_bad_hf_directory_or_flags_are_one_line(tmp_path):
    with pytest.raises(UserError, match=r"missing: no such directory$"):
        trainer.train(parse(tmp_path, f"--load_checkpoint=hf::{tmp_path / 'missing'}"), FAMILY)
    make_hf(tmp_path / "hf")
    with pytest.raises(UserError, match=r"the --llama.\* flags describe a model with other "
                                        r"parameters than its config.json"):
        trainer.train(parse(tmp_path, f"--load_checkpoint=hf::{tmp_path / 'hf'}",
                            "--llama.num_hidden_layers=2"), FAMILY)
    with pytest.raises(UserError, match=r"model/embed_tokens/embedding has shape \(512, 64\), "
                                        r"but the --llama.\* flags imply \(512, 32\)"):
        trainer.train(parse(tmp_path, f"--load_checkpoint=hf::{tmp_path / 'hf'}",
                            "--llama.hidden_size=32"), FAMILY)
    with pytest.raises(UserError, match=r"unknown prefix 'hug'; expected one of params, "
                                        r"trainstate, trainstate_params, hf$"):
        trainer.train(parse(tmp_path, f"--load_checkpoint=hug::{tmp_path / 'hf'}"), FAMILY)


def test_a_qwen3_directory_fine_tunes_and_exports_back(tmp_path, capsys):
    # The README's recipe on a tiny Qwen3 (q/k norms, head_dim 32 != D/heads): the command
    # reads config.json as Qwen3, a few steps lower the loss, and the checkpoint exports
    # to a directory transformers loads as Qwen3ForCausalLM with our logits.
    from llama_variants import hf_variant, variant_config
    from transformers import AutoModelForCausalLM

    from easylm.data.tokenizer import load_tokenizer
    from easylm.llama import convert_easylm_to_hf
    from easylm.llama.model import LLaMAForCausalLM

    config = variant_config("qwen3")
    hf_variant(config).save_pretrained(tmp_path / "hf")
    load_tokenizer("embedded").save_pretrained(tmp_path / "hf")
    train.main(run_argv(tmp_path, steps=6, lr=3e-3) + [
        f"--load_checkpoint=hf::{tmp_path / 'hf'}", f"--tokenizer={tmp_path / 'hf'}"])
    final = capsys.readouterr().out.split("checkpoint: ")[1].split()[0]
    losses = [line["loss"] for line in metrics(final)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    assert checkpoint.read_metadata(final)["llama_config"]["model_type"] == "qwen3"

    convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{final}",
                               f"--output_dir={tmp_path / 'back'}", f"--tokenizer={tmp_path / 'hf'}"])
    assert "verify: max |logit difference| vs transformers" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    trained = variants.build(FAMILY, parse(tmp_path, f"--load_checkpoint=params::{final}"),
                           from_checkpoint=True)
    params = checkpoint.load_params(f"params::{final}", jax.eval_shape(
        trained.init_params, jax.random.key(0)))
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    ours = LLaMAForCausalLM(config).apply({"params": params}, ids)
    assert_close(ours, theirs, forward_rel(config, 32))
    # Negative twin: the original model's logits are others (training moved them).
    with torch.no_grad():
        assert_differs(hf_variant(config)(torch.tensor(ids)).logits.numpy(), theirs,
                       forward_rel(config, 32))


def test_a_refused_config_json_is_the_one_line_before_the_tokenizer_loads(tmp_path, capsys):
    """A config.json this model is not (gpt_oss, no `architectures`): the refusal names only
    what the file says, and comes before the tokenizer is loaded (whose transformers
    warnings, or here its own error, would come first). Fails on 4280dbe, which named
    `architectures ['LlamaForCausalLM']`, a list it made up, after loading the tokenizer."""
    from cli_utils import one_line_error

    make_hf(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["architectures"]
    config["model_type"] = "gpt_oss"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' progress bar saving it
    message = one_line_error(train.main, run_argv(tmp_path) + [
        f"--load_checkpoint=hf::{tmp_path / 'hf'}", f"--tokenizer={tmp_path / 'no_tokenizer'}"],
        capsys)
    assert message.startswith(f"{tmp_path / 'hf'}: model_type 'gpt_oss' is not a LLaMA-like "
                              "causal LM"), message
    assert "architectures" not in message.partition("(")[0]
