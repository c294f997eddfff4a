"""A paged cache: the positional cache arrays in one pool of fixed-size pages, a page table
per slot, and the host's book of which slot holds which pages.

Dense (`--page_size=0`), each slot owns `seq_length` positions of every positional array
(`cache_layout.CacheLayout`): B x S positions whether a request uses 10 of them or all. Paged,
every positional array is `model.init_cache(pages, page_size)`: its slot axis counts pages
and its length axis a page's positions, whatever the layer (keys and values, MLA's latent,
Gemma 4's shared keys and values; a scan's stacked layers only add a leading axis), and
slot b's position p lives at offset p % page_size of page table[b, p // page_size]. A
state without a length axis (Gated DeltaNet's conv and recurrent state) stays one row per
slot, as dense.

The read path (`PagedLayout.window`) gathers a slot's positions through its page table
into the dense (B, L) window the model already attends over, and `write_window` scatters
the window back: the model sees at every position its mask admits exactly the values the
dense cache holds, so its numbers are the dense engine's. Positions a slot holds no page
for read and write page 0, a scratch page no slot owns (the dense engine's never-read
garbage, in one page).

Shape letters: B slots, S positions a slot may hold (seq_length), L positions a call
reads, P pages, Z page_size.
"""

import collections
import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from easylm.errors import UserError
from easylm.models.paged_attention import PagedKV, SharedPrefix, combine, split
from easylm.runtime.sharding import match_partition_rules
from easylm.serving.cache_layout import CacheLayout

SCRATCH = 0  # the page that positions without a page of their own read and write


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pool", "table", "prefix"],
                   meta_fields=[])
@dataclasses.dataclass
class PagedCache:
    """The engine's cache when paged: `pool`, laid out like `model.init_cache`'s tree (a
    positional array's slot axis holds P pages, its length axis Z positions; a state's
    slot axis B slots), `table` (B, S / Z) int32, each slot's pages in order, and with
    --prefix_groups the groups of slots that share their leading pages
    (`PageBook.shared_groups`), which decode reads once a group."""

    pool: object
    table: jax.Array
    prefix: SharedPrefix | None = None


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """`cache_layout.CacheLayout`'s cache methods over a `PagedCache`: the engine calls these
    where it reads and writes its cache, and the model only ever sees dense windows."""

    dense: object  # the model's cache_layout.CacheLayout: each array's slot and length axes
    page_size: int
    pages: int
    # The pool's layout when every positional array is an attention layer's keys or values
    # and no slot holds a state (`kernel_layout`): each layer's pair interleaved in one
    # array (`paged_attention.combine`), which decode attends straight from (`decoded`).
    packed: CacheLayout | None = None
    decode_kernel: str = "batched"  # the kernel decode attends with (`PagedKV.kernel`)
    prefix_groups: int = 0  # groups of slots on shared pages decode reads once (E)

    @property
    def direct(self) -> bool:
        """Whether decode reads the pool in place (`decoded`) instead of a dense window."""
        return self.packed is not None

    def _pool(self):
        return self.packed or self.dense

    def _pack(self, tree):
        return _swap(tree, {"k", "v"}, lambda e: {"kv": combine(e["k"], e["v"])}) \
            if self.direct else tree

    def _unpack(self, tree):
        return _swap(tree, {"kv"}, lambda e: dict(zip("kv", split(e["kv"])))) \
            if self.direct else tree

    def decoded(self, cache: PagedCache, step):
        """`step(entries)` -> (out, entries) over the pool with each layer's pair a
        `PagedKV` (its pages and every slot's table): (out, the cache it leaves)."""
        def entry(e):
            kv = e["kv"]  # (..., P, Z, 2K, H): a scan's stacked layers lead
            lead = jax.tree.map(lambda x: jnp.broadcast_to(x, (*kv.shape[:-4], *x.shape)),
                                (cache.table, cache.prefix))
            return PagedKV(kv, lead[0], self.decode_kernel, lead[1])
        out, entries = step(_swap(cache.pool, {"kv"}, entry))
        pool = jax.tree.map(lambda x: {"kv": x.kv} if isinstance(x, PagedKV) else x, entries,
                            is_leaf=lambda x: isinstance(x, PagedKV))
        return out, dataclasses.replace(cache, pool=pool)

    @property
    def has_state(self) -> bool:
        return self.dense.has_state

    def map(self, fn, *trees):
        return self.dense.map(fn, *trees)

    def pool_specs(self, rules, pool):
        """The pool's PartitionSpecs by the cache's `rules` (`Model.cache_rules`): a
        positional array's heads split as the dense cache's (over 'mp'), its page axis
        whole on every device; a state's slot axis split like the dense cache's slots.
        Why not the pages over the batch axes like slots: a slot's pages may be any of
        the pool's (a shared prompt's, the free list's), so every window would gather
        pages from other devices and every write scatter into them."""
        specs = jax.tree.leaves(match_partition_rules(rules, pool),
                                is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))

        def whole_pages(b, s, leaf, spec):
            if s is None:
                return spec
            dims = list(spec) + [None] * (leaf.ndim - len(spec))
            dims[b] = None
            return jax.sharding.PartitionSpec(*dims)
        return jax.tree.unflatten(jax.tree.structure(pool), [
            whole_pages(b, s, leaf, spec) for b, s, leaf, spec in
            zip(self._pool().batch, self._pool().length, jax.tree.leaves(pool), specs)])

    def empty(self, model, slots: int, length: int) -> PagedCache:
        """Zero pages and every slot's table at the scratch page."""
        pool = self.dense.map(lambda b, s, paged, per_slot: per_slot if s is None else paged,
                              model.init_cache(self.pages, self.page_size),
                              model.init_cache(slots, self.page_size))
        table = np.full((slots, -(-length // self.page_size)), SCRATCH, np.int32)
        prefix = SharedPrefix(**no_groups(self.prefix_groups, table)) \
            if self.prefix_groups else None
        return PagedCache(self._pack(pool), jnp.asarray(table),
                          jax.tree.map(jnp.asarray, prefix))

    def cache_length(self, cache: PagedCache) -> int:
        return cache.table.shape[1] * self.page_size

    def _flat(self, table, slots, length: int):
        """(rows, length) indices into a pool array's flattened (P * Z) positions: row i's
        positions 0..length-1 through slots[i]'s table row; a slot index past the last
        (padding rows) gives P * Z, out of range: its writes are dropped."""
        B = table.shape[0]
        p = jnp.arange(length)
        rows = table[jnp.clip(slots, 0, B - 1)][:, p // self.page_size]  # (rows, length)
        flat = rows * self.page_size + p % self.page_size
        return jnp.where((slots < B)[:, None], flat, self.pages * self.page_size)

    @staticmethod
    def _positions_first(b, s, x):
        """x with its slot (page) and length axes first, those two merged: (P * Z, ...)."""
        x = jnp.moveaxis(x, (b, s), (0, 1))
        return x.reshape(-1, *x.shape[2:])

    @staticmethod
    def _back(b, s, x, like):
        """`_positions_first`'s inverse for an array shaped like `like` on axes b, s."""
        x = x.reshape(like.shape[b], like.shape[s], *x.shape[1:])
        return jnp.moveaxis(x, (0, 1), (b, s))

    def take_slots(self, cache: PagedCache, slots, length: int | None = None):
        """Dense (n, length) rows of `slots` (n,): what `CacheLayout.map`'s take along the
        slot axis gives for a dense cache (a padding slot reads the last slot's)."""
        length = self.cache_length(cache) if length is None else length
        index = self._flat(cache.table, jnp.clip(slots, 0, cache.table.shape[0] - 1), length)

        def take(b, s, c):
            if s is None:
                return jnp.take(c, slots, axis=b, mode="clip")
            out = self._positions_first(b, s, c)[index]  # (n, length, ...)
            return jnp.moveaxis(out, (0, 1), (b, s))
        return self._unpack(self._pool().map(take, cache.pool))

    def window(self, cache: PagedCache, length: int):
        """Every slot's first `length` positions, dense (B, length); states whole."""
        return self.take_slots(cache, jnp.arange(cache.table.shape[0]), length)

    def write_slots(self, cache: PagedCache, fresh, slots, T: int) -> PagedCache:
        """Rows of the dense `fresh` (n, >= T) into `slots` (n,)' pages: positions 0..T-1
        of a positional array, a state whole; a slot index past the last is dropped."""
        index = self._flat(cache.table, slots, T)

        def write(b, s, c, f):
            if s is None:
                at = [slice(None)] * c.ndim
                at[b] = slots
                return c.at[tuple(at)].set(f.astype(c.dtype), mode="drop")
            rows = jnp.moveaxis(jax.lax.slice_in_dim(f, 0, T, axis=s), (b, s), (0, 1))
            flat = self._positions_first(b, s, c)
            flat = flat.at[index.reshape(-1)].set(
                rows.reshape(-1, *rows.shape[2:]).astype(c.dtype), mode="drop")
            return self._back(b, s, flat, c)
        return dataclasses.replace(cache, pool=self._pool().map(write, cache.pool,
                                                                self._pack(fresh)))

    def write_window(self, cache: PagedCache, window) -> PagedCache:
        """`window` (from `window`) written back through every slot's pages."""
        length = next((leaf.shape[s] for leaf, s in zip(jax.tree.leaves(window),
                                                        self.dense.length) if s is not None), 0)
        return self.write_slots(cache, window, jnp.arange(cache.table.shape[0]), length)


def _swap(tree, keys: set, fn):
    """`tree` (nested dicts) with fn(entry) in place of every dict whose keys are `keys`."""
    if isinstance(tree, dict) and set(tree) == keys:
        return fn(tree)
    if isinstance(tree, dict):
        return {name: _swap(x, keys, fn) for name, x in tree.items()}
    return tree


def kernel_layout(model, dense: CacheLayout) -> CacheLayout | None:
    """The pool's layout with each attention layer's keys and values interleaved in one
    array "kv" (the axes of its keys), or None when some positional array is not a layer's
    keys or values (MLA's latent, ...) or a slot holds a state (Gated DeltaNet): those
    decode over a dense window (`PagedLayout.window`)."""
    if dense.has_state:
        return None
    tree = jax.eval_shape(lambda: model.init_cache(2, 8))
    axes = jax.tree.unflatten(jax.tree.structure(tree), list(zip(dense.batch, dense.length)))
    packed = _swap(axes, {"k", "v"}, lambda e: {"kv": e["k"]} if e["k"] == e["v"] else e)
    pairs = jax.tree.leaves(_swap(packed, {"kv"}, lambda e: {"kv": "pair"}))
    if not pairs or any(x != "pair" for x in pairs):
        return None
    leaves = jax.tree.leaves(packed, is_leaf=lambda x: isinstance(x, tuple))
    return CacheLayout(tuple(b for b, _ in leaves), tuple(s for _, s in leaves))


class PageBook:
    """The host's record of the pages: each slot's table row (its first `held[b]` entries
    its pages, the rest the scratch page), each page's reference count (the slots holding
    it), the free pages, and the prefix index. Sent to the device (`PagedCache.table`)
    before a call that reads it whenever it changed (`dirty`).

    Prefix sharing: a full page of a prompt is indexed by a hash of its tokens chained with
    its predecessor's hash (`chain`), so a later prompt that starts with the same tokens
    takes the same pages (`share`) instead of computing them. A page is only ever written
    by the slot that filled it first, before it was indexed: a sharing slot's prompt goes on
    from the first position past its shared pages, in pages of its own (the partial page is
    never shared: copy on write done by never writing). A page no slot holds stays indexed
    and is taken back, least recently used first, when the free list runs out."""

    def __init__(self, slots: int, length: int, page_size: int, pages: int):
        self.page_size = page_size
        self.table = np.full((slots, -(-length // page_size)), SCRATCH, np.int32)
        self.held = np.zeros(slots, np.int64)
        self.dropped = np.zeros(slots, np.int64)  # the first pages a slot gave back (`drop`)
        self.free = list(range(pages - 1, SCRATCH, -1))  # pop() hands out low pages first
        self.refs = np.zeros(pages, np.int64)
        self.index: dict[bytes, int] = {}  # prefix hash -> page
        self.hash_of: dict[int, bytes] = {}  # indexed page -> its prefix hash
        self.unused = collections.OrderedDict()  # indexed pages no slot holds, oldest first
        self.pages = pages
        self.dirty = True

    def chain(self, tokens) -> list[bytes]:
        """Each full page's prefix hash: sha256 of the previous one and the page's tokens."""
        out, h, Z = [], b"", self.page_size
        for i in range(len(tokens) // Z):
            h = hashlib.sha256(h + np.asarray(tokens[i * Z:(i + 1) * Z], np.int64).tobytes()).digest()
            out.append(h)
        return out

    def lookup(self, tokens) -> list[int]:
        """The indexed pages that hold `tokens`' first full pages, leaving at least its last
        token to compute (its logits draw the first new token)."""
        pages = []
        for h in self.chain(tokens[:len(tokens) - 1]):
            if h not in self.index:
                break
            pages.append(self.index[h])
        return pages

    def share(self, slot: int, pages: list[int]):
        """`slot` (holding nothing) takes `pages` as its first pages."""
        assert self.held[slot] == 0
        for i, page in enumerate(pages):
            self.table[slot, i] = page
            self.refs[page] += 1
            self.unused.pop(page, None)
        self.held[slot] = len(pages)
        self.dirty = self.dirty or bool(pages)

    def register(self, slot: int, tokens):
        """Index `slot`'s full pages of `tokens` (written, or about to be, by a call sent
        before any that reads them through the index)."""
        for i, h in enumerate(self.chain(tokens)[:int(self.held[slot])]):
            if i < self.dropped[slot]:
                continue
            page = int(self.table[slot, i])
            if h not in self.index and page not in self.hash_of:
                self.index[h], self.hash_of[page] = page, h

    @property
    def available(self) -> int:
        """Pages a reservation may take: free ones and indexed ones no slot holds."""
        return len(self.free) + len(self.unused)

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        page, _ = self.unused.popitem(last=False)
        del self.index[self.hash_of.pop(page)]
        return page

    def needed(self, slot: int, positions: int) -> int:
        """Pages `slot` lacks to hold positions 0..positions-1."""
        want = min(-(-positions // self.page_size), self.table.shape[1])
        return max(0, want - int(self.held[slot]))

    def reserve(self, slot: int, positions: int) -> bool:
        """Give `slot` pages for positions 0..positions-1; False (nothing changed) when
        too few pages are free."""
        need = self.needed(slot, positions)
        if need > self.available:
            return False
        for _ in range(need):
            page = self._take()
            self.table[slot, self.held[slot]] = page
            self.refs[page] = 1
            self.held[slot] += 1
        self.dirty = self.dirty or need > 0
        return True

    def _give_back(self, slot: int, start: int, end: int):
        """`slot`'s pages start..end-1 back: to the free list, or when indexed (a prefix
        another request may share) to the unused ones; their entries at the scratch page."""
        for page in self.table[slot, start:end][::-1].tolist():
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self.unused[page] = None
                else:
                    self.free.append(page)
        self.table[slot, start:end] = SCRATCH
        self.dirty = self.dirty or end > start

    def release(self, slot: int):
        """All of `slot`'s pages back (`_give_back`)."""
        self._give_back(slot, int(self.dropped[slot]), int(self.held[slot]))
        self.held[slot] = self.dropped[slot] = 0

    def drop(self, slot: int, pages: int):
        """`slot`'s first `pages` pages back (those its sliding windows have passed: no
        query of it reads them again); its later pages stay where they are."""
        pages = min(pages, int(self.held[slot]))
        if pages > self.dropped[slot]:
            self._give_back(slot, int(self.dropped[slot]), pages)
            self.dropped[slot] = pages

    def shared_groups(self, groups: int, members: int) -> dict:
        """`SharedPrefix`'s arrays (numpy): slots whose leading pages are the same pages,
        each held by more than one slot (so written once and never again: a sharing slot
        writes only past them), as groups of at least 2, the most shared positions first,
        at most `groups` groups of `members`; the other slots share nothing."""
        B, _ = self.table.shape
        runs = collections.defaultdict(list)
        for b in np.flatnonzero((self.held > 0) & (self.dropped == 0)):
            n = 0
            while n < self.held[b] and self.refs[self.table[b, n]] > 1:
                n += 1
            if n:
                runs[tuple(self.table[b, :n].tolist())].append(int(b))
        chosen = sorted((k for k in runs if len(runs[k]) > 1),
                        key=lambda k: -min(len(runs[k]), members) * len(k))[:groups]
        out = no_groups(groups, self.table, members)
        for e, pages in enumerate(chosen):
            out["table"][e, :len(pages)] = pages
            out["length"][e] = len(pages) * self.page_size
            for i, b in enumerate(runs[pages][:members]):
                out["members"][e, i], out["group"][b], out["member"][b] = b, e, i
                out["shared"][b] = len(pages) * self.page_size
        return out

    @property
    def in_use(self) -> int:
        """Pages some slot holds (a shared page once; the scratch page not counted)."""
        return int((self.refs > 0).sum())


def no_groups(groups: int, table, members: int = 0) -> dict:
    """`SharedPrefix`'s arrays (numpy) with no group: `groups` groups of `members` (0: as
    many as slots), every slot sharing nothing."""
    B, W = table.shape
    members = members or B
    return {"table": np.full((groups, W), SCRATCH, np.int32),
            "length": np.zeros(groups, np.int32),
            "members": np.full((groups, members), B, np.int32),
            "group": np.zeros(B, np.int32), "member": np.zeros(B, np.int32),
            "shared": np.zeros(B, np.int32)}


def group_pages(rows: int, group: int, prompt: int, new: int, length: int,
                page_size: int) -> int:
    """The pool (with the scratch page) that `rows` requests in groups of `group` with
    one prompt (GRPO's num_generations completions) need at most, when prompts have up to
    `prompt` tokens and each request writes `new` positions after its prompt (up to
    `length`): a group holds its prompt's full pages before its last token once
    (`Engine._prompt_pages`) and each request its own pages from there. The largest over
    the prompt lengths 1..prompt: a longer prompt shares more."""
    Z, most = page_size, 0
    for L in range(1, prompt + 1):
        shared = (L - 1) // Z
        own = -(-min(L + new, length) // Z) - shared
        most = max(most, -(-rows // group) * shared + rows * own)
    return most + 1


def check_pages(page_size: int, pages: int, slots: int, length: int, flags: str = "") -> int:
    """The pool's page count (`pages`, or 0: enough for every slot's whole length, plus
    the scratch page); refused in one line when it cannot hold one slot's length (`flags`:
    the flags' prefix, "plan." for the planner's)."""
    if page_size < 0 or pages < 0:
        raise UserError(f"--page_size and --pages must be >= 0, got {page_size} and {pages}")
    per_slot = -(-length // page_size)
    if pages == 0:
        return slots * per_slot + 1
    if pages < per_slot + 1:
        raise UserError(f"--{flags}pages={pages} cannot hold one request of "
                        f"--{flags}{'serve_tokens' if flags else 'seq_length'}={length} in "
                        f"pages of {page_size} (needs {per_slot} and the scratch page)")
    return pages
