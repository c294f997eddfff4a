"""Scoring text under the model: log-likelihood, rolling log-likelihood, is-greedy.

EasyLM's semantics, per text (so a result never depends on what else is in the batch):

    loglikelihood(prefix, text)
        The model reads [BOS] + prefix + text; the result is the summed log-probability
        of the text's tokens, and whether each of them was the argmax. A prefix too
        long for the context loses tokens from its left (EasyLM's truncation side);
        a text that alone does not fit is an error.

    loglikelihood_rolling(text)
        For texts longer than the context (perplexity). The inputs are [BOS] + tokens,
        cut into windows of seq_length: each full window is scored on its own, and the
        tail is scored inside the last seq_length tokens, with only its new tokens counted.
        Every token is scored exactly once.

Everything here runs on the batcher's thread (`Batcher.run`), between decode calls.
"""

from typing import Sequence

import numpy as np

from easylm.errors import UserError
from easylm.serving.engine import Engine


def score_rows(engine: Engine, rows):
    """rows: (inputs, targets, first scored index) -> [(sum logprob, all greedy)]."""
    if not rows:
        return []
    scored = engine.score([r[0] for r in rows], [r[1] for r in rows])
    return [(float(np.sum(lp[start:], dtype=np.float64)), bool(np.all(greedy[start:])))
            for (_, _, start), (lp, greedy, _, _) in zip(rows, scored)]


def loglikelihood(engine: Engine, bos_id: int, pairs: Sequence[tuple[list[int], list[int]]]):
    """[(prefix ids, text ids)] -> [(log-likelihood of text, is greedy)]."""
    rows = []
    for prefix, text in pairs:
        if len(text) > engine.seq_length:
            raise UserError(f"a text of {len(text)} tokens does not fit the context of "
                            f"{engine.seq_length} tokens")
        keep = engine.seq_length - len(text)  # prefix tokens that fit after BOS
        prefix = list(prefix)[max(0, len(prefix) - keep):]
        tokens = [bos_id] + prefix + list(text)
        # An empty text has log-likelihood 0 and is (vacuously) greedy: nothing to run.
        rows.append((tokens[:-1], tokens[1:], len(prefix)) if text else None)
    scored = iter(score_rows(engine, [r for r in rows if r is not None]))
    return [next(scored) if r is not None else (0.0, True) for r in rows]


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


def loglikelihood_rolling(engine: Engine, bos_id: int, texts: Sequence[list[int]]):
    """[text ids] -> [(summed log-likelihood over all windows, all greedy)]."""
    rows, owner = [], []
    for index, tokens in enumerate(texts):
        for window in rolling_windows(list(tokens), bos_id, engine.seq_length):
            rows.append(window)
            owner.append(index)
    totals = [[0.0, True] for _ in texts]
    for index, (logprob, greedy) in zip(owner, score_rows(engine, rows)):
        totals[index][0] += logprob
        totals[index][1] &= greedy
    return [tuple(t) for t in totals]


def prompt_logprobs(engine: Engine, prompts: Sequence[list[int]]):
    """Per prompt: each token's log-probability given the tokens before it (None for the
    first), and the most likely alternatives [(id, logprob)] at each position (None first).
    This is OpenAI's `echo` + `logprobs`, which lm-evaluation-harness scores with."""
    for prompt in prompts:
        if len(prompt) > engine.seq_length:
            raise UserError(f"the prompt has {len(prompt)} tokens, more than the context "
                            f"of {engine.seq_length}")
    long_enough = [list(p) for p in prompts if len(p) > 1]
    scored = iter(engine.score([p[:-1] for p in long_enough], [p[1:] for p in long_enough]))
    out = []
    for prompt in prompts:
        if len(prompt) <= 1:
            out.append(([None] * len(prompt), [None] * len(prompt)))
            continue
        logprobs, _, top_ids, top_logprobs = next(scored)
        top = [list(zip(map(int, ids), map(float, lps))) for ids, lps in zip(top_ids, top_logprobs)]
        out.append(([None] + [float(x) for x in logprobs], [None] + top))
    return out
