"""Gemma 3 text model configuration: one dataclass, a table of presets, and config.json.

config.json is read as transformers reads it (`Gemma3TextConfig`), in both layouts:

    4.x   rope_theta (global layers), rope_local_base_freq (sliding layers),
          rope_scaling (global layers only), sliding_window_pattern (every n-th layer
          global) or layer_types
    5.x   rope_parameters = {"full_attention": {...}, "sliding_attention": {...}},
          layer_types

Fields a config.json leaves out take Gemma3TextConfig's defaults (the released
multimodal configs' `text_config` lists only what differs from them). A `gemma3`
(multimodal) config.json is read for its text tower, `text_config`. The export writes the
installed transformers' layout (`to_hf_config`: Gemma3TextConfig's own `save_pretrained`).
"""

import dataclasses
from typing import Any

from easylm.errors import UserError
from easylm.models.config import LAYER_TYPES, ModelConfig, default, field
from easylm.models.hf_checkpoint import (
    config_fields,
    first_int,
    layer_types as hf_layer_types,
    text_model,
)

ROPE_TYPES = ("default", "linear")


@dataclasses.dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """Gemma 3's text model: the shared fields (easylm/models/config.py), with
    Gemma3TextConfig's defaults, and these."""

    section = "gemma"
    layer_type_choices = LAYER_TYPES[:2]  # sliding_attention, full_attention

    vocab_size: int = default(262208)
    hidden_size: int = default(2304)
    intermediate_size: int = default(9216)
    num_hidden_layers: int = default(26)
    num_attention_heads: int = default(8)
    num_key_value_heads: int = default(4)
    head_dim: int = default(256)
    tie_word_embeddings: bool = default(True)
    max_position_embeddings: int = default(131072)
    bos_token_id: int = default(2)
    eos_token_id: int = default(1)
    pad_token_id: int | None = default(0)

    # Attention.
    query_pre_attn_scalar: float = field(256.0, "attention scores are scaled by "
                                                "query_pre_attn_scalar ** -0.5")
    sliding_window: int = field(4096, "a sliding layer's query attends to at most this many "
                                      "positions, itself included; 0: no window")
    sliding_window_pattern: int = field(6, "every n-th layer (1-based) attends globally, the "
                                           "others slide (unless layer_types is set)")
    layer_types: str = field("", "comma-separated sliding_attention/full_attention, one per "
                                 "layer; empty: from sliding_window_pattern")
    # Numerics.
    rope_theta: float = field(1_000_000.0, "rotary base of the global (full attention) layers")
    rope_local_base_freq: float = field(10_000.0, "rotary base of the sliding-window layers")
    rope_scaling_factor: float = field(1.0, "linear rotary scaling of the global layers "
                                            "(positions divided by it; 1: none)")
    def __post_init__(self):
        super().__post_init__()
        if not self.layer_types and self.sliding_window_pattern < 1:
            raise UserError(f"--gemma.sliding_window_pattern must be >= 1, got "
                            f"{self.sliding_window_pattern}")

    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention: sliding_attention or full_attention (HF's names)."""
        if self.layer_types:
            return tuple(self.layer_types.split(","))
        return tuple("full_attention" if (i + 1) % self.sliding_window_pattern == 0
                     else "sliding_attention" for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "GemmaConfig":
        return from_hf_dict(hf, path)

    # --------------------------------------------------------------- counting

    def num_parameters(self) -> int:
        """Parameters of the model as built (the embedding counted once when tied)."""
        d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * h, self.num_key_value_heads * h
        layer = d * (q + 2 * kv) + q * d + 3 * d * f + 4 * d + 2 * h
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_hidden_layers * layer + d + head

    def num_matmul_parameters(self) -> int:
        """N of 6N FLOPs a token: the projections and the head, not the lookup or norms."""
        d, h = self.hidden_size, self.head_dim
        vectors = self.num_hidden_layers * (4 * d + 2 * h) + d
        head = self.vocab_size * d if self.tie_word_embeddings else 0
        return self.num_parameters() - self.vocab_size * d - vectors + head

    def flops_per_token(self, seq_length: int) -> float:
        """6*N + 12*d_attn*keys per layer (PaLM appendix B), the keys a query sees being
        the window on sliding layers."""
        width = self.num_attention_heads * self.head_dim
        keys = [min(seq_length, self.sliding_window or seq_length) if kind == "sliding_attention"
                else seq_length for kind in self.layer_kinds()]
        return 6 * self.num_matmul_parameters() + 12 * width * sum(keys)

    # ---------------------------------------------------- HF transformers

    def to_hf_config(self):
        """transformers' Gemma3TextConfig (architectures Gemma3ForCausalLM): its
        `save_pretrained` writes the installed version's config.json layout."""
        from transformers import Gemma3TextConfig

        global_rope = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling_factor != 1.0:
            global_rope.update(rope_type="linear", factor=float(self.rope_scaling_factor))
        config = Gemma3TextConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"full_attention": global_rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": float(self.rope_local_base_freq)}},
            query_pre_attn_scalar=_number(self.query_pre_attn_scalar),
            # transformers has no "no window": one as long as the context slides nothing.
            sliding_window=self.sliding_window or self.max_position_embeddings,
            layer_types=list(self.layer_kinds()),
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            hidden_activation="gelu_pytorch_tanh")
        config.architectures = ["Gemma3ForCausalLM"]
        return config


def _number(value: float):
    return int(value) if float(value).is_integer() else float(value)


# ------------------------------------------------------------- config.json

# Gemma3TextConfig's defaults: what transformers assumes for a field config.json omits.
HF_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    initializer_range=0.02, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=6, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0)
# Fields whose other values would make transformers compute something this model does not.
_MUST_BE = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False}
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
         "sliding_window_pattern")


def text_fields(hf: dict, path: str) -> dict:
    """The text model's config.json fields: `text_config` of a multimodal `gemma3` config
    (its vision tower is not this model), the whole of a `gemma3_text` one."""
    model_type = hf.get("model_type")
    if model_type == "gemma3":
        return text_model(hf, path, "gemma3_text", tied=True)
    if model_type != "gemma3_text":
        raise UserError(f"{path}: model_type {model_type!r} is not a Gemma 3 model (supported: "
                        f"gemma3_text, and the text tower of gemma3)")
    return hf


def from_hf_dict(hf: dict, path: str = "config.json") -> GemmaConfig:
    """A GemmaConfig from config.json's fields (either layout); what this model would
    compute differently from transformers is a UserError naming `path` and the field."""
    hf = text_fields(hf, path)
    get = config_fields(hf, path, HF_DEFAULTS, _INTS)
    for name, expected in _MUST_BE.items():
        if name == "hidden_activation" and "hidden_activation" not in hf and "hidden_act" in hf:
            name = "hidden_act"  # older configs' spelling
        value = hf.get(name, expected)
        if value != expected:
            raise UserError(f"{path}: {name}={value!r} is not supported (this Gemma 3 model "
                            f"implements {name}={expected!r})")
    global_rope, local_rope = _rope(hf, path)
    layer_types = hf_layer_types(hf, path, GemmaConfig.layer_type_choices)
    pattern, layer_types = _layer_pattern(layer_types, get("sliding_window_pattern"),
                                          get("num_hidden_layers"))
    try:
        return GemmaConfig(
            **{name: get(name) for name in _INTS if name != "sliding_window_pattern"},
            sliding_window_pattern=pattern,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
            # null: no window (transformers' sliding layers then see every position)
            sliding_window=int(get("sliding_window") or 0) if hf.get("sliding_window", 1)
            is not None else 0,
            layer_types=layer_types,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(global_rope["rope_theta"]),
            rope_local_base_freq=float(local_rope["rope_theta"]),
            rope_scaling_factor=float(global_rope.get("factor", 1.0)),
            initializer_range=float(get("initializer_range")),
            bos_token_id=first_int(get("bos_token_id")),
            eos_token_id=first_int(get("eos_token_id")),
            pad_token_id=first_int(hf.get("pad_token_id", HF_DEFAULTS["pad_token_id"])))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: a field has the wrong type ({e})") from None


def _layer_pattern(layer_types, pattern: int, layers: int) -> tuple[int, str]:
    """(sliding_window_pattern, layer_types) of the config: the layer types as a pattern
    (every n-th layer global) when one gives them, else spelled out."""
    if not layer_types:
        return pattern, ""
    for n in [pattern] + list(range(1, layers + 2)):
        if GemmaConfig(num_hidden_layers=layers, sliding_window_pattern=n).layer_kinds() == \
                tuple(layer_types):
            return n, ""
    return pattern, ",".join(layer_types)


def _rope(hf: dict, path: str) -> tuple[dict, dict]:
    """(global, sliding) rope parameters as Gemma3TextConfig derives them from either
    layout; only the default and linear types are implemented."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - set(GemmaConfig.layer_type_choices):
        raise UserError(f"{path}: rope_parameters must map sliding_attention and full_attention "
                        f"to their rope settings, got {params!r}")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise UserError(f"{path}: rope_scaling must be an object, got {scaling!r}")
        full.update(scaling)
    full.setdefault("rope_theta", get_number(hf, "rope_theta", path))
    local.setdefault("rope_theta", get_number(hf, "rope_local_base_freq", path))
    for kind, rope, source in (("full_attention", full, "rope_scaling" if scaling else
                               "rope_parameters"), ("sliding_attention", local, "rope_parameters")):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        allowed = ROPE_TYPES if kind == "full_attention" else ("default",)
        if rope_type not in allowed:
            raise UserError(f"{path}: {source} gives the {kind} layers rope type {rope_type!r}, "
                            f"which is not implemented (supported: {', '.join(allowed)})")
        if rope_type == "linear" and not isinstance(rope.get("factor"), (int, float)):
            raise UserError(f"{path}: {source}: a linear rope needs a numeric factor, got "
                            f"{rope.get('factor')!r}")
    return full, local


def get_number(hf: dict, name: str, path: str) -> float:
    value = hf.get(name)
    if value is None:
        return HF_DEFAULTS[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{path}: {name} must be a number, got {value!r}")
    return float(value)




# -------------------------------------------------------------------- presets
# Gemma 3's text models as their released config.json files describe them (written from
# knowledge, no hub access where this was written; tests/test_gemma_model.py checks the
# parameter counts against the model cards'). Every fifth of six layers is global.

_GEMMA3 = dict(vocab_size=262144, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
               sliding_window=512, sliding_window_pattern=6, max_position_embeddings=32768,
               rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rms_norm_eps=1e-6,
               bos_token_id=2, eos_token_id=1, pad_token_id=0)

GEMMA_PRESETS: dict[str, dict[str, Any]] = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens and ids
    # (pad 0, BOS 1, EOS 2), a window shorter than a test's rows, two sliding layers then a
    # global one.
    "debug": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2,
                  max_position_embeddings=512, rope_theta=10_000.0, rope_local_base_freq=1_000.0,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "gemma3_270m": dict(_GEMMA3, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                        num_attention_heads=4),
    "gemma3_1b": dict(_GEMMA3, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4),
    # The text tower of gemma-3-4b: 8 heads of 256 over 4 kv heads, a 1024 window, and the
    # global layers' rotary slowed 8x (linear scaling) for its 128k context.
    "gemma3_4b": dict(_GEMMA3, vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                      num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                      sliding_window=1024, max_position_embeddings=131072,
                      rope_scaling_factor=8.0),
}
