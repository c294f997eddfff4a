"""Continuous batching: requests take free decode slots between decode calls.

One thread owns the engine (and so the device). Each turn of its loop:

    1. run queued jobs (`run`), then ONE chunk of the oldest scoring job (`score`):
       the rows that fit one seq_length-token forward (a long prompt's prefill); drop
       cancelled requests, freeing their slots
    2. admit waiting requests into free slots, round-robin over the requests they
       came in (so a 300-prompt request does not hold a 1-prompt one behind it):
       the prompts that fit one prefill chunk (and image prompts, whatever their
       length: the vision tower runs once) in one prefill call, whose first tokens
       are handed out at once (a stream shows its first token right after prefill,
       not after a decode call); longer ones start a staged prefill, one at a time
    3. run ONE chunk of the staged prefill, if any (its slots are reserved; they join
       decoding, and get their first tokens, after its last chunk)
    4. dispatch one decode call (engine.decode_steps tokens for every slot)
    5. while it runs, hand out the previous call's tokens and text; requests that
       finished (stop token, stop string, max_tokens) free their slots
    (4. sends no call to a slot whose request the call in flight already fills to its
    max_tokens: `_wanting`.)

So a request never waits for another to finish, only for the current decode call,
one scoring chunk and one prefill chunk (a 32k-token prompt does not freeze the
streams running beside it), and the host's bookkeeping overlaps the device's work. Being
one call behind costs a little: a slot whose request stops (a stop token or string)
decodes one call too many, and tokens produced past a request's end are dropped.

A failure that belongs to one request (its settings, its detokenization, its
client's event handler) fails that request alone; only a failing device call fails
everything in flight.
"""

import collections
import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np

from easylm.serving.engine import Engine, PromptImages, Sampling, bucket_for
from easylm.serving.text import TextStream

log = logging.getLogger(__name__)
USE_LOG_SECONDS = 10.0  # how often a busy batcher logs the cache's use


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # besides the batcher's end-of-sequence ids


@dataclasses.dataclass
class Token:
    id: int
    logprob: float
    top_ids: np.ndarray  # (N,) the most likely tokens at this step
    top_logprobs: np.ndarray  # (N,)

    @property
    def top(self) -> list[tuple[int, float]]:
        return list(zip(self.top_ids.tolist(), self.top_logprobs.tolist()))


@dataclasses.dataclass
class Event:
    """What a request receives after each decode call: new text and tokens, and at the
    end a finish reason ('stop', 'length', 'cancelled') or an error message."""

    text: str
    tokens: list[Token]
    finish_reason: str | None = None
    error: str | None = None


class Generation:
    """One prompt in flight. `on_event` is called from the batcher's thread. Prompts
    with the same `group` (one HTTP request's) take turns with other groups for slots."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, tokenizer,
                 on_event: Callable[[Event], None], group=None, images=None):
        self.prompt = list(prompt)
        # An image prompt's image inputs (1, ...), laid out for seq_length tokens
        # (`Engine.prefill`'s images); None: a text prompt.
        self.images = images
        self.params = params
        self.group = self if group is None else group
        self.stop_ids: set[int] = set(params.stop_token_ids)  # the batcher adds EOS
        self.on_event = on_event
        self.stream = TextStream(tokenizer, params.stop)
        self.tokens: list[Token] = []
        self.cancelled = False
        self.finish_reason: str | None = None
        # Prompt tokens whose cache another request's run of the same prompt filled.
        self.cached_tokens = 0
        seed = params.seed if params.seed is not None else int(np.random.randint(2**31))
        # jax.random.PRNGKey(seed)'s raw bits, made on the host.
        self.key = np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


def check_params(params: SamplingParams):
    """Raise ValueError for settings the device would overflow on or misread (the
    server checks first, with messages naming the fields)."""
    if not 0 <= params.top_k < 2**31:
        raise ValueError(f"top_k={params.top_k} is outside [0, 2**31)")
    if not 0 <= params.temperature < float("inf"):
        raise ValueError(f"temperature={params.temperature} is not a finite number >= 0")
    # A top_p that float32 flushes to 0 would keep no token at all.
    if not np.finfo(np.float32).tiny <= params.top_p <= 1:
        raise ValueError(f"top_p={params.top_p} is outside [{np.finfo(np.float32).tiny:.3g}, 1]")
    if params.seed is not None and not -2**63 <= params.seed < 2**64:
        raise ValueError(f"seed={params.seed} does not fit 64 bits")


@dataclasses.dataclass
class _ScoreJob:
    tokens: list
    targets: list
    future: Future
    results: list = dataclasses.field(default_factory=list)


class Batcher:
    def __init__(self, engine: Engine, stop_token_ids: Sequence[int] = ()):
        self.engine = engine
        self.stop_token_ids = set(stop_token_ids)
        B = engine.batch_size
        self.slots: list[Generation | None] = [None] * B
        self.sampling = Sampling.empty(B)
        self._in_flight = None  # (decode outputs on the device, the slots when dispatched)
        self._staged = None  # (engine.StagedPrefill, [(slot, Generation)]) being prefilled
        self._waiting: list[Generation] = []
        # When `_log_use` last logged: the first line comes USE_LOG_SECONDS after the start
        # (a short session, the quick start's, logs nothing but its ready line).
        self._logged = time.monotonic()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._scoring: collections.deque[_ScoreJob] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="easylm-batcher", daemon=True)

    # ------------------------------------------------------------ any thread

    def start(self) -> "Batcher":
        self._thread.start()
        return self

    def stop(self):
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def submit(self, generation: Generation):
        """Queue a generation; ValueError for one that cannot run (nothing is queued).
        The server checks all of this first, with messages for the client."""
        if not generation.prompt or generation.params.max_tokens < 1:
            raise ValueError("a generation needs a prompt and max_tokens >= 1")
        if len(generation.prompt) + generation.params.max_tokens > self.engine.seq_length:
            raise ValueError("prompt + max_tokens exceeds seq_length")
        vocab, ids = self.engine.model.vocab_size, np.asarray(generation.prompt)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        check_params(generation.params)
        generation.stop_ids |= self.stop_token_ids
        with self._wake:
            self._waiting.append(generation)
            self._wake.notify()

    def cancel(self, generation: Generation):
        """Stop a request (its client went away); its slot is freed before the next decode."""
        generation.cancelled = True
        with self._wake:
            self._wake.notify()

    def run(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the batcher's thread between decode calls, in one piece
        (so decoding waits for all of it; `score` is the server's way)."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        with self._wake:
            self._wake.notify()
        return future

    def score(self, tokens: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> Future:
        """`engine.score(tokens, targets)`'s results, computed a chunk per turn between
        decode calls. Cancelling the future drops the rows not scored yet."""
        future: Future = Future()
        if not tokens:
            future.set_result([])
            return future
        with self._wake:
            self._scoring.append(_ScoreJob(list(tokens), list(targets), future))
            self._wake.notify()
        return future

    def generate(self, prompts: Sequence[Sequence[int]], params, tokenizer):
        """Blocking helper (tests, benchmarks): the finished Generations, in order;
        `params` one SamplingParams for all, or one per prompt."""
        done = [threading.Event() for _ in prompts]
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)

        def on_event(event, finished):
            if event.finish_reason or event.error:
                finished.set()

        gens = [Generation(p, q, tokenizer, lambda e, d=d: on_event(e, d))
                for p, q, d in zip(prompts, params, done)]
        for g in gens:
            self.submit(g)
        for d in done:
            d.wait()
        return gens

    # ------------------------------------------------------ batcher thread

    def _has_work(self) -> bool:
        return (self._stopping or bool(self._waiting) or not self._jobs.empty()
                or bool(self._scoring) or self._in_flight is not None
                or self._staged is not None
                or any(s is not None for s in self.slots))

    def _loop(self):
        while True:
            with self._wake:
                while not self._has_work():
                    self._wake.wait()
                if self._stopping:
                    break
                dropped = [g for g in self._waiting if g.cancelled]
                reserved = {slot for slot, _ in self._staged[1]} if self._staged else set()
                free = [i for i, s in enumerate(self.slots) if s is None and i not in reserved]
                waiting = [g for g in self._waiting if not g.cancelled]
                # While a staged prefill runs, only prompts of one chunk join.
                admitted, _ = _take_turns([g for g in waiting if self._staged is None
                                           or self._one_chunk(g)], len(free))
                admitted = self._fit_pages(admitted, free)
                self._waiting = [g for g in waiting if g not in admitted]
            for g in dropped:
                self._finish(None, g, "cancelled")
            try:
                self._run_jobs()
                self._score_chunk()
                self._free_cancelled()
                short = [g for g in admitted if self._one_chunk(g)]
                for prefilled in self._admit(short, free):
                    self._deliver(*prefilled)
                self._begin_staged([g for g in admitted if not self._one_chunk(g)],
                                   free[len(short):])
                prefilled = self._staged_chunk()
                if prefilled is not None:
                    self._deliver(*prefilled)
                previous, self._in_flight = self._in_flight, None
                active = self._wanting(previous)
                if any(active):
                    self._in_flight = (self.engine.decode(self.sampling, active),
                                       list(enumerate(self.slots)))
                if previous is not None:
                    self._deliver(*previous)
                self._log_use()
            except Exception as e:  # a device call failed: fail what is in flight, keep serving
                log.exception("batcher step failed")
                self._in_flight = None
                error = f"{type(e).__name__}: {e}"
                for i, g in enumerate(self.slots):
                    if g is not None:
                        self._finish(i, g, None, error=error)
                staged, self._staged = self._staged, None
                for g in admitted + [g for _, g in (staged[1] if staged else ())]:
                    if g.finish_reason is None:
                        self._finish(None, g, None, error=error)

    def _wanting(self, previous) -> list[bool]:
        """Per slot, whether a decode call sent now can give its request a token it may
        keep: it has a request whose tokens so far, with those of the call still in
        flight (`previous`), stay below max_tokens. A request that the call in flight
        fills up then gets no call it would drop whole (one call per request fewer, and
        a batch of max_tokens requests ends with the device idle, not decoding waste)."""
        steps = self.engine.config.decode_steps
        owners = [None] * len(self.slots) if previous is None else [g for _, g in previous[1]]
        return [g is not None and len(g.tokens) + steps * (owners[i] is g) < g.params.max_tokens
                for i, g in enumerate(self.slots)]

    def _log_use(self):
        """Every USE_LOG_SECONDS while requests run: the cache's slots in use (with
        pages: the pool's pages held, a shared page once, and those a request may take:
        free or holding an earlier prompt's prefix), the requests waiting for one, and the
        prompt tokens prefilled and shared since start."""
        now = time.monotonic()
        if now - self._logged < USE_LOG_SECONDS:
            return
        self._logged = now
        engine, free = self.engine, self.engine.pages_free()
        pages = "" if free is None else (f", {engine.pages.in_use} of "
                                         f"{engine.pages.pages - 1} pages in use ({free} free)")
        log.info("cache: %d of %d slots in use (%d positions each)%s, %d requests waiting; "
                 "prompt tokens since start: %d prefilled, %d from shared prompts",
                 sum(s is not None for s in self.slots), engine.batch_size,
                 engine.seq_length, pages, len(self._waiting),
                 engine.prompt_tokens["prefilled"], engine.prompt_tokens["cached"])

    def _run_jobs(self):
        while not self._jobs.empty():
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as e:
                    future.set_exception(e)

    def _score_chunk(self):
        """One chunk of the oldest scoring job; the job then goes to the back of the line."""
        while self._scoring and self._scoring[0].future.cancelled():
            self._scoring.popleft()
        if not self._scoring:
            return
        job = self._scoring.popleft()
        start = len(job.results)
        rows = self._chunk_rows(job.tokens[start:start + self.engine.batch_size])
        try:
            job.results += self.engine.score(job.tokens[start:start + rows],
                                             job.targets[start:start + rows])
        except Exception as e:  # this job's rows, e.g. longer than the context
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(e)
            return
        if len(job.results) < len(job.tokens):
            self._scoring.append(job)
        elif job.future.set_running_or_notify_cancel():
            job.future.set_result(job.results)

    def _chunk_rows(self, rows: list) -> int:
        """How many of `rows` (at most batch_size) to score now: as many as one score
        call holds (`prefill_rows` of their length bucket: prefill_budget tokens), and at
        least one: one call, chunked inside like a one-call prefill, so a decode call
        waits for no more than that."""
        engine = self.engine
        return engine.prefill_rows[bucket_for(max(map(len, rows)), engine.length_buckets)]

    def _free_cancelled(self):
        for i, g in enumerate(self.slots):
            if g is not None and g.cancelled:
                self._finish(i, g, "cancelled")

    def _one_chunk(self, g: Generation) -> bool:
        """Whether `g` is prefilled in one call (an image prompt always is)."""
        return g.images is not None or self.engine.prefill_chunks(len(g.prompt)) == 1

    @staticmethod
    def _rows(generations: list[Generation]) -> Sampling:
        rows = Sampling.empty(len(generations))
        for row, g in enumerate(generations):
            rows.keys[row], rows.temperature[row] = g.key, g.params.temperature
            rows.top_k[row], rows.top_p[row] = g.params.top_k, g.params.top_p
        return rows

    def _seat(self, owners: list, rows: Sampling):
        """Give each (slot, generation) its slot and the slot its sampling settings."""
        for row, (slot, g) in enumerate(owners):
            self.slots[slot] = g
            for field in ("keys", "temperature", "top_k", "top_p"):
                getattr(self.sampling, field)[slot] = getattr(rows, field)[row]

    def _fit_pages(self, admitted: list[Generation], free: list[int]) -> list[Generation]:
        """With a paged cache (engine.pages_free not None): the first of `admitted` whose
        pages (prompt and max_tokens, `engine.pages_needed`) the free pages cover; the
        rest wait for finished requests' pages. Free slots hold none (a staged prefill's
        cancelled or failed requests leave theirs claimed)."""
        if self.engine.pages_free() is None:
            return admitted
        for slot in free:
            self.engine.free(slot)
        left = self.engine.pages_free()
        for i, g in enumerate(admitted):
            left -= self.engine.pages_needed(len(g.prompt) + g.params.max_tokens)
            if left < 0:
                return admitted[:i]
        return admitted

    def _admit(self, generations: list[Generation], free: list[int]):
        """Prefill `generations` into free slots: those whose prompt starts with pages
        another request left (`engine.claim`) from there on (`engine.prefill_after`), the
        others in one call. Returns [(device outputs, owners)] per call."""
        owners = list(zip(free, generations))
        # An image prompt takes no shared pages: its token ids do not say which image.
        starts = [self.engine.claim(slot, len(g.prompt) + g.params.max_tokens,
                                    g.prompt if g.images is None else ())
                  for slot, g in owners]
        calls = []
        for kind in ("text", "after", "images"):
            group = [(o, s) for o, s in zip(owners, starts)
                     if kind == ("images" if o[1].images is not None else
                                 "after" if s else "text")]
            if not group:
                continue
            mine = [o for o, _ in group]
            rows = self._rows([g for _, g in mine])
            prompts, slots = [g.prompt for _, g in mine], [slot for slot, _ in mine]
            if kind == "after":  # the positions its shared pages hold: prompt tokens not run
                out = self.engine.prefill_after(prompts, slots, [s for _, s in group], rows)
                cached = [s for _, s in group]
            else:
                out = self.engine.prefill(prompts, slots, rows, None if kind == "text" else
                                          PromptImages.each([g.images for _, g in mine]))
                cached = out.cached
            for (_, g), tokens in zip(mine, cached):
                g.cached_tokens = tokens
            self._seat(mine, rows)
            calls.append((out, mine))
        return calls

    def _begin_staged(self, generations: list[Generation], free: list[int]):
        """Start prefilling `generations` (longer than a chunk) into free slots, a chunk
        per turn (`_staged_chunk`); the slots stay empty, and reserved, until the last."""
        if not generations:
            return
        # One staged prefill's rows; the rest wait, first in line, for the next.
        take = self.engine.staged_rows(max(len(g.prompt) for g in generations))
        generations, rest = generations[:take], generations[take:]
        with self._wake:
            self._waiting[:0] = rest
        slots = free[:len(generations)]
        for slot, g in zip(slots, generations):  # shares no page: it writes its whole prompt
            self.engine.claim(slot, len(g.prompt) + g.params.max_tokens)
        staged = self.engine.begin_prefill([g.prompt for g in generations], slots,
                                           self._rows(generations))
        for g, cached in zip(generations, staged.cached):
            g.cached_tokens = cached
        self._staged = (staged, list(zip(slots, generations)))

    def _staged_chunk(self):
        """The staged prefill's next chunk; after its last, its requests take their slots:
        returns (device outputs, owners) then, else None. Dropped once every request in it
        is cancelled."""
        if self._staged is None:
            return None
        staged, owners = self._staged
        if all(g.cancelled for _, g in owners):
            self._staged = None
            for _, g in owners:
                self._finish(None, g, "cancelled")
            return None
        out = self.engine.prefill_step(staged)
        if out is None:
            return None
        self._staged = None
        self._seat(owners, staged.sampling)
        return out, owners

    def _deliver(self, out, owners):
        """Hand row r of `out` (steps, rows, ...) to owners[r] = (slot, request as it was
        when the call was dispatched), unless that request has finished since."""
        tokens, logprobs, top_ids, top_logprobs = self.engine.fetch(out)
        for row, (slot, g) in enumerate(owners):
            if g is not None and g.finish_reason is None:
                try:
                    self._take(slot, g, tokens[:, row], logprobs[:, row], top_ids[:, row],
                               top_logprobs[:, row])
                except Exception as e:  # its text or its client's handler: it alone fails
                    log.exception("a request failed while taking its tokens")
                    if g.finish_reason is None:
                        self._finish(slot, g, None, error=f"{type(e).__name__}: {e}")

    def _take(self, slot: int, g: Generation, tokens, logprobs, top_ids, top_logprobs):
        """Give `g` its new tokens, then finish it if it has reached its end."""
        ids = tokens.tolist()
        n = next((i for i, t in enumerate(ids) if t in g.stop_ids), len(ids))
        reason = "stop" if n < len(ids) else None
        room = g.params.max_tokens - len(g.tokens)
        if room <= n:
            n, reason = room, "length"
        accepted = ids[:n]
        if g.stream.stop:  # token by token, to know which one completes a stop string
            for i, token in enumerate(accepted):
                if g.stream.add(token):
                    accepted, reason = accepted[:i + 1], "stop"
                    break
        else:
            g.stream.extend(accepted)
        new = [Token(t, float(logprobs[i]), top_ids[i], top_logprobs[i])
               for i, t in enumerate(accepted)]
        g.tokens.extend(new)
        if reason is None:
            g.on_event(Event(g.stream.take(), new))
        else:
            self._finish(slot, g, reason, new)

    def _finish(self, slot: int | None, g: Generation, reason, new=(), error=None):
        """End `g` (in `slot`, or None when it never got one) and tell its client; never
        raises, so that one request's failure stays its own."""
        if slot is not None and self.slots[slot] is g:
            self.slots[slot] = None
            self.engine.free(slot)
            self.sampling.temperature[slot] = 0  # an idle slot should not make others sort
        g.finish_reason = reason or "error"
        text = ""
        try:
            if error is None:
                g.stream.finish()
                text = g.stream.take(final=True)
            g.on_event(Event(text, list(new), reason, error))
        except Exception:
            log.exception("a request's final event failed")


def _take_turns(waiting: list[Generation], n: int):
    """(the n generations to admit, the rest in arrival order): every group's first
    waiting prompt, then every group's second, ... so requests share the free slots."""
    seen: dict = collections.Counter()
    turn = []
    for g in waiting:
        turn.append(seen[id(g.group)])
        seen[id(g.group)] += 1
    order = sorted(range(len(waiting)), key=lambda i: (turn[i], i))
    chosen = set(order[:n])
    return ([waiting[i] for i in sorted(chosen, key=lambda i: (turn[i], i))],
            [g for i, g in enumerate(waiting) if i not in chosen])
