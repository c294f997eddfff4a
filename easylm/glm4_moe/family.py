"""The GLM-4.5 family (GLM-4.5, GLM-4.5-Air, GLM-4.6): `FAMILY`."""

from easylm.glm4_moe import hf
from easylm.glm4_moe.config import GLM4_MOE_PRESETS, Glm4MoeConfig
from easylm.glm4_moe.model import PARTITION_RULES, Glm4MoeForCausalLM
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class Glm4MoeFamily(ModelFamily):
    name = "glm4_moe"
    config_class = Glm4MoeConfig
    presets = GLM4_MOE_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = Glm4MoeForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("glm4_moe",), read_config=Glm4MoeConfig.read_hf,
                   write_params=hf.to_hf,
                   read_params=hf_params_reader(hf.load_hf_params, Glm4MoeForCausalLM))

    def partition_rules(self, config: Glm4MoeConfig):
        return PARTITION_RULES


FAMILY = Glm4MoeFamily()
