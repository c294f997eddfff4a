"""Gemma 4 text model configuration: one dataclass, config.json, the presets.

config.json is read as transformers 5 reads `Gemma4TextConfig`: a `gemma4_text` file, or
the `text_config` of a multimodal `gemma4` one (its vision and audio towers are not this
model). The global (full-attention) layers' own head size and key/value heads come from
`per_layer_config` (what `save_pretrained` writes) or from `global_head_dim` and
`num_global_key_value_heads` (what the released files say); transformers gives the global
layers num_global_key_value_heads only with attention_k_eq_v, and so does this reader.
A key the file leaves out takes Gemma4TextConfig's default.
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
from easylm.models.moe import MoEConfig

ROPE_TYPES = ("default", "proportional")


@dataclasses.dataclass(frozen=True)
class Gemma4Config(ModelConfig):
    """Gemma 4's text model: the shared fields with Gemma4TextConfig's defaults, and these.
    `head_dim` and `num_key_value_heads` are the sliding layers'."""

    section = "gemma4"
    routed_experts_field = "num_experts"
    experts_per_token_field = "top_k_experts"
    layer_type_choices = LAYER_TYPES[:2]  # sliding_attention, full_attention

    vocab_size: int = default(262144)
    hidden_size: int = default(2304)
    intermediate_size: int = default(9216)
    num_hidden_layers: int = default(30)
    num_attention_heads: int = default(8)
    num_key_value_heads: int = default(4)
    head_dim: int = default(256)
    tie_word_embeddings: bool = default(True)
    max_position_embeddings: int = default(131072)
    bos_token_id: int = default(2)
    eos_token_id: int = default(1)
    pad_token_id: int | None = default(0)

    # Attention.
    sliding_window: int = field(512, "a sliding layer's query attends to at most this many "
                                     "positions, itself included")
    layer_types: str = field("", "comma-separated sliding_attention/full_attention, one per "
                                 "layer (the last is always full); empty: every 6th full")
    global_head_dim: int = field(512, "head width of the full-attention layers")
    num_global_key_value_heads: int = field(0, "key/value heads of the full-attention "
                                               "layers; 0: num_key_value_heads")
    attention_k_eq_v: bool = field(False, "full-attention layers have no v_proj: the keys "
                                          "(before their norm and rotary) are the values")
    num_kv_shared_layers: int = field(0, "the last n layers compute no keys/values: each "
                                         "attends over those of the last earlier layer of "
                                         "its kind, and caches nothing")
    # Per-layer inputs (PLE).
    hidden_size_per_layer_input: int = field(256, "width of each layer's per-layer input "
                                                  "(a second embedding table); 0: none")
    vocab_size_per_layer_input: int = field(262144, "rows of the per-layer input table")
    # MLP and experts.
    use_double_wide_mlp: bool = field(False, "the KV-shared layers' MLPs are twice as wide")
    enable_moe_block: bool = field(False, "each layer adds a mixture of experts beside its "
                                          "MLP (routed on the residual, on its own norms)")
    num_experts: int = field(0, "experts of the MoE block")
    top_k_experts: int = field(0, "experts each token takes")
    moe_intermediate_size: int = field(0, "one expert's MLP width")
    capacity_factor: float = field(0.0, "an expert takes at most ceil(c * tokens * k / E) "
                                        "pairs of a batch shard (0: dropless)")
    router_aux_loss_coef: float = field(0.0, "weight of the load-balancing loss in training "
                                             "(Gemma 4 trains without one)")
    # Numerics.
    rope_theta: float = field(1_000_000.0, "rotary base of the full-attention layers")
    rope_partial_rotary_factor: float = field(0.25, "share of a full-attention head's "
                                                    "frequencies that rotate (proportional "
                                                    "rope; 1: all)")
    rope_scaling_factor: float = field(1.0, "full-attention frequencies divided by this")
    rope_local_base_freq: float = field(10_000.0, "rotary base of the sliding layers")
    final_logit_softcapping: float = field(0.0, "logits = c * tanh(logits / c); 0: none")

    def __post_init__(self):
        super().__post_init__()
        fail = lambda msg: UserError(f"--gemma4.{msg}")
        if self.num_attention_heads % self.global_kv_heads():
            raise fail(f"num_global_key_value_heads={self.global_kv_heads()} must divide "
                       f"num_attention_heads={self.num_attention_heads}")
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise fail(f"num_kv_shared_layers={self.num_kv_shared_layers} must be in 0.."
                       f"{self.num_hidden_layers - 1}")
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if self.num_kv_shared_layers and set(self.layer_kinds()[:first]) != set(
                self.layer_kinds()):
            raise fail("num_kv_shared_layers: a shared layer's kind has no earlier layer of "
                       "that kind to take keys/values from")
        if self.enable_moe_block and not (0 < self.top_k_experts <= self.num_experts
                                          and self.moe_intermediate_size > 0):
            raise fail(f"enable_moe_block needs 0 < top_k_experts ({self.top_k_experts}) <= "
                       f"num_experts ({self.num_experts}) and moe_intermediate_size > 0")
        if self.final_logit_softcapping and self.loss_chunk_size:
            raise fail("loss_chunk_size is not supported with final_logit_softcapping (the "
                       "chunked loss applies the head without the cap)")

    # ----------------------------------------------------------------- layers

    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention (HF's names): every 6th full unless layer_types says;
        the last always full, as transformers forces it."""
        kinds = (self.layer_types.split(",") if self.layer_types else
                 ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                  for i in range(self.num_hidden_layers)])
        return tuple(kinds[:-1]) + ("full_attention",)

    @property
    def routed_experts(self) -> int:
        return self.num_experts if self.enable_moe_block else 0

    def rotary_widths(self) -> dict[str, int]:
        return {"head_dim": self.head_dim, "global_head_dim": self.global_head_dim}

    def kv_shared(self) -> tuple[bool, ...]:
        """Whether each layer takes its keys/values from an earlier layer."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        return tuple(i >= first for i in range(self.num_hidden_layers))

    def global_kv_heads(self) -> int:
        return self.num_global_key_value_heads or self.num_key_value_heads

    def attention_shape(self, kind: str) -> tuple[int, int]:
        """(key/value heads, head width) of a layer of `kind`."""
        if kind == "full_attention":
            return self.global_kv_heads(), self.global_head_dim
        return self.num_key_value_heads, self.head_dim

    def moe(self) -> MoEConfig:
        return MoEConfig(num_experts=self.num_experts, num_experts_per_tok=self.top_k_experts,
                         intermediate_size=self.moe_intermediate_size, norm_topk_prob=True,
                         activation="gelu_tanh", capacity_factor=self.capacity_factor,
                         initializer_range=self.initializer_range)

    def router_loss(self):
        from easylm.models.moe import RouterLoss

        if not self.enable_moe_block:
            return None
        return RouterLoss(top_k=self.top_k_experts, aux_coef=self.router_aux_loss_coef)

    def shard_variant(self, layers: int, mp: int):
        """ModelConfig's, every layer computing its own keys/values (a sample of 1 or 2
        layers has no earlier layer to share with; a shared layer's activations are a few
        (B, T, K, H) fewer, so the planner errs high) and the global kv heads split too."""
        variant = ModelConfig.shard_variant(self.replace(num_kv_shared_layers=0), layers, mp)
        return variant.replace(num_global_key_value_heads=-(-self.global_kv_heads() // mp))

    # --------------------------------------------------------------- counting

    def _layer_counts(self, kind: str, shared: bool) -> tuple[int, int]:
        """(matmul parameters, vector parameters) of one layer."""
        d, n = self.hidden_size, self.num_attention_heads
        k, h = self.attention_shape(kind)
        kv = 0 if shared else (1 if self.attention_k_eq_v and kind == "full_attention"
                               else 2) * d * k * h
        f = self.intermediate_size * (2 if self.use_double_wide_mlp and shared else 1)
        matmul = 2 * d * n * h + kv + 3 * d * f
        vectors = 4 * d + 1 + h + (0 if shared else h)  # norms, layer_scalar, q/k norms
        if self.hidden_size_per_layer_input:
            matmul += 2 * d * self.hidden_size_per_layer_input
            vectors += d
        if self.enable_moe_block:
            e = self.num_experts
            matmul += d * e + 3 * e * d * self.moe_intermediate_size
            vectors += 3 * d + d + e
        return matmul, vectors

    def num_parameters(self) -> int:
        """Parameters of the model as built (the embedding counted once when tied)."""
        d, v, L = self.hidden_size, self.vocab_size, self.num_hidden_layers
        total = sum(sum(self._layer_counts(kind, s))
                    for kind, s in zip(self.layer_kinds(), self.kv_shared()))
        p = self.hidden_size_per_layer_input
        ple = self.vocab_size_per_layer_input * L * p + d * L * p + p if p else 0
        return v * d + total + ple + d + (0 if self.tie_word_embeddings else v * d)

    def num_matmul_parameters(self) -> int:
        """N of 6N FLOPs a token: projections, MLPs, the experts a token takes, the head;
        not the lookups or norms."""
        d, L = self.hidden_size, self.num_hidden_layers
        total = sum(self._layer_counts(kind, s)[0]
                    for kind, s in zip(self.layer_kinds(), self.kv_shared()))
        if self.enable_moe_block:  # only the chosen experts compute
            total -= L * 3 * (self.num_experts - self.top_k_experts) * d * \
                self.moe_intermediate_size
        p = self.hidden_size_per_layer_input
        return total + (d * L * p if p else 0) + self.vocab_size * d

    def flops_per_token(self, seq_length: int) -> float:
        """6*N + 12*d_attn*keys per layer (PaLM appendix B), the keys a query sees being
        the window on sliding layers."""
        keys = 0
        for kind in self.layer_kinds():
            _, h = self.attention_shape(kind)
            seen = min(seq_length, self.sliding_window) if kind == "sliding_attention" \
                else seq_length
            keys += self.num_attention_heads * h * seen
        return 6 * self.num_matmul_parameters() + 12 * keys

    # ---------------------------------------------------- HF transformers

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "Gemma4Config":
        return from_hf_dict(hf, path)

    def to_hf_config(self):
        """transformers' Gemma4TextConfig (architectures Gemma4ForCausalLM)."""
        from transformers import Gemma4TextConfig

        full = {"rope_type": "proportional", "rope_theta": float(self.rope_theta),
                "partial_rotary_factor": float(self.rope_partial_rotary_factor)}
        if self.rope_scaling_factor != 1.0:
            full["factor"] = float(self.rope_scaling_factor)
        kinds = self.layer_kinds()
        k, h = self.attention_shape("full_attention")
        config = Gemma4TextConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": float(self.rope_local_base_freq)}},
            sliding_window=self.sliding_window, layer_types=list(kinds),
            per_layer_config={i: {"head_dim": h, "num_key_value_heads": k}
                              for i, kind in enumerate(kinds) if kind == "full_attention"},
            attention_k_eq_v=self.attention_k_eq_v,
            num_kv_shared_layers=self.num_kv_shared_layers,
            hidden_size_per_layer_input=self.hidden_size_per_layer_input,
            vocab_size_per_layer_input=self.vocab_size_per_layer_input,
            use_double_wide_mlp=self.use_double_wide_mlp,
            enable_moe_block=self.enable_moe_block,
            num_experts=self.num_experts or None, top_k_experts=self.top_k_experts or None,
            moe_intermediate_size=self.moe_intermediate_size or None,
            final_logit_softcapping=self.final_logit_softcapping or None,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            hidden_activation="gelu_pytorch_tanh")
        config.architectures = ["Gemma4ForCausalLM"]
        return config


# ------------------------------------------------------------- config.json

# Gemma4TextConfig's defaults: what transformers assumes for a field config.json omits.
HF_DEFAULTS = dict(
    vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
    initializer_range=0.02, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, sliding_window=512, vocab_size_per_layer_input=262144,
    hidden_size_per_layer_input=256, attention_k_eq_v=False, num_kv_shared_layers=0,
    enable_moe_block=False, use_double_wide_mlp=False, global_head_dim=512)
# Fields whose other values would make transformers compute something this model does not
# (use_bidirectional_attention="vision" concerns vision tokens only: text is causal).
_MUST_BE = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
         "sliding_window", "vocab_size_per_layer_input", "hidden_size_per_layer_input",
         "num_kv_shared_layers", "global_head_dim")


def text_fields(hf: dict, path: str) -> dict:
    """The text model's fields: a `gemma4`'s `text_config`, or the whole `gemma4_text`."""
    model_type = hf.get("model_type")
    if model_type == "gemma4":
        return text_model(hf, path, "gemma4_text", tied=True)
    if model_type != "gemma4_text":
        raise UserError(f"{path}: model_type {model_type!r} is not a Gemma 4 model (supported: "
                        f"gemma4_text, and the text model of gemma4)")
    return hf


def from_hf_dict(hf: dict, path: str = "config.json") -> Gemma4Config:
    """A Gemma4Config from config.json's fields; what this model would compute differently
    from transformers is a UserError naming `path` and the field."""
    hf = text_fields(hf, path)
    if "hidden_size_per_layer_input" in hf and not hf["hidden_size_per_layer_input"]:
        hf = {**hf, "hidden_size_per_layer_input": 0}  # null: no per-layer inputs
    get = config_fields(hf, path, HF_DEFAULTS, _INTS, _MUST_BE, "this Gemma 4 model")
    if hf.get("use_bidirectional_attention") not in (None, "vision"):
        raise UserError(f"{path}: use_bidirectional_attention="
                        f"{hf['use_bidirectional_attention']!r} is not supported (text "
                        f"tokens attend causally here)")
    layers = get("num_hidden_layers")
    kinds = hf_layer_types(hf, path, Gemma4Config.layer_type_choices) or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    global_kv, global_h = _global_attention(hf, path, kinds, get)
    full, local = _rope(hf, path)
    moe = bool(get("enable_moe_block"))
    try:
        return Gemma4Config(
            **{name: get(name) for name in _INTS if name != "global_head_dim"},
            global_head_dim=global_h, layer_types=",".join(kinds[:-1] + ["full_attention"]),
            num_global_key_value_heads=global_kv if global_kv != get("num_key_value_heads")
            else 0,
            attention_k_eq_v=bool(get("attention_k_eq_v")),
            use_double_wide_mlp=bool(get("use_double_wide_mlp")), enable_moe_block=moe,
            num_experts=int(hf.get("num_experts") or 0) if moe else 0,
            top_k_experts=int(hf.get("top_k_experts") or 0) if moe else 0,
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0) if moe else 0,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(full["rope_theta"]),
            rope_partial_rotary_factor=float(full.get("partial_rotary_factor", 1.0)),
            rope_scaling_factor=float(full.get("factor", 1.0)),
            rope_local_base_freq=float(local["rope_theta"]),
            final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0),
            initializer_range=float(get("initializer_range")),
            bos_token_id=first_int(get("bos_token_id")),
            eos_token_id=first_int(get("eos_token_id")),
            pad_token_id=first_int(hf.get("pad_token_id", HF_DEFAULTS["pad_token_id"])))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: a field has the wrong type ({e})") from None


def _global_attention(hf: dict, path: str, kinds, get) -> tuple[int, int]:
    """(key/value heads, head width) of the full-attention layers: per_layer_config's
    (one override for every full layer, none for sliding ones), else transformers' rule."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        heads = hf.get("num_global_key_value_heads") if get("attention_k_eq_v") else None
        return int(heads or get("num_key_value_heads")), int(get("global_head_dim"))
    if not isinstance(overrides, dict):
        raise UserError(f"{path}: per_layer_config must map layer indices to overrides")
    found = set()
    for i, kind in enumerate(kinds[:-1] + ["full_attention"]):
        o = overrides.get(str(i), overrides.get(i)) or {}
        if set(o) - {"head_dim", "num_key_value_heads"}:
            raise UserError(f"{path}: per_layer_config[{i}] overrides {sorted(o)}; only "
                            f"head_dim and num_key_value_heads are supported")
        shape = (int(o.get("num_key_value_heads", get("num_key_value_heads"))),
                 int(o.get("head_dim", get("head_dim"))))
        if kind == "sliding_attention" and o:
            raise UserError(f"{path}: per_layer_config overrides sliding layer {i}; only "
                            f"the full-attention layers may differ")
        if kind == "full_attention":
            found.add(shape)
    if len(found) > 1:
        raise UserError(f"{path}: per_layer_config gives the full-attention layers different "
                        f"shapes {sorted(found)}; one shape is supported")
    return found.pop()


def _rope(hf: dict, path: str) -> tuple[dict, dict]:
    """(full, sliding) rope parameters; default and proportional types only."""
    params = hf.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0}}
    if not isinstance(params, dict) or set(params) - set(Gemma4Config.layer_type_choices):
        raise UserError(f"{path}: rope_parameters must map sliding_attention and full_attention "
                        f"to their rope settings, got {params!r}")
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    for kind, rope in (("full_attention", full), ("sliding_attention", local)):
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES or not isinstance(rope.get("rope_theta"), (int, float)):
            raise UserError(f"{path}: rope_parameters.{kind} {rope!r}: a rope_type of "
                            f"{', '.join(ROPE_TYPES)} with a numeric rope_theta is supported")
        if rope_type == "default":
            rope.pop("partial_rotary_factor", None)
            rope.pop("factor", None)
        if kind == "sliding_attention" and (rope.get("partial_rotary_factor", 1.0) != 1.0
                                            or rope.get("factor", 1.0) != 1.0):
            raise UserError(f"{path}: rope_parameters.sliding_attention {rope!r}: partial or "
                            f"scaled rope on sliding layers is not supported")
    return full, local




# -------------------------------------------------------------------- presets

def _every(n: int, layers: int) -> str:
    """layer_types with every n-th layer full."""
    return ",".join("full_attention" if (i + 1) % n == 0 else "sliding_attention"
                    for i in range(layers))


_GEMMA4 = dict(vocab_size=262144, vocab_size_per_layer_input=262144, num_attention_heads=8,
               head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
               sliding_window=512, max_position_embeddings=131072, rope_theta=1_000_000.0,
               rope_partial_rotary_factor=0.25, rope_local_base_freq=10_000.0,
               final_logit_softcapping=30.0, rms_norm_eps=1e-6, bos_token_id=2,
               eos_token_id=1, pad_token_id=0)

GEMMA4_PRESETS: dict[str, dict[str, Any]] = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens and ids
    # (pad 0, BOS 1, EOS 2), a window shorter than a test's rows, per-layer inputs, the
    # global layers' own head size, keys as values and two KV-shared layers.
    "debug": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                  num_kv_shared_layers=2, sliding_window=8,
                  layer_types="sliding_attention,sliding_attention,full_attention,"
                              "sliding_attention,sliding_attention,full_attention",
                  hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
                  max_position_embeddings=512, rope_local_base_freq=1_000.0,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # The released models' text config.json, as transcribed in public code that reads them
    # (written here without hub access; `--load_checkpoint=hf::DIR` reads the real file).
    # E2B and E4B: per-layer inputs and KV sharing; E2B's shared layers' MLPs double wide.
    "gemma4_e2b": dict(_GEMMA4, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
                       num_key_value_heads=1, num_kv_shared_layers=20,
                       use_double_wide_mlp=True, layer_types=_every(5, 35)),
    "gemma4_e4b": dict(_GEMMA4, hidden_size=2560, intermediate_size=10240,
                       num_hidden_layers=42, num_key_value_heads=2, num_kv_shared_layers=18,
                       layer_types=_every(6, 42)),
    # 26B-A4B: 128 experts (8 a token) beside a small MLP, keys as values on the global
    # layers, no per-layer inputs, no KV sharing.
    "gemma4_26b_a4b": dict(_GEMMA4, hidden_size=2816, intermediate_size=2112,
                           num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
                           num_global_key_value_heads=2, attention_k_eq_v=True,
                           hidden_size_per_layer_input=0, sliding_window=1024,
                           max_position_embeddings=262144, layer_types=_every(6, 30),
                           enable_moe_block=True, num_experts=128, top_k_experts=8,
                           moe_intermediate_size=704),
}
