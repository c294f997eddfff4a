"""LLaMA with LoRA adapters (easylm/variants/lora.py), and PEFT adapter directories for it.

qwix adapts the matmul that reads a module's own kernel. The fused q/k/v and gate/up
matmuls (`--llama.fused_qkv/fused_mlp`) read a concatenation of kernels instead, so a
LoRA model computes them unfused: the same numbers (the config's implementation
choices change none), and every projection gets its adapters.
"""

import dataclasses

import jax.numpy as jnp

from easylm.llama import hf
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM
from easylm.models.decoder import relayout
from easylm.variants import lora_variant as variant
from easylm.variants.lora import LoraConfig, LoraModel, read_peft, write_peft
from easylm.variants.lora_variant import (  # noqa: F401  (this family's LoRA, by these names)
    LORA_RUN_DEFAULTS,
    check_base,
    state_settings,
)

def lora_model(config: LLaMAConfig, lora: LoraConfig, dtype=jnp.float32,
               param_dtype=jnp.float32) -> LoraModel:
    module = LLaMAForCausalLM(config.replace(fused_qkv=False, fused_mlp=False), dtype=dtype,
                              param_dtype=param_dtype)
    return LoraModel(module, lora, dtype)


def load_base(lm: LoraModel, spec: str, mesh, load):
    """The frozen base of `lm` from `spec`, in its shards of `mesh`, stored as it trains."""
    return variant.load_base(lm, spec, mesh, load, PARTITION_RULES)


def read_adapters(spec: str, config: LLaMAConfig) -> tuple[LoraConfig, dict, dict]:
    """(LoraConfig, adapters on one device, the run's checkpoint metadata ({} for PEFT))
    from a PEFT directory or a LoRA run's checkpoint (DIR or params::DIR): read in the
    layout they were stored in, returned in `config`'s (serve, eval and convert all read
    adapters here)."""
    lora, adapters, metadata = variant.read_adapters(
        spec, lambda directory: load_peft(directory, config))
    return lora, relayout(adapters, config.scan_layers), metadata


def merge_into(spec: str, base_spec: str, config: LLaMAConfig, params, mesh, load):
    """`params` (float, sharded, read from `base_spec` by `load(spec, abstract)`) with the
    adapters at `spec` folded into their kernels; refused unless the base is the one a LoRA
    run's adapters were trained on."""
    lora, adapters, metadata = read_adapters(spec, config)

    def as_the_run(metadata):
        run_config = LLaMAConfig(**metadata["llama_config"])
        run_lm = lora_model(run_config, lora,
                            dtype=jnp.dtype(metadata["frozen"].get("dtype", "float32")))
        return variant.stored_as_the_run(
            run_lm, params, lambda p: relayout(p, run_config.scan_layers),
            lambda: load_base(run_lm, base_spec, mesh, load))

    return variant.merge_into(spec, base_spec, params, lora_model(config, lora), adapters,
                              metadata, as_the_run)


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
