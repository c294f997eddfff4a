"""The train state: what a step reads and writes (`TrainState`), created in its shards,
loaded from a checkpoint or resumed, and what it reads but does not train
(`TrainState.frozen`: a variant's frozen base, an objective's frozen reference), built once
per run and never saved; checkpoints record the base's fingerprint."""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.models.family import Model
from easylm.runtime import checkpoint
from easylm.runtime.dtypes import dtype_from_flag
from easylm.runtime.sharding import init_sharded, rule_shardings
from easylm.training import optimizers
from easylm.training.options import LOAD_PREFIXES


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 (), updates applied so far
    params: Any  # what the optimizer trains
    opt_state: Any
    skipped_updates: jax.Array  # int32 (), non-finite steps whose update was skipped
    first_nonfinite_step: jax.Array  # int32 (), -1 until one occurs
    # What the losses read but do not train: {"base": a variant's frozen parameters
    # (`Model.frozen`), "reference": an objective's frozen copy of the starting
    # parameters}, each only where there is one. No gradient, no optimizer state, never
    # updated, rebuilt (not saved) at each start.
    frozen: dict = dataclasses.field(default_factory=dict)


def new_state(params, tx: optax.GradientTransformation, frozen=None) -> TrainState:
    """The state of step 0 around `params`: the one constructor (traced by `init_state`
    to create it in its shards, by `abstract_state` for its shapes)."""
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, opt_state=tx.init(params), skipped_updates=zero,
                      first_nonfinite_step=zero - 1, frozen=frozen or {})


def _state_rules(model: Model):
    # Optimizer state leaves carry their parameter's path, so the parameter rules match
    # them (and optimizers.STATE_RULES the few that do not); a frozen copy of the
    # parameters matches them too.
    return tuple(model.partition_rules) + optimizers.STATE_RULES + \
        (tuple(model.frozen.rules) if model.frozen else ())


def _initial_state(model: Model, tx, rng, params=None, base: bool = True) -> TrainState:
    """Traced by `init_state` and `abstract_state`: step 0 around `params` (default: fresh
    ones from `rng`), with a freshly drawn frozen base unless `base` is False."""
    frozen = {}
    if base and model.frozen is not None:
        frozen["base"] = model.frozen.init(jax.random.fold_in(rng, 1))
    return new_state(model.init_params(rng) if params is None else params, tx, frozen)


def init_base(model: Model, mesh, seed: int) -> dict:
    """{"base": the frozen parameters in their shards}, read (`Frozen.load`) or drawn as
    `init_state` draws them; {} for a model without."""
    if model.frozen is None:
        return {}
    if model.frozen.load is not None:
        return {"base": model.frozen.load(mesh)}
    return {"base": init_sharded(lambda rng: model.frozen.init(jax.random.fold_in(rng, 1)),
                                 model.frozen.rules, mesh, jax.random.key(seed))}


def init_state(model: Model, tx, mesh, seed: int, params=None) -> TrainState:
    """A fresh train state created in its shards (or around given `params`)."""
    if model.frozen is None or model.frozen.load is None:
        return init_sharded(lambda rng, p: _initial_state(model, tx, rng, p),
                            _state_rules(model), mesh, jax.random.key(seed), params)
    state = init_sharded(lambda rng, p: _initial_state(model, tx, rng, p, base=False),
                         model.partition_rules, mesh, jax.random.key(seed), params)
    return state.replace(frozen=init_base(model, mesh, seed))


def starting_params(config: ConfigDict, model: Model, tx, mesh):
    """The parameters the run started from, sharded as the train state's: those of
    --load_checkpoint, else the initialisation from --seed (recomputed, so also after a
    resume). A preference objective's frozen reference."""
    if not config.load_checkpoint:
        return init_state(model, tx, mesh, config.seed).params
    kind, directory = checkpoint.parse_load_spec(config.load_checkpoint, LOAD_PREFIXES)
    return read_params(model, kind, directory, abstract_state(model, tx, mesh, config.seed).params)


def read_params(model: Model, kind: str, directory: str, abstract):
    """The parameters of a `--load_checkpoint` (`kind::directory`): the family's loader
    (hf::DIR, an easylm checkpoint in either layout) where the model has one."""
    if model.load is not None:
        return model.load(f"{kind}::{directory}", abstract)
    if kind == "hf":
        raise UserError(f"--load_checkpoint=hf::{directory}: the {model.name} model "
                        f"cannot load Hugging Face checkpoints")
    return checkpoint.restore_items(directory, {"params": abstract})["params"]


def abstract_state(model: Model, tx, mesh, seed: int) -> TrainState:
    """ShapeDtypeStructs with shardings: the restore target for checkpoints."""
    shapes = jax.eval_shape(lambda rng: _initial_state(model, tx, rng), jax.random.key(seed))
    shardings = rule_shardings(mesh, _state_rules(model), shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def optimizer_item(state: TrainState) -> dict:
    """The train state minus parameters (and the frozen ones, which each start rebuilds):
    the checkpoint's 'opt_state' item."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.name not in ("params", "frozen")}


def load_state(kind: str, directory: str, model: Model, tx, mesh, seed: int):
    """(state, data state or None) from a checkpoint directory."""
    abstract = abstract_state(model, tx, mesh, seed)
    if kind in ("hf", "params", "trainstate_params"):
        return init_state(model, tx, mesh, seed,
                          params=read_params(model, kind, directory, abstract.params)), None
    if kind == "trainstate" and checkpoint.has_item(directory, "opt_state"):
        items = checkpoint.restore_items(
            directory, {"params": abstract.params, "opt_state": optimizer_item(abstract)},
            json_items=("data",) if checkpoint.has_item(directory, "data") else (),
        )
        state = TrainState(params=items["params"], **items["opt_state"],
                           frozen=init_base(model, mesh, seed))
        return state, items.get("data")
    params = checkpoint.restore_items(directory, {"params": abstract.params})["params"]
    state = init_state(model, tx, mesh, seed, params=params)
    # (The trainer asks for --allow_fresh_optimizer first.) The step and the data resume,
    # the optimizer starts afresh.
    if jax.process_index() == 0:
        print(f"note: {directory} has no optimizer state; the optimizer starts afresh")
    items = checkpoint.restore_items(directory, {}, json_items=("data", "metadata"))
    step = int(items["metadata"]["step"])
    state = state.replace(step=jax.device_put(jnp.int32(step), state.step.sharding))
    return state, items["data"]


def base_record(config, model: Model, state: TrainState, source) -> dict | None:
    """What the frozen base is ({"source", "fingerprint", "dtype": the compute dtype it was
    stored for}), for checkpoint metadata. A train state resumed (or loaded) on a base other
    than the one it was trained on would continue from a different model: refused."""
    if "base" not in state.frozen:
        return None
    record = {"source": config.load_checkpoint if model.frozen.load else "init",
              "fingerprint": checkpoint.fingerprint(model.frozen.identity(state.frozen["base"])),
              # what the base was stored for (quantization scales are in it)
              "dtype": jnp.dtype(dtype_from_flag("dtype", config.dtype)).name}
    if source and source[0] == "trainstate":
        recorded = checkpoint.read_metadata(source[1]).get("frozen")
        if recorded and recorded["fingerprint"] != record["fingerprint"]:
            raise UserError(
                f"{source[1]} was trained on a frozen base ({recorded['source']}) with "
                f"fingerprint {recorded['fingerprint']}, but {record['source']} now gives "
                f"{record['fingerprint']}: restore that base, or start a new run "
                f"(--logger.experiment_id)")
    return record
