"""Dotted command-line flags from a tree of `get_default_config()` ConfigDicts.

Every leaf of the tree becomes one absl flag named by its path, EasyLM style:

    --total_steps=1000 --optimizer.adamw_optimizer.lr=3e-4 --llama.base_model=llama3_8b

absl parses them (types, `--flagfile=FILE`, `--noflag` for booleans). Unlike
ml_collections' config-dict flags (what mlxu uses), a nested field is a flag of
its own from the start, so `--help` lists it with its help text and an unknown
or mistyped one is rejected by name. Errors become one-line `UserError`s.

A default may depend on other flags (the trainer's learning-rate schedule follows
`--total_steps`): `parse(..., derived=[rule, ...])` calls each rule on the parsed tree
and sets what it returns, `{name: value}`, on the flags the command line did not give.
"""

import sys

from absl import flags
from ml_collections import ConfigDict

from easylm.errors import UserError

_DEFINE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
           float: flags.DEFINE_float, str: flags.DEFINE_string}


def flatten(config: ConfigDict, prefix: str = "") -> dict:
    """{'optimizer.adamw_optimizer.lr': 3e-4, ...} in definition order."""
    out = {}
    for key in config.keys():
        value = config[key]
        name = f"{prefix}{key}"
        if isinstance(value, ConfigDict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _leaf_type(config: ConfigDict, name: str) -> type:
    *parents, key = name.split(".")
    for parent in parents:
        config = config[parent]
    kind = config.get_type(key)
    if kind not in _DEFINE:
        raise TypeError(f"flag {name}: type {kind} is not one of bool, int, float, str")
    return kind


def define(config: ConfigDict, help_text: dict) -> flags.FlagValues:
    """A fresh FlagValues with one flag per leaf of `config`."""
    flag_values = flags.FlagValues()
    for name, default in flatten(config).items():
        _DEFINE[_leaf_type(config, name)](
            name, default, help_text.get(name, ""), flag_values=flag_values
        )
    return flag_values


def parse(config: ConfigDict, help_text: dict, argv: list[str], usage: str = "",
          derived=()) -> ConfigDict:
    """A copy of `config` with the values given in `argv` (argv[0] is the program), then
    the `derived` defaults (see the module docstring), each rule seeing the ones before.
    With --help (or -h) in `argv`, prints `usage` and every flag, and exits 0."""
    if wants_help(argv):
        print_help_and_exit(config, help_text, usage)
    flag_values = define(config, help_text)
    try:
        rest = flag_values(argv)
    except flags.Error as e:
        raise UserError(" ".join(str(e).split())) from None
    if len(rest) > 1:
        raise UserError(f"unexpected argument {rest[1]!r}; flags look like --name=value")
    parsed = ConfigDict(config.to_dict(), type_safe=False)
    for name in flatten(config):
        _set(parsed, name, flag_values[name].value)
    for rule in derived:
        for name, value in rule(parsed).items():
            if not flag_values[name].present:
                _set(parsed, name, value)
    return parsed


def get(config: ConfigDict, name: str):
    """The value of the dotted flag `name`."""
    for key in name.split("."):
        config = config[key]
    return config


def _set(config: ConfigDict, name: str, value):
    *parents, key = name.split(".")
    for parent in parents:
        config = config[parent]
    config[key] = value


def wants_help(argv: list[str]) -> bool:
    return any(arg in ("--help", "-h", "--helpfull", "-help") for arg in argv[1:])


def format_help(config: ConfigDict, help_text: dict, usage: str) -> str:
    """All flags with defaults and help, grouped by their first name component."""
    lines = [usage, ""]
    section = None
    # Top-level flags first, then one block per section.
    for name, default in sorted(flatten(config).items(), key=lambda kv: ("." in kv[0], kv[0])):
        group = name.split(".")[0] if "." in name else ""
        if group != section:
            section = group
            lines.append(f"{group}:" if group else "flags:")
        shown = "" if default is None else str(default)
        flag = f"  --{name}={shown}"
        text = help_text.get(name, "")
        lines.append(f"{flag:<50} {text}" if len(flag) < 50 else f"{flag}\n{'':<50} {text}")
    lines += ["", "Flags may also come from a file: --flagfile=FILE (one --name=value a line)."]
    return "\n".join(lines)


def print_help_and_exit(config: ConfigDict, help_text: dict, usage: str):
    print(format_help(config, help_text, usage))
    sys.exit(0)
