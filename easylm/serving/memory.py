"""What the serving engine holds on one device while it prefills or scores a long prompt,
estimated before anything is compiled (`python -m easylm.plan --plan.serve_tokens=32768`).

    weights   every parameter's shard in the compute dtype (the engine keeps them in --dtype),
              an int8 variant's int8 values in their one byte
    kv cache  every slot's keys and values for seq_length positions, and a recurrent layer's
              state (a constant per slot and layer): the engine's state
    prompt    the prompt's own keys and values (and state) while it is prefilled (rows x T',
              T rounded up to a multiple of the chunk), written into its slot at the end;
              a scored row's cache the same (the batcher scores at most seq_length tokens
              of rows at a time)
    chunk     one chunk through one layer (layers run one after another): its scores and
              probabilities (rows, N, C, T') in fp32 and their mask, q/k/v, the MLP's
              (rows, C, F) and the head's (rows, C, V) logits, with a scored chunk's fp32
              log-probabilities

Each chunk attends over the prompt's cache so far (easylm/serving/programs.py
`_prompt_forward`, `_score`), so nothing grows as T^2: the chunk term is linear in T, the
caches too.
"""

import math

import jax
import jax.numpy as jnp

from easylm.runtime.sharding import axes_size, match_partition_rules


def _shard_bytes(shapes, rules, sizes: dict, dtype=None, specs=None) -> int:
    """One device's bytes of `shapes` under `rules` (or the PartitionSpecs `specs`), every
    float leaf in `dtype` (None: its own; an integer leaf, int8 weights, in its own); a
    dimension the axes do not divide stays whole (as the engine's `fitted_spec` keeps it)."""
    total = 0
    specs = match_partition_rules(rules, shapes) if specs is None else specs
    for leaf, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        shape = list(leaf.shape)
        for dim, axes in enumerate(spec):
            split = axes_size(sizes, axes)
            if shape[dim] % split == 0:
                shape[dim] //= split
        cast = dtype is not None and jnp.issubdtype(leaf.dtype, jnp.floating)
        total += math.prod(shape) * jnp.dtype(dtype if cast else leaf.dtype).itemsize
    return total


def chunk_bytes(config: dict, rows: int, chunk: int, keys: int, mp: int, dtype) -> int:
    """One chunk's transient through a layer and the head, heads, MLP and vocabulary
    divided over mp (`config`: the family's config as a dict)."""
    size = jnp.dtype(dtype).itemsize
    heads = max(1, config["num_attention_heads"] // mp)
    kv = max(1, config["num_key_value_heads"] // mp)
    head_dim = config["head_dim"]
    scores = rows * heads * chunk * keys * (4 + 4)  # fp32 scores and probabilities
    mask = rows * chunk * keys
    qkv = rows * chunk * (heads + 2 * kv) * head_dim * size
    mlp = rows * chunk * 3 * (config["intermediate_size"] // mp) * size
    # The logits, and in fp32 a prefill's pick or a scored chunk's logits and log-softmax.
    logits = rows * chunk * (config["vocab_size"] // mp) * (size + 8)
    return scores + mask + qkv + max(mlp, logits)


def page_bytes(model, sizes: dict, dtype, page_size: int) -> int:
    """One device's bytes of one cache page (`serving/pages.py`): `page_size` positions of
    every positional array, heads split over mp; every device holds every page
    (`PagedLayout.pool_specs`). A cache of one slot less one of no
    positions: what a slot's state (no length axis) holds cancels."""
    def one(length):
        return _shard_bytes(jax.eval_shape(lambda: model.init_cache(1, length, dtype)),
                            model.cache_rules, sizes)
    return one(page_size) - one(0)


def serving_bytes(model, sizes: dict, dtype, slots: int, seq_length: int, prompt: int,
                  chunk: int, rows: int = 1, page_size: int = 0, pages: int = 0) -> dict:
    """{part: bytes per device} of an engine with `slots` slots of `seq_length` positions
    prefilling `rows` prompts of `prompt` tokens `chunk` at a time (0: at once); with
    `page_size`, its cache a pool of `pages` pages (0: the engine's default, every slot's
    whole length and the scratch page) and each slot's state."""
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    cache = jax.eval_shape(lambda: model.init_cache(slots, seq_length, dtype))
    cache_specs = None
    if page_size:
        from easylm.serving.cache_layout import CacheLayout
        from easylm.serving.pages import PagedLayout, check_pages

        pages = check_pages(page_size, pages, slots, seq_length)
        layout = PagedLayout(CacheLayout.of(model), page_size, pages)
        cache = layout.map(
            lambda b, s, pool, per_slot: per_slot if s is None else pool,
            jax.eval_shape(lambda: model.init_cache(pages, page_size, dtype)),
            jax.eval_shape(lambda: model.init_cache(slots, page_size, dtype)))
        cache_specs = layout.pool_specs(model.cache_rules, cache)  # the engine's
    C = prompt if chunk <= 0 or chunk >= prompt else chunk
    padded = -(-prompt // C) * C
    fresh = jax.eval_shape(lambda: model.init_cache(rows, padded, dtype))
    parts = {
        "weights": _shard_bytes(params, model.partition_rules, sizes, dtype),
        # The caches as `init_cache` makes them in `dtype`: keys and values in it, a
        # recurrent state in its own (Gated DeltaNet's fp32), the same bytes whatever the
        # length (a constant per linear layer).
        "kv cache": _shard_bytes(cache, model.cache_rules, sizes, specs=cache_specs),
        "prompt": _shard_bytes(fresh, model.cache_rules, sizes),
        "chunk": chunk_bytes(model.config, rows, C, padded, sizes["mp"], dtype),
    }
    return parts | {"total": sum(parts.values())}
