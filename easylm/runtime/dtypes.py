"""The one table of dtype flag names: `--dtype`, `--param_dtype`, `--optimizer.state_dtype`,
`--checkpointer.float_dtype` and the converters' `--dtype` all read it."""

import math

import jax
import jax.numpy as jnp

from easylm.errors import UserError

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def dtype_from_flag(flag: str, name: str, allowed=tuple(DTYPES), auto: bool = True):
    """'bf16' -> jnp.bfloat16, for `--flag=name`; 'auto' (where allowed) is bf16 on GPU/TPU
    and fp32 on CPU (where bf16 matmuls are slow)."""
    if auto and name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name not in allowed:
        choices = (("auto",) if auto else ()) + tuple(allowed)
        raise UserError(f"--{flag}={name!r} is not one of {', '.join(choices)}")
    return DTYPES[name]


def nbytes(tree) -> int:
    """Bytes of the arrays (or ShapeDtypeStructs) of `tree` as a device stores them: sub-byte
    dtypes packed (a uint4 is half a byte; numpy's itemsize says 1)."""
    return sum(math.ceil(math.prod(x.shape) * bits(x.dtype) / 8) for x in jax.tree.leaves(tree))


def bits(dtype) -> int:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    return 8 * dtype.itemsize


def cast_names(names, keep: str = "keep") -> dict:
    """A cast flag's table: `keep` (no cast) and the given DTYPES names -> numpy dtype
    names."""
    return {keep: None, **{name: jnp.dtype(DTYPES[name]).name for name in names}}
