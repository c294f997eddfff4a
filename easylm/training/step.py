"""The train and eval steps: pure functions `(state, batch) -> (state, metrics)` and
`(params, batch, totals, frozen) -> totals`, jitted with explicit shardings. A loss returns
sums (tokens, pairs, ... counted), so gradient accumulation and hosts add up exactly and
the step divides once."""

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from easylm.data import make_global_batch
from easylm.errors import UserError
from easylm.models import sigmoid_moe
from easylm.models.context_parallel import use_order, zigzag_permutation
from easylm.models.family import Model
from easylm.objectives.next_token import NextToken
from easylm.runtime.sharding import (
    BATCH_AXES,
    constrain,
)
from easylm.training.state import TrainState


def _loss_and_grads(loss_fn, params, batch, rng, frozen, accumulate_steps: int):
    """Summed loss statistics and gradients of the summed loss over the batch.

    With k > 1 the batch is split into k micro-batches (rows j, j+k, ... form
    micro-batch j, so each stays spread over all batch shards) and the
    gradients are summed in a scan, so only one micro-batch's activations live
    at a time. Sums add exactly, so this equals the unsplit batch. `frozen`: what the
    loss reads but does not train (`TrainState.frozen`); it gets no gradient.
    """

    def one(micro_batch, rng):
        def summed_loss(p):
            sums = loss_fn(p, micro_batch, rng, frozen)
            return sums.loss, sums

        (_, sums), grads = jax.value_and_grad(summed_loss, has_aux=True)(params)
        return grads, sums

    if accumulate_steps == 1:
        return one(batch, rng)

    def split(x):  # (B, ...) -> (k, B/k, ...)
        return x.reshape(x.shape[0] // accumulate_steps, accumulate_steps, *x.shape[1:]).swapaxes(0, 1)

    def body(total, inputs):
        micro_batch, i = inputs
        micro_batch = jax.tree.map(lambda x: constrain(x, P(BATCH_AXES)), micro_batch)
        out = one(micro_batch, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, total, out), None

    micro_batches = jax.tree.map(split, batch)
    # Whatever sums the loss returns (LossSums, PreferenceSums), zeros of their shape.
    sums_shape = jax.eval_shape(lambda b: one(b, rng)[1], jax.tree.map(lambda x: x[0], micro_batches))
    zeros = (jax.tree.map(jnp.zeros_like, params),
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape))
    (grads, sums), _ = jax.lax.scan(body, zeros, (micro_batches, jnp.arange(accumulate_steps)))
    return grads, sums


def zigzag_tokens(batch: dict, sp: int) -> dict:
    """A batch with every per-token array in zig-zag order along T
    (`context_parallel.zigzag_permutation`), so that each of the sp devices holding T/sp
    places does equal causal work.

    Each `<prefix>input_tokens` names a row layout: documents' input_tokens (B, T), a
    preference pair's chosen_ and rejected_ ones (B, T), GRPO's (B, G, T). Every array whose
    leading dimensions are such a shape (targets, loss masks, segment ids, GRPO's old and
    reference log-probabilities) moves with the tokens, and so do `<prefix>positions` (the
    row's own 0..T-1 when the batch has none): attention decides what it sees from
    positions and segment ids, and a loss summed over tokens does not care about their
    order; GRPO's recorded expert choices (`routing`, (B, G, L, T, K)) move along their T.
    Per-row arrays ((B,), (B, G)) stay as they are; a batch with no input_tokens
    (an objective's own layout, --objective=MODULE:CLASS) too: its forward then runs in
    the row's order, correct but not balanced."""
    shapes = {batch[k].shape for k in batch if k.endswith("input_tokens")}
    if not shapes:
        return batch
    T = next(iter(shapes))[-1]
    if T % (2 * sp):
        raise UserError(f"rows of {T} tokens cannot be split over sp={sp} in zig-zag order: "
                        f"the sequence length must be a multiple of 2*sp = {2 * sp}")
    batch = dict(batch)
    for key in [k for k in batch if k.endswith("input_tokens")]:
        shape, positions = batch[key].shape, key[:-len("input_tokens")] + "positions"
        if positions not in batch:
            batch[positions] = jnp.broadcast_to(jnp.arange(shape[-1], dtype=jnp.int32), shape)
    order = zigzag_permutation(T, sp)
    for key, x in batch.items():
        token_axes = [len(s) for s in shapes if x.shape[:len(s)] == s]
        if key == "routing":  # GRPO's recorded experts (B, G, L, T, K): T is not next to G
            batch[key] = jnp.take(x, order, axis=-2)
        elif token_axes:
            batch[key] = jnp.take(x, order, axis=max(token_axes) - 1)
    return batch


def split_sequence(loss_fn, sp: int):
    """`loss_fn` for batches under a mesh that splits the sequence over sp devices: it sees
    them in zig-zag order (`zigzag_tokens`)."""

    def zigzag_loss(params, batch, rng, frozen):
        # A batch of an objective's own layout stays in the row's order; a layer that
        # carries state along the row (Gated DeltaNet) is told so.
        permuted = any(key.endswith("input_tokens") for key in batch)
        with use_order("zigzag" if permuted else "rows"):
            return loss_fn(params, zigzag_tokens(batch, sp), rng, frozen)

    return zigzag_loss


def make_train_step(loss_fn, tx: optax.GradientTransformation, schedule, seed: int,
                    accumulate_steps: int = 1, bias_update_rate: float = 0.0):
    """The pure train step `(state, batch) -> (state, metrics)` (jit it); `loss_fn(params,
    batch, rng, frozen)` is the objective's. `bias_update_rate` (a model whose
    RouterLoss asks for it): after the update the routers' correction biases move by the
    step's expert load (sigmoid_moe.update_bias)."""

    def train_step(state: TrainState, batch: dict):
        rng = jax.random.fold_in(jax.random.key(seed), state.step)
        grads, sums = _loss_and_grads(loss_fn, state.params, batch, rng, state.frozen,
                                      accumulate_steps)
        count = jnp.maximum(sums.count, 1.0)
        # A mean over what the loss counts: tokens (LossSums), pairs (PreferenceSums).
        grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grads)
        means = sums.means()
        gradient_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if bias_update_rate:
            params = sigmoid_moe.update_bias(params, sums.load, bias_update_rate)
        # A NaN/Inf step leaves parameters and optimizer state as they were; the
        # loop stops (or counts it) when it next looks at the metrics.
        finite = jnp.isfinite(means["loss"]) & jnp.isfinite(gradient_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        first_bad = jnp.where((state.first_nonfinite_step < 0) & ~finite,
                              state.step + 1, state.first_nonfinite_step)
        new_state = state.replace(
            step=state.step + 1,
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32),
            first_nonfinite_step=first_bad,
        )
        metrics = dict(
            **means,
            learning_rate=schedule(state.step),
            gradient_norm=gradient_norm,
            param_norm=optax.tree.norm(new_state.params),
            **{f"loss_{sums.COUNT}": sums.count},
            skipped_updates=new_state.skipped_updates,
            first_nonfinite_step=first_bad,
        )
        return new_state, metrics

    return train_step


def jit_train_step(model: Model, tx, schedule, seed: int, accumulate_steps: int, state, mesh,
                   loss_fn=None):
    """The jitted train step `(state, batch) -> (state, metrics)`, sharded like `state`, the
    batch over BATCH_AXES, the state donated. The trainer and `python -m easylm.bench
    train` both run this one; loss_fn: the objective's (default: next-token prediction)."""
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(
        make_train_step(loss_fn or NextToken(model).loss_fn, tx, schedule, seed,
                        accumulate_steps,
                        getattr(model.router_loss, "bias_update_rate", 0.0)),
        in_shardings=(state_shardings, NamedSharding(mesh, P(BATCH_AXES))),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=(0,),
    )


def device_batch(batch: dict, mesh) -> dict:
    """A host batch (numpy, this process's rows) as global arrays split over BATCH_AXES."""
    return make_global_batch(batch, mesh)


def make_eval_step(loss_fn):
    """`(params, batch, totals, frozen) -> totals`: the loss's sums added over eval
    batches."""

    def eval_step(params, batch, totals, frozen):
        sums = loss_fn(params, batch, jax.random.key(0), frozen)
        return jax.tree.map(jnp.add, totals, sums)

    return eval_step


def jit_eval_step(loss_fn, state, mesh):
    """`make_eval_step` jitted: parameters and frozen ones sharded as in `state`, the batch
    over BATCH_AXES, the totals replicated."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(mesh, P())
    return jax.jit(make_eval_step(loss_fn),
                   in_shardings=(shardings.params, NamedSharding(mesh, P(BATCH_AXES)),
                                 replicated, shardings.frozen),
                   out_shardings=replicated)


def zero_sums(loss_fn) -> Callable:
    """(params, batch, frozen) -> zeros shaped like loss_fn's sums (LossSums,
    PreferenceSums, ...), traced once."""
    shapes = []

    def zeros(params, batch, frozen):
        if not shapes:
            shapes.append(jax.eval_shape(loss_fn, params, batch, jax.random.key(0), frozen))
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0])

    return zeros
