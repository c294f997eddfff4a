"""DeepSeek-V4 (Flash, Pro) configuration: one dataclass and config.json as transformers
5.25 reads `DeepseekV4Config`.

Each layer is one of three attention types (`layer_types`): sliding-window attention,
compressed sparse attention (CSA: the sliding window plus entries that each compress
`compress_rate_csa` tokens, of which a lightning indexer keeps `index_topk` per query)
and heavily compressed attention (HCA: the window plus every entry compressing
`compress_rate_hca` tokens); and one of two mixtures of experts (`mlp_layer_types`):
routed by a frozen token -> experts table (`hash_moe`) or by top-k scores (`moe`). The
residual is `hc_mult` streams mixed by hyper-connections. easylm/deepseek_v4/model.py
writes down the computation.
"""

import dataclasses
import math

from easylm.errors import UserError
from easylm.models import rope
from easylm.models.config import ModelConfig, default, field
from easylm.models.hf_checkpoint import config_fields
from easylm.models.moe import ExpertMatmulConfig, MoEConfig, RouterLoss
from easylm.models.sparse_attention import QUERY_BLOCK_HELP, TOPK_ATTENTION
from easylm.models.sigmoid_moe_decoder import check_model_type, skip_mtp

ATTENTION_TYPES = ("sliding_attention", "compressed_sparse_attention",
                   "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config(ExpertMatmulConfig, ModelConfig):
    section = "deepseek_v4"
    routed_experts_field = "n_routed_experts"
    experts_per_token_field = "num_experts_per_tok"
    layer_type_choices = ATTENTION_TYPES
    # The attention is this package's dense reference (masks where transformers masks).
    attention_implementations = ("auto", "xla")

    vocab_size: int = default(129280)
    hidden_size: int = default(4096)
    intermediate_size: int | None = default(None)  # moe_intermediate_size (fixed)
    num_hidden_layers: int = default(43)
    num_attention_heads: int = default(64)
    head_dim: int | None = default(512)
    max_position_embeddings: int = default(1048576)
    bos_token_id: int | None = default(0)
    eos_token_id: int | None = default(1)

    layer_types: str = field("", "each layer's attention, comma-separated: sliding_attention, "
                                 "compressed_sparse_attention, heavily_compressed_attention; "
                                 "'': two heavily compressed, then the two alternating")
    mlp_layer_types: str = field("", "each layer's experts, comma-separated: hash_moe (routed "
                                     "by a token -> experts table) or moe; '': 3 hash_moe "
                                     "first")
    compress_rate_csa: int = field(4, "tokens a compressed sparse attention entry compresses")
    compress_rate_hca: int = field(128, "tokens a heavily compressed attention entry "
                                        "compresses")
    sliding_window: int = field(128, "the window every layer attends to token by token")
    q_lora_rank: int = field(1024, "query latent width")
    qk_rope_head_dim: int = field(64, "rotary dims (the last of each head)")
    o_groups: int = field(8, "head groups of the grouped output projection")
    o_lora_rank: int = field(1024, "each group's width after the first output projection")
    index_n_heads: int = field(64, "the indexer's query heads")
    index_head_dim: int = field(128, "the indexer's head width")
    index_topk: int = field(512, "compressed entries the indexer keeps per query")
    topk_attention: str = field("auto", "served attention over the kept keys: gather (only "
                                        "the window's keys and the kept entries), mask (all "
                                        "cached positions masked to them, as transformers), "
                                        "auto (gather where it reads fewer keys); without a "
                                        "cache (training) always mask")
    query_block: int = field(0, QUERY_BLOCK_HELP)
    hc_mult: int = field(4, "residual streams of the hyper-connections")
    hc_sinkhorn_iters: int = field(20, "Sinkhorn iterations of the stream-mixing matrix")
    hc_eps: float = field(1e-6, "the hyper-connections' epsilon")
    rope_theta: float = field(10_000.0, "rotary base of the sliding-window layers")
    compress_rope_theta: float = field(160_000.0, "rotary base of the compressed layers")
    compress_rope_type: str = field("default", "the compressed layers' rotary: default or yarn")
    compress_rope_factor: float = field(1.0, "YaRN factor (compressed layers)")
    compress_rope_original_max_position_embeddings: int = field(
        65536, "YaRN's original context (compressed layers)")
    compress_rope_beta_fast: float = field(32.0, "YaRN beta_fast (compressed layers)")
    compress_rope_beta_slow: float = field(1.0, "YaRN beta_slow (compressed layers)")
    moe_intermediate_size: int = field(2048, "one routed (and shared) expert's MLP width")
    n_routed_experts: int = field(256, "routed experts E")
    n_shared_experts: int = field(1, "shared experts every token takes")
    num_experts_per_tok: int = field(6, "routed experts chosen per token K")
    scoring_func: str = field("sqrtsoftplus", "router scores: sqrtsoftplus, sigmoid or softmax")
    routed_scaling_factor: float = field(1.5, "multiplies the routed experts' weights")
    swiglu_limit: float = field(10.0, "clamps the experts' gate (above) and up (both sides)")

    def __post_init__(self):
        super().__post_init__()

        def fail(message):
            raise UserError(f"--deepseek_v4.{message}")

        if self.mlp_layer_types and (len(self.mlp_kinds()) != self.num_hidden_layers
                                     or set(self.mlp_kinds()) - set(MLP_TYPES)):
            fail(f"mlp_layer_types needs {self.num_hidden_layers} entries, each one of "
                 f"{', '.join(MLP_TYPES)}; got {self.mlp_layer_types!r}")
        if self.n_shared_experts != 1:
            fail(f"n_shared_experts={self.n_shared_experts}: one shared expert is built")
        if self.scoring_func not in SCORING:
            fail(f"scoring_func={self.scoring_func!r} is not one of {', '.join(SCORING)}")
        if self.topk_attention not in TOPK_ATTENTION:
            fail(f"topk_attention={self.topk_attention!r} is not one of "
                 f"{', '.join(TOPK_ATTENTION)}")
        if self.query_block < 0:
            fail(f"query_block={self.query_block} must be >= 0 (0: all queries at once)")
        if self.compress_rope_type not in ("default", "yarn"):
            fail(f"compress_rope_type={self.compress_rope_type!r} is not one of default, yarn")
        if self.num_attention_heads * self.head_dim % self.o_groups:
            fail(f"o_groups={self.o_groups} must divide num_attention_heads * head_dim")
        if not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            fail(f"qk_rope_head_dim={self.qk_rope_head_dim} must be in 1..head_dim and "
                 f"index_head_dim")
        for name in ("compress_rate_csa", "compress_rate_hca", "sliding_window", "hc_mult",
                     "index_topk", "hc_sinkhorn_iters"):
            if getattr(self, name) < 1:
                fail(f"{name} must be >= 1, got {getattr(self, name)}")
        try:
            self.moe()
        except ValueError as e:
            raise UserError(f"--deepseek_v4: {e}") from None

    def fixed_fields(self) -> dict:
        # One key/value head, which is also the value (shared-KV multi-query attention).
        return {"num_key_value_heads": 1, "intermediate_size": self.moe_intermediate_size}

    def rotary_widths(self) -> dict[str, int]:
        return {"qk_rope_head_dim": self.qk_rope_head_dim}

    def attention_kinds(self) -> tuple[str, ...]:
        if self.layer_types:
            return tuple(self.layer_types.split(","))
        n = self.num_hidden_layers
        return (("heavily_compressed_attention",) * min(n, 2) + tuple(
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(n - 2, 0))))

    def mlp_kinds(self) -> tuple[str, ...]:
        if self.mlp_layer_types:
            return tuple(self.mlp_layer_types.split(","))
        n = self.num_hidden_layers
        return ("hash_moe",) * min(n, 3) + ("moe",) * max(0, n - 3)

    def layer_kinds(self) -> tuple[str, ...]:
        """'<attention type>:<mlp type>' of each layer."""
        return tuple(f"{a}:{m}" for a, m in zip(self.attention_kinds(), self.mlp_kinds()))

    def compress_rate(self, attention: str) -> int:
        return {"compressed_sparse_attention": self.compress_rate_csa,
                "heavily_compressed_attention": self.compress_rate_hca}.get(attention, 0)

    def inv_freq(self, attention: str):
        """(inverse frequencies (R/2,), attention factor) of a layer's rotary: the plain
        base for sliding layers, the compressed base (YaRN, factor 1 as transformers forces
        it) for the compressed ones and their compressors and indexer."""
        R = self.qk_rope_head_dim
        if attention == "sliding_attention":
            return rope.default(self.rope_theta, R)[0]
        if self.compress_rope_type == "yarn":
            return rope.yarn(self.compress_rope_theta, R, self.compress_rope_factor,
                             self.compress_rope_original_max_position_embeddings,
                             self.compress_rope_beta_fast, self.compress_rope_beta_slow,
                             attention_factor=1.0)[0]
        return rope.default(self.compress_rope_theta, R)[0]

    def moe(self) -> MoEConfig:
        return MoEConfig(self.n_routed_experts, self.num_experts_per_tok,
                         self.moe_intermediate_size, initializer_range=self.initializer_range,
                         clamp_limit=self.swiglu_limit, matmul=self.moe_matmul)

    def router_loss(self) -> RouterLoss:
        """Nothing trained on (transformers' aux loss is off without
        output_router_logits): the routers' statistics logged."""
        return RouterLoss(self.num_experts_per_tok, 0.0)

    def shard_variant(self, layers: int, mp: int):
        kinds = [self.layer_kinds()[i * self.num_hidden_layers // layers]
                 for i in range(layers)]
        return self.replace(
            num_hidden_layers=layers, num_attention_heads=math.ceil(self.num_attention_heads / mp),
            index_n_heads=math.ceil(self.index_n_heads / mp),
            vocab_size=math.ceil(self.vocab_size / mp),
            layer_types=",".join(k.split(":")[0] for k in kinds),
            mlp_layer_types=",".join(k.split(":")[1] for k in kinds))

    # --------------------------------------------------------------- counting

    def _attention_params(self, attention: str) -> int:
        d, n, h = self.hidden_size, self.num_attention_heads, self.head_dim
        q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * h
        out = n * h * self.o_lora_rank + self.o_groups * self.o_lora_rank * d
        own = q + d * h + h + out + n
        m = self.compress_rate(attention)
        if attention == "heavily_compressed_attention":
            own += 2 * d * h + m * h + h
        if attention == "compressed_sparse_attention":
            i = self.index_head_dim
            own += 4 * d * h + 2 * m * h + h + 4 * d * i + 2 * m * i + i
            own += self.q_lora_rank * self.index_n_heads * i + d * self.index_n_heads
        return own

    def _mlp_params(self, active: bool = False) -> int:
        d, f = self.hidden_size, self.moe_intermediate_size
        experts = self.num_experts_per_tok if active else self.n_routed_experts
        # As transformers counts: its buffers (the correction bias, tid2eid) left out.
        return 3 * d * f * (experts + self.n_shared_experts) + d * self.n_routed_experts

    def _hc_params(self) -> int:
        k = self.hc_mult
        return 2 * ((2 + k) * k * (k * self.hidden_size + 1) + 3)

    def num_parameters(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        layers = sum(self._attention_params(a) + self._mlp_params() + self._hc_params() + 2 * d
                     for a, m in zip(self.attention_kinds(), self.mlp_kinds()))
        head = self.hc_mult * (self.hc_mult * d + 1) + 1
        return v * d * (1 if self.tie_word_embeddings else 2) + layers + d + head

    def num_matmul_parameters(self) -> int:
        return (sum(self._attention_params(a) + self._mlp_params(True)
                    for a, m in zip(self.attention_kinds(), self.mlp_kinds()))
                + self.vocab_size * self.hidden_size)

    def flops_per_token(self, seq_length: int) -> float:
        """6N plus the dense reference's attention: every query against the T keys under
        the window mask and the compressed entries (what this implementation computes)."""
        n, h = self.num_attention_heads, self.head_dim
        keys = sum(seq_length + seq_length // max(self.compress_rate(a), 1)
                   * (a != "sliding_attention") for a in self.attention_kinds())
        return 6 * self.num_matmul_parameters() + 6 * 2 * n * h * keys

    # ---------------------------------------------------- HF transformers

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "DeepseekV4Config":
        return from_hf_dict(hf, path)

    def to_hf_config(self):
        from transformers import DeepseekV4Config as HFConfig

        compress = {"rope_type": self.compress_rope_type,
                    "rope_theta": float(self.compress_rope_theta),
                    "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
        if self.compress_rope_type == "yarn":
            compress.update(
                factor=self.compress_rope_factor, attention_factor=1.0,
                original_max_position_embeddings=self.compress_rope_original_max_position_embeddings,
                beta_fast=self.compress_rope_beta_fast, beta_slow=self.compress_rope_beta_slow)
        main = {"rope_type": "default", "rope_theta": float(self.rope_theta),
                "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
        config = HFConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, head_dim=self.head_dim,
            q_lora_rank=self.q_lora_rank, num_experts_per_tok=self.num_experts_per_tok,
            n_routed_experts=self.n_routed_experts, n_shared_experts=self.n_shared_experts,
            scoring_func=self.scoring_func, routed_scaling_factor=self.routed_scaling_factor,
            max_position_embeddings=self.max_position_embeddings, rope_theta=self.rope_theta,
            layer_types=list(self.attention_kinds()),
            compress_rates={"compressed_sparse_attention": self.compress_rate_csa,
                            "heavily_compressed_attention": self.compress_rate_hca},
            compress_rope_theta=self.compress_rope_theta, hc_mult=self.hc_mult,
            hc_sinkhorn_iters=self.hc_sinkhorn_iters, hc_eps=self.hc_eps,
            mlp_layer_types=list(self.mlp_kinds()), swiglu_limit=self.swiglu_limit,
            sliding_window=self.sliding_window, o_groups=self.o_groups,
            o_lora_rank=self.o_lora_rank, index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim, index_topk=self.index_topk,
            num_nextn_predict_layers=0, rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            partial_rotary_factor=self.qk_rope_head_dim / self.head_dim,
            rope_parameters={"main": main, "compress": compress})
        config.architectures = ["DeepseekV4ForCausalLM"]
        return config


_INTS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
         "num_attention_heads", "head_dim", "q_lora_rank", "n_routed_experts",
         "n_shared_experts", "num_experts_per_tok", "sliding_window", "o_groups",
         "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
         "hc_sinkhorn_iters", "max_position_embeddings")
HF_MUST_BE = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "num_key_value_heads": 1, "n_shared_experts": 1}  # transformers' one shared MLP


def _rope(hf: dict, path: str) -> dict:
    """The rotary fields from rope_parameters ({main, compress}, as transformers nests it)
    or the flat form an older file has (its YaRN keys are the compressed layers')."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if isinstance(params.get("compress"), dict):
        main, compress = params.get("main") or {}, params["compress"]
    else:
        main, compress = {}, params
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind not in ("default", "yarn") or main.get("rope_type", "default") != "default":
        raise UserError(f"{path}: rope_parameters {params!r}: only default rotary on the "
                        f"sliding layers and default or YaRN on the compressed ones are built")
    fields = dict(rope_theta=float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
                  compress_rope_theta=float(compress.get(
                      "rope_theta", hf.get("compress_rope_theta", 160000.0))),
                  compress_rope_type=kind)
    if kind == "yarn":
        if compress.get("attention_factor", 1.0) != 1.0:
            raise UserError(f"{path}: YaRN attention_factor {compress['attention_factor']} is "
                            f"not supported (DeepSeek-V4 uses 1.0)")
        fields.update(compress_rope_factor=float(compress["factor"]),
                      compress_rope_original_max_position_embeddings=int(
                          compress.get("original_max_position_embeddings", 65536)),
                      compress_rope_beta_fast=float(compress.get("beta_fast") or 32.0),
                      compress_rope_beta_slow=float(compress.get("beta_slow") or 1.0))
    return fields


def from_hf_dict(hf: dict, path: str = "config.json") -> DeepseekV4Config:
    check_model_type(hf, path, "deepseek_v4")
    defaults = {f.name: f.default for f in dataclasses.fields(DeepseekV4Config)}
    get = config_fields(hf, path, defaults, _INTS, HF_MUST_BE, "DeepSeek-V4")
    skip_mtp(path, hf.get("num_nextn_predict_layers"))
    n = get("num_hidden_layers")
    rates = dict(hf.get("compress_rates") or {})
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("compress_ratios") is not None:
        by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention",
                    128: "heavily_compressed_attention"}
        layer_types = [by_ratio.get(r, str(r)) for r in hf["compress_ratios"]]
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        hashed = hf.get("num_hash_layers", 3)
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    rotary = int(get("head_dim") * (hf.get("partial_rotary_factor") or 64 / 512))
    try:
        return DeepseekV4Config(
            **{name: get(name) for name in _INTS}, **_rope(hf, path),
            layer_types=",".join(layer_types[:n]) if layer_types else "",
            mlp_layer_types=",".join(mlp_types[:n]), qk_rope_head_dim=rotary,
            compress_rate_csa=int(rates.get("compressed_sparse_attention",
                                            hf.get("compress_rate_csa", 4))),
            compress_rate_hca=int(rates.get("heavily_compressed_attention",
                                            hf.get("compress_rate_hca", 128))),
            hc_eps=float(get("hc_eps")), scoring_func=str(get("scoring_func")),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            swiglu_limit=float(get("swiglu_limit")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rms_norm_eps=float(get("rms_norm_eps")),
            initializer_range=float(get("initializer_range")),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=_first(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) and value else value


DEEPSEEK_V4_PRESETS = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens; one
    # layer of each attention type, the first routed by its token.
    "debug": dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  head_dim=32, q_lora_rank=32, qk_rope_head_dim=16, o_groups=2,
                  o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
                  compress_rate_csa=4, compress_rate_hca=16, sliding_window=32, hc_mult=2,
                  layer_types="sliding_attention,compressed_sparse_attention,"
                              "heavily_compressed_attention",
                  mlp_layer_types="hash_moe,moe,moe", moe_intermediate_size=32,
                  n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # DeepSeek-V4-Flash (transformers' DeepseekV4Config defaults, which its docstring gives as
    # V4-Flash's shape: 43 layers, 256 experts top 6, hc_mult 4). The compressed layers'
    # YaRN (factor 16) is from transformers' comments; original_max_position_embeddings
    # (65536) is not verified against the released config.json.
    "deepseek_v4_flash": dict(compress_rope_type="yarn", compress_rope_factor=16.0),
    # DeepSeek-V4-Pro: Flash's layers at the card's size (written from knowledge, not
    # verified against its config.json): 61 layers of 7168, 128 heads, 384 experts of 3072
    # (6 a token), 16 output groups, the indexer keeping 1024; transformers' default
    # schedule (2 HCA, then CSA and HCA alternating). 1,573.0B parameters, 48.7B active
    # (the card: 1.6T, 49B).
    "deepseek_v4_pro": dict(compress_rope_type="yarn", compress_rope_factor=16.0,
                            hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                            q_lora_rank=1536, moe_intermediate_size=3072,
                            n_routed_experts=384, o_groups=16, index_topk=1024),
}
