"""Attention implementations, all with the same signature and the same numbers.

Shapes (letters used throughout easylm):
    B batch, T query positions, S key positions,
    N query heads, K key/value heads, G = N // K query heads per kv head, H head dim.

    q: (B, T, N, H)    k, v: (B, S, K, H)    mask: (B, T, S) bool or None (causal)

Grouped-query attention never repeats K/V: queries are viewed as (B, T, K, G, H).

Implementations:
    xla          the plain einsum reference below
    dot_product  jax.nn.dot_product_attention with its XLA implementation
    cudnn        jax.nn.dot_product_attention's cuDNN flash kernel (GPU, bf16/fp16)
    auto         cudnn where it applies, dot_product elsewhere
"""

import jax
import jax.numpy as jnp
import numpy as np


def xla_attention(q, k, v, mask=None):
    B, T, N, H = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, N // K, H) * jnp.asarray(1.0 / np.sqrt(H), q.dtype)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    if mask is None:
        mask = causal_mask(T, k.shape[1])[None]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, N, H)


def causal_mask(T: int, S: int):
    """(T, S) bool: query t sees keys s <= t + (S - T) (the queries are the last T)."""
    return jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T)


def segment_mask(segment_ids):
    """(B, T) segment ids -> (B, T, T) causal mask that never crosses documents."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    T = segment_ids.shape[1]
    return same & causal_mask(T, T)[None]


def resolve_implementation(implementation: str, q, mask) -> str:
    if implementation != "auto":
        return implementation
    on_gpu = jax.default_backend() == "gpu"
    half = q.dtype in (jnp.bfloat16, jnp.float16)
    head_dim_ok = q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
    if on_gpu and half and head_dim_ok and mask is None:
        return "cudnn"
    return "dot_product"


def attention(q, k, v, mask=None, implementation: str = "auto"):
    """Causal attention when `mask` is None, else attention under `mask`."""
    implementation = resolve_implementation(implementation, q, mask)
    if implementation == "xla":
        return xla_attention(q, k, v, mask)
    return jax.nn.dot_product_attention(
        q, k, v,
        mask=None if mask is None else mask[:, None],
        is_causal=mask is None,
        implementation="cudnn" if implementation == "cudnn" else None,
    )
