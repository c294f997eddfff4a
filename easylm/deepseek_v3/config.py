"""DeepSeek-V3 (also DeepSeek-R1, Kimi K2, Moonlight) configuration: one dataclass and
config.json as transformers 5 reads `DeepseekV3Config`.

Every layer attends with multi-head latent attention (easylm/models/mla.py); the first
`first_k_dense_replace` layers have a dense gated MLP (`intermediate_size`), the others
DeepSeek's mixture of experts (easylm/models/sigmoid_moe.py: sigmoid scores, the
correction bias that picks, group-limited top-k, `n_shared_experts` shared experts of
`moe_intermediate_size` each). Rotary is default or YaRN (with mscale / mscale_all_dim).

Mistral Small 4 (`model_type` mistral4, transformers' Mistral4ForCausalLM) is this model
with two changes, read from its config.json and written back as it: the router scores
with a softmax over the experts and has no correction bias, and each query is multiplied
by Llama 4's position scale (`llama_4_scaling_beta`, easylm/models/mla.py).
"""

import dataclasses

from easylm.errors import UserError
from easylm.models import rope
from easylm.models.config import default, field
from easylm.models.hf_checkpoint import config_fields, text_model
from easylm.models.mla import MLAConfig
from easylm.models import sigmoid_moe
from easylm.models.sigmoid_moe import SigmoidMoEConfig
from easylm.models.sigmoid_moe_decoder import (
    HF_MUST_BE,
    SigmoidMoEDecoderConfig,
    check_model_type,
    hf_common_fields,
    skip_mtp,
)


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(SigmoidMoEDecoderConfig):
    section = "deepseek_v3"

    vocab_size: int = default(129280)
    hidden_size: int = default(7168)
    intermediate_size: int = default(18432)
    num_hidden_layers: int = default(61)
    num_attention_heads: int = default(128)
    max_position_embeddings: int = default(4096)
    bos_token_id: int | None = default(0)
    eos_token_id: int | None = default(1)
    # The MoE fields' defaults (easylm/models/sigmoid_moe_decoder.py) are DeepSeek-V3's.

    model_type: str = field("deepseek_v3", "deepseek_v3, or mistral4 (Mistral Small 4: a "
                                           "softmax router without correction bias, and "
                                           "llama_4_scaling_beta)")

    kv_lora_rank: int = field(512, "the key/value latent C (what the cache holds)")
    q_lora_rank: int = field(1536, "query latent width; 0: one q_proj")
    qk_rope_head_dim: int = field(64, "rotary dims of each query/key head")
    qk_nope_head_dim: int = field(128, "non-rotary dims of each query/key head")
    v_head_dim: int = field(128, "value head width")
    rope_theta: float = field(10_000.0, "rotary base")
    rope_interleave: bool = field(True, "the checkpoint stores rotary dims as pairs")
    attention_bias: bool = field(False, "biases on q_a_proj, kv_a_proj_with_mqa, o_proj")
    rope_type: str = field("default", "default or yarn")
    rope_factor: float = field(1.0, "YaRN factor")
    rope_original_max_position_embeddings: int = field(4096, "YaRN's original context")
    rope_beta_fast: float = field(32.0, "YaRN beta_fast")
    rope_beta_slow: float = field(1.0, "YaRN beta_slow")
    rope_mscale: float = field(0.0, "YaRN mscale (attention factor of cos/sin); 0: none")
    rope_mscale_all_dim: float = field(0.0, "YaRN mscale_all_dim (softmax scale); 0: none")
    llama_4_scaling_beta: float = field(
        0.0, "mistral4: queries at position p multiplied by 1 + beta * log(1 + floor(p / "
             "rope_original_max_position_embeddings)); 0: none")

    def __post_init__(self):
        super().__post_init__()
        if self.rope_type not in ("default", "yarn"):
            raise UserError(f"--{self.section}.rope_type={self.rope_type!r} is not one of "
                            f"default, yarn")
        flag = f"--{self.section}"
        if self.model_type not in MODEL_TYPES:
            raise UserError(f"{flag}.model_type={self.model_type!r} is not one of "
                            f"{', '.join(MODEL_TYPES)}")
        mistral4 = self.model_type == "mistral4"
        if self.llama_4_scaling_beta and not mistral4:
            raise UserError(f"{flag}.llama_4_scaling_beta={self.llama_4_scaling_beta}: "
                            f"Llama 4's query scale is mistral4's, not {self.model_type}'s")
        if self.llama_4_scaling_beta and self.rope_type != "yarn":
            raise UserError(f"{flag}.llama_4_scaling_beta={self.llama_4_scaling_beta} "
                            f"divides positions by YaRN's original context: rope_type=yarn "
                            f"needs setting")
        if mistral4 and self.routed_bias_update_rate:
            raise UserError(f"{flag}.routed_bias_update_rate="
                            f"{self.routed_bias_update_rate}: mistral4's router has no "
                            f"correction bias to move")
        for name, least in (("kv_lora_rank", 1), ("qk_rope_head_dim", 1), ("v_head_dim", 1),
                            ("q_lora_rank", 0)):  # else a shape deep in the load names it
            if getattr(self, name) < least:
                raise UserError(f"{flag}.{name}={getattr(self, name)} must be >= {least}")
        try:
            self.mla()
        except ValueError as e:
            raise UserError(f"--{self.section}: {e}") from None

    def fixed_fields(self) -> dict:
        # The shared decoder reads head_dim / num_key_value_heads: the latent cache's.
        return {"num_key_value_heads": 1, "head_dim": self.kv_lora_rank + self.qk_rope_head_dim}

    def rotary_widths(self) -> dict[str, int]:
        return {"qk_rope_head_dim": self.qk_rope_head_dim}

    def yarn(self) -> tuple:
        if self.rope_type != "yarn":
            return ()
        fields = dict(factor=self.rope_factor,
                      original_max_position_embeddings=self.rope_original_max_position_embeddings,
                      beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow)
        if self.rope_mscale:
            fields["mscale"] = self.rope_mscale
        if self.rope_mscale_all_dim:
            fields["mscale_all_dim"] = self.rope_mscale_all_dim
        return tuple(sorted((k, v) for k, v in fields.items() if k in rope.YARN_FIELDS))

    def mla(self) -> MLAConfig:
        return MLAConfig(hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads,
                         kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                         qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                         q_lora_rank=self.q_lora_rank or None, rope_theta=self.rope_theta,
                         rope_interleave=self.rope_interleave, yarn=self.yarn(),
                         attention_bias=self.attention_bias,
                         initializer_range=self.initializer_range, attention=self.attention,
                         query_scale_beta=self.llama_4_scaling_beta,
                         query_scale_length=self.rope_original_max_position_embeddings)

    def moe(self) -> SigmoidMoEConfig:
        router = "softmax" if self.model_type == "mistral4" else sigmoid_moe.ROUTER
        return dataclasses.replace(super().moe(), router=router)

    # --------------------------------------------------------------- counting

    def _attention_params(self) -> int:
        d, n = self.hidden_size, self.num_attention_heads
        h = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * h
             if self.q_lora_rank else d * n * h)
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank + \
            self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * d

    def flops_per_token(self, seq_length: int) -> float:
        n = self.num_attention_heads
        width = n * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) / 2
        return 6 * self.num_matmul_parameters() + 12 * width * seq_length * \
            self.num_hidden_layers

    # ---------------------------------------------------- HF transformers

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "DeepseekV3Config":
        return from_hf_dict(hf, path)

    def to_hf_config(self):
        from transformers import DeepseekV3Config, Mistral4Config

        mistral4 = self.model_type == "mistral4"
        config = (Mistral4Config if mistral4 else DeepseekV3Config)(
            **self.hf_mla_kwargs(), rope_interleave=self.rope_interleave)
        config.architectures = ["Mistral4ForCausalLM" if mistral4 else "DeepseekV3ForCausalLM"]
        return config

    def hf_mla_kwargs(self) -> dict:
        """transformers' config arguments of this model's MLA and MoE (what DeepSeek-V3.2's
        and GLM-5's configs take too)."""
        rope_parameters = {"rope_type": self.rope_type, "rope_theta": float(self.rope_theta)}
        if self.rope_type == "yarn":
            rope_parameters.update(
                factor=self.rope_factor,
                original_max_position_embeddings=self.rope_original_max_position_embeddings,
                beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow,
                **({"mscale": self.rope_mscale} if self.rope_mscale else {}),
                **({"mscale_all_dim": self.rope_mscale_all_dim}
                   if self.rope_mscale_all_dim else {}))
        if self.model_type == "mistral4":
            rope_parameters.update(
                llama_4_scaling_beta=self.llama_4_scaling_beta,
                partial_rotary_factor=self.qk_rope_head_dim / (self.qk_rope_head_dim
                                                               + self.qk_nope_head_dim))
        return dict(
            **self.hf_config_kwargs(),
            num_key_value_heads=self.num_attention_heads, kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=self.q_lora_rank or None, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
            rope_parameters=rope_parameters, attention_bias=self.attention_bias)


MODEL_TYPES = ("deepseek_v3", "mistral4")
# Mistral4Config's rope where config.json has none.
_MISTRAL4_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=128.0,
                      original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
         "num_hidden_layers", "num_attention_heads", "n_routed_experts", "n_shared_experts",
         "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace",
         "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
         "max_position_embeddings")


def text_fields(hf: dict, path: str) -> dict:
    """The text model's fields: `text_config` of a multimodal `kimi_k25` config.json (Kimi
    K2.5: a DeepSeek-V3 text model beside a vision tower, which is not this model; its
    text_config says `kimi_k2` in the released files, read as transformers reads it,
    deepseek_v3), the whole of a `deepseek_v3` one."""
    if hf.get("model_type") != "kimi_k25":
        return hf
    text = hf.get("text_config") or {}
    if isinstance(text, dict) and text.get("model_type") == "kimi_k2":
        text = {**text, "model_type": "deepseek_v3"}
    return text_model({**hf, "text_config": text}, path, "deepseek_v3", tied=True)


def from_hf_dict(hf: dict, path: str = "config.json", cls: type = DeepseekV3Config,
                 model_type: str = "deepseek_v3", model: str = "DeepSeek-V3",
                 **fields) -> DeepseekV3Config:
    """A `cls` from config.json's fields: DeepSeek-V3's, and a variant's (DeepSeek-V3.2,
    GLM-5: `model_type`, named `model` in messages) with its own `fields`."""
    hf = text_fields(hf, path)
    mistral4 = {}
    if cls is DeepseekV3Config and hf.get("model_type") == "mistral4":
        model_type, model = "mistral4", "Mistral Small 4"
    check_model_type(hf, path, model_type)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    if model_type == "mistral4":  # Mistral4Config's defaults (its released shape)
        defaults.update(DEEPSEEK_V3_PRESETS["mistral_small_4"])
        hf = {"rope_parameters": _MISTRAL4_ROPE, **hf}
        beta = (hf.get("rope_parameters") or {}).get("llama_4_scaling_beta")
        mistral4 = dict(model_type="mistral4", llama_4_scaling_beta=float(beta or 0.0))
    get = config_fields(hf, path, defaults, _INTS, HF_MUST_BE, model)
    skip_mtp(path, hf.get("num_nextn_predict_layers"))
    try:
        mla = MLAConfig.from_hf({**{k: get(k) for k in _INTS}, **hf})
    except (KeyError, ValueError) as e:
        raise UserError(f"{path}: rope: {e}") from None
    yarn = dict(mla.yarn)
    rope_fields = {}
    if yarn:
        rope_fields = dict(rope_type="yarn", rope_factor=float(yarn["factor"]))
        for name in ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                     "mscale_all_dim"):
            if yarn.get(name) is not None:
                rope_fields["rope_" + name] = type(defaults["rope_" + name])(yarn[name])
        extra = set(yarn) - {"factor", "original_max_position_embeddings", "beta_fast",
                             "beta_slow", "mscale", "mscale_all_dim"}
        if any(yarn[k] is not None for k in extra):
            raise UserError(f"{path}: YaRN keys {sorted(extra)} are not supported")
    try:
        return cls(
            **{name: get(name) for name in _INTS}, **rope_fields,
            q_lora_rank=hf.get("q_lora_rank") or 0, rope_theta=mla.rope_theta,
            rope_interleave=mla.rope_interleave, attention_bias=mla.attention_bias,
            **mistral4, **hf_common_fields(hf, get), **fields)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


DEEPSEEK_V3_PRESETS = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens.
    "debug": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                  topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # Moonlight-16B-A3B (Moonshot AI; DeepSeek-V3's model_type): MLA with one q_proj, 1
    # dense layer then 26 of 64 routed experts (top 6) and 2 shared, one expert group.
    # rope_theta, rms_norm_eps and the token ids written from knowledge of its config.json.
    "moonlight_16b_a3b": dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264,
                              moe_intermediate_size=1408, num_hidden_layers=27,
                              num_attention_heads=16, n_routed_experts=64, n_shared_experts=2,
                              num_experts_per_tok=6, n_group=1, topk_group=1,
                              first_k_dense_replace=1, routed_scaling_factor=2.446,
                              kv_lora_rank=512, q_lora_rank=0, qk_rope_head_dim=64,
                              qk_nope_head_dim=128, v_head_dim=128, rope_theta=50000.0,
                              max_position_embeddings=8192, rms_norm_eps=1e-5,
                              bos_token_id=163584, eos_token_id=163585),
    # Mistral-Small-4-119B-2603's text model, as transformers 5.25's Mistral4Config defaults
    # describe it (119B parameters, 128 experts, 4 + 1 shared a token, no dense layer).
    "mistral_small_4": dict(model_type="mistral4", vocab_size=131072, hidden_size=4096,
                            intermediate_size=12288, moe_intermediate_size=2048,
                            num_hidden_layers=36, num_attention_heads=32, n_routed_experts=128,
                            n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
                            first_k_dense_replace=0, routed_scaling_factor=1.0,
                            norm_topk_prob=True, kv_lora_rank=256, q_lora_rank=1024,
                            qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=128,
                            rope_theta=10000.0, rope_type="yarn", rope_factor=128.0,
                            rope_original_max_position_embeddings=8192, rope_mscale=1.0,
                            rope_mscale_all_dim=1.0, llama_4_scaling_beta=0.1,
                            max_position_embeddings=1048576, rms_norm_eps=1e-6,
                            bos_token_id=1, eos_token_id=2, pad_token_id=11),
    "deepseek_v3": dict(rope_type="yarn", rope_factor=40.0, rope_mscale=1.0,
                        rope_mscale_all_dim=1.0, max_position_embeddings=163840,
                        rope_beta_fast=32.0, rope_beta_slow=1.0),
    # Kimi K2.5's text model (moonshotai/Kimi-K2.5's text_config, a Kimi K2: written from
    # knowledge of its config.json, not verified against the released file): DeepSeek-V3's
    # layers with 64 heads, 384 experts (8 a token) in one group, YaRN 64x over 4096.
    # 1,026.4B parameters, 31.7B of them in the matmuls a token runs (the card: 1T, 32B
    # activated, its vision tower apart).
    "kimi_k2_5": dict(vocab_size=163840, num_attention_heads=64, n_routed_experts=384,
                      num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                      routed_scaling_factor=2.827, rope_theta=50000.0, rope_type="yarn",
                      rope_factor=64.0, rope_original_max_position_embeddings=4096,
                      rope_beta_fast=1.0, rope_beta_slow=1.0, rope_mscale=1.0,
                      rope_mscale_all_dim=1.0, max_position_embeddings=262144,
                      bos_token_id=163584, eos_token_id=163585),
}
