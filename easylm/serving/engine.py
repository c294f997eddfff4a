"""The device side of serving: weights, a preallocated key/value cache, and three jitted calls.

    prefill  run prompts (n rows, bucketed length T), prefill_chunk_size tokens at a time,
             and write their keys/values into cache rows ("slots"); draw each row's
             first new token. In one call, or one chunk per call (`begin_prefill`,
             `prefill_step`) so that the batcher decodes the other slots in between
    decode   C steps for all B slots at once, each slot at its own position,
             attending over the first L cache positions (a bucket covering the
             active slots' positions)
    score    (n, T) tokens through the model chunk by chunk like a prefill: the
             log-probabilities of given targets
    extend   suffixes fed onto slots that already hold a conversation, at each slot's
             own position (a tool's result after the model's turn: multi-turn rollouts),
             never re-reading the history; draw each slot's next token

Which request sits in which slot is `batcher.py`'s business; this file only
runs arrays. The cache is sharded like training activations (batch over
(dp, fsdp, ep), heads over 'mp'), so a model that needs 'mp' to fit serves too.

Model-agnostic: it runs a family's `easylm.models.family.Model` (its `apply`, `init_cache`,
`cache_rules`). What each cache array is, the layer declares by the shape its
`layer_cache` gives (`cache_layout.CacheLayout`): an array with a length axis is positional (an
attention layer's keys and values (B, S, K, H), a latent cache (B, S, C)): sliced to
the positions a decode call reads and written by position; one without is a slot's
state (Gated DeltaNet's conv inputs and recurrent state): carried whole, started from
zeros when a slot takes a request, and continued from chunk to chunk of a prefill. A
state cannot be rewound, so a decode call advances a slot's state only while the slot
is live (`Engine.decode`'s active, ends, stop): a slot waiting for `extend` keeps the
state of its history's end.

The compiled calls (`_prefill`, `_prefill_end`, `_extend`, `_decode`, `_score`) and the
values they take (`Settings`, `PromptRows`, `Sampling`) are in programs.py; how a cache
array is read and written (`CacheLayout`) is in cache_layout.py. This file binds them to a
model and a mesh and runs them for the batcher and the rollouts.

Shapes: B slots, S cache positions (seq_length), n rows of one prefill or score
call, T bucketed length, C decode steps per call, V vocabulary, N top logprobs.
"""

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.models.family import Model
from easylm.models.paged_attention import DECODE_KERNELS, SharedPrefix
from easylm.runtime.sharding import axes_size, match_partition_rules
from easylm.serving.pages import (PageBook, PagedCache, PagedLayout, check_pages,
                                  kernel_layout)
from easylm.serving.cache_layout import check_cache
from easylm.serving.programs import (PromptImages, PromptRows, Sampling, Settings, _chunking,
                                     _decode, _extend, _prefill, _prompt_chunk, _score,
                                     _staged_end, _staged_start)
from easylm.serving.sampling import KINDS, SAMPLE, TRUNCATE

log = logging.getLogger(__name__)

KIND_NAMES = {False: "greedy", SAMPLE: "sampling", TRUNCATE: "sampling with top-k/top-p"}

HELP = {
    "batch_size": "decode slots: requests generated concurrently (continuous batching)",
    "seq_length": "context length served (prompt plus new tokens, per request); 0: the "
                  "model's max_position_embeddings, at most 2048",
    "decode_steps": "tokens decoded per device call between scheduling decisions",
    "min_bucket": "shortest prompt-length bucket; buckets double up to seq_length (decode "
                  "windows over the cache: from the larger of this and seq_length/8)",
    "pre_compile": "compile the engine's programs at start (`Engine.warmup`: per length "
                   "bucket a prefill and a score program, per cache window a decode "
                   "program, each greedy, sampling and sampling with top-k/top-p), so no "
                   "request compiles",
    "prefill_budget": "prompt tokens one prefill or score call runs at most: a call holds "
                      "budget // length-bucket rows (1 to batch_size), so there is one "
                      "program per length bucket, whatever the number of prompts",
    "prefill_chunk_size": "prompt tokens a prefill runs through the model at a time (each "
                          "chunk attends over the cache so far: scores are chunk x T, not "
                          "T x T); 0: the whole prompt at once",
    "decode_unroll": "unroll a decode call's decode_steps steps into one straight-line "
                     "program instead of a loop (longer compile; fewer kernel launches and "
                     "no loop bookkeeping per token)",
    "share_prompts": "a prompt that several requests of one prefill share (GRPO's "
                     "num_generations completions of a prompt, identical requests "
                     "arriving together) runs through the model once and its cache is "
                     "copied into each request's slot; with --page_size, a prompt also takes the "
                     "cached pages of an earlier request's identical prefix; False: every "
                     "copy is prefilled",
    "page_size": "positions per cache page (pages.py): the positional caches live in one "
                 "pool of pages and each slot holds a page table, so memory goes to the "
                 "positions requests use; 0: dense, each slot owns seq_length positions",
    "pages": "pages in the pool with --page_size (one of them a scratch page); 0: enough "
             "for every slot's whole seq_length",
    "decode_from_pages": "with --page_size, decode attends straight from the pages (ragged "
                         "paged attention: the kernel on TPU) where every positional cache "
                         "is an attention layer's keys and values, instead of a dense window "
                         "gathered and written back; exact on CPU; on a v5e 16-28% faster than "
                         "the window path at batch 16-64 (docs/serving.md)",
    "decode_kernel": "with --decode_from_pages, the TPU kernel decode attends with: batched "
                     "(ours: several sequences' pages per step, the next step's copied "
                     "meanwhile, one product over all kv heads; models/paged_decode_kernel.py; "
                     "on a v5e llama_1b decodes 29% faster than with rpa at batch 64, 22% at "
                     "16, 2% at 1), rpa (JAX's ragged paged attention) or batched_vpu (ours, "
                     "its products on the VPU); off a TPU all run the same XLA path "
                     "(EASYLM_PALLAS_INTERPRET=1: ours in Pallas interpret mode, slow)",
    "prefix_groups": "with --decode_kernel=batched or batched_vpu: up to this many groups of "
                     "slots whose leading pages are shared (GRPO's completions of one "
                     "prompt) attend over those pages once a group, the members' queries "
                     "together, and over their own pages after them, merged by log-sum-exp "
                     "(cascade attention; models/paged_attention.py); sliding-window layers "
                     "read every slot's pages; on a v5e a GRPO rollout 1.88x the dense "
                     "cache's; 0: off",
}


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.batch_size = 8
    config.seq_length = 0
    config.decode_steps = 8
    config.min_bucket = 16
    config.pre_compile = False
    config.decode_unroll = False
    config.prefill_chunk_size = 512
    config.prefill_budget = 4096
    config.share_prompts = True
    config.page_size = 0
    config.pages = 0
    config.decode_from_pages = False
    config.decode_kernel = "batched"
    config.prefix_groups = 0
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def check_config(config: ConfigDict):
    for name in ("batch_size", "seq_length", "decode_steps", "min_bucket", "prefill_budget"):
        if config[name] < 1:
            raise UserError(f"--{name} must be >= 1, got {config[name]}")
    if config.prefill_chunk_size < 0:
        raise UserError(f"--prefill_chunk_size must be >= 0 (0: unchunked), got "
                        f"{config.prefill_chunk_size}")
    if config.page_size:
        check_pages(config.page_size, config.pages, config.batch_size, config.seq_length)
    if config.decode_from_pages and not config.page_size:
        raise UserError("--decode_from_pages needs pages: set --page_size")
    if config.decode_kernel not in DECODE_KERNELS:
        raise UserError(f"--decode_kernel must be one of {', '.join(DECODE_KERNELS)}, got "
                        f"{config.decode_kernel!r}")
    if config.decode_kernel != "batched" and not config.decode_from_pages:
        raise UserError(f"--decode_kernel={config.decode_kernel} needs --decode_from_pages")
    if config.prefix_groups < 0:
        raise UserError(f"--prefix_groups must be >= 0, got {config.prefix_groups}")
    if config.prefix_groups and (config.decode_kernel == "rpa" or not config.share_prompts):
        raise UserError("--prefix_groups needs --decode_kernel=batched or batched_vpu (JAX's "
                        "rpa kernel gives no log-sum-exp to merge with) and --share_prompts")


def cached_tokens(prompts: list[list[int]], calls: list) -> list[int]:
    """Per request of a prefill's `calls` (`Engine._calls`): its prompt's tokens when
    another request's run of the same prompt filled its cache (a shared prompt), else 0."""
    cached = [0] * len(prompts)
    for rows, requests in calls:
        ran = set()
        for i, row in zip(requests, rows.source[:len(requests)].tolist()):
            cached[i] = len(prompts[i]) if row in ran else 0
            ran.add(row)
    return cached


def buckets(largest: int, smallest: int) -> list[int]:
    """smallest, 2*smallest, ... below largest, then largest."""
    out, size = [], max(1, smallest)
    while size < largest:
        out.append(size)
        size *= 2
    return out + [largest]


def bucket_for(length: int, sizes: list[int]) -> int:
    return next(size for size in sizes if size >= length)


def fitted_spec(spec: P, shape, mesh) -> P:
    """`spec` with the mesh axes a dimension cannot be split over dropped (batch 1 on 8 devices)."""
    dims = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        dims.append(axes if dim % axes_size(mesh.shape, axes) == 0 else None)
    return P(*dims)


@dataclasses.dataclass
class Prefilled:
    """A prefill's outputs (`Engine.prefill`): per device call, its outputs (rows padded
    to B) and the requests its rows 0.. serve."""

    parts: list  # [(device outputs (1, B, ...), request indices)]
    n: int  # requests
    cached: list = dataclasses.field(default_factory=list)  # per request (`cached_tokens`)

    def fetch(self) -> tuple[np.ndarray, ...]:
        """Host arrays (1, n, ...) in request order."""
        out = None
        for arrays, requests in self.parts:
            arrays = [np.asarray(x) for x in jax.device_get(arrays)]
            if out is None:
                out = [np.zeros((x.shape[0], self.n, *x.shape[2:]), x.dtype) for x in arrays]
            for whole, x in zip(out, arrays):
                whole[:, requests] = x[:, :len(requests)]
        return tuple(out)


@dataclasses.dataclass
class StagedPrefill:
    """Prompts prefilled one chunk per call (`Engine.begin_prefill`, `prefill_step`), so
    that the other slots decode between their chunks. Their cache stays in a buffer of
    their own (`carry`: rows x T', what one-call prefill holds too) until the last chunk,
    which writes it into their slots: until then the slots hold nothing a decode call
    could disturb or sample from."""

    tokens: np.ndarray  # (U, chunks * C), padded
    rows: "PromptRows"
    sampling: Sampling  # padded to the requests' rows
    T: int  # the length bucket
    C: int  # the chunk
    carry: object  # on the device: (cache of the prompts, last-token logits)
    routing: list = dataclasses.field(default_factory=list)  # each chunk's, recording
    done: int = 0  # chunks run
    cached: list = dataclasses.field(default_factory=list)  # per request (`cached_tokens`)

    @property
    def chunks(self) -> int:
        return self.tokens.shape[1] // self.C


def _layout_and_pages(config: ConfigDict, model: Model):
    """The engine's cache layout and, with --page_size, its `PageBook` (else None)."""
    layout = check_cache(model)
    if not config.page_size:
        return layout, None
    pages = check_pages(config.page_size, config.pages, config.batch_size, config.seq_length)
    return (PagedLayout(layout, config.page_size, pages, kernel_layout(model, layout)
                        if config.decode_from_pages else None, config.decode_kernel,
                        config.prefix_groups),
            PageBook(config.batch_size, config.seq_length, config.page_size, pages))


class Engine:
    """Holds params and the slots' device state; called from one thread (the batcher's).

    The state is (cache, each slot's last token (B,), its position (B,)) and stays on
    the device: prefill and decode only dispatch work and return their outputs as
    device arrays (`fetch` brings them over), so the host can prepare the next call
    while the device runs this one.
    """

    def __init__(self, config: ConfigDict, model: Model, params, mesh=None, base=None,
                 record_routing: bool = False):
        """`record_routing` (GRPO's routing replay, a MoE model): prefill and decode also
        return each token's expert choices in every MoE layer (`_forward`); so does extend."""
        self.config = config = get_default_config(config)
        check_config(config)
        # With --page_size, `pages` is the host's book of each slot's pages (else None).
        self.layout, self.pages = _layout_and_pages(config, model)
        layout = self.layout
        # `params` and, for a variant, its frozen `base`: what `Model.forward` reads.
        self.model, self.params, self.base, self.mesh = model, params, base, mesh
        self.batch_size, self.seq_length = config.batch_size, config.seq_length
        self.length_buckets = buckets(config.seq_length, config.min_bucket)
        self.row_buckets = buckets(config.batch_size, 1)  # an extend's rows
        # Rows of one prefill or score call of each length bucket: prefill_budget tokens
        # (1 to B rows), so each bucket has one program whatever the number of prompts.
        self.prefill_rows = {T: min(config.batch_size, max(1, config.prefill_budget // T))
                             for T in self.length_buckets}
        # Cache lengths a decode call attends over: S/8, S/4, S/2, S (or from min_bucket
        # when that is larger), so short requests on a long-context server read a fraction
        # of the cache per token, at the cost of at most four decode programs per kind.
        self.decode_buckets = buckets(config.seq_length,
                                      max(config.min_bucket, config.seq_length // 8))
        # Each slot's position as the device has it (every decode call advances all).
        self.positions = np.zeros(config.batch_size, np.int64)
        # Prompt tokens since `reset`: run through the model, and shared (`share_prompts`).
        self.prompt_tokens = {"prefilled": 0, "cached": 0}
        self.state_shardings, self._init_state = self._state_program()
        self.reset()
        # Calls return the state with exactly the shardings it came in with (and small
        # replicated outputs), so the donated buffers are reused and nothing recompiles.
        out_shardings = {} if mesh is None else {
            "out_shardings": (self.state_shardings, NamedSharding(mesh, P()))}
        self.settings = Settings(model, layout, record=record_routing,
                                 chunk=config.prefill_chunk_size, steps=config.decode_steps,
                                 unroll=config.decode_unroll)
        self._out_shardings, self.record_routing = out_shardings, record_routing

        def programs(fn, **settings):
            # Three programs each: all rows greedy, some sampling, some sampling with
            # top-k or top-p (`sampling.kind`); each compiles when first used.
            return {sample: jax.jit(functools.partial(fn, dataclasses.replace(
                        self.settings, sample=sample, **settings)), donate_argnums=(1,),
                        **out_shardings) for sample in KINDS}

        self._prefill_fns = programs(_prefill)
        self._image_prefill_fns = programs(_prefill, chunk=0)  # `prefill`'s images: unchunked
        # Decoding straight from the pages (`PagedLayout.direct`) reads no window: one
        # program per kind serves every bucket.
        windows = {length: programs(_decode, window=length) for length in
                   ([0] if layout.direct else self.decode_buckets)}
        self._decode_fns = {(sample, length): fn for length in self.decode_buckets
                            for sample, fn in windows[0 if layout.direct else length].items()}
        self._staged = {}  # (rows, T) -> a staged prefill's programs (`_staged_fns`)
        # Suffix lengths an `extend` call is padded to: short ones (a tool's answer) stay short.
        self.extend_buckets = buckets(config.seq_length, min(8, config.seq_length))
        self._extend_fns = programs(_extend)
        # Replicated outputs: each host's process can read them (sharded ones would not).
        self._score_fn = jax.jit(functools.partial(_score, model, config.prefill_chunk_size), **(
            {} if mesh is None else {"out_shardings": NamedSharding(mesh, P())}))

    @property
    def after_buckets(self) -> list[int]:
        """Lengths `prefill_after` pads a prompt's rest to: one page first (a GRPO group's
        copies share every full page before the prompt's last token, so their rest is at
        most a page: a 512-token bucket would run 32x the tokens), then the prompts'."""
        Z = self.config.page_size
        return sorted({*self.length_buckets, *([Z] if 0 < Z < self.seq_length else [])})

    def _state_program(self):
        """(the state's shardings or None, the program that makes a zero state): the
        state is created with the shardings the calls return, so that the first call's
        inputs look like every later call's: one compile each."""
        model, mesh, B, S = self.model, self.mesh, self.batch_size, self.seq_length
        layout = self.layout

        def init_state():  # (cache, each slot's last token, its position)
            return layout.empty(model, B, S), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32)

        if mesh is None:
            return None, jax.jit(init_state)
        shapes = jax.eval_shape(lambda: layout.empty(model, B, S))
        arrays = shapes.pool if self.pages else shapes
        specs = layout.pool_specs(model.cache_rules, arrays) if self.pages else \
            match_partition_rules(model.cache_rules, arrays)
        cache_shardings = jax.tree.map(
            lambda spec, s: NamedSharding(mesh, fitted_spec(spec, s.shape, mesh)),
            specs, arrays, is_leaf=lambda x: isinstance(x, P))
        replicated = NamedSharding(mesh, P())
        if self.pages:
            cache_shardings = PagedCache(cache_shardings, replicated, SharedPrefix(
                *[replicated] * 6) if layout.prefix_groups else None)
        shardings = (cache_shardings, replicated, replicated)
        return shardings, jax.jit(init_state, out_shardings=shardings)

    def reset(self):
        """A fresh state: an empty cache, every slot free (the cache's memory comes back
        after `release`)."""
        self.state = self._run(self._init_state)
        self.positions[:] = 0
        self._share_pages = False  # whether a prompt may take an earlier one's pages
        if self.pages:
            self.pages = PageBook(self.batch_size, self.seq_length, self.config.page_size,
                                  self.layout.pages)
            self._claimed = set()  # slots `claim`ed for a request not yet prefilled
            # Each slot's positions that may take pages: a claimed request's, else all.
            self._bound = np.full(self.batch_size, self.seq_length, np.int64)
            self._share_pages = self.config.share_prompts and not self.layout.has_state
        self.prompt_tokens = {"prefilled": 0, "cached": 0}

    def release(self):
        """Free the cache's device memory until `reset` (an engine that evaluates now and
        then, in a training job); nothing may run on the engine in between."""
        self.state = None

    def pages_free(self) -> int | None:
        """Pages no slot holds (None: dense, no pages)."""
        return self.pages.available if self.pages else None

    def pages_needed(self, positions: int) -> int:
        """Pages a request of `positions` (prompt and new tokens) holds at most."""
        return -(-min(positions, self.seq_length) // self.config.page_size) if self.pages else 0

    def claim(self, slot: int, positions: int, prompt=()) -> int:
        """With pages: `slot`'s pages returned and pages for a request's `positions` taken
        (`pages_free` must cover `pages_needed`: the batcher admits by it), so that the
        request never runs out of pages; its prefill then takes no more. With
        `share_prompts` (and no state in the cache: a state cannot start mid-prompt), the
        first of them are the indexed pages that already hold `prompt`'s first full pages
        (`PageBook.lookup`): returns how many of its positions they hold, which its
        prefill skips (`extend` from there), else 0."""
        if not self.pages:
            return 0
        self.pages.release(slot)
        shared = self.pages.lookup(prompt) if self._share_pages else []
        self.pages.share(slot, shared)
        self._reserve([slot], [positions])
        self._claimed.add(slot)
        self._bound[slot] = positions
        return len(shared) * self.config.page_size

    def _index(self, slots, prompts):
        """With pages and sharing: index the full pages of the prompts just written into
        `slots` (calls sent later may read them)."""
        if self.pages and self._share_pages:
            for slot, prompt in zip(slots, prompts):
                if slot < self.batch_size:
                    self.pages.register(int(slot), prompt)

    def free(self, slot: int):
        """With pages: `slot`'s request is done; its pages go back to the pool (the page
        table on the device changes with the next call)."""
        if self.pages:
            self.pages.release(slot)

    def _prompt_pages(self, prompts, slots, images: PromptImages | None = None):
        """With pages: each prompt's slot gets pages for it (`_reserve`, fresh). With
        sharing, a request whose prompt an earlier request of the same prefill has (GRPO's
        num_generations completions of a prompt) takes that one's full pages before its
        last token instead of pages of its own: the prefill writes the same values (one
        prompt row's cache) into them for both, and neither writes below its last token
        again, so each slot reads what it would from pages of its own. Image prompts share
        only with the same images (`images.keys`), as in `_calls`."""
        if not self.pages:
            return
        first, shared, own = {}, [], []
        for i, (prompt, slot) in enumerate(zip(prompts, slots)):
            slot, key = int(slot), (tuple(prompt), images.keys[i] if images else None)
            if self._share_pages and key in first and slot < self.batch_size and \
                    slot not in self._claimed:
                shared.append((slot, first[key], len(prompt)))
                continue
            own.append((slot, len(prompt)))
            if slot < self.batch_size:
                first.setdefault(key, slot)
        self._reserve(*zip(*own), fresh=True)
        for slot, owner, length in shared:
            self.pages.release(slot)
            self._bound[slot] = self.seq_length
            self.pages.share(slot, self.pages.table[owner, :(length - 1) // self.config.page_size]
                             .tolist())
        if shared:
            self._reserve(*list(zip(*shared))[::2])

    def _reserve(self, slots, positions, fresh: bool = False, strict: bool = True):
        """With pages: give each of `slots` (a slot index past the last: none) pages for
        its positions 0..positions[i]-1 (`fresh`: a new request's, after returning the
        pages the slot held unless it was `claim`ed), and send the page table to the
        device if it changed. Not `strict` (decode): a slot that cannot get a page writes
        its positions past its pages to the scratch page (a claimed request's are past
        its last token)."""
        if not self.pages:
            return
        for slot, upto in zip(slots, positions):
            if slot >= self.batch_size:
                continue
            if fresh and slot not in self._claimed:
                self.pages.release(slot)
                self._bound[slot] = self.seq_length
            if strict:  # a prefill's or an extend's: the claim is spent
                self._claimed.discard(slot)
            if not self.pages.reserve(slot, min(int(upto), self.seq_length)) and strict:
                raise RuntimeError(f"out of cache pages: slot {slot} needs "
                                   f"{self.pages.needed(slot, upto)}, {len(self.pages.free)} free")
        if self.pages.dirty:
            cache, last, positions_ = self.state
            groups = self.layout.prefix_groups
            table, prefix = jax.tree.map(jnp.asarray, (self.pages.table, SharedPrefix(
                **self.pages.shared_groups(groups, self.batch_size)) if groups else None))
            if self.mesh is not None:
                table, prefix = jax.device_put((table, prefix), NamedSharding(self.mesh, P()))
            self.state = (PagedCache(cache.pool, table, prefix), last, positions_)
            self.pages.dirty = False

    def _run(self, fn, *args):
        if self.mesh is None:
            return fn(*args)
        with jax.set_mesh(self.mesh):
            return fn(*args)

    @property
    def weights(self):
        return self.params, self.base

    @property
    def cache(self):
        return self.state[0]

    @staticmethod
    def fetch(out) -> tuple[np.ndarray, ...]:
        """Device outputs -> host arrays (waits for the call that makes them); a
        `Prefilled`'s calls' rows put back in request order."""
        if isinstance(out, Prefilled):
            return out.fetch()
        return tuple(np.asarray(x) for x in jax.device_get(out))

    def _calls(self, prompts: list[list[int]], slots: list[int],
               images: PromptImages | None = None) -> list[tuple]:
        """The prefill calls for `prompts` going to `slots`: (PromptRows, the requests it
        serves), each distinct prompt once when `share_prompts` (else each request's
        own), `prefill_rows` of them a call, right-padded to the prompts' length bucket;
        each call's request rows padded to B (slot index B: dropped), with their `images`'
        inputs. Counted in `prompt_tokens`."""
        B, n = self.batch_size, len(prompts)
        distinct, firsts, source = {}, [], []
        for i, prompt in enumerate(prompts):
            key = i if not self.config.share_prompts else \
                (tuple(prompt), images.keys[i] if images else None)
            if key not in distinct:
                distinct[key] = len(firsts)
                firsts.append(i)
            source.append(distinct[key])
        T = bucket_for(max(len(p) for p in prompts), self.length_buckets)
        U, calls = self.prefill_rows[T], []
        for first in range(0, len(firsts), U):
            requests = [i for i in range(n) if first <= source[i] < first + U]
            tokens, lengths = np.zeros((U, T), np.int32), np.ones(U, np.int32)
            for row, i in enumerate(firsts[first:first + U]):
                tokens[row, :len(prompts[i])], lengths[row] = prompts[i], len(prompts[i])
            slot_ids, rows = np.full(B, B, np.int32), np.zeros(B, np.int32)
            slot_ids[:len(requests)] = [slots[i] for i in requests]
            rows[:len(requests)] = [source[i] - first for i in requests]
            inputs = None if images is None else images.lay_out(
                (firsts[first:first + U] + [None] * U)[:U], T)
            calls.append((PromptRows(tokens, lengths, slot_ids, rows, images=inputs), requests))
        ran = sum(len(prompts[i]) for i in firsts)
        self.prompt_tokens["prefilled"] += ran
        self.prompt_tokens["cached"] += sum(map(len, prompts)) - ran
        return calls

    def prefill(self, prompts: list[list[int]], slots: list[int], sampling: Sampling,
                images: PromptImages | None = None):
        """Write prompts into `slots` and draw their first tokens, all chunks of a call
        at once, `prefill_rows` distinct prompts a call. Returns a `Prefilled` (device
        arrays; `fetch` gives tokens (1, n), logprobs (1, n), top ids and logprobs
        (1, n, N); recording routing: then the prompts' expert choices (1, n, L, T, K)).
        `images`: an image-text model's prompts' images, their embeddings put in place of
        their tokens' as the prompts are prefilled (one chunk: prefill_chunk_size=0)."""
        parts, calls = [], self._calls(prompts, slots, images)
        self._prompt_pages(prompts, slots, images)
        programs = self._prefill_fns if images is None else self._image_prefill_fns
        for rows, requests in calls:
            self.state, out = self._run(programs[sampling.samples()], self.weights,
                                        self.state, rows,
                                        sampling.take(requests).pad(self.batch_size).snapshot())
            self._placed(rows)
            parts.append((out, requests))
        return Prefilled(parts, len(prompts), cached_tokens(prompts, calls))

    def _placed(self, rows: "PromptRows"):
        """The host's record of the positions of the slots `rows` were written into."""
        real = rows.slot_ids < self.batch_size
        self.positions[rows.slot_ids[real]] = rows.request_lengths[real]
        if rows.images is not None:  # pages keyed by token ids alone: not for images
            return
        source = np.arange(len(rows.slot_ids)) if rows.source is None else rows.source
        self._index(rows.slot_ids, [rows.tokens[u, :rows.lengths[u]] for u in source])

    def prefill_chunks(self, length: int) -> int:
        """The chunks a prompt of `length` tokens is prefilled in (1: one call suffices)."""
        return _chunking(bucket_for(length, self.length_buckets), self.config.prefill_chunk_size)[1]

    def staged_rows(self, length: int) -> int:
        """The distinct prompts of up to `length` tokens one `begin_prefill` takes."""
        return self.prefill_rows[bucket_for(length, self.length_buckets)]

    def begin_prefill(self, prompts: list[list[int]], slots: list[int],
                      sampling: Sampling) -> StagedPrefill:
        """`prefill` of at most `staged_rows` distinct prompts, to be run one chunk per
        `prefill_step` call: nothing touches `slots` until the last chunk (decode calls
        between chunks may run over them as over idle slots)."""
        calls = self._calls(prompts, slots)
        (rows, requests), *more = calls
        if more:
            raise ValueError(f"begin_prefill: more distinct prompts than the "
                             f"{len(rows.lengths)} one staged prefill holds")
        self._prompt_pages(prompts, slots)
        U, T = rows.tokens.shape
        C, chunks = _chunking(T, self.config.prefill_chunk_size)
        start, _, _ = self._staged_fns(U, T)
        return StagedPrefill(np.pad(rows.tokens, ((0, 0), (0, chunks * C - T))), rows,
                             sampling.take(requests).pad(self.batch_size), T, C,
                             self._run(start), cached=cached_tokens(prompts, calls))

    def prefill_step(self, staged: StagedPrefill):
        """Run `staged`'s next chunk; after its last, write its prompts into their slots
        and return `prefill`'s outputs (device arrays), else None."""
        rows = staged.rows
        _, chunk, end = self._staged_fns(len(rows.lengths), staged.T)
        at = staged.done * staged.C
        staged.carry, routing = self._run(chunk, self.weights, staged.carry,
                                          staged.tokens[:, at:at + staged.C], np.int32(at),
                                          rows.lengths)
        staged.routing.append(routing)
        staged.done += 1
        if staged.done < staged.chunks:
            return None
        routing = tuple(zip(*staged.routing))  # per recorded array, its chunks
        self.state, out = self._run(end[staged.sampling.samples()], self.state, staged.carry,
                                    routing, rows, staged.sampling.snapshot())
        staged.carry = staged.routing = None
        self._placed(rows)
        n = int((rows.slot_ids < self.batch_size).sum())
        return Prefilled([(out, list(range(n)))], n, staged.cached)

    def _staged_fns(self, rows: int, T: int):
        """A staged prefill's programs for (rows, T): its carry's start, one chunk, and
        the end (greedy, sampling); with a mesh the carry keeps the cache's shardings
        from call to call."""
        if (rows, T) not in self._staged:
            C, chunks = _chunking(T, self.config.prefill_chunk_size)
            model, mesh = self.model, self.mesh
            carry_out = {}
            if mesh is not None:
                shapes = jax.eval_shape(lambda: _staged_start(model, rows, chunks * C))
                specs = match_partition_rules(model.cache_rules, shapes[0])
                cache = jax.tree.map(
                    lambda spec, s: NamedSharding(mesh, fitted_spec(spec, s.shape, mesh)),
                    specs, shapes[0], is_leaf=lambda x: isinstance(x, P))
                carry = (cache, NamedSharding(mesh, P()))
                carry_out = {"out_shardings": carry}
            start = jax.jit(functools.partial(_staged_start, model, rows, chunks * C),
                            **carry_out)
            chunk = jax.jit(functools.partial(_prompt_chunk, model, self.record_routing,
                                              self.layout.has_state),
                            donate_argnums=(1,), **({} if mesh is None else {
                                "out_shardings": (carry, NamedSharding(mesh, P()))}))
            end = {sample: jax.jit(functools.partial(_staged_end, dataclasses.replace(
                       self.settings, sample=sample)), donate_argnums=(0,), **self._out_shardings)
                   for sample in KINDS}
            self._staged[rows, T] = start, chunk, end
        return self._staged[rows, T]

    def decode(self, sampling: Sampling, active=None, keep: int = 0, ends=None,
               stop: int = -1):
        """decode_steps tokens for every slot, as device arrays: tokens (C, B),
        logprobs (C, B), top ids and logprobs (C, B, N) (recording routing: then each step's
        input token's expert choices (C, B, L, K)). `active` (B,) bool marks the
        slots whose tokens matter (default: all); the call attends over the shortest
        cache length that holds their positions, and at least `keep`: an idle slot writes
        its garbage at the window's last position, so a slot waiting to be `extend`ed
        whose history ends at position keep - 1 stays intact.

        A cache that holds a state (`CacheLayout.has_state`) cannot be rewound: a slot
        not active keeps its state, last token and position through the call, and an
        active one stops advancing (`_decode`) once its input token is at position
        ends[i] (default: never) or is `stop` (-1: none): a turn that ends there mid-call,
        or in a call sent before the host read that it ended, leaves the state of the
        tokens before its last one, which `extend` feeds again."""
        active = np.ones(self.batch_size, bool) if active is None else np.asarray(active, bool)
        end = int(self.positions[active].max()) + self.config.decode_steps if active.any() else 0
        end = max(end, keep)
        ends = np.iinfo(np.int32).max if ends is None else np.asarray(ends)
        ends = np.where(active, ends, 0).astype(np.int32)
        if self.pages:  # pages for the positions the call writes, of slots holding some
            held = np.flatnonzero(active & (self.pages.held > 0))
            self._drop_passed(held)
            self._reserve(held, np.minimum(self.positions[held] + self.config.decode_steps,
                                           self._bound[held]), strict=False)
        return self._decode(sampling, bucket_for(min(end, self.seq_length), self.decode_buckets),
                            ends, stop)

    def _drop_passed(self, slots):
        """With pages and a model whose every layer attends a sliding window
        (`Model.cache_reach`): `slots`' pages wholly before their queries' reach give
        back: a query at position p reads keys p - reach + 1 .. p, and this call's and
        every later query of an active slot sits at or past its position (an `extend`
        starts at its history's end). Their entries then read the scratch page, which
        the window's mask weighs 0, as the dense engine's masked positions."""
        reach, Z = self.model.cache_reach, self.config.page_size
        if not reach:
            return
        for slot in slots:
            passed = (int(self.positions[slot]) - reach + 1) // Z
            if passed > 0:
                self.pages.drop(int(slot), passed)

    def compile_decode(self, sampling: Sampling):
        """Compile now the decode program of every cache window for `sampling`'s kind
        (greedy or sampling), so that later decoding compiles nothing whatever the
        positions (GRPO's rollouts: no program after the first step). It decodes into the
        slots: `reset` before using the engine."""
        for length in self.decode_buckets:
            jax.block_until_ready(self._decode(sampling, length))

    def _decode(self, sampling: Sampling, length: int, ends=None, stop: int = -1):
        if ends is None:  # every slot live
            ends = np.full(self.batch_size, np.iinfo(np.int32).max, np.int32)
        self.state, out = self._run(self._decode_fns[sampling.samples(), length], self.weights,
                                    self.state, ends, np.int32(stop), sampling.snapshot())
        self.positions += self.config.decode_steps
        return out

    def extend(self, suffixes: list[list[int]], slots: list[int], starts: list[int],
               sampling: Sampling):
        """Feed each suffix onto its slot's cache at positions starts[i].., which the
        slot's earlier tokens fill below (the history is not run again), and draw each
        slot's next token: `prefill`'s outputs (recording routing: the suffixes' expert
        choices (1, n, L, T, K)). A slot's cache past starts[i] may hold
        anything (an idle slot's decode garbage): it is overwritten. A cache that holds a
        state continues from the slot's, which must be that of its tokens before
        starts[i]: the decode calls since its last turn began held it there (`decode`'s
        active, ends and stop)."""
        return self._extend(suffixes, slots, starts, sampling,
                            bucket_for(len(suffixes), self.row_buckets),
                            bucket_for(max(len(x) for x in suffixes), self.extend_buckets))

    def _extend(self, suffixes, slots, starts, sampling: Sampling, rows: int, T: int):
        """`extend` in a call of `rows` rows of T tokens."""
        n = len(suffixes)
        tokens = np.zeros((rows, T), np.int32)
        lengths, begin = np.ones(rows, np.int32), np.zeros(rows, np.int32)
        slot_ids = np.full(rows, self.batch_size, np.int32)
        for i, (suffix, slot, start) in enumerate(zip(suffixes, slots, starts)):
            if not suffix or start + len(suffix) > self.seq_length:
                raise ValueError(f"extend: slot {slot}'s suffix of {len(suffix)} tokens at "
                                 f"{start} is empty or past seq_length={self.seq_length}")
            tokens[i, :len(suffix)], lengths[i], begin[i], slot_ids[i] = suffix, len(suffix), \
                start, slot
        self._reserve(slot_ids[:n], begin[:n] + lengths[:n])
        self.state, out = self._run(self._extend_fns[sampling.samples()], self.weights,
                                    self.state, PromptRows(tokens, lengths, slot_ids, None, begin),
                                    sampling.pad(rows).snapshot())
        self.positions[slot_ids[:n]] = begin[:n] + lengths[:n]
        return out

    def prefill_after(self, prompts: list[list[int]], slots: list[int], starts: list[int],
                      sampling: Sampling):
        """`prefill` of prompts whose first starts[i] positions their slots' shared pages
        already hold (`claim`): only the rest runs through the model (`extend`), in a
        call of B rows padded to a page or a prompt length bucket (`after_buckets`): the
        programs `warmup` compiles."""
        suffixes = [p[s:] for p, s in zip(prompts, starts)]
        out = self._extend(suffixes, slots, starts, sampling, self.batch_size,
                           bucket_for(max(map(len, suffixes)), self.after_buckets))
        self.prompt_tokens["prefilled"] += sum(len(p) - s for p, s in zip(prompts, starts))
        self.prompt_tokens["cached"] += sum(starts)
        self._index(slots, prompts)
        return out

    def score(self, tokens: list[list[int]], targets: list[list[int]]):
        """Per row: target log-probabilities (len,), greedy flags (len,), top ids and
        top log-probabilities (len, N), for rows of up to seq_length tokens."""
        results, T = [], bucket_for(max(len(t) for t in tokens), self.length_buckets)
        rows = self.prefill_rows[T]  # per call: one program per length bucket
        for start in range(0, len(tokens), rows):
            chunk_tokens = tokens[start:start + rows]
            chunk_targets = targets[start:start + rows]
            ids = np.zeros((rows, T), np.int32)
            tgt = np.zeros((rows, T), np.int32)
            for i, (row, target) in enumerate(zip(chunk_tokens, chunk_targets)):
                ids[i, :len(row)], tgt[i, :len(target)] = row, target
            out = jax.device_get(self._run(self._score_fn, self.weights, ids, tgt))
            for i, row in enumerate(chunk_tokens):
                results.append(tuple(np.asarray(x)[i, :len(row)] for x in out))
        return results

    def warmup(self, sample=KINDS, score: bool = True) -> str:
        """Compile now the programs requests run, rather than on the first that needs
        them: per length bucket a prefill (and with chunks a staged prefill's) and a score
        program, per cache window a decode program, for each kind of rows in `sample`
        (`sampling.kind`: greedy, sampling, sampling with top-k or top-p). The one-call
        programs are traced one by one and compiled side by side in threads (XLA compiles
        one program on one core); jit's calls then find them compiled. With pages and
        sharing, per length bucket also the extend of B rows that runs a prompt's rest
        after its shared pages (`prefill_after`). Afterwards no prompt length, number of
        prompts or max_tokens compiles anything (`extend`'s programs of other shapes,
        multi-turn episodes', are not among them).
        Returns (and logs) one line: what was compiled, in how long."""
        began, B = time.perf_counter(), self.batch_size
        programs = []  # (jitted function, its arguments)
        for kind in sample:
            for T in self.length_buckets:
                (rows, _), = self._calls(*self._dummy_prompts(T))
                programs.append((self._prefill_fns[kind], (
                    self.weights, self.state, rows, self._dummy_sampling(B, kind))))
            ends = np.full(B, np.iinfo(np.int32).max, np.int32)
            programs += [(fn, (self.weights, self.state, ends, np.int32(-1),
                               self._dummy_sampling(B, kind))) for fn in dict.fromkeys(
                self._decode_fns[kind, length] for length in self.decode_buckets)]
        for kind in sample if self._share_pages else ():  # `prefill_after`'s
            programs += [(self._extend_fns[kind], (self.weights, self.state,
                                                   self._dummy_suffixes(T),
                                                   self._dummy_sampling(B, kind)))
                         for T in self.after_buckets]
        if score:
            programs += [(self._score_fn, (self.weights, *[np.zeros(
                (self.prefill_rows[T], T), np.int32)] * 2)) for T in self.length_buckets]
        lowered = [self._run(lambda: fn.lower(*args)) for fn, args in programs]
        with concurrent.futures.ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1)) as pool:
            list(pool.map(lambda program: program.compile(), lowered))
        self._run_each_once(sample)
        if score:
            for T in self.length_buckets:
                self.score([[0] * T], [[0] * T])
        self.reset()
        rows = ", ".join(str(self.prefill_rows[T]) for T in self.length_buckets)
        line = (f"compiled {len(programs)} programs in {time.perf_counter() - began:.1f}s: "
                f"prefill{' and score' * score} of prompt lengths {self.length_buckets} "
                f"({rows} rows a call), decode over cache windows {self.decode_buckets} ({B} "
                f"slots, {self.config.decode_steps} steps a call), "
                f"{f'prompts of {self.after_buckets} after shared pages, ' * self._share_pages}"
                f"{', '.join(KIND_NAMES[k] for k in sample)}")
        log.info(line)
        return line

    def _run_each_once(self, sample):
        """Warm-up's second half: each program run once (the staged prefills, which are
        not lowered ahead, compile here), for each kind of rows in `sample`."""
        B = self.batch_size
        for kind in sample:
            for T in self.length_buckets:
                prompts, slots = self._dummy_prompts(T)
                self.fetch(self.prefill(prompts, slots, self._dummy_sampling(len(prompts), kind)))
                if self.prefill_chunks(T) > 1:  # the batcher's chunk-per-call programs
                    staged = self.begin_prefill(prompts, slots,
                                                self._dummy_sampling(len(prompts), kind))
                    while (out := self.prefill_step(staged)) is None:
                        pass
                    self.fetch(out)
            # Decoding writes garbage into idle slots, which nothing reads: each slot's
            # positions are written again before its queries can see them.
            for length in self.decode_buckets:
                jax.block_until_ready(self._decode(self._dummy_sampling(B, kind), length))
            for T in self.after_buckets if self._share_pages else ():
                self.state, out = self._run(self._extend_fns[kind], self.weights, self.state,
                                            self._dummy_suffixes(T), self._dummy_sampling(B, kind))
                jax.block_until_ready(out)

    def _dummy_prompts(self, T: int):
        """Warm-up's prompts of bucket T, one call's worth, all distinct, and their slots:
        index B, so that their writes are dropped and the cache stays."""
        prompts = [[0] * (T - 1) + [i % self.model.vocab_size]
                   for i in range(self.prefill_rows[T])]
        return prompts, [self.batch_size] * len(prompts)

    def _dummy_suffixes(self, T: int) -> PromptRows:
        """Warm-up's `prefill_after` rows of bucket T, to slot index B (writes dropped)."""
        B = self.batch_size
        return PromptRows(np.zeros((B, T), np.int32), np.ones(B, np.int32),
                          np.full(B, B, np.int32), None, np.zeros(B, np.int32))

    @staticmethod
    def _dummy_sampling(rows: int, sample: int) -> Sampling:
        """Rows of kind `sample` (`sampling.kind`)."""
        s = Sampling.empty(rows)
        s.temperature[:] = float(sample > 0)
        s.top_p[:] = 0.5 if sample == TRUNCATE else 1.0
        return s
