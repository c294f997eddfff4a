"""OLMo 3 configuration: one dataclass, config.json as transformers 5 reads `Olmo3Config`,
and the presets.

OLMo 3 is a dense decoder whose layers are sliding-window (`sliding_attention`) or global
(`full_attention`), three sliding then one global by default (`layer_types`); each kind has
its own rotary (the global layers' with YaRN in the released 7B/32B configs). What differs
from LLaMA is in easylm/olmo3/model.py: post-norm and the q/k norms over all heads.
"""

import dataclasses

from easylm.errors import UserError
from easylm.models import rope
from easylm.models.config import ModelConfig, default, field
from easylm.models.hf_checkpoint import config_fields, first_int, layer_types as hf_layer_types

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "yarn")


@dataclasses.dataclass(frozen=True)
class Olmo3Config(ModelConfig):
    """OLMo 3: the shared fields (easylm/models/config.py) with Olmo3Config's defaults, and
    these."""

    section = "olmo3"
    layer_type_choices = LAYER_TYPES

    vocab_size: int = default(50304)
    max_position_embeddings: int = default(2048)
    rms_norm_eps: float = default(1e-5)
    bos_token_id: int | None = default(None)
    eos_token_id: int | None = default(50279)
    pad_token_id: int | None = default(1)

    attention_bias: bool = field(False, "biases on the q, k, v and o projections")
    sliding_window: int = field(4096, "a sliding layer's query attends to at most this many "
                                      "positions, itself included")
    layer_types: str = field("", "comma-separated sliding_attention/full_attention, one per "
                                 "layer; empty: every 4th layer full, the others sliding")
    rope_theta: float = field(500_000.0, "rotary base of the global (full attention) layers")
    sliding_rope_theta: float = field(500_000.0, "rotary base of the sliding-window layers")
    rope_type: str = field("default", "the global layers' rotary: default or yarn")
    rope_factor: float = field(1.0, "YaRN factor (global layers)")
    rope_original_max_position_embeddings: int = field(8192, "YaRN's original context")
    rope_beta_fast: float = field(32.0, "YaRN beta_fast")
    rope_beta_slow: float = field(1.0, "YaRN beta_slow")
    rope_attention_factor: float = field(0.0, "YaRN's factor on cos and sin; 0: "
                                              "0.1 ln(factor) + 1, transformers' default")

    def __post_init__(self):
        super().__post_init__()  # the shared checks, layer_types among them
        checks = (
            (self.rope_type in ROPE_TYPES,
             f"rope_type={self.rope_type!r} is not one of {', '.join(ROPE_TYPES)}"),
            (self.sliding_window >= 1, f"sliding_window must be >= 1, got {self.sliding_window}"),
        )
        for ok, message in checks:
            if not ok:
                raise UserError(f"--olmo3.{message}")

    def layer_kinds(self) -> tuple[str, ...]:
        if self.layer_types:
            return tuple(self.layer_types.split(","))
        return tuple("full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                     for i in range(self.num_hidden_layers))

    def rotary(self, kind: str):
        """(inverse frequencies (H/2,), attention factor) of a layer of `kind`."""
        if kind == "sliding_attention":
            return rope.default(self.sliding_rope_theta, self.head_dim)
        if self.rope_type == "default":
            return rope.default(self.rope_theta, self.head_dim)
        return rope.yarn(self.rope_theta, self.head_dim, self.rope_factor,
                         self.rope_original_max_position_embeddings, self.rope_beta_fast,
                         self.rope_beta_slow, attention_factor=self.rope_attention_factor or None)

    # --------------------------------------------------------------- counting

    def _vectors_per_layer(self) -> int:
        """Norms (post-attention, post-MLP, q over N*H, k over K*H) and biases."""
        d, q, kv = (self.hidden_size, self.num_attention_heads * self.head_dim,
                    self.num_key_value_heads * self.head_dim)
        return 2 * d + q + kv + ((q + 2 * kv + d) if self.attention_bias else 0)

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = d * (q + 2 * kv) + q * d + 3 * d * f + self._vectors_per_layer()
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_hidden_layers * layer + d + head

    def num_matmul_parameters(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        vectors = self.num_hidden_layers * self._vectors_per_layer() + d
        head = v * d if self.tie_word_embeddings else 0
        return self.num_parameters() - v * d - vectors + head

    def flops_per_token(self, seq_length: int) -> float:
        """6N + 12 d_attn keys per layer (PaLM appendix B), a sliding layer's keys its window."""
        width = self.num_attention_heads * self.head_dim
        keys = [min(seq_length, self.sliding_window) if kind == "sliding_attention"
                else seq_length for kind in self.layer_kinds()]
        return 6 * self.num_matmul_parameters() + 12 * width * sum(keys)

    # ---------------------------------------------------- HF transformers

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "Olmo3Config":
        return from_hf_dict(hf, path)

    def to_hf_config(self):
        """transformers' Olmo3Config (architectures Olmo3ForCausalLM)."""
        from transformers import Olmo3Config as HFConfig

        full = {"rope_type": self.rope_type, "rope_theta": float(self.rope_theta)}
        if self.rope_type == "yarn":
            full.update(factor=float(self.rope_factor), beta_fast=float(self.rope_beta_fast),
                        beta_slow=float(self.rope_beta_slow), original_max_position_embeddings=int(
                            self.rope_original_max_position_embeddings))
            if self.rope_attention_factor:
                full["attention_factor"] = float(self.rope_attention_factor)
        config = HFConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
            sliding_window=self.sliding_window, layer_types=list(self.layer_kinds()),
            rope_parameters={"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": float(self.sliding_rope_theta)}},
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id, hidden_act="silu")
        config.architectures = ["Olmo3ForCausalLM"]
        return config


# ------------------------------------------------------------- config.json

# Olmo3Config's defaults: what transformers assumes for a field config.json omits.
HF_DEFAULTS = dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008,
                   num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                   initializer_range=0.02, rms_norm_eps=1e-5, pad_token_id=1, bos_token_id=None,
                   eos_token_id=50279, tie_word_embeddings=False, attention_bias=False,
                   sliding_window=4096, rope_theta=500_000.0)
_MUST_BE = {"hidden_act": "silu"}
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "max_position_embeddings", "sliding_window")


def from_hf_dict(hf: dict, path: str = "config.json") -> Olmo3Config:
    """An Olmo3Config from config.json's fields; what this model would compute differently
    from transformers is a UserError naming `path` and the field."""
    if hf.get("model_type") != "olmo3":
        raise UserError(f"{path}: model_type {hf.get('model_type')!r} is not an OLMo 3 model "
                        f"(olmo3)")
    get = config_fields(hf, path, HF_DEFAULTS, _INTS, _MUST_BE, "OLMo 3")
    kinds = hf_layer_types(hf, path, LAYER_TYPES)
    full, sliding = _rope(hf, path)
    heads = get("num_attention_heads")
    try:
        return Olmo3Config(
            **{name: get(name) for name in _INTS},
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or get("hidden_size") // heads,
            layer_types=",".join(kinds) if kinds else "",
            rms_norm_eps=float(get("rms_norm_eps")),
            initializer_range=float(get("initializer_range")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=bool(get("attention_bias")),
            rope_theta=float(full["rope_theta"]), sliding_rope_theta=float(sliding["rope_theta"]),
            **_yarn_fields(full),
            bos_token_id=first_int(hf.get("bos_token_id", HF_DEFAULTS["bos_token_id"])),
            eos_token_id=first_int(hf.get("eos_token_id", HF_DEFAULTS["eos_token_id"])),
            pad_token_id=first_int(hf.get("pad_token_id", HF_DEFAULTS["pad_token_id"])))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: a field has the wrong type ({e})") from None


def _rope(hf: dict, path: str) -> tuple[dict, dict]:
    """(full, sliding) rope parameters as Olmo3Config derives them: rope_parameters per
    kind, or the older top-level rope_theta with rope_scaling on the global layers."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - set(LAYER_TYPES):
        raise UserError(f"{path}: rope_parameters must map sliding_attention and full_attention "
                        f"to their rope settings, got {params!r}")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise UserError(f"{path}: rope_scaling must be an object, got {scaling!r}")
        full.update(scaling)
    theta = hf.get("rope_theta", HF_DEFAULTS["rope_theta"])
    for kind, params in (("full_attention", full), ("sliding_attention", sliding)):
        params.setdefault("rope_theta", theta)
        if not isinstance(params["rope_theta"], (int, float)):
            raise UserError(f"{path}: the {kind} layers' rope_theta must be a number, got "
                            f"{params['rope_theta']!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        allowed = ROPE_TYPES if kind == "full_attention" else ("default",)
        if rope_type not in allowed:
            raise UserError(f"{path}: the {kind} layers' rope type {rope_type!r} is not "
                            f"implemented (supported: {', '.join(allowed)})")
        params["rope_type"] = rope_type
    return full, sliding


def _yarn_fields(full: dict) -> dict:
    if full["rope_type"] != "yarn":
        return {}
    unsupported = {"mscale", "mscale_all_dim"} & {k for k, v in full.items() if v is not None}
    if unsupported or full.get("truncate", True) is not True:
        raise UserError(f"YaRN's {', '.join(sorted(unsupported)) or 'truncate=false'} is not "
                        f"supported for OLMo 3")
    return dict(rope_type="yarn", rope_factor=float(full["factor"]),
                rope_original_max_position_embeddings=int(
                    full["original_max_position_embeddings"]),
                rope_beta_fast=float(full.get("beta_fast") or 32.0),
                rope_beta_slow=float(full.get("beta_slow") or 1.0),
                rope_attention_factor=float(full.get("attention_factor") or 0.0))



# -------------------------------------------------------------------- presets
# allenai/Olmo-3-1025-7B and Olmo-3-1125-32B as their config.json files have them (written
# from knowledge, no hub access where this was written): three sliding layers (window
# 4096) then one global, whose rotary is YaRN (factor 8 over an 8,192 context, attention
# factor 1.2079) for 65,536 positions; tokenizer dolma2 (100,278 ids).
_OLMO3 = dict(vocab_size=100278, max_position_embeddings=65536, rms_norm_eps=1e-6,
              sliding_window=4096, rope_theta=500_000.0, sliding_rope_theta=500_000.0,
              rope_type="yarn", rope_factor=8.0, rope_original_max_position_embeddings=8192,
              rope_attention_factor=1.2079441541679836, bos_token_id=None,
              eos_token_id=100257, pad_token_id=100277)

OLMO3_PRESETS = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens, a
    # window shorter than a test's rows, 3 sliding layers then a global one.
    "debug": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "olmo3_7b": dict(_OLMO3, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32),
    "olmo3_32b": dict(_OLMO3, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                      num_attention_heads=40, num_key_value_heads=8),
}
