"""Export an easylm checkpoint as a Hugging Face model directory, and check it, for any
model family (the one its metadata names, or --family=NAME):

    python -m easylm.convert_easylm_to_hf --load_checkpoint=params::DIR --output_dir=DIR \\
        [--tokenizer=SPEC] [--dtype=keep|bf16|fp32] [--verify=True] [--family=NAME]

Writes `config.json` (transformers' own save_pretrained of the family's HF config),
`generation_config.json`, `model*.safetensors` (sharded at `--max_shard_gb`, with an index
when there is more than one shard) and, with `--tokenizer`, the tokenizer files (and its
pad and unk ids into config.json when the checkpoint does not record them). With
`--verify` (the default, when torch is installed) the export is loaded back with
`transformers` and its logits on fixed sequences are compared with ours; the command fails
above `--verify_tolerance`. Everything is written to `<output_dir>.partial` and renamed at
the end, so a failed export never looks complete.

A LoRA run's checkpoint (`--lora.rank` > 0: adapters and a reference to their base)
exports with `--lora_mode`: `adapter` writes a PEFT directory (adapter_config.json,
adapter_model.safetensors; verified by loading it with `peft.PeftModel` onto the HF
model of the base as the run stored it), `merged` a full HF model: the base as its
source holds it, with W + s·A·B computed in fp32 and stored in the kernel's dtype in each
adapted kernel, every other tensor the source's bit for bit (PEFT's model of the same
adapter on that base; verified as any export). The base is read again from the
--load_checkpoint the run recorded (or --lora_base), and refused if its fingerprint is
not the run's (easylm/variants/adapters.py).

`python -m easylm.llama.convert_easylm_to_hf` and `easylm.gemma.convert_easylm_to_hf` are
this command for their family.
"""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from easylm import flags, model_flags
from easylm.errors import INSTALL, UserError, exit_on_user_error
from easylm.models import registry
from easylm.models.family import ModelFamily, hf_adapter
from easylm.models.hf_checkpoint import causal_lm_class, write_safetensors
from easylm.runtime.checkpoint import (
    check_free_space,
    disk_full_error,
    is_disk_full,
    load_stored_params,
    parse_load_spec,
    read_metadata,
)
from easylm.runtime.dtypes import cast_names

DTYPES = cast_names(("bf16", "fp32"))
LORA_MODES = ("adapter", "merged")

HELP = {
    "load_checkpoint": "params::DIR, trainstate::DIR or trainstate_params::DIR",
    "output_dir": "the Hugging Face model directory to write (must not exist)",
    "tokenizer": "tokenizer to save alongside (a path, or 'embedded'); empty: none",
    "dtype": "tensor dtype of the export: keep, bf16 or fp32",
    "max_shard_gb": "largest safetensors shard, in GiB",
    "verify": "reload the export with transformers and compare logits with ours",
    "verify_tolerance": "largest max |logit difference| --verify accepts",
    "lora_mode": "a LoRA run's checkpoint: 'adapter' (a PEFT directory) or 'merged' (the "
                 "base with the adapters folded in)",
    "lora_base": "the LoRA run's base (hf::DIR, params::DIR, ...) when it has moved (empty: "
                 "the --load_checkpoint the run recorded)",
}


def get_default_config() -> ConfigDict:
    return ConfigDict(dict(load_checkpoint="", output_dir="", tokenizer="", dtype="keep",
                           max_shard_gb=5.0, verify=True, verify_tolerance=1e-3,
                           lora_mode="", lora_base=""))


def config_of(family: ModelFamily, metadata: dict, directory: str):
    """The model config an easylm checkpoint's metadata records for `family`."""
    key = model_flags.metadata_key(family)
    if key not in metadata:
        raise UserError(f"{directory}: the checkpoint metadata has no {key}; "
                        f"not a {family.name} checkpoint (its model: {metadata.get('model')!r})")
    return family.config_class(**metadata[key])


def load_checkpoint(family: ModelFamily, spec: str):
    """(config, params on one host device, in their stored layout and dtype)."""
    _, directory = parse_load_spec(spec)
    return config_of(family, read_metadata(directory), directory), load_stored_params(spec)


def export(family: ModelFamily, params, config, directory: str, dtype: str = "keep",
           tokenizer: str = "", max_shard_gb: float = 5.0) -> None:
    """Write the HF directory (no verification)."""
    from transformers import GenerationConfig

    cast = DTYPES[dtype]
    tensors = ((name, t if cast is None else t.astype(cast))
               for name, t in hf_adapter(family).write_params(params, config))
    if tokenizer:
        from easylm.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
        config = config.replace(**{
            name: getattr(tokenizer, name) for name in ("pad_token_id", "unk_token_id")
            if name in family.config_class.field_names() and getattr(config, name) is None
            and getattr(tokenizer, name) is not None})
    os.makedirs(directory)
    write_safetensors(tensors, directory, int(max_shard_gb * 2**30))
    hf_config = config.to_hf_config()  # with its architecture (LlamaForCausalLM, ...)
    hf_config.dtype = str(jnp.dtype(cast or jax.tree.leaves(params)[0].dtype))
    hf_config.save_pretrained(directory)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(directory)
    if tokenizer:
        tokenizer.save_pretrained(directory)


def verify(family: ModelFamily, params, config, directory: str) -> float:
    """Max |logits(HF export) - logits(ours)| on fixed sequences, both in fp32."""
    import torch

    model, info = causal_lm_class(directory).from_pretrained(directory, dtype=torch.float32,
                                                             output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    if bad:
        raise UserError(f"{directory}: transformers reports {bad}")
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    params32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    module = family.module_class(config.replace(attention="xla"))
    ours = module.apply({"params": params32}, jnp.asarray(ids))
    return float(np.abs(np.asarray(ours) - theirs).max())


def run(family: ModelFamily, FLAGS) -> None:
    """Check the flags, tell a LoRA run's checkpoint from a whole model's, and export it."""
    if not FLAGS.load_checkpoint or not FLAGS.output_dir:
        raise UserError("both --load_checkpoint and --output_dir are required")
    if FLAGS.dtype not in DTYPES:
        raise UserError(f"--dtype={FLAGS.dtype!r} is not one of {', '.join(DTYPES)}")
    output_dir = os.path.abspath(FLAGS.output_dir)
    if os.path.exists(output_dir):
        raise UserError(f"{output_dir} already exists; refusing to overwrite it")
    _, directory = parse_load_spec(FLAGS.load_checkpoint)
    metadata = read_metadata(directory)
    config = config_of(family, metadata, directory)
    is_lora = bool(metadata.get("flags", {}).get("lora.rank"))
    if FLAGS.lora_mode not in ("",) + LORA_MODES:
        raise UserError(f"--lora_mode={FLAGS.lora_mode!r} is not one of {', '.join(LORA_MODES)}")
    if is_lora != bool(FLAGS.lora_mode):
        raise UserError(f"{directory} is a LoRA run's checkpoint: pass --lora_mode=adapter or "
                        f"merged" if is_lora else f"--lora_mode={FLAGS.lora_mode}: {directory} "
                        f"is not a LoRA run's checkpoint")
    if FLAGS.lora_mode:
        from easylm.variants.adapters import Adapters

        adapters = Adapters(family)
        if FLAGS.lora_mode == "adapter":
            return adapters.export_adapter(FLAGS, output_dir, metadata)
        config, params = adapters.merged_params(FLAGS.load_checkpoint, metadata, FLAGS.lora_base)
    else:
        params = load_checkpoint(family, FLAGS.load_checkpoint)[1]
    _write(family, FLAGS, config, params, output_dir)


def _write(family: ModelFamily, FLAGS, config, params, output_dir: str) -> None:
    partial = output_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    cast = DTYPES[FLAGS.dtype]
    needed = check_free_space(output_dir, sum(
        x.size * (jnp.dtype(cast).itemsize if cast else x.dtype.itemsize)
        for x in jax.tree.leaves(params)), "the export")
    try:
        try:
            export(family, params, config, partial, FLAGS.dtype, FLAGS.tokenizer,
                   FLAGS.max_shard_gb)
        except Exception as e:
            if not is_disk_full(e):
                raise
            raise disk_full_error("the export", partial, needed) from None
        if FLAGS.verify:
            _verify(family, params, config, partial, FLAGS.verify_tolerance)
        os.replace(partial, output_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"wrote {output_dir}")


def _verify(family: ModelFamily, params, config, directory: str, tolerance: float) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"verify: skipped, torch is not installed ({INSTALL['torch']})")
        return
    diff = verify(family, params, config, directory)
    print(f"verify: max |logit difference| vs transformers = {diff:.3g}")
    if not diff <= tolerance:
        raise UserError(f"verification failed: max |logit difference| {diff:.3g} exceeds "
                        f"--verify_tolerance={tolerance}")


@exit_on_user_error
def main(argv=None, family: ModelFamily | None = None, command: str = "easylm"):
    """The command; a family's alias (`python -m easylm.<family>.convert_easylm_to_hf`)
    passes its family and its name."""
    argv = list(argv or sys.argv)
    if family is None:
        family, argv = registry.from_argv(argv, detect=True)
    usage = (f"usage: python -m {command}.convert_easylm_to_hf --load_checkpoint=params::DIR "
             f"--output_dir=DIR")
    run(family, flags.parse(get_default_config(), HELP, argv, usage))


if __name__ == "__main__":
    main()
