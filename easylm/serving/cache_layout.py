"""How the serving engine reads a model's cache: `CacheLayout` learns each cache array's
slot axis and length axis (or none, a slot's state) from `init_cache`'s shapes, and holds
the methods the engine reads and writes its dense cache with; `pages.PagedLayout` has the
same methods over a pool of pages.

What each cache array is, the layer declares by the shape its `layer_cache` gives: an
array with a length axis is positional (an attention layer's keys and values (B, S, K, H),
a latent cache (B, S, C)): sliced to the positions a decode call reads and written by
position; one without is a slot's state (Gated DeltaNet's conv inputs and recurrent
state): carried whole, started from zeros when a slot takes a request.

Shapes: B slots, S cache positions.
"""

import dataclasses

import jax
import jax.numpy as jnp

from easylm.errors import UserError
from easylm.models import decoder
from easylm.models.family import Model


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Per cache array (in `jax.tree.leaves` order): its batch (slot) axis, and its length
    axis or None for a slot's state, read off the shapes `init_cache` gives for two batch
    sizes (the batch axis) and by the decoder's rule (`decoder.length_axes`, the length
    its masks read): what a layer's `layer_cache` declares, whatever it names its arrays
    (a scan's stacked layers only add a leading axis)."""

    batch: tuple[int, ...]
    length: tuple[int | None, ...]

    @classmethod
    def of(cls, model: Model) -> "CacheLayout":
        def shapes(batch, length):
            tree = jax.eval_shape(lambda: model.init_cache(batch, length))
            return [leaf.shape for leaf in jax.tree.leaves(tree)], tree

        base, tree = shapes(2, 8)
        wider, _ = shapes(3, 8)
        names = [jax.tree_util.keystr(path) for path, _ in
                 jax.tree_util.tree_flatten_with_path(tree)[0]]
        batch, length = [], []
        # The length axes by the decoder's rule (what its masks read), the batch axis alike.
        for name, one, b, length_axes in zip(names, base, wider, decoder.length_axes(
                model.init_cache)):
            batch_axes = [i for i, (x, y) in enumerate(zip(one, b)) if x != y]
            if len(batch_axes) != 1 or len(length_axes) > 1 or \
                    tuple(batch_axes) == length_axes:
                raise UserError(f"{model.name}: the serving engine (serve, eval, GRPO "
                                f"rollouts) needs each cache array to have one batch axis "
                                f"and at most one length axis; {name} has shape {one} "
                                f"for 2 slots of 8 positions")
            batch.append(batch_axes[0])
            length.append(length_axes[0] if length_axes else None)
        return cls(tuple(batch), tuple(length))

    direct = False  # decode reads a dense window (`pages.PagedLayout.direct`: the pool)

    @property
    def has_state(self) -> bool:
        """Whether some array is a slot's state (no length axis)."""
        return any(axis is None for axis in self.length)

    def map(self, fn, *trees):
        """fn(batch axis, length axis or None, *leaves) over the cache's arrays."""
        leaves = [jax.tree.leaves(tree) for tree in trees]
        out = [fn(b, s, *xs) for b, s, *xs in zip(self.batch, self.length, *leaves)]
        return jax.tree.unflatten(jax.tree.structure(trees[0]), out)

    def cache_length(self, cache) -> int:
        """S, the positions the cache holds (0: none, only state)."""
        for leaf, axis in zip(jax.tree.leaves(cache), self.length):
            if axis is not None:
                return leaf.shape[axis]
        return 0

    def empty(self, model: Model, slots: int, length: int):
        """The engine's zero cache: `slots` rows of `length` positions."""
        return model.init_cache(slots, length)

    def take_slots(self, cache, slots):
        """The rows of `slots` (n,), all positions (a padding slot reads the last slot's)."""
        return self.map(lambda b, s, c: jnp.take(c, slots, axis=b, mode="clip"), cache)

    def window(self, cache, length: int):
        """The first `length` positions of each positional array; states whole."""
        if length >= self.cache_length(cache):
            return cache
        return self.map(lambda b, s, c: c if s is None else
                        jax.lax.slice_in_dim(c, 0, length, axis=s), cache)

    def write_window(self, cache, window):
        """`window` (from `window`) written back over the cache's first positions."""
        if self.cache_length(window) >= self.cache_length(cache):
            return window
        return self.map(lambda b, s, c, w: w if s is None else
                        jax.lax.dynamic_update_slice_in_dim(c, w.astype(c.dtype), 0, axis=s),
                        cache, window)

    def write_slots(self, cache, fresh, slots, T: int):
        """Rows of `fresh` (n prompts) into `slots` (n,): a positional array's first T
        positions, a state whole. A slot index past the last (padding rows) is dropped."""
        def write(b, s, c, f):
            index = [slice(None)] * c.ndim
            index[b] = slots
            if s is not None:
                index[s] = slice(0, T)
                f = jax.lax.slice_in_dim(f, 0, T, axis=s)
            return c.at[tuple(index)].set(f.astype(c.dtype), mode="drop")
        return self.map(write, cache, fresh)


def check_cache(model: Model) -> CacheLayout:
    """The cache's layout; refused in one line when some array has no single batch axis
    or more than one length axis (what the engine could not slice, write by slot and
    reset per request)."""
    return CacheLayout.of(model)
