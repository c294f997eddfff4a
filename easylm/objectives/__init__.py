"""What a run trains for (`--objective`): the objectives the trainer knows, by name, each an
`Objective` class (base.py) that owns its flags, checks, data defaults, frozen inputs and
plan lines, and is imported only when chosen or its flags are defined (the trainer's and
the planner's flags; a serve process imports none). `--objective=MODULE:CLASS` trains a
class defined elsewhere (a test's, a user's).

Adding an objective: its class in one file, and one line in `REGISTRY`.
"""

import importlib

from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.objectives.base import Objective

REGISTRY = {
    "next_token": "easylm.objectives.next_token:NextToken",
    "dpo": "easylm.objectives.preference:DPO",
    "simpo": "easylm.objectives.preference:SimPO",
    "orpo": "easylm.objectives.preference:ORPO",
    "grpo": "easylm.objectives.grpo:GRPOObjective",
    "distill": "easylm.objectives.distill:Distill",
}
DEFAULT = "next_token"
HELP = {"objective": "what to train: next_token (language modelling on text), on "
                     "preference pairs dpo, simpo or orpo (docs/preference.md), grpo on "
                     "rollouts from prompts, or distill (a frozen teacher's distributions "
                     "on the student's samples; docs/rl.md); or MODULE:CLASS, an Objective "
                     "of your own (docs/training.md)"}
_SECTIONS = ("train_dataset", "eval_dataset")


def get(name: str):
    """The `Objective` class --objective=`name` names: a registered name or MODULE:CLASS."""
    if name not in REGISTRY and ":" not in name:
        raise UserError(f"--objective={name!r} is not one of {', '.join(REGISTRY)}")
    module, _, attribute = REGISTRY.get(name, name).partition(":")
    try:
        objective = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise UserError(f"--objective={name}: {e}") from None
    if not (isinstance(objective, type) and issubclass(objective, Objective)):
        raise UserError(f"--objective={name}: {module}.{attribute} is not an Objective class")
    return objective


def named_in(argv: list[str]) -> str | None:
    """The objective a command line names (--objective=VALUE or --objective VALUE; the
    last, as absl reads them), if it names one."""
    values = [arg.partition("=")[2] if "=" in arg else (argv[i + 1:] or [None])[0]
              for i, arg in enumerate(argv) if arg.partition("=")[0] == "--objective"]
    return values[-1] if values else None


def _chosen(config: ConfigDict):
    """The class --objective names, its flags defined (a MODULE:CLASS named only in a
    --flagfile brings none: `named_in` reads the command line)."""
    cls = get(config.objective)
    if cls.get_default_config() is not None and cls.name not in config:
        raise UserError(f"--objective={config.objective}: its flags --{cls.name}.* are "
                        f"not defined; give --objective on the command line, not in a "
                        f"--flagfile")
    return cls


def _classes(objective: str | None = None) -> list:
    """The registered classes, and the one `objective` names if it is not registered."""
    names = [*REGISTRY, *([objective] if objective and objective not in REGISTRY else [])]
    return [get(name) for name in names]


def get_default_config(objective: str | None = None) -> ConfigDict:
    """--objective and each objective's own block (--dpo.*, --simpo.*, --orpo.*, --grpo.*),
    and that of `objective` (MODULE:CLASS, from the command line) where it has one."""
    config = ConfigDict()
    config.objective = DEFAULT
    for cls in _classes(objective):
        block = cls.get_default_config()
        if block is None:
            continue
        if cls.name in config:
            raise UserError(f"--objective={objective}: its flags --{cls.name}.* are another "
                            f"objective's or --objective itself; name it otherwise")
        config[cls.name] = block
    return config


def help_entries(objective: str | None = None) -> dict:
    return {k: v for cls in _classes(objective) for k, v in cls.HELP.items()} | HELP


def build(config: ConfigDict, model, tokenizer):
    """The `Objective` --objective names, for `model`."""
    chosen = _chosen(config)
    if model.indexer_loss and not chosen.adds_indexer_loss:
        raise UserError(f"--{model.name}.indexer_loss_coef={model.indexer_loss}: the "
                        f"indexer's KL loss is added by --objective=next_token only, not "
                        f"{config.objective}; set it to 0")
    return chosen(model, config, tokenizer)


def dataset_defaults(config: ConfigDict) -> dict:
    """A derived default (the trainer's run defaults): the chosen objective's."""
    return _chosen(config).dataset_defaults(config)


def other_sections(config: ConfigDict) -> tuple:
    """The flag blocks of the objectives `config` does not train (`dpo` under
    --objective=next_token): nothing reads them in this run."""
    chosen = _chosen(config)
    return tuple(cls.name for cls in _classes(config.objective)
                 if cls is not chosen and cls.get_default_config() is not None)


def unused_flags(config: ConfigDict) -> tuple:
    """Prefixes of the flags that do not change what `config` trains: the options of the
    other objectives, and those the chosen one names, left out of the run directory's
    name so that runs keep theirs."""
    others = other_sections(config)
    return (*_chosen(config).unused_flags(config), *(f"{name}." for name in others))


def check_config(config: ConfigDict) -> None:
    """--objective, its options and the datasets agree: the datasets hold the rows the
    objective reads (preference pairs or not), then the objective's own checks."""
    chosen = _chosen(config)
    pairs = ", ".join(name for name in REGISTRY if get(name).rows == "pairs")
    for section in _SECTIONS if config.eval_freq else _SECTIONS[:1]:
        enabled = config[section].preference.enabled
        if enabled == (chosen.rows == "pairs"):
            continue
        if chosen.rows == "pairs":
            raise UserError(f"--objective={config.objective} trains on preference pairs, "
                            f"but --{section}.preference.enabled=False")
        if chosen.rows == "prompts":
            raise UserError(f"--objective={config.objective} trains on prompts, not "
                            f"preference pairs: set --{section}.preference.enabled=False")
        default = "the default " if config.objective == DEFAULT else ""
        raise UserError(f"--{section}.preference.enabled=True makes batches of preference "
                        f"pairs, which train with --objective={pairs}, not {default}"
                        f"--objective={config.objective}")
    chosen.check_config(config)
