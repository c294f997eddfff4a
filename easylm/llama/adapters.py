"""LLaMA with LoRA adapters (easylm/variants/lora.py), and PEFT adapter directories for it.

qwix adapts the matmul that reads a module's own kernel. The fused q/k/v and gate/up
matmuls (`--llama.fused_qkv/fused_mlp`) read a concatenation of kernels instead, so a
LoRA model computes them unfused: the same numbers (the config's implementation
choices change none), and every projection gets its adapters.
"""

import dataclasses

import jax
import jax.numpy as jnp

from easylm.errors import UserError
from easylm.llama import hf
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM, lm_head_weight, relayout
from easylm.models.family import Model
from easylm.runtime import checkpoint
from easylm.variants import lora_variant as variant
from easylm.variants.lora import LoraConfig, LoraModel, read_peft, write_peft
from easylm.variants.lora_variant import (  # noqa: F401  (this family's LoRA, by these names)
    LORA_RUN_DEFAULTS,
    READ_DTYPE,
    Host,
    check_base,
    state_settings,
)

def lora_model(config: LLaMAConfig, lora: LoraConfig, dtype=jnp.float32,
               param_dtype=jnp.float32) -> LoraModel:
    module = LLaMAForCausalLM(config.replace(fused_qkv=False, fused_mlp=False), dtype=dtype,
                              param_dtype=param_dtype)
    return LoraModel(module, lora, dtype)


def lora_variant(model: Model, config: LLaMAConfig, lora: LoraConfig, dtype, load_spec: str,
                 load) -> Model:
    """The LoRA `Model` of the LLaMA `model` (bound to `config`, compute `dtype`): it trains
    the adapters on the frozen base read from `load_spec` (easylm/variants/lora_variant.py)."""
    host = Host(name="llama", rules=PARTITION_RULES,
                head_weight=lambda params: lm_head_weight(params, config),
                loss_chunk_size=config.loss_chunk_size,
                matmul_parameters=config.num_matmul_parameters())
    return variant.lora_variant(model, lora_model(config, lora, dtype=dtype), host, load_spec,
                                load)


def load_base(lm: LoraModel, spec: str, mesh, load):
    """The frozen base of `lm` from `spec`, in its shards of `mesh`, stored as it trains."""
    return variant.load_base(lm, spec, mesh, load, PARTITION_RULES)


def read_adapters(spec: str, config: LLaMAConfig) -> tuple[LoraConfig, dict, dict]:
    """(LoraConfig, adapters on one device, the run's checkpoint metadata ({} for PEFT))
    from a PEFT directory or a LoRA run's checkpoint (DIR or params::DIR): read in the
    layout they were stored in, returned in `config`'s (serve, eval and convert all read
    adapters here)."""
    import os

    from easylm.variants.lora import PEFT_CONFIG

    directory = spec.partition("::")[2] if "::" in spec else spec
    if os.path.isfile(os.path.join(directory, PEFT_CONFIG)):
        return (*load_peft(directory, config), {})
    checkpoint.check_checkpoint_dir(directory)
    metadata = checkpoint.read_metadata(directory)
    fields = {name.split(".", 1)[1]: value for name, value in metadata.get("flags", {}).items()
              if name.startswith("lora.")}
    if not fields.get("rank"):
        raise UserError(f"--lora_checkpoint={spec}: neither a PEFT adapter directory nor a "
                        f"LoRA run's checkpoint (its flags have no --lora.rank)")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype,
                                                              sharding=device),
                            checkpoint.stored_tree(directory, "params"))
    adapters = checkpoint.load_params(f"params::{directory}", abstract)
    return LoraConfig(**fields), relayout(adapters, config.scan_layers), metadata


def merge_into(spec: str, base_spec: str, config: LLaMAConfig, params, mesh, load):
    """`params` (float, sharded, read from `base_spec` by `load(spec, abstract)`) with the
    adapters at `spec` folded into their kernels, on the devices and in each kernel's dtype
    and shards; refused unless the base is the one a LoRA run's adapters were trained on."""
    lora, adapters, metadata = read_adapters(spec, config)
    adapters = jax.device_get(adapters)  # small: jit places them beside the kernels
    lm = lora_model(config, lora)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    expected = jax.tree.structure(lm.adapter_shapes)
    if jax.tree.structure(adapters) != expected or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(adapters),
                                               jax.tree.leaves(lm.adapter_shapes))):
        raise UserError(f"--lora_checkpoint={spec}: its adapters do not fit the served model "
                        f"(another shape, or other adapted modules)")
    if (metadata.get("frozen") or {}).get("fingerprint"):  # a PEFT directory records none
        check_base(spec, metadata["frozen"], base_spec,
                   *_stored_as_the_run(metadata, lora, params, base_spec, mesh, load),
                   fix=f"serve the adapters on their base (--load_checkpoint="
                       f"{metadata['frozen']['source']})")
    return jax.jit(lm.merge, out_shardings=shardings)(params, adapters)


def _stored_as_the_run(metadata: dict, lora: LoraConfig, params, base_spec: str, mesh, load):
    """(LoraModel of the run, the base as the LoRA run whose `metadata` these are stored it:
    its layout, cast or quantized from the dtype it read): what its fingerprint is of. Made
    from the served `params` when they hold every bit the run read (fp32, or its read
    dtype), else read again from `base_spec`; for the check only, then freed."""
    recorded = metadata["frozen"]
    run_config = LLaMAConfig(**metadata["llama_config"])
    lm = lora_model(run_config, lora, dtype=jnp.dtype(recorded.get("dtype", "float32")))
    read = jnp.dtype(READ_DTYPE.get(lm.config.base_dtype, jnp.bfloat16))  # auto resolved
    if any(x.dtype not in (jnp.float32, read) for x in jax.tree.leaves(params)):
        return lm, load_base(lm, base_spec, mesh, load)
    as_read = lambda p: jax.tree.map(lambda x: x.astype(read), relayout(p, run_config.scan_layers))
    return lm, jax.jit(lambda p: lm.store_base(as_read(p)))(params)


def save_peft(directory: str, lm: LoraModel, adapters, config: LLaMAConfig,
              base_model: str = "") -> None:
    """`adapters` as a PEFT directory that `peft.PeftModel.from_pretrained` loads onto
    the HF LlamaForCausalLM of the same base."""
    unscanned = config.replace(scan_layers=False)
    kernels = [path for path in hf.param_shapes(unscanned)
               if _scanned(path, config) in lm.targets]
    write_peft(directory, hf.to_peft(adapters, config), lm.config,
               hf.peft_target_modules(kernels, unscanned), base_model)


def load_peft(directory: str, config: LLaMAConfig) -> tuple[LoraConfig, dict]:
    """(LoraConfig, adapters) from a PEFT directory (ours or peft's own), shaped for
    `config` (scanned or not); the config selects the modules the file adapts."""
    lora, tensors = read_peft(directory)
    adapters, pattern = hf.from_peft(tensors, config, lora.rank, source=directory)
    return dataclasses.replace(lora, target_modules=pattern), adapters


def _scanned(path: str, config: LLaMAConfig) -> str:
    """model/layers/<i>/... -> model/layers/... when the config scans layers."""
    if config.scan_layers and path.startswith("model/layers/"):
        _, _, _, rest = path.split("/", 3)
        return f"model/layers/{rest}"
    return path
