"""A family's model on the command line: the `--<family>.*` flags and their help, derived
from its config dataclass (each field a flag, its help the field's metadata), the config a
command's flags (or the checkpoint it loads) describe, the `Model` they build, and the
commands a run's hints name. easylm/models knows nothing of flags; the commands (train,
serve, eval, convert, plan, bench, doctor) ask here.

    model_config(family, flags)   --<family>.base_model's preset, or the config the
                                  checkpoint records (hf::DIR's config.json, an easylm
                                  checkpoint's metadata), then the --<family>.* fields given
    build(family, flags)          that config bound to --dtype / --param_dtype: a Model
"""

import dataclasses
import importlib.util
import os

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

from easylm.errors import UserError
from easylm.models import registry
from easylm.models.family import Model, ModelFamily, hf_adapter, load_params


def flag_config(family: ModelFamily, base_model: str | None = None) -> ConfigDict:
    """The `--<name>.*` flag tree: a preset name plus optional per-field overrides."""
    config = ConfigDict()
    config.base_model = base_model or family.default_preset
    for field in dataclasses.fields(family.config_class):
        config[field.name] = placeholder(_flag_type(field))
    return config


def help_entries(family: ModelFamily, source: str = "the preset's") -> dict:
    """`--<name>.*` help: each field's own text and where its default comes from."""
    entries = {f"{family.name}.base_model": f"preset: {', '.join(family.presets)}"}
    for field in dataclasses.fields(family.config_class):
        text = field.metadata.get("help", "")
        entries[f"{family.name}.{field.name}"] = f"{text} (unset: {source} value)".strip()
    return entries


def _flag_type(field: dataclasses.Field) -> type:
    kind = field.type
    if isinstance(kind, str):  # postponed annotations
        kind = {"int": int, "float": float, "str": str, "bool": bool}[kind.split(" ")[0]]
    if kind not in (int, float, str, bool):  # `int | None`
        kind = int
    return kind


def metadata_key(family: ModelFamily) -> str:
    """Where a checkpoint's metadata records the model config."""
    return f"{family.name}_config"


def model_config(family: ModelFamily, flags: ConfigDict, from_checkpoint: bool = False):
    """The model's config from a command's parsed flags: the config hf::DIR's
    config.json gives (and, with `from_checkpoint`, the one an easylm checkpoint's
    metadata records), else the --<name>.base_model preset; then the --<name>.* fields
    given on the command line."""
    block = dict(flags[family.name])
    preset = block.pop("base_model")
    overrides = {k: v for k, v in block.items() if v is not None}
    recorded = recorded_config(family, flags.get("load_checkpoint", ""), from_checkpoint)
    if recorded is None:
        return family.from_preset(preset, **overrides)
    return recorded.replace(**overrides)


def recorded_config(family: ModelFamily, spec: str, from_checkpoint: bool = True):
    """The config a `--load_checkpoint` spec records, or None."""
    from easylm.runtime import checkpoint

    prefix, _, path = spec.partition("::")
    if prefix == "hf":
        return hf_adapter(family).read_config(path)
    if not (spec and from_checkpoint):
        return None
    _, directory = checkpoint.parse_load_spec(spec)
    if not os.path.isdir(os.path.join(directory, "metadata")):
        return None
    recorded = checkpoint.read_metadata(directory).get(metadata_key(family))
    if recorded is None:
        return None
    return config_from_metadata(family, recorded, directory)


def config_from_metadata(family: ModelFamily, recorded: dict, directory: str):
    """The family's config from the dict a checkpoint's metadata records."""
    unknown = set(recorded) - set(family.config_class.field_names())
    if unknown:
        raise UserError(f"{directory}: its {metadata_key(family)} has field(s) the "
                        f"{family.name} model does not know: {', '.join(sorted(unknown))}")
    return family.config_class(**recorded)


def build(family: ModelFamily, flags: ConfigDict, config=None,
          from_checkpoint: bool = False) -> Model:
    """The Model `flags` describe (`model_config`), bound to --dtype and --param_dtype
    (when a command has no --param_dtype, parameters are kept in --dtype), loading what
    --load_checkpoint names."""
    from easylm.runtime.dtypes import dtype_from_flag

    config = model_config(family, flags, from_checkpoint) if config is None else config
    dtype = dtype_from_flag("dtype", flags.dtype)
    param_dtype = (dtype_from_flag("param_dtype", flags.param_dtype)
                   if "param_dtype" in flags else dtype)
    model = family.bind(config, dtype, param_dtype)
    load = lambda spec, abstract: load_params(  # noqa: E731
        family, spec, config, abstract, model.partition_rules)
    return dataclasses.replace(model, load=load)


def layout_setting(family: ModelFamily, config: dict) -> dict:
    """Whether a run's layers are stacked, by the flag that sets it: a trainstate's
    optimizer state is not relaid out, so a resume under the other layout is refused."""
    return {f"--{family.name}.scan_layers": bool(config.get("scan_layers"))}


def command(family: ModelFamily, verb: str) -> str:
    """How a user runs `verb` (train, serve, eval) for `family`: its package's own entry
    point where it has one (`python -m easylm.llama.serve`, EasyLM's), else the generic
    command, which finds the family from the checkpoint it loads (and is told it when the
    family is not registered)."""
    package = type(family).__module__.rpartition(".")[0]
    if package and importlib.util.find_spec(f"{package}.{verb}") is not None:
        return f"python -m {package}.{verb}"
    if family.name in registry.FAMILIES:
        return f"python -m easylm.{verb}"
    return f"python -m easylm.{verb} --family={type(family).__module__}:FAMILY"
