"""The Qwen3.5 family (dense, MoE, and Qwen3-Next): the one object through which train, eval, plan, bench,
doctor and the converters reach the model (`FAMILY`)."""

from easylm.models.family import HFAdapter, ModelFamily, layout
from easylm.qwen3_5 import hf
from easylm.qwen3_5.config import NOT_BUILT, QWEN35_PRESETS, Qwen35Config
from easylm.qwen3_5.model import PARTITION_RULES, Qwen35ForCausalLM


def _read_params(directory: str, config: Qwen35Config, dtype: str = "keep", place=None):
    # As config.json describes them, laid out as `config` says: the loader then checks
    # them against `config`, which the --qwen3_5.* flags may have changed.
    return layout(FAMILY, hf.load_hf_params(directory, dtype, place)[1], config)


class Qwen35Family(ModelFamily):
    name = "qwen3_5"
    config_class = Qwen35Config
    presets = QWEN35_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = Qwen35ForCausalLM
    # LoRA: every projection (nn.Dense) is a target, the DeltaNet ones by transformers'
    # names (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a or in_proj_qkvz, in_proj_ba,
    # out_proj), and the expert stacks as moe.py adapts them.
    variants = ("lora", "int8")
    # qwen3_5 and qwen3_5_moe: the multimodal checkpoints' text models
    hf = HFAdapter(model_types=("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe",
                                "qwen3_next"),
                   read_config=hf.read_hf_config, read_params=_read_params,
                   write_params=hf.to_hf, not_built=NOT_BUILT)

    def partition_rules(self, config: Qwen35Config):
        return PARTITION_RULES


FAMILY = Qwen35Family()
