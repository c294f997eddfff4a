"""The one mapping between easylm LLaMA parameters and HF `LlamaForCausalLM` tensors.

Our parameter paths are HF's names with '/' for '.', so the mapping is a rule:

    model/layers/3/self_attn/q_proj/kernel  <->  model.layers.3.self_attn.q_proj.weight (transposed)
    model/embed_tokens/embedding            <->  model.embed_tokens.weight
    model/norm/weight                       <->  model.norm.weight

Flax Dense kernels are (in, out); torch Linear weights are (out, in). Both
directions work tensor by tensor, so converters can stream.
"""

from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.hf_checkpoint import to_numpy  # noqa: F401  (also imported from here)
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import LLaMAForCausalLM, stack_layers

# Tensors HF checkpoints may carry that hold no parameter of ours.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_key(path: str) -> tuple[str, bool]:
    """Our '/'-joined parameter path -> (HF tensor name, whether to transpose)."""
    *module, leaf = path.split("/")
    return ".".join(module + ["weight"]), leaf == "kernel"


def param_shapes(config: LLaMAConfig) -> dict[str, tuple[int, ...]]:
    """Unscanned parameter path -> shape, from eval_shape (nothing allocated)."""
    model = LLaMAForCausalLM(config.replace(scan_layers=False))
    shapes = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def to_hf(params, config: LLaMAConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy tensor) one at a time, unstacking scanned layers lazily."""
    flat = traverse_util.flatten_dict(params, sep="/")
    for path in param_shapes(config):
        key, transpose = hf_key(path)
        if config.scan_layers and path.startswith("model/layers/"):
            _, _, index, rest = path.split("/", 3)
            tensor = flat[f"model/layers/{rest}"][int(index)]
        else:
            tensor = flat[path]
        tensor = np.asarray(jax.device_get(tensor))
        yield key, (tensor.T if transpose else tensor)


def from_hf(tensors: Mapping[str, Any], config: LLaMAConfig, dtype=None, source: str = "checkpoint",
            place: Callable[[np.ndarray], Any] | None = None):
    """Build our parameter tree from HF-named tensors (numpy, torch, or anything array-like).

    Missing tensors, unexpected tensors and shape mismatches are UserErrors that name
    them. `place` (e.g. `jax.device_put`) moves each tensor as soon as it is converted,
    so that the host copy can be freed before the next one is read.
    """
    shapes = param_shapes(config)
    expected = {hf_key(path)[0]: path for path in shapes}
    missing = [key for key in expected if key not in tensors]
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensor(s): {_some(missing)}")
    unexpected = [
        key for key in tensors
        if key not in expected
        and not key.endswith(_IGNORED_HF_SUFFIXES)
        and not (config.tie_word_embeddings and key == "lm_head.weight")
    ]
    if unexpected:
        raise UserError(f"{source} has {len(unexpected)} unexpected tensor(s): {_some(unexpected)}")
    flat = {}
    for key, path in expected.items():
        tensor = to_numpy(tensors[key])
        _, transpose = hf_key(path)
        if transpose:  # `place` copies anyway: no contiguous host copy first
            tensor = tensor.T if place else np.ascontiguousarray(tensor.T)
        if tensor.shape != shapes[path]:
            want = shapes[path][::-1] if transpose else shapes[path]
            got = tensor.shape[::-1] if transpose else tensor.shape
            raise UserError(f"{source}: tensor {key} has shape {got}, but the config implies {want}")
        tensor = tensor if dtype is None else tensor.astype(dtype)
        flat[path] = tensor if place is None else place(tensor)
        del tensor
    params = traverse_util.unflatten_dict(flat, sep="/")
    if config.scan_layers:
        params = stack_layers(params, config.num_hidden_layers)
    return params


def _some(names, limit: int = 8) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
