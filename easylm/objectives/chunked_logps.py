"""Per-token quantities of long rows from hidden states and the output head, chunk by
chunk over the sequence, so that the whole (N, T, V) logits never exist.

GRPO's loss needs each completion token's log-probability and entropy at the sampling
temperature (rollouts.token_logps) from the policy's logits; with 8 completions of 4k
tokens and a 152k vocabulary those logits are ~20 GB in fp32. `chunked_token_logps` makes
the same (N, T) numbers from hidden (N, T, D) and the head (D, V) with at most
(N, chunk_size, V) logits live, forward and backward. Summed per-row log-probabilities
(preference losses) are preference.chunked_sequence_logps, and the next-token loss is
next_token.chunked_next_token_loss; this module is for losses that need every token's
value rather than a sum.

Shape letters: N rows, T positions, c positions of one chunk, D width, V vocabulary.
"""

from collections.abc import Callable
from functools import partial

import jax

from easylm.errors import UserError
from easylm.objectives.next_token import head_logits
from easylm.objectives.rollouts import token_logps


def map_chunks(fn: Callable, hidden, head_weight, per_token: tuple, chunk_size: int):
    """`fn(logits, *per_token)` over the whole row, computed chunk by chunk.

    fn maps fp32 logits (N, c, V) and the chunk's slice (N, c, ...) of each `per_token`
    array to a tree of per-token outputs (N, c, ...); the result is that tree for all T
    positions (N, T, ...). Each chunk's logits (`head_logits`: compute dtype, fp32
    accumulation) are made, used and dropped, and `jax.checkpoint` makes the backward pass
    remake them chunk by chunk. hidden (N, T, D), head_weight (D, V)."""
    N, T, _ = hidden.shape
    if T % chunk_size:  # a ragged last chunk would need its own program, or padding
        raise UserError(f"loss_chunk_size={chunk_size} must divide the sequence length {T}")
    chunks = T // chunk_size

    def chunk_outputs(h, xs):  # h (N, c, D)
        return fn(head_logits(h, head_weight), *xs)

    if chunks == 1:  # the logits are needed whole anyway: keep them, recompute nothing
        return chunk_outputs(hidden, per_token)

    def split(x):  # (N, T, ...) -> (chunks, N, c, ...)
        return x.reshape(N, chunks, chunk_size, *x.shape[2:]).swapaxes(0, 1)

    def join(x):  # (chunks, N, c, ...) -> (N, T, ...)
        return x.swapaxes(0, 1).reshape(N, T, *x.shape[3:])

    body = jax.checkpoint(lambda carry, xs: (carry, chunk_outputs(xs[0], xs[1:])))
    _, outputs = jax.lax.scan(body, None, (split(hidden), *map(split, per_token)))
    return jax.tree_util.tree_map(join, outputs)


def chunked_token_logps(hidden, head_weight, targets, temperature: float, chunk_size: int):
    """`rollouts.token_logps(hidden @ head_weight, targets, temperature)` (log-probabilities
    of the targets (N, T) and entropies (N, T), fp32) with at most (N, chunk_size, V) logits
    live. targets (N, T) int."""
    return map_chunks(partial(token_logps, temperature=temperature), hidden, head_weight,
                      (targets,), chunk_size)
