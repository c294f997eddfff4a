"""`python -m easylm.eval` (and `python -m easylm.llama.eval`): a checkpoint of any model
family evaluated with lm-evaluation-harness, in-process.

Prints lm-eval's table and writes its results as JSON (and with --log_samples every
request and response) to --output_dir, by default CHECKPOINT-eval/ beside the
checkpoint. The model loads as the family's server loads it; its engine flags
(--batch_size, --seq_length, ...) are the server's. See docs/evaluation.md.
"""

import logging
import os
import sys

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

from easylm import flags as flag_lib, model_flags
from easylm.errors import UserError, exit_on_user_error
from easylm.evaluation import harness_flags
from easylm.models.family import ModelFamily
from easylm.runtime import checkpoint, run_flags
from easylm.serving import cli as serving_cli


HELP = {
    "load_checkpoint": run_flags.help_text("load_checkpoint", "required"),
    # Meant as the trainer's --eval_harness.* are: their text lives there (lm-eval-free).
    **{name: harness_flags.HELP[name]
       for name in ("batch_size", "max_gen_toks", "num_fewshot", "limit", "include_path")},
    "tasks": "comma-separated lm-eval task, group or tag names (or task YAML paths)",
    "output_dir": "where results_*.json (and samples_*.jsonl) go; empty: CHECKPOINT-eval "
                  "beside a local checkpoint (the --lora_checkpoint's, where given)",
    "log_samples": "also write every document's requests and responses, one JSONL per task",
    "bootstrap_iters": "bootstrap resamples for the standard errors; 0: none (faster)",
}


def usage(family: ModelFamily) -> str:
    return (f"usage: {model_flags.command(family, 'eval')} --load_checkpoint=... --tasks=a,b "
            f"[--flag=value ...]")


def model_config(family: ModelFamily) -> ConfigDict:
    """The flags that load the model: the server's checkpoint, tokenizer and engine flags."""
    config = serving_cli.engine_config(family)
    config.max_gen_toks = 256
    return config


def default_config(family: ModelFamily) -> ConfigDict:
    config = model_config(family)
    config.tasks = ""
    config.num_fewshot = placeholder(int)
    config.limit = placeholder(float)
    config.include_path = ""
    config.output_dir = ""
    config.log_samples = False
    config.bootstrap_iters = 100000
    return config


def help_entries(family: ModelFamily) -> dict:
    return {**serving_cli.engine_help_entries(family), **HELP}


def load(family: ModelFamily, config: ConfigDict, cls=None):
    """The model of `config` (`model_config()` flags) as an lm-eval model, a `HarnessLM`
    (or `cls`, a subclass)."""
    from easylm.evaluation.harness import HarnessLM

    _require_checkpoint(config)
    engine, tokenizer, stop_ids = serving_cli.load_engine(family, config)
    return (cls or HarnessLM)(engine, tokenizer, stop_ids, max_gen_toks=config.max_gen_toks)


def _require_checkpoint(config: ConfigDict):
    if not config.load_checkpoint:
        raise UserError("--load_checkpoint is required (params::DIR, trainstate::DIR, "
                        "trainstate_params::DIR or hf::DIR)")


def output_directory(config: ConfigDict) -> str:
    """--output_dir, or CHECKPOINT-eval beside a local checkpoint (the --lora_checkpoint's,
    where adapters are given: the model evaluated is the run's, not its base); checked to
    be creatable (it is created when there are results to put in it)."""
    directory = config.output_dir
    if not directory and config.get("lora_checkpoint"):
        path = config.lora_checkpoint
        if "://" in path:
            raise UserError(f"the adapters are at {path}: pass --output_dir=DIR, a local "
                            f"directory for the results")
        directory = path.rstrip("/") + "-eval"
    elif not directory:
        _, path = checkpoint.parse_load_spec(config.load_checkpoint,
                                             ("hf",) + checkpoint.LOAD_PREFIXES)
        if "://" in path:
            raise UserError(f"the checkpoint is at {path}: pass --output_dir=DIR, a local "
                            f"directory for the results")
        directory = path.rstrip("/") + "-eval"
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"cannot write the results into {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK):
        raise UserError(f"cannot write the results into {directory}: {existing} is not writable")
    return directory


@exit_on_user_error
def main(family: ModelFamily, argv=None):
    config = flag_lib.parse(default_config(family), help_entries(family), argv or sys.argv,
                            usage(family))
    # Here, not at the top: without lm-eval installed, one line that says how to get it.
    from easylm.evaluation.harness import (
        check_generation_room,
        evaluate,
        load_tasks,
        table,
        write_results,
    )

    tasks = [t for t in config.tasks.split(",") if t]
    if not tasks:
        raise UserError("--tasks is required: comma-separated lm-eval task names")
    _require_checkpoint(config)
    if config.limit is not None and config.limit <= 0:
        raise UserError(f"--limit must be > 0, got {config.limit}")
    if config.num_fewshot is not None and config.num_fewshot < 0:
        raise UserError(f"--num_fewshot must be >= 0, got {config.num_fewshot}")
    # What can be checked without the model is checked before it loads.
    manager, tasks = load_tasks(tasks, config.include_path)
    directory = output_directory(config)
    lm = load(family, config)
    check_generation_room(tasks, config.max_gen_toks, lm.max_length)
    # lm-eval's progress from here on (a refusal above stays one line). force: importing
    # orbax already gave the root logger a WARNING-level handler (absl).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        force=True)
    results = evaluate(lm, tasks, manager, config.num_fewshot, config.limit, config.log_samples,
                       config.bootstrap_iters)
    model_flags = model_config(family)
    results["config"].update(model="easylm", model_args={
        k: v for k, v in flag_lib.flatten(config).items() if k.split(".")[0] in model_flags})
    print(table(results))
    paths = write_results(results, directory)
    print(f"results: {paths[0]}")
    for path in paths[1:]:
        print(f"samples: {path}")

