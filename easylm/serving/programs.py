"""The serving engine's compiled calls (`engine.Engine` binds and runs them): the
programs that prefill prompts into cache slots, decode, extend a slot's conversation and
score rows, and the values they take.

Each compiled call (`_prefill`, `_prefill_end`, `_extend`, `_decode`) is bound to one
`Settings` (the model, the cache layout, greedy or sampling, chunk, steps, window: what a
program is specialised on) and takes the weights, the state, its rows (`PromptRows`) and
one `Sampling` value (the rows' keys, temperatures, top-k, top-p). The state is (cache,
each slot's last token (B,), its position (B,)); the cache is read and written through
the layout (`cache_layout.CacheLayout`, or `pages.PagedLayout`), so these programs never
learn whether it is paged.

Shapes: B slots, S cache positions (seq_length), n rows of one prefill or score
call, T bucketed length, C decode steps per call, V vocabulary, N top logprobs.
"""

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models import vision
from easylm.models.context_parallel import allow_whole_rows
from easylm.models.family import Model
from easylm.serving.cache_layout import CacheLayout
from easylm.serving.sampling import TOP_LOGPROBS, kind as rows_kind, next_tokens


def prompt_cache(model: Model, layout: CacheLayout, cache, slots, rows: int, length: int):
    """The cache prompts going to `slots` start from: zeros, positions and state alike, so
    a slot's last request leaks nothing into its next one (`cache` is the engine's,
    which a prompt does not read)."""
    del layout, cache, slots
    return model.init_cache(rows, length)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["keys", "temperature", "top_k", "top_p"], meta_fields=[])
@dataclasses.dataclass
class Sampling:
    """Per-row sampling settings, one entry per row: (rows,). Host arrays, and the one
    sampling value a compiled call takes (`snapshot`)."""

    keys: np.ndarray  # (rows, 2) uint32
    temperature: np.ndarray  # float32, 0 = greedy
    top_k: np.ndarray  # int32, 0 = off
    top_p: np.ndarray  # float32, 1 = off

    @classmethod
    def empty(cls, rows: int) -> "Sampling":
        return cls(np.zeros((rows, 2), np.uint32), np.zeros(rows, np.float32),
                   np.zeros(rows, np.int32), np.ones(rows, np.float32))

    def pad(self, rows: int) -> "Sampling":
        extra = rows - len(self.temperature)
        pad = Sampling.empty(extra)
        return Sampling(*(np.concatenate([a, b]) for a, b in
                          zip(dataclasses.astuple(self), dataclasses.astuple(pad))))

    def take(self, rows) -> "Sampling":
        """These settings of `rows` (indices), in that order."""
        return Sampling(*(a[np.asarray(rows, np.int64)] for a in dataclasses.astuple(self)))

    def samples(self) -> int:
        """The rows' kind (`sampling.kind`): 0 (False) when every row is greedy, else
        whether some sampling row truncates (top-k, top-p)."""
        return rows_kind(self.temperature, self.top_k, self.top_p)

    def snapshot(self) -> "Sampling":
        """A copy for a device call: the batcher edits its arrays while an asynchronous
        call may still read them."""
        return Sampling(*(np.array(a) for a in dataclasses.astuple(self)))

    def draw(self, logits, positions, sample: bool):
        """`next_tokens` of logits (rows, V) with these rows' settings."""
        return next_tokens(logits, self.keys, positions, self.temperature, self.top_k,
                           self.top_p, sample)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a compiled engine call is specialised on: one program per value."""

    model: Model
    layout: CacheLayout
    sample: int = 0  # greedy, sampling, or sampling with top-k/top-p (`sampling.kind`)
    record: bool = False  # routing replay: also return each fed token's expert choices
    chunk: int = 0  # prefill_chunk_size
    steps: int = 1  # decode_steps
    unroll: bool = False  # decode_unroll
    window: int = 0  # decode: the cache positions a call attends over


@dataclasses.dataclass(frozen=True)
class PromptImages:
    """An image-text model's prompts' images, for `Engine.prefill`: `keys[i]` names request
    i's images (prompts share one prefill only when their tokens and keys are equal), and
    `lay_out(requests, T)` gives the image inputs (U, ...) of those requests' prompts
    (None: a padding row), right-padded to T tokens, as `Model.forward(images=)` reads
    them (easylm/models/vision.py's IMAGE_KEYS)."""

    keys: list
    lay_out: Callable[[list, int], dict]

    @classmethod
    def each(cls, inputs: list) -> "PromptImages":
        """Prompts each with its own image inputs (1, ...) laid out for at least their
        length bucket, never shared (an image's placeholder tokens are the same whatever
        the image): the server's image chats."""
        return cls(list(range(len(inputs))), lambda requests, T: vision.stack_rows(
            [inputs[i] for i in requests if i is not None], len(requests), T))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "lengths", "slot_ids", "source", "starts", "images"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PromptRows:
    """A prefill call's rows (`Engine._calls`): the prompts it runs, U rows (the length
    bucket's `prefill_rows`), and the requests they go to, padded to B rows; an extend's
    suffixes (U = n) and where each starts."""

    tokens: np.ndarray  # (U, T)
    lengths: np.ndarray  # (U,)
    slot_ids: np.ndarray  # (n,), B for padding rows
    source: np.ndarray | None  # (n,): request i's prompt row; None: row i (U = n)
    starts: np.ndarray | None = None  # (n,) extend: each suffix's first position
    images: dict | None = None  # the prompts' image inputs (U, ...) (`PromptImages`)

    @property
    def request_lengths(self) -> np.ndarray:
        """(n,): each request's prompt length."""
        return self.lengths if self.source is None else self.lengths[self.source]


def _forward(model: Model, record: bool, params, tokens, positions, cache, base,
             segment_ids=None, images=None, logits_at=None):
    """(logits, cache, out): with `record` (routing replay, GRPO), out is a 1-tuple of the
    expert choices each token got in each MoE layer, (n, L, T, K) int16 (L in
    `moe.router_stats`' order); else (). `segment_ids` (n, T): 0 marks padding; `images`:
    an image-text model's image inputs of these rows (a whole prompt's, unchunked);
    `logits_at` (n,): logits (n, 1, V) at that position of each row only."""
    out = model.forward(params, tokens, positions, segment_ids, cache=cache, base=base,
                        router_stats=record, images=images, logits_at=logits_at)
    if not record:
        return out.logits, out.cache, ()
    n, T = tokens.shape
    L, _, K = out.router_stats.experts.shape
    experts = out.router_stats.experts.reshape(L, n, T, K).swapaxes(0, 1).astype(jnp.int16)
    return out.logits, out.cache, (experts,)


def _prompt_chunk(model: Model, record: bool, state: bool, weights, carry, chunk_ids, start,
                  lengths, images=None):
    """One chunk of prompts (n, C) starting at position `start` through the model over
    `carry` = (their cache of T' positions, each row's last-token logits so far (n, V)):
    the next carry, and with `record` the chunk's expert choices (`_forward`)."""
    params, base = weights
    cache, last = carry
    n, C = chunk_ids.shape
    positions = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (n, C))
    segments = (positions < lengths[:, None]).astype(jnp.int32) if state else None
    at = lengths - 1 - start  # each row's last token, if it falls in this chunk
    logits, cache, routing = _forward(model, record, params, chunk_ids, positions, cache,
                                      base, segments, images,
                                      logits_at=jnp.clip(at, 0, C - 1))
    picked = logits[:, 0].astype(jnp.float32)
    last = jnp.where(((at >= 0) & (at < C))[:, None], picked, last)
    return (cache, last), routing


def _chunking(T: int, chunk: int) -> tuple[int, int]:
    """(C, chunks) for a T-token bucket: C = T when unchunked or the chunk is no shorter."""
    C = T if chunk <= 0 or chunk >= T else chunk
    return C, -(-T // C)


def _prompt_forward(model: Model, chunk: int, record: bool, weights, tokens, lengths,
                    start=None, state: bool = False, images=None):
    """The prompts' keys/values in a fresh cache of T' >= T positions (T rounded up to a
    multiple of the chunk) and each row's logits at its last token (n, V) in fp32.

    The prompt goes through the model `chunk` tokens at a time (a loop on the device,
    `_prompt_chunk` per chunk): each chunk writes its keys/values and attends over the
    cache so far and itself under the cache's causal (and sliding-window) mask, so a layer
    holds (chunk, T') scores, never (T, T), and the head makes logits for each row's one
    position that matters in the chunk (n, 1, V), never (n, T, V). With `record`, a third output: the expert choices of each prompt token,
    (n, L, T, K) (`_forward`).

    `start`: the cache of T' positions to begin from (None: zeros). With `state` (the cache
    holds a state, `CacheLayout.has_state`), each chunk also marks the padding past each
    row's length (segment id 0), which a recurrent layer then neither reads nor writes:
    the state a row ends with is its last real token's, however the chunks fall.

    `images`: the prompts' image inputs (`PromptImages`), read in one chunk only."""
    n, T = tokens.shape
    C, chunks = _chunking(T, chunk)
    if images is not None and chunks > 1:
        raise ValueError("images are prefilled in one chunk: prefill_chunk_size=0")
    ids = jnp.pad(tokens, ((0, 0), (0, chunks * C - T))).reshape(n, chunks, C)

    def step(carry, xs):
        return _prompt_chunk(model, record, state, weights, carry, *xs, lengths, images)

    if start is None:
        start = model.init_cache(n, chunks * C)
    carry = (start, jnp.zeros((n, model.vocab_size), jnp.float32))
    starts = jnp.arange(chunks, dtype=jnp.int32) * C
    if chunks == 1:  # no loop: the program of an unchunked prefill
        (fresh, last), routing = _prompt_chunk(model, record, state, weights, carry,
                                               ids[:, 0], starts[0], lengths, images)
    else:
        (fresh, last), routing = jax.lax.scan(step, carry, (ids.transpose(1, 0, 2), starts))
        # (chunks, n, L, C, K) -> (n, L, chunks * C, K)
        routing = tuple(jnp.moveaxis(r, 0, 2).reshape(*r.shape[1:3], -1, r.shape[-1])
                        for r in routing)
    return fresh, last, tuple(r[:, :, :T] for r in routing)


def _prefill(settings: Settings, weights, state, rows: PromptRows, sampling: Sampling):
    model, layout = settings.model, settings.layout
    n, T = rows.tokens.shape
    C, chunks = _chunking(T, settings.chunk)
    start = prompt_cache(model, layout, state[0], rows.slot_ids, n, chunks * C)
    fresh, logits, routing = _prompt_forward(model, settings.chunk, settings.record, weights,
                                             rows.tokens, rows.lengths, start, layout.has_state,
                                             rows.images)
    return _prefill_end(settings, state, fresh, logits, routing, rows, sampling)


def _prefill_end(settings: Settings, state, fresh, logits, routing, rows: PromptRows,
                 sampling: Sampling):
    """Each request's first token drawn from its prompt's last-token logits, and its
    prompt's cache written into its slot: the engine's state and the outputs
    (`Engine.prefill`). The prompts (`fresh`, `logits`, `routing`, `lengths`: U rows) are
    the requests' (`slots`, sampling: n rows) one to one when `source` is None, else
    request i's prompt is row source[i] (prompts shared by several requests, run once:
    their cache, a state's included, is copied into each request's slot whole)."""
    layout, (cache, last, slot_positions) = settings.layout, state
    lengths, slots, source, T = rows.lengths, rows.slot_ids, rows.source, rows.tokens.shape[1]
    if source is not None:
        fresh = layout.map(lambda b, s, f: jnp.take(f, source, axis=b), fresh)
        logits, lengths = logits[source], lengths[source]
        routing = tuple(r[source] for r in routing)
    out = sampling.draw(logits, lengths, settings.sample) + routing
    # Padding rows carry slot index B, out of range, and are dropped.
    cache = layout.write_slots(cache, fresh, slots, T)
    last = last.at[slots].set(out[0], mode="drop")
    slot_positions = slot_positions.at[slots].set(lengths, mode="drop")
    # A leading step axis, like decode's outputs: (1, n, ...).
    return (cache, last, slot_positions), tuple(x[None] for x in out)


def _staged_start(model: Model, rows: int, length: int):
    """A staged prefill's carry (`Engine.begin_prefill`): its prompts' zero cache of
    `length` positions and last-token logits."""
    return model.init_cache(rows, length), jnp.zeros((rows, model.vocab_size), jnp.float32)


def _staged_end(settings: Settings, state, carry, routing, rows: PromptRows,
                sampling: Sampling):
    # (chunks of (n, L, C, K)) -> (n, L, T, K)
    routing = tuple(jnp.concatenate(r, axis=2)[:, :, :rows.tokens.shape[1]] for r in routing)
    return _prefill_end(settings, state, *carry, routing, rows, sampling)


def _extend(settings: Settings, weights, state, rows: PromptRows, sampling: Sampling):
    """Suffixes (n, T) (`rows`: right-padded, `lengths` real) fed onto the caches of
    `slot_ids` (n,) at positions starts..starts + T: their rows of the cache are taken whole (S
    positions), the suffix written into them and attending over them under the cache's
    causal mask, and written back. Padding writes past a row's suffix (nothing reads them
    before its next tokens overwrite them) or past S (dropped). Each row's next token is
    drawn from its last real position's logits (`_prefill_end`'s outputs). A state part of
    the cache continues from the slot's state, which must be that of its tokens before
    starts (`_decode` keeps a waiting slot's). With `record`, the suffixes' expert choices
    too (n, L, T, K) (`_forward`), as a prefill's."""
    model, layout, (params, base) = settings.model, settings.layout, weights
    cache, last, slot_positions = state
    tokens, lengths, starts, slots = rows.tokens, rows.lengths, rows.starts, rows.slot_ids
    n, T = tokens.shape
    S = layout.cache_length(cache)
    held = layout.take_slots(cache, slots)
    positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)  # (n, T)
    # A state (held at the history's end by `_decode`) continues over the suffix; its
    # padding (segment id 0) neither reads nor writes it, as in a prefill's chunks.
    segments = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.int32) \
        if layout.has_state else None
    logits, held, routing = _forward(model, settings.record, params, tokens, positions, held,
                                     base, segments, logits_at=lengths - 1)
    picked = logits[:, 0].astype(jnp.float32)  # (n, V)
    out = sampling.draw(picked, starts + lengths, settings.sample) + routing
    cache = layout.write_slots(cache, held, slots, S)
    last = last.at[slots].set(out[0], mode="drop")
    slot_positions = slot_positions.at[slots].set(starts + lengths, mode="drop")
    return (cache, last, slot_positions), tuple(x[None] for x in out)


def _decode(settings: Settings, weights, state, ends, stop, sampling: Sampling):
    """`steps` tokens for every slot, attending over the first `window` cache positions
    only (the host picks a window that covers every active slot's positions); a loop, or
    with `unroll` the steps one after another in one program.

    A cache that holds a state (`CacheLayout.has_state`; else `ends` and `stop` are
    unused and the program is the attention-only one): a step runs a slot live only while
    its input token sits before ends (B,) and is not `stop` (a scalar; -1 none). A slot
    not live keeps its state, last token and position, so its state stays that of the
    tokens before its input token: what `_extend` continues from, the input token fed
    again. Live slots compute exactly what they would without the mask."""
    model, layout, length, record = settings.model, settings.layout, settings.window, \
        settings.record
    params, base = weights
    cache, tokens, positions = state
    if layout.direct:
        return _decode_pages(settings, weights, state, sampling)
    # The first `length` positions, decoded in a copy and written back once per call:
    # each step then reads L positions of keys and values, not S (a state goes whole).
    window = layout.window(cache, length)

    def step(carry, _):
        window, tokens, positions = carry  # tokens (B,): the last token, not yet in the cache
        # Idle and finished slots run past the end: they write (garbage, never read) at
        # the last position instead.
        at = jnp.minimum(positions, length - 1)[:, None]
        logits, new, routing = _forward(model, record, params, tokens[:, None], at, window,
                                        base)  # routing: the input token's choices
        out = sampling.draw(logits[:, 0], positions + 1, settings.sample)
        if not layout.has_state:
            return (new, out[0], positions + 1), out + tuple(r[:, :, 0] for r in routing)
        live = (positions < ends) & (tokens != stop)  # (B,)

        def held(b, s, n, o):  # a state's rows of slots not live: as they were
            if s is not None:  # positional: a held slot rewrites its input token's entry
                return n
            shape = [1] * n.ndim
            shape[b] = n.shape[b]
            return jnp.where(live.reshape(shape), n, o)

        window = layout.map(held, new, window)
        return ((window, jnp.where(live, out[0], tokens), jnp.where(live, positions + 1, positions)),
                out + tuple(r[:, :, 0] for r in routing))

    unroll = settings.steps if settings.unroll else 1
    (window, tokens, positions), outs = jax.lax.scan(step, (window, tokens, positions), None,
                                                     length=settings.steps, unroll=unroll)
    return (layout.write_window(cache, window), tokens, positions), outs  # outs: (C, B, ...)


def _decode_pages(settings: Settings, weights, state, sampling: Sampling):
    """`_decode` straight from the page pool (`pages.PagedLayout.direct`: attention layers
    only, no state): each step writes every slot's new keys and values into its page and
    attends over its own pages (`paged_attention.PagedKV`; the ragged paged attention
    kernel on a TPU), so nothing is copied out of the pool or back; `window` is unused."""
    model, layout, record = settings.model, settings.layout, settings.record
    params, base = weights
    cache, tokens, positions = state
    last = layout.cache_length(cache) - 1

    def step(carry, _):
        cache, tokens, positions = carry  # tokens (B,): the last token, not yet in the cache
        at = jnp.minimum(positions, last)[:, None]  # idle slots write (garbage) at the end

        def forward(entries):
            logits, entries, routing = _forward(model, record, params, tokens[:, None], at,
                                                entries, base)
            return (logits, routing), entries
        (logits, routing), cache = layout.decoded(cache, forward)
        out = sampling.draw(logits[:, 0], positions + 1, settings.sample)
        return (cache, out[0], positions + 1), out + tuple(r[:, :, 0] for r in routing)

    unroll = settings.steps if settings.unroll else 1
    return jax.lax.scan(step, (cache, tokens, positions), None, length=settings.steps,
                        unroll=unroll)


def _score(model: Model, chunk: int, weights, tokens, targets):
    """Per position of the rows (n, T): the target's log-probability, whether it is the
    argmax, and the top N log-probabilities, in fp32. Like a prefill, the rows go through
    the model `chunk` tokens at a time over their cache (`_forward` at each chunk's
    positions), so a layer holds (chunk, T') scores and the head (n, chunk, V) logits,
    never (T, T) or (n, T, V)."""
    params, base = weights
    n, T = tokens.shape
    C, chunks = _chunking(T, chunk)

    def pad(x):  # (n, T) -> (chunks, n, C)
        return jnp.pad(x, ((0, 0), (0, chunks * C - T))).reshape(n, chunks, C).swapaxes(0, 1)

    def step(cache, xs):
        ids, tgt, start = xs
        positions = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (n, C))
        logits, cache, _ = _forward(model, False, params, ids, positions, cache, base)
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # (n, C, V)
        target_logprobs = jnp.take_along_axis(logprobs, tgt[..., None], axis=-1)[..., 0]
        is_greedy = jnp.argmax(logprobs, axis=-1) == tgt
        top_logprobs, top_ids = jax.lax.top_k(logprobs, min(TOP_LOGPROBS, logprobs.shape[-1]))
        return cache, (target_logprobs, is_greedy, top_ids, top_logprobs)

    xs = (pad(tokens), pad(targets), jnp.arange(chunks, dtype=jnp.int32) * C)
    cache = model.init_cache(n, chunks * C)
    with allow_whole_rows():  # texts of any length, on a training mesh with sp too
        if chunks == 1:  # no loop: the program of an unchunked forward
            outs = jax.tree.map(lambda x: x[None], step(cache, jax.tree.map(lambda x: x[0], xs))[1])
        else:
            outs = jax.lax.scan(step, cache, xs)[1]
    # (chunks, n, C, ...) -> (n, T, ...)
    return tuple(jnp.moveaxis(x, 0, 1).reshape(n, chunks * C, *x.shape[3:])[:, :T] for x in outs)
