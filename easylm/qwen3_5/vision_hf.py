"""Qwen3.5's image-text checkpoints (`Qwen3_5ForConditionalGeneration`, model_type
`qwen3_5` / `qwen3_5_moe`) both ways, and the family object that reads them (`FAMILY`,
--family=qwen3_5_vl).

Names: the text model's tensors are `model.language_model.*` (easylm/qwen3_5/hf.py maps
them as `model.*`) and `lm_head.weight`; the vision tower's are `model.visual.*`, our
`visual/...` with '/' for '.' (hf_checkpoint.hf_key), except

    visual/patch_embed/proj/kernel (C tp p p, D)  <->  model.visual.patch_embed.proj.weight
        (D, C, tp, p, p): a Conv3d whose stride is its kernel, one matmul per patch
"""

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.models.family import HFAdapter, hf_params_reader
from easylm.models.hf_checkpoint import (
    HFTensors,
    RenamedTensors,
    hf_key,
    params_from_hf,
    to_numpy,
)
from easylm.models.vision import load_image_processor
from easylm.qwen3_5 import hf as text_hf
from easylm.qwen3_5.config import MULTIMODAL
from easylm.qwen3_5.family import Qwen35Family
from easylm.qwen3_5.images import Qwen35ImageChats
from easylm.qwen3_5.vision import (
    PARTITION_RULES,
    QWEN35_VL_PRESETS,
    UNTRAINED,
    Qwen35VLConfig,
    Qwen35VLForConditionalGeneration,
)

_VISUAL = "model.visual."
_CONV = "patch_embed.proj.weight"


def vision_shapes(config: Qwen35VLConfig) -> dict[str, tuple[int, ...]]:
    """The vision tower's parameter paths (under visual/, without it) -> shapes."""
    module = Qwen35VLForConditionalGeneration(config.replace(scan_layers=False))
    shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))["visual"]
    return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


class _VisionTensors(RenamedTensors):
    """model.visual.* under the vision tower's own names, its Conv3d as a matmul's (D, E)."""

    def __init__(self, tensors):
        super().__init__(tensors, lambda n: n[len(_VISUAL):] if n.startswith(_VISUAL) else None)

    def __getitem__(self, name):
        tensor = super().__getitem__(name)
        return to_numpy(tensor).reshape(tensor.shape[0], -1) if name == _CONV else tensor


def from_hf(tensors, config: Qwen35VLConfig, dtype=None, source="checkpoint", place=None):
    """Our parameter tree (both towers) from an image-text checkpoint's tensors; missing,
    unexpected or misshapen tensors are UserErrors that name them."""
    text = text_hf.from_hf(RenamedTensors(tensors, _text_name), config, dtype, source, place)
    flat = params_from_hf(_VisionTensors(tensors), vision_shapes(config), source, dtype, place)
    return {**text, "visual": traverse_util.unflatten_dict(flat, sep="/")}


def _text_name(name: str) -> str | None:
    """A text model's tensor under Qwen3_5ForCausalLM's name; the vision tower's left to
    the vision reader (and `mtp.`, which transformers does not load either)."""
    if name.startswith((_VISUAL, "mtp.")):
        return None
    return "model." + name[len("model.language_model."):] if name.startswith(
        "model.language_model.") else name


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    if dtype not in text_hf.DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(text_hf.DTYPES)}")
    config = Qwen35VLConfig.read_hf(directory)
    return config, from_hf(HFTensors(directory), config, text_hf.DTYPES[dtype], directory,
                           place)


def to_hf(params, config: Qwen35VLConfig):
    """(HF name, numpy tensor) of both towers, as Qwen3_5ForConditionalGeneration names them."""
    for name, tensor in text_hf.to_hf({k: v for k, v in params.items() if k != "visual"},
                                      config):
        yield ("model.language_model." + name[len("model."):]
               if name.startswith("model.") else name), tensor
    flat = traverse_util.flatten_dict(params["visual"], sep="/")
    for path in vision_shapes(config):
        tensor = np.asarray(jax.device_get(flat[path]))
        name, transpose = hf_key(path)
        tensor = tensor.T if transpose else tensor
        if name == _CONV:
            c = config
            tensor = tensor.reshape(c.vision_hidden_size, c.vision_in_channels,
                                    c.vision_temporal_patch_size, c.vision_patch_size,
                                    c.vision_patch_size)
        yield _VISUAL + name, tensor


class Qwen35VLFamily(Qwen35Family):
    """Qwen3.5's image-text model: the text family's layers, presets of its text model
    with the debug vision tower, the vision tower's rules and names."""

    name = "qwen3_5_vl"
    config_class = Qwen35VLConfig
    presets = QWEN35_VL_PRESETS
    module_class = Qwen35VLForConditionalGeneration
    # LoRA: the text model's projections (the text family's), and the vision side
    # train_vision names (its config's `lora_targets`); int8 serving not yet
    # (docs/vision.md).
    variants = ("lora",)
    hf = HFAdapter(model_types=tuple(MULTIMODAL), read_config=Qwen35VLConfig.read_hf,
                   read_params=hf_params_reader(load_hf_params,
                                                Qwen35VLForConditionalGeneration),
                   write_params=to_hf,
                   module_prefixes=(("model/", "model/language_model/"),
                                    ("visual/", "model/visual/")))

    def partition_rules(self, config):
        return PARTITION_RULES

    def image_chats(self, config, directory):
        return Qwen35ImageChats(config, load_image_processor(directory))

    def untrained_parameters(self, config):
        return UNTRAINED[config.train_vision]


FAMILY = Qwen35VLFamily()
