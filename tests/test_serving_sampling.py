"""Sampling: seeded draws independent of the batch, top-k and top-p."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from serving_utils import PROMPTS, tokenizer  # noqa: F401 (a fixture)

from easylm.serving.batcher import SamplingParams
from easylm.serving.sampling import next_tokens


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
