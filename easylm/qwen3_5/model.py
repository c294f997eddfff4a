"""Qwen3.5's text model on the shared decoder (easylm/models/decoder.py).

Each layer is x + mixer(norm(x)), then x + MLP(norm(x)), with Gemma's (1 + w) RMS norm
(cast after the product). The mixer is by kind:

    linear_attention  Gated DeltaNet (easylm/models/gated_deltanet.py), a recurrent state
                      in place of keys and values; it reads the documents (segment_ids)
                      to restart that state at each
    full_attention    attention whose q_proj also gives an output gate (per head
                      [query | gate], as transformers splits it): o_proj(attend(...) *
                      sigmoid(gate)); (1 + w) q/k norms; rotary on the first
                      `rotary_dim()` dims of each head only

The MLP is dense (qwen3_5_text) or, for qwen3_5_moe_text and qwen3_next, easylm/models/
moe.py's routed experts beside a shared expert that sigmoid(shared_expert_gate(x))
scales (`SharedExpertMoE`): mlp/router (D, E), mlp/experts/* (E, ...),
mlp/shared_expert/{gate,up,down}_proj, mlp/shared_expert_gate (D, 1). Its
`moe.RouterStats` are sown to the "router" collection, as LLaMA's MoE layers do.

Parameter names are transformers' (`model/layers/<i>/linear_attn/in_proj_qkv`,
`.../self_attn/q_proj`, ...). The cache holds per linear layer a `DeltaNetState` (the
conv's last inputs and the fp32 state: a constant size whatever the length) and per full
layer keys and values. Sequence parallelism (sp > 1) splits a row over devices and
reorders it: attention runs context_parallel's strategy, a DeltaNet layer passes its
state and conv inputs from piece to piece (gated_deltanet.py, "the sequence split over
'sp'").

Shape letters: B batch, T positions, D width, N query heads, K key/value heads, H head
dim, R rotary dims.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.models import moe
from easylm.models.context_parallel import SplitSequence
from easylm.models.decoder import (
    CACHE_PARTITION_RULES,
    HEADS,
    Attention,
    CausalLM,
    GatedMLP,
    Sublayer,
    apply_rotary,
    write_cache,
)
from easylm.models.gated_deltanet import DeltaNetState, GatedDeltaNet
from easylm.qwen3_5.config import Qwen35Config
from easylm.runtime.sharding import BATCH_AXES, constrain

PARTITION_RULES = (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"linear_attn/(in_proj_qkv|in_proj_z|in_proj_qkvz)/kernel", P("fsdp", "mp")),
    (r"linear_attn/(in_proj_b|in_proj_a|in_proj_ba)/kernel", P("fsdp", None)),
    (r"linear_attn/out_proj/kernel", P("mp", "fsdp")),
    (r"linear_attn/conv1d/kernel", P(None, None)),
    (r"linear_attn/(A_log|dt_bias)$", P(None)),
    (r"mlp/(shared_expert/)?(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"mlp/(shared_expert/)?down_proj/kernel", P("mp", "fsdp")),
    (r"mlp/shared_expert_gate/kernel", P("fsdp", None)),
    *moe.PARTITION_RULES,
    (r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|linear_attn/norm)/weight",
     P(None)),
    (r"model/norm/weight", P(None)),
    (r"lm_head/kernel", P("fsdp", "mp")),
)
# A DeltaNetState: the conv inputs (B, W - 1, F) and the state (B, N, H, U), split over
# the batch like the keys and values beside them.
CACHE_RULES = CACHE_PARTITION_RULES + (
    (r"(^|/)conv$", P(BATCH_AXES, None, None)),
    (r"(^|/)recurrent$", P(BATCH_AXES, None, None, None)),
)


class RMSNorm(nn.Module):
    """x / rms(x) * (1 + w) in fp32, then the compute dtype (transformers' Qwen3_5RMSNorm,
    Gemma's form)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.zeros_init(), (x.shape[-1],),
                            self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)


def rotate_partial(x, cos, sin):
    """Rotary on the first R dims of x (B, T, heads, H), cos and sin being (B, T, R); the
    rest pass unrotated (transformers' partial rotary)."""
    R = cos.shape[-1]
    return jnp.concatenate([apply_rotary(x[..., :R], cos, sin), x[..., R:]], axis=-1)


class GatedAttention(Attention):
    """Attention with the output gate: q_proj (D, N 2H) gives each head's query and gate."""

    @nn.compact
    def __call__(self, x, cos, sin, mask, window, positions, cache):
        c = self.config
        B, T, _ = x.shape
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, gate = jnp.split(self.dense(2 * N * H, "q_proj")(x).reshape(B, T, N, 2 * H), 2, -1)
        k = self.dense(K * H, "k_proj")(x).reshape(B, T, K, H)
        v = self.dense(K * H, "v_proj")(x).reshape(B, T, K, H)
        q, k = self.norm("q_norm")(q), self.norm("k_norm")(k)
        q = constrain(rotate_partial(q, cos, sin), HEADS)
        k = constrain(rotate_partial(k, cos, sin), HEADS)
        v = constrain(v, HEADS)
        if cache is not None:
            k, v, cache = write_cache(cache, k, v, positions)
        out = self.attend(q, k, v, mask, window, positions).reshape(B, T, N * H)
        out = out * jax.nn.sigmoid(gate.reshape(B, T, N * H))
        return self.dense(c.hidden_size, "o_proj")(out), cache


class SharedExpertMoE(moe.SparseMoE):
    """x (B, T, D) -> (routed experts' sum + sigmoid(x W_g) * shared_expert(x), stats), as
    transformers' Qwen3_5MoeSparseMoeBlock / Qwen3NextSparseMoeBlock compute it."""

    shared: object = None  # the shared expert's config: intermediate_size its width

    @nn.compact
    def __call__(self, x, experts=None):
        routed, stats = super().__call__(x, experts)
        shared = GatedMLP(self.shared, self.dtype, self.param_dtype, name="shared_expert")(x)
        gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.config.initializer_range),
                        name="shared_expert_gate")(x)
        return routed + jax.nn.sigmoid(gate) * shared, stats


class DecoderLayer(Sublayer):
    norm_class: type = RMSNorm
    kind: str = "full_attention"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        h = self.norm("input_layernorm")(x)
        if self.kind == "linear_attention":
            segment_ids, split = context
            order = None if split is None else split.order
            h, state = GatedDeltaNet(c.deltanet(), self.dtype, self.param_dtype,
                                     name="linear_attn")(h, cache, segment_ids, order)
            cache = None if cache is None else state
        else:
            h, cache = GatedAttention(c, self.dtype, self.param_dtype, norm_class=RMSNorm,
                                      name="self_attn")(h, *context, positions, cache)
        x = x + h
        h = self.norm("post_attention_layernorm")(x)
        if c.num_experts:
            shared = c.replace(intermediate_size=c.shared_expert_intermediate_size)
            h, stats = SharedExpertMoE(c.moe(), self.dtype, self.param_dtype, shared=shared,
                                       name="mlp")(h)
            self.sow("router", "stats", stats)
        else:
            h = GatedMLP(c, self.dtype, self.param_dtype, name="mlp")(h)
        x = x + h
        return constrain(x, P(BATCH_AXES, None, None)), cache


class Qwen35ForCausalLM(CausalLM):
    layer = DecoderLayer
    norm = RMSNorm

    @classmethod
    def inv_freq(cls, config: Qwen35Config, kind: str):
        R = config.rotary_dim()
        return 1.0 / (config.rope_theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R))

    @classmethod
    def layer_context(cls, config, kind: str, context, segment_ids):
        if kind != "linear_attention":
            return context
        # Under sp the `SplitSequence` (its places' order, a static field: a string
        # would not pass a scan over the layers): the state passes from piece to piece.
        split = context.mask
        return segment_ids, (split if isinstance(split, SplitSequence) else None)

    @classmethod
    def layer_cache(cls, config: Qwen35Config, kind: str, batch_size: int, length: int, dtype):
        if kind == "linear_attention":
            return DeltaNetState.init(batch_size, config.deltanet(), dtype)
        return Attention.init_cache(config, batch_size, length, dtype)

    @classmethod
    def cache_rules(cls, config):
        return CACHE_RULES
