"""Qwen3.5 (dense and MoE) and Qwen3-Next text model configuration: one dataclass,
config.json, the presets.

Three of every four layers are Gated DeltaNet linear attention (easylm/models/
gated_deltanet.py), every fourth full attention with an output gate and rotary on the
first `partial_rotary_factor` of each head. config.json is read as transformers 5 reads
`Qwen3_5TextConfig`: a `qwen3_5_text` file, or the `text_config` of a multimodal
`qwen3_5` one (its vision tower is not this model); a key it leaves out takes
transformers' default. MRoPE's sections (`mrope_section`) are read as text positions:
with one position per token all three sections rotate alike, so the rotary is plain.

`model_type` says which of transformers' three models the config is; they share the
layers and differ in the MLP and the DeltaNet projections:

    qwen3_5_text      a dense MLP (intermediate_size)
    qwen3_5_moe_text  each layer's MLP a mixture of experts (easylm/models/moe.py's
                      softmax top-k, always renormalised) plus a shared expert scaled by
                      sigmoid(shared_expert_gate(x))
    qwen3_next        the same mixture (norm_topk_prob as the file says), and the DeltaNet
                      projections fused (in_proj_qkvz, in_proj_ba, grouped per key head)
"""

import dataclasses
from typing import Any

from easylm.errors import UserError
from easylm.models.config import LAYER_TYPES, ModelConfig, default, field
from easylm.models.gated_deltanet import GatedDeltaNetConfig
from easylm.models.hf_checkpoint import (
    config_fields,
    first_int,
    layer_types as hf_layer_types,
    text_model,
)
from easylm.models.moe import MoEConfig, RouterLoss

MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MOE_TYPES = ("qwen3_5_moe_text", "qwen3_next")
# The multimodal checkpoints' model_type -> their text model's.
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# Near model_types this family does not build, and what in them it would compute
# differently (refused in one line, never approximated).
NOT_BUILT: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Qwen35Config(ModelConfig):
    """Qwen3.5's text model: the shared fields with Qwen3_5TextConfig's defaults, and these."""

    section = "qwen3_5"
    routed_experts_field = "num_experts"
    experts_per_token_field = "num_experts_per_tok"
    layer_type_choices = LAYER_TYPES[1:]  # full_attention, linear_attention

    vocab_size: int = default(248320)
    hidden_size: int = default(4096)
    intermediate_size: int = default(12288)
    num_hidden_layers: int = default(32)
    num_attention_heads: int = default(16)
    num_key_value_heads: int = default(4)
    head_dim: int = default(256)
    max_position_embeddings: int = default(32768)
    bos_token_id: int | None = default(None)
    eos_token_id: int | None = default(None)

    layer_types: str = field("", "comma-separated linear_attention/full_attention, one per "
                                 "layer; empty: every full_attention_interval-th layer full")
    full_attention_interval: int = field(4, "every n-th layer (1-based) is full attention, "
                                            "the others Gated DeltaNet (unless layer_types)")
    linear_num_key_heads: int = field(16, "Gated DeltaNet query/key heads")
    linear_num_value_heads: int = field(32, "Gated DeltaNet value heads (state heads), a "
                                            "multiple of the key heads")
    linear_key_head_dim: int = field(128, "Gated DeltaNet query/key head width")
    linear_value_head_dim: int = field(128, "Gated DeltaNet value head width")
    linear_conv_kernel_dim: int = field(4, "width of Gated DeltaNet's causal depthwise conv")
    rope_theta: float = field(10_000.0, "rotary base of the full-attention layers")
    partial_rotary_factor: float = field(0.25, "the share of each attention head's dims that "
                                               "rotary rotates (the first ones)")
    model_type: str = field("qwen3_5_text", "qwen3_5_text (dense MLP), qwen3_5_moe_text "
                                            "(experts and a gated shared expert) or qwen3_next "
                                            "(those, and fused DeltaNet projections)")
    # Mixture of experts (qwen3_5_moe_text, qwen3_next): easylm/models/moe.py's block.
    num_experts: int = field(0, "routed experts of each layer's MLP; 0 with qwen3_5_text")
    num_experts_per_tok: int = field(8, "experts each token is routed to")
    moe_intermediate_size: int = field(512, "one routed expert's MLP width")
    shared_expert_intermediate_size: int = field(512, "the shared expert's MLP width")
    norm_topk_prob: bool = field(True, "divide the chosen experts' probabilities by their sum "
                                       "(qwen3_5_moe_text always does)")
    output_router_logits: bool = field(
        False, "train with router_aux_loss_coef x the load-balancing loss added, as "
               "transformers adds it with output_router_logits (logged either way)")
    router_aux_loss_coef: float = field(0.001, "weight of the load-balancing loss")
    router_z_loss_coef: float = field(0.0, "weight of ST-MoE's router z-loss (not in "
                                           "transformers' loss)")

    def __post_init__(self):
        super().__post_init__()
        checks = (
            (self.linear_num_value_heads % self.linear_num_key_heads == 0,
             (f"linear_num_key_heads={self.linear_num_key_heads} must divide "
              f"linear_num_value_heads={self.linear_num_value_heads}")),
            (self.rotary_dim() % 2 == 0 and 0 < self.rotary_dim() <= self.head_dim,
             (f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={self.head_dim} "
              f"must give an even rotary width of at least 2")),
            (self.linear_conv_kernel_dim >= 2,
             f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be >= 2"),
            (self.full_attention_interval >= 1,
             f"full_attention_interval={self.full_attention_interval} must be >= 1"),
            (self.model_type in MODEL_TYPES,
             f"model_type={self.model_type!r} is not one of {', '.join(MODEL_TYPES)}"),
            ((self.num_experts > 0) == (self.model_type in MOE_TYPES),
             (f"num_experts={self.num_experts}: model_type={self.model_type} "
              + ("needs experts (>= 1)" if self.model_type in MOE_TYPES else "has none (0)"))),
            (not self.num_experts or 0 < self.num_experts_per_tok <= self.num_experts,
             (f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
              f"{self.num_experts}")),
            (self.model_type != "qwen3_5_moe_text" or self.norm_topk_prob,
             "norm_topk_prob=False: qwen3_5_moe_text always renormalises"),
        )
        for ok, message in checks:
            if not ok:
                raise UserError(f"--qwen3_5.{message}")

    def layer_kinds(self) -> tuple[str, ...]:
        if self.layer_types:
            return tuple(self.layer_types.split(","))
        n = self.full_attention_interval
        return tuple("full_attention" if (i + 1) % n == 0 else "linear_attention"
                     for i in range(self.num_hidden_layers))

    def rotary_dim(self) -> int:
        """The rotated dims of a head, as transformers rounds them: int(H * factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rotary_widths(self) -> dict[str, int]:
        return {}  # the rotated share of a head is checked with partial_rotary_factor

    def deltanet(self) -> GatedDeltaNetConfig:
        """The Gated DeltaNet layers' config."""
        return GatedDeltaNetConfig(
            hidden_size=self.hidden_size, linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim, rms_norm_eps=self.rms_norm_eps,
            fused_projections=self.model_type == "qwen3_next",
            initializer_range=self.initializer_range)

    def moe(self) -> MoEConfig | None:
        """The routed experts' config (easylm/models/moe.py); None: a dense MLP."""
        if not self.num_experts:
            return None
        return MoEConfig(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                         norm_topk_prob=self.norm_topk_prob,
                         initializer_range=self.initializer_range)

    def router_loss(self) -> RouterLoss | None:
        if not self.num_experts:
            return None
        aux = self.router_aux_loss_coef if self.output_router_logits else 0.0
        return RouterLoss(self.num_experts_per_tok, aux, self.router_z_loss_coef)

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "Qwen35Config":
        return from_hf_dict(hf, path)

    # --------------------------------------------------------------- counting

    def num_parameters(self) -> int:
        """Parameters of the model as built (the embedding counted once when tied)."""
        d, v = self.hidden_size, self.vocab_size
        g = self.deltanet()
        linear_vectors = g.linear_conv_kernel_dim * g.conv_channels + 2 * \
            self.linear_num_value_heads + self.linear_value_head_dim
        full_vectors = 2 * self.head_dim
        kinds = self.layer_kinds()
        vectors = sum(linear_vectors if k == "linear_attention" else full_vectors for k in kinds)
        head = 0 if self.tie_word_embeddings else v * d
        layers = sum(self._mixer_matmul(k) for k in kinds) + len(kinds) * (
            self._mlp_matmul() + 2 * d)
        return v * d + layers + vectors + d + head

    def num_active_parameters(self) -> int:
        """Parameters a token's forward pass reads: all but the experts it is not routed
        to (= num_parameters for a dense model)."""
        inactive = self._mlp_matmul() - self._mlp_matmul(active=True)
        return self.num_parameters() - self.num_hidden_layers * inactive

    def _mlp_matmul(self, active: bool = False) -> int:
        """One layer's MLP parameters: the dense MLP's, or the (active) routed experts',
        the router's, the shared expert's and its gate's."""
        d = self.hidden_size
        if not self.num_experts:
            return 3 * d * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return (experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
                + 3 * d * self.shared_expert_intermediate_size + d)

    def _mixer_matmul(self, kind: str) -> int:
        """The matmul parameters of a layer's token mixer."""
        d = self.hidden_size
        if kind == "linear_attention":
            k = self.linear_num_key_heads * self.linear_key_head_dim
            u = self.linear_num_value_heads * self.linear_value_head_dim
            # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (or fused), out_proj
            return d * (2 * k + u) + d * u + 2 * d * self.linear_num_value_heads + u * d
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return d * 2 * q + 2 * d * kv + q * d  # q_proj carries the output gate: 2 q

    def num_matmul_parameters(self) -> int:
        """N of 6N FLOPs a token: the projections, the MLPs (the experts a token is routed
        to) and the head; not the lookup, norms, the conv (W multiply-adds per channel) or
        the decay parameters."""
        kinds = self.layer_kinds()
        return (sum(self._mixer_matmul(k) for k in kinds)
                + len(kinds) * self._mlp_matmul(active=True)
                + self.vocab_size * self.hidden_size)

    def flops_per_token(self, seq_length: int) -> float:
        """6N, plus per full layer 12 * d_attn * keys (PaLM appendix B), plus per linear
        layer the delta rule's three H x U products per value head a token (decay and
        predict, write, read), forward and backward: 18 N_v H U."""
        kinds = self.layer_kinds()
        full = kinds.count("full_attention")
        width = self.num_attention_heads * self.head_dim
        state = self.linear_num_value_heads * self.linear_key_head_dim * \
            self.linear_value_head_dim
        return (6 * self.num_matmul_parameters() + 12 * width * seq_length * full
                + 18 * state * (len(kinds) - full))

    # ---------------------------------------------------- HF transformers

    def to_hf_config(self):
        """transformers' Qwen3_5TextConfig (Qwen3_5ForCausalLM), Qwen3_5MoeTextConfig
        (Qwen3_5MoeForCausalLM) or Qwen3NextConfig (Qwen3NextForCausalLM)."""
        import transformers

        class_name, architecture = HF_CLASSES[self.model_type]
        fields = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings, layer_types=list(self.layer_kinds()),
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta),
                             "partial_rotary_factor": float(self.partial_rotary_factor)},
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id)
        if self.model_type != "qwen3_5_moe_text":  # the MoE text config has no dense MLP
            fields["intermediate_size"] = self.intermediate_size
        if self.num_experts:
            fields.update(num_experts=self.num_experts,
                          num_experts_per_tok=self.num_experts_per_tok,
                          moe_intermediate_size=self.moe_intermediate_size,
                          shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                          output_router_logits=self.output_router_logits,
                          router_aux_loss_coef=self.router_aux_loss_coef)
        if self.model_type == "qwen3_next":
            fields.update(norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                          mlp_only_layers=[])
        config = getattr(transformers, class_name)(**fields)
        config.architectures = [architecture]
        return config


# ------------------------------------------------------------- config.json

HF_CLASSES = {"qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
              "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
              "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM")}
# Each config class's defaults: what transformers assumes for a key config.json omits.
_SHARED_DEFAULTS = dict(
    max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6,
    tie_word_embeddings=False, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    full_attention_interval=4, rope_theta=10_000.0, partial_rotary_factor=0.25, head_dim=256,
    num_attention_heads=16)
_MOE_DEFAULTS = dict(moe_intermediate_size=512, shared_expert_intermediate_size=512,
                     output_router_logits=False, router_aux_loss_coef=0.001)
HF_DEFAULTS_BY_TYPE = {
    "qwen3_5_text": dict(_SHARED_DEFAULTS, vocab_size=248320, hidden_size=4096,
                         intermediate_size=12288, num_hidden_layers=32, num_key_value_heads=4),
    "qwen3_5_moe_text": dict(_SHARED_DEFAULTS, **_MOE_DEFAULTS, vocab_size=248320,
                             hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2,
                             num_experts=256, num_experts_per_tok=8, norm_topk_prob=True,
                             intermediate_size=512),  # no dense MLP: the field is unused
    "qwen3_next": dict(_SHARED_DEFAULTS, **_MOE_DEFAULTS, vocab_size=151936, hidden_size=2048,
                       intermediate_size=5632, num_hidden_layers=48, num_key_value_heads=2,
                       num_experts=512, num_experts_per_tok=10, norm_topk_prob=True),
}
HF_DEFAULTS = HF_DEFAULTS_BY_TYPE["qwen3_5_text"]
# Keys whose other values would make transformers compute what this model does not.
_MUST_BE = {"hidden_act": "silu", "attention_bias": False}
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
         "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
         "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval")
_MOE_INTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
             "shared_expert_intermediate_size")


def text_fields(hf: dict, path: str) -> dict:
    """The text model's keys: a multimodal `qwen3_5`/`qwen3_5_moe`'s `text_config`, or a
    text model's config.json whole."""
    model_type = hf.get("model_type")
    if model_type in NOT_BUILT:
        raise UserError(f"{path}: model_type {model_type!r} is not built: its "
                        f"{NOT_BUILT[model_type]} is not supported")
    if model_type in MULTIMODAL:
        return text_model(hf, path, MULTIMODAL[model_type], HF_DEFAULTS["tie_word_embeddings"])
    if model_type not in MODEL_TYPES:
        raise UserError(f"{path}: model_type {model_type!r} is not a Qwen3.5 model (supported: "
                        f"{', '.join(MODEL_TYPES)}, and the text model of "
                        f"{', '.join(MULTIMODAL)})")
    return hf


def _sparse_layers(hf: dict, path: str):
    """Qwen3-Next's decoder_sparse_step and mlp_only_layers: only every layer a mixture of
    experts is built (the published checkpoints' 1 and [])."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise UserError(f"{path}: decoder_sparse_step={step}, mlp_only_layers={dense} is not "
                        f"supported (this Qwen3-Next model builds every layer's MLP as experts:"
                        f" decoder_sparse_step=1, mlp_only_layers=[])")


def _rope(hf: dict, path: str) -> dict:
    """rope_parameters as transformers 5 reads them (or 4.x's rope_theta and
    partial_rotary_factor at the top level); only the default rope is implemented."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{path}: rope_parameters must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    defaults = HF_DEFAULTS_BY_TYPE[hf["model_type"]] if hf.get("model_type") in \
        HF_DEFAULTS_BY_TYPE else HF_DEFAULTS
    if rope_type != "default":
        raise UserError(f"{path}: rope_parameters.rope_type={rope_type!r} is not supported "
                        f"(this Qwen3.5 model implements 'default')")
    get = lambda name: rope.get(name, hf.get(name, defaults[name]))
    return {"rope_theta": float(get("rope_theta")),
            "partial_rotary_factor": float(get("partial_rotary_factor"))}


def from_hf_dict(hf: dict, path: str = "config.json") -> Qwen35Config:
    """A Qwen35Config from config.json's keys; what this model would compute differently
    from transformers is a UserError naming `path` and the key."""
    hf = text_fields(hf, path)
    model_type = hf["model_type"]
    defaults = HF_DEFAULTS_BY_TYPE[model_type]
    moe = model_type in MOE_TYPES
    ints = _INTS + (_MOE_INTS if moe else ())
    get = config_fields(hf, path, defaults, ints, _MUST_BE, "this Qwen3.5 model")
    layer_types = hf_layer_types(hf, path, Qwen35Config.layer_type_choices)
    if model_type == "qwen3_next":
        _sparse_layers(hf, path)
    extra = {}
    if moe:
        extra = dict(norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                     output_router_logits=bool(get("output_router_logits")),
                     router_aux_loss_coef=float(get("router_aux_loss_coef")))
    try:
        config = Qwen35Config(
            **{name: get(name) for name in ints}, **_rope(hf, path), **extra,
            model_type=model_type,
            layer_types=",".join(layer_types or ()),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            rms_norm_eps=float(get("rms_norm_eps")),
            initializer_range=float(get("initializer_range")),
            bos_token_id=first_int(hf.get("bos_token_id")),
            eos_token_id=first_int(hf.get("eos_token_id")),
            pad_token_id=first_int(hf.get("pad_token_id")))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: a key has the wrong type ({e})") from None
    # layer_types that follow the interval are stored as the interval (the scan's period).
    if config.layer_types and config.replace(layer_types="").layer_kinds() == config.layer_kinds():
        config = config.replace(layer_types="")
    return config




# -------------------------------------------------------------------- presets
# Qwen3.5's dense text models as their model cards describe them (written from knowledge,
# no hub access where this was written; tests/test_qwen3_5.py counts their parameters
# with transformers and against the cards' sizes, the vision tower left out). Token ids are
# the checkpoint's (read from hf::DIR); the presets are shapes.
_QWEN35 = dict(vocab_size=248320, head_dim=256, num_key_value_heads=4,
               linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, full_attention_interval=4, partial_rotary_factor=0.25,
               rope_theta=10_000_000.0, max_position_embeddings=262144, rms_norm_eps=1e-6)

# Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B share these (transformers' config defaults are
# those checkpoints').
_MOE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
            linear_num_value_heads=32, moe_intermediate_size=512,
            shared_expert_intermediate_size=512)
_DEBUG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
              partial_rotary_factor=0.25, rope_theta=10_000.0, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
_DEBUG_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48)

QWEN35_PRESETS: dict[str, dict[str, Any]] = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens and ids
    # (pad 0, BOS 1, EOS 2), three Gated DeltaNet layers then one full-attention layer.
    "debug": _DEBUG,
    "qwen3_5_9b": dict(_QWEN35, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, linear_num_value_heads=32),
    "qwen3_5_27b": dict(_QWEN35, hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, linear_num_value_heads=48),
    # The mixtures of experts, tiny: "debug"'s layers with 4 experts (2 a token) of width 32
    # beside a shared expert of 48 (intermediate_size: transformers' default, unused by
    # qwen3_5_moe_text, the dense MLP of qwen3_next layers the file may declare).
    "debug_moe": dict(_DEBUG, model_type="qwen3_5_moe_text", intermediate_size=512,
                      **_DEBUG_MOE),
    "debug_next": dict(_DEBUG, model_type="qwen3_next", intermediate_size=5632, **_DEBUG_MOE),
    "qwen3_5_35b_a3b": dict(_QWEN35, **_MOE, model_type="qwen3_5_moe_text", num_hidden_layers=40,
                            num_experts=256, num_experts_per_tok=8, intermediate_size=512),
    "qwen3_next_80b_a3b": dict(_QWEN35, **_MOE, model_type="qwen3_next", vocab_size=151936,
                               num_hidden_layers=48, num_experts=512, num_experts_per_tok=10,
                               intermediate_size=5632),
}
