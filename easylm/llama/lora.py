"""LLaMA with LoRA adapters (easylm/lora.py), and PEFT adapter directories for it.

qwix adapts the matmul that reads a module's own kernel. The fused q/k/v and gate/up
matmuls (`--llama.fused_qkv/fused_mlp`) read a concatenation of kernels instead, so a
LoRA model computes them unfused: the same numbers (the config's implementation
choices change none), and every projection gets its adapters.
"""

import dataclasses

import jax.numpy as jnp

from easylm.llama import hf_weights
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import LLaMAForCausalLM
from easylm.lora import LoraConfig, LoraModel, read_peft, write_peft


def lora_model(config: LLaMAConfig, lora: LoraConfig, dtype=jnp.float32,
               param_dtype=jnp.float32) -> LoraModel:
    module = LLaMAForCausalLM(config.replace(fused_qkv=False, fused_mlp=False), dtype=dtype,
                              param_dtype=param_dtype)
    return LoraModel(module, lora, dtype)


def save_peft(directory: str, lm: LoraModel, adapters, config: LLaMAConfig,
              base_model: str = "") -> None:
    """`adapters` as a PEFT directory that `peft.PeftModel.from_pretrained` loads onto
    the HF LlamaForCausalLM of the same base."""
    unscanned = config.replace(scan_layers=False)
    kernels = [path for path in hf_weights.param_shapes(unscanned)
               if _scanned(path, config) in lm.targets]
    write_peft(directory, hf_weights.to_peft(adapters, config), lm.config,
               hf_weights.peft_target_modules(kernels, unscanned), base_model)


def load_peft(directory: str, config: LLaMAConfig) -> tuple[LoraConfig, dict]:
    """(LoraConfig, adapters) from a PEFT directory (ours or peft's own), shaped for
    `config` (scanned or not); the config selects the modules the file adapts."""
    lora, tensors = read_peft(directory)
    adapters, pattern = hf_weights.from_peft(tensors, config, lora.rank, source=directory)
    return dataclasses.replace(lora, target_modules=pattern), adapters


def _scanned(path: str, config: LLaMAConfig) -> str:
    """model/layers/<i>/... -> model/layers/... when the config scans layers."""
    if config.scan_layers and path.startswith("model/layers/"):
        _, _, _, rest = path.split("/", 3)
        return f"model/layers/{rest}"
    return path
