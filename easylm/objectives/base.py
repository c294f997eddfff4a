"""What the trainer asks of an objective (`--objective`): one interface, so that a new
objective is one more class (and a line in the registry, objectives/__init__.py) and no
branch in the trainer or the planner.

Before there is a model (class methods, from the flags alone) an objective owns
  - its flags, the block `--NAME.*` (`get_default_config`, `HELP`; NAME its `name`);
  - its checks of the flags, each a one-line `UserError` (`check_config`);
  - the data defaults it implies (`dataset_defaults`), and the flags that do not change
    what it trains (`unused_flags`: left out of the run directory's name).

Built for a model, an objective says
  - what its batches hold (`rows`: the data pipeline's row kind, "documents" or "pairs")
    and how they are made: `batches` reads the data pipeline (host batches `prepare`d,
    then placed on the devices); an online objective (GRPO, rows "prompts") makes them
    from rollouts of the live parameters instead, which `batches` reads through
    `live_state()` each time it makes one;
  - what its loss reads but does not train (`reference`: nothing, the base with the
    adapters off, a frozen copy of the starting parameters, or log-probabilities
    precomputed into the batches), which the trainer keeps in `TrainState.frozen`;
  - its loss, `loss_fn(params, batch, rng, frozen) -> sums`, whose sums type (LossSums,
    PreferenceSums) says its metrics (`means()`) and what it counts;
  - its work per token (`flops_per_token`), for MFU;
  - what it adds to the plan (`python -m easylm.plan`): its rows per example, a COPY
    reference (a second copy of the parameters), how the header counts a step's rows
    (`plan_rows`), and the KV cache its rollouts decode in (`rollout_cache`).
"""

import abc
from typing import Any, Callable, Iterator

from ml_collections import ConfigDict

# Where `reference` points: what the loss compares the policy with.
NO_REFERENCE = "none"
BASE = "base"  # the model's frozen base with the adapters off (LoRA): no second copy
COPY = "copy"  # a frozen copy of the starting parameters, TrainState.frozen["reference"]
PRECOMPUTED = "precomputed"  # log-probabilities computed once and carried by the batches


class Objective(abc.ABC):
    name: str  # also the name of its flag block, --NAME.*
    rows: str = "documents"  # the data pipeline's row kind its batches hold
    rows_per_example: int = 1  # rows of one example (a preference pair: 2, GRPO: G)
    completion_tokens: int = 0  # rows of "prompts" leave this many tokens for rollouts
    takes_images: bool = False  # its loss (and rollouts) read an image-text model's images
    # Its loss adds a sparse attention model's indexer KL term (`Model.indexer_loss`,
    # objectives/indexer_loss.py); the others refuse a model that asks for it.
    adds_indexer_loss: bool = False
    # That model's reader of images (its family's `image_chats`), which the trainer sets
    # when the run's data hold image chats: what rollouts lay out their rows' images with.
    images = None
    reference: str = NO_REFERENCE
    HELP: dict = {}  # "NAME.option": help text, for each of its flags

    def __init__(self, model, config: ConfigDict | None = None, tokenizer=None):
        """`config`: the trainer's flags; `tokenizer`: the run's (None when planning)."""
        self.model, self.config, self.tokenizer = model, config, tokenizer

    # ------------------------------------------------ from the flags, before a model

    @classmethod
    def get_default_config(cls) -> ConfigDict | None:
        """Its options, the flags --NAME.*; None: it has none."""
        return None

    @classmethod
    def check_config(cls, config: ConfigDict) -> None:
        """Refuses, in one line (`UserError`), flags it cannot train with. The registry
        has already checked that the datasets hold its `rows`."""

    @classmethod
    def dataset_defaults(cls, config: ConfigDict) -> dict:
        """Defaults of dataset flags it implies, {dotted name: value}, applied to those the
        command line does not give."""
        return {}

    @classmethod
    def unused_flags(cls, config: ConfigDict) -> tuple:
        """Prefixes of flags beyond the other objectives' blocks that do not change what
        it trains, left out of the run directory's name."""
        return ()

    # ------------------------------------------------------------ built for a model

    @abc.abstractmethod
    def loss_fn(self, params, batch: dict, rng, frozen: dict) -> Any:
        """The loss's sums over `batch`. `frozen` is `TrainState.frozen`: {"base": the
        model's frozen parameters, "reference": a frozen copy}, each where there is one."""

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: the model's forward and backward passes."""
        return self.model.flops_per_token(seq_length)

    def describe(self) -> str:
        """For the run's header line ('' for next-token training)."""
        return ""

    def plan_rows(self) -> str:
        """How the plan's header counts a step's rows after the batch size ('': rows)."""
        return ""

    def rollout_cache(self, batch_size: int, seq_length: int):
        """Shapes (`jax.eval_shape`) of the KV cache its rollouts of a step decode in,
        which the plan counts beside what stays resident; None: it makes no rollouts."""
        return None

    def prepare_run(self, run_dir: str, starting_params: Callable, state, place: Callable,
                    print_fn: Callable) -> None:
        """Once per run, before the first step (a precomputed reference is computed or
        read here). `starting_params()` gives the run's starting point, also after a
        resume; `state` is the train state; `place` puts a host batch on the devices."""

    def frozen_params(self, mesh) -> dict:
        """Parameters its loss reads but does not train besides a reference copy ({name:
        tree in its shards on `mesh`}: a distillation teacher), added to
        `TrainState.frozen` once per run and never saved."""
        return {}

    def prepare(self, batch: dict) -> dict:
        """A host batch as the step takes it."""
        return batch

    def batches(self, dataset, place: Callable, live_state: Callable | None = None) -> Iterator:
        """(device batch, data metrics) for each step, from the data pipeline.
        `live_state()`: the train state as it is when the next batch is asked for."""
        return dataset.iterate(place=lambda batch: place(self.prepare(batch)))
