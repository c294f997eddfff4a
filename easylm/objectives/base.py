"""What the trainer asks of an objective (`--objective`): one interface, so that a new
objective is one more class and no branch in the trainer.

An objective says
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
  - its work per token (`flops_per_token`), for MFU.
"""

import abc
from typing import Any, Callable, Iterator

# Where `reference` points: what the loss compares the policy with.
NO_REFERENCE = "none"
BASE = "base"  # the model's frozen base with the adapters off (LoRA): no second copy
COPY = "copy"  # a frozen copy of the starting parameters, TrainState.frozen["reference"]
PRECOMPUTED = "precomputed"  # log-probabilities computed once and carried by the batches


class Objective(abc.ABC):
    name: str
    rows: str = "documents"  # the data pipeline's row kind its batches hold
    rows_per_example: int = 1  # rows of one example (a preference pair: 2, GRPO: G)
    completion_tokens: int = 0  # rows of "prompts" leave this many tokens for rollouts
    reference: str = NO_REFERENCE

    def __init__(self, model):
        self.model = model

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

    def prepare_run(self, run_dir: str, starting_params: Callable, state, place: Callable,
                    print_fn: Callable) -> None:
        """Once per run, before the first step (a precomputed reference is computed or
        read here). `starting_params()` gives the run's starting point, also after a
        resume; `state` is the train state; `place` puts a host batch on the devices."""

    def prepare(self, batch: dict) -> dict:
        """A host batch as the step takes it."""
        return batch

    def batches(self, dataset, place: Callable, live_state: Callable | None = None) -> Iterator:
        """(device batch, data metrics) for each step, from the data pipeline.
        `live_state()`: the train state as it is when the next batch is asked for."""
        return dataset.iterate(place=lambda batch: place(self.prepare(batch)))
