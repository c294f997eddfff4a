"""The MiniMax-M2 family (M2, M2.1, M2.5, M2.7): `FAMILY`."""

from easylm.minimax_m2 import hf
from easylm.minimax_m2.config import MINIMAX_M2_PRESETS, MiniMaxM2Config
from easylm.minimax_m2.model import PARTITION_RULES, MiniMaxM2ForCausalLM
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class MiniMaxM2Family(ModelFamily):
    name = "minimax_m2"
    config_class = MiniMaxM2Config
    presets = MINIMAX_M2_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = MiniMaxM2ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("minimax_m2",), read_config=MiniMaxM2Config.read_hf,
                   read_params=hf_params_reader(hf.load_hf_params, MiniMaxM2ForCausalLM),
                   write_params=hf.to_hf)

    def partition_rules(self, config: MiniMaxM2Config):
        return PARTITION_RULES


FAMILY = MiniMaxM2Family()
