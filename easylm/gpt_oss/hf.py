"""The mapping between easylm gpt-oss parameters and HF `GptOssForCausalLM` tensors.

Attention, norms, the router and the embeddings map by the rule of
easylm/models/hf_checkpoint.py (`hf_key`: '/' for '.', kernels transposed); the sinks
keep their name. The experts are stored fused, as transformers holds them:

    mlp/experts/gate_proj, up_proj (E, D, F)  <->  mlp.experts.gate_up_proj (E, D, 2F),
                                                   gate in the even columns, up in the odd
    mlp/experts/gate_proj_bias, up_proj_bias  <->  mlp.experts.gate_up_proj_bias (E, 2F)
    mlp/experts/down_proj (E, F, D), down_proj_bias (E, D)  <->  the same names, as they are

The released checkpoints store the experts' matrices in MXFP4 (config.json's
`quantization_config.quant_method == "mxfp4"`): `<name>_blocks` (E, out, in/32, 16) uint8,
two 4-bit e2m1 codes a byte (the low nibble first), and `<name>_scales` (E, out, in/32)
uint8, a power of two 2^(s - 127) per 32 values. They are dequantized on reading
(`Mxfp4Tensors`), exactly: every fp4 value times a power of two is a float32 (and bf16).
"""

import os
from collections.abc import Iterator, Mapping

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.gpt_oss.config import GptOssConfig
from easylm.gpt_oss.model import GptOssForCausalLM
from easylm.models.decoder import relayout
from easylm.models.hf_checkpoint import HFTensors, hf_key, read_config, some, to_numpy
from easylm.runtime.dtypes import cast_names

DTYPES = cast_names(("bf16", "fp32"))  # what a conversion may store
# transformers' integrations/mxfp4.py FP4_VALUES: e2m1 codes 0..15 (bit 3 the sign).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_FUSED = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
          "gate_proj_bias": "gate_up_proj_bias", "up_proj_bias": "gate_up_proj_bias"}


def param_shapes(config: GptOssConfig) -> dict[str, tuple[int, ...]]:
    """Parameter path -> shape (layers one by one), from eval_shape (nothing allocated)."""
    module = GptOssForCausalLM(config.replace(scan_layers=False))
    shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def hf_name(path: str) -> tuple[str, bool]:
    """Our path -> (HF tensor name, whether to transpose); gate and up share a fused name."""
    *module, leaf = path.split("/")
    if module[-1:] == ["experts"]:
        return ".".join(module + [_FUSED.get(leaf, leaf)]), False
    if leaf == "sinks":
        return ".".join(module + [leaf]), False
    return hf_key(path)


def _half(path: str) -> int | None:
    """Which columns of the fused tensor a path holds: 0 (gate, even), 1 (up, odd), None."""
    leaf = path.rsplit("/", 1)[-1]
    return {"gate_proj": 0, "gate_proj_bias": 0, "up_proj": 1, "up_proj_bias": 1}.get(leaf)


def to_hf(params, config: GptOssConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy tensor) in GptOssForCausalLM's names, the experts' gate and
    up interleaved into gate_up_proj (scanned layers unstacked first)."""
    flat = traverse_util.flatten_dict(relayout(params, False), sep="/")
    for path in param_shapes(config):
        name, transpose = hf_name(path)
        tensor = np.asarray(jax.device_get(flat[path]))
        half = _half(path)
        if half == 1:
            continue  # written with its gate
        if half == 0:
            up = np.asarray(jax.device_get(flat[path.replace("gate_proj", "up_proj")]))
            fused = np.empty(tensor.shape[:-1] + (2 * tensor.shape[-1],), tensor.dtype)
            fused[..., 0::2], fused[..., 1::2] = tensor, up
            tensor = fused
        yield name, (tensor.T if transpose else tensor)


def from_hf(tensors: Mapping, config: GptOssConfig, dtype=None, source: str = "checkpoint",
            place=None):
    """Our parameter tree from HF-named tensors; missing, unexpected or misshapen tensors
    are UserErrors that name them."""
    shapes = param_shapes(config)
    names = {hf_name(path)[0] for path in shapes}
    tied = config.tie_word_embeddings
    missing = sorted(stored for name in names for stored in _absent(tensors, name))
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensor(s): {some(missing)}")
    unexpected = [name for name in tensors
                  if name not in names and not (tied and name == "lm_head.weight")]
    if unexpected:
        raise UserError(f"{source} has {len(unexpected)} unexpected tensor(s): "
                        f"{some(unexpected)}")
    flat = {}
    for path, shape in shapes.items():
        name, transpose = hf_name(path)
        tensor = to_numpy(tensors[name])
        tensor = np.ascontiguousarray(tensor.T) if transpose else tensor
        half = _half(path)
        want = shape if half is None else shape[:-1] + (2 * shape[-1],)
        if tensor.shape != want:
            raise UserError(f"{source}: tensor {name} has shape "
                            f"{tensor.shape[::-1] if transpose else tensor.shape}, but the "
                            f"config implies {want[::-1] if transpose else want}")
        if half is not None:
            tensor = np.ascontiguousarray(tensor[..., half::2])
        tensor = tensor if dtype is None else tensor.astype(dtype)
        flat[path] = tensor if place is None else place(tensor)
    return traverse_util.unflatten_dict(flat, sep="/")


def _absent(tensors: Mapping, name: str) -> list[str]:
    """The names, as the files spell them, that `name` lacks: a user looks for those."""
    if name in tensors:
        return []
    return tensors.absent(name) if isinstance(tensors, Mxfp4Tensors) else [name]


def dequantize_mxfp4(blocks, scales) -> np.ndarray:
    """MXFP4 (blocks (..., out, G, 16) uint8, scales (..., out, G) uint8) -> float32
    (..., G * 32, out): transformers' `convert_moe_packed_tensors`, so (E, in, out)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    values = values.reshape(*blocks.shape[:-2], -1)  # (..., out, in)
    return np.swapaxes(values, -1, -2)


class Mxfp4Tensors(Mapping):
    """An MXFP4 checkpoint's tensors with each `<name>_blocks`/`<name>_scales` pair read
    as the dequantized `<name>` (float32)."""

    def __init__(self, tensors: Mapping):
        self.tensors = tensors
        self.names = [name for name in tensors if not name.endswith(("_blocks", "_scales"))]
        self.names += [name[:-len("_blocks")] for name in tensors if name.endswith("_blocks")]

    def __getitem__(self, name):
        if name in self.tensors:
            return self.tensors[name]
        if name + "_blocks" not in self.tensors or name + "_scales" not in self.tensors:
            raise KeyError(name)
        return dequantize_mxfp4(self.tensors[name + "_blocks"], self.tensors[name + "_scales"])

    def absent(self, name: str) -> list[str]:
        """What is missing of a pair whose other half is stored (`<name>_scales` beside its
        `_blocks`); `name` itself where neither is (it may be stored unquantized)."""
        pair = [name + "_blocks", name + "_scales"]
        lacking = [stored for stored in pair if stored not in self.tensors]
        return lacking if len(lacking) == 1 else [name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def hf_tensors(directory: str) -> Mapping:
    """DIR's tensors by HF name, MXFP4 experts dequantized; another quantization refused."""
    quantization = read_config(directory).get("quantization_config")
    if quantization is None:
        return HFTensors(directory)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != "mxfp4":
        raise UserError(f"{os.path.join(directory, 'config.json')}: quantization_config."
                        f"quant_method {method!r} is not readable (supported: mxfp4, or none)")
    return Mxfp4Tensors(HFTensors(directory))


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    """(config, params) from a HF directory: numpy arrays, or what `place` makes of each."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = GptOssConfig.read_hf(directory)
    return config, from_hf(hf_tensors(directory), config, dtype=DTYPES[dtype], source=directory,
                           place=place)
