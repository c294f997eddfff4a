"""The Gemma 4 family (text; the language model of a multimodal checkpoint): `FAMILY`."""

from easylm.gemma4 import hf
from easylm.gemma4.config import GEMMA4_PRESETS, Gemma4Config
from easylm.gemma4.model import Gemma4ForCausalLM, partition_rules
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class Gemma4Family(ModelFamily):
    name = "gemma4"
    config_class = Gemma4Config
    presets = GEMMA4_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = Gemma4ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("gemma4_text", "gemma4"),  # gemma4: its language model
                   read_config=Gemma4Config.read_hf,
                   read_params=hf_params_reader(hf.load_hf_params, Gemma4ForCausalLM),
                   write_params=hf.to_hf)

    def partition_rules(self, config: Gemma4Config):
        return partition_rules(config)


FAMILY = Gemma4Family()
