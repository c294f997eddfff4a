"""The DeepSeek-V4 family (V4-Flash, V4-Pro): `FAMILY`. Full forward (training,
scoring) and serving (its caches all positional: model.py's docstring) exact to
transformers; LoRA and int8 by transformers' module names (hf.MODULE_RENAMES)."""

from easylm.deepseek_v4 import hf
from easylm.deepseek_v4.config import DEEPSEEK_V4_PRESETS, DeepseekV4Config
from easylm.deepseek_v4.model import PARTITION_RULES, DeepseekV4ForCausalLM
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class DeepseekV4Family(ModelFamily):
    name = "deepseek_v4"
    variants = ("lora", "int8")
    config_class = DeepseekV4Config
    presets = DEEPSEEK_V4_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = DeepseekV4ForCausalLM
    hf = HFAdapter(model_types=("deepseek_v4",), read_config=DeepseekV4Config.read_hf,
                   read_params=hf_params_reader(hf.load_hf_params, DeepseekV4ForCausalLM),
                   write_params=hf.to_hf, module_renames=hf.MODULE_RENAMES)

    def partition_rules(self, config: DeepseekV4Config):
        return PARTITION_RULES


FAMILY = DeepseekV4Family()
