"""One training run (`Run`): what `setup.start` made, the live state, the hooks the loop
calls, and its checkpoints."""

import dataclasses
from typing import Any, Callable

import flax
import jax
import optax
import orbax.checkpoint as ocp
from ml_collections import ConfigDict

from easylm import flags as flag_lib
from easylm.models.family import Model, ModelFamily
from easylm.objectives.base import Objective
from easylm.runtime import checkpoint
from easylm.training import logger
from easylm.training.state import TrainState, optimizer_item


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step: the live state (do not keep it past the call, the
    next step donates its buffers) and that step's device metrics."""

    step: int
    state: TrainState
    metrics: dict


def metadata(config: ConfigDict, model: Model, step: int) -> dict:
    # `model` and `<model>_config` as the HF converter writes them, so that serving
    # and conversion back to HF read trained and converted checkpoints alike.
    return {
        "model": model.name, f"{model.name}_config": model.config, "step": step,
        "flags": flag_lib.flatten(config),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                     "orbax-checkpoint": ocp.__version__},
    }


@dataclasses.dataclass
class Run:
    """One training run, set up by `setup.start`; `loop.loop` trains it. Extras run every N
    steps through `add_hook(fn, every=N)`: `fn(StepInfo)` after that step (after its
    metrics are logged), in the order added; a hook may set `stop_requested` to end the run
    after the current step (it is saved)."""

    config: ConfigDict
    family: ModelFamily
    model: Model
    objective: Objective
    mesh: Any
    schedule: Callable
    dataset: Any
    eval_dataset: Any
    place: Callable  # host batch -> global device arrays
    run_dir: str
    manager: checkpoint.CheckpointManager
    log: logger.Logger
    state: TrainState  # the live state
    start_step: int
    train_step: Callable  # jitted (state, batch) -> (state, metrics)
    eval_step: Callable  # jitted (params, batch, totals, frozen) -> totals
    eval_zeros: Callable  # (params, batch, frozen) -> zeros of the loss's sums
    saved_step: int | None  # the step a checkpoint holds (no second save of it)
    base_record: dict | None = None  # {"source", "fingerprint", "dtype"} of the frozen base
    harness: Any = None  # evaluation.harness.HarnessHook (--eval_harness.tasks), or None
    hooks: list = dataclasses.field(default_factory=list)  # (every, fn)
    stop_requested: bool = False
    profiler: Any = None

    def add_hook(self, fn: Callable[[StepInfo], None], every: int = 1):
        if every < 1:
            raise ValueError(f"a hook runs every N >= 1 steps, got {every}")
        self.hooks.append((every, fn))

    @property
    def batch_tokens(self) -> int:
        # A preference pair is two rows.
        return self.objective.rows_per_example * self.dataset.batch_size * self.dataset.seq_length

    def save(self, step: int):
        """A checkpoint of the current state at `step` (once per step)."""
        if self.saved_step != step:
            data = metadata(self.config, self.model, step)
            if self.base_record is not None:
                data["frozen"] = self.base_record
            self.manager.save(step, self.state.params, optimizer_item(self.state),
                              self.dataset.get_state_dict(), data)
            self.saved_step = step
