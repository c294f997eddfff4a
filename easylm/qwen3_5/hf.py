"""The mapping between easylm Qwen3.5 parameters and transformers' `Qwen3_5ForCausalLM`
tensors: our paths are HF's names with '/' for '.' (easylm/models/hf_checkpoint.py
`hf_key`, kernels transposed), except

    model/layers/0/linear_attn/A_log, dt_bias  <->  the same names with '.' (no .weight)
    model/layers/0/linear_attn/conv1d/kernel (W, F)  <->  ...conv1d.weight (F, 1, W)
    model/layers/0/mlp/router/kernel (D, E)  <->  model.layers.0.mlp.gate.weight (E, D)
    model/layers/0/mlp/experts/gate_proj (E, D, F)  <->  ...mlp.experts.<e>.gate_proj.weight
        (F, D) per expert (up_proj alike; down_proj (E, F, D) <-> (D, F)): what
        transformers 5's save_pretrained writes. Its in-memory fused layout,
        ...mlp.experts.gate_up_proj (E, 2F, D) gate rows first and ...experts.down_proj
        (E, D, F), is read too.

A multimodal `qwen3_5` directory (Qwen3_5ForConditionalGeneration) keeps the text model's
tensors under `model.language_model.` beside its vision tower (`model.visual.`), which
this model does not load (the read says so in one line). Multi-token-prediction tensors
(`mtp.`), which transformers does not load either, are skipped.
"""

import sys
from collections.abc import Iterator, Mapping

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.models.decoder import relayout
from easylm.models.hf_checkpoint import (
    HFTensors,
    RenamedTensors,
    hf_key,
    some,
    to_numpy,
)
from easylm.qwen3_5.config import Qwen35Config
from easylm.qwen3_5.model import Qwen35ForCausalLM
from easylm.runtime.dtypes import cast_names

DTYPES = cast_names(("bf16", "fp32"))
_TEXT_PREFIX = "model.language_model."
_SKIPPED = ("model.visual.", "mtp.")


def param_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Parameter path -> shape (layers one by one), from eval_shape (nothing allocated)."""
    module = Qwen35ForCausalLM(config.replace(scan_layers=False))
    shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def hf_name(path: str) -> tuple[str, bool]:
    """Our path -> (HF tensor name, whether to transpose)."""
    *module, leaf = path.split("/")
    if leaf in ("A_log", "dt_bias"):
        return ".".join(module + [leaf]), False
    if module[-1:] == ["experts"]:  # a stack: one tensor per expert (see to_hf)
        return ".".join(module + [leaf]), True
    if module[-2:] == ["mlp", "router"]:
        return ".".join(module[:-1] + ["gate", "weight"]), True
    return hf_key(path)


def to_hf(params, config: Qwen35Config) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy tensor) one at a time (scanned layers unstacked first)."""
    flat = traverse_util.flatten_dict(relayout(params, False), sep="/")
    for path in param_shapes(config):
        tensor = np.asarray(jax.device_get(flat[path]))
        if "/mlp/experts/" in path:
            prefix, leaf = hf_name(path)[0].rsplit(".", 1)
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.{leaf}.weight", tensor[e].T
            continue
        name, transpose = hf_name(path)
        tensor = tensor.T if transpose else tensor
        yield name, (tensor[:, None, :] if path.endswith("conv1d/kernel") else tensor)


def _read_experts(tensors: Mapping, path: str, experts: int, source: str):
    """(our (E, ...) stack at mlp/experts/<leaf>, the HF names read), per expert or fused."""
    prefix, leaf = hf_name(path)[0].rsplit(".", 1)  # model.layers.<i>.mlp.experts, gate_proj
    fused = f"{prefix}.gate_up_proj" in tensors
    names = ([f"{prefix}.{'down_proj' if leaf == 'down_proj' else 'gate_up_proj'}"] if fused
             else [f"{prefix}.{e}.{leaf}.weight" for e in range(experts)])
    missing = [name for name in names if name not in tensors]
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensor(s): {some(missing)}")
    if not fused:
        return np.stack([to_numpy(tensors[name]).T for name in names]), names
    tensor = to_numpy(tensors[names[0]])
    F = tensor.shape[1] // 2
    part = {"gate_proj": tensor[:, :F], "up_proj": tensor[:, F:]}.get(leaf, tensor)
    return np.ascontiguousarray(part.transpose(0, 2, 1)), names


def from_hf(tensors: Mapping, config: Qwen35Config, dtype=None, source: str = "checkpoint",
            place=None):
    """Our parameter tree from HF-named tensors; missing, unexpected or misshapen tensors
    are UserErrors that name them."""
    shapes = param_shapes(config)
    stacks = [path for path in shapes if "/mlp/experts/" in path]
    expected = {hf_name(path)[0]: path for path in shapes if path not in stacks}
    tied = config.tie_word_embeddings  # transformers may store the tied head too
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensor(s): {some(missing)}")
    flat, read = {}, set(expected)
    for path in stacks:
        flat[path], names = _read_experts(tensors, path, config.num_experts, source)
        read.update(names)
    unexpected = [name for name in tensors if name not in read
                  and not (tied and name == "lm_head.weight")]
    if unexpected:
        raise UserError(f"{source} has {len(unexpected)} unexpected tensor(s): "
                        f"{some(unexpected)}")
    for name, path in expected.items():
        tensor = to_numpy(tensors[name])
        if path.endswith("conv1d/kernel") and tensor.ndim == 3:
            tensor = tensor[:, 0, :]  # (F, 1, W) -> (F, W), transposed below
        if hf_name(path)[1] or path.endswith("conv1d/kernel"):
            tensor = np.ascontiguousarray(tensor.T)
        flat[path] = tensor
    for path, tensor in flat.items():
        if tensor.shape != shapes[path]:
            raise UserError(f"{source}: the tensor(s) of {path} have shape {tensor.shape} as "
                            f"we lay them out, but the config implies {shapes[path]}")
        tensor = tensor if dtype is None else tensor.astype(dtype)
        flat[path] = tensor if place is None else place(tensor)
    return traverse_util.unflatten_dict(flat, sep="/")


def _text_name(name: str) -> str | None:
    """A stored tensor's name under Qwen3_5ForCausalLM's: a multimodal checkpoint's
    `model.language_model.*` as `model.*`; the vision tower and the multi-token-prediction
    head left out."""
    if name.startswith(_SKIPPED):
        return None
    return "model." + name[len(_TEXT_PREFIX):] if name.startswith(_TEXT_PREFIX) else name


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    """(config, params) from a HF directory: numpy arrays, or what `place` makes of each."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = Qwen35Config.read_hf(directory)
    tensors = HFTensors(directory)
    if any(name.startswith("model.visual.") for name in tensors):
        print(f"{directory}: the vision tower (model.visual.*) is not loaded: easylm's "
              f"Qwen3.5 is the text model", file=sys.stderr)
    return config, from_hf(RenamedTensors(tensors, _text_name), config, dtype=DTYPES[dtype], source=directory,
                           place=place)
