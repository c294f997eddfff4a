"""The DeepSeek-V3.2 family (DeepSeek-V3.2-Exp, DeepSeek-V3.2): `FAMILY`. DeepSeek-V3
(easylm/deepseek_v3) with DeepSeek sparse attention (easylm/models/sparse_attention.py);
its checkpoints are DeepSeek-V3's names (easylm/models/sigmoid_moe_hf.py) and the
indexer's (`self_attn.indexer.wq_b`, `wk`, `k_norm`, `weights_proj`)."""

from easylm.deepseek_v32 import hf
from easylm.deepseek_v32.config import DEEPSEEK_V32_PRESETS, DeepseekV32Config
from easylm.deepseek_v32.model import PARTITION_RULES, DeepseekV32ForCausalLM
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class DeepseekV32Family(ModelFamily):
    name = "deepseek_v32"
    config_class = DeepseekV32Config
    presets = DEEPSEEK_V32_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = DeepseekV32ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("deepseek_v32",), read_config=DeepseekV32Config.read_hf,
                   write_params=hf.to_hf,
                   read_params=hf_params_reader(hf.load_hf_params, DeepseekV32ForCausalLM))

    def partition_rules(self, config: DeepseekV32Config):
        return PARTITION_RULES


FAMILY = DeepseekV32Family()
