"""The Gemma 3 family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the Gemma model (`FAMILY`)."""

from easylm.gemma import hf
from easylm.gemma.config import GEMMA_PRESETS, GemmaConfig
from easylm.gemma.model import GemmaForCausalLM, partition_rules
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class GemmaFamily(ModelFamily):
    name = "gemma"
    config_class = GemmaConfig
    presets = GEMMA_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = GemmaForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("gemma3_text", "gemma3"),  # gemma3: its text tower
                   read_config=GemmaConfig.read_hf,
                   read_params=hf_params_reader(hf.load_hf_params, GemmaForCausalLM),
                   write_params=hf.to_hf)

    def partition_rules(self, config: GemmaConfig):
        return partition_rules(config)


FAMILY = GemmaFamily()
