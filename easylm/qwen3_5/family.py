"""The Qwen3.5 family (dense, MoE, and Qwen3-Next): the one object through which train, eval, plan, bench,
doctor and the converters reach the model (`FAMILY`)."""

from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader
from easylm.qwen3_5 import hf
from easylm.qwen3_5.config import NOT_BUILT, QWEN35_PRESETS, Qwen35Config
from easylm.qwen3_5.model import PARTITION_RULES, Qwen35ForCausalLM


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
                   read_config=Qwen35Config.read_hf,
                   read_params=hf_params_reader(hf.load_hf_params, Qwen35ForCausalLM),
                   write_params=hf.to_hf, not_built=NOT_BUILT)

    def partition_rules(self, config: Qwen35Config):
        return PARTITION_RULES


FAMILY = Qwen35Family()
