"""Chunked per-token log-probabilities (easylm/objectives/chunked_logps.py): the numbers and
gradients of rollouts.token_logps on the full logits, without those logits."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easylm.errors import UserError
from easylm.objectives.chunked_logps import chunked_token_logps
from easylm.objectives.next_token import head_logits
from easylm.objectives.rollouts import token_logps

EPS32 = float(np.finfo(np.float32).eps)
N, T, D, V, CHUNK, TEMPERATURE = 3, 16, 8, 32, 4, 0.7


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(N, T, D)).astype(np.float32)
    head = (rng.normal(size=(D, V)) / np.sqrt(D)).astype(np.float32)
    targets = rng.integers(0, V, size=(N, T)).astype(np.int32)
    weights = rng.normal(size=(2, N, T)).astype(np.float32)
    return hidden, head, targets, weights


def loss(logps, entropy, weights):
    """Nonlinear in every token's values, as GRPO's ratio exp(logp - old) is."""
    return jnp.sum(weights[0] * jnp.exp(logps)) + jnp.sum(weights[1] * entropy)


@partial(jax.jit, static_argnums=0)
def values_and_grads(logps_fn, hidden, head, targets, weights):
    def f(hidden, head):
        logps, entropy = logps_fn(hidden, head, targets)
        return loss(logps, entropy, weights), (logps, entropy)
    (_, (logps, entropy)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        hidden, head)
    return [logps, entropy, *grads]


def full(hidden, head, targets):
    return token_logps(head_logits(hidden, head), targets, TEMPERATURE)


def within(got, want):
    """fp32 against float64: logits sum D terms and the log-sum-exp V more; the head's
    gradient adds a sum over all N*T tokens. Each drifts by ~terms * eps * its scale."""
    terms = [D + V, D + V, 2 * (D + V), N * T + D + V]
    return all(np.abs(g - w).max() <= n * EPS32 * np.abs(w).max()
               for g, w, n in zip(got, want, terms))


def test_equals_full_logits_values_and_gradients():
    hidden, head, targets, weights = inputs()
    with jax.enable_x64(True):
        want = values_and_grads(full, *(jnp.asarray(x, jnp.float64) for x in (hidden, head)),
                                targets, jnp.asarray(weights, jnp.float64))

    def chunked(hidden, head, targets):
        return chunked_token_logps(hidden, head, targets, TEMPERATURE, CHUNK)

    want = [np.asarray(x) for x in want]
    assert within(values_and_grads(chunked, hidden, head, targets, weights), want)
    # Negative twin: each chunk's targets one place late.
    late = np.roll(targets, 1, axis=1)
    shifted = values_and_grads(chunked, hidden, head, late, weights)
    assert not within(shifted, want)


def test_memory_is_below_the_full_logits_by_the_chunk_factor():
    """The backward of the full version keeps two (N, T, V) fp32 buffers (the logits and
    their gradient): 2 * 64 MiB here; the chunked one two (N, c, V) buffers, T/c = 8 times
    fewer, plus O(N * T * D) buffers (hidden's gradient, 2 MiB each, V/D = 32 times
    smaller than the logits). So the ratio is about T/c, a little under: at least half."""
    n, t, d, v, chunk = 8, 1024, 64, 2048, 128

    def temp_bytes(logps_fn):
        def f(hidden, head, targets, weights):
            logps, entropy = logps_fn(hidden, head, targets)
            # GRPO's form: the ratio's gradient, the entropy only logged
            return jnp.sum(jnp.exp(logps - jax.lax.stop_gradient(logps)) * weights) + \
                jnp.sum(jax.lax.stop_gradient(entropy))
        shapes = [((n, t, d), jnp.float32), ((d, v), jnp.float32), ((n, t), jnp.int32),
                  ((n, t), jnp.float32)]
        args = [jax.ShapeDtypeStruct(s, dtype) for s, dtype in shapes]
        program = jax.jit(jax.grad(f, argnums=(0, 1))).lower(*args).compile()
        return program.memory_analysis().temp_size_in_bytes

    logits_bytes = n * t * v * 4
    full_bytes = temp_bytes(full)
    chunked_bytes = temp_bytes(lambda h, w, y: chunked_token_logps(h, w, y, 1.0, chunk))
    assert full_bytes >= logits_bytes > chunked_bytes
    assert full_bytes / chunked_bytes >= (t / chunk) / 2


def test_chunk_must_divide_the_row():
    hidden, head, targets, _ = inputs()
    with pytest.raises(UserError, match="loss_chunk_size=5 must divide the sequence length 16"):
        chunked_token_logps(hidden, head, targets, 1.0, 5)
