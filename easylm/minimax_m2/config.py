"""MiniMax-M2 (M2, M2.1, M2.5, M2.7) configuration: one dataclass and config.json as
transformers 5 reads `MiniMaxM2Config`.

Every layer attends with the shared grouped-query attention (easylm/models/decoder.py), its
q and k RMS-normalised over all heads at once and rotary on the first
`partial_rotary_factor` of each head's dims (half-split), then routes every token to
`num_experts_per_tok` of `n_routed_experts` experts: DeepSeek-V3's sigmoid routing
(easylm/models/sigmoid_moe.py) with one group, no shared expert and no scaling, the
chosen weights divided by their sum. transformers' `intermediate_size` is the expert width
(`moe_intermediate_size` here, as Mixtral's).
"""

import dataclasses

from easylm.errors import UserError
from easylm.models.config import default
from easylm.models.hf_checkpoint import config_fields, first_int
from easylm.models.sigmoid_moe_decoder import PartialRotaryMoEConfig, check_model_type


@dataclasses.dataclass(frozen=True)
class MiniMaxM2Config(PartialRotaryMoEConfig):
    section = "minimax_m2"

    vocab_size: int = default(200064)
    hidden_size: int = default(3072)
    intermediate_size: int = default(1536)
    num_hidden_layers: int = default(62)
    num_attention_heads: int = default(48)
    num_key_value_heads: int | None = default(8)
    head_dim: int | None = default(128)
    max_position_embeddings: int = default(196608)
    bos_token_id: int | None = default(200034)
    eos_token_id: int | None = default(200020)
    moe_intermediate_size: int = default(1536)
    n_routed_experts: int = default(256)
    n_shared_experts: int = default(0)
    num_experts_per_tok: int = default(8)
    n_group: int = default(1)
    topk_group: int = default(1)
    first_k_dense_replace: int = default(0)
    routed_scaling_factor: float = default(1.0)

    rope_theta: float = default(5_000_000.0)

    def __post_init__(self):
        super().__post_init__()
        if (self.n_group, self.topk_group, self.n_shared_experts, self.first_k_dense_replace,
                self.routed_scaling_factor) != (1, 1, 0, 0, 1.0):
            raise UserError("--minimax_m2.n_group, topk_group, n_shared_experts, "
                            "first_k_dense_replace, routed_scaling_factor: MiniMax-M2 routes "
                            "over one group, no shared expert, no dense layer, no scaling "
                            "(1, 1, 0, 0, 1.0)")

    # --------------------------------------------------------------- counting

    def _attention_params(self) -> int:
        d, n, k, h = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                      self.head_dim)
        return d * (n + 2 * k) * h + n * h * d + (n + k) * h  # the q/k norms over all heads

    # ---------------------------------------------------- HF transformers

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "MiniMaxM2Config":
        return from_hf_dict(hf, path)

    def to_hf_config(self):
        from transformers import MiniMaxM2Config as HFConfig

        config = HFConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range, rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            num_experts_per_tok=self.num_experts_per_tok, num_local_experts=self.n_routed_experts,
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta),
                             "partial_rotary_factor": float(self.partial_rotary_factor)})
        config.architectures = ["MiniMaxM2ForCausalLM"]
        return config


# MiniMaxM2Config's defaults, and what this model implements of the rest.
HF_DEFAULTS = dict(vocab_size=200064, hidden_size=3072, intermediate_size=1536,
                   num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8,
                   head_dim=128, max_position_embeddings=196608, initializer_range=0.02,
                   rms_norm_eps=1e-6, bos_token_id=200034, eos_token_id=200020,
                   num_experts_per_tok=8, num_local_experts=256, rope_theta=5_000_000.0)
_MUST_BE = {"hidden_act": "silu", "router_jitter_noise": 0.0, "output_router_logits": False,
            "attention_bias": False, "use_qk_norm": True, "qk_norm_type": "per_layer",
            "scoring_func": "sigmoid", "use_routing_bias": True}
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
         "num_experts_per_tok", "num_local_experts")


def from_hf_dict(hf: dict, path: str = "config.json") -> MiniMaxM2Config:
    check_model_type(hf, path, "minimax_m2")
    get = config_fields(hf, path, HF_DEFAULTS, _INTS, _MUST_BE, "MiniMax-M2")
    rope = {**{k: hf[k] for k in ("rope_theta", "rotary_dim") if k in hf},
            **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf.get("rope_scaling"):
        raise UserError(f"{path}: rope_type {rope_type!r} / rope_scaling is not supported "
                        f"(MiniMax-M2 implements the default rotary)")
    factor = rope.get("partial_rotary_factor")
    if factor is None:  # the released files give rotary_dim, as transformers reads it
        factor = rope["rotary_dim"] / get("head_dim") if "rotary_dim" in rope else 1.0
    if hf.get("num_mtp_modules"):
        print(f"{path}: its {hf['num_mtp_modules']} multi-token-prediction module(s) are not "
              f"loaded (transformers skips them too)")
    try:
        return MiniMaxM2Config(
            **{name: get(name) for name in _INTS
               if name not in ("intermediate_size", "num_local_experts")},
            intermediate_size=get("intermediate_size"),
            moe_intermediate_size=get("intermediate_size"),
            n_routed_experts=get("num_local_experts"),
            rope_theta=float(rope.get("rope_theta", HF_DEFAULTS["rope_theta"])),
            partial_rotary_factor=float(factor),
            rms_norm_eps=float(get("rms_norm_eps")),
            initializer_range=float(get("initializer_range")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id", HF_DEFAULTS["bos_token_id"]),
            eos_token_id=first_int(hf.get("eos_token_id", HF_DEFAULTS["eos_token_id"])),
            pad_token_id=hf.get("pad_token_id"))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None



MINIMAX_M2_PRESETS = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens.
    "debug": dict(vocab_size=512, hidden_size=64, intermediate_size=32,
                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # MiniMaxAI/MiniMax-M2's config.json (written from knowledge): 62 layers of 256 experts
    # of width 1536, 8 per token; 48 query heads of 128 over 8 kv heads, rotary on 64 dims.
    "minimax_m2": dict(partial_rotary_factor=0.5, rope_theta=5_000_000.0),
}
