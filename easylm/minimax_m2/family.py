"""The MiniMax-M2 family (M2, M2.1, M2.5, M2.7): `FAMILY`."""

from easylm.minimax_m2 import hf
from easylm.minimax_m2.config import MINIMAX_M2_PRESETS, MiniMaxM2Config
from easylm.minimax_m2.model import PARTITION_RULES, MiniMaxM2ForCausalLM
from easylm.models.family import HFAdapter, ModelFamily, layout


def _read_params(directory: str, config: MiniMaxM2Config, dtype: str = "keep", place=None):
    return layout(FAMILY, hf.load_hf_params(directory, dtype, place)[1], config)


class MiniMaxM2Family(ModelFamily):
    name = "minimax_m2"
    config_class = MiniMaxM2Config
    presets = MINIMAX_M2_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = MiniMaxM2ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("minimax_m2",), read_config=hf.read_hf_config,
                   read_params=_read_params, write_params=hf.to_hf)

    def partition_rules(self, config: MiniMaxM2Config):
        return PARTITION_RULES


FAMILY = MiniMaxM2Family()
