"""The training loop and the train/eval steps, for any model family.

A model family (`easylm.models.family.ModelFamily`) gives the trainer a `Model` (how to
initialise parameters, the loss, the partition rules, FLOPs per token);
`python -m easylm.llama.train` passes LLaMA's. The train step is a pure function
`(state, batch) -> (state, metrics)` jitted with explicit shardings and the state
donated. `start` sets a run up (mesh, model, data, state: fresh, loaded or resumed);
`loop` only feeds batches and logs, and calls the extras every N steps as hooks
(`Run.add_hook(fn, every=N)`): evaluation, checkpoints, the profiler's window of
steps (`easylm.runtime.profiling.Profiler`), preemption.

Batches reach the devices from the data pipeline's background thread, a few
steps ahead. Nothing waits for the device on an ordinary step: metrics are fetched only on
log steps, and a non-finite loss is caught inside the step (the update is not
applied and the step number recorded) and reported at the next log step.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import ConfigDict

from easylm import flags as flag_lib
from easylm.errors import UserError, exit_on_user_error
from easylm.evaluation import harness_flags
from easylm.models.family import Model, ModelFamily
from easylm.objectives import preference
from easylm.runtime import checkpoint, distributed, flops, profiling
from easylm.runtime.dtypes import dtype_from_flag
from easylm.runtime.sharding import (
    BATCH_AXES,
    check_batch_split,
    constrain,
    init_sharded,
    make_mesh,
    match_partition_rules,
    mesh_string,
    named_shardings,
)
from easylm.training import logger, optimizers, run_lock

# `hf::DIR` is read by the model family's `Model.load_hf`, the rest by easylm.runtime.checkpoint.
LOAD_PREFIXES = checkpoint.LOAD_PREFIXES + ("hf",)

HELP = {
    "seed": "random seed: parameter initialisation and the per-step RNG",
    "mesh_dim": "device mesh dp,fsdp,mp; one entry may be -1 (all remaining devices)",
    "dcn_mesh_dim": "hybrid mesh: how TPU slices (GPU/CPU: processes) combine, dp,fsdp,mp; "
                    "--mesh_dim then splits the devices of one slice/process (empty: flat mesh)",
    "log_all_worker": "every process logs (metrics.process<i>.jsonl), not only process 0",
    "dtype": "compute dtype: bf16, fp16, fp32, or auto (bf16 on GPU/TPU, fp32 on CPU)",
    "param_dtype": "dtype the parameters (and their updates) are kept in",
    "total_steps": "number of optimizer updates to train for",
    "log_freq": "log metrics every this many steps (the only time the host waits "
                "for the device)",
    "save_model_freq": "save a checkpoint every this many steps, keeping the latest "
                       "--checkpointer.keep (0: only the final one)",
    "save_milestone_freq": "save a checkpoint every this many steps that is never deleted "
                           "(0: none)",
    "eval_freq": "evaluate on --eval_dataset every this many steps (0: never)",
    "eval_steps": "batches per evaluation (0: one full pass over --eval_dataset)",
    "load_checkpoint": "start from params::DIR (parameters), trainstate::DIR (everything), "
                       "trainstate_params::DIR (parameters of a train state) or hf::DIR (a "
                       "Hugging Face model directory, converted as it loads; its config.json "
                       "gives the model's shape)",
    "resume": "continue from the newest complete checkpoint in the run directory, if any",
    "allow_fresh_optimizer": "resume from a checkpoint without optimizer state (saved with "
                             "--checkpointer.save_optimizer_state=False) with a fresh "
                             "optimizer, instead of stopping",
    "tokenizer": "'embedded', a tokenizer directory, a tokenizer.json or a SentencePiece .model",
    "peak_tflops": "peak TFLOP/s of one device for MFU (0: look the device up; unknown "
                   "devices such as CPUs report MFU as n/a)",
    "compilation_cache_dir": "persistent XLA compilation cache: a second start of the same "
                             "step skips compiling ('' to disable)",
    "skip_nonfinite_updates": "skip updates whose loss or gradient norm is NaN/Inf and count "
                              "them, instead of stopping the run",
    "profile_steps": "trace this many steps with the jax profiler into RUN_DIR/profile/"
                     "process<i> (--logger.wandb_dir, when set, instead of RUN_DIR); 0: off",
    "profile_start_step": "the first traced step (steps count from 1; the first one compiles)",
}


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 (), updates applied so far
    params: Any  # what the optimizer trains
    opt_state: Any
    skipped_updates: jax.Array  # int32 (), non-finite steps whose update was skipped
    first_nonfinite_step: jax.Array  # int32 (), -1 until one occurs
    # What the model reads but does not train (`Model.init_frozen`; None: nothing): no
    # gradient, no optimizer state, never updated, rebuilt (not saved) at each start.
    frozen: Any = None


def new_state(params, tx: optax.GradientTransformation, frozen=None) -> TrainState:
    """The state of step 0 around `params`: the one constructor (traced by `init_state`
    to create it in its shards, by `abstract_state` for its shapes)."""
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, opt_state=tx.init(params), skipped_updates=zero,
                      first_nonfinite_step=zero - 1, frozen=frozen)


def get_default_config(dataset_config: ConfigDict | None = None) -> ConfigDict:
    """Top-level flags and each component's own block (`--optimizer.*`, ...)."""
    config = ConfigDict()
    config.seed = 42
    config.mesh_dim = "1,-1,1"
    config.dcn_mesh_dim = ""
    config.dtype = "auto"
    config.param_dtype = "fp32"
    config.total_steps = 10000
    config.log_freq = 50
    config.save_model_freq = 0
    config.save_milestone_freq = 0
    config.eval_freq = 0
    config.eval_steps = 0
    config.load_checkpoint = ""
    config.resume = True
    config.allow_fresh_optimizer = False
    config.tokenizer = "embedded"
    config.peak_tflops = 0.0
    config.compilation_cache_dir = "~/.cache/easylm/jax"
    config.skip_nonfinite_updates = False
    config.profile_steps = 0
    config.profile_start_step = 5
    config.log_all_worker = False
    config.objective = preference.NEXT_TOKEN
    for name, block in preference.get_default_config().items():   # --dpo.*, --simpo.*, ...
        config[name] = block
    if dataset_config is not None:
        config.train_dataset = dataset_config
        config.eval_dataset = ConfigDict(dataset_config.to_dict())
    config.optimizer = optimizers.get_default_config()
    config.checkpointer = checkpoint.get_default_config()
    config.logger = logger.get_default_config()
    config.jax_distributed = distributed.get_default_config()
    config.eval_harness = harness_flags.get_default_config()
    config.update_from_flattened_dict(_schedule_defaults(config))
    return config


def help_text(dataset_help: dict | None = None) -> dict:
    text = dict(HELP)
    sections = {"optimizer": optimizers.HELP, "checkpointer": checkpoint.HELP,
                "logger": logger.HELP, "jax_distributed": distributed.HELP,
                "eval_harness": harness_flags.HELP}
    text.update(preference.HELP, objective=preference.OBJECTIVE_HELP)
    for section in ("train_dataset", "eval_dataset"):
        sections[section] = dataset_help or {}
    for section, entries in sections.items():
        text.update({f"{section}.{name}": entry for name, entry in entries.items()})
    for name, default in RUN_DEFAULTS_HELP.items():
        text[name] = f"{text.get(name, '')} ({default})".strip()
    return text


def default_config(family: ModelFamily) -> ConfigDict:
    """`family`'s training flags before those that depend on the run (`run_defaults`)."""
    from easylm.data import DatasetFactory

    config = get_default_config(DatasetFactory.get_default_config())
    config[family.name] = family.flag_config()  # from scratch; hf:: gives its own shape
    for section, block in family.variant_flags().items():
        config[section] = block
    return config


def help_entries(family: ModelFamily) -> dict:
    from easylm.data import DatasetFactory

    entries = help_text(getattr(DatasetFactory, "HELP", None))
    entries.update(family.help_entries("the preset's, or hf::DIR config.json's"))
    entries.update(family.variant_help())
    for name, value in family.demo.items():
        entries[name] = f"{entries.get(name, '')} (the embedded demo, given no data and no " \
                        f"checkpoint: {value:g})".strip()
    return entries


def family_run_defaults(family: ModelFamily) -> list[Callable[[ConfigDict], dict]]:
    """`run_defaults` for `family`: its demo; rows no longer than its model takes (1024
    tokens do not fit a small preset)."""
    return run_defaults(family.demo,
                        lambda config: family.bind(family.model_config(config)).max_seq_length,
                        family.variant_run_defaults)


def common_flags(family: ModelFamily) -> list[str]:
    """What `--help` shows, the flags most runs change, in the order one sets them."""
    data = [f"train_dataset.{name}" for name in (
        "type", "json_dataset.path", "json_dataset.seq_length", "json_dataset.batch_size",
        "huggingface_dataset.path")]
    return ["load_checkpoint", f"{family.name}.base_model", "tokenizer", *data, "total_steps",
            "optimizer.adamw_optimizer.lr", "mesh_dim", "dtype", "log_freq", "save_model_freq",
            "eval_freq", "eval_dataset.json_dataset.path", "logger.output_dir",
            "logger.experiment_id", "resume"]


def usage(family: ModelFamily) -> str:
    command = f"python -m {family.commands}.train"
    return (f"Train a {family.name} model (from scratch, or fine-tune a checkpoint).\n\n"
            f"  {command} --{family.name}.base_model={family.default_preset} "
            f"--train_dataset.json_dataset.path=data.jsonl --total_steps=1000\n\n"
            f"usage: {command} [--flag=value ...]  (all flags: --helpfull)")


def parse_flags(family: ModelFamily, argv: list[str]) -> ConfigDict:
    """`argv` (argv[0] is the program) as `python -m <family>.train` reads it, the
    defaults of the run included."""
    config = default_config(family)
    common = [name for name in common_flags(family) if name in flag_lib.flatten(config)]
    return flag_lib.parse(config, help_entries(family), argv, usage(family),
                          derived=family_run_defaults(family), common=common)


# ------------------------------------------------------------ defaults of a run
# Some defaults depend on the run; `flags.parse(..., derived=run_defaults(demo))` applies
# them to the flags not given, in this order.

# Full fine-tuning of a pretrained model at a higher peak rate tends to diverge (the
# embedded demo's 3e-3 drove a 135M model's perplexity from 144 to 296 in 22 steps).
FINE_TUNING_MAX_LR = 1e-4
FINE_TUNING_DEFAULTS = {"optimizer.adamw_optimizer.lr": 2e-5}
RUN_DEFAULTS_HELP = {
    "optimizer.adamw_optimizer.lr": "from a pretrained params::, trainstate_params:: or hf:: "
                                    "--load_checkpoint: "
                                    f"{FINE_TUNING_DEFAULTS['optimizer.adamw_optimizer.lr']:g}",
    "optimizer.adamw_optimizer.end_lr": "default: a tenth of the peak lr",
    "optimizer.adamw_optimizer.lr_warmup_steps": "default: a tenth of --total_steps, at most 2000",
    "optimizer.adamw_optimizer.lr_decay_steps": "default: --total_steps",
    **{f"train_dataset.{loader}.seq_length": "default: 1024, or the model's "
                                             "max_position_embeddings if smaller"
       for loader in ("json_dataset", "huggingface_dataset", "cache", "mixture")},
    **{f"eval_dataset.{loader}.{field}": f"default: --train_dataset's {field}"
       for loader in ("json_dataset", "huggingface_dataset", "cache", "mixture")
       for field in ("seq_length", "batch_size")},
}


def is_demo(config: ConfigDict) -> bool:
    """No data and no checkpoint given: the embedded corpus, from scratch."""
    return (not config.load_checkpoint and config.train_dataset.type == "json"
            and config.train_dataset.json_dataset.path == "embedded")


def starts_from_pretrained(config: ConfigDict) -> bool:
    """Pretrained parameters with a fresh optimizer: fine-tuning."""
    return config.load_checkpoint.partition("::")[0] in ("params", "trainstate_params", "hf")


def _loader(dataset_config: ConfigDict) -> str:
    from easylm.data.dataset import loader_block

    return loader_block(dataset_config)


def _schedule_defaults(config: ConfigDict) -> dict:
    # The decay ends at a tenth of the peak, whichever sets the peak (a flag, a fine-tuning
    # or a variant's default): a peak given below another rule's end_lr would rise.
    steps = config.total_steps
    return {"optimizer.adamw_optimizer.lr_warmup_steps": min(2000, steps // 10),
            "optimizer.adamw_optimizer.lr_decay_steps": steps,
            # the decimal tenth (3e-4, not 3.0000000000000003e-05), as a flag would give it
            "optimizer.adamw_optimizer.end_lr":
                float(f"{config.optimizer.adamw_optimizer.lr / 10:.12g}")}


def run_defaults(demo: dict, max_seq_length: Callable[[ConfigDict], int] | None = None,
                 variant: Callable[[ConfigDict], dict] | None = None
                 ) -> list[Callable[[ConfigDict], dict]]:
    """For `flags.parse(derived=...)`: the embedded demo's settings (`demo`, from the model
    family) for a run given no data and no checkpoint; a fine-tuning learning rate from a
    pretrained checkpoint, then a variant's own (`variant(config)`, from the family); rows
    no longer than the model takes (`max_seq_length(config)`, from the family); a schedule
    that ends with the run; eval rows shaped like the train rows."""

    def rows(config):
        if max_seq_length is None:
            return {}
        try:
            limit = max_seq_length(config)
        except UserError:
            return {}  # a bad checkpoint or preset: the trainer reports it
        name = f"train_dataset.{_loader(config.train_dataset)}.seq_length"
        return {name: min(flag_lib.get(config, name), limit)}

    def eval_rows(config):
        train = config.train_dataset[_loader(config.train_dataset)]
        loader = _loader(config.eval_dataset)
        return {f"eval_dataset.{loader}.seq_length": train.seq_length,
                f"eval_dataset.{loader}.batch_size": train.batch_size}

    return [lambda config: dict(demo) if is_demo(config) else {},
            lambda config: dict(FINE_TUNING_DEFAULTS) if starts_from_pretrained(config) else {},
            variant or (lambda config: {}), rows, _schedule_defaults, eval_rows,
            preference.dataset_defaults]


# ------------------------------------------------------------------ the steps


def _loss_and_grads(loss_fn, params, batch, rng, accumulate_steps: int, extra=()):
    """Summed loss statistics and gradients of the summed loss over the batch.

    With k > 1 the batch is split into k micro-batches (rows j, j+k, ... form
    micro-batch j, so each stays spread over all batch shards) and the
    gradients are summed in a scan, so only one micro-batch's activations live
    at a time. Sums add exactly, so this equals the unsplit batch. `extra`: the
    objective's arrays that get no gradient (a reference model), passed to loss_fn.
    """

    def one(micro_batch, rng):
        def summed_loss(p):
            sums = loss_fn(p, micro_batch, rng, *extra)
            return sums.loss, sums

        (_, sums), grads = jax.value_and_grad(summed_loss, has_aux=True)(params)
        return grads, sums

    if accumulate_steps == 1:
        return one(batch, rng)

    def split(x):  # (B, ...) -> (k, B/k, ...)
        return x.reshape(x.shape[0] // accumulate_steps, accumulate_steps, *x.shape[1:]).swapaxes(0, 1)

    def body(total, inputs):
        micro_batch, i = inputs
        micro_batch = jax.tree.map(lambda x: constrain(x, P(BATCH_AXES)), micro_batch)
        out = one(micro_batch, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, total, out), None

    micro_batches = jax.tree.map(split, batch)
    # Whatever sums the loss returns (LossSums, PreferenceSums), zeros of their shape.
    sums_shape = jax.eval_shape(lambda b: one(b, rng)[1], jax.tree.map(lambda x: x[0], micro_batches))
    zeros = (jax.tree.map(jnp.zeros_like, params),
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape))
    (grads, sums), _ = jax.lax.scan(body, zeros, (micro_batches, jnp.arange(accumulate_steps)))
    return grads, sums


def with_frozen(loss_fn, frozen):
    """`loss_fn` as `(params, batch, rng, *extra)`, given the frozen parameters it also
    reads (`TrainState.frozen`)."""
    if frozen is None:
        return loss_fn
    return lambda params, batch, rng, *extra: loss_fn(params, batch, rng, *extra, frozen=frozen)


def make_train_step(loss_fn, tx: optax.GradientTransformation, schedule, seed: int,
                    accumulate_steps: int = 1):
    """The pure train step `(state, batch) -> (state, metrics)` (jit it)."""

    def train_step(state: TrainState, batch: dict, *extra):
        rng = jax.random.fold_in(jax.random.key(seed), state.step)
        grads, sums = _loss_and_grads(with_frozen(loss_fn, state.frozen), state.params, batch,
                                      rng, accumulate_steps, extra)
        count = jnp.maximum(sums.count, 1.0)
        # A mean over what the loss counts: tokens (LossSums), pairs (PreferenceSums).
        grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grads)
        means = sums.means()
        loss = means["loss"]
        gradient_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A NaN/Inf step leaves parameters and optimizer state as they were; the
        # loop stops (or counts it) when it next looks at the metrics.
        finite = jnp.isfinite(loss) & jnp.isfinite(gradient_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        first_bad = jnp.where((state.first_nonfinite_step < 0) & ~finite,
                              state.step + 1, state.first_nonfinite_step)
        new_state = state.replace(
            step=state.step + 1,
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32),
            first_nonfinite_step=first_bad,
        )
        metrics = dict(
            **means,
            learning_rate=schedule(state.step),
            gradient_norm=gradient_norm,
            param_norm=optax.tree.norm(new_state.params),
            **{f"loss_{sums.COUNT}": sums.count},
            skipped_updates=new_state.skipped_updates,
            first_nonfinite_step=first_bad,
        )
        return new_state, metrics

    return train_step


def jit_train_step(model: Model, tx, schedule, seed: int, accumulate_steps: int, state, mesh,
                   loss_fn=None, extra=()):
    """The jitted train step `(state, batch, *extra)`, sharded like `state`, the batch over
    BATCH_AXES, state donated (`extra`, the objective's arrays such as a live reference
    model, is not). The trainer and `python -m easylm.bench train` both run this one;
    loss_fn: the objective's (default: the model's next-token loss)."""
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(
        make_train_step(loss_fn or model.loss_fn, tx, schedule, seed, accumulate_steps),
        in_shardings=(state_shardings, NamedSharding(mesh, P(BATCH_AXES)),
                      *jax.tree.map(lambda x: x.sharding, extra)),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=(0,),
    )


def device_batch(batch: dict, mesh) -> dict:
    """A host batch (numpy, this process's rows) as global arrays split over BATCH_AXES."""
    from easylm.data import make_global_batch

    return make_global_batch(batch, mesh)


# XLA flags for GPU training, added on GPU hosts only, never over a flag the user set in
# XLA_FLAGS: the latency-hiding scheduler overlaps collectives with compute; cuBLAS for
# every matmul instead of XLA's Triton GEMM fusions (NVIDIA's JAX-Toolbox setting for
# LLMs; +1.1% on the llama_1b step on one H200, docs/benchmarks.md).
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                 "--xla_gpu_enable_triton_gemm=false")


def setup_compilation(cache_dir: str) -> None:
    """Before the first compile: the persistent compilation cache (a second start of the
    same step skips XLA compilation) and, on GPU hosts, GPU_XLA_FLAGS."""
    if cache_dir:
        cache_dir = os.path.expanduser(cache_dir)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if _gpu_plugin_installed():
        present = os.environ.get("XLA_FLAGS", "")
        extra = [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in present]
        os.environ["XLA_FLAGS"] = " ".join([present, *extra]).strip()


def _gpu_plugin_installed() -> bool:
    """Whether jax's CUDA plugin is installed, decided without starting a backend (XLA
    reads XLA_FLAGS when the backend starts, so the flags must be set before)."""
    import importlib.util

    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return False

    def installed(name):  # find_spec of 'a.b' raises when package 'a' is missing
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            return False

    return any(installed(name)
               for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12"))


def make_eval_step(loss_fn):
    """`(params, batch, totals, frozen, *extra) -> totals`: the loss's sums added over eval
    batches."""

    def eval_step(params, batch, totals, frozen=None, *extra):
        sums = with_frozen(loss_fn, frozen)(params, batch, jax.random.key(0), *extra)
        return jax.tree.map(jnp.add, totals, sums)

    return eval_step


def _state_rules(model: Model):
    # Optimizer state leaves carry their parameter's path, so the parameter rules match them.
    return tuple(model.partition_rules) + tuple(model.frozen_rules)


def _initial_state(model: Model, tx, rng, params=None, frozen: bool = True) -> TrainState:
    """Traced by `init_state` and `abstract_state`: step 0 around `params` (default: fresh
    ones from `rng`), with fresh frozen parameters unless `frozen` is False."""
    fresh = frozen and model.init_frozen is not None
    return new_state(model.init_params(rng) if params is None else params, tx,
                     model.init_frozen(jax.random.fold_in(rng, 1)) if fresh else None)


def init_frozen(model: Model, mesh, seed: int):
    """The frozen parameters in their shards: read (`model.load_frozen`) or drawn as
    `init_state` draws them; None for a model without."""
    if model.load_frozen is not None:
        return model.load_frozen(mesh)
    if model.init_frozen is None:
        return None
    return init_sharded(lambda rng: model.init_frozen(jax.random.fold_in(rng, 1)),
                        model.frozen_rules, mesh, jax.random.key(seed))


def init_state(model: Model, tx, mesh, seed: int, params=None) -> TrainState:
    """A fresh train state created in its shards (or around given `params`)."""
    if model.load_frozen is None:
        return init_sharded(lambda rng, p: _initial_state(model, tx, rng, p),
                            _state_rules(model), mesh, jax.random.key(seed), params)
    state = init_sharded(lambda rng, p: _initial_state(model, tx, rng, p, frozen=False),
                         model.partition_rules, mesh, jax.random.key(seed), params)
    return state.replace(frozen=init_frozen(model, mesh, seed))


def starting_params(config: ConfigDict, model: Model, tx, mesh):
    """The parameters the run started from, sharded as the train state's: those of
    --load_checkpoint, else the initialisation from --seed (recomputed, so also after a
    resume). A preference objective's frozen reference."""
    if not config.load_checkpoint:
        return init_state(model, tx, mesh, config.seed).params
    kind, directory = checkpoint.parse_load_spec(config.load_checkpoint, LOAD_PREFIXES)
    abstract = abstract_state(model, tx, mesh, config.seed).params
    if kind == "hf":
        return model.load_hf(directory, abstract)
    return checkpoint.restore_items(directory, {"params": abstract})["params"]


def abstract_state(model: Model, tx, mesh, seed: int) -> TrainState:
    """ShapeDtypeStructs with shardings: the restore target for checkpoints."""
    shapes = jax.eval_shape(lambda rng: _initial_state(model, tx, rng), jax.random.key(seed))
    shardings = named_shardings(mesh, match_partition_rules(_state_rules(model), shapes))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


# ------------------------------------------------------------------- the loop


def run_directory(config: ConfigDict, model_name: str, unused: tuple = ()) -> str:
    """OUTPUT_DIR/EXPERIMENT_ID; by default the id hashes the flags, so re-running the
    same command (say, after preemption) lands in the same directory and resumes. Flags
    that do not change what is trained (resuming, logging, profiling; the prefixes
    `unused`: a variant's flags when it is off) are left out."""
    experiment_id = config.logger.experiment_id
    if not experiment_id:
        # logger.* and jax_distributed.* may differ between hosts; unset optional flags
        # (None) are left out too, so that adding such a flag keeps existing ids; and what
        # eval_harness.* evaluates changes nothing trained.
        flat = {k: v for k, v in flag_lib.flatten(config).items()
                if k not in ("resume", "allow_fresh_optimizer", "log_all_worker",
                             "profile_steps", "profile_start_step")
                and not k.startswith(("logger.", "jax_distributed.", "eval_harness.",
                                      *preference.unused_flags(config), *unused))
                and v is not None}
        digest = hashlib.sha1(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:8]
        experiment_id = f"{model_name}-{digest}"
    return checkpoint.absolute_path(os.path.join(config.logger.output_dir, experiment_id))


def _state_rest(state: TrainState) -> dict:
    """The train state minus parameters (and the frozen ones, which the model family
    rebuilds): the checkpoint's 'opt_state' item."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.name not in ("params", "frozen")}


def _metadata(config: ConfigDict, model: Model, step: int) -> dict:
    # `model` and `<model>_config` as the HF converter writes them, so that serving
    # and conversion back to HF read trained and converted checkpoints alike.
    return {
        "model": model.name, f"{model.name}_config": model.config, "step": step,
        "flags": flag_lib.flatten(config),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                     "orbax-checkpoint": ocp.__version__},
    }


def _load_state(kind: str, directory: str, model: Model, tx, mesh, seed: int):
    """(state, data state or None) from a checkpoint directory."""
    abstract = abstract_state(model, tx, mesh, seed)
    if kind == "hf":
        if model.load_hf is None:
            raise UserError(f"--load_checkpoint=hf::{directory}: the {model.name} model "
                            f"cannot load Hugging Face checkpoints")
        return init_state(model, tx, mesh, seed, params=model.load_hf(directory, abstract.params)), None
    if kind == "trainstate" and checkpoint.has_item(directory, "opt_state"):
        items = checkpoint.restore_items(
            directory, {"params": abstract.params, "opt_state": _state_rest(abstract)},
            json_items=("data",) if checkpoint.has_item(directory, "data") else (),
        )
        state = TrainState(params=items["params"], **items["opt_state"],
                           frozen=init_frozen(model, mesh, seed))
        return state, items.get("data")
    params = checkpoint.restore_items(directory, {"params": abstract.params})["params"]
    state = init_state(model, tx, mesh, seed, params=params)
    if kind != "trainstate":
        return state, None
    # (The trainer asks for --allow_fresh_optimizer first.) The step and the data resume,
    # the optimizer starts afresh.
    if jax.process_index() == 0:
        print(f"note: {directory} has no optimizer state; the optimizer starts afresh")
    items = checkpoint.restore_items(directory, {}, json_items=("data", "metadata"))
    step = int(items["metadata"]["step"])
    state = state.replace(step=jax.device_put(jnp.int32(step), state.step.sharding))
    return state, items["data"]


def _zero_sums(loss_fn) -> Callable:
    """(params, batch, frozen, *extra) -> zeros shaped like loss_fn's sums (LossSums,
    PreferenceSums, ...), traced once."""
    shapes = []

    def zeros(params, batch, frozen, *extra):
        if not shapes:
            shapes.append(jax.eval_shape(with_frozen(loss_fn, frozen), params, batch,
                                         jax.random.key(0), *extra))
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0])

    return zeros


def _evaluate(run: "Run", state: TrainState) -> dict:
    totals = None
    args = (state.frozen, *run.extra_args)
    for i, (batch, _) in enumerate(run.eval_dataset.iterate(place=run.make_batch)):
        if run.config.eval_steps and i >= run.config.eval_steps:
            break
        if totals is None:
            totals = run.eval_zeros(state.params, batch, *args)
        totals = run.eval_step(state.params, batch, totals, *args)
    if totals is None:
        return {}
    totals = jax.device_get(totals)
    return {**{f"eval_{k}": float(v) for k, v in totals.means().items()},
            f"eval_{totals.COUNT}": float(totals.count)}


class _Preemption(contextlib.AbstractContextManager):
    """While entered, SIGTERM sets a flag the loop checks after each step; on exit the
    previous handler is back (a process that trains in-process, as tests do, can then be
    stopped by SIGTERM again)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame):
        self.requested = True


def _check_config(config: ConfigDict):
    preference.check_config(config)
    if config.load_checkpoint:
        kind, directory = checkpoint.parse_load_spec(config.load_checkpoint, LOAD_PREFIXES)
        if kind != "hf":  # the model family reads (and checks) a HF directory
            checkpoint.check_checkpoint_dir(directory)
    if config.total_steps < 1:
        raise UserError(f"--total_steps must be >= 1, got {config.total_steps}")
    if config.log_freq < 1:
        raise UserError(f"--log_freq must be >= 1, got {config.log_freq}")
    if config.profile_start_step < 1:
        raise UserError(f"--profile_start_step must be >= 1, got {config.profile_start_step}")
    for name in ("save_model_freq", "save_milestone_freq", "eval_freq", "eval_steps",
                 "profile_steps"):
        if config[name] < 0:
            raise UserError(f"--{name} must be >= 0, got {config[name]}")
    embedded = lambda c: c.type == "json" and c.json_dataset.path == "embedded"
    if config.eval_freq and embedded(config.eval_dataset) and not embedded(config.train_dataset):
        raise UserError(
            f"--eval_freq={config.eval_freq} evaluates on --eval_dataset, which is not set (it "
            f"would be the embedded demo corpus, not your data): set "
            f"--eval_dataset.json_dataset.path (or --eval_dataset.type=huggingface and its "
            f"huggingface_dataset.path), or --eval_freq=0")


def _check_seq_length(config: ConfigDict, model: Model, datasets: dict):
    for section, dataset in datasets.items():
        if dataset is not None and model.max_seq_length and dataset.seq_length > model.max_seq_length:
            flag = f"--{section}.{_loader(config[section])}.seq_length"
            raise UserError(
                f"{flag}={dataset.seq_length} is above the model's max_position_embeddings="
                f"{model.max_seq_length}: lower {flag}, or raise --{model.name}."
                f"max_position_embeddings if the model can take longer rows")


def _load_data(config: ConfigDict, tokenizer, pairs: bool = False):
    """The train and (if evaluating) eval datasets, and the host->device batch function;
    pairs: batches of preference pairs (a preference objective)."""
    from easylm.data import DatasetFactory, make_global_batch

    train = DatasetFactory.load_dataset(config.train_dataset, tokenizer, pairs=pairs)
    evaluation = None
    if config.eval_freq > 0:
        evaluation = DatasetFactory.load_dataset(config.eval_dataset, tokenizer, for_eval=True,
                                                 pairs=pairs)
    return train, evaluation, make_global_batch


def _warn_about_the_schedule(config: ConfigDict, schedule, print_fn, variant: dict | None = None):
    """A fine-tuning learning rate too high for a pretrained model, and a decay that does
    not end with the run: both train, but rarely as meant."""
    if config.optimizer.type != "adamw":
        return
    c = config.optimizer.adamw_optimizer
    if starts_from_pretrained(config) and c.lr > FINE_TUNING_MAX_LR and \
            "optimizer.adamw_optimizer.lr" not in (variant or {}):
        print_fn(f"warning: fine-tuning {config.load_checkpoint} at a peak learning rate of "
                 f"{c.lr:g}, above the {FINE_TUNING_MAX_LR:g} a pretrained model usually "
                 f"tolerates (full fine-tuning uses about 1e-5 to 5e-5): lower "
                 f"--optimizer.adamw_optimizer.lr if the loss rises")
    if c.lr_decay_steps != config.total_steps:
        print_fn(f"note: --optimizer.adamw_optimizer.lr_decay_steps={c.lr_decay_steps} but "
                 f"--total_steps={config.total_steps}: the run ends at a learning rate of "
                 f"{float(schedule(config.total_steps)):.3g} (end_lr={c.end_lr:g})")


def _load_with_hint(load, manager, resumed_step: int | None):
    """`load()`; if it fails on this run's own latest checkpoint (`resumed_step`), the
    error also names the newest earlier complete one and how to resume from it."""
    try:
        return load()
    except UserError as e:
        if resumed_step is None:
            raise
        damaged = manager.step_directory(resumed_step)
        earlier = None
        for step in reversed([s for s in manager.all_steps() if s < resumed_step]):
            try:
                checkpoint.check_checkpoint_dir(manager.step_directory(step))
            except UserError:
                continue
            earlier = step
            break
        move = (f"move the damaged one away (mv {damaged} {damaged}.damaged) and run the same "
                f"command again")
        if earlier is None:
            hint = f"; it is the run's only checkpoint: to start the run afresh, {move}"
        else:
            hint = (f"; the earlier checkpoint {manager.step_directory(earlier)} (step "
                    f"{earlier}) is complete: to resume from it, {move}")
        raise UserError(f"{e}{hint}") from None


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step: the live state (do not keep it past the call, the
    next step donates its buffers) and that step's device metrics."""

    step: int
    state: TrainState
    metrics: dict


@dataclasses.dataclass
class Run:
    """One training run, set up by `start`; `loop` trains it. Extras run every N steps
    through `add_hook(fn, every=N)`: `fn(StepInfo)` after that step (after its metrics
    are logged), in the order added; a hook may set `stop_requested` to end the run after
    the current step (it is saved)."""

    config: ConfigDict
    family: ModelFamily
    model: Model
    mesh: Any
    tx: optax.GradientTransformation
    schedule: Callable
    dataset: Any
    eval_dataset: Any
    make_batch: Callable  # host batch -> global device arrays
    run_dir: str
    manager: checkpoint.CheckpointManager
    log: logger.Logger
    state: TrainState  # the live state
    start_step: int
    train_step: Callable  # jitted (state, batch, *extra_args) -> (state, metrics)
    eval_step: Callable  # jitted (params, batch, totals, frozen, *extra_args) -> totals
    saved_step: int | None  # the step a checkpoint holds (no second save of it)
    frozen_reference: dict | None = None  # {"source", "fingerprint", "dtype"} of state.frozen
    objective: Any = None  # easylm.objectives.preference.Objective: the loss, pairs or rows
    # The objective's arrays the steps take beside state and batch (a live reference).
    extra_args: tuple = ()
    eval_zeros: Callable | None = None  # zeros of the loss's sums, for the first eval batch
    harness: Any = None  # evaluation.HarnessHook (--harness_flags.tasks), or None
    hooks: list = dataclasses.field(default_factory=list)  # (every, fn)
    stop_requested: bool = False
    profiler: Any = None

    def add_hook(self, fn: Callable[[StepInfo], None], every: int = 1):
        if every < 1:
            raise ValueError(f"a hook runs every N >= 1 steps, got {every}")
        self.hooks.append((every, fn))

    def save(self, step: int):
        """A checkpoint of the current state at `step` (once per step)."""
        if self.saved_step != step:
            metadata = _metadata(self.config, self.model, step)
            if self.frozen_reference is not None:
                metadata["frozen"] = self.frozen_reference
            self.manager.save(step, self.state.params, _state_rest(self.state),
                              self.dataset.get_state_dict(), metadata)
            self.saved_step = step


def train(config: ConfigDict, family: ModelFamily) -> str:
    """Train as `config` says; returns the final checkpoint's directory."""
    with contextlib.ExitStack() as cleanup:
        run = start(config, family, cleanup)
        add_standard_hooks(run, cleanup)
        step = loop(run)
    final = run.manager.step_directory(step)
    if jax.process_index() == 0:
        print(f"checkpoint: {final}")
        if family.serve_module and step == config.total_steps:
            if run.model.apply is not None:
                print(f"serve it:   python -m {family.serve_module} --load_checkpoint=params::"
                      f"{final} --tokenizer={config.tokenizer}")
            elif config.load_checkpoint:  # adapters, folded into their base as it loads
                print(f"serve it:   python -m {family.serve_module} --load_checkpoint="
                      f"{config.load_checkpoint} --lora_checkpoint={final} "
                      f"--tokenizer={config.tokenizer}")
    return final


def start(config: ConfigDict, family: ModelFamily, cleanup: contextlib.ExitStack) -> Run:
    """Checks, mesh, tokenizer, model, optimizer, data; the run directory (locked), its
    checkpoints and log; the state, fresh, loaded or resumed; the jitted steps. What must
    be undone at the end (the lock, the checkpoint manager, the log, the mesh) goes on
    `cleanup`."""
    from easylm.data.tokenizer import load_tokenizer

    setup_compilation(config.compilation_cache_dir)
    distributed.initialize(config.jax_distributed)
    _check_config(config)
    mesh = make_mesh(config.mesh_dim, dcn_mesh_dim=config.dcn_mesh_dim)
    tokenizer = load_tokenizer(config.tokenizer)
    # The model a --load_checkpoint records (hf::, params::, ...), unless flags change it.
    model = family.build(config, from_checkpoint=True)
    if config.load_checkpoint.startswith("hf::") and config.tokenizer == "embedded" \
            and jax.process_index() == 0:
        print(f"warning: training {config.load_checkpoint} with --tokenizer=embedded; pass "
              f"--tokenizer=DIR for the model's own tokenizer", file=sys.stderr)
    if model.vocab_size < len(tokenizer):
        raise UserError(
            f"the model's vocabulary (--{model.name}.vocab_size={model.vocab_size}) is smaller "
            f"than the {len(tokenizer)} tokens of --tokenizer={config.tokenizer}"
        )
    tx, schedule = optimizers.get_optimizer(config.optimizer)
    accumulate = config.optimizer.accumulate_gradient_steps
    # ---- lm-eval in the loop (--eval_harness.*): tasks checked and the engine made now.
    harness = None
    if harness_flags.task_names(config.eval_harness):
        from easylm.evaluation.harness import HarnessHook

        if model.apply is None:
            raise UserError(f"--harness_flags.tasks: the {model.name} model has no serving "
                            f"engine to evaluate on")
        harness = HarnessHook(config.eval_harness, model, tokenizer, mesh)
    # ----
    objective = preference.build_objective(config, model, tokenizer)
    dataset, eval_dataset, make_global_batch = _load_data(config, tokenizer, objective.pairs)
    check_batch_split(dataset.batch_size, mesh.shape, accumulate)
    _check_seq_length(config, model, {"train_dataset": dataset, "eval_dataset": eval_dataset})
    make_batch = lambda batch: make_global_batch(objective.prepare(batch), mesh)  # noqa: E731

    run_dir = run_directory(config, model.name, family.unused_variant_flags(config))
    # One trainer per run directory (process 0 stands for all processes of a run).
    if jax.process_index() == 0:
        lock = cleanup.enter_context(run_lock.RunLock(run_dir))
        if lock.note:
            print(lock.note, file=sys.stderr)
    manager = checkpoint.CheckpointManager(
        os.path.join(run_dir, "checkpoints"), config.checkpointer, config.save_milestone_freq
    )
    cleanup.callback(manager.close)
    removed = manager.remove_unfinished()
    if removed:
        print(f"removed {len(removed)} unfinished checkpoint save(s) of an earlier run: "
              f"{', '.join(removed)}")
    latest = manager.latest_step()
    if latest is not None and not config.resume:
        raise UserError(
            f"{run_dir} already has checkpoints (latest: step {latest}); pass --resume=True "
            f"to continue from it, or set another --logger.experiment_id"
        )
    cleanup.enter_context(jax.set_mesh(mesh))
    source, state, data_state = _start_state(config, model, tx, mesh, manager, latest)
    frozen_reference = _frozen_reference(config, model, state, source)
    if data_state is not None:
        dataset.load_state_dict(data_state)
    start_step = int(state.step)
    log = logger.Logger(config.logger, run_dir, flag_lib.flatten(config),
                        config.total_steps, start_step, config.log_all_worker)
    cleanup.callback(log.close)
    run = Run(config=config, family=family, model=model, mesh=mesh, tx=tx, schedule=schedule,
              dataset=dataset, eval_dataset=eval_dataset, make_batch=make_batch,
              run_dir=run_dir, manager=manager, log=log, state=state, start_step=start_step,
              train_step=None, eval_step=None, objective=objective, harness=harness,
              frozen_reference=frozen_reference,
              saved_step=start_step if source and source[0] == "trainstate" else None)
    _print_start(run, latest is None)

    # The objective's arrays beside state and batch (a live reference model), or ().
    extra = objective.frozen(run_dir, lambda: starting_params(config, model, tx, mesh),
                             make_batch, log.print, state)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(mesh, P())
    run.extra_args = extra
    run.train_step = jit_train_step(model, tx, schedule, config.seed, accumulate, state, mesh,
                                    objective.loss_fn, extra)
    run.eval_step = jax.jit(make_eval_step(objective.loss_fn),
                            in_shardings=(state_shardings.params,
                                          NamedSharding(mesh, P(BATCH_AXES)), replicated,
                                          state_shardings.frozen,
                                          *jax.tree.map(lambda x: x.sharding, extra)),
                            out_shardings=replicated)
    run.eval_zeros = _zero_sums(objective.loss_fn)
    return run


def _start_state(config, model, tx, mesh, manager, latest):
    """(source or None, state, data state or None): resumed from the run's latest
    checkpoint, else from --load_checkpoint, else fresh."""
    if latest is not None:
        source = ("trainstate", manager.step_directory(latest))
    elif config.load_checkpoint and model.load_frozen is None:
        source = checkpoint.parse_load_spec(config.load_checkpoint, LOAD_PREFIXES)
    else:  # with `load_frozen`, --load_checkpoint is the frozen base under fresh parameters
        if model.load_frozen is not None and jax.process_index() == 0:
            print(f"loading the frozen base {config.load_checkpoint}")
        return None, init_state(model, tx, mesh, config.seed), None
    if jax.process_index() == 0:
        print(f"loading {source[0]}::{source[1]}")
    kind, directory = source
    if kind == "trainstate" and not config.allow_fresh_optimizer and \
            checkpoint.has_item(directory, "params") and \
            not checkpoint.has_item(directory, "opt_state"):
        raise UserError(
            f"{directory} has no optimizer state (saved with --checkpointer."
            f"save_optimizer_state=False), so resuming would restart the optimizer "
            f"(Adam's moments from zero); pass --allow_fresh_optimizer=True to accept "
            f"that")
    state, data_state = _load_with_hint(
        lambda: _load_state(kind, directory, model, tx, mesh, config.seed), manager, latest)
    return source, state, data_state


def _frozen_reference(config, model: Model, state: TrainState, source) -> dict | None:
    """What the frozen parameters are ({"source", "fingerprint", "dtype": the compute dtype
    they were stored for}), for checkpoint metadata. A train state resumed (or loaded) on frozen parameters other than those it
    was trained on would continue from a different model: refused."""
    if state.frozen is None:
        return None
    identity = model.frozen_identity or (lambda frozen: frozen)
    reference = {"source": config.load_checkpoint if model.load_frozen else "init",
                 "fingerprint": checkpoint.fingerprint(identity(state.frozen)),
                 # what the base was stored for (quantization scales are in it)
                 "dtype": jnp.dtype(dtype_from_flag("dtype", config.dtype)).name}
    if source and source[0] == "trainstate":
        recorded = checkpoint.read_metadata(source[1]).get("frozen")
        if recorded and recorded["fingerprint"] != reference["fingerprint"]:
            raise UserError(
                f"{source[1]} was trained on a frozen base ({recorded['source']}) with "
                f"fingerprint {recorded['fingerprint']}, but {reference['source']} now gives "
                f"{reference['fingerprint']}: restore that base, or start a new run "
                f"(--logger.experiment_id)")
    return reference


def _batch_tokens(run: Run) -> int:
    # A preference pair is two rows.
    return run.objective.rows_per_example * run.dataset.batch_size * run.dataset.seq_length


def _print_start(run: Run, fresh: bool):
    config, model, mesh = run.config, run.model, run.mesh
    batch_tokens = _batch_tokens(run)
    num_params = sum(x.size for x in jax.tree.leaves(run.state.params))
    run.log.print(f"run directory: {run.run_dir}")
    # MFU needs the device's peak; when unknown, say so once here, not on every line.
    peak = flops.peak_flops_per_device(jax.devices()[0], config.peak_tflops)
    no_mfu = "" if peak else (f" | no MFU: peak FLOP/s of {jax.devices()[0].device_kind} "
                              f"unknown (--peak_tflops sets it)")
    variant = (f" ({model.variant} on a {model.num_frozen_parameters:,}-parameter "
               f"{model.frozen_dtype} base)" if model.variant else "")
    run.log.print(f"{model.name}: {num_params:,} parameters{variant} | {jax.device_count()} "
                  f"{jax.devices()[0].platform} device(s), mesh {mesh_string(mesh)} | "
                  f"{batch_tokens:,} tokens/step | steps {run.start_step} -> "
                  f"{config.total_steps}{run.objective.describe()}{no_mfu}")
    if fresh:
        _warn_about_the_schedule(config, run.schedule, run.log.print,
                                 run.family.variant_run_defaults(config))


def add_standard_hooks(run: Run, cleanup: contextlib.ExitStack):
    """The profiler window, evaluation, lm-eval (--eval_harness), checkpoints and
    preemption, as the flags say; the SIGTERM handler is undone by `cleanup`."""
    config = run.config
    # Every process traces its own devices; W&B's directory is local also when the run
    # directory is a bucket.
    profiler = profiling.Profiler(
        os.path.join(config.logger.wandb_dir or run.run_dir, "profile",
                     f"process{jax.process_index()}"),
        config.profile_start_step, config.profile_steps, run.log.print)
    if config.profile_steps and config.profile_start_step <= run.start_step:
        run.log.print(f"note: not profiling: --profile_start_step={config.profile_start_step} "
                      f"is before this run's first step, {run.start_step + 1}")
    # Stopped before the manager and the logs close, also after an error; a run that ends
    # inside the window stops it before its final save.
    run.profiler = profiler
    run.add_hook(lambda info: (profiler.after(info.step, info.metrics),
                               profiler.before(info.step + 1)))
    if run.eval_dataset is not None:
        run.add_hook(lambda info: run.log.log(info.step, _evaluate(run, info.state)),
                     every=config.eval_freq)
    if run.harness is not None:
        run.add_hook(lambda info: run.log.log(info.step, run.harness(info.step, info.state)),
                     every=run.harness.every)
    for every in {config.save_model_freq, config.save_milestone_freq} - {0}:
        run.add_hook(lambda info: run.save(info.step), every=every)
    preemption = cleanup.enter_context(_Preemption())

    def on_sigterm(info):
        if preemption.requested:
            run.log.print(f"SIGTERM: saving a checkpoint at step {info.step} and exiting")
            run.stop_requested = True

    run.add_hook(on_sigterm)


def loop(run: Run) -> int:
    """Train from `run.start_step` to --total_steps (or until a hook stops it), logging
    every --log_freq steps, running the hooks, then save; returns the last step."""
    config = run.config
    step = run.start_step
    data = run.dataset.iterate(place=run.make_batch)  # batches arrive on the devices
    throughput = _Throughput(run)
    # Last in, first out: the save in flight completes before the manager and the logs
    # close (also after an error), and the profiler stops before that.
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(run.manager.wait)
        profiler = run.profiler
        if profiler is not None:
            cleanup.callback(profiler.stop)
            profiler.before(step + 1)
        while step < config.total_steps and not run.stop_requested:
            batch, data_metrics = next(data)
            run.state, metrics = run.train_step(run.state, batch, *run.extra_args)
            step += 1
            run.log.advance()
            throughput.started(step, metrics)
            if step % config.log_freq == 0 or step in (run.start_step + 1, config.total_steps):
                _log_step(run, step, metrics, data_metrics, throughput)
            info = StepInfo(step, run.state, metrics)
            with throughput.paused():
                for every, hook in run.hooks:
                    if step % every == 0:
                        hook(info)
        if profiler is not None:
            profiler.stop()  # the final save is not traced
        run.save(step)
    return step


class _Throughput:
    """Tokens/s between log steps, from after the first (compiling) step, not counting
    the time hooks take (evaluation, saves)."""

    def __init__(self, run: Run):
        self.batch_tokens = _batch_tokens(run)
        # A live reference's forward pass counts in MFU.
        self.flops_per_token = run.objective.flops_per_token(run.dataset.seq_length)
        self.peak = flops.peak_flops_per_device(jax.devices()[0], run.config.peak_tflops)
        self.clock = None  # (time, step)

    def started(self, step: int, metrics):
        if self.clock is None:  # the first step compiles; time from after it
            jax.block_until_ready(metrics)
            self.clock = (time.time(), step)

    @contextlib.contextmanager
    def paused(self):
        began = time.time()
        yield
        self.clock = (self.clock[0] + time.time() - began, self.clock[1])

    def measure(self, step: int) -> dict:
        now = time.time()
        tokens_per_second = None
        if step > self.clock[1]:
            tokens_per_second = (step - self.clock[1]) * self.batch_tokens / (now - self.clock[0])
        self.clock = (now, step)
        return dict(tokens_seen=step * self.batch_tokens, tokens_per_second=tokens_per_second,
                    mfu=flops.mfu(self.flops_per_token, tokens_per_second, self.peak,
                                  jax.device_count()) if tokens_per_second else None)


def _log_step(run: Run, step: int, metrics: dict, data_metrics: dict, throughput: _Throughput):
    """The one place the loop waits for the device: the step's metrics, checked for a
    non-finite loss."""
    values = {k: v.item() for k, v in jax.device_get(metrics).items()}
    bad = values.pop("first_nonfinite_step")
    if bad >= 0 and not run.config.skip_nonfinite_updates:
        raise UserError(
            f"loss or gradient norm became NaN/Inf at step {bad}; stopping "
            f"(lower the learning rate, or pass --skip_nonfinite_updates=True "
            f"to skip such steps)"
        )
    values.update(**throughput.measure(step), **{f"data/{k}": v for k, v in data_metrics.items()})
    run.log.log(step, values)


@exit_on_user_error
def main(family: ModelFamily, argv: list[str] | None = None):
    """`python -m <family>.train`: parse `argv` (or print --help) and train."""
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's per-save chatter
    train(parse_flags(family, argv or sys.argv), family)
