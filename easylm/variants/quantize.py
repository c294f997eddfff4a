"""Int8 weight-only post-training quantization for serving (`--quantize=int8`): the int8
variant (`INT8`, its `Model`: `int8_variant`).

Each targeted kernel W (in, out) is stored as int8 values q and one scale per output
channel, in LoRA's int8 format (`easylm.variants.lora.quantize_kernel`, so both paths quantize a
weight to the same numbers):

    s[o] = max_i |W[i, o]| / 127.5        q[i, o] = round(W[i, o] / s[o])   (saturating)
    y = x (q * s)                         the matmul reads q and s; x stays in the compute dtype

qwix's post-training-quantization provider intercepts the dot_general that reads a
targeted module's own kernel and dequantizes it inside that matmul, so the weights stay
int8 on the device (half of bf16's bytes, which bound decode at small batches) and the
activations are never quantized. A mixture of experts' stacks (E, in, out) are read by
grouped matmuls (`jax.lax.ragged_dot`), which qwix does not intercept: they are stored
the same way (`lora.quantize_stack`: int8 values, one scale per (expert, output
channel)) and `moe.Experts` dequantizes each layer's before its grouped matmuls, as it
does QLoRA's nf4 stacks. Everything else (embeddings, norms, and the head when
it is tied to the embeddings) stays in the compute dtype. Quantizing happens at load,
on the devices, from whatever float parameters were loaded (a checkpoint of any dtype or
a Hugging Face directory): no quantized checkpoint format to keep in step.

The worst-case rounding error of one weight is s/2 = absmax/255 of its output channel;
docs/serving.md gives the measured cost in loss.
"""

import dataclasses
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix

from easylm.errors import UserError
from easylm.runtime.sharding import PartitionRules, rule_shardings
from easylm.variants.lora import (
    flat,
    nested,
    partition_rules,
    quantize_kernel,
    quantize_stack,
    target_paths,
)

MODES = ("none", "int8")
HELP = "weight-only quantization of the matmul kernels at load: none or int8 (per output channel)"
# LoRA's projections plus the output head: at a 128k vocabulary the head is a sixteenth
# of an 8B model's weights. Gated DeltaNet's wide projections too (Qwen3.5's in_proj_qkv,
# in_proj_z, Qwen3-Next's fused in_proj_qkvz, and out_proj); its per-head decay and
# write-strength projections (in_proj_a/b/ba, D x heads) stay in the compute dtype, as
# the routers do. Multi-head latent attention's (DeepSeek-V3) four besides o_proj;
# DeepSeek-V4's, by transformers' names (HFAdapter.module_path): kv_proj (its attention's,
# compressors' and indexer's) and o_b_proj (its grouped o_a_proj is read by an einsum
# outside its module: it stays in the compute dtype, as do its hyper-connections).
DEFAULT_TARGETS = (r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|lm_head|"
                   r"in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj|"
                   r"q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|kv_proj|o_b_proj)/kernel$")
# A mixture of experts' stacked expert weights (easylm/models/moe.py), quantized here
# rather than by qwix (see the module doc).
EXPERT_STACKS = re.compile(r"experts/(gate_proj|up_proj|down_proj)$")


class Int8Model:
    """A Linen module whose targeted kernels are int8, and the parameters it reads.

    `module` must have `init_params(rng) -> params` and read each targeted kernel in its
    own module's matmul (as `nn.Dense` does). Like LoRA, this excludes fused q/k/v and
    gate/up matmuls, which read a concatenation: build the module unfused (the same
    numbers).
    """

    def __init__(self, module: nn.Module, pattern: str = DEFAULT_TARGETS, names=None):
        self.base_module = module
        self.dtype = jnp.dtype(module.dtype)
        shapes = jax.eval_shape(module.init_params, jax.random.key(0))
        self.targets = tuple(target_paths(shapes, pattern, names=names))
        self.stacks = tuple(path for path in flat(shapes) if EXPERT_STACKS.search(path))
        modules = "|".join(re.escape(path[: -len("/kernel")]) for path in self.targets)
        rule = qwix.QtRule(module_path=f"({modules})", weight_qtype=jnp.int8)
        self.module = qwix.quantize_model(module, qwix.PtqProvider([rule]))
        # qwix's abstract init gives the quantized kernels' WithAux templates; a kernel it
        # did not turn into one would be served in full precision, silently.
        self._template = flat(jax.eval_shape(self.module.init_params, jax.random.key(0)))
        missed = [path for path in self.targets if not hasattr(self._template[path], "array")]
        # What the rest is stored in: the compute dtype, except where the module declares a
        # parameter fp32 whatever its param_dtype (DeepSeek-V4's hyper-connections, routers
        # and its token -> experts table, integers carried as floats).
        in_compute = module.clone(param_dtype=self.dtype)
        self._stored = {path: leaf.dtype for path, leaf in
                        flat(jax.eval_shape(in_compute.init_params, jax.random.key(0))).items()}
        if missed:
            raise UserError(f"--quantize=int8 could not quantize {len(missed)} kernel(s), which "
                            f"the model reads outside their own module's matmul: "
                            f"{', '.join(missed)}")

    def quantize(self, params) -> Any:
        """Float parameters -> the quantized module's: targeted kernels and expert stacks
        int8 with scales in the compute dtype, the rest cast to it."""
        out = {}
        for path, leaf in flat(params).items():
            if path in self.targets:
                out[path] = self._template[path].replace(
                    array=quantize_kernel(leaf, "int8", self.dtype))
            elif path in self.stacks:
                out[path] = quantize_stack(leaf, "int8", self.dtype)
            else:
                out[path] = jnp.asarray(leaf, self._stored[path])
        return nested(out)

    def quantize_sharded(self, params, rules: PartitionRules, mesh) -> Any:
        """`quantize` on the devices: each kernel is quantized where its shards are (a
        scale needs only its own output column), the result placed by `rules` extended
        to quantized kernels (values like the kernel, scales like its output axis)."""
        shapes = jax.eval_shape(self.quantize, params)
        shardings = rule_shardings(mesh, partition_rules(rules), shapes)
        with jax.set_mesh(mesh):
            return jax.jit(self.quantize, out_shardings=shardings)(params)

    def apply(self, params, *args, collections=None, **kwargs):
        return self.module.apply({"params": params, **(collections or {})}, *args, **kwargs)


def weight_bytes(params) -> int:
    """Bytes of the parameter arrays (or their shapes) as stored: int8 values, scales, the rest."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class Int8Variant:
    """int8 weight-only serving as a variant: its flag (--quantize: none or int8), its help
    and its `Model` (`int8_variant`, which `easylm.variants.build` makes). Only a served
    model takes it: training refuses it in one line (an int8 base trains adapters:
    --lora.base_dtype=int8)."""

    section: str = "quantize"  # its flag: a value, not a section of fields
    prefix: str = "quantize"  # the flags it owns (run names, ignored flags)
    serves: bool = True  # the engine's commands (serve, eval) declare its flag

    def flags(self) -> str:
        return "none"

    def help(self) -> dict:
        return {"quantize": HELP}

    def selected(self, flags) -> bool:
        """Whether --quantize asks for int8; a value other than none and int8 is refused."""
        value = flags.get("quantize", "none")
        if value not in MODES:
            raise UserError(f"--quantize={value!r}: expected one of {', '.join(MODES)}")
        return value == "int8"

    def run_defaults(self, flags) -> dict:
        return {}

    def state_settings(self, flags: dict) -> dict:
        return {}  # never trained: a checkpoint's parameters mean nothing under it

    def refuse_training(self, flags) -> None:
        if self.selected(flags):
            raise UserError("--quantize=int8 stores a served model's weights in int8 (serve, "
                            "eval, bench decode, plan --plan.serve_tokens); a trained model "
                            "cannot be: for adapters on an int8 base give --lora.rank=R "
                            "--lora.base_dtype=int8")


INT8 = Int8Variant()


def int8_variant(family, config, dtype, model):
    """`model` (`family`'s float model of `config`, parameters in any float dtype) as its
    int8 weight-only `Model` computing in `dtype` (`--quantize=int8`): its parameters are
    the float model's, drawn (`init_params`) or read (`load`), then quantized on the
    devices. qwix quantizes the matmuls that read a module's own kernel, so the
    projections run unfused (the same parameters, the same numbers)."""
    unfused = config.unfused()
    int8 = Int8Model(family.module_class(unfused, dtype=dtype, param_dtype=dtype),
                     names=family.hf and family.hf.module_path)

    def apply(params, base, rng, collections, *args, **kwargs):
        del base, rng  # no frozen parameters, no dropout
        return int8.apply(params, *args, collections=collections, **kwargs)

    def load(spec, abstract):
        from easylm.models.family import abstract_params

        mesh = jax.tree.leaves(abstract)[0].sharding.mesh
        params = model.load(spec, abstract_params(model, mesh))
        return int8.quantize_sharded(params, model.partition_rules, mesh)

    return dataclasses.replace(
        family.bind(unfused, dtype, dtype), apply=apply,
        init_params=lambda rng: int8.quantize(model.init_params(rng)),
        partition_rules=partition_rules(model.partition_rules),
        load=load if model.load is not None else None)
