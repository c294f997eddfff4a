"""Attention implementations, all with the same signature and the same numbers.

Shapes (letters used throughout easylm):
    B batch, T query positions, S key positions,
    N query heads, K key/value heads, G = N // K query heads per kv head, H head dim.

    q: (B, T, N, H)    k, v: (B, S, K, H)

    mask: None            causal (the queries are the last T of S), over the last
                          `window` keys
          (B, T) int      segment ids: causal inside each document of a packed row, nothing
                          across documents (T == S; with `window`, by place in the row,
                          which is the position inside a document: packing restarts them)
          (B, T, S) bool  any mask (a cache's, by position); it holds the window itself
          BidirectionalBlocks  causal (inside each document), except that the tokens of
                          one block (an image's) also see each other both ways; the window
                          still applies (Gemma 4's sliding layers under
                          use_bidirectional_attention="vision")

Grouped-query attention never repeats K/V: queries are viewed as (B, T, K, G, H).
`sinks` (N,) (gpt-oss): one more logit per head in the softmax's denominator, with no
value. `soft_cap` c: scores c * tanh(scores / c) before the mask (Gemma 2's
attn_logit_softcapping; no family here has it yet).

A sliding window of W (Mistral, Qwen) lets a query see at most the last W keys, itself
included: key s is visible from query t iff t - W < s <= t, transformers' convention
(`masking_utils.sliding_window_overlay`: kv_idx > q_idx - sliding_window). With no mask
or segment ids the kernels apply it themselves (`window=`); a caller with a (B, T, S) mask
puts it in the mask (`sliding_window_mask`).

Chunked local attention of C (Llama 4's attention_chunk_size) lets a query see the keys of
its own chunk of C positions, itself and those before it: key s is visible from query t
iff s // C == t // C and s <= t, transformers' convention (`masking_utils.chunked_overlay`).
No kernel takes a chunk: a caller puts it in a (B, T, S) mask (`chunked_mask`), which sends
splash's and cuDNN's calls to dot_product (the same numbers).

Implementations:
    xla          the plain einsum reference below
    dot_product  jax.nn.dot_product_attention with its XLA implementation
    cudnn        jax.nn.dot_product_attention's cuDNN flash kernel (GPU, bf16/fp16)
    splash       JAX's Pallas splash attention kernel (TPU; easylm/models/splash.py)
    auto         cudnn on GPU, splash on TPU, where they apply; dot_product elsewhere
A mask, sinks or a soft cap that an implementation cannot take sends the call to the one
that can (a cache's (B, T, S) mask: dot_product; sinks, a soft cap: xla), so every name
gives the same numbers for every call.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from easylm.errors import UserError
from easylm.models import splash

# The names a config's `attention` field takes (easylm/models/config.py); a family allows
# these or fewer (`ModelConfig.attention_implementations`).
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "dot_product", "cudnn", "splash")


def xla_attention(q, k, v, mask=None, window: int = 0, scale: float | None = None,
                  sinks=None, soft_cap: float | None = None):
    B, T, N, H = q.shape
    K = k.shape[2]
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    q = q.reshape(B, T, K, N // K, H) * jnp.asarray(scale, q.dtype)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = dense_mask(mask, T, k.shape[1], window)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink's column joins the softmax, then is dropped (it has no value)
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1),
                                (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v)
    return out.reshape(B, T, N, H)


class BidirectionalBlocks(NamedTuple):
    """A mask kind (module docstring): `blocks` (B, T) each token's block id (-1: in none),
    `segment_ids` (B, T) the documents of a packed row or None. As transformers' Gemma 4
    builds it: AND(window, OR(causal, same block)) (`create_masks_for_vision_model`)."""

    blocks: jax.Array
    segment_ids: jax.Array | None = None

    def dense(self, T: int, S: int, window: int = 0):
        """(B, T, S) bool; T == S (a call without a cache)."""
        t, s = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
        mask = (s <= t)[None] | same_block(self.blocks, self.blocks)
        if window:
            mask &= (s > t - window)[None]
        if self.segment_ids is not None:
            mask &= self.segment_ids[:, :, None] == self.segment_ids[:, None, :]
        return mask


def same_block(query_blocks, key_blocks):
    """(B, T) and (B, S) block ids -> (B, T, S) bool: both tokens in one block (id >= 0)."""
    return (query_blocks[:, :, None] == key_blocks[:, None, :]) & (query_blocks[:, :, None] >= 0)


def dense_mask(mask, T: int, S: int, window: int = 0):
    """Any of the masks (module docstring) as (B or 1, T, S) bool."""
    if isinstance(mask, BidirectionalBlocks):
        return mask.dense(T, S, window)
    if mask is None:
        return causal_mask(T, S, window)[None]
    if mask.ndim == 2:  # segment ids
        return segment_mask(mask) & causal_mask(T, S, window)[None]
    return mask


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


def chunked_mask(query_positions, key_positions, chunk: int):
    """(B, T) and (B, S) positions -> (B, T, S) bool: key in the query's chunk of `chunk`
    positions (and any later key of it: AND it with a causal mask)."""
    return key_positions[:, None, :] // chunk == query_positions[:, :, None] // chunk


def segment_mask(segment_ids):
    """(B, T) segment ids -> (B, T, T) causal mask that never crosses documents."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    T = segment_ids.shape[1]
    return same & causal_mask(T, T)[None]


def holds_window(mask) -> bool:
    """Whether `mask` is a (B, T, S) mask, which holds any window (the others take one)."""
    return mask is not None and not isinstance(mask, BidirectionalBlocks) and mask.ndim == 3


def resolve_implementation(implementation: str, q, k, mask, sinks=None,
                           soft_cap: float | None = None) -> str:
    """The implementation that runs: the configured one where it can take this call,
    else the one that can (module docstring)."""
    self_attention = not holds_window(mask) and q.shape[1] == k.shape[1]
    if isinstance(mask, BidirectionalBlocks):  # a mask by data: splash's masks are static
        if implementation == "splash":
            raise UserError("attention=splash cannot take the bidirectional image-token mask "
                            "(use_bidirectional_attention=vision); use attention=auto")
        self_attention = False
    if implementation == "splash" or (implementation == "auto" and splash.available()):
        if self_attention:
            return "splash"
        implementation = "auto"  # a cache's mask: splash's masks are static
    if sinks is not None or soft_cap:
        return "xla"
    if implementation != "auto":
        return implementation
    on_gpu = jax.default_backend() == "gpu"
    half = q.dtype in (jnp.bfloat16, jnp.float16)
    head_dim_ok = q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
    if on_gpu and half and head_dim_ok and mask is None:
        return "cudnn"
    return "dot_product"


def attention(q, k, v, mask=None, implementation: str = "auto", window: int = 0,
              scale: float | None = None, sinks=None, soft_cap: float | None = None):
    """Causal attention when `mask` is None or segment ids (over the last `window` keys
    when > 0), else attention under a (B, T, S) `mask`, which then holds any window.
    Scores are q·k times `scale` (default 1/sqrt(H); Gemma's is query_pre_attn_scalar **
    -0.5)."""
    if window and holds_window(mask):
        raise ValueError("a (B, T, S) mask holds the sliding window itself "
                         "(sliding_window_mask)")
    implementation = resolve_implementation(implementation, q, k, mask, sinks, soft_cap)
    if implementation == "splash":
        return splash.splash_attention(q, k, v, mask, window, scale, sinks, soft_cap)
    if implementation == "xla":
        return xla_attention(q, k, v, mask, window, scale, sinks, soft_cap)
    if isinstance(mask, BidirectionalBlocks) or (mask is not None and mask.ndim == 2):
        mask = dense_mask(mask, q.shape[1], k.shape[1], window)
        window = 0
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale,
        mask=None if mask is None else mask[:, None],
        is_causal=mask is None,
        # jax's window (left, right) is inclusive: left = W - 1 earlier keys and the query's own.
        local_window_size=(window - 1, 0) if window else None,
        implementation="cudnn" if implementation == "cudnn" else None,
    )
