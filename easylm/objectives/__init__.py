"""What a run trains for (`--objective`): next-token prediction on documents, a
preference objective (DPO, SimPO, ORPO) on pairs, or GRPO on rollouts from prompts, each
an `Objective` (base.py). This module holds their flags and builds the one a run asks
for."""

from ml_collections import ConfigDict

from easylm.data.options import loader_block
from easylm.errors import UserError
from easylm.objectives import grpo, preference
from easylm.objectives.base import Objective
from easylm.objectives.next_token import NextToken

NEXT_TOKEN = "next_token"
GRPO = "grpo"
OBJECTIVES = (NEXT_TOKEN, *preference.OBJECTIVES, GRPO)
HELP = {"objective": "what to train: next_token (language modelling on text), on "
                     "preference pairs dpo, simpo or orpo (docs/preference.md), or grpo on "
                     "rollouts from prompts (docs/rl.md)",
        **preference.HELP, **grpo.HELP}
_SECTIONS = ("train_dataset", "eval_dataset")


def get_default_config() -> ConfigDict:
    """--objective and each objective's own block (--dpo.*, --simpo.*, --orpo.*, --grpo.*)."""
    config = ConfigDict()
    config.objective = NEXT_TOKEN
    for name, block in preference.get_default_config().items():
        config[name] = block
    config.grpo = grpo.get_default_config()
    return config


def build(config: ConfigDict, model, tokenizer) -> Objective:
    """The `Objective` --objective names, for `model`."""
    if config.objective == NEXT_TOKEN:
        return NextToken(model)
    if config.objective == GRPO:
        return grpo.GRPOObjective(config, model, tokenizer)
    return preference.PreferenceObjective(config, model, tokenizer)


def dataset_defaults(config: ConfigDict) -> dict:
    """A derived default (the trainer's run defaults): a preference objective reads pairs."""
    if config.objective in (NEXT_TOKEN, GRPO):
        return {}
    return {f"{section}.preference.enabled": True for section in _SECTIONS}


def unused_flags(config: ConfigDict) -> tuple:
    """Prefixes of the flags that do not change what `config` trains: the options of the
    other objectives (all of them, and --objective itself, for next-token training), left
    out of the run directory's name so that runs keep theirs."""
    others = (*preference.OBJECTIVES, GRPO)
    if config.objective == NEXT_TOKEN:
        return ("objective", *(f"{name}." for name in others))
    return tuple(f"{name}." for name in others if name != config.objective)


def check_config(config: ConfigDict) -> None:
    """--objective, its options and the datasets agree: pairs for a preference objective,
    prompts for GRPO, text else."""
    objective = config.objective
    if objective not in OBJECTIVES:
        raise UserError(f"--objective={objective!r} is not one of {', '.join(OBJECTIVES)}")
    if objective == GRPO:
        return _check_grpo(config)
    pairs = ", ".join(preference.OBJECTIVES)
    for section in _SECTIONS if config.eval_freq else _SECTIONS[:1]:
        enabled = config[section].preference.enabled
        if enabled and objective == NEXT_TOKEN:
            raise UserError(f"--{section}.preference.enabled=True makes batches of preference "
                            f"pairs, which train with --objective={pairs}, not the default "
                            f"--objective={NEXT_TOKEN}")
        if not enabled and objective != NEXT_TOKEN:
            raise UserError(f"--objective={objective} trains on preference pairs, but "
                            f"--{section}.preference.enabled=False")
    if objective == NEXT_TOKEN:
        return
    preference.check_options(objective, config[objective])
    data = config.train_dataset
    if data.type == "json" and data.json_dataset.path == "embedded":
        raise UserError(f"--objective={objective} trains on preference pairs: set "
                        f"--train_dataset.json_dataset.path to JSON lines with prompt, chosen "
                        f"and rejected (docs/preference.md)")


def _check_grpo(config: ConfigDict) -> None:
    data = config.train_dataset
    for section in _SECTIONS if config.eval_freq else _SECTIONS[:1]:
        if config[section].preference.enabled:
            raise UserError(f"--objective=grpo trains on prompts, not preference pairs: set "
                            f"--{section}.preference.enabled=False")
    if data.type == "json" and data.json_dataset.path == "embedded":
        raise UserError("--objective=grpo makes rollouts from prompts: set --train_dataset."
                        "json_dataset.path to JSON lines with a prompt (and the fields your "
                        "reward functions read, e.g. answer; docs/rl.md)")
    grpo.check_options(config.grpo, data[loader_block(data)].seq_length)
    lora = config.get("lora")
    if lora is not None and lora.get("rank") and lora.get("dropout"):
        raise UserError(f"--lora.dropout={lora.dropout} does not act in --objective=grpo (its "
                        f"forward is the serving engine's, which has none): set it to 0")
