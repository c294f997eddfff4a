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


# ------------------------------------------------------------ in GRPO's loss


def grpo_step(chunk_size):
    """(GRPO objective (beta 0.1, a frozen copy as reference) on the one-layer debug LLaMA
    with --llama.loss_chunk_size=chunk_size, its parameters, a synthetic batch of 2 prompts
    x 4 completions of 16 tokens)."""
    from easylm import objectives, variants
    from easylm.llama import train as llama_train
    from easylm.llama.family import FAMILY

    config = llama_train.parse_flags([
        "train", "--objective=grpo", "--llama.base_model=debug", "--llama.num_hidden_layers=1",
        f"--llama.loss_chunk_size={chunk_size}", "--grpo.num_generations=4", "--grpo.beta=0.1",
        "--grpo.reward_funcs=answer_match", "--train_dataset.json_dataset.seq_length=16"])
    model = variants.build(FAMILY, config)
    params = model.init_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 512, (2, 4, 17)).astype(np.int32)
    masks = np.zeros((2, 4, 17), np.float32)
    masks[..., 5:] = rng.integers(0, 2, (2, 4, 12))
    batch = {"input_tokens": tokens[..., :-1], "target_tokens": tokens[..., 1:],
             "loss_masks": masks[..., 1:], "advantages": rng.normal(size=(2, 4)),
             "valid": np.ones((2, 4), np.float32), "old_logps": -rng.uniform(3, 8, (2, 4, 16))}
    batch = {k: np.asarray(v, np.float32 if v.dtype == np.float64 else v.dtype)
             for k, v in batch.items()}
    return objectives.build(config, model, None), params, batch


def reference_logps(objective, params, batch):
    """The reference's (B, G, T) log-probabilities, as the rollouts store them."""
    frozen = {"reference": jax.tree.map(lambda x: x * 0.9, params)}
    logps, _ = jax.jit(lambda p, f, x, y: objective.token_logps(p, f, x, y, reference=True))(
        params, frozen, batch["input_tokens"].reshape(8, 16),
        batch["target_tokens"].reshape(8, 16))
    return np.asarray(logps).reshape(2, 4, 16)


def grpo_loss_and_grads(objective):
    """The jitted (params, batch) -> (loss, gradients) of `objective`."""
    return jax.jit(jax.value_and_grad(lambda p, b: objective.loss_fn(p, b, None, {}).loss))


def test_grpo_loss_chunked_equals_full_logits():
    """GRPO's step (its loss over 2 x 4 completions and its gradients, and the reference's
    log-probabilities) with the logits made 4 positions at a time equals the full logits':
    the same per-token numbers, each logit a D-term sum in another matmul."""
    chunked, params, batch = grpo_step(4)
    full, _, _ = grpo_step(0)
    ref = reference_logps(full, params, batch)
    assert np.abs(reference_logps(chunked, params, batch) - ref).max() <= \
        2 * 64 * EPS32 * np.abs(ref).max()  # a log-softmax of D=64-term logits
    batch["ref_logps"] = ref
    step = grpo_loss_and_grads(chunked)
    loss, grads = step(params, batch)
    want_loss, want_grads = grpo_loss_and_grads(full)(params, batch)
    tokens = batch["loss_masks"].sum()
    assert abs(float(loss) - float(want_loss)) <= tokens * EPS32 * abs(float(want_loss))
    for g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        scale = np.abs(want).max()
        assert np.abs(np.asarray(g) - want).max() <= 2 * tokens * EPS32 * scale
    # Negative twin: another row's targets (every token off by one place).
    shifted = {**batch, "target_tokens": np.roll(batch["target_tokens"], 1, axis=-1)}
    other, _ = step(params, shifted)
    assert abs(float(other) - float(want_loss)) > tokens * EPS32 * abs(float(want_loss))
