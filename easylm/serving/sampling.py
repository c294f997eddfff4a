"""Choosing the next token on the device: greedy, or sampled with temperature, top-k, top-p.

Every row of a batch carries its own settings, so requests with different
settings share one decode step. A row's random key is folded with the position
of the token it draws, so a seeded request draws the same tokens whichever
slot it runs in and whatever else is in the batch.

Shapes: B rows, V vocabulary, N = TOP_LOGPROBS alternatives reported per token.
"""

import jax
import jax.numpy as jnp

TOP_LOGPROBS = 5  # alternatives reported per token (OpenAI's `logprobs` maximum)

# What a call's rows need (`next_tokens`' `sample`, one compiled program each): all greedy;
# some sample, none truncates (GRPO's rollouts: temperature only); some sample with top-k
# or top-p, which sorts the vocabulary. GREEDY == False and SAMPLE == True as keys.
GREEDY, SAMPLE, TRUNCATE = 0, 1, 2
KINDS = (GREEDY, SAMPLE, TRUNCATE)


def kind(temperature, top_k, top_p) -> int:
    """The `sample` kind host arrays of rows' settings need."""
    sampled = temperature > 0
    if not sampled.any():
        return GREEDY
    return TRUNCATE if ((top_k > 0) | (top_p < 1))[sampled].any() else SAMPLE


def _sample(logits, keys, temperature, top_k, top_p, truncate: bool):
    """Draw from softmax(logits / temperature) restricted by top-k, then top-p (HF's order).
    Without `truncate` no row is restricted and nothing is sorted; with it, a row with
    neither top-k nor top-p draws from the same logits with the same key, so its token is
    the one it draws without `truncate`."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]  # (B, V)
    if not truncate:
        return jax.vmap(jax.random.categorical)(keys, scaled)
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    ordered = jnp.where(jnp.arange(V)[None, :] < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: an entry stays if the
    # mass before it is still below top_p (so the first one always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    allowed = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    allowed = jnp.where(((top_k > 0) | (top_p < 1))[:, None], allowed, scaled)
    return jax.vmap(jax.random.categorical)(keys, allowed)


def next_tokens(logits, keys, positions, temperature, top_k, top_p, sample: int = TRUNCATE):
    """Pick one token per row and report log-probabilities.

    Args:
      logits: (B, V) for the next token.
      keys: (B, 2) uint32 raw PRNG keys, one per request.
      positions: (B,) position of the token being drawn (folded into the key).
      temperature: (B,) float, 0 for greedy; top_k: (B,) int, 0 for off;
      top_p: (B,) float, 1 for off.
      sample: static, a kind (`kind`). GREEDY (False): every row is greedy whatever its
        temperature; SAMPLE (True): rows with a temperature sample, without top-k or
        top-p; TRUNCATE: with them. Only TRUNCATE sorts the vocabulary (the costly
        part); the caller knows the kind from the rows' settings on the host. A
        data-dependent `lax.cond` instead would copy its predicate to the host on every
        token on GPU, stalling the device.
    Returns:
      tokens (B,), their log-probability (B,), and the N most likely tokens'
      ids (B, N) and log-probabilities (B, N), all under the model's own
      distribution (temperature 1, no truncation), as OpenAI reports them.
    """
    logits = logits.astype(jnp.float32)
    tokens = jnp.argmax(logits, axis=-1)
    if sample:
        keys = jax.vmap(jax.random.fold_in)(keys, positions)
        sampled = _sample(logits, keys, temperature, top_k, top_p, sample == TRUNCATE)
        tokens = jnp.where(temperature > 0, sampled, tokens)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(TOP_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), chosen, top_ids.astype(jnp.int32), top_logprobs
