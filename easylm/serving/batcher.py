"""Continuous batching: requests take free decode slots between decode calls.

One thread owns the engine (and so the device). Each turn of its loop:

    1. run queued device jobs (scoring); drop cancelled requests, freeing their slots
    2. admit waiting requests into free slots: one prefill call for all of them
    3. dispatch one decode call (engine.decode_steps tokens for every slot)
    4. while it runs, hand out the previous call's tokens and text; requests that
       finished (stop token, stop string, max_tokens) free their slots

So a request never waits for another to finish, only for the current decode
call, and the host's bookkeeping overlaps the device's work. Being one call
behind costs a little: a finished slot decodes one call too many, and tokens
produced past a request's end are dropped.
"""

import dataclasses
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np

from easylm.serving.engine import Engine, Sampling
from easylm.serving.text import TextStream

log = logging.getLogger(__name__)


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
    """One request in flight. `on_event` is called from the batcher's thread."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, tokenizer,
                 on_event: Callable[[Event], None]):
        self.prompt = list(prompt)
        self.params = params
        self.stop_ids: set[int] = set(params.stop_token_ids)  # the batcher adds EOS
        self.on_event = on_event
        self.stream = TextStream(tokenizer, params.stop)
        self.tokens: list[Token] = []
        self.cancelled = False
        self.finish_reason: str | None = None
        seed = params.seed if params.seed is not None else int(np.random.randint(2**31))
        # jax.random.PRNGKey(seed)'s raw bits, made on the host.
        self.key = np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


class Batcher:
    def __init__(self, engine: Engine, stop_token_ids: Sequence[int] = ()):
        self.engine = engine
        self.stop_token_ids = set(stop_token_ids)
        B = engine.batch_size
        self.slots: list[Generation | None] = [None] * B
        self.sampling = Sampling.empty(B)
        self._in_flight = None  # (decode outputs on the device, the slots when dispatched)
        self._waiting: list[Generation] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
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
        # The server checks these first, with messages for the client.
        if not generation.prompt or generation.params.max_tokens < 1:
            raise ValueError("a generation needs a prompt and max_tokens >= 1")
        if len(generation.prompt) + generation.params.max_tokens > self.engine.seq_length:
            raise ValueError("prompt + max_tokens exceeds seq_length")
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
        """Run `fn(*args)` on the batcher's thread between decode calls (device jobs)."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        with self._wake:
            self._wake.notify()
        return future

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, tokenizer):
        """Blocking helper (tests, benchmarks): the finished Generations, in order."""
        done = [threading.Event() for _ in prompts]

        def on_event(event, finished):
            if event.finish_reason or event.error:
                finished.set()

        gens = [Generation(p, params, tokenizer, lambda e, d=d: on_event(e, d))
                for p, d in zip(prompts, done)]
        for g in gens:
            self.submit(g)
        for d in done:
            d.wait()
        return gens

    # ------------------------------------------------------ batcher thread

    def _has_work(self) -> bool:
        return (self._stopping or bool(self._waiting) or not self._jobs.empty()
                or self._in_flight is not None or any(s is not None for s in self.slots))

    def _loop(self):
        while True:
            with self._wake:
                while not self._has_work():
                    self._wake.wait()
                if self._stopping:
                    break
                waiting = [g for g in self._waiting if not g.cancelled]
                free = [i for i, s in enumerate(self.slots) if s is None]
                admitted, self._waiting = waiting[:len(free)], waiting[len(free):]
            try:
                self._run_jobs()
                self._free_cancelled()
                prefilled = self._admit(admitted, free)
                previous, self._in_flight = self._in_flight, None
                if any(s is not None for s in self.slots):
                    active = [s is not None for s in self.slots]
                    self._in_flight = (self.engine.decode(self.sampling, active),
                                       list(enumerate(self.slots)))
                if prefilled is not None:
                    self._deliver(*prefilled)
                if previous is not None:
                    self._deliver(*previous)
            except Exception as e:  # a bug: fail the requests in flight, keep serving
                log.exception("batcher step failed")
                self._in_flight = None
                for i, g in enumerate(self.slots):
                    if g is not None:
                        self._finish(i, g, None, error=f"{type(e).__name__}: {e}")
                for g in admitted:
                    if g.finish_reason is None:
                        g.finish_reason = "error"
                        g.on_event(Event("", [], error=f"{type(e).__name__}: {e}"))

    def _run_jobs(self):
        while not self._jobs.empty():
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as e:
                    future.set_exception(e)

    def _free_cancelled(self):
        for i, g in enumerate(self.slots):
            if g is not None and g.cancelled:
                self._finish(i, g, "cancelled")

    def _admit(self, generations: list[Generation], free: list[int]):
        """Prefill `generations` into free slots; returns (device outputs, owners) or None."""
        if not generations:
            return None
        slots = free[:len(generations)]
        rows = Sampling(
            keys=np.stack([g.key for g in generations]),
            temperature=np.array([g.params.temperature for g in generations], np.float32),
            top_k=np.array([g.params.top_k for g in generations], np.int32),
            top_p=np.array([g.params.top_p for g in generations], np.float32),
        )
        out = self.engine.prefill([g.prompt for g in generations], slots, rows)
        for row, (slot, g) in enumerate(zip(slots, generations)):
            self.slots[slot] = g
            for field in ("keys", "temperature", "top_k", "top_p"):
                getattr(self.sampling, field)[slot] = getattr(rows, field)[row]
        return out, list(zip(slots, generations))

    def _deliver(self, out, owners):
        """Hand row r of `out` (steps, rows, ...) to owners[r] = (slot, request as it was
        when the call was dispatched), unless that request has finished since."""
        tokens, logprobs, top_ids, top_logprobs = self.engine.fetch(out)
        for row, (slot, g) in enumerate(owners):
            if g is not None and g.finish_reason is None:
                self._take(slot, g, tokens[:, row], logprobs[:, row], top_ids[:, row],
                           top_logprobs[:, row])

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

    def _finish(self, slot: int, g: Generation, reason, new=(), error=None):
        if self.slots[slot] is g:
            self.slots[slot] = None
            self.sampling.temperature[slot] = 0  # an idle slot should not make others sort
        g.stream.finish()
        g.finish_reason = reason or "error"
        g.on_event(Event(g.stream.take(final=True), list(new), reason, error))
