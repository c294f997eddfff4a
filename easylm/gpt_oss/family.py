"""The gpt-oss family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the gpt-oss model (`FAMILY`)."""

import dataclasses

import jax.numpy as jnp

from easylm.gpt_oss import hf
from easylm.gpt_oss.config import GPT_OSS_PRESETS, GptOssConfig
from easylm.gpt_oss.model import GptOssForCausalLM, partition_rules
from easylm.models import remat
from easylm.models.family import Model, ModelFamily
from easylm.models.moe import RouterLoss


class GptOssFamily(ModelFamily):
    name = "gpt_oss"
    config_class = GptOssConfig
    presets = GPT_OSS_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    commands = "easylm.gpt_oss"
    hf_model_types = ("gpt_oss",)
    remat_policies = remat.NAMES
    variants = ("lora",)
    hf_gate_up_interleaved = True
    module_class = GptOssForCausalLM

    def partition_rules(self, config: GptOssConfig):
        return partition_rules(config)

    def bind(self, config: GptOssConfig, dtype=jnp.float32, param_dtype=jnp.float32) -> Model:
        # Every layer is a mixture of experts: training adds its router losses as
        # transformers' GptOssForCausalLM does (objectives/router_loss.py).
        aux = config.router_aux_loss_coef if config.output_router_logits else 0.0
        return dataclasses.replace(super().bind(config, dtype, param_dtype), router_loss=RouterLoss(
            config.num_experts_per_tok, aux, config.router_z_loss_coef))

    def read_hf_config(self, directory: str) -> GptOssConfig:
        return hf.read_hf_config(directory)

    def hf_params(self, directory: str, config: GptOssConfig, dtype: str = "keep", place=None):
        # As config.json describes them, laid out as `config` says: `load_hf` then checks
        # them against `config`, which the --gpt_oss.* flags may have changed.
        return self.layout(hf.load_hf_params(directory, dtype, place)[1], config)

    def to_hf(self, params, config: GptOssConfig):
        return hf.to_hf(params, config)


FAMILY = GptOssFamily()
