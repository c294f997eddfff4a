"""The Gemma 3 family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the Gemma model (`FAMILY`)."""


from easylm.gemma import hf
from easylm.gemma.config import GEMMA_PRESETS, GemmaConfig
from easylm.gemma.model import GemmaForCausalLM, partition_rules
from easylm.models import remat
from easylm.models.family import ModelFamily


class GemmaFamily(ModelFamily):
    name = "gemma"
    config_class = GemmaConfig
    presets = GEMMA_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    commands = "easylm.gemma"
    hf_model_types = ("gemma3_text", "gemma3")  # gemma3: its text tower
    remat_policies = remat.NAMES
    variants = ("lora",)
    module_class = GemmaForCausalLM

    def partition_rules(self, config: GemmaConfig):
        return partition_rules(config)

    def read_hf_config(self, directory: str) -> GemmaConfig:
        return hf.read_hf_config(directory)

    def hf_params(self, directory: str, config: GemmaConfig, dtype: str = "keep", place=None):
        # As config.json describes them, laid out as `config` says: `load_hf` then checks
        # them against `config`, which the --gemma.* flags may have changed.
        return self.layout(hf.load_hf_params(directory, dtype, place)[1], config)

    def to_hf(self, params, config: GemmaConfig):
        return hf.to_hf(params, config)


FAMILY = GemmaFamily()
