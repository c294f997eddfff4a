"""Training losses, returned as sums so that micro-batches and hosts add up exactly.

A loss function maps (params, batch, rng) to a `LossSums`; the train step
divides by the token count once, after summing over micro-batches. A model
family supplies its own (see `easylm/llama/train.py`); `next_token_loss` is the
causal-LM one for models whose forward pass returns logits. A fused or chunked
cross-entropy that never holds the full (B, T, V) logits can replace it without
touching the trainer.

Shape letters: B batch, T positions, V vocabulary.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossSums(NamedTuple):
    loss: jax.Array  # sum over counted tokens of -log p(target), fp32 scalar
    correct: jax.Array  # number of counted tokens whose argmax is the target
    tokens: jax.Array  # number of counted tokens (sum of loss_masks)


def next_token_loss(logits, target_tokens, loss_masks) -> LossSums:
    """Masked cross-entropy in fp32. logits (B, T, V); targets (B, T) int; masks (B, T)."""
    logits = logits.astype(jnp.float32)
    masks = loss_masks.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
    target_logit = jnp.take_along_axis(logits, target_tokens[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == target_tokens).astype(jnp.float32)
    return LossSums(
        loss=jnp.sum((log_z - target_logit) * masks),
        correct=jnp.sum(correct * masks),
        tokens=jnp.sum(masks),
    )


def causal_lm_loss(apply_fn):
    """A loss function for a model whose `apply_fn(params, batch)` returns logits."""

    def loss_fn(params, batch, rng) -> LossSums:
        del rng  # LLaMA has no dropout; the argument is for models that do
        logits = apply_fn(params, batch)  # (B, T, V)
        return next_token_loss(logits, batch["target_tokens"], batch["loss_masks"])

    return loss_fn
