"""The DeepSeek-V3.2 family (`deepseek_v32`: DeepSeek-V3.2-Exp, DeepSeek-V3.2): DeepSeek-V3
(this package) with DeepSeek sparse attention (easylm/models/sparse_attention.py). Its
config (the lightning indexer's fields; config.json as transformers 5 reads
`DeepseekV32Config`: MLA's rotary always interleaved, every layer a q latent), its model,
its checkpoint names (DeepSeek-V3's, easylm/models/sigmoid_moe_hf.py, and the indexer's:
`self_attn.indexer.wq_b`, `wk`, `k_norm`, `weights_proj`) and `FAMILY`.
"""

import dataclasses
import functools
from typing import ClassVar

from easylm.deepseek_v3.config import DEEPSEEK_V3_PRESETS, DeepseekV3Config, from_hf_dict
from easylm.deepseek_v3.model import PARTITION_RULES as DEEPSEEK_V3_RULES
from easylm.errors import UserError
from easylm.models import sigmoid_moe_hf, sparse_attention
from easylm.models.config import field
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader
from easylm.models.sparse_attention import IndexerConfig, SparseMLACausalLM


# ------------------------------------------------------------------------------ config

@dataclasses.dataclass(frozen=True)
class DeepseekV32Config(DeepseekV3Config):
    section = "deepseek_v32"
    # The indexer's rotary: half-split (DeepSeek-V3.2) or interleaved pairs (GLM-5).
    indexer_rope_interleave: ClassVar[bool] = False

    index_topk: int = field(2048, "keys the indexer keeps per query (all while a query "
                                  "sees fewer)")
    index_n_heads: int = field(64, "indexer query heads")
    index_head_dim: int = field(128, "indexer head width (its first qk_rope_head_dim "
                                     "dims rotary)")
    topk_attention: str = field("auto", "attention over the kept keys: gather (only their "
                                        "latents), mask (full attention masked to them, as "
                                        "transformers), auto (gather with a cache where it "
                                        "counts fewer FLOPs)")
    query_block: int = field(0, sparse_attention.QUERY_BLOCK_HELP)
    indexer_loss_coef: float = field(0.0, "training: this times the indexer's KL loss (the "
                                          "mean over layers) added to the loss, the indexer's "
                                          "inputs detached; 0: none, the indexer untrained")
    indexer_loss: str = field("sparse", "the indexer's KL target: sparse (the attention over "
                                        "the kept keys) or dense (over every visible key: "
                                        "DeepSeek-V3.2's warm-up)")

    def __post_init__(self):
        super().__post_init__()
        checks = ((self.q_lora_rank > 0, f"q_lora_rank={self.q_lora_rank}: the indexer reads "
                                         f"the q latent; give one (> 0)"),
                  (self.index_topk >= 1, f"index_topk={self.index_topk} must be >= 1"),
                  (self.index_n_heads >= 1, f"index_n_heads={self.index_n_heads} must be >= 1"),
                  (self.topk_attention in sparse_attention.TOPK_ATTENTION,
                   f"topk_attention={self.topk_attention!r} is not one of "
                   f"{', '.join(sparse_attention.TOPK_ATTENTION)}"),
                  (self.query_block >= 0, f"query_block={self.query_block} must be >= 0 "
                                          f"(0: all queries at once)"),
                  (not (self.query_block and self.topk_attention == "gather"),
                   f"query_block={self.query_block} blocks the masked form; "
                   f"topk_attention=gather trains through the gather (use auto or mask)"),
                  (self.indexer_loss_coef >= 0,
                   f"indexer_loss_coef={self.indexer_loss_coef} must be >= 0 (0: none)"),
                  (self.indexer_loss in sparse_attention.INDEXER_LOSSES,
                   f"indexer_loss={self.indexer_loss!r} is not one of "
                   f"{', '.join(sparse_attention.INDEXER_LOSSES)}"),
                  (not (self.indexer_loss_coef and self.topk_attention == "gather"),
                   f"indexer_loss_coef={self.indexer_loss_coef}: the KL loss reads the masked "
                   f"form's attention; topk_attention=gather trains through the gather (use "
                   f"auto or mask)"),
                  (self.qk_rope_head_dim <= self.index_head_dim,
                   f"index_head_dim={self.index_head_dim} must be at least "
                   f"qk_rope_head_dim={self.qk_rope_head_dim} (its rotary dims)"))
        for ok, message in checks:
            if not ok:
                raise UserError(f"--{self.section}.{message}")

    def fixed_fields(self) -> dict:
        return {**super().fixed_fields(), "rope_interleave": True}

    def indexer(self) -> IndexerConfig:
        return IndexerConfig(q_lora_rank=self.q_lora_rank, n_heads=self.index_n_heads,
                             head_dim=self.index_head_dim, rope_dim=self.qk_rope_head_dim,
                             topk=self.index_topk, rope_interleave=self.indexer_rope_interleave,
                             initializer_range=self.initializer_range,
                             loss=self.indexer_loss if self.indexer_loss_coef else "")

    def indexer_loss_weight(self) -> float:
        return self.indexer_loss_coef

    def shared_topk(self) -> tuple[bool, ...]:
        """Per layer: whether it reuses the last full layer's keys (GLM-5's shared ones)."""
        return (False,) * self.num_hidden_layers

    def shares_topk(self) -> bool:
        return any(self.shared_topk())

    # --------------------------------------------------------------- counting

    def _indexer_params(self) -> int:
        H, K, d = self.index_n_heads, self.index_head_dim, self.hidden_size
        return self.q_lora_rank * H * K + d * K + 2 * K + d * H

    def num_parameters(self) -> int:
        full = self.shared_topk().count(False)
        return super().num_parameters() + full * self._indexer_params()

    def num_matmul_parameters(self) -> int:
        full = self.shared_topk().count(False)
        return super().num_matmul_parameters() + full * (self._indexer_params()
                                                         - 2 * self.index_head_dim)

    def flops_per_token(self, seq_length: int) -> float:
        # The dense reference: MLA over all keys (DeepSeek-V3's count), and the indexer's
        # scores, H * K multiply-adds a pair: forward only (no gradient reaches it), or with
        # the KL loss forward and backward (3x) and the target's N-head scores once more.
        full = self.shared_topk().count(False)
        pairs = full * seq_length / 2  # a token's causal keys, on average, in each layer
        indexer = 2 * self.index_n_heads * self.index_head_dim * pairs
        if self.indexer_loss_coef:
            indexer = 3 * indexer + 2 * self.num_attention_heads * self.mla().qk_head_dim * pairs
        return super().flops_per_token(seq_length) + indexer

    # ---------------------------------------------------- HF transformers

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "DeepseekV32Config":
        return read_hf_fields(hf, path, cls, "deepseek_v32", "DeepSeek-V3.2")

    def hf_indexer_kwargs(self) -> dict:
        return dict(**self.hf_mla_kwargs(), index_topk=self.index_topk,
                    index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim)

    def to_hf_config(self):
        from transformers import DeepseekV32Config as HFConfig

        config = HFConfig(**self.hf_indexer_kwargs())
        config.architectures = ["DeepseekV32ForCausalLM"]
        return config


def read_hf_fields(hf: dict, path: str, cls: type, model_type: str, model: str, **fields):
    """A DSA config from config.json: DeepSeek-V3's reading and the indexer's fields; the
    per-layer lists transformers derives (`mlp_layer_types`, `layer_types`) must be what
    this model builds."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name in ("index_topk", "index_n_heads", "index_head_dim"):
        value = hf.get(name, defaults[name])
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserError(f"{path}: {name} must be an integer, got {value!r}")
        fields[name] = value
    config = from_hf_dict({"first_k_dense_replace": defaults["first_k_dense_replace"], **hf},
                          path, cls, model_type, model, **fields)
    L, k = config.num_hidden_layers, config.first_k_dense_replace
    mlp = hf.get("mlp_layer_types")
    if mlp is not None and list(mlp) != ["dense"] * k + ["sparse"] * (L - k):
        raise UserError(f"{path}: mlp_layer_types {mlp} is not {k} dense layers then sparse "
                        f"ones (first_k_dense_replace), the only layout built")
    layer_types = hf.get("layer_types")
    if layer_types is not None and set(layer_types) != {"indexed_attention"}:
        raise UserError(f"{path}: layer_types {sorted(set(layer_types))}: only "
                        f"indexed_attention layers are built")
    return config


DEEPSEEK_V32_PRESETS = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens; an
    # indexer keeping 8 keys, so that rows of 16 and more are sparse.
    "debug": dict(DEEPSEEK_V3_PRESETS["debug"], index_topk=8, index_n_heads=4,
                  index_head_dim=16),
    # deepseek-ai/DeepSeek-V3.2(-Exp): DeepSeek-V3's shape (its preset's YaRN) and an
    # indexer of 64 heads of 128 keeping 2048 keys (transformers' DeepseekV32Config).
    "deepseek_v3_2": dict(DEEPSEEK_V3_PRESETS["deepseek_v3"], index_topk=2048,
                          index_n_heads=64, index_head_dim=128),
}


# ------------------------------------------------------------------------------- model

PARTITION_RULES = sparse_attention.PARTITION_RULES + DEEPSEEK_V3_RULES


class DeepseekV32ForCausalLM(SparseMLACausalLM):
    pass


# ---------------------------------------------------------------- HF checkpoint names

to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=DeepseekV32ForCausalLM)
load_hf_params = functools.partial(sigmoid_moe_hf.load_hf_params, config_class=DeepseekV32Config,
                                   lm=DeepseekV32ForCausalLM)


# ------------------------------------------------------------------------------ family

class DeepseekV32Family(ModelFamily):
    name = "deepseek_v32"
    config_class = DeepseekV32Config
    presets = DEEPSEEK_V32_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = DeepseekV32ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("deepseek_v32",), read_config=DeepseekV32Config.read_hf,
                   write_params=to_hf,
                   read_params=hf_params_reader(load_hf_params, DeepseekV32ForCausalLM))

    def partition_rules(self, config: DeepseekV32Config):
        return PARTITION_RULES

    def untrained_parameters(self, config: DeepseekV32Config):
        # DeepSeek-V3.2's dense warm-up: only the indexers train (on their KL loss).
        if config.indexer_loss_coef and config.indexer_loss == "dense":
            return (r"^(?!.*indexer/)",)
        return ()


FAMILY = DeepseekV32Family()
