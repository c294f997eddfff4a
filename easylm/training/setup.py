"""Setting a run up (`start`): checks, mesh, tokenizer, model, objective, data, the run
directory (locked), its checkpoints, the state (fresh, loaded or resumed) and its frozen
parameters, the log and the jitted steps; each a named step that returns a value, and the
`Run` built once from them."""

import contextlib
import json
import os
import sys

import jax
from ml_collections import ConfigDict

from easylm import flags as flag_lib, model_flags, objectives, variants
from easylm.data import DatasetFactory, make_global_batch
from easylm.models.vision import processor_directory
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError
from easylm.evaluation import harness_flags
from easylm.models.context_parallel import DEFAULT_STRATEGY, use_strategy
from easylm.models.config import ModelConfig
from easylm.models.family import Model, ModelFamily
from easylm.objectives.base import COPY
from easylm.runtime import checkpoint, distributed, flops
from easylm.runtime.compilation import setup_compilation
from easylm.runtime.sharding import (
    check_batch_split,
    make_mesh,
    mesh_string,
    path_to_string,
)
from easylm.training import logger, optimizers, run_lock
from easylm.training.options import (
    LOAD_PREFIXES,
    check_config,
    check_seq_length,
    mesh_problems,
    run_directory,
    warn_about_ignored_flags,
    warn_about_the_schedule,
)
from easylm.training.run import Run
from easylm.training.state import base_record, init_state, load_state, starting_params
from easylm.training.step import jit_eval_step, jit_train_step, split_sequence, zero_sums


def start(config: ConfigDict, family: ModelFamily, cleanup: contextlib.ExitStack) -> Run:
    """Checks, mesh, tokenizer, model, optimizer, objective, data; the run directory
    (locked), its checkpoints and log; the state, fresh, loaded or resumed, with what its
    losses read but do not train; the jitted steps. What must be undone at the end (the
    lock, the checkpoint manager, the log, the mesh) goes on `cleanup`."""
    setup_compilation(config.compilation_cache_dir)
    distributed.initialize(config.jax_distributed)
    check_config(config)
    mesh = make_mesh(config.mesh_dim, dcn_mesh_dim=config.dcn_mesh_dim)
    # The model (its config.json read and checked) before the tokenizer, whose loading
    # may print transformers' warnings: a refused config is then the one line printed.
    model = variants.build(family, config, from_checkpoint=True)
    tokenizer = load_tokenizer(config.tokenizer)
    _check_model(config, model, tokenizer)
    tx, schedule = optimizers.get_optimizer(config.optimizer)
    model_config = family.config_class(**model.config)
    tx = optimizers.leave_untrained(tx, family.untrained_parameters(model_config))
    # Muon's split of the parameters, refused before a run directory is made if empty.
    split = optimizers.describe(config.optimizer, jax.eval_shape(model.init_params,
                                                                 jax.random.key(0)))
    harness = _harness(config, model, tokenizer, mesh)
    objective = objectives.build(config, model, tokenizer)
    objective.images = _image_chats(config, family, model_config)
    dataset, eval_dataset = _datasets(config, tokenizer, objective, mesh, model, model_config,
                                      objective.images)
    run_dir = run_directory(config, model.name, variants.unused_flags(family, config))
    manager, latest = _checkpoints(config, run_dir, cleanup)
    cleanup.enter_context(jax.set_mesh(mesh))
    # The strategy every decoder traced in this run uses under sp > 1 (steps, rollouts).
    cleanup.enter_context(use_strategy(config.context_parallel or DEFAULT_STRATEGY))
    source, state, data_state = _start_state(config, family, model, tx, mesh, manager, latest)
    record = base_record(config, model, state, source)
    if data_state is None and config.load_dataset_state:
        data_state = _dataset_state(config.load_dataset_state)
    if data_state is not None:
        dataset.load_state_dict(data_state)
    if objective.reference == COPY:  # built once, never saved: the starting parameters
        state = state.replace(frozen={**state.frozen,
                                      "reference": starting_params(config, model, tx, mesh)})
    state = state.replace(frozen={**state.frozen, **objective.frozen_params(mesh)})
    loss_fn = objective.loss_fn
    if mesh.shape["sp"] > 1:
        loss_fn = split_sequence(loss_fn, mesh.shape["sp"])  # balanced: zig-zag order
    log = logger.Logger(config.logger, run_dir, flag_lib.flatten(config),
                        config.total_steps, int(state.step), config.log_all_worker)
    cleanup.callback(log.close)
    run = Run(config=config, family=family, model=model, objective=objective, mesh=mesh,
              schedule=schedule, dataset=dataset, eval_dataset=eval_dataset,
              place=lambda batch: make_global_batch(batch, mesh), run_dir=run_dir,
              manager=manager, log=log, state=state, start_step=int(state.step),
              train_step=jit_train_step(model, tx, schedule, config.seed,
                                        config.optimizer.accumulate_gradient_steps, state,
                                        mesh, loss_fn),
              eval_step=jit_eval_step(loss_fn, state, mesh),
              eval_zeros=zero_sums(loss_fn), base_record=record, harness=harness,
              saved_step=int(state.step) if source and source[0] == "trainstate" else None)
    _print_start(run, fresh=latest is None, split=split)
    objective.prepare_run(run_dir, lambda: starting_params(config, model, tx, mesh), state,
                          run.place, log.print)
    return run


def _dataset_state(path: str) -> dict:
    """--load_dataset_state: a checkpoint directory's data state, or a JSON file of one."""
    if os.path.isdir(path):
        if not checkpoint.has_item(path, "data"):
            raise UserError(f"--load_dataset_state={path}: the checkpoint holds no data state")
        return checkpoint.restore_items(path, {}, json_items=("data",))["data"]
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"--load_dataset_state={path}: {e}") from None


def _check_model(config: ConfigDict, model: Model, tokenizer):
    """The model a --load_checkpoint records (hf::, params::, ...), unless flags change it,
    checked against the tokenizer."""
    if config.load_checkpoint.startswith("hf::") and config.tokenizer == "embedded" \
            and jax.process_index() == 0:
        print(f"warning: training {config.load_checkpoint} with --tokenizer=embedded; pass "
              f"--tokenizer=DIR for the model's own tokenizer", file=sys.stderr)
    if model.vocab_size < len(tokenizer):
        raise UserError(
            f"the model's vocabulary (--{model.name}.vocab_size={model.vocab_size}) is smaller "
            f"than the {len(tokenizer)} tokens of --tokenizer={config.tokenizer}"
        )


def _harness(config: ConfigDict, model: Model, tokenizer, mesh):
    """lm-eval in the loop (--eval_harness.*): its tasks checked and its engine made now;
    None when no task is asked for."""
    if not harness_flags.task_names(config.eval_harness):
        return None
    from easylm.evaluation.harness import HarnessHook  # lm-eval: an optional extra

    if model.init_cache is None:
        raise UserError(f"--eval_harness.tasks: the {model.name} model has no serving "
                        f"engine to evaluate on")
    return HarnessHook(config.eval_harness, model, tokenizer, mesh)


def _image_chats(config: ConfigDict, family: ModelFamily, model_config: ModelConfig):
    """An image-text family's reader of image chats (text_processor.chat=True), with its
    image processor (`vision.processor_directory`); None for a family that reads no
    images or data that are no chats."""
    if not config.train_dataset.text_processor.chat:
        return None
    return family.image_chats(model_config, processor_directory(config.tokenizer,
                                                                config.load_checkpoint))


def _datasets(config: ConfigDict, tokenizer, objective, mesh, model: Model,
              model_config: ModelConfig, images=None):
    """The train and (if evaluating) eval datasets of the objective's rows, checked against
    the mesh and the model (`model_config`: its config); `images`: an image-text model's
    reader of image chats."""
    if images is not None and mesh.shape["sp"] > 1:
        raise UserError(f"--mesh_dim={config.mesh_dim}: sp={mesh.shape['sp']} splits rows "
                        f"over devices, which image chats do not take yet; use sp=1")
    if images is not None and not objective.takes_images:
        raise UserError(f"--objective={config.objective} does not read images as yet "
                        f"(next_token, dpo, simpo, orpo and grpo do)")
    kind = dict(pairs=objective.rows == "pairs", images=images,
                prompts=objective.completion_tokens if objective.rows == "prompts" else 0)
    train = DatasetFactory.load_dataset(config.train_dataset, tokenizer, **kind)
    evaluation = None
    if config.eval_freq > 0:
        evaluation = DatasetFactory.load_dataset(config.eval_dataset, tokenizer, for_eval=True,
                                                 **kind)
    check_batch_split(train.batch_size, mesh.shape, config.optimizer.accumulate_gradient_steps)
    check_seq_length(config, model, {"train_dataset": train, "eval_dataset": evaluation})
    lengths = {section: data.seq_length for section, data in
               (("train_dataset", train), ("eval_dataset", evaluation)) if data is not None}
    problems = mesh_problems(config, model_config, mesh.shape, lengths)
    if problems:
        raise UserError(problems[0])
    return train, evaluation


def _checkpoints(config: ConfigDict, run_dir: str, cleanup: contextlib.ExitStack):
    """(the run directory's checkpoint manager, its latest step or None), the directory
    locked: one trainer per run directory (process 0 stands for all processes of a run)."""
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
    return manager, latest


def _start_state(config, family, model, tx, mesh, manager, latest):
    """(source or None, state, data state or None): resumed from the run's latest
    checkpoint, else from --load_checkpoint, else fresh."""
    loads_base = model.frozen is not None and model.frozen.load is not None
    if latest is not None:
        source = ("trainstate", manager.step_directory(latest))
    elif config.load_checkpoint and not loads_base:
        source = checkpoint.parse_load_spec(config.load_checkpoint, LOAD_PREFIXES)
    else:  # a variant's --load_checkpoint is its frozen base, under fresh parameters
        if loads_base and jax.process_index() == 0:
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
    if kind == "trainstate":
        _check_same_model(config, family, model, directory)
    state, data_state = _load_with_hint(
        lambda: load_state(kind, directory, model, tx, mesh, config.seed), manager, latest)
    return source, state, data_state


def _check_same_model(config, family: ModelFamily, model: Model, directory: str) -> None:
    """A train state saved under other settings than this run's is intact, and another
    model: refused with the flag that differs (the settings recorded in its metadata
    against this run's), else the first parameter that does not fit, never as damage.
    A checkpoint whose metadata cannot be read is left to the load, which says so."""
    try:
        metadata = checkpoint.read_metadata(directory)
        stored = _shapes(checkpoint.stored_tree(directory, "params"))
    except UserError:
        return
    theirs = variants.state_settings(family, metadata.get("flags", {}),
                                   metadata.get(model_flags.metadata_key(family)) or {})
    ours = variants.state_settings(family, flag_lib.flatten(config), model.config)
    new_run = "start a new run (another --logger.experiment_id)"
    for flag, value in ours.items():
        if flag in theirs and theirs[flag] != value:
            raise UserError(f"{directory} was saved by a run with {flag}={theirs[flag]}, this "
                            f"run has {flag}={value}: resume with {flag}={theirs[flag]}, or "
                            f"{new_run}")
    expected = _shapes(jax.eval_shape(model.init_params, jax.random.key(0)))
    for path in sorted(set(stored) | set(expected)):
        shapes = [tree.get(path, "none") for tree in (stored, expected)]
        if shapes[0] != shapes[1]:
            raise UserError(f"{directory} holds other parameters than this run's flags "
                            f"describe ({path}: {shapes[0]} there, {shapes[1]} here): resume "
                            f"with the flags it was saved with, or {new_run}")


def _shapes(tree) -> dict:
    return {path_to_string(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


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


def _print_start(run: Run, fresh: bool, split: str | None = None):
    config, model, mesh = run.config, run.model, run.mesh
    num_params = sum(x.size for x in jax.tree.leaves(run.state.params))
    run.log.print(f"run directory: {run.run_dir}")
    # MFU needs the device's peak; when unknown, say so once here, not on every line.
    peak = flops.peak_flops_per_device(jax.devices()[0], config.peak_tflops)
    no_mfu = "" if peak else (f" | no MFU: peak FLOP/s of {jax.devices()[0].device_kind} "
                              f"unknown (--peak_tflops sets it)")
    frozen = model.frozen
    variant = (f" ({frozen.variant} on a {frozen.num_parameters:,}-parameter "
               f"{frozen.dtype} base)" if frozen else "")
    run.log.print(f"{model.name}: {num_params:,} parameters{variant} | {jax.device_count()} "
                  f"{jax.devices()[0].platform} device(s), mesh {mesh_string(mesh)} | "
                  f"{run.batch_tokens:,} tokens/step | steps {run.start_step} -> "
                  f"{config.total_steps}{run.objective.describe()}{no_mfu}")
    if split:
        run.log.print(split)
    warn_about_ignored_flags(config, run.family, run.log.print)
    if fresh:
        warn_about_the_schedule(config, run.schedule, run.log.print,
                                variants.run_defaults(run.family, config))
