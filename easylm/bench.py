"""Benchmarks: `python -m easylm.bench {train,data,decode,rollout} [--flag=value ...]`.

    train   the trainer's own jitted train step on synthetic tokens: warm-up steps,
            then timed steps; prints one JSON line (tokens/s, step time, MFU, peak
            device memory, compile time, versions, device). With --profile_steps=N, N
            more steps run under the profiler and 'profile' summarises where their time
            went (easylm/runtime/profiling.py).
    data    the data pipeline against raw `tokenizers` batch encoding (easylm/data/throughput.py)
    decode  the serving engine's generated tokens/s (easylm/serving/decode_bench.py)
    rollout a GRPO rollout's tokens/s, dense cache against pages and shared prompts
            (easylm/objectives/rollout_bench.py)

Example, the llama_1b shape on one GPU:

    python -m easylm.bench train --llama.base_model=llama_1b --seq_length=2048 \
        --batch_size=8 --dtype=bf16 --llama.attention=cudnn --llama.loss_chunk_size=2048

With --lora.rank=R (and --lora.base_dtype=nf4 for QLoRA) the step is the LoRA run's:
'parameters' are the adapters it trains, 'frozen_*' the base it reads. --compile_only=True
measures a step too big for this machine (docs/lora.md#memory).

A long-sequence step splits each row over --mesh_dim's sp devices, in zig-zag order as
the trainer does, with --context_parallel=ring|all_gather attention (docs/long_context.md):

    python -m easylm.bench train --seq_length=8192 --batch_size=2 \
        --mesh_dim=dp=1,fsdp=2,sp=4 --context_parallel=ring
"""

import json
import platform
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import ConfigDict

from easylm import flags, model_flags, objectives, variants
from easylm.errors import UserError, exit_on_user_error
from easylm.runtime import dtypes, flops, profiling, run_flags
from easylm.runtime.compilation import setup_compilation
from easylm.models.context_parallel import DEFAULT_STRATEGY, STRATEGIES, use_strategy
from easylm.objectives.next_token import NextToken
from easylm.runtime.sharding import BATCH_AXES, make_mesh, shown_axes
from easylm.training import optimizers
from easylm.training.options import HELP as TRAINER_HELP
from easylm.training.state import abstract_state, init_state
from easylm.training.step import device_batch, jit_train_step, split_sequence

USAGE = "usage: python -m easylm.bench {train,data,decode,rollout} [--flag=value ...]"

TRAIN_HELP = {
    "seq_length": "tokens per row",
    "batch_size": "rows per step (global)",
    "warmup_steps": "steps run before timing (the first one compiles)",
    "steps": "timed steps",
    **run_flags.help_entries("mesh_dim", "dtype", "param_dtype", "seed",
                             seed="also of the synthetic tokens"),
    "context_parallel": TRAINER_HELP["context_parallel"],
    "peak_tflops": "peak TFLOP/s per device for MFU (0: from the device table)",
    "compilation_cache_dir": "persistent compilation cache ('' to disable)",
    "compile_only": "only lower and compile the step from abstract shapes, allocating "
                    "nothing: compile time and XLA's per-device memory, for shapes too big "
                    "for this machine",
    "profile_steps": "after the timed steps, trace this many more with the jax profiler and "
                     "add a summary of the trace under 'profile' (0: no profiling)",
    "profile_dir": "where the trace (and its kernels.csv) goes; '': a temporary directory, "
                   "deleted after summarising",
}


def train_config(family) -> ConfigDict:
    config = ConfigDict()
    config.seq_length = 128
    config.batch_size = 8
    config.warmup_steps = 2
    config.steps = 5
    config.update(run_flags.get_default_config("mesh_dim", "dtype", "param_dtype", "seed",
                                               seed=0))
    config.context_parallel = ""
    config.peak_tflops = 0.0
    config.compilation_cache_dir = ""
    config.compile_only = False
    config.profile_steps = 0
    config.profile_dir = ""
    config[family.name] = model_flags.flag_config(family, family.tiny_preset)
    # --lora.*: adapters on a frozen base
    for section, block in variants.flag_sections(family).items():
        config[section] = block
    config.optimizer = optimizers.get_default_config()
    return config


def _train_help(family) -> dict:
    text = dict(TRAIN_HELP)
    text.update(model_flags.help_entries(family))
    text.update(variants.help_entries(family))
    text.update({f"optimizer.{k}": v for k, v in optimizers.HELP.items()})
    return text


def synthetic_batch(config: ConfigDict, vocab_size: int) -> dict:
    rng = np.random.RandomState(config.seed)
    tokens = rng.randint(0, vocab_size, (config.batch_size, config.seq_length + 1)).astype(np.int32)
    return {"input_tokens": tokens[:, :-1], "target_tokens": tokens[:, 1:],
            "loss_masks": np.ones((config.batch_size, config.seq_length), np.float32)}


def bench_train(config: ConfigDict, family) -> dict:
    if config.steps < 1 or config.warmup_steps < 1:
        raise UserError("--steps and --warmup_steps must be >= 1 (the first warm-up step compiles)")
    if config.profile_steps < 0:
        raise UserError(f"--profile_steps must be >= 0, got {config.profile_steps}")
    if config.profile_steps and config.compile_only:
        raise UserError("--profile_steps needs steps to run; --compile_only runs none")
    setup_compilation(config.compilation_cache_dir)
    mesh = make_mesh(config.mesh_dim)
    strategy = _check_split(config, mesh)
    model = variants.build(family, config)
    tx, schedule = optimizers.get_optimizer(config.optimizer)
    with use_strategy(strategy):
        if config.compile_only:
            return _compile_only(config, model, tx, schedule, mesh)
        return _run_steps(config, model, tx, schedule, mesh)


def _check_split(config: ConfigDict, mesh) -> str:
    """The context parallel strategy, rows checked to split over sp in zig-zag order."""
    if config.context_parallel not in ("", *STRATEGIES):
        raise UserError(f"--context_parallel={config.context_parallel!r}; expected one of "
                        f"{', '.join(STRATEGIES)}")
    sp = mesh.shape["sp"]
    if sp > 1 and config.seq_length % (2 * sp):
        raise UserError(f"--seq_length={config.seq_length} must be a multiple of 2*sp = "
                        f"{2 * sp} to split rows over --mesh_dim={config.mesh_dim}")
    return config.context_parallel or DEFAULT_STRATEGY


def _train_step(config: ConfigDict, model, tx, schedule, state, mesh):
    """The trainer's jitted step; with sp > 1 its loss sees rows in zig-zag order, as the
    trainer's does (easylm/training/setup.py)."""
    loss_fn = NextToken(model).loss_fn
    if mesh.shape["sp"] > 1:
        loss_fn = split_sequence(loss_fn, mesh.shape["sp"])
    return jit_train_step(model, tx, schedule, config.seed,
                          config.optimizer.accumulate_gradient_steps, state, mesh, loss_fn)


def _sequence_fields(config: ConfigDict, mesh) -> dict:
    if mesh.shape["sp"] == 1:
        return {}
    return {"context_parallel": config.context_parallel or DEFAULT_STRATEGY}


def _run_steps(config: ConfigDict, model, tx, schedule, mesh) -> dict:
    with jax.set_mesh(mesh):
        state = init_state(model, tx, mesh, config.seed)
        step = _train_step(config, model, tx, schedule, state, mesh)
        batch = device_batch(synthetic_batch(config, model.vocab_size), mesh)
        start = time.perf_counter()
        step.lower(state, batch).compile()
        compile_seconds = time.perf_counter() - start
        # The steps call `step`, which reuses that executable (jit's caches): the compiled
        # object itself refuses a uint4 (nf4) base, whose arrays jax 0.10.2 reports in
        # another layout than the executable's (sub_byte_element_size_in_bits 0, not 4).
        losses = []  # device scalars, fetched at the end: no per-step host sync
        for _ in range(config.warmup_steps):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(config.steps):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        loss = float(metrics["loss"])  # waits for the last step
        seconds = (time.perf_counter() - start) / config.steps
        losses = [round(float(x), 4) for x in jax.device_get(losses)]
        profile = None
        if config.profile_steps:
            state, profile = _profile(step, state, batch, config)
    tokens_per_second = config.batch_size * config.seq_length / seconds
    peak = flops.peak_flops_per_device(jax.devices()[0], config.peak_tflops)
    mfu = flops.mfu(model.flops_per_token(config.seq_length), tokens_per_second, peak, jax.device_count())
    memory = jax.devices()[0].memory_stats() or {}
    return {
        "benchmark": "train",
        **_model_fields(config, model, state),
        "seq_length": config.seq_length,
        "batch_size": config.batch_size,
        "optimizer": config.optimizer.type,  # Muon's step time beside AdamW's: two rows
        "mesh": shown_axes(mesh),
        **_sequence_fields(config, mesh),
        "tokens_per_second": round(tokens_per_second, 1),
        "step_time_s": round(seconds, 5),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_memory_gb": round(memory["peak_bytes_in_use"] / 2**30, 3) if "peak_bytes_in_use" in memory else None,
        "compile_time_s": round(compile_seconds, 2),
        "final_loss": round(loss, 4),
        "losses": losses,  # every step's, warm-up included: compare runs' loss curves
        **_machine(),
        **({"profile": profile} if profile else {}),
    }


def _profile(step, state, batch, config: ConfigDict):
    """(state, summary): `config.profile_steps` more steps under the profiler. They run
    after the timed steps and change neither their figures nor `losses`."""
    directory = config.profile_dir or tempfile.mkdtemp(prefix="easylm-profile-")
    try:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(config.profile_steps):
                state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            seconds = (time.perf_counter() - start) / config.profile_steps
        # Traced steps run slower (and on GPU without CUDA graphs, see easylm/runtime/profiling.py):
        # compare this with the untraced step_time_s.
        summary = {"traced_step_time_s": round(seconds, 5),
                   **profiling.summarize_trace(directory, config.profile_steps)}
    finally:
        if not config.profile_dir:
            shutil.rmtree(directory, ignore_errors=True)
    if not config.profile_dir:  # deleted
        summary.update(trace=None, kernels_csv=None)
    return state, summary


def _model_fields(config: ConfigDict, model, state) -> dict:
    """The model, its trained parameters and, for a variant with frozen ones (LoRA's
    base), what those are: how many weights, stored how, and their bytes (all devices)."""
    fields = {"model": config[model.name].base_model,
              "parameters": sum(x.size for x in jax.tree.leaves(state.params))}
    if model.frozen is not None:
        fields.update(variant=model.frozen.variant, frozen_parameters=model.frozen.num_parameters,
                      frozen_dtype=model.frozen.dtype,
                      frozen_gb=round(dtypes.nbytes(state.frozen["base"]) / 2**30, 3))
    return fields


def _machine() -> dict:
    return {"device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "versions": {"python": platform.python_version(), "jax": jax.__version__,
                         "jaxlib": getattr(jax.lib, "__version__", None)}}


def _compile_only(config: ConfigDict, model, tx, schedule, mesh) -> dict:
    """The step compiled for abstract state and batch (ShapeDtypeStructs with shardings)."""
    batch_sharding = NamedSharding(mesh, P(BATCH_AXES, None))
    with jax.set_mesh(mesh):
        state = abstract_state(model, tx, mesh, config.seed)
        step = _train_step(config, model, tx, schedule, state, mesh)
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
                 for k, v in synthetic_batch(config, model.vocab_size).items()}
        start = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    xla = {"xla_memory_gb_per_device": None}
    if memory is not None:
        gb = lambda n: round(n / 2**30, 3)  # noqa: E731
        # Arguments (the state is donated: outputs alias it) and temporaries: of these the
        # step's inputs (state, frozen base, batch) and its working memory (activations,
        # gradients, XLA's own copies).
        xla = {"xla_memory_gb_per_device": gb(
                   memory.argument_size_in_bytes + memory.output_size_in_bytes
                   - memory.alias_size_in_bytes + memory.temp_size_in_bytes),
               "xla_arguments_gb": gb(memory.argument_size_in_bytes),
               "xla_temp_gb": gb(memory.temp_size_in_bytes)}
    return {
        "benchmark": "train",
        "compile_only": True,
        **_model_fields(config, model, state),
        "seq_length": config.seq_length,
        "batch_size": config.batch_size,
        "mesh": shown_axes(mesh),
        **_sequence_fields(config, mesh),
        "compile_time_s": round(compile_seconds, 2),
        **xla,
        **_machine(),
    }


def _train_main(argv):
    from easylm.models import registry

    family, argv = registry.from_argv(argv, detect=True)
    usage = "usage: python -m easylm.bench train [--family=NAME] [--flag=value ...]"
    named = objectives.named_in(argv)
    if named not in (None, objectives.DEFAULT):
        raise UserError(f"--objective={named}: bench train times the next-token step on "
                        f"synthetic tokens, not another objective's (its rollouts, pairs, "
                        f"teacher): time that with python -m easylm.train, whose log has "
                        f"tokens/s (and data/rollout/seconds)")
    config = flags.parse(train_config(family), _train_help(family), argv, usage,
                         absent=variants.absent_sections(family))
    print(json.dumps(bench_train(config, family)))


@exit_on_user_error
def main(argv=None):
    argv = list(argv or sys.argv)
    if argv[1:2] and flags.wants_help(argv[:2]):
        print(f"{USAGE}\n(each benchmark's flags: python -m easylm.bench NAME --help)")
        return
    if len(argv) < 2 or argv[1] not in ("train", "data", "decode", "rollout"):
        raise UserError(f"expected a benchmark name, train, data, decode or rollout ({USAGE})")
    name, rest = argv[1], [f"{argv[0]} {argv[1]}"] + argv[2:]
    if name == "train":
        return _train_main(rest)
    if name == "data":
        from easylm.data.throughput import main as data_main
    elif name == "rollout":
        from easylm.objectives.rollout_bench import main as data_main
    else:
        from easylm.serving.decode_bench import main as data_main
    return data_main(rest)


if __name__ == "__main__":
    main()
