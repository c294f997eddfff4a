"""Gemma 4's image-text checkpoints (`Gemma4ForConditionalGeneration`, model_type `gemma4`
with a vision_config) both ways, and the family object that reads them (`FAMILY`,
--family=gemma4_vl).

Names: the text model's tensors are `model.language_model.*` (easylm/gemma4/hf.py maps
them as `model.*`); the vision tower's and the projector's are `model.vision_tower.*` and
`model.embed_vision.*`, our paths with '.' for '/' (hf_checkpoint.hf_key), except the
leaves that are tensors of their own, not a module's weight:

    vision_tower/patch_embedder/position_embedding_table (2, S, D)
    vision_tower/std_bias, vision_tower/std_scale (D,)        (vision_standardize)

An audio tower's tensors (`model.audio_tower.*`, `model.embed_audio.*`) are not read (one
line says so) and not written: the export is an image-text model.
"""

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.gemma4 import hf as text_hf
from easylm.gemma4.family import Gemma4Family
from easylm.gemma4.vision import (
    GEMMA4_VL_PRESETS,
    Gemma4VLConfig,
    Gemma4VLForConditionalGeneration,
    partition_rules,
)
from easylm.gemma4.images import Gemma4ImageChats
from easylm.models.family import SERVED, HFAdapter, hf_params_reader
from easylm.models.vision import load_image_processor
from easylm.models.hf_checkpoint import HFTensors, RenamedTensors, hf_key, params_from_hf

_TOWERS = ("model.vision_tower.", "model.embed_vision.")
_AUDIO = ("model.audio_tower.", "model.embed_audio.")
_LEAVES = ("position_embedding_table", "std_bias", "std_scale")


def vision_shapes(config: Gemma4VLConfig) -> dict[str, tuple[int, ...]]:
    """The vision tower's and the projector's parameter paths -> shapes."""
    module = Gemma4VLForConditionalGeneration(config.replace(scan_layers=False))
    shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    return {path: leaf.shape
            for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()
            if path.startswith(("vision_tower/", "embed_vision/"))}


def vision_key(path: str) -> tuple[str, bool]:
    """A tower path's HF name (less `model.`) and whether it is transposed."""
    if path.endswith(_LEAVES):
        return path.replace("/", "."), False
    return hf_key(path)


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    """(config, params of both towers) from DIR; missing, unexpected or misshapen tensors
    are UserErrors that name them."""
    if dtype not in text_hf.DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(text_hf.DTYPES)}")
    config = Gemma4VLConfig.read_hf(directory)
    tensors = HFTensors(directory)
    audio = [name for name in tensors if name.startswith(_AUDIO)]
    if audio:
        print(f"{directory}: {len(audio)} tensors of the audio tower and its projector not "
              f"loaded (image-text model)")
    cast = text_hf.DTYPES[dtype]
    params = text_hf.from_hf(text_hf.text_model(tensors), config, cast, directory, place)
    towers = RenamedTensors(tensors, lambda name: name[len("model."):]
                            if name.startswith(_TOWERS) else None)
    flat = params_from_hf(towers, vision_shapes(config), directory, cast, place,
                          name_of=vision_key)
    return config, {**params, **traverse_util.unflatten_dict(flat, sep="/")}


def to_hf(params, config: Gemma4VLConfig):
    """(HF name, numpy tensor) of both towers, as Gemma4ForConditionalGeneration names them."""
    text = {k: v for k, v in params.items() if k not in ("vision_tower", "embed_vision")}
    for name, tensor in text_hf.to_hf(text, config):
        yield ("model.language_model." + name[len("model."):]
               if name.startswith("model.") else name), tensor
    flat = traverse_util.flatten_dict(params, sep="/")
    for path in vision_shapes(config):
        tensor = np.asarray(jax.device_get(flat[path]))
        name, transpose = vision_key(path)
        yield "model." + name, tensor.T if transpose else tensor


class Gemma4VLFamily(Gemma4Family):
    """Gemma 4's image-text model: the text family's layers, a preset of its text model
    with a debug vision tower, the vision tower's rules and names."""

    name = "gemma4_vl"
    config_class = Gemma4VLConfig
    presets = GEMMA4_VL_PRESETS
    module_class = Gemma4VLForConditionalGeneration
    variants = ()  # LoRA and int8 wait for the commands to take the family
    hf = HFAdapter(model_types=("gemma4",), read_config=Gemma4VLConfig.read_hf,
                   read_params=hf_params_reader(load_hf_params,
                                                Gemma4VLForConditionalGeneration),
                   write_params=to_hf)

    not_in_commands = SERVED + ("but images do not reach the data or the trainer yet "
                                "(docs/vision.md); --family=gemma4 trains its text model")

    def partition_rules(self, config):
        return partition_rules(config)

    def image_chats(self, config, directory):
        return Gemma4ImageChats(config, load_image_processor(directory))


FAMILY = Gemma4VLFamily()
