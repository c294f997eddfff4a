"""Variants of a family's model: LoRA/QLoRA adapters on a frozen base, int8 weight-only
serving. They sit above easylm/models/ (a family knows none of them): the commands build a
run's model here, `build(family, flags)`, which is the family's own unless a variant's
flags select one."""

import dataclasses

from easylm.models import decoder
from easylm.models.family import Model, ModelFamily


def build(family: ModelFamily, flags, config=None, from_checkpoint: bool = False) -> Model:
    """`family.build(flags, ...)`, or with `--lora.rank` > 0 its LoRA variant: adapters
    trained on the frozen base --load_checkpoint names (easylm/variants/lora_variant.py)."""
    config = family.model_config(flags, from_checkpoint) if config is None else config
    model = family.build(flags, config, from_checkpoint)
    lora = flags.get("lora")
    if lora is None or not lora.rank:
        return model
    from easylm.runtime.dtypes import dtype_from_flag
    from easylm.variants.lora import LoraConfig, LoraModel
    from easylm.variants.lora_variant import Host, lora_variant

    dtype = dtype_from_flag("dtype", flags.dtype)
    lm = LoraModel(family.module_class(family.unfused(config), dtype=dtype),
                   LoraConfig.from_flags(lora), dtype)
    host = Host(name=family.name, rules=model.partition_rules,
                head_weight=lambda params: decoder.head_weight(params, config),
                loss_chunk_size=config.loss_chunk_size,
                matmul_parameters=config.num_matmul_parameters())
    return lora_variant(dataclasses.replace(model, load=None), lm, host,
                        flags.get("load_checkpoint", ""), model.load)
