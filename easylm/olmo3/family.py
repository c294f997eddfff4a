"""The OLMo 3 family (Olmo-3 7B and 32B, base, Instruct and Think): `FAMILY`."""

from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader
from easylm.olmo3 import hf
from easylm.olmo3.config import OLMO3_PRESETS, Olmo3Config
from easylm.olmo3.model import PARTITION_RULES, Olmo3ForCausalLM


class Olmo3Family(ModelFamily):
    name = "olmo3"
    config_class = Olmo3Config
    presets = OLMO3_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = Olmo3ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("olmo3",), read_config=Olmo3Config.read_hf,
                   read_params=hf_params_reader(hf.load_hf_params, Olmo3ForCausalLM),
                   write_params=hf.to_hf)

    def partition_rules(self, config: Olmo3Config):
        return PARTITION_RULES


FAMILY = Olmo3Family()
