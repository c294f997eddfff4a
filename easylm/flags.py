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

Another program's spelling of a flag (EasyLM's `--load_llama_config=7b`) is an `Alias`:
`parse(..., aliases=[...])` rewrites each one given into the flags it stands for before
absl parses, ahead of the command line's own flags (so those win), and `--help` lists
them apart.
"""

import dataclasses
import sys
from typing import Callable

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


@dataclasses.dataclass(frozen=True)
class Alias:
    """`--name=VALUE`, another program's flag: `translate(VALUE, given)` returns the flags
    it stands for, {name: value}; `given` holds every `--name=value` of the command line
    (an alias may need another flag's value). A value it cannot map is a UserError."""

    name: str
    help: str
    translate: Callable[[str, dict], dict]


def _rewrite(argv: list[str], aliases) -> list[str]:
    """argv with each alias replaced by the flags it stands for, placed first."""
    by_name = {alias.name: alias for alias in aliases}
    given = dict(arg[2:].partition("=")[::2] for arg in argv[1:]
                 if arg.startswith("--") and "=" in arg)
    translated, rest = [], []
    for arg in argv[1:]:
        name = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if name not in by_name:
            rest.append(arg)
        elif "=" not in arg:
            raise UserError(f"--{name} needs a value: --{name}=VALUE ({by_name[name].help})")
        else:
            translated += [f"--{flag}={value}" for flag, value in
                           by_name[name].translate(given[name], given).items()]
    return argv[:1] + translated + rest


def define(config: ConfigDict, help_text: dict) -> flags.FlagValues:
    """A fresh FlagValues with one flag per leaf of `config`."""
    flag_values = flags.FlagValues()
    for name, default in flatten(config).items():
        _DEFINE[_leaf_type(config, name)](
            name, default, help_text.get(name, ""), flag_values=flag_values
        )
    return flag_values


def parse(config: ConfigDict, help_text: dict, argv: list[str], usage: str = "",
          derived=(), common=(), aliases=(), absent=None) -> ConfigDict:
    """A copy of `config` with the values given in `argv` (argv[0] is the program; its
    `aliases` rewritten first), then the `derived` defaults (see the module docstring),
    each rule seeing the ones before. With --help (or -h) in `argv`, prints `usage` and
    the `common` flags (all of them when `common` is empty) and the aliases, with
    --helpfull every flag, and exits 0. `absent`: {section: why its flags are not
    offered here}, the line a flag of such a section gets instead of 'unknown flag'."""
    if wants_help(argv):
        print_help_and_exit(config, help_text, usage, common,
                            full="--helpfull" in argv[1:] or not common, aliases=aliases)
    argv = _rewrite(argv, aliases)
    for arg in argv[1:]:
        name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        if name.partition(".")[0] in (absent or {}):
            raise UserError(f"--{name}: {absent[name.partition('.')[0]]}")
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


def _help_line(name: str, default, text: str) -> str:
    flag = f"  --{name}={'' if default is None else default}"
    return f"{flag:<50} {text}" if len(flag) < 50 else f"{flag}\n{'':<50} {text}"


def format_help(config: ConfigDict, help_text: dict, usage: str, common=(),
                full: bool = True, aliases=()) -> str:
    """Not `full`: the `common` flags, in that order, and how to see the rest. `full`: all
    flags with defaults and help, grouped by their first name component (the groups of
    `common` first); a group with the same flags as an earlier one (eval_dataset's,
    train_dataset's) lists only those that differ."""
    values = flatten(config)
    lines = [usage, ""]
    if not full:
        lines.append("most used flags:")
        lines += [_help_line(name, values[name], help_text.get(name, "")) for name in common]
        lines += _alias_lines(aliases) + ["", f"all {len(values)} flags: --helpfull"]
        return "\n".join(lines)
    groups: dict[str, dict] = {"": {}}
    # Top-level flags first, then the groups of the common flags, then the rest;
    # alphabetical within each.
    for name in [*common, *sorted(values)]:
        groups.setdefault(name.partition(".")[0] if "." in name else "", {})
    for name, default in sorted(values.items()):
        groups[name.partition(".")[0] if "." in name else ""][name] = default
    seen: dict[frozenset, str] = {}
    for group, flags_ in groups.items():
        suffixes = {name[len(group) + 1:]: (default, help_text.get(name, ""))
                    for name, default in flags_.items()} if group else {}
        twin = seen.get(frozenset(suffixes)) if group else None
        if twin is None:
            if group:
                seen[frozenset(suffixes)] = group
            lines.append(f"{group}:" if group else "flags:")
            lines += [_help_line(name, default, help_text.get(name, ""))
                      for name, default in flags_.items()]
            continue
        lines.append(f"{group}: the same flags as {twin}.* (--{group}.NAME); those that "
                     f"differ:")
        for suffix, (default, text) in suffixes.items():
            if (default, text) != (values[f"{twin}.{suffix}"], help_text.get(f"{twin}.{suffix}", "")):
                lines.append(_help_line(f"{group}.{suffix}", default, text))
    lines += _alias_lines(aliases)
    lines += ["", "Flags may also come from a file: --flagfile=FILE (one --name=value a line)."]
    return "\n".join(lines)


def _alias_lines(aliases) -> list[str]:
    if not aliases:
        return []
    return ["", "EasyLM aliases (EasyLM's flag names, rewritten into the flags above):"] + \
        [_help_line(alias.name, "VALUE", alias.help) for alias in aliases]


def print_help_and_exit(config: ConfigDict, help_text: dict, usage: str, common=(),
                        full: bool = True, aliases=()):
    print(format_help(config, help_text, usage, common, full, aliases))
    sys.exit(0)
