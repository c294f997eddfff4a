"""Scoring: log-likelihoods of given targets, rolling windows."""

import numpy as np
import pytest
from serving_utils import full_forward_greedy, log_softmax

from easylm.serving import scoring


def test_loglikelihood_matches_a_full_forward(served, logprob_atol):
    batcher, model, params = served
    engine = batcher.engine
    prefix, text = [5, 6, 7], [8, 9]
    tokens = [1] + prefix + text
    logp = log_softmax(model, params, tokens[:-1])
    expected = float(logp[3, 8] + logp[4, 9])
    greedy_text, _ = full_forward_greedy(model, params, [1] + prefix, 2)
    (ll, is_greedy), (_, greedy_flag), (empty, empty_greedy) = batcher.run(
        scoring.loglikelihood, engine, 1, [(prefix, text), (prefix, greedy_text), (prefix, [])]
    ).result()
    assert ll == pytest.approx(expected, abs=logprob_atol(terms=2))
    assert not is_greedy and greedy_flag
    assert (empty, empty_greedy) == (0.0, True)


def test_rolling_windows_score_every_token_once():
    tokens = list(range(10, 160))  # 150 tokens, windows of 64: 64 + 64 + a 22-token tail
    windows = scoring.rolling_windows(tokens, 1, 64)
    scored = [t for inputs, targets, start in windows for t in targets[start:]]
    assert scored == tokens
    assert [len(w[0]) for w in windows] == [64, 64, 64] and windows[-1][2] == 64 - 22
    for inputs, targets, _ in windows:  # each input is the token before its target
        assert inputs[1:] == targets[:-1]
    assert windows[0][0][0] == 1  # BOS starts the first window
    assert scoring.rolling_windows([5, 6], 1, 64) == [([1, 5], [5, 6], 0)]


def test_rolling_loglikelihood_sums_its_windows(served, logprob_atol):
    batcher, model, params = served
    engine = batcher.engine  # seq_length 64
    tokens = list(np.random.RandomState(0).randint(3, 300, 100))
    expected = 0.0
    for inputs, targets, start in scoring.rolling_windows(tokens, 1, 64):
        logp = log_softmax(model, params, inputs)
        expected += float(sum(logp[i, targets[i]] for i in range(start, len(targets))))
    ((ll, _),) = batcher.run(scoring.loglikelihood_rolling, engine, 1, [tokens]).result()
    # 100 log-probabilities, each from another program than the reference's (a fixed 1e-4
    # failed on another processor: 1.4e-7 of the sum); a token scored twice or missed
    # would move it by several nats.
    assert ll == pytest.approx(expected, abs=logprob_atol(terms=len(tokens)))
