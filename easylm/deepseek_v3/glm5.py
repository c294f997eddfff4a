"""The GLM-5 family (`glm_moe_dsa`: GLM-5, GLM-5.1): DeepSeek-V3.2's model (v32.py,
easylm/models/sparse_attention.py) with the indexer's rotary on interleaved pairs and
GLM's cross-layer top-k sharing: `indexer_types` names each layer "full" (its own
indexer) or "shared" (the keys the last full layer chose, no indexer of its own), as
transformers 5 reads `GlmMoeDsaConfig`; DeepSeek-V3.2's checkpoint names. `FAMILY`.
"""

import dataclasses
import functools
from typing import ClassVar

from easylm.deepseek_v3.v32 import (
    DEEPSEEK_V32_PRESETS,
    DeepseekV32Config,
    DeepseekV32Family,
    read_hf_fields,
)
from easylm.errors import UserError
from easylm.models import sigmoid_moe_hf
from easylm.models.config import default, field
from easylm.models.family import HFAdapter, hf_params_reader
from easylm.models.sparse_attention import SparseMLACausalLM


# ------------------------------------------------------------------------------ config

INDEXER_TYPES = ("full", "shared")


@dataclasses.dataclass(frozen=True)
class GlmMoeDsaConfig(DeepseekV32Config):
    section = "glm_moe_dsa"
    indexer_rope_interleave: ClassVar[bool] = True

    vocab_size: int = default(154880)
    hidden_size: int = default(6144)
    intermediate_size: int = default(12288)
    num_hidden_layers: int = default(78)
    num_attention_heads: int = default(64)
    max_position_embeddings: int = default(202752)
    rms_norm_eps: float = default(1e-5)
    q_lora_rank: int = default(2048)
    v_head_dim: int = default(256)
    qk_nope_head_dim: int = default(192)
    n_group: int = default(1)
    topk_group: int = default(1)
    index_n_heads: int = default(32)
    indexer_types: str = field("", "each layer's indexer, comma-separated: full (its own) or "
                                   "shared (the last full layer's keys); '': all full")

    def __post_init__(self):
        super().__post_init__()
        kinds = self.indexer_types.split(",") if self.indexer_types else []
        if kinds and (len(kinds) != self.num_hidden_layers or set(kinds) - set(INDEXER_TYPES)
                      or kinds[0] != "full"):
            raise UserError(f"--{self.section}.indexer_types needs {self.num_hidden_layers} "
                            f"entries of {', '.join(INDEXER_TYPES)}, the first full; got "
                            f"{self.indexer_types!r}")

    def shared_topk(self) -> tuple[bool, ...]:
        if not self.indexer_types:
            return (False,) * self.num_hidden_layers
        return tuple(kind == "shared" for kind in self.indexer_types.split(","))

    def shard_variant(self, layers: int, mp: int):
        # The few layers keep the mix of full and shared ones (the first full).
        shared = self.shared_topk()
        kinds = ",".join("shared" if i and shared[i * len(shared) // layers] else "full"
                         for i in range(layers))
        variant = super(GlmMoeDsaConfig, self.replace(indexer_types="")).shard_variant(layers, mp)
        return variant.replace(indexer_types=kinds if self.shares_topk() else "")

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "GlmMoeDsaConfig":
        kinds = hf.get("indexer_types") or _indexer_types(hf, path)
        shared = ",".join(kinds) if "shared" in kinds else ""
        return read_hf_fields(hf, path, cls, "glm_moe_dsa", "GLM-5", indexer_types=shared)

    def to_hf_config(self):
        from transformers import GlmMoeDsaConfig as HFConfig

        kinds = ["shared" if s else "full" for s in self.shared_topk()]
        config = HFConfig(**self.hf_indexer_kwargs(), indexer_types=kinds)
        config.architectures = ["GlmMoeDsaForCausalLM"]
        return config


def _indexer_types(hf: dict, path: str) -> list[str]:
    """transformers' derivation when config.json has no indexer_types: a pattern of F and
    S, or every `index_topk_freq`-th layer full from `index_skip_topk_offset` on."""
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if set(pattern) - set("FS"):
                raise UserError(f"{path}: index_topk_pattern {pattern!r} is not of F and S")
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return list(pattern)
    freq = max(hf.get("index_topk_freq", 1), 1)
    offset = hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
            for i in range(hf.get("num_hidden_layers", 78))]


GLM_MOE_DSA_PRESETS = {
    # Tiny, for tests and the commands' default: DeepSeek-V3.2's, its third layer shared.
    "debug": dict(DEEPSEEK_V32_PRESETS["debug"], indexer_types="full,full,shared"),
    # zai-org/GLM-5's shape as transformers' GlmMoeDsaConfig defaults give it (78 layers, 256
    # experts top 8, MLA with a 2048 q latent, an indexer of 32 heads keeping 2048 keys).
    "glm_5": dict(bos_token_id=0, eos_token_id=1),
}


# ------------------------------------------------------------------------------- model

class GlmMoeDsaForCausalLM(SparseMLACausalLM):
    pass


# ---------------------------------------------------------------- HF checkpoint names

to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=GlmMoeDsaForCausalLM)
load_hf_params = functools.partial(sigmoid_moe_hf.load_hf_params, config_class=GlmMoeDsaConfig,
                                   lm=GlmMoeDsaForCausalLM)


# ------------------------------------------------------------------------------ family

class GlmMoeDsaFamily(DeepseekV32Family):
    """DeepSeek-V3.2's family (its presets' defaults, variants and partition rules) with
    GLM-5's config, presets, model and model_type."""

    name = "glm_moe_dsa"
    config_class = GlmMoeDsaConfig
    presets = GLM_MOE_DSA_PRESETS
    module_class = GlmMoeDsaForCausalLM
    hf = HFAdapter(model_types=("glm_moe_dsa",), read_config=GlmMoeDsaConfig.read_hf,
                   write_params=to_hf,
                   read_params=hf_params_reader(load_hf_params, GlmMoeDsaForCausalLM))


FAMILY = GlmMoeDsaFamily()
