"""How much memory one device needs to train, estimated before anything is compiled.

    python -m easylm.plan [trainer flags] [--plan.device_memory_gib=80] [--plan.num_devices=256]

Takes the trainer's own flags (model, mesh, batch, dtypes, optimizer, remat) and
prints, per device:

    parameters    each trained parameter's shard under the model's partition rules
    frozen        parameters read but not trained (LoRA's base), each shard in its stored
                  dtype (nf4: half a byte a weight, and its block scales)
    optimizer     the optimizer state's shards (optax's own `init`, traced)
    gradients     a gradient per trained parameter shard, and the update computed beside it
    activations   what the backward pass keeps for every layer: JAX's own list of
                  saved residuals (`saved_residuals`) for one device's share of the
                  batch, under the remat policy
    working set   the transient of one layer's backward pass: its forward recomputed
                  when remat is on, its weights gathered over fsdp (frozen ones also cast
                  or dequantized to the compute dtype) and the trained ones' full-size
                  gradient before the reduce-scatter
    batch         the step's input arrays

Activations are traced for a model of 1 and 2 layers (shard-local: heads, MLP and
vocabulary divided by mp) and extrapolated to L, so planning a 70B model takes
seconds on a laptop. With a device memory (`--plan.device_memory_gib`, or the local
device's own limit when it reports one) it says whether the run fits and, if not,
which single change makes it fit, trying the cheapest first: more fsdp, a remat
policy, gradient accumulation (a smaller per-device batch), bf16 moments (failing
that, those that help, together).

With `--lora.*` the trained parameters are the adapters and the frozen base is counted in
its stored dtype (docs/planning.md). `--quantize=int8` is a served model's (below); a
training plan refuses it, as the trainer does.

Checked against XLA's `compiled.memory_analysis()` on 8 CPU devices with
`--llama.scan_layers=True` (tests/test_plan.py: 4-7% under; LoRA 2% under to 13%
over). With unscanned layers XLA fuses some saved activations away (one case measured,
no remat: 22% less than planned), and XLA:CPU does not keep remat's savings there at
all (needs more).
With `--plan.serve_tokens=T` it plans serving instead: what `python -m easylm.serve` holds
while it prefills one T-token prompt in chunks (--plan.prefill_chunk_size) into an engine
of --plan.serve_slots slots of T positions: weights, KV cache, the prompt's own cache and
one chunk's activations (easylm/serving/memory.py; docs/long_context.md has it against
XLA's analysis); with `--quantize=int8`, the weights as the int8 variant stores them.
Exit status: 0 fits (or no device memory known), 1 does not fit, 2 bad flags.
"""

import contextlib
import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
from ml_collections import ConfigDict

from easylm import flags as flag_lib, model_flags, objectives, variants
from easylm.data.options import loader_block, loader_options
from easylm.errors import UserError, exit_on_user_error
from easylm.models import remat as remat_lib
from easylm.models.context_parallel import DEFAULT_STRATEGY, use_strategy
from easylm.objectives.base import COPY
from easylm.runtime.dtypes import DTYPES, bits, dtype_from_flag, nbytes
from easylm.runtime.sharding import (
    MESH_AXES,
    axes_size,
    batch_shards,
    check_batch_split,
    hybrid_mesh_shape,
    match_partition_rules,
    mesh_dim_string,
    mesh_string,
    over_parameter_axes,
    parse_mesh_dim,
)
from easylm.serving.engine import get_default_config as engine_defaults
from easylm.serving.memory import page_bytes, serving_bytes
from easylm.serving.pages import check_pages
from easylm.training import optimizers, options

GIB = 1024 ** 3
# Attention kernels that keep no (T, T) scores for the backward pass (flash attention:
# easylm/models/attention.py's splash); planned as the XLA einsum less those.
FLASH_ATTENTION = ("splash",)

HELP = {
    "plan.device_memory_gib": "memory of one device in GiB to check the plan against "
                              "(0: the local device's limit, if it reports one)",
    "plan.num_devices": "plan for this many devices (0: the devices present)",
    "plan.num_processes": "processes (hosts) of that run, for --dcn_mesh_dim "
                          "(0: the processes present)",
    "plan.serve_tokens": "plan serving instead of training: an engine of this context length "
                         "(serve's --seq_length) prefilling one prompt that long (0: plan "
                         "training)",
    "plan.serve_slots": "with --plan.serve_tokens: decode slots (serve's --batch_size)",
    "plan.prefill_chunk_size": "with --plan.serve_tokens: serve's --prefill_chunk_size",
    "plan.page_size": "with --plan.serve_tokens: serve's --page_size (0: dense): the cache is "
                      "a pool of pages, and the plan says how many concurrent requests of "
                      "--plan.request_tokens the pool (and the device memory) holds",
    "plan.pages": "with --plan.page_size: serve's --pages (0: every slot's whole length)",
    "plan.request_tokens": "with --plan.page_size: a request's prompt and new tokens, the "
                           "pages it holds (0: --plan.serve_tokens)",
}


def get_default_config() -> ConfigDict:
    config = ConfigDict()
    config.device_memory_gib = 0.0
    config.num_devices = 0
    config.num_processes = 0
    config.serve_tokens = 0
    config.serve_slots = 1
    config.prefill_chunk_size = engine_defaults().prefill_chunk_size
    config.page_size = 0
    config.pages = 0
    config.request_tokens = 0
    return config


@dataclasses.dataclass
class Estimate:
    """Bytes per device."""

    parameters: int
    optimizer: int
    gradients: int
    activations: int
    working_set: int
    batch: int
    mesh: dict
    frozen: int = 0  # parameters read but not trained (LoRA's base)
    reference: int = 0  # a live DPO reference: a second copy of the parameters
    # GRPO's rollouts: the engine's KV cache for every completion of a step, live while
    # generating (the training step's gradients, activations and batch are not) and
    # freed before the step.
    rollout_cache: int = 0

    @property
    def total(self) -> int:
        return self.rows()[-1][1]

    def rows(self):
        """(name, bytes) of each part, frozen, reference and rollout cache only where there
        are any, in the printed order, and the total: the larger of the training step's
        sum and the rollouts' (what stays resident, and the cache)."""
        names = ["parameters", "frozen", "optimizer", "gradients", "activations",
                 "working_set", "batch", "reference"]
        optional = ("frozen", "reference")
        parts = [(name.replace("_", " "), getattr(self, name)) for name in names
                 if name not in optional or getattr(self, name)]
        total = sum(size for _, size in parts)
        if self.rollout_cache:
            resident = self.parameters + self.frozen + self.optimizer + self.reference
            parts.append(("rollout cache", self.rollout_cache))
            total = max(total, resident + self.rollout_cache)
        return parts + [("total", total)]


def mesh_sizes(config: ConfigDict, num_devices: int, num_processes: int) -> dict:
    """{'dp': .., 'fsdp': .., 'sp': .., 'ep': .., 'mp': ..} for the configured (hybrid) mesh."""
    if config.dcn_mesh_dim:
        ici, dcn = hybrid_mesh_shape(config.mesh_dim, config.dcn_mesh_dim, num_devices,
                                     num_processes)
        return {axis: ici[axis] * dcn[axis] for axis in MESH_AXES}
    return parse_mesh_dim(config.mesh_dim, num_devices)


def shard_bytes(tree, specs, sizes: dict) -> int:
    """Bytes of one device's shard of every leaf (ShapeDtypeStructs) under `specs`."""
    total = 0
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        shape = list(leaf.shape)
        for dim, axes in enumerate(spec):
            shape[dim] = math.ceil(shape[dim] / axes_size(sizes, axes))
        total += math.ceil(math.prod(shape) * bits(leaf.dtype) / 8)  # uint4: packed
    return total


def parameter_bytes(tree, rules, sizes: dict) -> int:
    """Bytes of one device's shard of parameters (or their optimizer state) placed by a rule
    table: 'fsdp' split over fsdp and sp (`sharding.over_parameter_axes`), as the trainer
    places them."""
    specs = jax.tree.map(lambda spec: over_parameter_axes(spec, sizes),
                         match_partition_rules(rules, tree),
                         is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return shard_bytes(tree, specs, sizes)


# ------------------------------------------- what the estimates share, built once
# `report` estimates the run as given and then each change it tries (twenty and more for
# a model that does not fit); those change the optimizer, the mesh, the rows or the remat
# policy, none of which changes a model's parameters, and only the policy what a model
# keeps. So within one answer (`_sharing`: `report`, `find_fix`, `longest_row`) each model
# is built, and each trace made, once: a preset's whole model (unscanned, its init traced
# layer by layer) took 5-30 s of CPU to build and as much to shape, and the largest plans
# took 17-29 minutes on two shared cores.
_MEMO: dict | None = None  # None: outside an answer, nothing kept


@contextlib.contextmanager
def _sharing():
    global _MEMO
    outer = _MEMO
    _MEMO = {} if outer is None else outer
    try:
        yield
    finally:
        _MEMO = outer


def _memo(key: tuple, compute):
    if _MEMO is None:
        return compute()
    if key not in _MEMO:
        _MEMO[key] = compute()
    return _MEMO[key]


def _build_key(family, flags: ConfigDict, model_config) -> tuple:
    """What `variants.build(family, flags, model_config)` reads: the model's config, its
    variants' flags (LoRA's, --quantize), the dtypes and the checkpoint (an hf:: one's
    config.json is in the model config already; its path names what is loaded)."""
    read = {name: flags.get(name) for name in ("lora", "quantize", "dtype", "param_dtype",
                                                "load_checkpoint", "lora_checkpoint")}
    return (family.name, repr(model_config),
            repr({k: v.to_dict() if isinstance(v, ConfigDict) else v for k, v in read.items()}))


def _build(family, flags: ConfigDict, model_config):
    return _memo(("build", *_build_key(family, flags, model_config)),
                 lambda: variants.build(family, flags, model_config))


def _whole_model(family, flags: ConfigDict):
    """The run's model, built with remat_policy none: the plan reads of the whole model
    only what a remat policy does not change (parameters, rules, layers, the objective's
    rows); the policy itself it reads from the flags (`_remat`)."""
    return _build(family, flags, _config(family, flags).replace(remat_policy="none"))


def _config(family, flags: ConfigDict):
    return model_flags.model_config(family, flags)


def _remat(family, flags: ConfigDict) -> str:
    return _config(family, flags).remat_policy


def _shard_model(family, config: ConfigDict, layers: int, mp: int, remat: str | None = None):
    """The model of `config` with `layers` layers and one mp shard's heads, MLP and
    vocabulary (and, with `remat`, that policy): its activations are one device's."""
    variant = _config(family, config).shard_variant(layers, mp)
    if remat is not None:
        variant = variant.replace(remat_policy=remat)
    return variant, _build(family, config, variant)


def _model_shapes(family, flags: ConfigDict, model_config=None):
    """(trained, frozen or None) parameter shapes of the model of `model_config` (default:
    the flags' whole model), which no remat policy changes."""
    model_config = (model_config or _config(family, flags)).replace(remat_policy="none")
    return _memo(("shapes", *_build_key(family, flags, model_config)),
                 lambda: _shapes(_build(family, flags, model_config)))


def _saved_bytes(family, config: ConfigDict, layers: int, mp: int, batch, sp: int,
                 flash: bool, remat: str | None = None) -> int:
    """`_residual_bytes` of `_shard_model(family, config, layers, mp, remat)`."""
    variant, model = _shard_model(family, config, layers, mp, remat)
    key = ("saved", *_build_key(family, config, variant), repr(batch), sp, flash,
           _strategy(config))
    return _memo(key, lambda: _residual_bytes(model, batch, sp, flash))


def _shapes(model):
    """(trained, frozen or None) parameter shapes of `model`."""
    frozen = model.frozen and jax.eval_shape(model.frozen.init, jax.random.key(0))
    return jax.eval_shape(model.init_params, jax.random.key(0)), frozen


def _residual_bytes(model, batch, sp: int = 1, flash: bool = False) -> int:
    """Bytes the backward pass keeps (parameters, frozen ones and inputs not counted, nor
    what a remat policy offloads to the host) for `batch`; with sp > 1, one device's share
    when its rows are split over sp devices: traced under a mesh with that sp axis, so
    attention is the context parallel one (no T x T probabilities kept), and every
    residual, a (rows, T, ...) array split over sp, divided by sp. `flash`: the model's
    attention is a flash kernel's (splash), traced as the XLA einsum less its (..., T, T)
    scores and probabilities; the kernel's log-sum-exp (B, N, T), 1/(2H) of its output's
    size, is left out."""
    if sp > 1:
        mesh = AbstractMesh((1, 1, sp, 1, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 5)
        with jax.sharding.use_abstract_mesh(mesh):
            return _residual_bytes(model, batch) // sp
    # The private function behind the public `jax.ad_checkpoint.print_saved_residuals`.
    from jax._src.ad_checkpoint import saved_residuals

    from easylm.objectives.next_token import next_token_sums

    params, frozen = _shapes(model)
    if frozen is None:
        residuals = saved_residuals(
            lambda p, b: next_token_sums(model, p, b, jax.random.key(0)).loss, params, batch)
    else:  # constants of the loss (traced, but no gradient flows into them), as in the step
        residuals = []

        def trace(frozen):
            residuals.extend(saved_residuals(lambda p, b: next_token_sums(
                model, p, b, jax.random.key(0), frozen).loss, params, batch))

        jax.eval_shape(trace, frozen)
    T = batch["input_tokens"].shape[1]
    return sum(aval.size * aval.dtype.itemsize for aval, source in residuals
               if not source.startswith(("from the argument", "from a constant"))
               and getattr(aval, "memory_space", None) != jax.memory.Space.Host
               and not (flash and aval.shape[-2:] == (T, T)))


def _gathered_layer(family, config, mp: int, compute) -> int:
    """Bytes of one layer's parameters, as one mp shard holds them, gathered whole for
    its backward pass: the trained ones in the compute dtype and their gradient in their
    own; the frozen ones as stored and, where that is not the compute dtype (a quantized
    or cast kernel), again in it."""
    one, two = (_model_shapes(family, config, _config(family, config).shard_variant(n, 1))
                for n in (1, 2))
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    size = compute.itemsize
    total = (count(two[0]) - count(one[0])) * size + nbytes(two[0]) - nbytes(one[0])
    if two[1] is not None:
        cast = lambda tree: sum(x.size for x in jax.tree.leaves(tree)  # noqa: E731
                                if x.dtype != compute)
        total += nbytes(two[1]) - nbytes(one[1]) + (cast(two[1]) - cast(one[1])) * size
    return total // mp


def _dataset(config: ConfigDict):
    """The train rows' options, from the block --train_dataset.type reads."""
    return loader_options(config.train_dataset)


def _strategy(config: ConfigDict) -> str:
    """--context_parallel, as the trainer reads it: how attention splits under sp > 1."""
    return config.get("context_parallel") or DEFAULT_STRATEGY


def estimate(config: ConfigDict, family, num_devices: int, num_processes: int = 1) -> Estimate:
    """Per-device memory of training as `config` says, on `num_devices` devices (under
    sp > 1 every model traced here attends with the run's --context_parallel)."""
    with use_strategy(_strategy(config)):
        return _estimate(config, family, num_devices, num_processes)


def _check_plannable(flags: ConfigDict, family, sizes: dict, T: int) -> None:
    """A UserError for what the trainer refuses of this mesh (rows of T over sp, experts
    over ep), and where this machine cannot trace the model (a GPU-only kernel)."""
    config = model_flags.model_config(family, flags)
    problems = options.mesh_problems(flags, config, sizes, {"train_dataset": T})
    if problems:
        raise UserError(problems[0])
    if config.attention == "cudnn" and jax.default_backend() != "gpu":
        # 'auto' picks it on a GPU only; tracing it needs cuDNN present.
        raise UserError(f"--{family.name}.attention=cudnn can only be planned where cuDNN is: "
                        f"plan on the GPU host, or with --{family.name}.attention=dot_product "
                        f"for an upper bound")


def _flash_as_xla(family, config: ConfigDict) -> tuple[ConfigDict, bool]:
    """(config, flash): a flash attention kernel's config traced as the XLA einsum, whose
    T x T residuals `_residual_bytes` then leaves out."""
    if model_flags.model_config(family, config).attention not in FLASH_ATTENTION:
        return config, False
    return _changed(config, {f"{family.name}.attention": "xla"}), True


def _estimate(config: ConfigDict, family, num_devices: int, num_processes: int) -> Estimate:
    sizes = mesh_sizes(config, num_devices, num_processes)
    data = _dataset(config)
    accumulate = config.optimizer.accumulate_gradient_steps
    check_batch_split(data.batch_size, sizes, accumulate)
    rows = data.batch_size // batch_shards(sizes)  # rows of one device per step
    T, sp = data.seq_length, sizes["sp"]
    _check_plannable(config, family, sizes, T)
    config, flash = _flash_as_xla(family, config)
    model = _whole_model(family, config)
    # A preference pair is two rows; the policy's activations are then those of the
    # language-model loss on them (the reference's forward pass keeps none).
    objective = objectives.build(config, model, None)
    rows *= objective.rows_per_example
    params, frozen_shapes = _model_shapes(family, config)
    tx, _ = optimizers.get_optimizer(config.optimizer)
    opt_state = _memo(("optimizer", *_build_key(family, config, _config(family, config)
                                                 .replace(remat_policy="none")),
                       repr(config.optimizer.to_dict())),
                      lambda: jax.eval_shape(tx.init, params))
    rules = model.partition_rules
    parameters = parameter_bytes(params, rules, sizes)
    optimizer = parameter_bytes(opt_state, tuple(rules) + optimizers.STATE_RULES, sizes)
    frozen = 0 if frozen_shapes is None else parameter_bytes(
        frozen_shapes, model.frozen.rules, sizes)

    # Activations of one micro-batch on one device, for 1 and 2 layers -> L layers.
    micro = jax.ShapeDtypeStruct((rows // accumulate, T), jnp.int32)
    batch = dict(input_tokens=micro, target_tokens=micro,
                 loss_masks=jax.ShapeDtypeStruct(micro.shape, jnp.float32))
    if data.segment_ids:
        batch.update(segment_ids=micro, positions=micro)
    mp = sizes["mp"]
    saved = [_saved_bytes(family, config, n, mp, batch, sp, flash) for n in (1, 2)]
    per_layer = saved[1] - saved[0]
    activations = saved[0] + (model.num_layers - 1) * per_layer

    # One layer's backward: with remat its forward is recomputed (everything a layer
    # keeps without remat, less what the policy keeps anyway) ...
    working = 0
    if _remat(family, config) != "none":
        plain = [_saved_bytes(family, config, n, mp, batch, sp, flash, "none") for n in (1, 2)]
        working += (plain[1] - plain[0]) - per_layer
    # ... and with fsdp (or sp: PARAMETER_AXES) its weights are gathered whole and their
    # gradient is whole until reduce-scattered.
    if sizes["fsdp"] * sizes["sp"] > 1:
        compute = jnp.dtype(dtype_from_flag("dtype", config.dtype))
        working += _gathered_layer(family, config, mp, compute)

    return Estimate(
        parameters=parameters, optimizer=optimizer,
        gradients=2 * parameters,  # the gradient, and the new parameters beside the old
        activations=activations, working_set=working,
        batch=sum(rows * T * x.dtype.itemsize for x in batch.values()), mesh=sizes,
        frozen=frozen,
        # LoRA's reference is its own frozen base with the adapters off (BASE): no second
        # copy; a precomputed one is in the batches.
        reference=parameters if objective.reference == COPY else 0,
        rollout_cache=_rollout_cache(objective, model, data, sizes),
    )


def row_step(config: ConfigDict, family, num_devices: int, num_processes: int,
             step: int = 1024) -> int:
    """The granularity of `longest_row`: `step` tokens, or a sixteenth of the model's
    context when that is shorter (a 512-token model searched in steps of 1,024 finds
    nothing), rounded up to a multiple of 2*sp and the loss's chunk."""
    sp = mesh_sizes(config, num_devices, num_processes)["sp"]
    model_config = model_flags.model_config(family, config)
    step = min(step, max(1, model_config.max_position_embeddings // 16))
    return math.lcm(step, 2 * sp, model_config.loss_chunk_size or 1)


def longest_row(config: ConfigDict, family, num_devices: int, num_processes: int,
                budget: int, step: int = 1024) -> int:
    """The longest rows (a multiple of `row_step`, at most the model's
    max_position_embeddings) whose plan fits in `budget` bytes; 0 if none does.
    Doubling, then bisection: about 2 log2(longest / step) estimates."""
    with _sharing():
        return _longest_row(config, family, num_devices, num_processes, budget, step)


def _longest_row(config: ConfigDict, family, num_devices: int, num_processes: int,
                 budget: int, step: int) -> int:
    step = row_step(config, family, num_devices, num_processes, step)
    limit = model_flags.model_config(family, config).max_position_embeddings // step
    key = f"train_dataset.{loader_block(config.train_dataset)}.seq_length"

    def fits(units: int) -> bool:
        plan = estimate(_changed(config, {key: units * step}), family, num_devices,
                        num_processes)
        return plan.total <= budget

    low, high = 0, 1
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:  # fits(low) (or low = 0), not fits(high) (or beyond the limit)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step


def _rollout_cache(objective, model, data, sizes: dict) -> int:
    """One device's shard of the KV cache an online objective's rollouts decode in (GRPO's),
    under the model's cache partition rules; 0 for one that makes no rollouts."""
    shapes = objective.rollout_cache(data.batch_size, data.seq_length)
    if shapes is None:
        return 0
    return shard_bytes(shapes, match_partition_rules(model.cache_rules, shapes), sizes)


# -------------------------------------------------------------- what makes it fit


def _changed(config: ConfigDict, changes: dict) -> ConfigDict:
    out = ConfigDict(config.to_dict(), type_safe=False)
    for name, value in changes.items():
        *parents, key = name.split(".")
        node = out
        for parent in parents:
            node = node[parent]
        node[key] = value
    return out


def _dp_into_fsdp(sizes: dict) -> dict:
    return sizes | {"dp": 1, "fsdp": sizes["dp"] * sizes["fsdp"]}


def candidate_fixes(config: ConfigDict, family, num_devices: int, num_processes: int) -> list[dict]:
    """Single flag changes that lower memory, cheapest first: the ring (under sp) and fsdp
    only add communication, remat recomputes (checkpoint_dots the least), accumulation shrinks
    the per-device batch (less efficient matmuls), bf16 moments change the numerics."""
    fixes = []
    if _strategy(config) != "ring" and mesh_sizes(config, num_devices, num_processes)["sp"] > 1:
        fixes.append({"context_parallel": "ring"})  # K/V passed round: no whole K/V kept
    if config.dcn_mesh_dim:  # dp -> fsdp inside a slice/host first: ICI is fast
        ici, dcn = hybrid_mesh_shape(config.mesh_dim, config.dcn_mesh_dim, num_devices,
                                     num_processes)
        if ici["dp"] > 1:
            fixes.append({"mesh_dim": mesh_dim_string(_dp_into_fsdp(ici))})
        elif dcn["dp"] > 1:
            fixes.append({"dcn_mesh_dim": mesh_dim_string(_dp_into_fsdp(dcn))})
    else:
        sizes = parse_mesh_dim(config.mesh_dim, num_devices)
        if sizes["dp"] > 1:
            fixes.append({"mesh_dim": mesh_dim_string(_dp_into_fsdp(sizes))})
    order = remat_lib.NAMES  # ordered by what they recompute, least first
    remat = model_flags.model_config(family, config).remat_policy
    for policy in order[order.index(remat) + 1:]:
        fixes.append({f"{family.name}.remat_policy": policy})
    sizes = mesh_sizes(config, num_devices, num_processes)
    rows = _dataset(config).batch_size // batch_shards(sizes)
    k = config.optimizer.accumulate_gradient_steps
    while rows % (2 * k) == 0:
        k *= 2
        fixes.append({"optimizer.accumulate_gradient_steps": k})
    optimizer = optimizers.flags_section(config.optimizer)
    if not config.optimizer[optimizer].bf16_momentum:
        fixes.append({f"optimizer.{optimizer}.bf16_momentum": True})
    if config.optimizer.state_dtype == "fp32":
        fixes.append({"optimizer.state_dtype": "bf16"})
    return fixes


def find_fix(config: ConfigDict, family, num_devices: int, num_processes: int,
             budget: int) -> tuple[dict, Estimate] | None:
    """The first single change whose estimate fits in `budget` bytes; failing that, the
    changes that help, taken together in order until it fits; None if nothing does."""
    with _sharing():
        return _find_fix(config, family, num_devices, num_processes, budget)


def _find_fix(config: ConfigDict, family, num_devices: int, num_processes: int,
              budget: int) -> tuple[dict, Estimate] | None:
    plan = lambda changes: estimate(_changed(config, changes), family,  # noqa: E731
                                    num_devices, num_processes)
    fixes = candidate_fixes(config, family, num_devices, num_processes)
    for changes in fixes:
        fixed = plan(changes)
        if fixed.total <= budget:
            return changes, fixed
    combined, best = {}, plan({}).total
    for changes in fixes:
        fixed = plan({**combined, **changes})
        if fixed.total < best:
            combined, best = {**combined, **changes}, fixed.total
        if best <= budget:
            return combined, fixed
    return None


# ------------------------------------------------------------------------ the CLI


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def _model_name(config: ConfigDict, family) -> str:
    """What the plan is of: the --load_checkpoint the model config comes from (an hf::
    directory with its config.json's model_type), else the preset."""
    spec = config.get("load_checkpoint", "")
    if spec.startswith("hf::"):
        from easylm.models.hf_checkpoint import read_config

        return f"{spec} ({read_config(spec[len('hf::'):]).get('model_type', 'no model_type')})"
    return spec or config[family.name].base_model


def report(config: ConfigDict, family, num_devices: int, num_processes: int,
           budget: int | None) -> tuple[str, bool]:
    """The printed plan, and whether it fits (True when no budget is known)."""
    with _sharing():
        return _report(config, family, num_devices, num_processes, budget)


def _report(config: ConfigDict, family, num_devices: int, num_processes: int,
            budget: int | None) -> tuple[str, bool]:
    plan = estimate(config, family, num_devices, num_processes)
    model = _whole_model(family, config)
    objective = objectives.build(config, model, None)
    data = _dataset(config)
    compute = jnp.dtype(dtype_from_flag("dtype", config.dtype)).name
    mesh = mesh_string(plan.mesh)
    # A variant with frozen parameters (LoRA) says what it trains on what.
    name = _model_name(config, family)
    what = f"{name}, {model.num_parameters / 1e6:,.1f}M parameters"
    if model.frozen is not None:
        what = (f"{name} {model.frozen.variant}, "
                f"{model.num_parameters / 1e6:,.1f}M parameters trained, "
                f"{model.frozen.num_parameters / 1e6:,.1f}M frozen in {model.frozen.dtype}")
    names = {jnp.dtype(dtype): name for name, dtype in DTYPES.items()}
    trained = sorted({names.get(jnp.dtype(x.dtype), jnp.dtype(x.dtype).name)
                      for x in jax.tree.leaves(_model_shapes(family, config)[0])})
    lines = [
        f"plan: {what}, {model.num_layers} layers | "
        f"{num_devices} devices, mesh {mesh}"
        f"{' (' + _strategy(config) + ')' if plan.mesh['sp'] > 1 else ''} | "
        f"{data.batch_size}{objective.plan_rows()} x "
        f"{data.seq_length} tokens per step | compute {compute}"
        f"{' (--dtype=auto on ' + jax.default_backend() + ')' if config.dtype == 'auto' else ''}, "
        f"parameters {'/'.join(trained)} | {config.optimizer.type} | remat "
        f"{_remat(family, config)}",
        "per device:",
    ]
    lines += [f"  {name:<12} {_size(size):>12}" for name, size in plan.rows()]
    lines += _image_lines(family, model_flags.model_config(family, config), data.seq_length)
    if budget is None:
        lines.append("no device memory known: pass --plan.device_memory_gib to check the fit")
        return "\n".join(lines), True
    fits = plan.total <= budget
    lines.append(f"{'fits' if fits else 'does NOT fit'} in {_size(budget)} "
                 f"({100 * plan.total / budget:.0f}%)")
    if plan.mesh["sp"] > 1:  # context parallel: how long a row can get on this mesh
        longest = longest_row(config, family, num_devices, num_processes, budget)
        cap, step = model.max_seq_length, row_step(config, family, num_devices, num_processes)
        capped = f", the model's --{family.name}.max_position_embeddings" \
            if cap and longest > cap - step else ""
        lines.append(f"longest row that fits: {longest:,} tokens ({data.batch_size} rows a "
                     f"step, sp={plan.mesh['sp']}, the rest as given{capped})")
    if not fits:
        found = find_fix(config, family, num_devices, num_processes, budget)
        if found is None:
            lines.append("nothing tried fits (more fsdp, remat, gradient accumulation, bf16 "
                         "moments); use more devices or a smaller model or sequence")
        else:
            changes, fixed = found
            flags = " ".join(f"--{k}={v}" for k, v in changes.items())
            lines.append(f"fix: {flags} -> {_size(fixed.total)} per device")
    return "\n".join(lines), fits


def _image_lines(family, model_config, seq_length: int) -> list[str]:
    """An image-text model's: its vision tower (counted in the parameters above) and the
    patches and image tokens a row's images take at most (of the row's tokens)."""
    budget = model_config.image_budget()
    if budget is None:
        return []
    patches, tokens = budget
    return [f"images: vision tower {model_config.vision_parameters():,} parameters (in the "
            f"count above); a row's images up to {patches:,} patches "
            f"(--{family.name}.max_image_patches), {tokens:,} image tokens (rows of "
            f"{seq_length:,} tokens); the vision tower's activations are not estimated"]


def serving_report(config: ConfigDict, family, num_devices: int, num_processes: int,
                   budget: int | None) -> tuple[str, bool]:
    """The printed serving plan (`--plan.serve_tokens`), and whether it fits."""
    plan = config.plan
    sizes = mesh_sizes(config, num_devices, num_processes)
    if sizes["sp"] > 1:
        raise UserError(f"--mesh_dim={config.mesh_dim}: serving does not split the sequence; "
                        f"plan it with sp=1")
    model = variants.build(family, config, serving=True)  # --quantize=int8: int8 weights
    if model.max_seq_length and plan.serve_tokens > model.max_seq_length:
        raise UserError(f"--plan.serve_tokens={plan.serve_tokens} is above the model's "
                        f"max_position_embeddings={model.max_seq_length}")
    if plan.page_size < 0 or plan.pages < 0 or plan.request_tokens < 0:
        raise UserError(f"--plan.page_size, --plan.pages and --plan.request_tokens must be "
                        f">= 0, got {plan.page_size}, {plan.pages} and {plan.request_tokens}")
    if plan.page_size:
        check_pages(plan.page_size, plan.pages, plan.serve_slots, plan.serve_tokens, "plan.")
    compute = jnp.dtype(dtype_from_flag("dtype", config.dtype))
    parts = serving_bytes(model, sizes, compute, plan.serve_slots, plan.serve_tokens,
                          plan.serve_tokens, plan.prefill_chunk_size, page_size=plan.page_size,
                          pages=plan.pages)
    lines = [f"plan: serving {_model_name(config, family)}, {model.num_parameters / 1e6:,.1f}M "
             f"parameters, {model.num_layers} layers | {num_devices} devices, mesh "
             f"{mesh_string(sizes)} | {plan.serve_slots} slots x {plan.serve_tokens} tokens, "
             f"one {plan.serve_tokens}-token prompt prefilled or scored in chunks of "
             f"{plan.prefill_chunk_size or plan.serve_tokens} | compute {compute.name}"
             f"{', int8 weights' if config.get('quantize') == 'int8' else ''}",
             "per device:"]
    lines += [f"  {name:<12} {_size(size):>12}" for name, size in parts.items()]
    if plan.page_size:
        lines += page_lines(model, sizes, compute, plan, parts["total"], budget)
    lines += _image_lines(family, model_flags.model_config(family, config), plan.serve_tokens)
    fits = budget is None or parts["total"] <= budget
    if budget is None:
        lines.append("no device memory known: pass --plan.device_memory_gib to check the fit")
    else:
        lines.append(f"{'fits' if fits else 'does NOT fit'} in {_size(budget)} "
                     f"({100 * parts['total'] / budget:.0f}%)")
    return "\n".join(lines), fits


def page_lines(model, sizes: dict, dtype, plan: ConfigDict, total: int,
               budget: int | None) -> list[str]:
    """The serving plan's pages: how many concurrent requests of --plan.request_tokens the
    pool holds (the batcher admits a request when the pages of its prompt and max_tokens
    are free: `Engine.pages_needed`), and with a device memory, how many pages and
    requests the memory the rest of the plan leaves would hold."""
    Z, slots = plan.page_size, plan.serve_slots
    tokens = min(plan.request_tokens or plan.serve_tokens, plan.serve_tokens)
    pages, page = check_pages(Z, plan.pages, slots, plan.serve_tokens), \
        page_bytes(model, sizes, dtype, Z)
    each = -(-tokens // Z)
    lines = [f"pages: {pages} of {Z} positions ({page / 1024:,.1f} KiB per device each, one the "
             f"scratch page): {min(slots, (pages - 1) // each)} concurrent requests of "
             f"{tokens} tokens ({each} pages each, {slots} slots)"]
    if budget is not None and page:
        most = pages + (budget - total) // page
        lines.append(f"the device memory holds --plan.pages={max(most, 0)}: "
                     f"{max(0, (most - 1) // each)} concurrent requests of {tokens} tokens "
                     f"with as many slots (their recurrent state aside)")
    return lines


def default_config(family, objective: str | None = None) -> ConfigDict:
    config = options.default_config(family, objective)
    config.plan = get_default_config()
    return config


def help_entries(family, objective: str | None = None) -> dict:
    return {**HELP, **options.help_entries(family, objective)}


@exit_on_user_error
def main(argv=None):
    from easylm.models import registry

    family, argv = registry.from_argv(argv or sys.argv, detect=True)
    usage = (f"{__doc__.strip().splitlines()[0]}\n\n  python -m easylm.plan "
             f"--{family.name}.base_model=... --mesh_dim=1,-1,1 --plan.device_memory_gib=80\n\n"
             f"usage: python -m easylm.plan [--family=NAME] [trainer flags] "
             f"[--plan.device_memory_gib=GiB]  (all flags: --helpfull)")
    objective = objectives.named_in(argv)  # MODULE:CLASS brings its own flags
    config = default_config(family, objective)
    common = [f"plan.{name}" for name in get_default_config()] + [
        name for name in options.common_flags(family) if name in flag_lib.flatten(config)]
    config = flag_lib.parse(config, help_entries(family, objective), argv, usage,
                            common=common, absent=variants.absent_sections(family))
    num_devices = config.plan.num_devices or jax.device_count()
    num_processes = config.plan.num_processes or jax.process_count()
    budget = int(config.plan.device_memory_gib * GIB) or None
    if budget is None:
        stats = jax.local_devices()[0].memory_stats() or {}
        budget = stats.get("bytes_limit")
    planner = serving_report if config.plan.serve_tokens else report
    text, fits = planner(config, family, num_devices, num_processes, budget)
    print(text)
    sys.exit(0 if fits else 1)


if __name__ == "__main__":
    main()
