"""`python -m <family>.train`: the trainer, for any model family.

A model family (`easylm.models.family.ModelFamily`) gives the trainer a `Model` (how to
initialise parameters, the loss, the partition rules, FLOPs per token), and
`--objective` an `Objective` (easylm/objectives/). The trainer's parts, in the order a run
meets them:

    options.py  flags, their help and the defaults that depend on the run; checks
    setup.py    `start`: mesh, model, objective, data, run directory, state, jitted steps
    state.py    the train state: created in its shards, loaded, resumed; its frozen part
    step.py     the pure train step `(state, batch) -> (state, metrics)`, the eval step
    run.py      `Run`: what `start` made, the hooks, checkpoints
    loop.py     feeds batches, logs, and calls the hooks every N steps

Batches reach the devices from the data pipeline's background thread, a few steps
ahead. Nothing waits for the device on an ordinary step: metrics are fetched only on
log steps, and a non-finite loss is caught inside the step (the update is not applied and
the step number recorded) and reported at the next log step.
"""

import contextlib
import sys

import jax
from absl import logging as absl_logging
from ml_collections import ConfigDict

from easylm import model_flags
from easylm.errors import exit_on_user_error
from easylm.models.family import ModelFamily
from easylm.training.loop import add_standard_hooks, loop
from easylm.training.options import parse_flags
from easylm.training.setup import start


def train(config: ConfigDict, family: ModelFamily) -> str:
    """Train as `config` says; returns the final checkpoint's directory."""
    with contextlib.ExitStack() as cleanup:
        run = start(config, family, cleanup)
        add_standard_hooks(run, cleanup)
        step = loop(run)
    final = run.manager.step_directory(step)
    if jax.process_index() == 0:
        print(f"checkpoint: {final}")
        model = serving_flags(config, run.model, final)
        if step == config.total_steps and model:
            print(f"serve it:   {model_flags.command(family, 'serve')} {model}")
            print(f"eval it:    {model_flags.command(family, 'eval')} {model} --tasks=TASKS")
    return final


def serving_flags(config: ConfigDict, model, final: str) -> str:
    """The serve and eval commands' flags that load the model a run trained into
    `final`; '' when there is none to print (adapters on a base drawn at random)."""
    if model.frozen is None:
        return f"--load_checkpoint=params::{final} --tokenizer={config.tokenizer}"
    if not config.load_checkpoint:
        return ""
    # adapters, folded into their base as it loads
    return (f"--load_checkpoint={config.load_checkpoint} --lora_checkpoint={final} "
            f"--tokenizer={config.tokenizer}")


@exit_on_user_error
def main(family: ModelFamily, argv: list[str] | None = None):
    """`python -m <family>.train`: parse `argv` (or print --help) and train."""
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's per-save chatter
    train(parse_flags(family, argv or sys.argv), family)
