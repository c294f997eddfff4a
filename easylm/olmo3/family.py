"""The OLMo 3 family (Olmo-3 7B and 32B, base, Instruct and Think): `FAMILY`."""

from easylm.models.family import HFAdapter, ModelFamily, layout
from easylm.olmo3 import hf
from easylm.olmo3.config import OLMO3_PRESETS, Olmo3Config
from easylm.olmo3.model import PARTITION_RULES, Olmo3ForCausalLM


def _read_params(directory: str, config: Olmo3Config, dtype: str = "keep", place=None):
    return layout(FAMILY, hf.load_hf_params(directory, dtype, place)[1], config)


class Olmo3Family(ModelFamily):
    name = "olmo3"
    config_class = Olmo3Config
    presets = OLMO3_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = Olmo3ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("olmo3",), read_config=hf.read_hf_config,
                   read_params=_read_params, write_params=hf.to_hf)

    def partition_rules(self, config: Olmo3Config):
        return PARTITION_RULES


FAMILY = Olmo3Family()
