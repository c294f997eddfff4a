"""Attention implementations, all with the same signature and the same numbers.

Shapes (letters used throughout easylm):
    B batch, T query positions, S key positions,
    N query heads, K key/value heads, G = N // K query heads per kv head, H head dim.

    q: (B, T, N, H)    k, v: (B, S, K, H)    mask: (B, T, S) bool or None (causal)

Grouped-query attention never repeats K/V: queries are viewed as (B, T, K, G, H).

A sliding window of W (Mistral, Qwen) lets a query see at most the last W keys, itself
included: key s is visible from query t iff t - W < s <= t, transformers' convention
(`masking_utils.sliding_window_overlay`: kv_idx > q_idx - sliding_window). With no mask
the kernels apply it themselves (`window=`); a caller with a mask puts it in the mask
(`sliding_window_mask`).

Implementations:
    xla          the plain einsum reference below
    dot_product  jax.nn.dot_product_attention with its XLA implementation
    cudnn        jax.nn.dot_product_attention's cuDNN flash kernel (GPU, bf16/fp16)
    auto         cudnn where it applies, dot_product elsewhere
"""

import jax
import jax.numpy as jnp
import numpy as np

# The names a config's `attention` field takes (easylm/models/config.py); a family allows
# these or fewer (`ModelConfig.attention_implementations`).
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "dot_product", "cudnn")


def xla_attention(q, k, v, mask=None, window: int = 0, scale: float | None = None):
    B, T, N, H = q.shape
    K = k.shape[2]
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    q = q.reshape(B, T, K, N // K, H) * jnp.asarray(scale, q.dtype)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    if mask is None:
        mask = causal_mask(T, k.shape[1], window)[None]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, N, H)


def causal_mask(T: int, S: int, window: int = 0):
    """(T, S) bool: query t sees keys s <= t + (S - T) (the queries are the last T), and
    with a window only the last `window` of them."""
    query = jnp.arange(T)[:, None] + (S - T)
    mask = jnp.arange(S)[None, :] <= query
    if window:
        mask &= jnp.arange(S)[None, :] > query - window
    return mask


def sliding_window_mask(query_positions, key_positions, window: int):
    """(B, T) and (B, S) positions -> (B, T, S) bool: key within the last `window`
    positions of the query, itself included (and any later key: AND it with a causal mask)."""
    return key_positions[:, None, :] > query_positions[:, :, None] - window


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


def attention(q, k, v, mask=None, implementation: str = "auto", window: int = 0,
              scale: float | None = None):
    """Causal attention when `mask` is None (over the last `window` keys when > 0), else
    attention under `mask`, which then holds any window. Scores are q·k times `scale`
    (default 1/sqrt(H); Gemma's is query_pre_attn_scalar ** -0.5)."""
    if window and mask is not None:
        raise ValueError("a mask holds the sliding window itself (sliding_window_mask)")
    implementation = resolve_implementation(implementation, q, mask)
    if implementation == "xla":
        return xla_attention(q, k, v, mask, window, scale)
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale,
        mask=None if mask is None else mask[:, None],
        is_causal=mask is None,
        # jax's window (left, right) is inclusive: left = W - 1 earlier keys and the query's own.
        local_window_size=(window - 1, 0) if window else None,
        implementation="cudnn" if implementation == "cudnn" else None,
    )
