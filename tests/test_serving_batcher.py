"""The batcher: stops, continuous batching, failures kept to their requests, fair turns."""

import dataclasses
import threading

import pytest
from serving_utils import GREEDY, PROMPTS, full_forward_greedy, tokenizer  # noqa: F401 (a fixture)

from easylm.serving.batcher import Generation, SamplingParams


def test_stop_tokens_strings_and_max_tokens(served, tokenizer):
    batcher, model, params = served
    expected, _ = full_forward_greedy(model, params, PROMPTS[0], 12)
    # A stop token ends the answer before it.
    (g,) = batcher.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0,
                                                        stop_token_ids=(expected[3],)), tokenizer)
    assert [t.id for t in g.tokens] == expected[:expected.index(expected[3])]
    assert g.finish_reason == "stop"
    # A stop string cuts the text before it, even when it spans tokens.
    full_text = tokenizer.decode(expected, skip_special_tokens=True)
    stop = full_text[5:8]
    (g,) = batcher.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0,
                                                        stop=(stop,)), tokenizer)
    assert g.finish_reason == "stop" and g.stream.text == full_text[:full_text.index(stop)]
    (g,) = batcher.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0), tokenizer)
    assert len(g.tokens) == 3 and g.finish_reason == "length"


def test_new_requests_join_between_decode_steps(served, tokenizer):
    """Continuous batching: a short request submitted while a long one decodes finishes first."""
    batcher, _, _ = served
    long_started, short_submitted, short_done = (threading.Event() for _ in range(3))

    def on_long(event):  # on the batcher's thread: hold it until the short one is queued
        if not long_started.is_set():
            long_started.set()
            short_submitted.wait(60)

    long = Generation(PROMPTS[0], SamplingParams(max_tokens=48, temperature=0.0), tokenizer,
                      on_long)
    short = Generation(PROMPTS[1], SamplingParams(max_tokens=2, temperature=0.0), tokenizer,
                       lambda event: event.finish_reason and short_done.set())
    batcher.submit(long)
    assert long_started.wait(60)
    batcher.submit(short)
    short_submitted.set()
    assert short_done.wait(60)
    assert short.finish_reason == "length"
    assert long.finish_reason is None and len(long.tokens) < 48  # still decoding
    batcher.cancel(long)


def test_a_failing_step_fails_its_requests_and_the_batcher_keeps_serving(served, tokenizer):
    batcher, _, _ = served
    engine = batcher.engine
    real = engine.prefill
    engine.prefill = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        (g,) = batcher.generate(PROMPTS[:1], GREEDY, tokenizer)
    finally:
        engine.prefill = real
    assert g.finish_reason == "error"
    (ok,) = batcher.generate(PROMPTS[:1], GREEDY, tokenizer)
    assert ok.finish_reason == "length"


class _BrokenTokenizer:
    def decode(self, *args, **kwargs):
        raise RuntimeError("detokenizer broke")


def test_one_requests_failure_is_its_own(served, tokenizer):
    # Three requests generate next to two that fail while taking their tokens (a client
    # handler that raises, a detokenizer that raises): the three get what they get alone.
    batcher, _, _ = served
    params = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [[t.id for t in g.tokens] for g in batcher.generate(PROMPTS[:3], params, tokenizer)]
    # Settings the device would overflow on are refused before anything is queued.
    for bad in (dict(top_k=2**31), dict(top_p=1e-39), dict(seed=2**64), dict(temperature=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            batcher.submit(Generation(PROMPTS[0], dataclasses.replace(params, **bad), tokenizer,
                                      lambda event: None))
    with pytest.raises(ValueError, match="token ids"):
        batcher.submit(Generation([1, 2**40], params, tokenizer, lambda event: None))

    finished, errors = threading.Semaphore(0), []

    def on_event(event):
        if event.finish_reason or event.error:
            errors.append(event.error)
            finished.release()

    def raising(event):
        on_event(event)
        raise RuntimeError("client handler broke")

    good = [Generation(p, params, tokenizer, on_event) for p in PROMPTS[:3]]
    bad = [Generation(PROMPTS[3], params, tokenizer, raising),
           Generation(PROMPTS[4], params, _BrokenTokenizer(), on_event)]
    for g in (good[0], bad[0], good[1], bad[1], good[2]):
        batcher.submit(g)
    for _ in range(5):
        assert finished.acquire(timeout=60)
    assert [[t.id for t in g.tokens] for g in good] == alone
    assert [g.finish_reason for g in good] == ["length"] * 3
    assert [g.finish_reason for g in bad] == ["error"] * 2
    assert sorted(e for e in errors if e) == ["RuntimeError: client handler broke",
                                              "RuntimeError: detokenizer broke"]


def test_prompts_of_different_requests_take_turns_for_slots(served, tokenizer):
    # A 12-prompt request, then a 1-prompt one, on 4 slots: the single prompt is admitted
    # with the first four, not after all twelve.
    batcher, _, _ = served
    hold, held = threading.Event(), threading.Event()
    batcher.run(lambda: (held.set(), hold.wait(60)))  # keep the batcher from admitting
    assert held.wait(60)
    order, done = [], threading.Semaphore(0)

    def on_event(name):
        return lambda event: event.finish_reason and (order.append(name), done.release())

    params = SamplingParams(max_tokens=6, temperature=0.0)
    group = object()
    for i in range(12):
        batcher.submit(Generation(PROMPTS[i % 3], params, tokenizer, on_event(f"big{i}"), group))
    batcher.submit(Generation(PROMPTS[3], params, tokenizer, on_event("single")))
    hold.set()
    for _ in range(13):
        assert done.acquire(timeout=60)
    assert "single" in order[:4], order
    assert [n for n in order if n != "single"] == [f"big{i}" for i in range(12)]


def test_a_busy_batcher_logs_the_caches_use(served, tokenizer, caplog, monkeypatch):
    """While requests run the batcher logs, every USE_LOG_SECONDS, the slots in use and
    the prompt tokens prefilled and shared; none before that much time has passed (the
    quick start's short session prints its ready line only)."""
    import logging

    from easylm.serving import batcher as batcher_module

    batcher, _, _ = served
    with caplog.at_level(logging.INFO, logger=batcher_module.log.name):
        monkeypatch.setattr(batcher_module, "USE_LOG_SECONDS", 1e9)
        batcher.generate(PROMPTS[:1], GREEDY, tokenizer)
        assert not [r for r in caplog.records if "slots in use" in r.getMessage()]
        monkeypatch.setattr(batcher_module, "USE_LOG_SECONDS", 0.0)
        batcher.generate(PROMPTS[:2], GREEDY, tokenizer)
    (line, *_) = [r.getMessage() for r in caplog.records if "slots in use" in r.getMessage()]
    assert f"of {batcher.engine.batch_size} slots in use" in line, line
    assert "prompt tokens since start" in line and "requests waiting" in line, line


def test_no_decode_call_past_every_requests_max_tokens(served, tokenizer, monkeypatch):
    """A request bound by max_tokens gets exactly the decode calls its tokens need,
    ceil((max_tokens - 1) / decode_steps) (its first token comes from the prefill), and
    the tokens it gets alone; two requests of different lengths together: the longer
    one's. Negative twin: the batcher sending a call to every occupied slot (main's rule)
    makes one call more, each time, with the same tokens: the count tells them apart."""
    batcher, model, params = served
    engine, steps = batcher.engine, batcher.engine.config.decode_steps
    expected, _ = full_forward_greedy(model, params, PROMPTS[0], 12)
    calls = []
    real = engine.decode
    monkeypatch.setattr(engine, "decode", lambda *a, **k: (calls.append(1), real(*a, **k))[1])

    def generate(lengths):
        calls.clear()
        done, gens = threading.Semaphore(0), []
        for n in lengths:
            gens.append(Generation(PROMPTS[0], SamplingParams(max_tokens=n, temperature=0.0),
                                   tokenizer, lambda e: e.finish_reason and done.release()))
        for g in gens:
            batcher.submit(g)
        for _ in gens:
            assert done.acquire(timeout=60)
        return [[t.id for t in g.tokens] for g in gens], len(calls)

    for wanting, extra in ((batcher._wanting, 0),
                           (lambda previous: [s is not None for s in batcher.slots], 1)):
        monkeypatch.setattr(batcher, "_wanting", wanting)
        for lengths in ((1,), (4,), (5,), (9,), (12,), (3, 12)):
            tokens, made = generate(lengths)
            assert tokens == [expected[:n] for n in lengths], (lengths, extra)
            needed = -(-(max(lengths) - 1) // steps)
            assert made == needed + (extra if needed else 0), (lengths, made, extra)
