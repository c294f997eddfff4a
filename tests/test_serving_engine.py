"""The generation engine: KV-cache parity, HF parity, sampling, stops, batching, sharding."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama
from jax.sharding import PartitionSpec as P

from easylm.llama.hf_weights import from_hf
from easylm.serving import engine as engine_lib
from easylm.serving import scoring
from easylm.serving.batcher import Generation, SamplingParams
from easylm.serving.sampling import next_tokens
from easylm.serving.text import TextStream
from easylm.sharding import make_mesh
from numerics import assert_close, assert_differs, forward_rel, logprob_atol_for
from serving_utils import log_softmax, make_batcher, make_tokenizer, tiny_config

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SHORT = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [[1, 5, 9, 33], [1, 7], [1] + list(range(40, 63)), [1, 3, 3, 3, 3], [1, 99, 100]]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def served():
    batcher, model, params = make_batcher()
    yield batcher, model, params
    batcher.stop()


@pytest.fixture(scope="module")
def logprob_atol(served):
    """Tolerance of one log-probability: the engine's programs (prefill buckets, decode
    windows, the cache) sum in other orders than a full forward pass."""
    _, model, params = served
    return logprob_atol_for(model, params)


def full_forward_greedy(model, params, prompt, steps):
    """Reference: re-run the whole sequence for every new token, no cache."""
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        logp = log_softmax(model, params, ids)[-1]
        ids.append(int(np.argmax(logp)))
        logprobs.append(float(logp[ids[-1]]))
    return ids[len(prompt):], logprobs


@pytest.mark.parametrize("scan_layers", [False, True])
def test_cache_logits_match_full_forward(scan_layers):
    # Prefill 5 tokens, then decode one at a time; rows at different positions.
    config = tiny_config(scan_layers=scan_layers, num_attention_heads=8, head_dim=8)
    from easylm.llama.model import LLaMAForCausalLM

    model = LLaMAForCausalLM(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    ids = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (2, 20)))
    full = jax.jit(model.apply)({"params": params}, ids)
    apply = jax.jit(lambda params, ids, positions, cache: model.apply(
        {"params": params}, ids, positions=positions, cache=cache))
    start = jnp.broadcast_to(jnp.arange(5), (2, 5))
    logits, cache = apply(params, ids[:, :5], start, model.init_cache(2, 32))
    pieces = [logits]
    for t in range(5, 20):
        step, cache = apply(params, ids[:, t:t + 1], jnp.full((2, 1), t), cache)
        pieces.append(step)
    assert float(jnp.abs(full).max()) > 1.0
    incremental = jnp.concatenate(pieces, 1)
    assert_close(incremental, full, forward_rel(config, 32))
    assert_differs(incremental[:, 1:], full[:, :-1], forward_rel(config, 32))  # one position off


def test_engine_greedy_and_logprobs_match_full_forward(served, tokenizer, logprob_atol):
    batcher, model, params = served
    gens = batcher.generate(PROMPTS, GREEDY, tokenizer)  # 5 prompts on 4 slots
    for prompt, g in zip(PROMPTS, gens):
        expected, logprobs = full_forward_greedy(model, params, prompt, GREEDY.max_tokens)
        assert [t.id for t in g.tokens] == expected
        np.testing.assert_allclose([t.logprob for t in g.tokens], logprobs,
                                   atol=logprob_atol(), rtol=0)
        assert g.finish_reason == "length"


def test_decode_attends_over_the_shortest_window_covering_active_slots(tokenizer, logprob_atol):
    # seq_length 64: decode calls read 16, 32 or all 64 cache positions. A short request
    # next to a long one, and a request that outlives a long one, get the same tokens as
    # a full forward pass, and short ones really ran on a short window.
    batcher, model, params = make_batcher()
    engine, lengths = batcher.engine, []
    decode = engine._decode
    engine._decode = lambda sampling, length: lengths.append(length) or decode(sampling, length)
    try:
        # Positions 3..10, and up to 14 in the call the batcher dispatches before it
        # sees the request finished: 16.
        short = batcher.generate([[1, 5, 9]], SHORT, tokenizer)
        assert set(lengths) == {16}
        lengths.clear()
        prompts = [[1, 7], [1] + list(range(40, 80))]  # the long one needs all 64
        both = batcher.generate(prompts, GREEDY, tokenizer)
        assert set(lengths) == {64}
    finally:
        batcher.stop()
    for prompt, g in zip([[1, 5, 9], *prompts], short + both):
        expected, logprobs = full_forward_greedy(model, params, prompt, len(g.tokens))
        assert [t.id for t in g.tokens] == expected
        np.testing.assert_allclose([t.logprob for t in g.tokens], logprobs,
                                   atol=logprob_atol(), rtol=0)


def test_unrolled_decode_is_the_same_program_without_a_loop(served, tokenizer, logprob_atol):
    # --decode_unroll: the same tokens and log-probabilities, greedy and sampled, from a
    # decode program with the steps laid out one after another (no while loop).
    looped, _, _ = served
    unrolled, _, _ = make_batcher(decode_unroll=True)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    try:
        for params in (GREEDY, sampled):
            want = looped.generate(PROMPTS, params, tokenizer)
            got = unrolled.generate(PROMPTS, params, tokenizer)
            for w, g in zip(want, got):
                assert [t.id for t in g.tokens] == [t.id for t in w.tokens]
                np.testing.assert_allclose([t.logprob for t in g.tokens],
                                           [t.logprob for t in w.tokens], atol=logprob_atol(),
                                           rtol=0)
        engine = unrolled.engine
        args = (engine.params, engine.state, *engine_lib.Sampling.empty(engine.batch_size).arrays())
        for unroll, fns in ((True, engine._decode_fns), (False, looped.engine._decode_fns)):
            hlo = fns[False, 16].lower(*args).as_text()
            assert ("stablehlo.while" in hlo) != unroll
    finally:
        unrolled.stop()


def test_greedy_matches_hf_generate(tokenizer):
    config = tiny_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = HFLlama(config.to_hf_config()).eval()
    hf.generation_config.eos_token_id = None  # compare fixed-length outputs
    hf.generation_config.pad_token_id = 0
    batcher, _, _ = make_batcher(config)
    batcher.engine.params = from_hf(hf.state_dict(), config)
    try:
        gens = batcher.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0), tokenizer)
    finally:
        batcher.stop()
    for prompt, g in zip(PROMPTS, gens):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
        assert [t.id for t in g.tokens] == out[0, len(prompt):].tolist()


def test_sampling_is_seeded_and_independent_of_the_batch(served, tokenizer):
    batcher, _, _ = served
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    together = batcher.generate(PROMPTS[:3], params, tokenizer)
    alone = batcher.generate(PROMPTS[:1], params, tokenizer)
    assert [t.id for t in together[0].tokens] == [t.id for t in alone[0].tokens]
    other_seed = batcher.generate(PROMPTS[:1], dataclasses.replace(params, seed=8), tokenizer)
    assert [t.id for t in other_seed[0].tokens] != [t.id for t in alone[0].tokens]
    # top_k=1 leaves only the argmax: sampling at any temperature is greedy.
    top1 = batcher.generate(PROMPTS[:1], SamplingParams(max_tokens=10, temperature=2.0, top_k=1),
                            tokenizer)
    greedy = batcher.generate(PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0.0),
                              tokenizer)
    assert [t.id for t in top1[0].tokens] == [t.id for t in greedy[0].tokens]


def test_top_k_and_top_p_restrict_the_support():
    # (top_k, top_p) per row, 300 draws each from probabilities .5 .3 .15 .05.
    settings = {"top_k=2": (2, 1.0), "top_p=0.7": (0, 0.7), "top_p=0.85": (0, 0.85),
                "off": (0, 1.0)}
    draws = 300
    rows = len(settings) * draws
    logits = jnp.log(jnp.tile(jnp.array([[0.5, 0.3, 0.15, 0.05]]), (rows, 1)))
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(0), rows))
    top_k = jnp.repeat(jnp.array([k for k, _ in settings.values()]), draws)
    top_p = jnp.repeat(jnp.array([p for _, p in settings.values()]), draws)
    tokens, *_ = jax.jit(next_tokens)(logits, keys, jnp.zeros(rows, jnp.int32), jnp.ones(rows),
                                      top_k, top_p)
    seen = {name: set(np.asarray(tokens).reshape(len(settings), draws)[i].tolist())
            for i, name in enumerate(settings)}
    assert seen == {"top_k=2": {0, 1}, "top_p=0.7": {0, 1}, "top_p=0.85": {0, 1, 2},
                    "off": {0, 1, 2, 3}}


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


def test_text_stream_matches_whole_decode_and_holds_back_stop_prefixes(tokenizer):
    text = "Héllo wörld 🙂 and ünïcödé."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer)
    pieces = []
    for token in ids:
        assert not stream.add(token)
        pieces.append(stream.take())
        assert "\ufffd" not in pieces[-1]  # half a character is never handed out
    stream.finish()
    pieces.append(stream.take(final=True))
    assert "".join(pieces) == text
    stream = TextStream(tokenizer, stop=["wör"])
    taken = ""
    for token in ids:
        stopped = stream.add(token)
        taken += stream.take()
        assert "w" not in taken  # a possible start of the stop string is held back
        if stopped:
            break
    assert stopped and taken + stream.take(final=True) == "Héllo "


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


def _compiled(engine):
    return [f._cache_size() for f in (*engine._prefill_fns.values(), *engine._decode_fns.values(),
                                      engine._score_fn)]


def test_pre_compile_covers_every_bucket(tokenizer):
    # On a mesh, as the server runs: the state must not change shardings after warm-up.
    batcher, _, _ = make_batcher(mesh=make_mesh("1,2,4"), seq_length=32, batch_size=1,
                                 min_bucket=16)
    try:
        engine = batcher.engine
        engine.warmup()
        # prefill and score: lengths 16 and 32; prefill and decode: greedy and sampling;
        # decode: over 16 or 32 cache positions.
        assert _compiled(engine) == [2, 2, 1, 1, 1, 1, 2]
        # ... and nothing compiles again when requests of every shape and kind come in.
        for temperature in (0.0, 0.8):
            batcher.generate([[1, 2, 3], [1] + list(range(20)), [1, 5]],
                             SamplingParams(max_tokens=8, temperature=temperature), tokenizer)
        engine.score([[1, 2, 3]], [[2, 3, 4]])
        assert _compiled(engine) == [2, 2, 1, 1, 1, 1, 2]
    finally:
        batcher.stop()


def test_device_programs_have_no_data_dependent_branch(served):
    # On GPU a `lax.cond` on device data copies its predicate to the host, every token:
    # whether a call samples is decided on the host instead.
    batcher, _, _ = served
    engine = batcher.engine
    for (sample, _), fn in engine._decode_fns.items():
        sampling = engine_lib.Sampling.empty(engine.batch_size)
        sampling.temperature[:] = float(sample)
        hlo = fn.lower(engine.params, engine.state, *sampling.arrays()).as_text()
        assert "conditional" not in hlo and "stablehlo.case" not in hlo
        assert ("stablehlo.sort" in hlo) == sample  # only a sampling call sorts the vocabulary


def test_sharded_cache_serves_the_same_tokens(served, tokenizer, logprob_atol):
    batcher, _, params = served
    expected = batcher.generate(PROMPTS, GREEDY, tokenizer)
    mesh = make_mesh("2,2,2")
    sharded, _, _ = make_batcher(mesh=mesh)
    try:
        leaf = sharded.engine.cache["0"]["k"]  # (B=4, S, K=2, H)
        assert leaf.sharding.spec == P(("dp", "fsdp"), None, "mp", None)
        got = sharded.generate(PROMPTS, GREEDY, tokenizer)
        # Scoring's outputs are replicated: on several hosts, sharded ones would span other
        # processes' devices and jax.device_get could not read them.
        engine, ids = sharded.engine, np.ones((4, 16), np.int32)
        outputs = engine._run(engine._score_fn, engine.params, ids, ids)
        assert all(x.sharding.is_fully_replicated for x in outputs)
    finally:
        sharded.stop()
    for a, b in zip(expected, got):
        assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
        np.testing.assert_allclose([t.logprob for t in a.tokens], [t.logprob for t in b.tokens],
                                   atol=logprob_atol(), rtol=0)


def test_fitted_spec_drops_axes_that_do_not_divide():
    mesh = make_mesh("1,2,4")
    spec = P(("dp", "fsdp"), None, "mp", None)
    assert engine_lib.fitted_spec(spec, (4, 8, 4, 16), mesh) == spec
    assert engine_lib.fitted_spec(spec, (1, 8, 2, 16), mesh) == P(None, None, None, None)


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


def test_decode_benchmark_reports_both_engines():
    from easylm.serving import bench

    config = bench.default_config()
    config.update({"batch_sizes": "2", "prompt_length": 8, "new_tokens": 8,
                   "mesh_dim": "1,-1,1", "hf": "true"})
    rows = bench.run(config)
    assert [r["batch"] for r in rows] == [2]
    for row in rows:
        assert row["easylm_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["easylm_tokens_per_s"] / row["hf_tokens_per_s"])
