"""Gemma with LoRA adapters (easylm/variants/lora.py, lora_variant.py), and PEFT adapter
directories for it (target names q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj, as PEFT names Gemma3ForCausalLM's modules)."""

import dataclasses

import jax.numpy as jnp

from easylm.gemma import hf
from easylm.gemma.config import GemmaConfig
from easylm.gemma.model import GemmaForCausalLM, partition_rules
from easylm.models.decoder import period, relayout
from easylm.models.hf_checkpoint import peft_target_modules
from easylm.variants import lora_variant as variant
from easylm.variants.lora import LoraConfig, LoraModel, read_peft, write_peft


def lora_model(config: GemmaConfig, lora: LoraConfig, dtype=jnp.float32,
               param_dtype=jnp.float32) -> LoraModel:
    return LoraModel(GemmaForCausalLM(config, dtype=dtype, param_dtype=param_dtype), lora, dtype)


def load_base(lm: LoraModel, config: GemmaConfig, spec: str, mesh, load):
    return variant.load_base(lm, spec, mesh, load, partition_rules(config))


def save_peft(directory: str, lm: LoraModel, adapters, config: GemmaConfig,
              base_model: str = "") -> None:
    """`adapters` as a PEFT directory that `peft.PeftModel.from_pretrained` loads onto the
    HF Gemma3ForCausalLM of the same base."""
    kernels = [path for path in hf.param_shapes(config) if path.endswith("/kernel")]
    write_peft(directory, hf.to_peft(adapters), lm.config,
               peft_target_modules([path for path in kernels if path in lm.targets], kernels),
               base_model)


def load_peft(directory: str, config: GemmaConfig) -> tuple[LoraConfig, dict]:
    """(LoraConfig, adapters) from a PEFT directory; the config selects the modules the
    file adapts."""
    lora, tensors = read_peft(directory)
    adapters, pattern = hf.from_peft(tensors, config, lora.rank, source=directory)
    return dataclasses.replace(lora, target_modules=pattern), adapters


def merge_into(spec: str, base_spec: str, config: GemmaConfig, params, mesh, load):
    """`params` (float, sharded, read from `base_spec` by `load(spec, abstract)`) with the
    adapters at `spec` (a PEFT directory or a LoRA run's checkpoint) folded into their
    kernels: the server's --lora_checkpoint. Refused unless the base is the run's."""
    lora, adapters, metadata = variant.read_adapters(
        spec, lambda directory: load_peft(directory, config))
    # In the served layout (a scanned run's adapters are stacked).
    adapters = relayout(adapters, config.scan_layers, period(GemmaForCausalLM, config))

    def as_the_run(metadata):
        run_config = GemmaConfig(**metadata["gemma_config"])
        run_lm = lora_model(run_config, lora,
                            dtype=jnp.dtype(metadata["frozen"].get("dtype", "float32")))
        return variant.stored_as_the_run(
            run_lm, params,
            lambda p: relayout(p, run_config.scan_layers, period(GemmaForCausalLM, run_config)),
            lambda: load_base(run_lm, run_config, base_spec, mesh, load))

    return variant.merge_into(spec, base_spec, params, lora_model(config, lora), adapters,
                              metadata, as_the_run)
