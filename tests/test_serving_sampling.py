"""Sampling: seeded draws independent of the batch, top-k and top-p."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from serving_utils import PROMPTS, tokenizer  # noqa: F401 (a fixture)

from easylm.serving.batcher import SamplingParams
from easylm.serving.sampling import SAMPLE, TRUNCATE, kind, next_tokens


def test_sampling_is_seeded_and_independent_of_the_batch(served, tokenizer):
    batcher, _, _ = served
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    together = batcher.generate(PROMPTS[:3], params, tokenizer)
    alone = batcher.generate(PROMPTS[:1], params, tokenizer)
    assert [t.id for t in together[0].tokens] == [t.id for t in alone[0].tokens]
    other_seed = batcher.generate(PROMPTS[:1], dataclasses.replace(params, seed=8), tokenizer)
    assert [t.id for t in other_seed[0].tokens] != [t.id for t in alone[0].tokens]
    # top_k=1 leaves only the argmax: sampling at any temperature is greedy.
    top1 = batcher.generate(PROMPTS[:1], SamplingParams(max_tokens=10, temperature=2.0, top_k=1),
                            tokenizer)
    greedy = batcher.generate(PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0.0),
                              tokenizer)
    assert [t.id for t in top1[0].tokens] == [t.id for t in greedy[0].tokens]


def test_top_k_and_top_p_restrict_the_support():
    # (top_k, top_p) per row, 300 draws each from probabilities .5 .3 .15 .05.
    settings = {"top_k=2": (2, 1.0), "top_p=0.7": (0, 0.7), "top_p=0.85": (0, 0.85),
                "off": (0, 1.0)}
    draws = 300
    rows = len(settings) * draws
    logits = jnp.log(jnp.tile(jnp.array([[0.5, 0.3, 0.15, 0.05]]), (rows, 1)))
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(0), rows))
    top_k = jnp.repeat(jnp.array([k for k, _ in settings.values()]), draws)
    top_p = jnp.repeat(jnp.array([p for _, p in settings.values()]), draws)
    tokens, *_ = jax.jit(next_tokens)(logits, keys, jnp.zeros(rows, jnp.int32), jnp.ones(rows),
                                      top_k, top_p)
    seen = {name: set(np.asarray(tokens).reshape(len(settings), draws)[i].tolist())
            for i, name in enumerate(settings)}
    assert seen == {"top_k=2": {0, 1}, "top_p=0.7": {0, 1}, "top_p=0.85": {0, 1, 2},
                    "off": {0, 1, 2, 3}}


def test_rows_without_top_k_or_top_p_draw_alike_with_and_without_the_sort():
    """A call whose rows only sample (GRPO's rollouts) skips the vocabulary's sort; a row
    without top-k/top-p in a call where another row truncates draws the very same token
    (same key, same logits). Negative twin: rows with top_p draw differently."""
    rows, V = 64, 50
    logits = 3 * jax.random.normal(jax.random.PRNGKey(1), (rows, V))
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(2), rows))
    ones, positions = jnp.ones(rows), jnp.zeros(rows, jnp.int32)
    top_k, top_p = jnp.zeros(rows, jnp.int32), jnp.ones(rows)
    draw = jax.jit(next_tokens, static_argnames="sample")
    plain, *_ = draw(logits, keys, positions, ones, top_k, top_p, sample=SAMPLE)
    mixed_k = top_k.at[0].set(1)  # row 0 truncates: the call needs the sort
    assert kind(np.ones(rows), np.asarray(mixed_k), np.ones(rows)) == TRUNCATE
    assert kind(np.ones(rows), np.zeros(rows), np.ones(rows)) == SAMPLE
    mixed, *_ = draw(logits, keys, positions, ones, mixed_k, top_p, sample=TRUNCATE)
    np.testing.assert_array_equal(np.asarray(mixed)[1:], np.asarray(plain)[1:])
    assert mixed[0] == jnp.argmax(logits[0])
    nucleus, *_ = draw(logits, keys, positions, ones, top_k, top_p * 0.3, sample=TRUNCATE)
    assert (np.asarray(nucleus) != np.asarray(plain)).any()
