"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air configuration: one dataclass and config.json as
transformers 5 reads `Glm4MoeConfig`.

Every layer attends with the shared grouped-query attention (easylm/models/decoder.py):
biases on q, k and v with `attention_bias`, per-head q/k norms with `use_qk_norm`, rotary
on the first `partial_rotary_factor` of each head's dims (half-split). The first
`first_k_dense_replace` layers have a dense gated MLP (`intermediate_size`), the others
DeepSeek-V3's mixture of experts (easylm/models/sigmoid_moe.py: sigmoid scores, the
correction bias that picks, group-limited top-k, `n_shared_experts` shared experts).
"""

import dataclasses

from easylm.errors import UserError
from easylm.models.config import default, field
from easylm.models.hf_checkpoint import config_fields
from easylm.models.sigmoid_moe_decoder import (
    HF_MUST_BE,
    PartialRotaryMoEConfig,
    check_model_type,
    hf_common_fields,
    skip_mtp,
)


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig(PartialRotaryMoEConfig):
    section = "glm4_moe"

    vocab_size: int = default(151552)
    hidden_size: int = default(4096)
    intermediate_size: int = default(10944)
    num_hidden_layers: int = default(46)
    num_attention_heads: int = default(96)
    num_key_value_heads: int | None = default(8)
    head_dim: int | None = default(128)
    max_position_embeddings: int = default(131072)
    rms_norm_eps: float = default(1e-5)
    bos_token_id: int | None = default(None)
    eos_token_id: int | None = default(None)
    moe_intermediate_size: int = default(1408)
    n_routed_experts: int = default(128)
    n_group: int = default(1)
    topk_group: int = default(1)
    first_k_dense_replace: int = default(1)
    routed_scaling_factor: float = default(1.0)

    attention_bias: bool = field(False, "biases on q_proj, k_proj, v_proj")
    use_qk_norm: bool = field(False, "RMS-normalise each query and key head before rotary")

    # --------------------------------------------------------------- counting

    def _attention_params(self) -> int:
        d, n, k, h = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                      self.head_dim)
        bias = (n + 2 * k) * h if self.attention_bias else 0
        return d * (n + 2 * k) * h + n * h * d + bias + (2 * h if self.use_qk_norm else 0)

    # ---------------------------------------------------- HF transformers

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "Glm4MoeConfig":
        return from_hf_dict(hf, path)

    def to_hf_config(self):
        from transformers import Glm4MoeConfig as HFConfig

        config = HFConfig(
            **self.hf_config_kwargs(),
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            attention_bias=self.attention_bias, use_qk_norm=self.use_qk_norm,
            num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta),
                             "partial_rotary_factor": float(self.partial_rotary_factor)})
        config.architectures = ["Glm4MoeForCausalLM"]
        return config


_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
         "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_routed_experts",
         "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
         "first_k_dense_replace", "max_position_embeddings")


def from_hf_dict(hf: dict, path: str = "config.json") -> Glm4MoeConfig:
    check_model_type(hf, path, "glm4_moe")
    defaults = {f.name: f.default for f in dataclasses.fields(Glm4MoeConfig)}
    get = config_fields(hf, path, defaults, _INTS, HF_MUST_BE, "GLM-4.5")
    skip_mtp(path, hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")))
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta and partial_rotary_factor
    # at the top level (GLM-4.5's released config.json).
    rope = {**{k: hf[k] for k in ("rope_theta", "partial_rotary_factor") if k in hf},
            **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf.get("rope_scaling"):
        raise UserError(f"{path}: rope_type {rope_type!r} / rope_scaling is not supported "
                        f"(GLM-4.5 implements the default rotary)")
    num_heads = get("num_attention_heads")
    try:
        return Glm4MoeConfig(
            **{name: get(name) for name in _INTS},
            head_dim=hf.get("head_dim") or get("hidden_size") // num_heads,
            rope_theta=float(rope.get("rope_theta", defaults["rope_theta"])),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 defaults["partial_rotary_factor"])),
            attention_bias=bool(get("attention_bias")), use_qk_norm=bool(get("use_qk_norm")),
            **hf_common_fields(hf, get))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


GLM4_MOE_PRESETS = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens.
    "debug": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  attention_bias=True, use_qk_norm=True, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # zai-org/GLM-4.5-Air's config.json: 106,852.2M parameters, 12,803.0M active. The
    # planner (docs/model.md): full fine-tuning at rows of 4096 fits 32 H200s (fsdp=32,
    # 104.42 GiB a device), not 16 (166.60 GiB).
    "glm4_5_air": dict(rope_theta=1_000_000.0, attention_bias=True, routed_scaling_factor=1.0,
                       eos_token_id=151329, pad_token_id=151329),
}
