"""Qwen3.5's image-text checkpoints (`Qwen3_5ForConditionalGeneration`, model_type
`qwen3_5` / `qwen3_5_moe`) both ways, and the family object that reads them (`FAMILY`,
--family=qwen3_5_vl).

Names: the text model's tensors are `model.language_model.*` (easylm/qwen3_5/hf.py maps
them as `model.*`) and `lm_head.weight`; the vision tower's are `model.visual.*`, our
`visual/...` with '/' for '.' (hf_checkpoint.hf_key), except

    visual/patch_embed/proj/kernel (C tp p p, D)  <->  model.visual.patch_embed.proj.weight
        (D, C, tp, p, p): a Conv3d whose stride is its kernel, one matmul per patch
"""

import os

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.models.family import HFAdapter, layout
from easylm.models.hf_checkpoint import (
    HFTensors,
    RenamedTensors,
    config_fields,
    hf_key,
    params_from_hf,
    read_config,
    to_numpy,
)
from easylm.qwen3_5 import hf as text_hf
from easylm.qwen3_5.config import from_hf_dict
from easylm.qwen3_5.family import Qwen35Family
from easylm.qwen3_5.images import Qwen35ImageChats, load_image_processor
from easylm.qwen3_5.vision import (
    HF_CLASSES,
    PARTITION_RULES,
    QWEN35_VL_PRESETS,
    UNTRAINED,
    Qwen35VLConfig,
    Qwen35VLForConditionalGeneration,
)

MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_VISUAL = "model.visual."
_CONV = "patch_embed.proj.weight"
# transformers' Qwen3_5VisionConfig defaults: what it assumes for a key the file omits.
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                       patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                       in_channels=3, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")
_VISION_INTS = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                "temporal_patch_size", "spatial_merge_size", "in_channels",
                "num_position_embeddings", "out_hidden_size")


def read_hf_config(directory: str) -> Qwen35VLConfig:
    """DIR/config.json of an image-text Qwen3.5 as a Qwen35VLConfig."""
    path = os.path.join(directory, "config.json")
    hf = read_config(directory)
    if hf.get("model_type") not in MODEL_TYPES:
        raise UserError(f"{path}: model_type {hf.get('model_type')!r} is not an image-text "
                        f"Qwen3.5 ({', '.join(MODEL_TYPES)}); --family=qwen3_5 reads text "
                        f"models")
    text = from_hf_dict(hf, path)
    vision = hf.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise UserError(f"{path}: vision_config must be an object, got {vision!r}")
    get = config_fields(vision, f"{path} vision_config",
                        dict(VISION_DEFAULTS, out_hidden_size=text.hidden_size), _VISION_INTS,
                        {"hidden_act": "gelu_pytorch_tanh"}, "this Qwen3.5 vision tower")
    if get("out_hidden_size") != text.hidden_size:
        raise UserError(f"{path}: vision_config.out_hidden_size={get('out_hidden_size')} must "
                        f"be the text model's hidden_size={text.hidden_size}")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise UserError(f"{path}: vision_config.rope_parameters.rope_type="
                        f"{rope['rope_type']!r} is not supported (axial is)")
    text_rope = (hf.get("text_config") or {}).get("rope_parameters") or {}
    sections = text_rope.get("mrope_section", [11, 11, 10])
    if text_rope.get("mrope_interleaved", True) is not True:
        raise UserError(f"{path}: text_config.rope_parameters.mrope_interleaved=false is not "
                        f"supported (Qwen3.5 interleaves its sections)")
    ids = {name: hf.get(name, default) for name, default in (
        ("image_token_id", 248056), ("video_token_id", 248057),
        ("vision_start_token_id", 248053), ("vision_end_token_id", 248054))}
    return Qwen35VLConfig(
        **text.to_dict(), **ids,
        mrope_section=",".join(str(int(s)) for s in sections),
        vision_depth=get("depth"), vision_hidden_size=get("hidden_size"),
        vision_intermediate_size=get("intermediate_size"), vision_num_heads=get("num_heads"),
        vision_patch_size=get("patch_size"),
        vision_temporal_patch_size=get("temporal_patch_size"),
        vision_spatial_merge_size=get("spatial_merge_size"),
        vision_in_channels=get("in_channels"),
        vision_num_position_embeddings=get("num_position_embeddings"),
        vision_rope_theta=float(rope.get("rope_theta", 10_000.0)))


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
    config = read_hf_config(directory)
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


def _read_params(directory: str, config: Qwen35VLConfig, dtype: str = "keep", place=None):
    return layout(FAMILY, load_hf_params(directory, dtype, place)[1], config)


class Qwen35VLFamily(Qwen35Family):
    """Qwen3.5's image-text model: the text family's layers, presets of its text model
    with the debug vision tower, the vision tower's rules and names."""

    name = "qwen3_5_vl"
    config_class = Qwen35VLConfig
    presets = QWEN35_VL_PRESETS
    module_class = Qwen35VLForConditionalGeneration
    variants = ()  # LoRA and int8: not yet for the image-text model (docs/vision.md)
    hf = HFAdapter(model_types=tuple(MODEL_TYPES), read_config=read_hf_config,
                   read_params=_read_params, write_params=to_hf)

    def partition_rules(self, config):
        return PARTITION_RULES

    def image_chats(self, config, directory):
        return Qwen35ImageChats(config, load_image_processor(directory))

    def untrained_parameters(self, config):
        return UNTRAINED[config.train_vision]


assert set(MODEL_TYPES.values()) == set(HF_CLASSES)
FAMILY = Qwen35VLFamily()
