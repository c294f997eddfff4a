"""gpt-oss model configuration: one dataclass, a table of presets, and config.json.

config.json is read as transformers reads it (`GptOssConfig`), in both layouts:

    4.x   rope_theta and rope_scaling = {"rope_type": "yarn", "factor": ...} at the top
    5.x   rope_parameters = {"rope_type": "yarn", "rope_theta": ..., "factor": ...}

Fields a config.json leaves out take GptOssConfig's defaults. The released checkpoints'
`quantization_config` (MXFP4 experts) is the weights' business (easylm/gpt_oss/hf.py).
The export writes the installed transformers' layout (`to_hf_config`).
"""

import dataclasses
from typing import Any

from easylm.errors import UserError
from easylm.models.config import LAYER_TYPES, ModelConfig, default, field
from easylm.models.hf_checkpoint import config_fields, first_int, layer_types as hf_layer_types
from easylm.models.moe import RouterLoss

ROPE_TYPES = ("yarn", "default")


@dataclasses.dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    """gpt-oss: the shared fields (easylm/models/config.py), with gpt-oss-20b's values,
    and these."""

    section = "gpt_oss"
    # The sink logit needs the einsum reference (no fused kernel adds it).
    attention_implementations = ("xla",)
    routed_experts_field = "num_local_experts"
    experts_per_token_field = "num_experts_per_tok"
    layer_type_choices = LAYER_TYPES[:2]  # sliding_attention, full_attention

    vocab_size: int = default(201088)
    hidden_size: int = default(2880)
    intermediate_size: int = field(2880, "one expert's MLP width F")
    num_hidden_layers: int = default(24)
    num_attention_heads: int = default(64)
    num_key_value_heads: int = default(8)
    head_dim: int = default(64)
    max_position_embeddings: int = default(131072)
    rms_norm_eps: float = default(1e-5)
    bos_token_id: int | None = default(199998)
    eos_token_id: int | None = default(200002)
    pad_token_id: int | None = default(199999)
    attention: str = default("xla")
    # Experts.
    num_local_experts: int = field(32, "experts E of each layer's MoE")
    num_experts_per_tok: int = field(4, "experts each token is routed to")
    attention_bias: bool = field(True, "biases on the q, k, v and o projections")
    # Attention.
    sliding_window: int = field(128, "a sliding layer's query attends to at most this many "
                                     "positions, itself included")
    layer_types: str = field("", "comma-separated sliding_attention/full_attention, one per "
                                 "layer; empty: sliding, full, sliding, ...")
    # Numerics.
    rope_theta: float = field(150000.0, "rotary base")
    rope_type: str = field("yarn", f"rotary frequencies: {', '.join(ROPE_TYPES)}")
    rope_factor: float = field(32.0, "yarn: how much longer the context is than the original")
    rope_original_max_position_embeddings: int = field(4096, "yarn: the context the model "
                                                             "was pretrained at")
    rope_beta_fast: float = field(32.0, "yarn: dimensions turning more often than this over "
                                        "the original context are kept")
    rope_beta_slow: float = field(1.0, "yarn: dimensions turning less often are slowed by "
                                       "the factor")
    rope_truncate: bool = field(False, "yarn: round the blend's ends to whole dimensions")
    swiglu_limit: float = field(7.0, "the experts' SwiGLU clamps the gate above and the up "
                                     "projection on both sides at this")
    swiglu_alpha: float = field(1.702, "the experts' SwiGLU: gate * sigmoid(alpha * gate)")
    output_router_logits: bool = field(
        False, "train with router_aux_loss_coef x the load-balancing loss added, as "
              "transformers adds it with output_router_logits (logged either way)")
    router_aux_loss_coef: float = field(0.9, "weight of the load-balancing loss (carried to "
                                             "config.json)")
    router_z_loss_coef: float = field(0.0, "weight of ST-MoE's router z-loss added to the "
                                           "training loss (0: off; logged either way)")
    def __post_init__(self):
        super().__post_init__()
        if self.rope_type not in ROPE_TYPES:
            raise UserError(f"--gpt_oss.rope_type={self.rope_type!r} is not one of "
                            f"{', '.join(ROPE_TYPES)}")
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise UserError(f"--gpt_oss.num_experts_per_tok={self.num_experts_per_tok} must be "
                            f"in 1..num_local_experts={self.num_local_experts}")
        if self.sliding_window < 1:
            raise UserError(f"--gpt_oss.sliding_window must be >= 1, got {self.sliding_window}")

    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention (HF's names); by default sliding, full, sliding, ..."""
        if self.layer_types:
            return tuple(self.layer_types.split(","))
        return tuple(self.layer_type_choices[i % 2] for i in range(self.num_hidden_layers))

    def router_loss(self) -> RouterLoss:
        # Every layer is a mixture of experts: training adds its router losses as
        # transformers' GptOssForCausalLM does (objectives/router_loss.py).
        aux = self.router_aux_loss_coef if self.output_router_logits else 0.0
        return RouterLoss(self.num_experts_per_tok, aux, self.router_z_loss_coef)

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "GptOssConfig":
        return from_hf_dict(hf, path)

    # --------------------------------------------------------------- counting

    def _layer_parameters(self) -> tuple[int, int]:
        """(attention and norms, one expert) parameters of a layer."""
        d, h, f = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * h, self.num_key_value_heads * h
        attention = d * (q + 2 * kv) + q * d + self.num_attention_heads + 2 * d
        if self.attention_bias:
            attention += q + 2 * kv + d
        router = (d + 1) * self.num_local_experts
        return attention + router, 3 * d * f + 2 * f + d

    def num_parameters(self) -> int:
        """Parameters of the model as built (the embedding counted once when tied)."""
        shared, expert = self._layer_parameters()
        layer = shared + self.num_local_experts * expert
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_hidden_layers * layer + \
            self.hidden_size + head

    def num_active_parameters(self) -> int:
        """The matmul parameters a token goes through: attention, router, its k experts,
        the head (N of 6N FLOPs a token; biases, norms, sinks and the lookup left out)."""
        d, h, f = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * h, self.num_key_value_heads * h
        layer = d * (q + 2 * kv) + q * d + d * self.num_local_experts + \
            self.num_experts_per_tok * 3 * d * f
        return self.num_hidden_layers * layer + self.vocab_size * d

    def num_matmul_parameters(self) -> int:
        """N of the 6N FLOPs a token (`num_active_parameters`: matmuls only already): what a
        LoRA run's FLOPs count subtracts the frozen base's weight gradients of."""
        return self.num_active_parameters()

    def flops_per_token(self, seq_length: int) -> float:
        """6*N_active + 12*d_attn*keys per layer (PaLM appendix B), a sliding layer's keys
        being its window."""
        width = self.num_attention_heads * self.head_dim
        keys = [min(seq_length, self.sliding_window) if kind == "sliding_attention"
                else seq_length for kind in self.layer_kinds()]
        return 6 * self.num_active_parameters() + 12 * width * sum(keys)

    # ---------------------------------------------------- HF transformers

    def rope_parameters(self) -> dict:
        """transformers' 5.x rope_parameters for this config."""
        rope = {"rope_type": self.rope_type, "rope_theta": float(self.rope_theta)}
        if self.rope_type == "yarn":
            rope.update(factor=float(self.rope_factor), beta_fast=float(self.rope_beta_fast),
                        beta_slow=float(self.rope_beta_slow), truncate=self.rope_truncate,
                        original_max_position_embeddings=int(
                            self.rope_original_max_position_embeddings))
        return rope

    def to_hf_config(self):
        """transformers' GptOssConfig (architectures GptOssForCausalLM)."""
        from transformers import GptOssConfig as HFConfig

        config = HFConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            num_local_experts=self.num_local_experts,
            num_experts_per_tok=self.num_experts_per_tok, sliding_window=self.sliding_window,
            layer_types=list(self.layer_kinds()),
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, rope_parameters=self.rope_parameters(),
            swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha,
            router_aux_loss_coef=self.router_aux_loss_coef,
            output_router_logits=self.output_router_logits,
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
            initializer_range=self.initializer_range, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        config.architectures = ["GptOssForCausalLM"]
        return config


# ------------------------------------------------------------- config.json

# GptOssConfig's defaults: what transformers assumes for a field config.json omits.
HF_DEFAULTS = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
    num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
    rms_norm_eps=1e-5, swiglu_limit=7.0, swiglu_alpha=1.702, router_aux_loss_coef=0.001,
    output_router_logits=False, tie_word_embeddings=False, attention_bias=True, initializer_range=0.02,
    bos_token_id=None, eos_token_id=None, pad_token_id=None)
HF_DEFAULT_ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                       beta_slow=1.0, truncate=False, original_max_position_embeddings=4096)
# Fields whose other values would make transformers compute something this model does not.
_MUST_BE = {"hidden_act": "silu", "attention_dropout": 0.0}
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
         "num_experts_per_tok", "sliding_window", "max_position_embeddings")
_FLOATS = ("rms_norm_eps", "swiglu_limit", "swiglu_alpha", "router_aux_loss_coef",
           "initializer_range")


def from_hf_dict(hf: dict, path: str = "config.json") -> GptOssConfig:
    """A GptOssConfig from config.json's fields (either layout); what this model would
    compute differently from transformers is a UserError naming `path` and the field."""
    if hf.get("model_type") != "gpt_oss":
        raise UserError(f"{path}: model_type {hf.get('model_type')!r} is not gpt_oss")
    get = config_fields(hf, path, HF_DEFAULTS, _INTS, _MUST_BE, "gpt-oss")
    layer_types = hf_layer_types(hf, path, GptOssConfig.layer_type_choices)
    try:
        return GptOssConfig(
            **{name: get(name) for name in _INTS},
            **{name: float(get(name)) for name in _FLOATS},
            **_rope(hf, path),
            layer_types=_layer_types(layer_types, get("num_hidden_layers")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            output_router_logits=bool(get("output_router_logits")),
            attention_bias=bool(get("attention_bias")),
            bos_token_id=first_int(get("bos_token_id")),
            eos_token_id=first_int(get("eos_token_id")),
            pad_token_id=first_int(get("pad_token_id")))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: a field has the wrong type ({e})") from None


def _rope(hf: dict, path: str) -> dict:
    """The rope fields from rope_scaling (4.x, with a top-level rope_theta) or
    rope_parameters (5.x), as GptOssConfig standardises them."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    if rope is None:
        rope = dict(HF_DEFAULT_ROPE)
    if not isinstance(rope, dict):
        raise UserError(f"{path}: rope_parameters must be an object, got {rope!r}")
    rope = dict(rope)
    rope.setdefault("rope_theta", hf.get("rope_theta", HF_DEFAULT_ROPE["rope_theta"]))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UserError(f"{path}: rope type {rope_type!r} is not implemented for gpt-oss "
                        f"(supported: {', '.join(ROPE_TYPES)})")
    for name in ("attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor"):
        if rope.get(name) is not None:
            raise UserError(f"{path}: rope {name}={rope[name]!r} is not implemented for gpt-oss")
    fields = dict(rope_type=rope_type, rope_theta=float(rope["rope_theta"]))
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings")
        factor = rope.get("factor") or hf.get("max_position_embeddings", 131072) / original
        fields.update(rope_factor=float(factor), rope_original_max_position_embeddings=original,
                      rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                      rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                      # transformers reads truncate from rope_parameters, default True.
                      rope_truncate=bool(rope.get("truncate", True)))
    return fields


def _layer_types(layer_types, layers: int) -> str:
    """config.json's layer_types as the field holds them: empty when they are the default."""
    alternating = [GptOssConfig.layer_type_choices[i % 2] for i in range(layers)]
    if not layer_types or layer_types == alternating:
        return ""
    return ",".join(layer_types)




# -------------------------------------------------------------------- presets
# gpt-oss-20b as its released config.json describes it (written from knowledge, no hub
# access where this was written; tests/test_gpt_oss.py checks the parameter count against
# the model card's 21B total, 3.6B active).

GPT_OSS_PRESETS: dict[str, dict[str, Any]] = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens and ids
    # (pad 0, BOS 1, EOS 2), a window shorter than a test's rows, sliding and full layers.
    "debug": dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                  max_position_embeddings=512, rope_original_max_position_embeddings=32,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "gpt_oss_20b": dict(),  # the dataclass defaults are gpt-oss-20b's
}
