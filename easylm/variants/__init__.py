"""Variants of a family's model: LoRA/QLoRA adapters on a frozen base, int8 weight-only
serving (`--quantize=int8`). They sit above easylm/models/ (a family knows none of them,
it only names the ones it offers in `ModelFamily.variants`): the commands build a run's
model here, `build(family, flags)`, which is the family's own unless a variant's flags
select one, and ask here for the variants' flags, help, run defaults and state settings."""

import dataclasses

import jax

from easylm import model_flags
from easylm.errors import UserError
from easylm.models import decoder
from easylm.models.family import Model, ModelFamily


def _offered(family: ModelFamily, serving: bool = False) -> list:
    """The variant objects `family` offers (imported only for a family that offers one);
    with `serving`, those a served model takes (int8: LoRA adapters are served merged,
    --lora_checkpoint)."""
    offered = []
    if "lora" in family.variants and not serving:
        from easylm.variants.lora_variant import LORA

        offered.append(LORA)
    if "int8" in family.variants:
        from easylm.variants.quantize import INT8

        offered.append(INT8)
    return offered


def absent_sections(family: ModelFamily) -> dict:
    """{variant flag section: why} for the variants `family` does not offer (`flags.parse`'s
    `absent`): `--lora.rank=8` on such a family is that one line, not 'unknown flag'."""
    if "lora" in family.variants:
        return {}
    return {"lora": f"--family={family.name} does not offer LoRA as yet (docs/lora.md names "
                    f"the families that do)"}


def flag_sections(family: ModelFamily, serving: bool = False) -> dict:
    """Top-level flags that select a variant (`--lora.*`, `--quantize`), with their
    defaults; with `serving`, only those of the variants a served model takes."""
    return {variant.section: variant.flags() for variant in _offered(family, serving)}


def help_entries(family: ModelFamily, serving: bool = False) -> dict:
    """--help text of `flag_sections`' fields, by dotted name."""
    return {name: text for variant in _offered(family, serving)
            for name, text in variant.help().items()}


def unused_flags(family: ModelFamily, flags) -> tuple:
    """Prefixes of `flag_sections` that select nothing in `flags` (LoRA's with
    --lora.rank=0): left out of the run directory's name, which runs without the variant
    then keep."""
    return tuple(variant.prefix for variant in _offered(family)
                 if not variant.selected(flags))


def run_defaults(family: ModelFamily, flags) -> dict:
    """Run defaults a selected variant sets over the fine-tuning ones (LoRA's learning
    rate); a variant that sets a learning rate gets no full-fine-tuning warning."""
    return {name: value for variant in _offered(family)
            for name, value in variant.run_defaults(flags).items()}


def state_settings(family: ModelFamily, flags: dict, config: dict) -> dict:
    """What a run's trained parameters mean besides their values, by the flag that sets it:
    whether its layers are stacked (`model_flags.layout_setting`) and its variants' (LoRA's
    rank, ...)."""
    settings = model_flags.layout_setting(family, config)
    for variant in _offered(family):
        settings.update(variant.state_settings(flags))
    return settings


def merge_adapters(family: ModelFamily, spec: str, base_spec: str, config, params, mesh):
    """`params` (of `family.bind(config)`, on `mesh`, read from `base_spec`) with the
    adapters at `spec` folded in, once they are known to be that base's: the server's
    --lora_checkpoint."""
    if "lora" not in family.variants:
        raise UserError(f"--lora_checkpoint={spec}: the {family.name} family has no adapters")
    from easylm.variants.adapters import Adapters

    return Adapters(family).merge_into(spec, base_spec, config, params, mesh)


def build(family: ModelFamily, flags, config=None, from_checkpoint: bool = False,
          serving: bool = False) -> Model:
    """`model_flags.build(family, flags, ...)`, or the variant its flags select: with
    `--lora.rank` > 0 its LoRA variant, adapters trained on the frozen base
    --load_checkpoint names (easylm/variants/lora_variant.py); with `--quantize=int8` and
    `serving`, its int8 weight-only model (easylm/variants/quantize.py), read as the float
    one (with the adapters of --lora_checkpoint folded in) and quantized on the devices.
    int8 is refused for training, and without `serving`, in one line."""
    if family.not_in_commands:
        raise UserError(f"--family={family.name}: {family.not_in_commands}")
    if config is None:
        config = model_flags.model_config(family, flags, from_checkpoint)
    model = model_flags.build(family, flags, config, from_checkpoint)
    lora = flags.get("lora")
    int8 = _int8(family, flags, serving, lora is not None and bool(lora.rank))
    if serving and flags.get("lora_checkpoint"):
        model = _merging(family, flags.lora_checkpoint, config, model)
    if int8:
        from easylm.runtime.dtypes import dtype_from_flag
        from easylm.variants.quantize import int8_variant

        return int8_variant(family, config, dtype_from_flag("dtype", flags.dtype), model)
    if lora is None or not lora.rank:
        return model
    from easylm.runtime.dtypes import dtype_from_flag
    from easylm.variants.adapters import Adapters
    from easylm.variants.lora import LoraConfig
    from easylm.variants.lora_variant import Host, lora_variant

    dtype = dtype_from_flag("dtype", flags.dtype)
    lm = Adapters(family).lora_model(config, LoraConfig.from_flags(lora), dtype)
    host = Host(name=family.name, rules=model.partition_rules,
                head_weight=lambda params: decoder.head_weight(params, config),
                loss_chunk_size=config.loss_chunk_size,
                matmul_parameters=config.num_matmul_parameters())
    return lora_variant(dataclasses.replace(model, load=None), lm, host,
                        flags.get("load_checkpoint", ""), model.load)


def training_problems(family: ModelFamily, flags) -> list[str]:
    """What the trainer refuses of the variants' flags at its start, as lines (for the
    doctor): int8, which serves but does not train."""
    lora = flags.get("lora")
    try:
        _int8(family, flags, serving=False, lora=bool(lora is not None and lora.get("rank")))
    except UserError as e:
        return [str(e)]
    return []


def _int8(family: ModelFamily, flags, serving: bool, lora: bool) -> bool:
    """Whether `flags` select the int8 variant: refused (one line) for a family without
    it, for training, and beside LoRA adapters being trained."""
    if "int8" not in family.variants:
        if flags.get("quantize", "none") != "none":
            raise UserError(f"--quantize={flags.quantize}: the {family.name} family has no "
                            f"int8 variant")
        return False
    from easylm.variants.quantize import INT8

    if not serving:
        INT8.refuse_training(flags)
    if INT8.selected(flags) and lora:
        raise UserError("--quantize=int8 serves a whole model; --lora.rank trains adapters: "
                        "give one (an int8 base for adapters: --lora.base_dtype=int8)")
    return INT8.selected(flags)


def _merging(family: ModelFamily, spec: str, config, model: Model) -> Model:
    """`model` whose `load` folds the adapters at `spec` (--lora_checkpoint) into the
    weights it reads, before any quantizing."""
    load = model.load

    def merged(base_spec, abstract):
        params = load(base_spec, abstract)
        mesh = jax.tree.leaves(abstract)[0].sharding.mesh
        return merge_adapters(family, spec, base_spec, config, params, mesh)

    return dataclasses.replace(model, load=merged)
