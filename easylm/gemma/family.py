"""The Gemma 3 family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the Gemma model (`FAMILY`)."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from easylm.errors import UserError
from easylm.gemma import hf
from easylm.gemma.config import GEMMA_PRESETS, GemmaConfig
from easylm.gemma.model import (
    CACHE_PARTITION_RULES,
    GemmaForCausalLM,
    lm_head_weight,
    partition_rules,
)
from easylm.models import remat
from easylm.models.family import Model, ModelFamily
from easylm.objectives import preference
from easylm.objectives.next_token import causal_lm_loss, chunked_next_token_loss


class GemmaFamily(ModelFamily):
    name = "gemma"
    config_class = GemmaConfig
    presets = GEMMA_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    commands = "easylm.gemma"
    hf_model_types = ("gemma3_text", "gemma3")  # gemma3: its text tower
    remat_policies = remat.NAMES

    def bind(self, config: GemmaConfig, dtype=jnp.float32, param_dtype=jnp.float32) -> Model:
        module = GemmaForCausalLM(config, dtype=dtype, param_dtype=param_dtype)

        def logits(params, batch):  # (B, T, V)
            return module.apply({"params": params}, batch["input_tokens"],
                                positions=batch.get("positions"),
                                segment_ids=batch.get("segment_ids"))

        def chunked_loss(params, batch, rng, base=None):  # the same numbers, never all logits
            del rng, base
            hidden = module.apply({"params": params}, batch["input_tokens"],
                                  positions=batch.get("positions"),
                                  segment_ids=batch.get("segment_ids"), return_hidden=True)
            return chunked_next_token_loss(hidden, lm_head_weight(params, config),
                                           batch["target_tokens"], batch["loss_masks"],
                                           config.loss_chunk_size)

        def row_logps(params, rows, base=None, rng=None):  # one sequence per row, not packed
            del base, rng
            if not config.loss_chunk_size:
                return preference.sequence_logps(module.apply({"params": params},
                                                              rows["input_tokens"]),
                                                 rows["target_tokens"], rows["loss_masks"])
            hidden = module.apply({"params": params}, rows["input_tokens"], return_hidden=True)
            return preference.chunked_sequence_logps(
                hidden, lm_head_weight(params, config), rows["target_tokens"],
                rows["loss_masks"], config.loss_chunk_size)

        def apply(params, ids, positions, cache):
            return module.apply({"params": params}, ids, positions=positions, cache=cache)

        return Model(
            name=self.name, config=config.to_dict(), vocab_size=config.vocab_size,
            init_params=module.init_params,
            loss_fn=chunked_loss if config.loss_chunk_size else causal_lm_loss(logits),
            partition_rules=partition_rules(config), flops_per_token=config.flops_per_token,
            apply=apply, init_cache=module.init_cache, cache_rules=CACHE_PARTITION_RULES,
            max_seq_length=config.max_position_embeddings, eos_token_id=config.eos_token_id,
            num_layers=config.num_hidden_layers, num_parameters=config.num_parameters(),
            row_logps=row_logps)

    def build(self, flags, config=None, from_checkpoint: bool = False) -> Model:
        """The Gemma model, or with `--lora.rank` > 0 its LoRA variant (adapters trained on
        the frozen base --load_checkpoint names)."""
        config = self.model_config(flags, from_checkpoint) if config is None else config
        model = super().build(flags, config, from_checkpoint)
        lora = flags.get("lora")
        if lora is None or not lora.rank:
            return model
        from easylm.gemma.adapters import lora_variant
        from easylm.runtime.dtypes import dtype_from_flag
        from easylm.variants.lora import LoraConfig

        return lora_variant(model, config, LoraConfig.from_flags(lora),
                            dtype_from_flag("dtype", flags.dtype), flags.get("load_checkpoint", ""),
                            lambda spec, abstract: self.load_params(
                                spec, config, abstract, partition_rules(config)))

    def merge_adapters(self, spec: str, base_spec: str, config: GemmaConfig, params, mesh):
        from easylm.gemma.adapters import merge_into

        return merge_into(spec, base_spec, config, params, mesh,
                          lambda spec, abstract: self.load_params(spec, config, abstract,
                                                                  partition_rules(config)))

    def variant_flags(self) -> dict:
        from easylm.variants.lora import LoraConfig

        return {"lora": LoraConfig.get_default_config()}

    def variant_help(self) -> dict:
        from easylm.variants.lora import HELP

        return {f"lora.{name}": text for name, text in HELP.items()}

    def unused_variant_flags(self, flags) -> tuple:
        lora = flags.get("lora")
        return ("lora.",) if lora is None or not lora.rank else ()

    def state_settings(self, flags: dict, config: dict) -> dict:
        from easylm.variants.lora_variant import state_settings

        return state_settings(flags)

    def variant_run_defaults(self, flags) -> dict:
        from easylm.variants.lora_variant import LORA_RUN_DEFAULTS

        lora = flags.get("lora")
        return dict(LORA_RUN_DEFAULTS) if lora is not None and lora.rank and \
            flags.get("load_checkpoint") else {}

    def read_hf_config(self, directory: str) -> GemmaConfig:
        return hf.read_hf_config(directory)

    def hf_params(self, directory: str, config: GemmaConfig):
        # As config.json describes them: `load_hf` then checks them against `config`,
        # which the --gemma.* flags may have changed.
        return hf.load_hf_params(directory)[1]

    def shard_variant(self, config: GemmaConfig, layers: int, mp: int) -> GemmaConfig:
        kinds = config.layer_kinds()
        # The planner's `layers` keep the model's mix of sliding and global layers.
        return config.replace(
            num_hidden_layers=layers,
            layer_types=",".join(kinds[i * len(kinds) // layers] for i in range(layers)),
            num_attention_heads=math.ceil(config.num_attention_heads / mp),
            num_key_value_heads=math.ceil(config.num_key_value_heads / mp),
            intermediate_size=math.ceil(config.intermediate_size / mp),
            vocab_size=math.ceil(config.vocab_size / mp))

    def check_plannable(self, config: GemmaConfig) -> None:
        if config.attention == "cudnn" and jax.default_backend() != "gpu":
            raise UserError("--gemma.attention=cudnn can only be planned where cuDNN is: plan "
                            "on the GPU host, or with --gemma.attention=dot_product")

    def int8_model(self, config: GemmaConfig, dtype, params, mesh):
        from easylm.variants.quantize import Int8Model

        int8 = Int8Model(GemmaForCausalLM(config, dtype=dtype, param_dtype=dtype))

        def apply(params, ids, positions, cache):
            return int8.apply(params, ids, positions=positions, cache=cache)

        return (dataclasses.replace(self.bind(config, dtype, dtype), apply=apply),
                int8.quantize_sharded(params, partition_rules(config), mesh))

    def torch_reference(self, config: GemmaConfig, params):
        import numpy as np
        import torch
        from transformers import Gemma3ForCausalLM

        model = Gemma3ForCausalLM(config.to_hf_config()).eval()
        state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in hf.to_hf(params, config)}
        model.load_state_dict(state, strict=False)  # tied: lm_head is the embedding
        return model


FAMILY = GemmaFamily()
