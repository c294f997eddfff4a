"""Training losses, returned as sums so that micro-batches and hosts add up exactly.

A loss function maps (params, batch, rng, frozen) to sums: a NamedTuple with a `loss`
field, a `count` (the denominator: tokens here, pairs for a preference objective) and a
`means()` method giving what a step logs. The train step adds the sums of its
micro-batches and divides by the count once, so that accumulation is exact. The loss is
built here from a model's forward pass and head (`next_token_sums`), for every family and
variant alike; with `loss_chunk_size` the cross-entropy never holds the full (B, T, V)
logits.

Shape letters: B batch, T positions, V vocabulary.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from easylm.errors import UserError
from easylm.models import vision
from easylm.objectives.base import Objective
from easylm.objectives.indexer_loss import with_indexer_loss
from easylm.objectives.router_loss import with_router_loss


class LossSums(NamedTuple):
    loss: jax.Array  # sum over counted tokens of -log p(target), fp32 scalar
    correct: jax.Array  # number of counted tokens whose argmax is the target
    tokens: jax.Array  # number of counted tokens (sum of loss_masks)

    COUNT = "tokens"  # what `count` counts: the logs call it loss_tokens, eval_tokens
    PART = "ce_loss"  # the cross-entropy: logged under this name beside a total `loss`

    @property
    def count(self):
        return self.tokens

    def means(self) -> dict:
        tokens = jnp.maximum(self.tokens, 1.0)
        loss = self.loss / tokens
        return {"loss": loss, "accuracy": self.correct / tokens, "perplexity": jnp.exp(loss)}


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


def next_token_sums(model, params, batch, rng, base=None) -> LossSums:
    """`model`'s next-token loss sums over `batch` (a `Model`: its forward pass and head;
    `base` the frozen parameters a variant reads): from the logits, or with the model's
    `loss_chunk_size` from its hidden states, a chunk of positions' logits at a time."""
    chunked = bool(model.loss_chunk_size)
    out = model.forward(params, batch["input_tokens"], batch.get("positions"),
                        batch.get("segment_ids"), base=base, rng=rng, return_hidden=chunked,
                        # a mixture of experts: its router losses too
                        router_stats=model.router_loss is not None,
                        indexer_loss=bool(model.indexer_loss),  # a sparse attention's KL
                        images=vision.image_inputs_of(batch))
    if not chunked:
        sums = next_token_loss(out.logits, batch["target_tokens"], batch["loss_masks"])
    else:
        sums = chunked_next_token_loss(out.hidden, model.head(params, base),
                                       batch["target_tokens"], batch["loss_masks"],
                                       model.loss_chunk_size)
    if out.router_stats is not None:
        sums = with_router_loss(sums, out.router_stats, model.router_loss,
                                batch.get("segment_ids"))
    if out.indexer_loss is not None:
        sums = with_indexer_loss(sums, out.indexer_loss, model.indexer_loss)
    return sums


@jax.custom_vjp
def head_logits(hidden, weight):
    """fp32 logits `hidden @ weight` (B, c, V): a matmul in hidden's dtype (the compute
    dtype) with fp32 accumulation, the weight cast to that dtype first.

    Autodiff alone would run this matmul's two backward matmuls in fp32, since the
    logits' gradient is fp32 (on an H200, TF32 GEMMs that took 6% of the llama_1b step).
    Here the gradient is cast to the compute dtype first, as every other layer's
    is, and the weight's gradient is accumulated in fp32 and returned in weight's dtype.
    In fp32 compute the cast does nothing: the gradients are autodiff's."""
    return jnp.einsum("BcD,DV->BcV", hidden, weight.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


def _head_logits_fwd(hidden, weight):
    return head_logits(hidden, weight), (hidden, weight)


def _head_logits_bwd(residuals, d_logits):
    hidden, weight = residuals
    d_logits = d_logits.astype(hidden.dtype)
    d_hidden = jnp.einsum("BcV,DV->BcD", d_logits, weight.astype(hidden.dtype),
                          preferred_element_type=jnp.float32)
    d_weight = jnp.einsum("BcD,BcV->DV", hidden, d_logits, preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden.dtype), d_weight.astype(weight.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def chunked_next_token_loss(hidden, head_weight, target_tokens, loss_masks, chunk_size: int) -> LossSums:
    """`next_token_loss(hidden @ head_weight, ...)` without the whole (B, T, V) logits.

    The positions are cut into chunks of `chunk_size`; each chunk's logits are made
    (`head_logits`: in the compute dtype with fp32 accumulation, and so is the
    backward pass), reduced to LossSums, and dropped.
    `jax.checkpoint` makes the backward pass recompute them chunk by chunk too, so at
    most (B, chunk_size, V) logits are live. One chunk (chunk_size = T) is not
    recomputed: its logits are made right before the backward pass needs them, so
    keeping them costs no extra peak memory, and recomputing would cost a third
    matmul the size of the output projection's. hidden (B, T, D), head_weight (D, V).
    """
    B, T, D = hidden.shape
    if T % chunk_size:  # one chunk instead would build the full logits this avoids (the
        # trainer checks this at its start, naming the family's flag)
        raise UserError(f"loss_chunk_size={chunk_size} must divide the sequence length {T}")
    chunks = T // chunk_size

    def chunk_sums(h, targets, masks):  # h (B, c, D)
        return next_token_loss(head_logits(h, head_weight), targets, masks)

    if chunks == 1:
        return chunk_sums(hidden, target_tokens, loss_masks)
    chunk_sums = jax.checkpoint(chunk_sums)

    def split(x):  # (B, T, ...) -> (chunks, B, c, ...)
        return x.reshape(B, chunks, T // chunks, *x.shape[2:]).swapaxes(0, 1)

    def body(total, xs):
        return LossSums(*(t + s for t, s in zip(total, chunk_sums(*xs)))), None

    zeros = LossSums(*(jnp.zeros((), jnp.float32),) * 3)
    sums, _ = jax.lax.scan(body, zeros, (split(hidden), split(target_tokens), split(loss_masks)))
    return sums


class NextToken(Objective):
    """Language modelling on documents: the model's own next-token loss."""

    name = "next_token"
    adds_indexer_loss = True
    takes_images = True

    @classmethod
    def unused_flags(cls, config) -> tuple:
        # The default's runs keep the directories they had before --objective existed.
        return ("objective",)

    def loss_fn(self, params, batch, rng, frozen):
        return next_token_sums(self.model, params, batch, rng, frozen.get("base"))
