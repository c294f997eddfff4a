"""The LLaMA family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the LLaMA model (`FAMILY`)."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from easylm.errors import UserError
from easylm.llama import hf
from easylm.llama.config import ARCHITECTURES, LLAMA_PRESETS, LLaMAConfig
from easylm.llama.model import (
    CACHE_PARTITION_RULES,
    PARTITION_RULES,
    LLaMAForCausalLM,
    layers_scanned,
    lm_head_weight,
    relayout,
)
from easylm.models import remat
from easylm.models.family import Model, ModelFamily
from easylm.objectives import preference
from easylm.objectives.next_token import causal_lm_loss, chunked_next_token_loss

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
    remat_policies = remat.NAMES

    def bind(self, config: LLaMAConfig, dtype=jnp.float32, param_dtype=jnp.float32) -> Model:
        module = LLaMAForCausalLM(config, dtype=dtype, param_dtype=param_dtype)

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
            del base, rng  # no frozen parameters, no dropout
            if not config.loss_chunk_size:
                logits = module.apply({"params": params}, rows["input_tokens"])
                return preference.sequence_logps(logits, rows["target_tokens"],
                                                 rows["loss_masks"])
            hidden = module.apply({"params": params}, rows["input_tokens"], return_hidden=True)
            return preference.chunked_sequence_logps(
                hidden, lm_head_weight(params, config), rows["target_tokens"],
                rows["loss_masks"], config.loss_chunk_size)

        def apply(params, ids, positions, cache):
            return module.apply({"params": params}, ids, positions=positions, cache=cache)

        return Model(
            name=self.name,
            config=config.to_dict(),
            vocab_size=config.vocab_size,
            init_params=module.init_params,
            loss_fn=chunked_loss if config.loss_chunk_size else causal_lm_loss(logits),
            partition_rules=PARTITION_RULES,
            flops_per_token=config.flops_per_token,
            apply=apply,
            init_cache=module.init_cache,
            cache_rules=CACHE_PARTITION_RULES,
            max_seq_length=config.max_position_embeddings,
            eos_token_id=config.eos_token_id,
            num_layers=config.num_hidden_layers,
            num_parameters=config.num_parameters(),
            row_logps=row_logps,
        )

    def build(self, flags, config=None, from_checkpoint: bool = False) -> Model:
        """The LLaMA model, or with `--lora.rank` > 0 its LoRA variant (easylm/llama/adapters.py):
        adapters trained on the frozen base --load_checkpoint names."""
        config = self.model_config(flags, from_checkpoint) if config is None else config
        model = super().build(flags, config, from_checkpoint)
        lora = flags.get("lora")
        if lora is None or not lora.rank:
            return model
        from easylm.llama.adapters import lora_variant
        from easylm.runtime.dtypes import dtype_from_flag
        from easylm.variants.lora import LoraConfig

        return lora_variant(model, config, LoraConfig.from_flags(lora),
                            dtype_from_flag("dtype", flags.dtype), flags.get("load_checkpoint", ""),
                            lambda spec, abstract: self.load_params(spec, config, abstract,
                                                                    PARTITION_RULES))

    def merge_adapters(self, spec: str, base_spec: str, config: LLaMAConfig, params, mesh):
        from easylm.llama.adapters import merge_into

        return merge_into(spec, base_spec, config, params, mesh,
                          lambda spec, abstract: self.load_params(spec, config, abstract,
                                                                  PARTITION_RULES))

    def relayout(self, tree, like):
        return relayout(tree, layers_scanned(like))

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
        # Whether layers are stacked, and LoRA's: rank (0: no adapters), the modules, the
        # scale, the base's storage (auto made concrete: it follows --dtype).
        from easylm.llama.adapters import state_settings

        return {"--llama.scan_layers": bool(config.get("scan_layers")),
                **state_settings(flags)}

    def variant_run_defaults(self, flags) -> dict:
        from easylm.llama.adapters import LORA_RUN_DEFAULTS

        lora = flags.get("lora")
        return dict(LORA_RUN_DEFAULTS) if lora is not None and lora.rank and \
            flags.get("load_checkpoint") else {}

    def read_hf_config(self, directory: str) -> LLaMAConfig:
        return hf.read_hf_config(directory)

    def hf_params(self, directory: str, config: LLaMAConfig):
        # As config.json describes them (laid out as `config` says): `load_hf` then checks
        # them against `config`, which the --llama.* flags may have changed.
        return hf.load_hf_params(directory, scan_layers=config.scan_layers)[1]

    def shard_variant(self, config: LLaMAConfig, layers: int, mp: int) -> LLaMAConfig:
        return config.replace(
            num_hidden_layers=layers, head_dim=config.head_dim,
            num_attention_heads=math.ceil(config.num_attention_heads / mp),
            num_key_value_heads=math.ceil(config.num_key_value_heads / mp),
            intermediate_size=math.ceil(config.intermediate_size / mp),
            vocab_size=math.ceil(config.vocab_size / mp))

    def check_plannable(self, config: LLaMAConfig) -> None:
        if config.attention == "cudnn" and jax.default_backend() != "gpu":
            # 'auto' picks it on a GPU only; tracing it needs cuDNN present.
            raise UserError("--llama.attention=cudnn can only be planned where cuDNN is: plan "
                            "on the GPU host, or with --llama.attention=dot_product for an "
                            "upper bound")

    def int8_model(self, config: LLaMAConfig, dtype, params, mesh):
        # qwix quantizes the matmuls that read a module's own kernel, so the projections
        # run unfused (the same parameters, the same numbers).
        from easylm.variants.quantize import Int8Model

        unfused = config.replace(fused_qkv=False, fused_mlp=False)
        int8 = Int8Model(LLaMAForCausalLM(unfused, dtype=dtype, param_dtype=dtype))

        def apply(params, ids, positions, cache):
            return int8.apply(params, ids, positions=positions, cache=cache)

        return (dataclasses.replace(self.bind(unfused, dtype, dtype), apply=apply),
                int8.quantize_sharded(params, PARTITION_RULES, mesh))

    def torch_reference(self, config: LLaMAConfig, params):
        import numpy as np
        import torch
        from transformers import AutoModelForCausalLM

        # The variant's own class (LlamaForCausalLM, Qwen3ForCausalLM, ...).
        model = AutoModelForCausalLM.from_config(config.to_hf_config()).eval()
        state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in hf.to_hf(params, config)}
        model.load_state_dict(state, strict=False)  # tied models list lm_head twice
        return model


FAMILY = LLaMAFamily()
