"""gpt-oss in Flax, as transformers' `GptOssForCausalLM` computes it.

What differs from LLaMA (easylm/llama/model.py):

    x = x + attention(norm(x))      q, k, v and o with biases; each head's learnable sink
                                    logit joins the softmax's denominator (and takes its
                                    share of the probability, then is dropped); layers
                                    alternate a 128-token window and full attention;
                                    YaRN rotary (easylm/models/rope.py)
    x = x + moe(norm(x))            easylm/models/moe.py: the top-k router logits (with a
                                    bias) softmaxed; experts with biases and the clamped
                                    SwiGLU (clip(up) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)
    norm(x) = (w * x / rms(x))      in fp32, then the compute dtype (HF casts after the product)

The MoE layer records its `moe.RouterStats` with `sow("router", "stats", ...)`: a caller
that applies with `mutable=["router"]` gets each layer's (what the load-balancing loss
reads); any other call computes the same logits and keeps nothing.

Parameters (easylm/gpt_oss/hf.py maps them to HF's names):

    model/embed_tokens/embedding                      (V, D)
    model/layers/<i>/input_layernorm/weight           (D,)  post_attention_layernorm
    model/layers/<i>/self_attn/q_proj/{kernel, bias}  (D, N*H)  k_proj, v_proj (D, K*H)
    model/layers/<i>/self_attn/o_proj/{kernel, bias}  (N*H, D)
    model/layers/<i>/self_attn/sinks                  (N,)
    model/layers/<i>/mlp/router/{kernel, bias}        (D, E)
    model/layers/<i>/mlp/experts/gate_proj            (E, D, F)  up_proj; down_proj (E, F, D)
    model/layers/<i>/mlp/experts/gate_proj_bias       (E, F)  up_proj_bias; down_proj_bias (E, D)
    model/norm/weight, lm_head/kernel                 (D,), (D, V)

Shape letters: B batch, T positions, S cache positions, D width, F expert width,
V vocabulary, N query heads, K key/value heads, G = N // K, H head dim, E experts.
"""

import flax.linen as nn
import numpy as np
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError
from easylm.gpt_oss.config import GptOssConfig
from easylm.models import decoder, moe, rope
from easylm.models.attention import attention, holds_window
from easylm.models.context_parallel import SplitSequence
from easylm.models.decoder import Attention, CausalLM, Sublayer
from easylm.runtime.sharding import BATCH_AXES, constrain

_RULES = (
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/bias", P("mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"self_attn/o_proj/bias", P(None)),
    (r"self_attn/sinks", P(None)),
    (r"(input_layernorm|post_attention_layernorm)/weight", P(None)),
    (r"model/norm/weight", P(None)),
    # gpt-oss's 201,088-token vocabulary is a multiple of 64 (as are the test models').
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"lm_head/kernel", P("fsdp", "mp")),
)


def partition_rules(config: GptOssConfig):
    """The one table that says how gpt-oss is sharded: attention and embeddings here, the
    experts' (split over 'ep') from moe.PARTITION_RULES."""
    return _RULES + moe.PARTITION_RULES


class SinkAttention(Attention):
    """The shared Attention with gpt-oss's sinks: a learnable logit per query head."""

    def attend(self, q, k, v, mask, window, positions):
        sinks = self.param("sinks", nn.initializers.normal(self.config.initializer_range),
                           (self.config.num_attention_heads,), self.param_dtype)
        if isinstance(mask, SplitSequence):
            raise UserError("gpt-oss under context parallelism (--mesh_dim with sp > 1): its "
                            "attention sinks are not built into the ring and all-gather "
                            "kernels; use sp=1")
        return attention(q, k, v, mask, self.config.attention,
                         0 if holds_window(mask) else window, sinks=sinks)


class RMSNorm(decoder.RMSNorm):
    """The shared norm scaled in fp32 before the cast (HF's gpt-oss casts after the product)."""

    scale_in_fp32 = True


def moe_config(config: GptOssConfig) -> moe.MoEConfig:
    return moe.MoEConfig(config.num_local_experts, config.num_experts_per_tok,
                         config.intermediate_size, router="topk_softmax", router_bias=True,
                         expert_bias=True, swiglu_limit=config.swiglu_limit,
                         swiglu_alpha=config.swiglu_alpha,
                         initializer_range=config.initializer_range,
                         matmul=config.moe_matmul)


class DecoderLayer(Sublayer):
    norm_class: type = RMSNorm
    kind: str = "full_attention"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        cos, sin, mask, window = context
        h, cache = SinkAttention(c, self.dtype, self.param_dtype, norm_class=RMSNorm,
                                 qkv_bias=c.attention_bias, out_bias=c.attention_bias,
                                 name="self_attn")(
            self.norm("input_layernorm")(x), cos, sin, mask, window, positions,
            cache)
        x = x + h
        h, stats = moe.SparseMoE(moe_config(c), self.dtype, self.param_dtype, name="mlp")(
            self.norm("post_attention_layernorm")(x))
        self.sow("router", "stats", stats)
        x = constrain(x + h, P(BATCH_AXES, None, None))
        return x, cache


class GptOssForCausalLM(CausalLM):
    """`apply(params, input_ids)` -> logits (B, T, V) in the compute dtype; with `cache=`
    (from `init_cache`) and `positions=`, `(logits, cache)` (easylm/models/decoder.py)."""

    layer = DecoderLayer
    norm = RMSNorm

    @classmethod
    def inv_freq(cls, config: GptOssConfig, kind: str):
        return _rope(config)[0]

    @classmethod
    def rope_attention_factor(cls, config: GptOssConfig, kind: str) -> float:
        return _rope(config)[1]

    @classmethod
    def window(cls, config: GptOssConfig, kind: str) -> int:
        return config.sliding_window if kind == "sliding_attention" else 0


def _rope(config: GptOssConfig) -> tuple[np.ndarray, float]:
    if config.rope_type == "default":
        return rope.default(config.rope_theta, config.head_dim)
    return rope.yarn(config.rope_theta, config.head_dim, config.rope_factor,
                     config.rope_original_max_position_embeddings, config.rope_beta_fast,
                     config.rope_beta_slow, config.rope_truncate)
