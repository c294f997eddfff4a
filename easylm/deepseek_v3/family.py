"""The DeepSeek-V3 family (DeepSeek-V3/R1, Kimi K2, Moonlight, Kimi K2.5's text model,
Mistral Small 4): `FAMILY`."""

from easylm.deepseek_v3 import hf
from easylm.deepseek_v3.config import DEEPSEEK_V3_PRESETS, DeepseekV3Config
from easylm.deepseek_v3.model import PARTITION_RULES, DeepseekV3ForCausalLM
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class DeepseekV3Family(ModelFamily):
    name = "deepseek_v3"
    config_class = DeepseekV3Config
    presets = DEEPSEEK_V3_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = DeepseekV3ForCausalLM
    variants = ("lora", "int8")
    # kimi_k25: its text model; mistral4: model_type mistral4 (config.py)
    hf = HFAdapter(model_types=("deepseek_v3", "kimi_k25", "mistral4"),
                   read_config=DeepseekV3Config.read_hf, write_params=hf.to_hf,
                   read_params=hf_params_reader(hf.load_hf_params, DeepseekV3ForCausalLM))

    def partition_rules(self, config: DeepseekV3Config):
        return PARTITION_RULES


FAMILY = DeepseekV3Family()
