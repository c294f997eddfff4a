"""The LLaMA family: the one object through which train, serve, eval, plan, bench,
doctor and the converters reach the LLaMA model (`FAMILY`)."""

from easylm.llama import hf
from easylm.llama.config import ARCHITECTURES, LLAMA_PRESETS, NOT_BUILT, LLaMAConfig
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM
from easylm.models.family import HFAdapter, ModelFamily

# The embedded demo: the `embedded` preset on the embedded corpus, sized to train in
# about three minutes on two CPU cores (its warmup, 20 steps, and decay, to step 200,
# follow --total_steps as in every run). Only run-level settings here: a
# `--llama.base_model=...` flag must get that preset's shape untouched.
EMBEDDED_DEFAULTS = {
    "train_dataset.json_dataset.seq_length": 256,
    "train_dataset.json_dataset.batch_size": 16,
    "total_steps": 200,
    "log_freq": 25,
    "optimizer.adamw_optimizer.lr": 3e-3,
}


def _read_params(directory: str, config: LLaMAConfig, dtype: str = "keep", place=None):
    # As config.json describes them (laid out as `config` says): the loader then checks
    # them against `config`, which the --llama.* flags may have changed.
    return hf.load_hf_params(directory, dtype, config.scan_layers, place)[1]


class LLaMAFamily(ModelFamily):
    name = "llama"
    config_class = LLaMAConfig
    presets = LLAMA_PRESETS
    # The commands' model with no flags: the trainer's demo, and so what its checkpoints are.
    default_preset = "embedded"
    tiny_preset = "debug"
    demo = EMBEDDED_DEFAULTS
    module_class = LLaMAForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=tuple(ARCHITECTURES), read_config=hf.read_hf_config,
                   read_params=_read_params, write_params=hf.to_hf, not_built=NOT_BUILT)

    def partition_rules(self, config: LLaMAConfig):
        return PARTITION_RULES


FAMILY = LLaMAFamily()
