"""The one mapping between easylm LLaMA parameters and HF `LlamaForCausalLM` tensors
(and those of its variants Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM,
which use the same names).

Our parameter paths are HF's names with '/' for '.', so the mapping is a rule:

    model/layers/3/self_attn/q_proj/kernel  <->  model.layers.3.self_attn.q_proj.weight (transposed)
    model/layers/3/self_attn/q_proj/bias    <->  model.layers.3.self_attn.q_proj.bias
    model/layers/3/self_attn/q_norm/weight  <->  model.layers.3.self_attn.q_norm.weight
    model/embed_tokens/embedding            <->  model.embed_tokens.weight
    model/norm/weight                       <->  model.norm.weight

Flax Dense kernels are (in, out); torch Linear weights are (out, in). Both
directions work tensor by tensor, so converters can stream.

LoRA adapters map to PEFT's names by the same rule (easylm/variants/adapters.py).
"""

import os
import re
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.llama.config import ARCHITECTURES, MOE_TYPES, NOT_BUILT, LLaMAConfig
from easylm.llama.model import LLaMAForCausalLM
from easylm.models.decoder import period, relayout, stack_layers
from easylm.models.hf_checkpoint import (HFTensors, hf_key, params_from_hf, read_config, some,
                                         to_numpy)
from easylm.runtime.dtypes import cast_names

DTYPES = cast_names(("bf16", "fp32"))  # what a conversion may store

# Tensors HF checkpoints may carry that hold no parameter of ours.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def param_shapes(config: LLaMAConfig) -> dict[str, tuple[int, ...]]:
    """Unscanned parameter path -> shape, from eval_shape (nothing allocated)."""
    model = LLaMAForCausalLM(config.replace(scan_layers=False))
    shapes = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def to_hf(params, config: LLaMAConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy tensor) one at a time, unstacking scanned layers lazily.
    Experts are written one tensor per expert, as transformers 5.24's save_pretrained
    writes them (and transformers 4 held them)."""
    if period(config) > 1:  # dense and sparse layers: slots, unstacked here
        params, config = relayout(params, False), config.replace(scan_layers=False)
    flat = traverse_util.flatten_dict(params, sep="/")
    for path in param_shapes(config):
        tensor = _unstacked(flat, path, config)
        if _is_moe(path):
            yield from _moe_to_hf(path, tensor, config)
            continue
        key, transpose = hf_key(path)
        yield key, (tensor.T if transpose else tensor)


# ------------------------------------------------------- experts (qwen3_moe, mixtral)
# Ours: mlp/router/kernel (D, E), mlp/experts/{gate,up}_proj (E, D, F), down_proj (E, F, D).
# HF per expert (transformers 4; transformers 5.24 saves so too):
#   qwen3_moe  model.layers.<i>.mlp.gate.weight (E, D)
#              model.layers.<i>.mlp.experts.<e>.{gate_proj,up_proj,down_proj}.weight
#   mixtral    model.layers.<i>.block_sparse_moe.gate.weight (E, D)
#              model.layers.<i>.block_sparse_moe.experts.<e>.{w1,w3,w2}.weight
# HF fused (transformers 5 in memory; read only), both variants:
#   model.layers.<i>.mlp.gate.weight (E, D), model.layers.<i>.mlp.experts.gate_up_proj
#   (E, 2F, D) (gate rows first), model.layers.<i>.mlp.experts.down_proj (E, D, F)
_PER_EXPERT = {"qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                     "down_proj": "down_proj"}),
               "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3",
                                                "down_proj": "w2"})}
_MOE_KEY = re.compile(r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.(gate\.weight|experts\.)")


def _is_moe(path: str) -> bool:
    return "/mlp/experts/" in path or "/mlp/router/" in path


def _moe_to_hf(path: str, tensor: np.ndarray, config: LLaMAConfig):
    _, _, i, _, kind, leaf = path.split("/")
    block, names = _PER_EXPERT[config.model_type]
    prefix = f"model.layers.{i}.{block}"
    if kind == "router":
        yield f"{prefix}.gate.weight", tensor.T
        return
    for e in range(tensor.shape[0]):
        yield f"{prefix}.experts.{e}.{names[leaf]}.weight", tensor[e].T


def _moe_from_hf(tensors: Mapping, path: str, config: LLaMAConfig, source: str):
    """(our tensor at `path`, the HF names it was read from), from either layout."""
    _, _, i, _, kind, leaf = path.split("/")
    block, names = _PER_EXPERT[config.model_type]
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj" in tensors
    prefix = f"model.layers.{i}.{'mlp' if fused else block}"

    def read(key):
        if key not in tensors:
            raise UserError(f"{source} is missing tensor {key} ("
                            f"{'fused' if fused else 'per-expert'} layout)")
        return to_numpy(tensors[key])

    if kind == "router":
        return read(f"{prefix}.gate.weight").T, [f"{prefix}.gate.weight"]
    if fused:
        key = f"{prefix}.experts.{'down_proj' if leaf == 'down_proj' else 'gate_up_proj'}"
        tensor = read(key)
        F = tensor.shape[1] // 2
        part = {"gate_proj": tensor[:, :F], "up_proj": tensor[:, F:]}.get(leaf, tensor)
        return part.transpose(0, 2, 1), [key]
    keys = [f"{prefix}.experts.{e}.{names[leaf]}.weight" for e in range(config.num_experts)]
    return np.stack([read(key).T for key in keys]), keys


def _unstacked(flat: dict, path: str, config: LLaMAConfig) -> np.ndarray:
    """The tensor at unscanned `path` (model/layers/<i>/...) of a flat tree, which holds
    the layers stacked when the config scans them."""
    if config.scan_layers and path.startswith("model/layers/"):
        _, _, index, rest = path.split("/", 3)
        return np.asarray(jax.device_get(flat[f"model/layers/{rest}"][int(index)]))
    return np.asarray(jax.device_get(flat[path]))


def from_hf(tensors: Mapping[str, Any], config: LLaMAConfig, dtype=None, source: str = "checkpoint",
            place: Callable[[np.ndarray], Any] | None = None):
    """Build our parameter tree from HF-named tensors (numpy, torch, or anything array-like).

    Missing tensors, unexpected tensors and shape mismatches are UserErrors that name
    them. `place` (e.g. `jax.device_put`) moves each tensor as soon as it is converted,
    so that the host copy can be freed before the next one is read.
    """
    shapes = param_shapes(config)
    dense = {path: shape for path, shape in shapes.items() if not _is_moe(path)}
    flat = params_from_hf(
        tensors, dense, source, dtype, place,
        ignored=lambda key: key.endswith(_IGNORED_HF_SUFFIXES) or bool(_MOE_KEY.match(key)) or (
            config.tie_word_embeddings and key == "lm_head.weight"))
    if len(dense) < len(shapes):
        flat.update(_experts_from_hf(tensors, shapes, config, source, dtype, place))
    params = traverse_util.unflatten_dict(flat, sep="/")
    if config.scan_layers:
        params = stack_layers(params, period(config))
    return params


def _experts_from_hf(tensors: Mapping, shapes: dict, config: LLaMAConfig, source: str, dtype,
                     place) -> dict:
    """{path: array} of the router and expert tensors; an expert tensor of the file that
    none of ours reads, or a shape that is not the config's, is a UserError naming it."""
    flat, read = {}, set()
    for path, shape in shapes.items():
        if not _is_moe(path):
            continue
        tensor, keys = _moe_from_hf(tensors, path, config, source)
        if tensor.shape != shape:
            raise UserError(f"{source}: tensor(s) {some(keys)} give {path} shape "
                            f"{tensor.shape}, but the config implies {shape}")
        tensor = tensor if dtype is None else tensor.astype(dtype)
        flat[path] = tensor if place is None else place(tensor)
        read.update(keys)
    unexpected = sorted(key for key in tensors if _MOE_KEY.match(key) and key not in read)
    if unexpected:
        raise UserError(f"{source} has {len(unexpected)} unexpected expert tensor(s): "
                        f"{some(unexpected)}")
    return flat


# ------------------------------------------------------------ a HF directory

# config.json fields this model reads, by the JSON type they must have (None allowed:
# an absent field takes its transformers class's default, `config.HF_DEFAULTS`). A wrong
# type is refused by name, never converted.
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
         "sliding_window", "max_window_layers", "num_experts", "num_local_experts",
         "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
         "no_rope_layer_interval")
_OPTIONAL_NUMBERS = ("rms_norm_eps", "rope_theta", "initializer_range", "router_aux_loss_coef",
                     "router_jitter_noise")
_OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
                   "norm_topk_prob", "output_router_logits")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def read_hf_config(directory: str) -> LLaMAConfig:
    """DIR/config.json as a LLaMAConfig; anything this model would compute differently
    from HF's class for it (LlamaForCausalLM, Qwen2ForCausalLM, ...) is a UserError that
    names the field."""
    hf = read_config(directory)
    path = os.path.join(directory, "config.json")
    model_type = hf.get("model_type", "llama")
    architecture = ARCHITECTURES.get(model_type, ("LlamaForCausalLM",))[0]
    architectures = hf.get("architectures") or [architecture]
    if model_type in NOT_BUILT:
        raise UserError(not_built(path, model_type))
    if model_type not in ARCHITECTURES or architecture not in architectures:
        expected = ", ".join(f"{name} ({cls})" for name, (cls, _) in ARCHITECTURES.items())
        # What the file says, and nothing this reader assumed in its absence.
        found = " / ".join(f"{key} {hf[key]!r}" for key in ("model_type", "architectures")
                           if key in hf)
        raise UserError(
            f"{directory}: {found or 'no model_type'} is not a LLaMA-like causal LM "
            f"(expected model_type and architecture: {expected})"
        )
    _check_types(hf, path)
    for rope in (hf, hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}):
        factor = rope.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise UserError(f"{path}: partial_rotary_factor={factor!r} (rotary embeddings on "
                            f"part of each head) is not supported by this LLaMA implementation")
    try:
        return LLaMAConfig.from_hf_config(hf)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:  # e.g. a llama3 rope without its factor
        raise UserError(f"{path}: cannot read its rope settings ({type(e).__name__}: {e})") from None


def not_built(path: str, model_type: str) -> str:
    return (f"{path}: model_type {model_type!r} is not built: its {NOT_BUILT[model_type]} "
            f"is not supported (mixtures of experts read: {', '.join(MOE_TYPES)})")


def _check_types(hf: dict, path: str):
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    is_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    checks = [(name, is_int, "an integer") for name in _INTS]
    checks += [(name, is_number, "a number") for name in _OPTIONAL_NUMBERS]
    checks += [(name, lambda v: is_int(v) or (isinstance(v, list) and v and all(map(is_int, v))),
                "a token id or a list of them") for name in _TOKEN_IDS]
    checks += [(name, lambda v: isinstance(v, bool), "true or false") for name in _OPTIONAL_BOOLS]
    checks += [(name, lambda v: isinstance(v, dict), "an object")
               for name in ("rope_scaling", "rope_parameters")]
    checks += [("layer_types", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "a list of strings")]
    for name, ok, expected in checks:
        if hf.get(name) is not None and not ok(hf[name]):
            raise UserError(f"{path}: {name} must be {expected}, got {hf[name]!r}")


def load_hf_params(directory: str, dtype: str = "keep", scan_layers: bool = False, place=None):
    """(config, params) from a HF directory; used by `hf::DIR` load specs too.

    Params are numpy arrays, or whatever `place` makes of each (e.g. jax.device_put)."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = read_hf_config(directory).replace(scan_layers=scan_layers)
    params = from_hf(HFTensors(directory), config, dtype=DTYPES[dtype], source=directory, place=place)
    return config, params
