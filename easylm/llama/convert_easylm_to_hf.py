"""Export an easylm LLaMA checkpoint as a Hugging Face model directory, and check it.

    python -m easylm.llama.convert_easylm_to_hf --load_checkpoint=params::DIR --output_dir=DIR \
        [--tokenizer=SPEC] [--dtype=keep|bf16|fp32] [--verify=True]

Writes `config.json`, `generation_config.json`, `model*.safetensors` (sharded at
`--max_shard_gb`, with an index when there is more than one shard) and, with
`--tokenizer`, the tokenizer files (and its pad and unk ids into config.json when
the checkpoint does not record them). With `--verify` (the default, when torch is
installed) the export is loaded back with `transformers` and its logits on
fixed sequences are compared with ours; the command fails above
`--verify_tolerance`. Everything is written to `<output_dir>.partial` and renamed
at the end, so a failed export never looks complete.

A LoRA run's checkpoint (`--lora.rank` > 0: adapters and a reference to their base)
exports with `--lora_mode`: `adapter` writes a PEFT directory (adapter_config.json,
adapter_model.safetensors; verified by loading it with `peft.PeftModel` onto the HF
model of the base as the run stored it), `merged` a full HF model: the base as its
source holds it, with W + s·A·B computed in fp32 and stored in the kernel's dtype in each
adapted kernel, every other tensor the source's bit for bit (PEFT's model of the same
adapter on that base; verified as any export). The base is read again from the
--load_checkpoint the run recorded (or --lora_base), and refused if its fingerprint is
not the run's.
"""

import dataclasses
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from easylm import flags
from easylm.errors import UserError, exit_on_user_error
from easylm.llama.config import LLaMAConfig
from easylm.llama.hf import to_hf
from easylm.llama.model import LLaMAForCausalLM
from easylm.models import hf_export
from easylm.models.hf_checkpoint import write_safetensors
from easylm.runtime.checkpoint import (
    load_params,
    parse_load_spec,
    read_metadata,
    stored_tree,
)
from easylm.runtime.dtypes import cast_names
from easylm.runtime.sharding import make_mesh

DTYPES = cast_names(("bf16", "fp32"))

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
USAGE = ("usage: python -m easylm.llama.convert_easylm_to_hf --load_checkpoint=params::DIR "
         "--output_dir=DIR")


def get_default_config() -> ConfigDict:
    return ConfigDict(dict(load_checkpoint="", output_dir="", tokenizer="", dtype="keep",
                           max_shard_gb=5.0, verify=True, verify_tolerance=1e-3,
                           lora_mode="", lora_base=""))


def config_from_metadata(metadata: dict, directory: str) -> LLaMAConfig:
    if "llama_config" not in metadata:
        raise UserError(f"{directory}: the checkpoint metadata has no llama_config; not a LLaMA checkpoint")
    return LLaMAConfig(**metadata["llama_config"])


def load_checkpoint(spec: str):
    """(config, params on one host device, in their stored dtype)."""
    _, directory = parse_load_spec(spec)
    config = config_from_metadata(read_metadata(directory), directory)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=device),
        stored_tree(directory, "params"),
    )
    return config, load_params(spec, abstract)


def export(params, config: LLaMAConfig, directory: str, dtype: str = "keep",
           tokenizer: str = "", max_shard_gb: float = 5.0) -> None:
    """Write the HF directory (no verification)."""
    from transformers import GenerationConfig

    cast = DTYPES[dtype]
    tensors = ((name, t if cast is None else t.astype(cast)) for name, t in to_hf(params, config))
    if tokenizer:
        from easylm.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
        config = config.replace(**{
            name: getattr(tokenizer, name) for name in ("pad_token_id", "unk_token_id")
            if getattr(config, name) is None and getattr(tokenizer, name) is not None})
    os.makedirs(directory)
    write_safetensors(tensors, directory, int(max_shard_gb * 2**30))
    hf_config = config.to_hf_config()  # with its architecture (LlamaForCausalLM, ...)
    first = jax.tree_util.tree_leaves(params)[0]
    hf_config.dtype = str(jnp.dtype(cast or first.dtype))
    hf_config.save_pretrained(directory)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(directory)
    if tokenizer:
        tokenizer.save_pretrained(directory)


def verify(params, config: LLaMAConfig, directory: str) -> float:
    """Max |logits(HF export) - logits(ours)| on fixed sequences, both in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    if bad:
        raise UserError(f"{directory}: transformers reports {bad}")
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    params32 = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
    ours = LLaMAForCausalLM(config.replace(attention="xla")).apply({"params": params32}, jnp.asarray(ids))
    return float(np.abs(np.asarray(ours) - theirs).max())


def load_lora(spec: str, metadata: dict, base_spec: str = ""):
    """(config, LoraModel, frozen base as the run stored it, adapters) of a LoRA run's
    checkpoint, on one device; the base checked against the run's fingerprint."""
    from easylm.llama.adapters import check_base, load_base, lora_model, read_adapters
    from easylm.llama.family import FAMILY
    from easylm.llama.model import PARTITION_RULES

    _, directory = parse_load_spec(spec)
    config = config_from_metadata(metadata, directory)
    recorded = metadata.get("frozen") or {}
    base_spec = base_spec or recorded.get("source", "")
    if base_spec in ("", "init"):
        raise UserError(f"{directory}: the run's base was drawn at random, not loaded; give it "
                        f"with --lora_base")
    lora, adapters, _ = read_adapters(directory, config)  # in the run's own layout
    lm = lora_model(config, lora, dtype=jnp.dtype(recorded.get("dtype", "float32")))
    mesh = make_mesh("1,1,1", devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        frozen = load_base(lm, base_spec, mesh, lambda spec, abstract: FAMILY.load_params(
            spec, config, abstract, PARTITION_RULES))
    if recorded.get("fingerprint"):
        check_base(directory, recorded, base_spec, lm, frozen,
                   fix="give the run's base with --lora_base")
    return config, lm, frozen, adapters


def merged_params(spec: str, metadata: dict, base_spec: str = ""):
    """(config, the run's base as its source holds it with W + s·A·B folded into each
    adapted kernel) on the host. The source is read again, in its own dtypes: what the run
    stored (bf16, quantized) is not the model PEFT adapts, and rounding it moved the
    merged logits 0.15 from PEFT's on an fp32 base. Each adapted kernel is merged in fp32
    and stored back in its dtype; every other tensor is the source's, bit for bit."""
    config, lm, frozen, adapters = load_lora(spec, metadata, base_spec)
    del frozen  # checked against the run's fingerprint; the source is read as it is
    source = base_spec or metadata["frozen"]["source"]
    return config, lm.merge(source_params(source, config), jax.device_get(adapters))


def source_params(spec: str, config: LLaMAConfig):
    """The parameters at `spec` (hf::, params:: or trainstate_params::) on the host, laid
    out as `config` says, each in the dtype it is stored in."""
    from easylm.llama.hf import load_hf_params

    kind, directory = parse_load_spec(spec, ("hf", "params", "trainstate_params"))
    if kind == "hf":
        return load_hf_params(directory, scan_layers=config.scan_layers)[1]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=device),
        stored_tree(directory, "params"))
    return jax.device_get(load_params(spec, abstract))


def flags_tree(flat: dict) -> dict:
    """The recorded dotted flags as a nested dict."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def verify_peft(lm, frozen, adapters, config: LLaMAConfig, directory: str) -> float:
    """Max |logits(HF base + PEFT adapter) - logits(ours)| on fixed sequences, in fp32."""
    import torch
    from peft import PeftModel

    from easylm.llama.adapters import lora_model
    from easylm.llama.family import FAMILY

    base = jax.device_get(lm.dequantized_base(frozen))
    model = PeftModel.from_pretrained(FAMILY.torch_reference(config, base), directory).eval()
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    # Ours on the same float base in fp32 (whatever the run computed in): what is compared
    # is the adapters.
    fp32 = lora_model(config, dataclasses.replace(lm.config, base_dtype="fp32"))
    ours = fp32.apply(fp32.store_base(base), adapters, jnp.asarray(ids))
    return float(np.abs(np.asarray(ours) - theirs).max())


@exit_on_user_error
def main(argv=None):
    FLAGS = flags.parse(get_default_config(), HELP, list(argv or sys.argv), USAGE)
    hf_export.run(FLAGS, hf_export.Exporter(
        dtypes=DTYPES, load_checkpoint=load_checkpoint, merged_params=merged_params,
        export_adapter=export_adapter, export=export, verify=verify))


def peft_base_model(spec: str) -> str:
    """adapter_config.json's base_model_name_or_path: the HF directory of an hf:: base,
    which peft loads by itself; none ('') for an easylm checkpoint, which it cannot."""
    kind, _, path = spec.partition("::")
    return os.path.abspath(path) if kind == "hf" else ""


def export_adapter(FLAGS, output_dir: str, metadata: dict) -> None:
    """--lora_mode=adapter: the PEFT directory, verified with peft."""
    from easylm.llama.adapters import save_peft

    config, lm, frozen, adapters = load_lora(FLAGS.load_checkpoint, metadata, FLAGS.lora_base)
    partial = output_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_peft(partial, lm, jax.device_get(adapters), config,
                  base_model=peft_base_model(FLAGS.lora_base or
                                             (metadata.get("frozen") or {}).get("source", "")))
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


if __name__ == "__main__":
    main()
