"""The mapping between easylm Gemma 4 parameters and transformers' `Gemma4ForCausalLM`
tensors.

Paths are HF's names with '/' for '.' (`hf_checkpoint.hf_key`), except:

    model/layers/<i>/layer_scalar (1,)            <->  model.layers.<i>.layer_scalar
    model/layers/<i>/router/kernel (D, E)         <->  model.layers.<i>.router.proj.weight (E, D)
    model/layers/<i>/router/{scale,per_expert_scale}  <->  the same names with '.'
    model/layers/<i>/experts/{gate,up}_proj (E, D, F) <->  experts.gate_up_proj (E, 2F, D),
                                                           gate's rows first
    model/layers/<i>/experts/down_proj (E, F, D)  <->  experts.down_proj (E, D, F)

A multimodal `gemma4` directory (Gemma4ForConditionalGeneration) holds the text model
under `model.language_model.`, beside vision and audio towers that are not loaded (one
line says so).
"""

from collections.abc import Iterator, Mapping

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.gemma4.config import Gemma4Config
from easylm.gemma4.model import Gemma4ForCausalLM
from easylm.models.decoder import relayout
from easylm.models.hf_checkpoint import (
    HFTensors,
    RenamedTensors,
    hf_key,
    read_config,
    to_numpy,
)
from easylm.runtime.dtypes import cast_names

DTYPES = cast_names(("bf16", "fp32"))
_TEXT_PREFIX = "model.language_model."
_LEAVES = ("layer_scalar", "router/scale", "router/per_expert_scale")  # stored as named
_EXPERTS = ("experts/gate_proj", "experts/up_proj", "experts/down_proj")


def param_shapes(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Parameter path -> shape (nothing allocated)."""
    shapes = jax.eval_shape(Gemma4ForCausalLM(config.replace(scan_layers=False)).init_params,
                            jax.random.PRNGKey(0))
    return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def _key(path: str) -> tuple[str, bool]:
    """A dense path's HF name and whether it is transposed (the experts aside)."""
    if path.endswith(_LEAVES):
        return path.replace("/", "."), False
    if path.endswith("router/kernel"):
        return path[:-len("kernel")].replace("/", ".") + "proj.weight", True
    return hf_key(path)


def to_hf(params, config: Gemma4Config) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy tensor) one at a time, as Gemma4ForCausalLM names them."""
    flat = traverse_util.flatten_dict(relayout(params, False), sep="/")
    get = lambda path: np.asarray(jax.device_get(flat[path]))
    for path in param_shapes(config):
        if path.endswith("experts/up_proj"):
            continue  # written with gate_proj
        if path.endswith("experts/gate_proj"):
            prefix = path[:-len("gate_proj")].replace("/", ".")
            up = get(path[:-len("gate_proj")] + "up_proj")
            yield prefix + "gate_up_proj", np.concatenate([get(path), up], -1).transpose(0, 2, 1)
        elif path.endswith("experts/down_proj"):
            yield path.replace("/", "."), get(path).transpose(0, 2, 1)
        else:
            key, transpose = _key(path)
            yield key, get(path).T if transpose else get(path)


def _read(tensors: Mapping, path: str, source: str) -> np.ndarray:
    """Our array at `path` from the HF tensors (an expert stack from its fused tensor)."""
    def read(key):
        if key not in tensors:
            raise UserError(f"{source} is missing tensor {key}")
        return to_numpy(tensors[key])

    if path.endswith(_EXPERTS):
        prefix = path[:path.rindex("experts/")].replace("/", ".") + "experts."
        if path.endswith("down_proj"):
            return read(prefix + "down_proj").transpose(0, 2, 1)
        fused = read(prefix + "gate_up_proj")  # (E, 2F, D), gate's rows first
        F = fused.shape[1] // 2
        return (fused[:, :F] if path.endswith("gate_proj") else fused[:, F:]).transpose(0, 2, 1)
    key, transpose = _key(path)
    return read(key).T if transpose else read(key)


def from_hf(tensors: Mapping, config: Gemma4Config, dtype=None, source: str = "checkpoint",
            place=None):
    """Our parameter tree from HF-named tensors; a missing, unexpected or misshapen tensor is
    a UserError naming it. `place` (e.g. jax.device_put) moves each as it is read."""
    shapes = param_shapes(config)
    expected = {_key(p)[0] for p in shapes if not p.endswith(_EXPERTS)}
    expected |= {p[:p.rindex("experts/")].replace("/", ".") + "experts." + name
                 for p in shapes if p.endswith("experts/gate_proj")
                 for name in ("gate_up_proj", "down_proj")}
    tied = config.tie_word_embeddings
    unexpected = [k for k in tensors if k not in expected and not (tied and k == "lm_head.weight")]
    if unexpected:
        raise UserError(f"{source} has {len(unexpected)} unexpected tensor(s): "
                        f"{', '.join(sorted(unexpected)[:8])}")
    flat = {}
    for path, shape in shapes.items():
        tensor = _read(tensors, path, source)
        if tensor.shape != shape:
            raise UserError(f"{source}: the tensor for {path} has shape {tensor.shape} (ours), "
                            f"but the config implies {shape}")
        tensor = np.ascontiguousarray(tensor if dtype is None else tensor.astype(dtype))
        flat[path] = tensor if place is None else place(tensor)
    return traverse_util.unflatten_dict(flat, sep="/")


def text_model(tensors: Mapping) -> RenamedTensors:
    """A multimodal checkpoint's language-model tensors under Gemma4ForCausalLM's names."""
    def rename(name):
        if name.startswith(_TEXT_PREFIX):
            return "model." + name[len(_TEXT_PREFIX):]
        return name if name == "lm_head.weight" else None
    return RenamedTensors(tensors, rename)


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    """(config, params) from a HF directory: numpy arrays, or what `place` makes of each."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = Gemma4Config.read_hf(directory)
    tensors = HFTensors(directory)
    if read_config(directory).get("model_type") == "gemma4":
        text = text_model(tensors)
        left = len(tensors) - len(text)
        if left:
            print(f"{directory}: the language model's tensors read; {left} tensors of the "
                  f"vision/audio towers and their projectors not loaded (text only)")
        tensors = text
    return config, from_hf(tensors, config, dtype=DTYPES[dtype], source=directory, place=place)
