"""Optimizers (optax): AdamW with warmup + cosine decay, PaLM's Adafactor, and Muon.

`--optimizer.type` picks one; each reads its own block of flags:

    --optimizer.type=adamw --optimizer.adamw_optimizer.lr=3e-4 ...
    --optimizer.type=palm  --optimizer.palm_optimizer.lr=1e-2 ...
    --optimizer.type=muon  --optimizer.adamw_optimizer.lr=3e-4 --optimizer.muon_optimizer.* ...

Muon (Keller Jordan's, at Moonlight's update scale) is AdamW whose hidden weight matrices
get orthogonalized momentum instead of Adam's moments: it reads all of adamw_optimizer's
flags (the schedule, weight decay, clipping, and Adam's betas for the parameters it leaves
to AdamW) and adds muon_optimizer's own. See `muon` below.

Both clip the gradient's global norm first and decay weights through a mask:
parameters whose path matches one of `weight_decay_exclusions` (comma-separated
regexes, searched in paths like `model/layers/0/input_layernorm/weight`) are
not decayed. `--optimizer.accumulate_gradient_steps=k` is applied by the train
step (it splits each batch into k micro-batches), not here.

Precision: the optimizer's math is fp32 whatever the parameters' dtype. With
`--param_dtype=bf16` the gradients and parameters are cast up, the moments kept
in fp32, and each update rounded once when added to the bf16 parameters (so an
update below about 2^-9 of a weight is lost: at fine-tuning learning rates such
as 2e-5, keep fp32 parameters or turn on stochastic rounding, below).
`--optimizer.state_dtype=bf16` stores every floating optimizer-state leaf (both
Adam moments) in bfloat16, cast up for each update: the memory of a llama3_8b on
one GPU is 2+2+2+2 bytes per parameter (parameters, gradients, two moments)
instead of 4+4+4+4. A bf16 second moment rounds away changes below 2^-8 of it,
so keep `b2` <= 0.99 with it.
`--optimizer.stochastic_rounding` rounds each bf16 parameter's fp32 sum up or down
at random, with the probability of each given by how close it is (unbiased), so
updates below half a bf16 step still move the weights on average instead of being
lost: bf16 parameters then follow the fp32 run much more closely (tests/test_optimizers.py
measures it). fp32 parameters are unaffected.
"""

import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.runtime.dtypes import dtype_from_flag
from easylm.runtime.sharding import path_to_string

OPTIMIZER_TYPES = ("adamw", "palm", "muon")

STATE_DTYPES = ("fp32", "bf16")

HELP = {
    "type": f"optimizer: {' or '.join(OPTIMIZER_TYPES)}",
    "state_dtype": "dtype the optimizer state (Adam's moments) is stored in: fp32 or bf16; "
                   "the update is computed in fp32 either way",
    "stochastic_rounding": "round bf16 parameters' updates stochastically (unbiased) "
                           "instead of to nearest; no effect on fp32 parameters",
    "accumulate_gradient_steps": "split each batch into this many micro-batches whose "
                                 "gradients are summed before one update (saves memory)",
    "adamw_optimizer.init_lr": "learning rate at step 0",
    "adamw_optimizer.lr": "peak learning rate, reached at the end of warmup",
    "adamw_optimizer.end_lr": "learning rate at the end of the cosine decay, kept after it",
    "adamw_optimizer.lr_warmup_steps": "steps of linear warmup from init_lr to lr",
    "adamw_optimizer.lr_decay_steps": "step at which the cosine decay (which starts after "
                                      "warmup) reaches end_lr",
    "adamw_optimizer.b1": "Adam beta1",
    "adamw_optimizer.b2": "Adam beta2",
    "adamw_optimizer.eps": "Adam epsilon",
    "adamw_optimizer.weight_decay": "decoupled weight decay (multiplied by the learning rate)",
    "adamw_optimizer.weight_decay_exclusions": "comma-separated regexes; matching parameter "
                                               "paths get no weight decay",
    "adamw_optimizer.clip_gradient": "clip the gradient's global norm to this (0: no clipping)",
    "adamw_optimizer.bf16_momentum": "keep Adam's first moment (only) in bfloat16 (saves "
                                     "memory; --optimizer.state_dtype=bf16 stores both moments "
                                     "so)",
    "palm_optimizer.lr": "learning rate during warmup; then lr*sqrt(warmup/step) (PaLM)",
    "palm_optimizer.lr_warmup_steps": "steps at the constant learning rate",
    "palm_optimizer.b1": "momentum",
    "palm_optimizer.decay_rate": "second-moment decay: beta2 = 1 - step^-decay_rate (PaLM: 0.8)",
    "palm_optimizer.weight_decay": "weight decay coefficient c, applied as c*lr(step)^2 (PaLM: 1)",
    "palm_optimizer.weight_decay_exclusions": "comma-separated regexes; matching parameter "
                                              "paths get no weight decay",
    "palm_optimizer.clip_gradient": "clip the gradient's global norm to this (0: no clipping)",
    "palm_optimizer.bf16_momentum": "keep the momentum (only) in bfloat16 (saves memory; "
                                    "--optimizer.state_dtype=bf16 stores all the state so)",
    "muon_optimizer.momentum": "Muon's momentum (beta) on the matrices it owns; the schedule, "
                               "weight decay and clipping are --optimizer.adamw_optimizer's",
    "muon_optimizer.nesterov": "Nesterov momentum, as Keller Jordan's Muon and Moonlight use",
    "muon_optimizer.ns_steps": "Newton-Schulz iterations that orthogonalize each update",
    "muon_optimizer.rms_scale": "each orthogonalized update is scaled to this RMS "
                                "(Moonlight's 0.2 ~ AdamW's, so AdamW's lr and weight decay "
                                "carry over); 0: Keller Jordan's sqrt(max(1, out/in)) instead",
    "muon_optimizer.adamw_parameters": "comma-separated regexes; matching parameter paths "
                                       "(and every 0-D or 1-D one) are trained by AdamW, the "
                                       "other matrices by Muon",
}


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.type = "adamw"
    config.accumulate_gradient_steps = 1
    config.state_dtype = "fp32"
    config.stochastic_rounding = False

    config.adamw_optimizer = ConfigDict()
    config.adamw_optimizer.init_lr = 0.0
    config.adamw_optimizer.lr = 3e-4
    config.adamw_optimizer.end_lr = 3e-5
    config.adamw_optimizer.lr_warmup_steps = 2000
    config.adamw_optimizer.lr_decay_steps = 500000
    config.adamw_optimizer.b1 = 0.9
    config.adamw_optimizer.b2 = 0.95
    config.adamw_optimizer.eps = 1e-8
    config.adamw_optimizer.weight_decay = 0.1
    config.adamw_optimizer.weight_decay_exclusions = "norm,embed,e_score_correction_bias,layer_scalar"
    config.adamw_optimizer.clip_gradient = 1.0
    config.adamw_optimizer.bf16_momentum = False

    config.palm_optimizer = ConfigDict()
    config.palm_optimizer.lr = 1e-2
    config.palm_optimizer.lr_warmup_steps = 10000
    config.palm_optimizer.b1 = 0.9
    config.palm_optimizer.decay_rate = 0.8
    config.palm_optimizer.weight_decay = 1.0
    config.palm_optimizer.weight_decay_exclusions = "norm,embed,e_score_correction_bias,layer_scalar"
    config.palm_optimizer.clip_gradient = 1.0
    config.palm_optimizer.bf16_momentum = False

    # Muon's own knobs; its learning rate, schedule and the AdamW half are adamw_optimizer's.
    config.muon_optimizer = ConfigDict()
    config.muon_optimizer.momentum = 0.95
    config.muon_optimizer.nesterov = True
    config.muon_optimizer.ns_steps = 5
    config.muon_optimizer.rms_scale = 0.2
    # What Moonlight and marin leave to AdamW: the embedding and output head (a lookup and
    # a classifier, not a hidden linear map), norms, biases (gpt_oss's expert biases are
    # (E, F): 2-D, so matched by name), router and sink logits. Scanned layers make a
    # norm (L, D), so names, not ranks, decide.
    config.muon_optimizer.adamw_parameters = "embed,lm_head,norm,bias,router,sinks"

    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def adamw_schedule(config: ConfigDict) -> optax.Schedule:
    """init_lr -> linear warmup -> lr -> cosine decay -> end_lr at lr_decay_steps."""
    if config.lr_decay_steps <= config.lr_warmup_steps:
        raise UserError(
            f"--optimizer.adamw_optimizer.lr_decay_steps={config.lr_decay_steps} must exceed "
            f"lr_warmup_steps={config.lr_warmup_steps}"
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=config.init_lr, peak_value=config.lr, warmup_steps=config.lr_warmup_steps,
        decay_steps=config.lr_decay_steps, end_value=config.end_lr,
    )


def palm_schedule(config: ConfigDict) -> optax.Schedule:
    """PaLM: lr for the first lr_warmup_steps, then lr * sqrt(warmup / step)."""
    warmup = max(config.lr_warmup_steps, 1)
    return lambda step: config.lr * jnp.sqrt(warmup / jnp.maximum(step, warmup))


def _regexes(flag: str, value: str) -> list[str]:
    patterns = [p for p in value.split(",") if p]
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise UserError(f"{flag}: bad regex {pattern!r}: {e}")
    return patterns


def weight_decay_mask(exclusions: str):
    """A function params -> tree of bools, False where a path matches an exclusion."""
    patterns = _regexes("weight_decay_exclusions", exclusions)

    def mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any(re.search(p, path_to_string(path)) for p in patterns),
            params,
        )

    return mask


def leave_untrained(tx: optax.GradientTransformation, patterns: tuple[str, ...]):
    """`tx` over the parameters no regex in `patterns` matches (a family's
    `untrained_parameters`); those it matches keep their values: no update, no weight
    decay, no optimizer state (optax.multi_transform hands them to set_to_zero)."""
    if not patterns:
        return tx

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "untrained" if any(re.search(p, path_to_string(path))
                                               for p in patterns) else "trained", params)

    return optax.multi_transform({"trained": tx, "untrained": optax.set_to_zero()}, labels)


def _clip(norm: float):
    return [optax.clip_by_global_norm(norm)] if norm > 0 else []


def _cast_floats(tree, dtype):
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def fp32_math(inner: optax.GradientTransformation, state_dtype=jnp.float32):
    """`inner` computed in fp32 on fp32 copies of the gradients and parameters (a no-op
    for fp32 ones), its floating state stored in `state_dtype` between steps.

    The updates come out in fp32; optax.apply_updates adds them to the parameters in
    fp32 and rounds the sum to the parameters' dtype."""
    low_precision_state = state_dtype != jnp.float32

    def store(state):
        return _cast_floats(state, state_dtype) if low_precision_state else state

    def init(params):
        return store(inner.init(_cast_floats(params, jnp.float32)))

    def update(updates, state, params=None):
        if low_precision_state:
            state = _cast_floats(state, jnp.float32)
        params = None if params is None else _cast_floats(params, jnp.float32)
        updates, state = inner.update(_cast_floats(updates, jnp.float32), state, params)
        return updates, store(state)

    return optax.GradientTransformation(init, update)


class StochasticRoundingState(NamedTuple):
    inner: optax.OptState
    count: jax.Array  # updates so far: the random stream's position (a scalar, so replicated)


def round_bf16_stochastically(x: jax.Array, key: jax.Array) -> jax.Array:
    """fp32 -> bf16 rounding to one of the two neighbours, the nearer one more likely:
    E[result] = x. bf16 is fp32's upper 16 bits, so adding 16 random bits to the lower
    half and truncating carries into the upper half with probability low/2^16 (both
    signs: the magnitude is rounded). Infinities and NaNs stay what they are."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) & jnp.uint32(0xFFFF)
    finite = jnp.isfinite(x)
    rounded = jnp.where(finite, (bits + noise) & jnp.uint32(0xFFFF0000), bits)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)


def stochastic_rounding(inner: optax.GradientTransformation, seed: int = 0):
    """`inner`'s updates changed so that optax.apply_updates lands each bf16 parameter
    on its fp32 sum rounded stochastically (see `round_bf16_stochastically`).

    The update returned is (rounded sum - parameter) in fp32: a difference of two bf16
    numbers that fp32 holds exactly (or within far less than half a bf16 step), so
    apply_updates' own rounding to nearest gives back the stochastic result."""

    def init(params):
        fp16 = [x for x in jax.tree.leaves(params) if x.dtype == jnp.float16]
        if fp16:
            raise UserError("--optimizer.stochastic_rounding supports bf16 and fp32 "
                            "parameters, got fp16 ones")
        return StochasticRoundingState(inner.init(params), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("stochastic_rounding needs the parameters")
        updates, inner_state = inner.update(updates, state.inner, params)
        key = jax.random.fold_in(jax.random.key(seed), state.count)
        leaves, treedef = jax.tree.flatten(params)
        new = []
        for i, (p, u) in enumerate(zip(leaves, treedef.flatten_up_to(updates))):
            if p.dtype == jnp.bfloat16:
                p32 = p.astype(jnp.float32)
                target = round_bf16_stochastically(p32 + u.astype(jnp.float32),
                                                   jax.random.fold_in(key, i))
                u = target.astype(jnp.float32) - p32
            new.append(u)
        return treedef.unflatten(new), StochasticRoundingState(inner_state, state.count + 1)

    return optax.GradientTransformation(init, update)


def muon_labels(adamw_parameters: str):
    """A function params -> tree of "muon" or "adamw" per leaf: AdamW for the paths that
    match one of `adamw_parameters` and for every leaf of fewer than 2 dimensions."""
    patterns = _regexes("--optimizer.muon_optimizer.adamw_parameters", adamw_parameters)

    def label(path, x):
        to_adamw = x.ndim < 2 or any(re.search(p, path_to_string(path)) for p in patterns)
        return "adamw" if to_adamw else "muon"

    return lambda params: jax.tree_util.tree_map_with_path(label, params)


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def matrix_axes(updates):
    """How Muon reads each leaf it owns: the last two axes are one matrix (D_in, D_out),
    as every kernel here is laid out; leading axes (experts E, scanned layers L) index a
    stack of matrices, each orthogonalized on its own. AdamW's leaves arrive masked."""
    def axes(u):
        if _is_masked(u):
            return u
        return optax.contrib.MuonDimensionNumbers(reduction_axis=u.ndim - 2,
                                                  output_axis=u.ndim - 1)

    return jax.tree.map(axes, updates, is_leaf=_is_masked)


def scale_to_rms(rms: float) -> optax.GradientTransformation:
    """Moonlight's update scale ("Muon is Scalable for LLM Training", 2025): an orthogonal
    (m, n) matrix has RMS 1/sqrt(max(m, n)), so x rms*sqrt(max(m, n)) gives each matrix's
    update the RMS `rms`; at 0.2, about AdamW's, AdamW's learning rate and weight decay
    carry over. rms=0: Keller Jordan's sqrt(max(1, n/m)), whose learning rates are not
    AdamW's. optax.contrib.muon's consistent_rms is the same formula, but optax does not
    export it on its own (optax.contrib._muon.scale_by_shape is private)."""
    def scale(u):
        m, n = u.shape[-2:]
        return u * (rms * math.sqrt(max(m, n)) if rms else math.sqrt(max(1.0, n / m)))

    return optax.stateless(lambda updates, params=None: jax.tree.map(scale, updates))


def muon(c: ConfigDict, m: ConfigDict) -> optax.GradientTransformation:
    """Muon on the hidden matrices, AdamW on the rest, one schedule (`c`: adamw_optimizer's
    flags, `m`: muon_optimizer's).

    Built from optax.contrib.scale_by_muon (momentum, Newton-Schulz) rather than
    optax.contrib.muon, whose AdamW half is Nesterov AdamW whenever Muon's momentum is
    Nesterov and decays every parameter it owns or none: here the AdamW half is exactly
    --optimizer.type=adamw (its betas, its weight_decay_exclusions), so switching the
    optimizer changes the matrices' updates only."""
    schedule = adamw_schedule(c)
    decay = weight_decay_mask(c.weight_decay_exclusions)
    mu_dtype = jnp.bfloat16 if c.bf16_momentum else None
    matrices = optax.chain(
        optax.contrib.scale_by_muon(ns_steps=m.ns_steps, beta=m.momentum, mu_dtype=mu_dtype,
                                    nesterov=m.nesterov, weight_dimension_numbers=matrix_axes),
        scale_to_rms(m.rms_scale),
        optax.add_decayed_weights(c.weight_decay, decay),
        optax.scale_by_learning_rate(schedule),
    )
    rest = optax.adamw(learning_rate=schedule, b1=c.b1, b2=c.b2, eps=c.eps, mu_dtype=mu_dtype,
                       weight_decay=c.weight_decay, mask=decay)
    return optax.partition({"muon": matrices, "adamw": rest}, muon_labels(m.adamw_parameters))


# Optimizer-state leaves that carry no parameter's path, so no model's partition rule
# matches them: Muon's Newton-Schulz coefficients (3,), replicated.
STATE_RULES = ((r"(^|/)ns_coeffs$", jax.sharding.PartitionSpec()),)


def flags_section(config: ConfigDict) -> str:
    """The block holding the learning rate and momentum flags --optimizer.type reads."""
    return "adamw_optimizer" if config.type == "muon" else f"{config.type}_optimizer"


def unused_flags(config: ConfigDict) -> tuple:
    """Flag prefixes a run's id leaves out (easylm/training/options.py's run_directory):
    muon_optimizer's unless Muon trains, so that runs started before it existed keep
    their directories. (palm_optimizer's were always hashed; leaving them out now would
    move those runs.)"""
    return () if config.type == "muon" else ("optimizer.muon_optimizer.",)


def describe(config: ConfigDict, params) -> str | None:
    """For the start of a run: how many parameters Muon and AdamW each own (None for the
    other optimizers). A split that leaves Muon nothing is refused: it would be AdamW."""
    if config.type != "muon":
        return None
    labels = jax.tree.leaves(muon_labels(config.muon_optimizer.adamw_parameters)(params))
    sizes = [math.prod(x.shape) for x in jax.tree.leaves(params)]
    owned = {k: (sum(n for n, l in zip(sizes, labels) if l == k), labels.count(k))
             for k in ("muon", "adamw")}
    if not owned["muon"][1]:
        raise UserError("--optimizer.type=muon: --optimizer.muon_optimizer.adamw_parameters "
                        "leaves Muon no matrix to train (that is --optimizer.type=adamw)")
    return " | ".join(f"{k}: {n:,} parameters in {count} tensors"
                      for k, (n, count) in owned.items()) + \
        " (--optimizer.muon_optimizer.adamw_parameters)"


def get_optimizer(config: ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation and its learning-rate schedule (for logging)."""
    state_dtype = dtype_from_flag("optimizer.state_dtype", config.state_dtype, STATE_DTYPES,
                                  auto=False)
    tx, schedule = _optimizer(config)
    tx = fp32_math(tx, state_dtype)
    if config.stochastic_rounding:
        tx = stochastic_rounding(tx)
    return tx, schedule


def _check_numbers(config: ConfigDict, section: str):
    """Rates, decays and clipping that would train without a word, but wrongly: NaN,
    negative (a negative learning rate climbs the loss), a beta outside [0, 1)."""
    c = config[section]
    for name in ("init_lr", "lr", "end_lr", "weight_decay", "clip_gradient"):
        if name in c and not (math.isfinite(c[name]) and c[name] >= 0):
            raise UserError(f"--optimizer.{section}.{name} must be a finite number >= 0, "
                            f"got {c[name]}")
    for name in ("b1", "b2", "momentum"):
        if name in c and not 0 <= c[name] < 1:
            raise UserError(f"--optimizer.{section}.{name} must be in [0, 1), got {c[name]}")
    if "rms_scale" in c and not (math.isfinite(c.rms_scale) and c.rms_scale >= 0):
        raise UserError(f"--optimizer.{section}.rms_scale must be a finite number >= 0, "
                        f"got {c.rms_scale}")
    if "ns_steps" in c and c.ns_steps < 1:
        raise UserError(f"--optimizer.{section}.ns_steps must be >= 1, got {c.ns_steps}")


def _optimizer(config: ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    if config.type not in OPTIMIZER_TYPES:
        raise UserError(
            f"--optimizer.type={config.type!r} is not one of {', '.join(OPTIMIZER_TYPES)}"
        )
    _check_numbers(config, flags_section(config))
    if config.type == "muon":
        _check_numbers(config, "muon_optimizer")
    if config.accumulate_gradient_steps < 1:
        raise UserError(
            f"--optimizer.accumulate_gradient_steps must be >= 1, "
            f"got {config.accumulate_gradient_steps}"
        )
    if config.type == "adamw":
        c = config.adamw_optimizer
        schedule = adamw_schedule(c)
        tx = optax.chain(*_clip(c.clip_gradient), optax.adamw(
            learning_rate=schedule, b1=c.b1, b2=c.b2, eps=c.eps,
            mu_dtype=jnp.bfloat16 if c.bf16_momentum else None,
            weight_decay=c.weight_decay, mask=weight_decay_mask(c.weight_decay_exclusions),
        ))
        return tx, schedule
    if config.type == "muon":
        c = config.adamw_optimizer
        return optax.chain(*_clip(c.clip_gradient), muon(c, config.muon_optimizer)), \
            adamw_schedule(c)
    c = config.palm_optimizer
    schedule = palm_schedule(c)
    tx = optax.chain(*_clip(c.clip_gradient), optax.adafactor(
        learning_rate=schedule,
        multiply_by_parameter_scale=True,
        momentum=c.b1,
        decay_rate=c.decay_rate,
        factored=False,  # PaLM: "Adafactor without factorization"
        clipping_threshold=None,
        dtype_momentum=jnp.bfloat16 if c.bf16_momentum else jnp.float32,
        weight_decay_rate=lambda step: c.weight_decay * schedule(step) ** 2,
        weight_decay_mask=weight_decay_mask(c.weight_decay_exclusions),
    ))
    return tx, schedule
