"""The mapping between easylm Gemma parameters and HF `Gemma3ForCausalLM` tensors.

Our parameter paths are HF's names with '/' for '.' (easylm/models/hf_checkpoint.py
`hf_key`), so the mapping is a rule:

    model/layers/3/self_attn/q_proj/kernel  <->  model.layers.3.self_attn.q_proj.weight (transposed)
    model/layers/3/pre_feedforward_layernorm/weight  <->  the same name with '.'
    model/embed_tokens/embedding            <->  model.embed_tokens.weight

A multimodal `gemma3` directory (Gemma3ForConditionalGeneration) holds the same text
tensors under `model.language_model.` (transformers >= 4.52) or `language_model.model.`
(the released files), beside a vision tower and projector that this model has no use for.
"""

from collections.abc import Iterator, Mapping

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.gemma.config import GemmaConfig
from easylm.gemma.model import GemmaForCausalLM
from easylm.models.decoder import relayout
from easylm.models.hf_checkpoint import (
    HFTensors,
    RenamedTensors,
    hf_key,
    params_from_hf,
    read_config,
)
from easylm.runtime.dtypes import cast_names

DTYPES = cast_names(("bf16", "fp32"))  # what a conversion may store
# Where each layout of a multimodal checkpoint keeps the text model's `model.` tensors.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def param_shapes(config: GemmaConfig) -> dict[str, tuple[int, ...]]:
    """Unscanned parameter path -> shape (the HF names are per layer), from eval_shape
    (nothing allocated)."""
    shapes = jax.eval_shape(GemmaForCausalLM(config.replace(scan_layers=False)).init_params,
                            jax.random.PRNGKey(0))
    return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def to_hf(params, config: GemmaConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy tensor) one at a time, in Gemma3ForCausalLM's names (scanned
    layers unstacked first)."""
    flat = traverse_util.flatten_dict(relayout(params, False), sep="/")
    for path in param_shapes(config):
        key, transpose = hf_key(path)
        tensor = np.asarray(jax.device_get(flat[path]))
        yield key, (tensor.T if transpose else tensor)


def from_hf(tensors: Mapping, config: GemmaConfig, dtype=None, source: str = "checkpoint",
            place=None):
    """Our parameter tree from HF-named tensors; missing, unexpected or misshapen tensors
    are UserErrors that name them (`easylm.models.hf_checkpoint.params_from_hf`)."""
    tied = config.tie_word_embeddings  # transformers may store the tied head too
    flat = params_from_hf(tensors, param_shapes(config), source, dtype, place,
                          ignored=lambda key: tied and key == "lm_head.weight")
    return traverse_util.unflatten_dict(flat, sep="/")


def _text_name(name: str) -> str | None:
    """A stored tensor's name under Gemma3ForCausalLM's: a multimodal checkpoint's text
    model as the text-only one's; the vision tower's and the projector's left out."""
    if name.startswith(_VISION_PREFIXES):
        return None
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    if prefix is not None:
        return "model." + name[len(prefix):]
    return "lm_head.weight" if name == "language_model.lm_head.weight" else name


def text_tower(tensors: Mapping) -> RenamedTensors:
    """A multimodal checkpoint's text-model tensors under Gemma3ForCausalLM's names."""
    return RenamedTensors(tensors, _text_name)


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    """(config, params) from a HF directory: numpy arrays, or what `place` makes of each."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = GemmaConfig.read_hf(directory)
    tensors = HFTensors(directory)
    if read_config(directory).get("model_type") == "gemma3":
        tensors = text_tower(tensors)
    return config, from_hf(tensors, config, dtype=DTYPES[dtype], source=directory, place=place)
