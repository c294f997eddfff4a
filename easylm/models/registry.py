"""The model families the generic commands (`python -m easylm.train|serve|eval|plan|bench|
doctor`) know, by name, each imported only when asked for: `--family=NAME` (default: the
family of the checkpoint given, else llama), or `--family=MODULE:ATTRIBUTE` for a family
defined elsewhere (a test's, a plugin's).

The one module outside a family's package that names it; a family's own commands
(`python -m easylm.llama.train|serve|eval`) pass their family object directly.
"""

import importlib
import json
import os

from easylm.errors import UserError
from easylm.models.family import ModelFamily

FAMILIES = {"llama": "easylm.llama.family:FAMILY", "gemma": "easylm.gemma.family:FAMILY",
            "gpt_oss": "easylm.gpt_oss.family:FAMILY", "qwen3_5": "easylm.qwen3_5.family:FAMILY",
            "deepseek_v3": "easylm.deepseek_v3.family:FAMILY",
            "glm4_moe": "easylm.glm4_moe.family:FAMILY",
            "gemma4": "easylm.gemma4.family:FAMILY", "olmo3": "easylm.olmo3.family:FAMILY",
            "minimax_m2": "easylm.minimax_m2.family:FAMILY",
            "qwen3_5_vl": "easylm.qwen3_5.vision_hf:FAMILY",
            "gemma4_vl": "easylm.gemma4.vision_hf:FAMILY",
            "deepseek_v32": "easylm.deepseek_v3.v32:FAMILY",
            "glm_moe_dsa": "easylm.deepseek_v3.glm5:FAMILY",
            "llama4": "easylm.llama4.family:FAMILY",
            "deepseek_v4": "easylm.deepseek_v4.family:FAMILY"}
DEFAULT = "llama"
# The flags that name what a command loads, whose family it then is.
CHECKPOINT_FLAGS = ("--load_checkpoint=", "--lora_checkpoint=")


def get(name: str = DEFAULT) -> ModelFamily:
    if name not in FAMILIES and ":" not in name:
        raise UserError(f"--family={name!r} is not one of {', '.join(FAMILIES)} (or "
                        f"MODULE:ATTRIBUTE)")
    module, _, attribute = FAMILIES.get(name, name).partition(":")
    try:
        family = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise UserError(f"--family={name}: {e}") from None
    if not isinstance(family, ModelFamily):
        raise UserError(f"--family={name}: {module}.{attribute} is not a ModelFamily")
    return family


def from_argv(argv: list[str], detect: bool = False) -> tuple[ModelFamily, list[str]]:
    """(the family a `--family=NAME` argument names; else with `detect` the family of the
    checkpoint the arguments load (`family_of`); else the default; argv without --family).
    """
    name, rest = None, []
    for arg in argv:
        if arg.startswith("--family="):
            name = arg.partition("=")[2]
        else:
            rest.append(arg)
    if name is None and detect:
        name = next((family_of(arg.partition("=")[2]) for arg in rest
                     if arg.startswith(CHECKPOINT_FLAGS)), None)
    return get(name or DEFAULT), rest


def family_of(spec: str) -> str | None:
    """The family that reads checkpoint `spec`: for `hf::DIR` the one whose
    Hugging Face adapter reads its config.json's model_type, for an easylm checkpoint the one
    its metadata names; None where neither says (the command then reports what is
    wrong with `spec`, if anything)."""
    prefix, sep, path = spec.partition("::")
    if not sep:  # --lora_checkpoint=DIR
        path = spec
    elif prefix == "hf":
        return _family_of_hf(path)
    if not path or not os.path.isdir(path):
        return None
    from easylm.runtime import checkpoint

    try:
        name = checkpoint.read_metadata(path).get("model")
    except Exception:  # no metadata here: not for the family choice to report
        return None
    if name is not None and name not in FAMILIES:
        raise UserError(f"{spec}: its metadata names model {name!r}, which is not one of "
                        f"{', '.join(FAMILIES)}; pass --family=MODULE:ATTRIBUTE")
    return name


def _family_of_hf(directory: str) -> str | None:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # the family's own reader names what is wrong with the file
    adapters = {name: get(name).hf for name in FAMILIES}
    known = {name: hf.model_types for name, hf in adapters.items() if hf is not None}
    for name, types in known.items():
        if model_type in types:
            return name
    for hf in adapters.values():
        why = hf.not_built.get(model_type) if hf is not None else None
        if why:
            raise UserError(f"{path}: model_type {model_type!r} is not built: its {why} is "
                            f"not supported")
    readable = "; ".join(f"{name}: {', '.join(types)}" for name, types in known.items())
    raise UserError(f"{path}: model_type {model_type!r} is not one easylm reads ({readable})")
