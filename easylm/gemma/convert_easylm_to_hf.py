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

A LoRA run's checkpoint exports with `--lora_mode`: `adapter` writes a PEFT directory
(verified by loading it with `peft.PeftModel` onto the HF model of the base as the run
stored it), `merged` the base as its source holds it with W + s·A·B folded into each
adapted kernel (in fp32, stored in the kernel's dtype; every other tensor the source's).
The base is read again from the --load_checkpoint the run recorded (or --lora_base) and
refused if its fingerprint is not the run's.
"""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from easylm import flags
from easylm.errors import UserError, exit_on_user_error
from easylm.gemma.config import GemmaConfig
from easylm.gemma.family import FAMILY
from easylm.gemma.hf import DTYPES, to_hf
from easylm.gemma.model import GemmaForCausalLM
from easylm.models import hf_export
from easylm.models.hf_checkpoint import write_safetensors
from easylm.runtime.checkpoint import (
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
    "lora_mode": "a LoRA run's checkpoint: 'adapter' (a PEFT directory) or 'merged' (the "
                 "base with the adapters folded in)",
    "lora_base": "the LoRA run's base (hf::DIR, params::DIR, ...) when it has moved (empty: "
                 "the --load_checkpoint the run recorded)",
}
USAGE = ("usage: python -m easylm.gemma.convert_easylm_to_hf --load_checkpoint=params::DIR "
         "--output_dir=DIR")


def get_default_config() -> ConfigDict:
    return ConfigDict(dict(load_checkpoint="", output_dir="", tokenizer="", dtype="keep",
                           max_shard_gb=5.0, verify=True, verify_tolerance=1e-3,
                           lora_mode="", lora_base=""))


def load_checkpoint(spec: str) -> tuple[GemmaConfig, dict]:
    """(config, params on one device, in their stored dtype)."""
    _, directory = parse_load_spec(spec)
    return config_of(read_metadata(directory), directory), _load_params(spec)


def config_of(metadata: dict, directory: str) -> GemmaConfig:
    if FAMILY.metadata_key not in metadata:
        raise UserError(f"{directory}: the checkpoint metadata has no {FAMILY.metadata_key}; "
                        f"not a Gemma checkpoint (its model: {metadata.get('model')!r})")
    return GemmaConfig(**metadata[FAMILY.metadata_key])


def _load_params(spec: str):
    """The parameters of an easylm checkpoint on one device, in their stored dtype."""
    _, directory = parse_load_spec(spec)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=device),
        stored_tree(directory, "params"))
    return load_params(spec, abstract)


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
    hf_export.run(FLAGS, hf_export.Exporter(
        dtypes=DTYPES, load_checkpoint=load_checkpoint, merged_params=merged_params,
        export_adapter=export_adapter, export=export, verify=verify))


def load_lora(spec: str, metadata: dict, base_spec: str = ""):
    """(config, LoraModel, frozen base as the run stored it, adapters, the base's source) of
    a LoRA run's checkpoint, on one device; the base checked against the run's fingerprint."""
    from easylm.gemma.adapters import load_base, load_peft, lora_model
    from easylm.gemma.model import partition_rules
    from easylm.runtime.sharding import make_mesh
    from easylm.variants.lora_variant import check_base, read_adapters

    _, directory = parse_load_spec(spec)
    config = config_of(metadata, directory)
    recorded = metadata.get("frozen") or {}
    base_spec = base_spec or recorded.get("source", "")
    if base_spec in ("", "init"):
        raise UserError(f"{directory}: the run's base was drawn at random, not loaded; give it "
                        f"with --lora_base")
    lora, adapters, _ = read_adapters(directory, lambda peft: load_peft(peft, config))
    lm = lora_model(config, lora, dtype=jnp.dtype(recorded.get("dtype", "float32")))
    mesh = make_mesh("1,1,1", devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        frozen = load_base(lm, config, base_spec, mesh, lambda spec, abstract: FAMILY.load_params(
            spec, config, abstract, partition_rules(config)))
    if recorded.get("fingerprint"):
        check_base(directory, recorded, base_spec, lm, frozen,
                   fix="give the run's base with --lora_base")
    return config, lm, frozen, adapters, base_spec


def merged_params(spec: str, metadata: dict, base_spec: str = ""):
    """(config, the base as its source holds it with W + s·A·B in each adapted kernel)."""
    from easylm.gemma.hf import load_hf_params

    config, lm, _, adapters, source = load_lora(spec, metadata, base_spec)
    kind, directory = parse_load_spec(source, ("hf", "params", "trainstate_params"))
    params = (load_hf_params(directory)[1] if kind == "hf"
              else jax.device_get(_load_params(source)))
    return config, lm.merge(params, jax.device_get(adapters))


def export_adapter(FLAGS, output_dir: str, metadata: dict) -> None:
    """--lora_mode=adapter: the PEFT directory, verified with peft."""
    from easylm.gemma.adapters import save_peft

    config, lm, frozen, adapters, source = load_lora(FLAGS.load_checkpoint, metadata,
                                                     FLAGS.lora_base)
    kind, _, path = source.partition("::")
    partial = output_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_peft(partial, lm, jax.device_get(adapters), config,
                  base_model=os.path.abspath(path) if kind == "hf" else "")
        if FLAGS.verify:
            diff = verify_peft(lm, frozen, adapters, config, partial)
            print(f"verify: max |logit difference| vs peft = {diff:.3g}")
            if not diff <= FLAGS.verify_tolerance:
                raise UserError(f"verification failed: max |logit difference| {diff:.3g} "
                                f"exceeds --verify_tolerance={FLAGS.verify_tolerance}")
        os.replace(partial, output_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"wrote {output_dir}")


def verify_peft(lm, frozen, adapters, config: GemmaConfig, directory: str) -> float:
    """Max |logits(HF base + PEFT adapter) - logits(ours)| on fixed sequences, in fp32."""
    import dataclasses

    import torch
    from peft import PeftModel

    from easylm.gemma.adapters import lora_model

    base = jax.device_get(lm.dequantized_base(frozen))
    model = PeftModel.from_pretrained(FAMILY.torch_reference(config, base), directory).eval()
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    fp32 = lora_model(config, dataclasses.replace(lm.config, base_dtype="fp32"))
    ours = fp32.apply(fp32.store_base(base), adapters, jnp.asarray(ids))
    return float(np.abs(np.asarray(ours) - theirs).max())


if __name__ == "__main__":
    main()
