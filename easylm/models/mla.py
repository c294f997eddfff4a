"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2), as transformers'
`DeepseekV3Attention` computes it, and its serving cache of latents.

Keys and values come from one small latent per token: x -> kv_a_proj_with_mqa gives the
latent (C) and one rotary key (R) shared by all heads; the latent, normalised
(kv_a_layernorm), expands through kv_b_proj into each head's non-rotary key (P) and value
(V). Queries go x -> q_a_proj -> q_a_layernorm -> q_b_proj (or x -> q_proj without a
q_lora_rank) and split into P non-rotary and R rotary dimensions; rotary touches only the
R ones (`rope_interleave`: the checkpoint stores them as pairs (x0, x1), (x2, x3), ...).

The cache holds what the expansion starts from: per token the normalised latent and the
rotated rope key, C + R values (576 for DeepSeek-V3) where keys and values would take
N * (P + R + V) (40,960). Attention can run two ways over it, equal in exact arithmetic:
    expanded   kv_b_proj applied to every cached latent, then ordinary attention with
               N heads of P + R (queries/keys) and V (values)
    absorbed   kv_b_proj's key half folded into the query (q_P W_k: (B, T, N, C)) and its
               value half into the output, so attention runs on the cache as it is: one
               key/value head of C + R shared by all N query heads
Absorbing costs more per (query, key) pair (2C + R against P + R + V multiply-adds per
head) but never expands the S cached latents (S * C * N * (P + V)): it is cheaper while
T * (2C + R - P - R - V) < C * (P + V), fewer than ~100 queries at DeepSeek-V3's sizes,
so decoding absorbs and prefill expands (`absorb`).

YaRN (easylm/models/rope.py) enters twice, as transformers has it: its attention factor
multiplies cos and sin (the rotary dimensions only), and `mscale_all_dim` multiplies the
softmax scale of all dimensions (`yarn_softmax_scale`).

Mistral Small 4 multiplies each query by Llama 4's position-dependent attention scale,
1 + beta * log(1 + floor(p / L)) at position p (`query_scale_beta` beta, L its YaRN
original context, `query_scale_length`): 1 within the first L positions, growing slowly
past them.

Parameter names are transformers' (q_a_proj/kernel is q_a_proj.weight transposed).

Shape letters: B batch, T query positions, S key (cache) positions, D width, N heads,
Q q_lora_rank, C kv_lora_rank (the latent), P non-rotary query/key dims, R rotary dims,
H = P + R the query/key head size, V the value head size, X = P + V.
"""

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from easylm.models import rope
from easylm.models.attention import attention
from easylm.models.decoder import RMSNorm, apply_rotary

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    # YaRN's rope_parameters (rope.YARN_FIELDS, `factor` resolved) as (name, value)
    # pairs, hashable like the rest; empty: plain rotary.
    yarn: tuple = ()
    attention_bias: bool = False
    initializer_range: float = 0.02
    attention: str = "auto"  # the kernel (easylm/models/attention.py)
    # Llama 4's query scale (Mistral Small 4's llama_4_scaling_beta; 0: none) and its L.
    query_scale_beta: float = 0.0
    query_scale_length: int = 8192

    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> "MLAConfig":
        """From a transformers DeepseekV3Config's dict (config.json): rope in
        `rope_parameters` (transformers 5) or `rope_scaling` with a top-level rope_theta."""
        rope_fields = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        rope_type = rope_fields.get("rope_type", rope_fields.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope type {rope_type!r}: multi-head latent attention reads "
                             f"default or yarn")
        yarn = ()
        if rope_type == "yarn":
            yarn = {k: rope_fields.get(k) for k in rope.YARN_FIELDS if k in rope_fields}
            if yarn.get("factor") is None:  # transformers derives it so
                yarn["factor"] = (hf["max_position_embeddings"]
                                  / yarn["original_max_position_embeddings"])
            yarn = tuple(sorted(yarn.items()))
        q_lora_rank = hf.get("q_lora_rank")
        return cls(hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
                   kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                   qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                   q_lora_rank=q_lora_rank,
                   rope_theta=float(rope_fields.get("rope_theta", hf.get("rope_theta", 10000.0))),
                   rope_interleave=bool(hf.get("rope_interleave", True)), yarn=yarn,
                   attention_bias=bool(hf.get("attention_bias", False)),
                   initializer_range=hf.get("initializer_range", 0.02), **overrides)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def rope(self) -> tuple[np.ndarray, float]:
        """(inverse frequencies (R/2,), the factor cos and sin are multiplied by)."""
        if not self.yarn:
            return rope.default(self.rope_theta, self.qk_rope_head_dim)
        return rope.yarn(self.rope_theta, self.qk_rope_head_dim, **dict(self.yarn))

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if not self.yarn:
            return scale
        yarn = dict(self.yarn)
        return rope.yarn_softmax_scale(scale, yarn["factor"], yarn.get("mscale_all_dim"))


class LatentCache(NamedTuple):
    """Per layer (B, S, 1, C + R): each token's normalised latent, then its rotated rope
    key. The axis of 1 is the one key/value head the absorbed form attends with."""

    kv: jax.Array

    @classmethod
    def init(cls, config: MLAConfig, batch: int, length: int, dtype=jnp.float32):
        return cls(jnp.zeros((batch, length, 1, config.cache_width), dtype))

    @property
    def bytes_per_token(self) -> int:
        return self.kv.shape[-2] * self.kv.shape[-1] * self.kv.dtype.itemsize

    def write(self, kv, positions):
        """This call's rows (B, T, 1, C + R) written at `positions` (B, T)."""
        rows = jnp.arange(kv.shape[0])[:, None]
        return LatentCache(self.kv.at[rows, positions].set(kv.astype(self.kv.dtype)))


class MultiHeadLatentAttention(nn.Module):
    """x (B, T, D), cos and sin (B, T, R) (decoder.rotary_embedding of `config.rope()`),
    positions (B, T), mask (B, T, S) bool or None (causal; with a cache: key s seen from
    position p iff s <= p), cache (`LatentCache`) or None -> (out (B, T, D), cache).

    `absorb`: True, False, or None to absorb when a cache is given and there are few
    queries (`absorbs`, the module docstring's count)."""

    config: MLAConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    absorb: bool | None = None

    @nn.compact
    def __call__(self, x, cos, sin, positions, mask=None, cache=None):
        return self.attend(x, self.query_latent(x), cos, sin, positions, mask, cache)

    def attend(self, x, q_latent, cos, sin, positions, mask, cache):
        """The attention from the query latent (`query_latent`): (out (B, T, D), cache). A
        layer that reads the query latent itself (DeepSeek sparse attention's indexer,
        easylm/models/sparse_attention.py) calls this from its own compact method."""
        c = self.config
        B, T, _ = x.shape
        N, P, V = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        q_nope, q_rope = self.split_query(self.query(q_latent))  # (B, T, N, P), (B, T, N, R)
        q_rope = self.rotate(q_rope, cos, sin)
        if c.query_scale_beta:  # Llama 4's, by position: (B, T, 1, 1)
            scale = 1 + c.query_scale_beta * jnp.log1p(jnp.floor(
                positions.astype(jnp.float32) / c.query_scale_length))
            scale = scale[..., None, None].astype(q_nope.dtype)
            q_nope, q_rope = q_nope * scale, q_rope * scale
        kv = self.latent(x, cos, sin)  # (B, T, 1, C + R)
        if cache is not None:
            cache = cache.write(kv, positions)
            kv = cache.kv.astype(self.dtype)
            if mask is None:
                mask = jnp.arange(kv.shape[1])[None, None, :] <= positions[:, :, None]
        kv_b = self.dense(N * (P + V), "kv_b_proj")  # latent (..., C) -> (..., N (P + V))
        if self.absorbs(T, cache, mask):
            out = self.absorbed(q_nope, q_rope, kv, self.kv_b_kernel(kv_b), mask)
        else:
            out = self.expanded(q_nope, q_rope, kv, kv_b, mask)
        out = self.dense(c.hidden_size, "o_proj", c.attention_bias)(out.reshape(B, T, N * V))
        return out, cache

    def absorbs(self, T: int, cache, mask=None) -> bool:
        """Whether a call of T queries absorbs; `mask` is what `attend` was given (a
        layer that attends over a few gathered keys, sparse_attention.py's, absorbs by it)."""
        if self.absorb is not None:
            return self.absorb
        c = self.config
        C, P, V = c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
        return cache is not None and T * (2 * C - P - V) < C * (P + V)

    def dense(self, features: int, name: str, bias: bool = False):
        return nn.Dense(features, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.config.initializer_range),
                        name=name)

    def kv_b_kernel(self, kv_b) -> jax.Array:
        """kv_b_proj's kernel (C, N, X) as its matmul computes with it, for absorbing. A
        variant's kernel (LoRA's W + s A B, qwix intercepting the matmul; int8's, stored as
        qwix's WithAux) is what kv_b_proj makes of the identity: C * C * N X multiply-adds a
        call, which a plain kernel, read as it is, does not cost; so is one not made yet
        (at init, which then makes it)."""
        c = self.config
        C, N = c.kv_lora_rank, c.num_attention_heads
        stored = self.variables.get("params", {}).get("kv_b_proj", {})
        kernel = stored.get("kernel")
        if kernel is None or "kernel_lora_a" in stored or hasattr(kernel, "array"):
            kernel = kv_b(jnp.eye(C, dtype=self.dtype))
        return kernel.astype(self.dtype).reshape(C, N, -1)

    def norm(self, name: str):
        return RMSNorm(LATENT_NORM_EPS, self.dtype, self.param_dtype, name=name)

    def query_latent(self, x):
        """q_a_layernorm(q_a_proj(x)) (B, T, Q); x itself without a q_lora_rank."""
        c = self.config
        if c.q_lora_rank is None:
            return x
        return self.norm("q_a_layernorm")(self.dense(c.q_lora_rank, "q_a_proj",
                                                     c.attention_bias)(x))

    def query(self, q_latent):
        """(B, T, N, H) from `query_latent`'s output."""
        c = self.config
        B, T, _ = q_latent.shape
        features = c.num_attention_heads * c.qk_head_dim
        name = "q_proj" if c.q_lora_rank is None else "q_b_proj"
        return self.dense(features, name)(q_latent).reshape(B, T, c.num_attention_heads,
                                                            c.qk_head_dim)

    def split_query(self, q):
        """Each head's non-rotary dimensions, then its rotary ones."""
        return q[..., :self.config.qk_nope_head_dim], q[..., self.config.qk_nope_head_dim:]

    def latent(self, x, cos, sin):
        """What the cache keeps of x (B, T, D): (B, T, 1, C + R)."""
        c = self.config
        kv = self.dense(c.cache_width, "kv_a_proj_with_mqa", c.attention_bias)(x)
        latent = self.norm("kv_a_layernorm")(kv[..., :c.kv_lora_rank])  # (B, T, C)
        k_rope = self.rotate(kv[..., None, c.kv_lora_rank:], cos, sin)  # (B, T, 1, R)
        return jnp.concatenate([latent[:, :, None, :], k_rope], axis=-1)

    def rotate(self, x, cos, sin):
        """Rotary on (B, T, heads, R). Interleaved pairs are first laid out as halves
        (evens, then odds), which is also the layout transformers' rotation returns."""
        if self.config.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rotary(x, cos, sin)

    def expanded(self, q_nope, q_rope, kv, kv_b, mask):
        """kv_b_proj over every cached latent, then N-head attention: (B, T, N, V)."""
        c = self.config
        C, P, V = c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
        B, S = kv.shape[:2]
        keys_values = kv_b(kv[:, :, 0, :C]).reshape(B, S, c.num_attention_heads, P + V)
        k_nope, v = keys_values[..., :P], keys_values[..., P:]  # (B, S, N, P), (B, S, N, V)
        k_rope = jnp.broadcast_to(kv[:, :, :, C:], (*k_nope.shape[:3], c.qk_rope_head_dim))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)  # (B, T, N, H)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)  # (B, S, N, H)
        # The kernels want one head size for q, k and v: zeros pad the smaller (zero
        # dimensions add nothing to a score, and padded value columns are cut off).
        width = max(c.qk_head_dim, V)
        q, k, v = (jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])]) for a in (q, k, v))
        return self.expanded_attention(q, k, v, mask)[..., :V]

    def expanded_attention(self, q, k, v, mask):
        """q (B, T, N, W), k, v (B, S, N, W) under `mask`: (B, T, N, W). A layer that
        attends otherwise (sparse_attention.py's, by blocks of queries) overrides it."""
        return attention(q, k, v, mask, self.config.attention, scale=self.config.softmax_scale)

    def absorbed(self, q_nope, q_rope, kv, w, mask):
        """Attention on the cache as it is, one key/value head of C + R: (B, T, N, V)."""
        c = self.config
        C, P = c.kv_lora_rank, c.qk_nope_head_dim
        q_latent = jnp.einsum("BTNP,CNP->BTNC", q_nope, w[..., :P])
        q = jnp.concatenate([q_latent, q_rope], axis=-1)  # (B, T, N, C + R)
        # The cached row is the key; its latent part is also the value (its rope part
        # rides along as a value and is cut off).
        out = self.latent_attention(q, kv, mask)[..., :C]
        return jnp.einsum("BTNC,CNV->BTNV", out, w[..., P:])

    def latent_attention(self, q, kv, mask):
        """q (B, T, N, C + R) over the cached rows kv (B, S, 1, C + R) as keys and values
        under `mask` (B, T, S): (B, T, N, C + R)."""
        return attention(q, kv, kv, mask, self.config.attention, scale=self.config.softmax_scale)


class LatentRotary:
    """A causal LM's rotary when its layers are MLA's (decoder.CausalLM's class methods):
    `config.mla()`'s frequencies and YaRN attention factor, every kind alike."""

    @classmethod
    def inv_freq(cls, config, kind: str):
        return jnp.asarray(config.mla().rope()[0])

    @classmethod
    def rope_attention_factor(cls, config, kind: str) -> float:
        return config.mla().rope()[1]
