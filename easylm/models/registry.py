"""The model families the generic commands (`python -m easylm.plan|bench|doctor`) know,
by name, each imported only when asked for: `--family=NAME` (default: llama), or
`--family=MODULE:ATTRIBUTE` for a family defined elsewhere (a test's, a plugin's).

The one module outside a family's package that names it; a family's own commands
(`python -m easylm.llama.train|serve|eval`) pass their family object directly.
"""

import importlib

from easylm.errors import UserError
from easylm.models.family import ModelFamily

FAMILIES = {"llama": "easylm.llama.family:FAMILY"}
DEFAULT = "llama"


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


def from_argv(argv: list[str]) -> tuple[ModelFamily, list[str]]:
    """(the family a `--family=NAME` argument names, or the default; argv without it)."""
    name, rest = DEFAULT, []
    for arg in argv:
        if arg.startswith("--family="):
            name = arg.partition("=")[2]
        else:
            rest.append(arg)
    return get(name), rest
