"""Scoring text under the model: log-likelihood, rolling log-likelihood, is-greedy.

EasyLM's semantics, per text (so a result never depends on what else is in the batch):

    loglikelihood(prefix, text)
        The model reads [BOS] + prefix + text; the result is the summed log-probability
        of the text's tokens, and whether each of them was the argmax. A prefix too
        long for the context loses tokens from its left (EasyLM's truncation side);
        a text that alone does not fit is an error. Without `always_bos` (a tokenizer
        that puts no BOS before text), the model reads prefix + text, and BOS only
        where the prefix is empty (the first text token needs something before it),
        as lm-evaluation-harness's `hf` model does.

    loglikelihood_rolling(text)
        For texts longer than the context (perplexity). The inputs are [BOS] + tokens,
        cut into windows of seq_length: each full window is scored on its own, and the
        tail is scored inside the last seq_length tokens, with only its new tokens counted.
        Every token is scored exactly once.

Each `*_job` function checks its input (UserError for what does not fit) and returns a
`Job`: the rows for `Engine.score` and how to turn their results into the answer, so
the batcher can score the rows a chunk at a time between decode calls (`Batcher.score`).
The functions without `_job` run one on an engine at once.
"""

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from easylm.errors import UserError
from easylm.serving.engine import Engine


@dataclasses.dataclass
class Job:
    """Rows for `Engine.score` (inputs, targets) and `finish(its results) -> answer`."""

    tokens: list[list[int]]
    targets: list[list[int]]
    finish: Callable[[list], Any]


def run(engine: Engine, job: Job):
    return job.finish(engine.score(job.tokens, job.targets) if job.tokens else [])


def summed(rows, finish) -> Job:
    """rows: (inputs, targets, first scored index); finish gets [(sum logprob, all greedy)]."""
    def sums(scored):
        return finish([(float(np.sum(lp[start:], dtype=np.float64)), bool(np.all(greedy[start:])))
                       for (_, _, start), (lp, greedy, _, _) in zip(rows, scored)])

    return Job([r[0] for r in rows], [r[1] for r in rows], sums)


def loglikelihood_job(seq_length: int, bos_id: int, pairs: Sequence[tuple[list[int], list[int]]],
                      always_bos: bool = True) -> Job:
    """[(prefix ids, text ids)] -> [(log-likelihood of text, is greedy)]."""
    rows = []
    for prefix, text in pairs:
        if len(text) > seq_length:
            raise UserError(f"a text of {len(text)} tokens does not fit the context of "
                            f"{seq_length} tokens")
        first = [bos_id] if always_bos or not prefix else []
        # Prefix tokens that fit: the inputs are everything but the last text token.
        keep = seq_length + 1 - len(first) - len(text)
        tokens = first + list(prefix)[max(0, len(prefix) - keep):] + list(text)
        # An empty text has log-likelihood 0 and is (vacuously) greedy: nothing to run.
        rows.append((tokens[:-1], tokens[1:], len(tokens) - 1 - len(text)) if text else None)

    def finish(scored):
        scored = iter(scored)
        return [next(scored) if r is not None else (0.0, True) for r in rows]

    return summed([r for r in rows if r is not None], finish)


def rolling_windows(tokens: list[int], bos_id: int, L: int):
    """The (inputs, targets, first scored index) windows of `loglikelihood_rolling`."""
    n = len(tokens)
    inputs = [bos_id] + tokens[:-1]
    windows = []
    for i in range(0, n, L):
        if i + L <= n or n <= L:
            windows.append((inputs[i:i + L], tokens[i:i + L], 0))
        else:  # the tail: score tokens i..n-1 with the L - (n - i) tokens before as context
            windows.append((inputs[n - L:], tokens[n - L:], L - (n - i)))
    return windows


def loglikelihood_rolling_job(seq_length: int, bos_id: int, texts: Sequence[list[int]]) -> Job:
    """[text ids] -> [(summed log-likelihood over all windows, all greedy)]."""
    rows, owner = [], []
    for index, tokens in enumerate(texts):
        for window in rolling_windows(list(tokens), bos_id, seq_length):
            rows.append(window)
            owner.append(index)

    def finish(sums):
        totals = [[0.0, True] for _ in texts]
        for index, (logprob, greedy) in zip(owner, sums):
            totals[index][0] += logprob
            totals[index][1] &= greedy
        return [tuple(t) for t in totals]

    return summed(rows, finish)


def prompt_logprobs_job(seq_length: int, prompts: Sequence[list[int]]) -> Job:
    """Per prompt: each token's log-probability given the tokens before it (None for the
    first), and the most likely alternatives [(id, logprob)] at each position (None first).
    This is OpenAI's `echo` + `logprobs`, which lm-evaluation-harness scores with."""
    for prompt in prompts:
        if len(prompt) > seq_length:
            raise UserError(f"the prompt has {len(prompt)} tokens, more than the context "
                            f"of {seq_length}")
    long_enough = [list(p) for p in prompts if len(p) > 1]

    def finish(scored):
        scored, out = iter(scored), []
        for prompt in prompts:
            if len(prompt) <= 1:
                out.append(([None] * len(prompt), [None] * len(prompt)))
                continue
            logprobs, _, top_ids, top_logprobs = next(scored)
            top = [list(zip(map(int, ids), map(float, lps)))
                   for ids, lps in zip(top_ids, top_logprobs)]
            out.append(([None] + [float(x) for x in logprobs], [None] + top))
        return out

    return Job([p[:-1] for p in long_enough], [p[1:] for p in long_enough], finish)


def loglikelihood(engine: Engine, bos_id: int, pairs, always_bos: bool = True):
    return run(engine, loglikelihood_job(engine.seq_length, bos_id, pairs, always_bos))


def loglikelihood_rolling(engine: Engine, bos_id: int, texts):
    return run(engine, loglikelihood_rolling_job(engine.seq_length, bos_id, texts))


def prompt_logprobs(engine: Engine, prompts):
    return run(engine, prompt_logprobs_job(engine.seq_length, prompts))
