"""The LLaMA causal language model in Flax (LLaMA 1, 2, 3 and 3.2), and the variants
that differ from it by a switch of `LLaMAConfig`: Qwen2/2.5, Qwen3 and Mistral, and their
mixture-of-experts twins Qwen3-MoE and Mixtral (every layer's MLP a `moe.SparseMoE`).

Parameter names follow Hugging Face's `LlamaForCausalLM` (and its Qwen2, Qwen3 and
Mistral twins), so converting a checkpoint is a table lookup (see `easylm/llama/hf.py`):

    model/embed_tokens/embedding                 (V, D)
    model/layers/<i>/input_layernorm/weight      (D,)
    model/layers/<i>/self_attn/q_proj/kernel     (D, N*H)   k_proj, v_proj: (D, K*H)
    model/layers/<i>/self_attn/o_proj/kernel     (N*H, D)
    model/layers/<i>/self_attn/q_proj/bias       (N*H,)     with qkv_bias; k, v: (K*H,)
    model/layers/<i>/self_attn/o_proj/bias       (D,)       with attention_bias
    model/layers/<i>/self_attn/q_norm/weight     (H,)       with qk_norm (Qwen3); k_norm
    model/layers/<i>/post_attention_layernorm/weight
    model/layers/<i>/mlp/gate_proj/kernel        (D, F)     up_proj (D, F), down_proj (F, D)
    model/layers/<i>/mlp/gate_proj/bias          (F,)       with mlp_bias; up (F,), down (D,)
    model/layers/<i>/mlp/router/kernel           (D, E)     with experts (Qwen3-MoE, Mixtral),
    model/layers/<i>/mlp/experts/gate_proj       (E, D, F)  instead of the dense MLP: up_proj
    model/layers/<i>/mlp/experts/down_proj       (E, F, D)  (E, D, F) (easylm/models/moe.py)
    model/norm/weight                            (D,)
    lm_head/kernel                               (D, V)     absent with tied embeddings

With `scan_layers=True` the layers are one stacked module: `model/layers/...`
with a leading layer axis of size L. The decoder around the layer (embedding, the
stack, norm, head, the key/value cache and the two layouts) is easylm/models/decoder.py's;
what is LLaMA's is its layer, its rotary frequencies (with Llama 3 scaling) and the
sliding window (Mistral, Qwen) that every layer applies.

Shape letters: B batch, T positions, S cache positions, D width, F MLP width,
V vocabulary, N query heads, K key/value heads, H head dim, L layers.
"""

import jax.numpy as jnp
import flax.linen as nn
from jax.sharding import PartitionSpec as P

from easylm.llama.config import LLaMAConfig
from easylm.models import moe, rope
from easylm.models.decoder import Attention, CausalLM, GatedMLP, Sublayer
from easylm.models.moe import SparseMoE
from easylm.runtime.sharding import BATCH_AXES, constrain

# Parameter partition rules: the one place that says how LLaMA is sharded.
PARTITION_RULES = (
    (r"model/embed_tokens/embedding", P("mp", "fsdp")),
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel", P("fsdp", "mp")),
    (r"self_attn/o_proj/kernel", P("mp", "fsdp")),
    (r"mlp/(gate_proj|up_proj)/kernel", P("fsdp", "mp")),
    (r"mlp/down_proj/kernel", P("mp", "fsdp")),
    # Biases are split like their kernel's output dimension.
    (r"self_attn/(q_proj|k_proj|v_proj)/bias", P("mp")),
    (r"self_attn/o_proj/bias", P("fsdp")),
    (r"mlp/(gate_proj|up_proj)/bias", P("mp")),
    (r"mlp/down_proj/bias", P("fsdp")),
    (r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)/weight", P(None)),
    (r"model/norm/weight", P(None)),
    (r"lm_head/kernel", P("fsdp", "mp")),
    # Qwen3-MoE, Mixtral: mlp/router (D, E), mlp/experts/* (E, ...).
    *moe.PARTITION_RULES,
)


def rope_frequencies(config: LLaMAConfig) -> jnp.ndarray:
    """Inverse frequencies (H/2,), with Llama-3 or YaRN frequency scaling when configured."""
    H = config.head_dim
    if config.rope_scaling_type == "yarn":
        return jnp.asarray(_yarn(config)[0])
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if config.rope_scaling_type != "llama3":
        return inv_freq
    return rope.llama3(inv_freq, config.rope_scaling_factor, config.rope_low_freq_factor,
                       config.rope_high_freq_factor, config.rope_original_max_position_embeddings)


def _yarn(config: LLaMAConfig):
    return rope.yarn(config.rope_theta, config.head_dim, config.rope_scaling_factor,
                     config.rope_original_max_position_embeddings)


class DecoderLayer(Sublayer):
    kind: str = "full_attention"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        c = self.config
        cos, sin, mask, window = context
        h, cache = Attention(c, self.dtype, self.param_dtype, fused=c.fused_qkv,
                             qkv_bias=c.qkv_bias, out_bias=c.attention_bias, qk_norm=c.qk_norm,
                             name="self_attn")(
            self.norm("input_layernorm")(x), cos, sin, mask, window, positions, cache)
        x = x + h
        x = x + self.mlp(self.norm("post_attention_layernorm")(x))
        x = constrain(x, P(BATCH_AXES, None, None))
        return x, cache  # (carry, output) so that nn.scan can stack the caches

    def mlp(self, x):
        """The gated MLP, or with experts the mixture of them, whose routing statistics go
        to the "router" collection (`moe.router_stats` collects them)."""
        c = self.config
        if not c.num_experts or self.kind == "dense":  # Qwen3-MoE's dense layers too
            return GatedMLP(c, self.dtype, self.param_dtype, fused=c.fused_mlp, bias=c.mlp_bias,
                            name="mlp")(x)
        out, stats = SparseMoE(c.moe, self.dtype, self.param_dtype, name="mlp")(x)
        self.sow("router", "stats", stats)
        return out


class LLaMAForCausalLM(CausalLM):
    """`apply(params, input_ids)` -> logits (B, T, V) in the compute dtype; with `cache=`
    (from `init_cache`) and `positions=`, `(logits, cache)` (easylm/models/decoder.py)."""

    layer = DecoderLayer

    @classmethod
    def inv_freq(cls, config: LLaMAConfig, kind: str):
        return None if kind == "no_rope" else rope_frequencies(config)

    @classmethod
    def rope_attention_factor(cls, config: LLaMAConfig, kind: str) -> float:
        return _yarn(config)[1] if config.rope_scaling_type == "yarn" else 1.0

    @classmethod
    def window(cls, config: LLaMAConfig, kind: str) -> int:
        return config.sliding_window

