"""LoRA and QLoRA: trainable low-rank adapters on a frozen, optionally quantized, base.

Each targeted kernel W (in, out) stays frozen and gets two trainable adapters:

    y = x W + s * dropout(x) A B        A (in, r), B (r, out); s = alpha / r, or
                                        alpha / sqrt(r) with use_rslora (PEFT's names)

A starts as PEFT's does (kaiming-uniform with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in)))
and B at zero, so the adapted model starts as the base model, bitwise. Merging folds
W + s * A B into the kernel (in fp32, then cast).

The model side is qwix's (google/qwix, used by MaxText and Tunix): `qwix.LoraProvider`
intercepts the dot_general/einsum that reads a targeted module's own kernel, adds the
low-rank term and, with a quantized base, computes with the kernel dequantized to the
compute dtype inside that matmul (the base stays int8/4-bit on the device). What qwix
does not do is here: the adapters as their own fp32 pytree (so gradients and optimizer
state exist for them alone) created in their shards, partition rules derived from the
base kernels' rules, quantizing a (scanned) base, and merging. docs/lora.md says why.

Parameter layout (leaf names are qwix's; scanned layers add a leading L axis):

    <module>/kernel                 frozen, in --lora.base_dtype (auto: fp32 under fp32
                                    compute, else bf16); when quantized, qwix's
                                    WithAux(QArray): <module>/kernel/array/qvalue (in, out)
                                    int8 or uint4, <module>/kernel/array/scale
    <module>/kernel_lora_a          (in, r)  fp32, trainable
    <module>/kernel_lora_b          (r, out) fp32, trainable

A mixture of experts' stacks (easylm/models/moe.py) are targets too, by transformers' fused
names: <module>/experts/gate_up_proj (A (E, D, r) shared by the gate_proj and up_proj
stacks, B (E, r, 2F)) and <module>/experts/down_proj. qwix does not reach them (a grouped
ragged_dot reads them); moe.py applies them, and they are created, scaled, quantized (as
WithAux(QArray), dequantized per layer by moe.py) and merged here. No dropout on them:
PEFT's ParamWrapper has none either.

Quantized formats (frozen kernels and expert stacks only; everything else frozen is kept
in the compute dtype, and so are the scales, so the dequantized kernel and its matmul are
in the compute dtype):

    int8  per output channel: scale = absmax / 127.5 (qwix's bound: the top bucket is
          [126.5, 127.5)), q = round(w / scale), saturating at 127.
    nf4   QLoRA's 4-bit NormalFloat: blocks of 64 consecutive inputs of one output
          (the blocks bitsandbytes takes along a torch (out, in) row), each scaled by its
          absmax into [-1, 1] and rounded to the nearest of the 16 NF4 levels.
"""

import contextlib
import dataclasses
import json
import math
import os
import re
import zlib
from typing import Any, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import traverse_util
from qwix._src.providers.ptq import WithAux  # qwix's quantized-kernel box; not exported
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.models.moe import EXPERT_ADAPTERS
from easylm.runtime.sharding import PartitionRules

BASE_DTYPES = ("auto", "bf16", "fp32", "int8", "nf4")
NF4_BLOCK = 64
ADAPTERS = ("kernel_lora_a", "kernel_lora_b")  # qwix's names for a kernel's A and B
# The attention and MLP projections, by the Hugging Face names LLaMA-like families use, and
# a mixture of experts' stacks by transformers' fused names (experts/gate_up_proj: the
# gate_proj and up_proj stacks with one A; experts/down_proj), as PEFT's target_parameters
# names them: a LoRA run adapts what a dense model's would, experts included.
DEFAULT_TARGET_MODULES = (r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)/kernel$"
                          r"|experts/(gate_up_proj|down_proj)$")
# The default before the expert stacks could be adapted: on a dense model it adapts the
# same kernels, so runs recorded with it are the default's (`LoraVariant.state_settings`,
# and the run directory's hash, training/options.py).
DENSE_TARGET_MODULES = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)/kernel$"

HELP = {
    "rank": "LoRA rank r (0: no LoRA, train every parameter)",
    "alpha": "LoRA alpha: the adapters' update is scaled by alpha / r",
    "dropout": "dropout on each adapted layer's input to its adapters (training only)",
    "target_modules": "regex searched in each kernel's parameter path (e.g. "
                      "model/layers/0/self_attn/q_proj/kernel): the kernels that get adapters",
    "base_dtype": "how the frozen base is stored: auto (fp32 when --dtype computes in fp32, "
                  "else bf16), bf16, fp32, int8 (per-channel) or nf4 (QLoRA: 4-bit "
                  "NormalFloat, blocks of 64)",
    "use_rslora": "rank-stabilised LoRA: scale by alpha / sqrt(r) instead of alpha / r",
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str = DEFAULT_TARGET_MODULES
    base_dtype: str = "auto"
    use_rslora: bool = False

    def __post_init__(self):
        if self.rank < 0:
            raise UserError(f"--lora.rank must be >= 0 (0: off), got {self.rank}")
        if self.alpha <= 0:
            raise UserError(f"--lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise UserError(f"--lora.dropout must be in [0, 1), got {self.dropout}")
        if self.base_dtype not in BASE_DTYPES:
            raise UserError(f"--lora.base_dtype={self.base_dtype!r} is not one of "
                            f"{', '.join(BASE_DTYPES)}")
        try:
            re.compile(self.target_modules)
        except re.error as error:
            raise UserError(f"--lora.target_modules={self.target_modules!r} is not a "
                            f"regular expression: {error}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def quantized(self) -> bool:
        return self.base_dtype in ("int8", "nf4")

    def resolved(self, dtype) -> "LoraConfig":
        """With base_dtype 'auto' made concrete for the compute `dtype`: an fp32 run keeps
        its base in fp32 (in bf16 its loss was 2e-4..5e-4 off PEFT's fp32 one), any other
        in bf16 (half the memory; the base is read into the compute dtype anyway)."""
        if self.base_dtype != "auto":
            return self
        fp32 = jnp.dtype(dtype) == jnp.float32
        return dataclasses.replace(self, base_dtype="fp32" if fp32 else "bf16")

    @classmethod
    def from_flags(cls, config: ConfigDict) -> "LoraConfig":
        return cls(**dict(config))

    @staticmethod
    def get_default_config() -> ConfigDict:
        return ConfigDict(dataclasses.asdict(LoraConfig()))


# ---------------------------------------------------------------- the pytrees


def flat(tree) -> dict[str, Any]:
    return traverse_util.flatten_dict(tree, sep="/")


def nested(flat_tree: dict[str, Any]):
    return traverse_util.unflatten_dict(flat_tree, sep="/")


def is_adapter(path: str) -> bool:
    leaf = path.rsplit("/", 1)[-1]
    return leaf in ADAPTERS or leaf.removesuffix("_lora_a").removesuffix("_lora_b") \
        in EXPERT_ADAPTERS and leaf.endswith(("_lora_a", "_lora_b"))


def split(params) -> tuple[Any, Any]:
    """(frozen base, adapters) from one tree holding both."""
    items = flat(params)  # a quantized kernel (not a dict) is one item
    return (nested({k: v for k, v in items.items() if not is_adapter(k)}),
            nested({k: v for k, v in items.items() if is_adapter(k)}))


def combine(base, adapters):
    """One tree for the model: the base's leaves and the adapters beside their kernels."""
    return nested({**flat(base), **flat(adapters)})


def _is_quantized(x) -> bool:
    return hasattr(x, "array") and isinstance(getattr(x, "array"), qwix.QArray)


def target_paths(shapes, pattern: str, experts: bool = False, names=None) -> list[str]:
    """The '/'-paths of the kernels `pattern` selects (re.search), in tree order; with
    `experts`, of the expert stacks too, by their adapters' names (`expert_stacks`).
    `names`: path -> transformers' module path (`HFAdapter.module_path`), which `pattern`
    may match instead (DeepSeek-V4's attn/wq_a is self_attn/q_a_proj there)."""
    kernels = [path for path, leaf in flat(shapes).items()
               if path.endswith("/kernel") and len(leaf.shape) >= 2]
    if experts:
        kernels += [path for path in flat(shapes) if path.endswith("/experts/gate_proj")
                    for path in _expert_targets(path)]
    targets = [path for path in kernels if re.search(pattern, path)
               or names is not None and re.search(pattern, names(path))]
    if not targets:
        some = ", ".join(kernels[:4]) + (", ..." if len(kernels) > 4 else "")
        raise UserError(f"--lora.target_modules={pattern!r} matches none of the model's "
                        f"kernels ({some})")
    return targets


def _expert_targets(gate_proj: str) -> list[str]:
    """.../experts/gate_proj -> the adapter targets of its module (.../experts/gate_up_proj,
    .../experts/down_proj)."""
    prefix = gate_proj.removesuffix("gate_proj")
    return [prefix + name for name in EXPERT_ADAPTERS]


def is_expert_target(path: str) -> bool:
    return not path.endswith("/kernel")


def expert_stacks(target: str) -> list[str]:
    """.../experts/gate_up_proj -> [.../experts/gate_proj, .../experts/up_proj]: the stacks
    an expert target's adapters add to (B's columns in this order)."""
    prefix, name = target.rsplit("/", 1)
    return [f"{prefix}/{stack}" for stack in EXPERT_ADAPTERS[name]]


def partition_rules(rules: PartitionRules) -> PartitionRules:
    """The model's rules extended to adapters and quantized kernels: A (in, r) is split
    like its kernel's input dimension, B (r, out) like its output dimension, a quantized
    kernel's values like the kernel, and its scales like the output dimension only (an
    int8 scale has one row; nf4 has in/64 rows, which need not divide the input's mesh
    axes: keeping them whole costs a bf16 scale's 2/64 byte per weight, 1/16 of its 4
    bits). An adapter of a kernel that no rule matches matches nothing either: an error,
    as for parameters."""
    derived = _expert_rules(rules)
    for pattern, spec in rules:
        if len(spec) != 2:  # only (in, out) kernels carry adapters; experts' are above
            continue
        inputs, outputs = spec
        pattern = pattern.removesuffix("$")  # anchored at the kernel: extended past it below
        derived += [(f"(?:{pattern})_lora_a$", P(inputs, None)),
                    (f"(?:{pattern})_lora_b$", P(None, outputs)),
                    (f"(?:{pattern})/array/qvalue$", spec),
                    (f"(?:{pattern})/array/scale$", P(None, outputs))]
    return (*derived, *rules)


def _expert_rules(rules: PartitionRules) -> list:
    """Expert adapters split like their stacks: A (E, in, r) by the experts and the input
    dimension, B (E, r, out) by the experts and the output; a quantized stack's values like
    the stack, its scales (E, in/64, out) without the input's axis."""
    def spec_of(stack):
        return next((spec for pattern, spec in rules if re.search(pattern, stack)), None)

    derived = []
    for name, stacks in EXPERT_ADAPTERS.items():
        first, last = spec_of("experts/" + stacks[0]), spec_of("experts/" + stacks[-1])
        if first is None or len(first) != 3:
            continue
        derived += [(rf"experts/{name}_lora_a$", P(first[0], first[1], None)),
                    (rf"experts/{name}_lora_b$", P(first[0], None, last[2]))]
        for stack in stacks:
            spec = spec_of("experts/" + stack)
            derived += [(rf"experts/{stack}/array/qvalue$", spec),
                        (rf"experts/{stack}/array/scale$", P(spec[0], None, spec[2]))]
    return derived


# ------------------------------------------------------------ quantization


def quantize_kernel(kernel: jax.Array, base_dtype: str, scale_dtype) -> qwix.QArray:
    """A kernel (..., in, out) as qwix's QArray (see the module doc for the formats);
    leading axes (a scanned layer axis) are quantized independently."""
    axes = list(range(kernel.ndim))
    inputs = kernel.ndim - 2
    if base_dtype == "int8":
        return qwix.quantize(kernel, jnp.int8, channelwise_axes=axes[:inputs] + [inputs + 1],
                             scale_dtype=scale_dtype)
    check_nf4_blocks(kernel.shape)
    return qwix.quantize(kernel, "nf4", channelwise_axes=axes[:inputs] + [inputs + 1],
                         tiled_axes={inputs: NF4_BLOCK}, scale_dtype=scale_dtype)


def quantize_stack(stack, base_dtype: str, scale_dtype):
    """An expert stack (..., E, in, out) quantized as a kernel is (each expert on its own:
    int8 has one scale per (expert, output channel)), in qwix's WithAux as qwix keeps its
    quantized kernels, which moe.py's `Experts` dequantizes before the grouped matmul."""
    return WithAux(array=quantize_kernel(stack, base_dtype, scale_dtype), how=None)


def check_nf4_blocks(shape, path: str = "a kernel") -> None:
    """nf4 scales blocks of NF4_BLOCK inputs: a kernel (..., in, out) whose `in` they do not
    divide is a UserError naming it."""
    if shape[-2] % NF4_BLOCK:
        raise UserError(f"--lora.base_dtype=nf4 needs each targeted kernel's input dimension "
                        f"to be a multiple of {NF4_BLOCK}: {path} has shape {tuple(shape)} "
                        f"(leave it out of --lora.target_modules, or use int8)")


def dequantize(leaf) -> jax.Array:
    return qwix.dequantize(leaf.array) if _is_quantized(leaf) else leaf


# ------------------------------------------------------------------ the model


class LoraModel:
    """A Linen module with adapters on its targeted kernels, and its frozen base's layout.

    `module` must have `init_params(rng) -> params`, and read each targeted kernel as a
    parameter of the module whose matmul uses it (as `nn.Dense` does): qwix adapts that
    matmul. Targets it would not reach (a kernel read into a matmul elsewhere) are an
    error here, not a silently unadapted layer.
    """

    def __init__(self, module: nn.Module, config: LoraConfig, dtype=jnp.float32, names=None):
        if config.rank < 1:
            raise UserError(f"--lora.rank must be >= 1 to build adapters, got {config.rank}")
        config = config.resolved(dtype)
        self.config, self.dtype, self.base_module = config, jnp.dtype(dtype), module
        shapes = flat(jax.eval_shape(module.init_params, jax.random.key(0)))
        self.targets = tuple(target_paths(nested(shapes), config.target_modules, experts=True,
                                          names=names))
        self.kernels = tuple(path for path in self.targets if not is_expert_target(path))
        experts = [path for path in self.targets if is_expert_target(path)]
        self.stacks = {stack: target for target in experts for stack in expert_stacks(target)}
        if config.base_dtype == "nf4":  # before qwix, which would fail in its own words
            for path in (*self.kernels, *self.stacks):
                check_nf4_blocks(shapes[path].shape, path)
        self.module = self._wrap(module, config.dropout)
        self._eval_module = self.module if not config.dropout else self._wrap(module, 0.0)
        # qwix's own abstract init: the quantized kernels' WithAux templates, and a check
        # that it adapts exactly the targeted kernels.
        with _tracers_without_origin():
            template, adapters = split(jax.eval_shape(self.module.init_params,
                                                      jax.random.key(0)))
        adapted = sorted({path.rsplit("_", 2)[0] for path in flat(adapters)})
        if adapted != sorted(self.kernels):
            missed = sorted(set(self.kernels) - set(adapted))
            raise UserError(f"LoRA could not adapt {len(missed)} targeted kernel(s), which the "
                            f"model reads outside their own module's matmul: {', '.join(missed)}")
        self._template = flat(template)
        adapter_shapes = {path: leaf.shape for path, leaf in flat(adapters).items()}
        for target in experts:
            adapter_shapes.update(_expert_adapter_shapes(target, shapes, config.rank))
        self.adapter_shapes = nested({path: jax.ShapeDtypeStruct(shape, jnp.float32)
                                      for path, shape in adapter_shapes.items()})

    def _wrap(self, module, dropout: float) -> nn.Module:
        c = self.config
        if not self.kernels:  # experts only: qwix adapts nothing
            return module
        modules = "|".join(re.escape(path[: -len("/kernel")]) for path in self.kernels)
        qtype = {"int8": jnp.int8, "nf4": "nf4"}.get(c.base_dtype)
        # qwix creates adapters (only ever abstractly here: ours come from init_adapters)
        # in the kernel's dtype; in the compute dtype they keep the layer's output in it,
        # as `apply` does by casting.
        zeros = lambda rng, shape, dtype: jnp.zeros(shape, self.dtype)
        rule = qwix.LoraRule(
            module_path=f"({modules})", rank=c.rank,
            alpha=c.scaling * c.rank,  # qwix scales by alpha / rank
            dropout=dropout, weight_qtype=qtype,
            tile_size=NF4_BLOCK if c.base_dtype == "nf4" else None,
            lora_a_initializer=zeros, lora_b_initializer=zeros)
        return qwix.apply_lora_to_model(module, qwix.LoraProvider([rule]))

    # ----------------------------------------------------------- the pytrees

    def init_adapters(self, rng) -> Any:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's default), B = 0, in fp32. Each layer's A
        is drawn from a key of its module's name and layer index, so scanned layers (a
        leading L axis) get the adapters unscanned ones do; an expert stack's A (E, in, r)
        draws each expert's as PEFT does its (r*E, in) lora_A (one bound, 1/sqrt(in))."""
        shapes, out = flat(self.adapter_shapes), {}
        for path in self.targets:
            a, b = shapes[path + "_lora_a"].shape, shapes[path + "_lora_b"].shape
            one = a[-3:] if is_expert_target(path) else a[-2:]  # one layer's A
            bound = 1.0 / math.sqrt(a[-2])
            name = re.sub(r"/layers/\d+/", "/layers/", path)
            key = jax.random.fold_in(rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)
            draw = lambda k: jax.random.uniform(k, one, jnp.float32, -bound, bound)  # noqa: E731
            layer = re.search(r"/layers/(\d+)/", path)
            if len(a) > len(one):  # scanned: (L, ...), layer i drawn as unscanned layer i is
                layer_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(a[0]))
                out[path + "_lora_a"] = jax.vmap(draw)(layer_keys)
            else:
                out[path + "_lora_a"] = draw(key if layer is None else
                                             jax.random.fold_in(key, int(layer.group(1))))
            out[path + "_lora_b"] = jnp.zeros(b, jnp.float32)
        return nested(out)

    def adapters_off(self, adapters) -> Any:
        """`adapters` with every B zeroed: x A B adds exactly 0 to each projection, so the
        model computes its base bitwise (a preference objective's reference)."""
        return nested({path: jnp.zeros_like(leaf) if path.endswith("_lora_b") else leaf
                       for path, leaf in flat(adapters).items()})

    def store_base(self, params) -> Any:
        """The frozen base from float parameters: targeted kernels quantized (int8/nf4),
        the rest cast to --lora.base_dtype (the compute dtype when quantized)."""
        storage = {"bf16": jnp.bfloat16, "fp32": jnp.float32}.get(self.config.base_dtype,
                                                                   self.dtype)
        out = {}
        for path, leaf in flat(params).items():
            if self.config.quantized and path in self.kernels:
                quantized = quantize_kernel(leaf, self.config.base_dtype, self.dtype)
                out[path] = self._template[path].replace(array=quantized)
            elif self.config.quantized and path in self.stacks:  # (..., E, in, out)
                out[path] = quantize_stack(leaf, self.config.base_dtype, self.dtype)
            else:  # jax arrays: qwix's dtype promotion passes numpy ones through uncast
                out[path] = jnp.asarray(leaf, storage)
        return nested(out)

    def identity(self, base) -> Any:
        """What identifies a stored base whatever the compute dtype (its fingerprint's
        input): quantized, every float (the scales, the unquantized leaves, stored in the
        compute dtype) in bf16. Lossless: the base is read in bf16 and qwix rounds fp32
        scales to bf16 ones, so a run on bf16 and its export on fp32 agree."""
        if not self.config.quantized:
            return base
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, base)

    def dequantized_base(self, base) -> Any:
        """The base as float parameters of the unadapted module (quantized kernels
        dequantized): the model that step 0 of a LoRA run computes."""
        return nested({path: dequantize(leaf) for path, leaf in flat(base).items()})

    def merge(self, base, adapters, dtype=None) -> Any:
        """Parameters of the unadapted module with W + s * A B folded into each targeted
        kernel, computed in fp32 and cast to `dtype` (default: each kernel's float dtype)."""
        params = flat(self.dequantized_base(base))
        lora = flat(adapters)
        for target in self.targets:
            delta = jnp.matmul(lora[target + "_lora_a"].astype(jnp.float32),
                               lora[target + "_lora_b"].astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST)  # (..., in, out)
            stacks = expert_stacks(target) if is_expert_target(target) else [target]
            parts = np.cumsum([params[path].shape[-1] for path in stacks])[:-1]
            for path, part in zip(stacks, jnp.split(delta, parts, axis=-1)):
                merged = params[path].astype(jnp.float32) + self.config.scaling * part
                params[path] = merged.astype(dtype or params[path].dtype)
        return nested(params)

    # ------------------------------------------------------------- applying

    def apply(self, base, adapters, *args, rng=None, method=None, collections=None, **kwargs):
        """The adapted module's `apply`; adapters are cast to the compute dtype (their
        gradients come back in fp32). `rng` draws the adapter dropout (training); without
        it there is none. `collections`: more variable collections (a routing to replay)."""
        adapters = flat(jax.tree.map(lambda x: jnp.asarray(x, self.dtype), adapters))
        for target in self.targets:  # qwix scales the kernels' x A B; the experts read B * s
            if is_expert_target(target):
                adapters[target + "_lora_b"] = adapters[target + "_lora_b"] * self.config.scaling
        variables = {"params": combine(base, nested(adapters)), **(collections or {})}
        if rng is not None and self.config.dropout:
            return self.module.apply(variables, *args, rngs={"dropout": rng}, method=method,
                                     **kwargs)
        return self._eval_module.apply(variables, *args, method=method, **kwargs)

    def num_adapter_parameters(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.adapter_shapes))


@contextlib.contextmanager
def _tracers_without_origin():
    """qwix asks each adapted kernel for its sharding, `getattr(kernel, 'sharding', None)`
    (qwix/_src/providers/lora.py, `_get_or_create_lora_params`); of a tracer JAX answers
    with an AttributeError whose message first walks the whole trace so far back to the
    value's origin (`DynamicJaxprTracer._origin_msg`). Over the abstract init of a whole
    unscanned model that is quadratic in its depth: DeepSeek-V4-Flash's QLoRA build took
    98 s, 77 of them there. getattr's default swallows the message unread, so while that
    init is traced the origin is left out of tracers' messages (the error still raised)."""
    from jax._src.interpreters import partial_eval

    tracer = getattr(partial_eval, "DynamicJaxprTracer", None)
    original = getattr(tracer, "_origin_msg", None)
    if original is None:  # another JAX: slower, not wrong
        yield
        return
    tracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        tracer._origin_msg = original


def _expert_adapter_shapes(target: str, shapes: dict, rank: int) -> dict:
    """A (..., E, in, r) and B (..., E, r, out) of an expert target: out sums its stacks'
    (gate_up: 2F)."""
    stacks = [shapes[path].shape for path in expert_stacks(target)]
    *lead, inputs, _ = stacks[0]
    outputs = sum(shape[-1] for shape in stacks)
    return {target + "_lora_a": (*lead, inputs, rank), target + "_lora_b": (*lead, rank, outputs)}


# ------------------------------------------------------ PEFT adapter directories

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
# adapter_config.json fields whose non-default values change what the adapters compute;
# anything but these defaults is a variant this LoRA does not implement.
_PEFT_DEFAULTS = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
                  "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
                  "layer_replication": None}


def write_peft(directory: str, tensors: Iterable[tuple[str, np.ndarray]], config: LoraConfig,
               target_modules: list[str], base_model: str = "",
               target_parameters: list[str] | None = None) -> None:
    """A PEFT LoRA directory: adapter_config.json and adapter_model.safetensors holding
    `tensors` (PEFT names and layout) as they are given; `target_parameters`: the expert
    tensors adapted. PEFT refuses dropout on those (its ParamWrapper cannot apply it), and
    ours adds none to them: their config then says lora_dropout 0."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    alpha = int(config.alpha) if float(config.alpha).is_integer() else config.alpha
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank, "lora_alpha": alpha,
        "lora_dropout": 0.0 if target_parameters else config.dropout,
        "use_rslora": config.use_rslora, "target_modules": target_modules or None,
        "target_parameters": target_parameters or None,
        "base_model_name_or_path": base_model or None,
        "init_lora_weights": True, "inference_mode": True, **_PEFT_DEFAULTS,
    }
    save_file(dict(tensors), os.path.join(directory, PEFT_WEIGHTS))
    with open(os.path.join(directory, PEFT_CONFIG), "w") as f:
        json.dump(peft_config, f, indent=2)


def read_peft(directory: str) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """(LoraConfig from adapter_config.json, PEFT-named tensors) of a PEFT LoRA directory.
    target_modules is left at its default: the tensors say which modules are adapted."""
    from safetensors.numpy import load_file

    paths = [os.path.join(directory, name) for name in (PEFT_CONFIG, PEFT_WEIGHTS)]
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing:
        raise UserError(f"{directory} is not a PEFT adapter directory: no {', '.join(missing)}")
    try:
        with open(paths[0]) as f:
            peft_config = json.load(f)
    except json.JSONDecodeError as error:
        raise UserError(f"{paths[0]}: not valid JSON ({error})")
    if peft_config.get("peft_type") != "LORA":
        raise UserError(f"{paths[0]}: peft_type is {peft_config.get('peft_type')!r}; "
                        f"only LORA adapters can be loaded")
    for field, default in _PEFT_DEFAULTS.items():
        value = peft_config.get(field, default)
        if value != default and (value or default):  # None, [] and {} are all "none"
            raise UserError(f"{paths[0]}: {field}={peft_config[field]!r} is not supported "
                            f"(only {field}={default!r})")
    try:
        config = LoraConfig(rank=int(peft_config["r"]), alpha=float(peft_config["lora_alpha"]),
                            dropout=float(peft_config.get("lora_dropout") or 0.0),
                            use_rslora=bool(peft_config.get("use_rslora", False)))
    except KeyError as error:
        raise UserError(f"{paths[0]} has no {error.args[0]!r}")
    return config, load_file(paths[1])
