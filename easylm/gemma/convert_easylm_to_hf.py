"""Export an easylm Gemma checkpoint as a Hugging Face `Gemma3ForCausalLM` directory, and
check it.

    python -m easylm.gemma.convert_easylm_to_hf --load_checkpoint=params::DIR --output_dir=DIR \\
        [--tokenizer=SPEC] [--dtype=keep|bf16|fp32] [--verify=True]

Writes config.json (the installed transformers' layout: Gemma3TextConfig's own
save_pretrained), generation_config.json, model*.safetensors (sharded at --max_shard_gb)
and, with --tokenizer, the tokenizer files. With --verify (the default, when torch is
installed) transformers loads the export and its logits on fixed sequences are compared
with ours; above --verify_tolerance the command fails. Everything is written into
`<output_dir>.partial`, renamed at the end.
"""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from easylm import flags
from easylm.errors import INSTALL, UserError, exit_on_user_error
from easylm.gemma.config import GemmaConfig
from easylm.gemma.family import FAMILY
from easylm.gemma.hf import DTYPES, to_hf
from easylm.gemma.model import GemmaForCausalLM
from easylm.models.hf_checkpoint import write_safetensors
from easylm.runtime.checkpoint import (
    check_free_space,
    disk_full_error,
    is_disk_full,
    load_params,
    parse_load_spec,
    read_metadata,
    stored_tree,
)

HELP = {
    "load_checkpoint": "params::DIR, trainstate::DIR or trainstate_params::DIR",
    "output_dir": "the Hugging Face model directory to write (must not exist)",
    "tokenizer": "tokenizer to save alongside (a path, or 'embedded'); empty: none",
    "dtype": "tensor dtype of the export: keep, bf16 or fp32",
    "max_shard_gb": "largest safetensors shard, in GiB",
    "verify": "reload the export with transformers and compare logits with ours",
    "verify_tolerance": "largest max |logit difference| --verify accepts",
}
USAGE = ("usage: python -m easylm.gemma.convert_easylm_to_hf --load_checkpoint=params::DIR "
         "--output_dir=DIR")


def get_default_config() -> ConfigDict:
    return ConfigDict(dict(load_checkpoint="", output_dir="", tokenizer="", dtype="keep",
                           max_shard_gb=5.0, verify=True, verify_tolerance=1e-3))


def load_checkpoint(spec: str) -> tuple[GemmaConfig, dict]:
    """(config, params on one device, in their stored dtype)."""
    _, directory = parse_load_spec(spec)
    metadata = read_metadata(directory)
    if metadata.get("flags", {}).get("lora.rank"):
        raise UserError(f"{directory} is a LoRA run's checkpoint: the gemma family has no "
                        f"adapters to export")
    if FAMILY.metadata_key not in metadata:
        raise UserError(f"{directory}: the checkpoint metadata has no {FAMILY.metadata_key}; "
                        f"not a Gemma checkpoint (its model: {metadata.get('model')!r})")
    config = GemmaConfig(**metadata[FAMILY.metadata_key])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=device),
        stored_tree(directory, "params"))
    return config, load_params(spec, abstract)


def export(params, config: GemmaConfig, directory: str, dtype: str = "keep",
           tokenizer: str = "", max_shard_gb: float = 5.0) -> None:
    """Write the HF directory (no verification)."""
    from transformers import GenerationConfig

    cast = DTYPES[dtype]
    tensors = ((name, t if cast is None else t.astype(cast)) for name, t in to_hf(params, config))
    os.makedirs(directory)
    write_safetensors(tensors, directory, int(max_shard_gb * 2**30))
    hf_config = config.to_hf_config()
    hf_config.dtype = str(jnp.dtype(cast or jax.tree.leaves(params)[0].dtype))
    hf_config.save_pretrained(directory)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(directory)
    if tokenizer:
        from easylm.data.tokenizer import load_tokenizer

        load_tokenizer(tokenizer).save_pretrained(directory)


def verify(params, config: GemmaConfig, directory: str) -> float:
    """Max |logits(HF export) - logits(ours)| on fixed sequences, both in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                       output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    if bad:
        raise UserError(f"{directory}: transformers reports {bad}")
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    params32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    ours = GemmaForCausalLM(config.replace(attention="xla")).apply({"params": params32},
                                                                   jnp.asarray(ids))
    return float(np.abs(np.asarray(ours) - theirs).max())


@exit_on_user_error
def main(argv=None):
    FLAGS = flags.parse(get_default_config(), HELP, list(argv or sys.argv), USAGE)
    if not FLAGS.load_checkpoint or not FLAGS.output_dir:
        raise UserError("both --load_checkpoint and --output_dir are required")
    if FLAGS.dtype not in DTYPES:
        raise UserError(f"--dtype={FLAGS.dtype!r} is not one of {', '.join(DTYPES)}")
    output_dir = os.path.abspath(FLAGS.output_dir)
    if os.path.exists(output_dir):
        raise UserError(f"{output_dir} already exists; refusing to overwrite it")
    config, params = load_checkpoint(FLAGS.load_checkpoint)
    partial = output_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    cast = DTYPES[FLAGS.dtype]
    needed = check_free_space(output_dir, sum(
        x.size * (jnp.dtype(cast).itemsize if cast else x.dtype.itemsize)
        for x in jax.tree.leaves(params)), "the export")
    try:
        try:
            export(params, config, partial, FLAGS.dtype, FLAGS.tokenizer, FLAGS.max_shard_gb)
        except Exception as e:
            if not is_disk_full(e):
                raise
            raise disk_full_error("the export", partial, needed) from None
        if FLAGS.verify:
            check(params, config, partial, FLAGS.verify_tolerance)
        os.replace(partial, output_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"wrote {output_dir}")


def check(params, config: GemmaConfig, directory: str, tolerance: float) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"verify: skipped, torch is not installed ({INSTALL['torch']})")
        return
    diff = verify(params, config, directory)
    print(f"verify: max |logit difference| vs transformers = {diff:.3g}")
    if not diff <= tolerance:
        raise UserError(f"verification failed: max |logit difference| {diff:.3g} exceeds "
                        f"--verify_tolerance={tolerance}")


if __name__ == "__main__":
    main()
