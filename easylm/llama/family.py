"""The LLaMA family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the LLaMA model (`FAMILY`)."""

import dataclasses

import jax.numpy as jnp

from easylm.llama import hf
from easylm.llama.config import ARCHITECTURES, LLAMA_PRESETS, NOT_BUILT, LLaMAConfig
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM
from easylm.models import remat
from easylm.models.family import Model, ModelFamily
from easylm.models.moe import RouterLoss

# The embedded demo: the `embedded` preset on the embedded corpus, sized to train in
# about three minutes on two CPU cores (its warmup, 20 steps, and decay, to step 200,
# follow --total_steps as in every run). Only run-level settings here: a
# `--llama.base_model=...` flag must get that preset's shape untouched.
EMBEDDED_DEFAULTS = {
    "train_dataset.json_dataset.seq_length": 256,
    "train_dataset.json_dataset.batch_size": 16,
    "total_steps": 200,
    "log_freq": 25,
    "optimizer.adamw_optimizer.lr": 3e-3,
}


class LLaMAFamily(ModelFamily):
    name = "llama"
    config_class = LLaMAConfig
    presets = LLAMA_PRESETS
    # The commands' model with no flags: the trainer's demo, and so what its checkpoints are.
    default_preset = "embedded"
    tiny_preset = "debug"
    demo = EMBEDDED_DEFAULTS
    commands = "easylm.llama"
    hf_model_types = tuple(ARCHITECTURES)
    hf_not_built = NOT_BUILT
    remat_policies = remat.NAMES
    variants = ("lora",)
    module_class = LLaMAForCausalLM

    def partition_rules(self, config: LLaMAConfig):
        return PARTITION_RULES

    def bind(self, config: LLaMAConfig, dtype=jnp.float32, param_dtype=jnp.float32) -> Model:
        model = super().bind(config, dtype, param_dtype)
        if not config.num_experts:
            return model
        aux = config.router_aux_loss_coef if config.output_router_logits else 0.0
        return dataclasses.replace(model, router_loss=RouterLoss(
            config.num_experts_per_tok, aux, config.router_z_loss_coef))

    def unfused(self, config: LLaMAConfig) -> LLaMAConfig:
        return config.replace(fused_qkv=False, fused_mlp=False)

    def read_hf_config(self, directory: str) -> LLaMAConfig:
        return hf.read_hf_config(directory)

    def hf_params(self, directory: str, config: LLaMAConfig, dtype: str = "keep", place=None):
        # As config.json describes them (laid out as `config` says): `load_hf` then checks
        # them against `config`, which the --llama.* flags may have changed.
        return hf.load_hf_params(directory, dtype, config.scan_layers, place)[1]

    def to_hf(self, params, config: LLaMAConfig):
        return hf.to_hf(params, config)


FAMILY = LLaMAFamily()
