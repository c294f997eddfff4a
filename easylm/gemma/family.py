"""The Gemma 3 family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the Gemma model (`FAMILY`)."""

import math


from easylm.gemma import hf
from easylm.gemma.config import GEMMA_PRESETS, GemmaConfig
from easylm.gemma.model import GemmaForCausalLM, partition_rules
from easylm.models import remat
from easylm.models.family import ModelFamily


class GemmaFamily(ModelFamily):
    name = "gemma"
    config_class = GemmaConfig
    presets = GEMMA_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    commands = "easylm.gemma"
    hf_model_types = ("gemma3_text", "gemma3")  # gemma3: its text tower
    remat_policies = remat.NAMES
    module_class = GemmaForCausalLM

    def partition_rules(self, config: GemmaConfig):
        return partition_rules(config)

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

        return {**super().state_settings(flags, config), **state_settings(flags)}

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

    def to_hf(self, params, config: GemmaConfig):
        return hf.to_hf(params, config)


FAMILY = GemmaFamily()
