"""The GLM-5 family (GLM-5, GLM-5.1): `FAMILY`. DeepSeek-V3.2's model (easylm/models/
sparse_attention.py) with the indexer's rotary interleaved and some layers sharing the last
full layer's keys; DeepSeek-V3.2's checkpoint names, shared layers without an indexer."""

from easylm.glm_moe_dsa import hf
from easylm.glm_moe_dsa.config import GLM_MOE_DSA_PRESETS, GlmMoeDsaConfig
from easylm.glm_moe_dsa.model import PARTITION_RULES, GlmMoeDsaForCausalLM
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class GlmMoeDsaFamily(ModelFamily):
    name = "glm_moe_dsa"
    config_class = GlmMoeDsaConfig
    presets = GLM_MOE_DSA_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = GlmMoeDsaForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("glm_moe_dsa",), read_config=GlmMoeDsaConfig.read_hf,
                   write_params=hf.to_hf,
                   read_params=hf_params_reader(hf.load_hf_params, GlmMoeDsaForCausalLM))

    def partition_rules(self, config: GlmMoeDsaConfig):
        return PARTITION_RULES


FAMILY = GlmMoeDsaFamily()
