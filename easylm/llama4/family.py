"""The Llama 4 family (Llama 4 Scout and Maverick, their text model): `FAMILY`."""

from easylm.llama4 import hf
from easylm.llama4.config import LLAMA4_PRESETS, Llama4Config
from easylm.llama4.model import PARTITION_RULES, Llama4ForCausalLM
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader

NOT_BUILT = {"llama4": "vision tower (Llama4ForConditionalGeneration); its text model, "
                       "llama4_text, is read"}


class Llama4Family(ModelFamily):
    name = "llama4"
    config_class = Llama4Config
    presets = LLAMA4_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = Llama4ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("llama4_text",), read_config=Llama4Config.read_hf,
                   read_params=hf_params_reader(hf.load_hf_params, Llama4ForCausalLM),
                   write_params=hf.to_hf, not_built=NOT_BUILT,
                   experts_in_first=True)

    def partition_rules(self, config: Llama4Config):
        return PARTITION_RULES


FAMILY = Llama4Family()
