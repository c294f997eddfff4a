"""Multi-turn rollouts (`--grpo.tools`, `--grpo.environment`): episodes of model turns and
environment messages on the serving engine, token in, token out.

Each episode owns one engine slot for its whole life. Its row is built of ids only, never
of re-tokenized text: the rendered prompt, then each turn's sampled ids exactly as the
engine drew them (trained on: `model` True), then the chat template's rendering of what
the environment appended (context: no loss, no advantage), taken as the template's delta
(`ChatRenderer.delta`, easylm/data/conversations.py: the conversation rendered before and
after, the new suffix). When a turn ends (EOS, --grpo.max_new_tokens, or the row full)
the environment's `step` runs in a thread pool while the other episodes keep decoding;
its messages' delta is then prefilled onto the slot's cache at the episode's position
(`Engine.extend`): the history is never run again, so an episode's prefill is its prompt
plus what was appended (logged as rollout/prefill_tokens_per_episode). A cache holding a
recurrent state (Qwen3.5's Gated DeltaNet) is held at the turn's end on the device:
decode calls stop advancing a slot at its EOS or its turn's last position, and while it
waits (`Engine.decode`). Messages whose delta does not fit the row (a tool's 1 MB answer)
are cut, marked, to leave the model a turn (`ChatRenderer.fit`). It ends when the
environment says done, at --grpo.max_turns turns, or when the row (seq_length) has no
room for the next delta, even cut, and a token of the model.

With routing replay (an engine that records routing, a mixture of experts) each episode
also keeps, per position of its row, the expert choices its token got as the engine fed
it (`Episode.routing`): the prompt's from the prefill, each sampled token's from the
decode step that fed it, and each delta's, with the model's last token fed again before
it, from `extend` (which rewrites that position's cache entry, so its choices are the
ones later tokens attended over). `episode_rows` lays them out where the training row
feeds its tokens.
"""

import collections
import concurrent.futures
import dataclasses

import numpy as np

from easylm.errors import UserError
from easylm.serving.engine import Sampling

DECODING, WAITING, DONE = "decoding", "waiting", "done"


@dataclasses.dataclass
class Episode:
    env: object  # None: a padding row (no environment, no turn)
    messages: list  # the conversation, the model's turns as {"role": "assistant", ...}
    tokens: list  # the row: prompt, each turn's sampled ids, each appended delta
    model: list  # per token: sampled by the model (trained on) or context
    logprobs: list  # per token: the engine's log-probability of it (0 for context)
    turn: list = dataclasses.field(default_factory=list)  # the turn being sampled
    turns: int = 0
    reward: float | None = None  # the environment's, summed
    prefilled: int = 0  # tokens run through prefill or extend, besides sampled ones
    ended_by_eos: bool = False  # the last turn
    truncated: bool = False  # ended without its EOS, or by the row's budget
    state: str = DECODING
    epoch: int = 0  # bumped at each turn's end and start: stale engine outputs are skipped
    routing: list = dataclasses.field(default_factory=list)  # per position: (L, K) or None

    @property
    def prompt_length(self) -> int:
        return self.model.index(True) if True in self.model else len(self.tokens)


def _one(sampling: Sampling, i: int) -> Sampling:
    return Sampling(*(a[i:i + 1] for a in dataclasses.astuple(sampling)))


class _Runner:
    """The loop of `run_episodes`: one decode call in flight ahead of the host's reading,
    environment steps in threads, each episode's turns resumed on its kept cache."""

    def __init__(self, engine, episodes, sampling, max_new_tokens, max_turns, renderer,
                 tokenizer, keep_cache):
        self.engine, self.episodes, self.sampling = engine, episodes, sampling
        self.max_new_tokens, self.max_turns = max_new_tokens, max_turns
        self.renderer, self.tokenizer, self.keep_cache = renderer, tokenizer, keep_cache
        self.pending = collections.deque()  # (device outputs, {episode: column}, epochs, fed)
        self.record = engine.record_routing
        self.futures = {}  # episode -> the environment's step in flight
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(episodes)))

    def run(self):
        engine, episodes = self.engine, self.episodes
        n, full = len(episodes), self.sampling.pad(self.engine.batch_size)
        for e in episodes:
            e.prefilled += len(e.tokens)
            if e.env is None:
                e.state = DONE
        columns = {i: i for i, e in enumerate(episodes) if e.state == DECODING}
        self._expect(engine.prefill([e.tokens for e in episodes], list(range(n)), self.sampling),
                     columns, {i: (0, len(episodes[i].tokens)) for i in columns})
        try:
            while True:
                decoding = np.asarray([e.state == DECODING for e in episodes])
                if decoding.any() and len(self.pending) < 2:
                    keep = max((len(e.tokens) for e in episodes if e.state == WAITING), default=0)
                    active = np.zeros(engine.batch_size, bool)
                    active[:n] = decoding
                    # A state cache (Gated DeltaNet) stops each turn where it can end (its
                    # EOS, its last token) and is extended from there.
                    ends = np.zeros(engine.batch_size, np.int64)
                    ends[:n] = [self._last_position(e) for e in episodes]
                    self._expect(engine.decode(full, active, keep, ends, self.renderer.eos),
                                 {i: i for i in np.flatnonzero(decoding)})
                if self.pending:
                    self._read(*self.pending.popleft())
                self._resume(wait=not self.pending and not decoding.any())
                if not self.pending and not self.futures and \
                        all(e.state == DONE for e in episodes):
                    return
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _last_position(self, e) -> int:
        """The position of the current turn's last token at the latest (`_read`'s
        max_new_tokens and seq_length ends)."""
        begun = len(e.tokens) - len(e.turn)  # the same while the host catches up
        return min(begun + self.max_new_tokens, self.engine.seq_length) - 1

    def _expect(self, out, columns, fed=None):
        """`fed` (a prefill's or an extend's): {episode: (the position its fed tokens
        start at, how many)}; None: a decode call (each step feeds the last token)."""
        self.pending.append((out, columns, {i: self.episodes[i].epoch for i in columns}, fed))

    def _read(self, out, columns, epochs, fed):
        fetched = self.engine.fetch(out)
        ids, logprobs = fetched[:2]  # (steps, rows)
        S, eos = self.engine.seq_length, self.renderer.eos
        for i, column in columns.items():
            e = self.episodes[i]
            if e.state != DECODING or e.epoch != epochs[i]:
                continue  # a turn that has ended since the call was made
            if self.record and fed is not None:  # (1, n, L, T, K): the fed tokens' choices
                start, count = fed[i]
                _place(e.routing, start, fetched[4][0, column, :, :count].swapaxes(0, 1))
            for step, (t, lp) in enumerate(zip(ids[:, column].tolist(),
                                               logprobs[:, column].tolist())):
                if self.record and fed is None:  # (C, B, L, K): the step's input token's
                    _place(e.routing, len(e.tokens) - 1, fetched[4][step, column][None])
                e.tokens.append(t)
                e.model.append(True)
                e.logprobs.append(lp)
                e.turn.append(t)
                if t == eos or len(e.turn) == self.max_new_tokens or len(e.tokens) == S:
                    self._end_turn(i, e, t == eos)
                    break

    def _end_turn(self, i, e, eos: bool):
        e.turns += 1
        e.epoch += 1
        e.ended_by_eos = eos
        text = self.tokenizer.decode(e.turn[:-1] if eos else e.turn, skip_special_tokens=True)
        e.messages.append({"role": "assistant", "content": text})
        e.turn = []
        if len(e.tokens) >= self.engine.seq_length:
            e.state, e.truncated = DONE, True
            return
        e.state = WAITING
        self.futures[i] = self.pool.submit(e.env.step, [dict(m) for m in e.messages])

    def _resume(self, wait: bool):
        if wait and self.futures:
            concurrent.futures.wait(self.futures.values(),
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for i in [i for i, f in self.futures.items() if f.done()]:
            self._continue(i, self.episodes[i], self.futures.pop(i))

    def _continue(self, i, e, future):
        try:
            new, reward, done = future.result()
        except Exception as ex:  # noqa: BLE001  (a user's environment)
            raise UserError(f"--grpo.environment: step() raised {type(ex).__name__}: {ex}") \
                from None
        if reward is not None:
            e.reward = (e.reward or 0.0) + float(reward)
        e.truncated = not e.ended_by_eos
        if done or not new or e.turns >= self.max_turns:
            e.state = DONE
            return
        room = self.engine.seq_length - len(e.tokens)  # for the delta and a model token
        fitted = self.renderer.fit(e.messages, list(new), e.ended_by_eos, room,
                                   min(self.max_new_tokens, room // 2))
        if fitted is None:
            e.state, e.truncated = DONE, True
            return
        new, delta = fitted
        e.messages.extend(new)
        last, start = e.tokens[-1], len(e.tokens) - 1
        e.tokens += delta
        e.model += [False] * len(delta)
        e.logprobs += [0.0] * len(delta)
        e.epoch += 1
        e.state = DECODING
        if self.keep_cache:  # the model's last token again (a decode call may not have
            # written it yet), then the delta, at the episode's own positions
            e.prefilled += len(delta)
            out = self.engine.extend([[last] + delta], [i], [start], _one(self.sampling, i))
            fed = (start, len(delta) + 1)
        else:  # the whole conversation again: what a rollout without a kept cache runs
            e.prefilled += len(e.tokens)
            out = self.engine.prefill([e.tokens], [i], _one(self.sampling, i))
            fed = (0, len(e.tokens))
        self._expect(out, {i: 0}, {i: fed})


def _place(routing: list, start: int, chosen):
    """Write `chosen` (n, L, K) at positions start.. of an episode's `routing`."""
    if len(routing) < start + len(chosen):
        routing.extend([None] * (start + len(chosen) - len(routing)))
    routing[start:start + len(chosen)] = list(chosen)


def run_episodes(engine, episodes, sampling, max_new_tokens: int, max_turns: int, renderer,
                 tokenizer, keep_cache: bool = True):
    """Run `episodes` (each in slot = its index; prompts in `tokens`) to their ends on
    `engine`, in place. `keep_cache` False: each later turn re-prefills the whole
    conversation into its slot instead of extending its cache (the comparison's baseline;
    with routing recorded, the re-prefill's choices replace the earlier turns', which
    near-tied routers may have made otherwise: replay then matches the later turns only)."""
    _Runner(engine, episodes, sampling, max_new_tokens, max_turns, renderer, tokenizer,
            keep_cache).run()
    return episodes


def episode_rows(episodes, T: int, pad_id: int, keep) -> dict:
    """Rows (N, T) of the episodes' tokens: input_tokens, target_tokens, loss_masks (1 on
    the model's tokens of the rows `keep`s, 0 on the prompt and every appended message) and
    sampling_logps (the engine's log-probabilities where loss_masks is 1); and, when the
    episodes recorded routing, routing (N, L, T, K) int16: each input token's expert
    choices, -1 (route as usual) where none was recorded (past the row, padding rows)."""
    N = len(episodes)
    tokens = np.full((N, T + 1), pad_id, np.int32)
    masks = np.zeros((N, T + 1), np.float32)
    logps = np.zeros((N, T + 1), np.float32)
    for i, e in enumerate(episodes):
        row = e.tokens[:T + 1]
        tokens[i, :len(row)] = row
        masks[i, :len(row)] = np.asarray(e.model[:T + 1], np.float32) * float(keep[i])
        logps[i, :len(row)] = e.logprobs[:T + 1]
    out = {"input_tokens": tokens[:, :-1], "target_tokens": tokens[:, 1:],
           "loss_masks": masks[:, 1:], "sampling_logps": logps[:, 1:] * masks[:, 1:]}
    recorded = [r for e in episodes for r in e.routing if r is not None]
    if recorded:
        L, K = recorded[0].shape
        routing = np.full((N, L, T, K), -1, np.int16)
        for i, e in enumerate(episodes):
            for p, chosen in enumerate(e.routing[:T]):
                if chosen is not None:
                    routing[i, :, p] = chosen
        out["routing"] = routing
    return out
