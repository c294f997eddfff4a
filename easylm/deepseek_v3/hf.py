"""The mapping between easylm DeepSeek-V3 parameters and transformers' `DeepseekV3ForCausalLM`
tensors: easylm/models/sigmoid_moe_hf.py's (the experts one tensor per expert as
save_pretrained writes them, the router as mlp.gate, the correction bias kept fp32,
multi-token-prediction layers skipped), over DeepSeek-V3's parameters.

A multimodal `kimi_k25` directory (Kimi K2.5, Kimi_K25ForConditionalGeneration) holds the
same text model under `model.language_model.` and `lm_head.` (as transformers holds it) or
`language_model.model.` and `language_model.lm_head.` (the released files, and what
transformers 5.25 writes, its layers as `blocks`), beside a vision tower and projector
that are not loaded (one line says so). It is written back as the DeepSeek-V3 text model
it is (`DeepseekV3ForCausalLM`).

A `mistral4` directory (Mistral4ForCausalLM) holds each layer's experts fused, as
transformers 5 saves them for it: `mlp.experts.gate_up_proj` (E, 2F, D), gate's rows first,
and `mlp.experts.down_proj` (E, D, F); they are read and written so."""

import functools

from easylm.deepseek_v3.config import DeepseekV3Config
from easylm.deepseek_v3.model import DeepseekV3ForCausalLM
from easylm.errors import UserError
from easylm.models import sigmoid_moe_hf
from easylm.models.hf_checkpoint import (HFTensors, PerExpertTensors, RenamedTensors,
                                         fuse_experts, read_config)



def to_hf(params, config: DeepseekV3Config):
    """(HF name, tensor) pairs; mistral4's experts fused, as Mistral4ForCausalLM loads them
    (transformers converts per-expert tensors for deepseek_v3 only)."""
    named = sigmoid_moe_hf.to_hf(params, config, lm=DeepseekV3ForCausalLM)
    return fuse_experts(named) if config.model_type == "mistral4" else named


from_hf = functools.partial(sigmoid_moe_hf.from_hf, lm=DeepseekV3ForCausalLM)
_TEXT = (("model.language_model.", "model."), ("language_model.model.", "model."),
         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def _text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under DeepseekV3ForCausalLM's name; None: a tower's.
    transformers reads `blocks` as `layers` in every name of such a checkpoint (and writes
    the language model's layers back as `blocks`), and so do we."""
    name = next((ours + name[len(theirs):] for theirs, ours in _TEXT
                 if name.startswith(theirs)), None)
    return None if name is None else name.replace("model.blocks.", "model.layers.", 1)


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    """(config, parameters) of a deepseek_v3 or mistral4 directory (its experts per expert
    or fused: `PerExpertTensors`), or of a kimi_k25's text model."""
    if dtype not in sigmoid_moe_hf.DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(sigmoid_moe_hf.DTYPES)}")
    config = DeepseekV3Config.read_hf(directory)
    tensors = text = HFTensors(directory)
    if read_config(directory).get("model_type") == "kimi_k25":
        text = RenamedTensors(tensors, _text_name)
        print(f"{directory}: the language model's tensors read; {len(tensors) - len(text)} "
              f"tensors of the vision tower and its projector not loaded (text only)")
    return config, from_hf(PerExpertTensors(text), config, dtype=sigmoid_moe_hf.DTYPES[dtype],
                           source=directory, place=place)
