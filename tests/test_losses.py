import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from numerics import EPS_BF16, assert_close, forward_rel

from easylm.errors import UserError
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM
from easylm.models.decoder import head_weight as lm_head_weight
from easylm.objectives.next_token import chunked_next_token_loss, next_token_loss
from easylm.runtime.sharding import BATCH_AXES, init_sharded, make_mesh


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_size", [8, 16, 32])
def test_chunked_loss_equals_full_logits(tied, chunk_size):
    config = LLaMAConfig.from_preset("debug", tie_word_embeddings=tied, initializer_range=0.2)
    model = LLaMAForCausalLM(config)
    params = model.init_params(jax.random.PRNGKey(0))
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, config.vocab_size, (2, 33)))
    masks = jnp.asarray(rng.rand(2, 32) > 0.3, jnp.float32)

    def full(params):
        logits = model.apply({"params": params}, ids[:, :-1])
        sums = next_token_loss(logits, ids[:, 1:], masks)
        return sums.loss / sums.tokens, sums  # the mean, as the train step uses

    def chunked(params):
        hidden = model.apply({"params": params}, ids[:, :-1], return_hidden=True)
        sums = chunked_next_token_loss(hidden, lm_head_weight(params, config), ids[:, 1:], masks, chunk_size)
        return sums.loss / sums.tokens, sums  # the mean, as the train step uses

    (_, want), grads = jax.value_and_grad(full, has_aux=True)(params)
    (_, got), grads2 = jax.jit(jax.value_and_grad(chunked, has_aux=True))(params)
    # The same sums in other orders: each token's loss is off by at most twice the largest
    # logit error, and the summed loss by the tokens' count times that.
    rel = forward_rel(config, 32)
    logits_scale = float(jnp.abs(model.apply({"params": params}, ids[:, :-1])).max())
    assert abs(float(got.loss) - float(want.loss)) <= float(want.tokens) * 2 * rel * logits_scale
    assert (float(got.correct), float(got.tokens)) == (float(want.correct), float(want.tokens))
    for g, g2 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
        assert_close(g2, g, 2 * rel)  # backward: the depth twice


def test_chunk_size_must_divide_the_sequence():
    hidden, weight = jnp.zeros((2, 32, 4)), jnp.zeros((4, 16))
    targets, masks = jnp.zeros((2, 32), jnp.int32), jnp.ones((2, 32))
    with pytest.raises(UserError, match=r"^loss_chunk_size=24 must divide the sequence "
                                        r"length 32$"):
        chunked_next_token_loss(hidden, weight, targets, masks, 24)


@pytest.mark.parametrize("chunk_size", [8, 32])
def test_only_several_chunks_recompute_their_logits(chunk_size):
    # Forward + backward of the loss: the head matmul once forward, twice backward
    # (hidden's and the weight's gradients), plus once more per recomputed chunk.
    hidden, weight = jnp.ones((2, 32, 4)), jnp.ones((4, 16))
    targets, masks = jnp.zeros((2, 32), jnp.int32), jnp.ones((2, 32))

    def loss(hidden, weight):
        return chunked_next_token_loss(hidden, weight, targets, masks, chunk_size).loss

    # The program as emitted (XLA:CPU happens to merge the single chunk's recompute
    # back into the forward matmul; nothing promises every backend does).
    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weight).as_text()
    assert hlo.count("dot_general") == (3 if chunk_size == 32 else 4), hlo


def test_head_backward_matmuls_run_in_the_compute_dtype():
    # bf16 hidden states, an fp32 head: autodiff alone makes the logits' fp32 gradient
    # meet an upcast weight and hidden in two fp32 matmuls. Every matmul of the loss's
    # forward and backward pass must take bf16 operands (fp32 accumulation allowed).
    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.randn(2, 32, 8), jnp.bfloat16)
    weight = jnp.asarray(rng.randn(8, 16) * 0.1, jnp.float32)
    targets = jnp.asarray(rng.randint(0, 16, (2, 32)))
    masks = jnp.ones((2, 32))

    def loss(hidden, weight):
        return chunked_next_token_loss(hidden, weight, targets, masks, 32).loss

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    dots = [line for line in grad.lower(hidden, weight).as_text().splitlines()
            if "dot_general" in line]
    assert len(dots) == 3, dots
    for line in dots:
        operands = line.rsplit(":", 1)[1].split("->")[0]
        assert operands.count("bf16>") == 2, line

    # The gradients are autodiff's of the same computation in fp32, to bf16 precision;
    # the weight's comes back in its own dtype.
    d_hidden, d_weight = grad(hidden, weight)
    want_hidden, want_weight = jax.grad(loss, argnums=(0, 1))(
        hidden.astype(jnp.float32), weight.astype(jnp.bfloat16).astype(jnp.float32))
    assert d_hidden.dtype == jnp.bfloat16 and d_weight.dtype == jnp.float32
    # Three bf16 roundings in sequence (the logits, their gradient, the product), half an
    # ulp each; the fp32 accumulation adds nothing comparable.
    assert_close(d_hidden.astype(jnp.float32), want_hidden, 3 * EPS_BF16 / 2)
    assert_close(d_weight, want_weight, 3 * EPS_BF16 / 2)


@pytest.mark.parametrize("mesh_dim", ["2,2,2", "1,1,8"])
@pytest.mark.parametrize("chunk_size", [8, 16])
def test_chunked_loss_sharded_equals_single_device(mesh_dim, chunk_size):
    config = LLaMAConfig.from_preset("debug", initializer_range=0.2)
    model = LLaMAForCausalLM(config)
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, config.vocab_size, (8, 17)))
    masks = jnp.asarray(rng.rand(8, 16) > 0.3, jnp.float32)

    def loss(params, ids, masks):
        hidden = model.apply({"params": params}, ids[:, :-1], return_hidden=True)
        sums = chunked_next_token_loss(hidden, lm_head_weight(params, config), ids[:, 1:], masks,
                                       chunk_size)
        return sums.loss / sums.tokens

    params = model.init_params(jax.random.PRNGKey(0))
    want, want_grads = jax.jit(jax.value_and_grad(loss))(params, ids, masks)
    mesh = make_mesh(mesh_dim)
    sharded = init_sharded(model.init_params, PARTITION_RULES, mesh, jax.random.PRNGKey(0))
    batch = NamedSharding(mesh, P(BATCH_AXES))
    with jax.set_mesh(mesh):
        got, grads = jax.jit(jax.value_and_grad(loss))(
            sharded, jax.device_put(ids, batch), jax.device_put(masks, batch))
    # Sharded sums (over the batch and the vocabulary) add in other orders; the loss is a
    # mean of token losses, each within twice the largest logit error.
    rel = forward_rel(config, 16)
    logits_scale = float(jnp.abs(model.apply({"params": params}, ids[:, :-1])).max())
    assert abs(float(got) - float(want)) <= 2 * rel * logits_scale
    for g, g2 in zip(jax.tree.leaves(want_grads), jax.tree.leaves(grads)):
        assert_close(np.asarray(g2), np.asarray(g), 2 * rel)
