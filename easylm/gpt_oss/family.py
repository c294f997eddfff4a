"""The gpt-oss family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the gpt-oss model (`FAMILY`)."""

from easylm.gpt_oss import hf
from easylm.gpt_oss.config import GPT_OSS_PRESETS, GptOssConfig
from easylm.gpt_oss.model import GptOssForCausalLM, partition_rules
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader


class GptOssFamily(ModelFamily):
    name = "gpt_oss"
    config_class = GptOssConfig
    presets = GPT_OSS_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = GptOssForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("gpt_oss",), read_config=GptOssConfig.read_hf,
                   read_params=hf_params_reader(hf.load_hf_params, GptOssForCausalLM),
                   write_params=hf.to_hf, gate_up_interleaved=True)

    def partition_rules(self, config: GptOssConfig):
        return partition_rules(config)


FAMILY = GptOssFamily()
