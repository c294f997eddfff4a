"""LLaMA with LoRA adapters (easylm/lora.py), and PEFT adapter directories for it.

qwix adapts the matmul that reads a module's own kernel. The fused q/k/v and gate/up
matmuls (`--llama.fused_qkv/fused_mlp`) read a concatenation of kernels instead, so a
LoRA model computes them unfused: the same numbers (the config's implementation
choices change none), and every projection gets its adapters.
"""

import jax.numpy as jnp

from easylm.llama.config import LLaMAConfig
from easylm.llama.model import LLaMAForCausalLM
from easylm.lora import LoraConfig, LoraModel


def lora_model(config: LLaMAConfig, lora: LoraConfig, dtype=jnp.float32,
               param_dtype=jnp.float32) -> LoraModel:
    module = LLaMAForCausalLM(config.replace(fused_qkv=False, fused_mlp=False), dtype=dtype,
                              param_dtype=param_dtype)
    return LoraModel(module, lora, dtype)
