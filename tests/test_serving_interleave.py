"""A long prompt's chunked prefill shares the device with the running streams: the batcher
runs one chunk per turn with a decode call of the running slots in between
(easylm/serving/engine.py `begin_prefill`/`prefill_step`), and nobody's tokens change."""

import itertools
import threading

import jax
import numpy as np
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import full_forward_greedy, make_batcher, tokenizer  # noqa: F401 (a fixture)

from easylm.serving.batcher import Generation, SamplingParams
from easylm.runtime.compilation import counting_compiles
from easylm.serving.engine import Engine, Sampling

CHUNK = 8
LONG = [1] + list(np.random.RandomState(2).randint(3, 300, 39))  # 40 tokens: 8 chunks of 8
SHORT = [1, 5, 9, 33]


def _decodes_between_chunks(log) -> bool:
    """Whether a decode call of the running stream comes between every two chunks."""
    chunks = [i for i, (kind, _) in enumerate(log) if kind == "chunk"]
    return len(chunks) > 1 and all(
        any(kind == "decode" and running for kind, running in log[a + 1:b])
        for a, b in itertools.pairwise(chunks))


def test_running_streams_decode_between_a_long_prompts_chunks(tokenizer):
    # SHORT fits one chunk (the 8 bucket): it is prefilled in one call.
    batcher, model, params = make_batcher(batch_size=2, decode_steps=1, min_bucket=CHUNK,
                                          prefill_chunk_size=CHUNK)
    engine, log = batcher.engine, []
    stream_slot, long_slot = [], []
    decode, prefill_step = engine.decode, engine.prefill_step

    def recorded_decode(sampling, active=None):
        active = list(active)
        log.append(("decode", bool(stream_slot) and active[stream_slot[0]]))
        # The slot being prefilled is neither sampled for nor counted as active.
        assert not (long_slot and active[long_slot[0]] and long.tokens == [])
        return decode(sampling, active)

    def recorded_step(staged):
        long_slot[:] = staged.rows.slot_ids[:1].tolist()
        out = prefill_step(staged)
        log.append(("chunk", out is not None))
        return out

    engine.decode, engine.prefill_step = recorded_decode, recorded_step
    done = [threading.Event(), threading.Event()]
    long = Generation(LONG, SamplingParams(max_tokens=6, temperature=0.0), tokenizer,
                      lambda e: (e.finish_reason or e.error) and done[1].set())

    def on_stream(event):  # the batcher's thread: the long prompt arrives mid-stream
        if not stream_slot:
            stream_slot.append(next(i for i, g in enumerate(batcher.slots) if g is stream))
            batcher.submit(long)
        if event.finish_reason or event.error:
            done[0].set()

    stream = Generation(SHORT, SamplingParams(max_tokens=24, temperature=0.0), tokenizer,
                        on_stream)
    try:
        batcher.submit(stream)
        assert done[0].wait(300) and done[1].wait(300)
    finally:
        batcher.stop()
    assert stream.finish_reason == long.finish_reason == "length"
    assert sum(kind == "chunk" for kind, _ in log) == 8
    assert _decodes_between_chunks(log)
    # Negative twin: the one-call prefill's order (all chunks, then decoding) fails the check.
    assert not _decodes_between_chunks([("decode", True)] + [("chunk", False)] * 8
                                       + [("decode", True)])
    # Nobody's tokens change: each is its own whole-sequence greedy text.
    for g in (stream, long):
        want, _ = full_forward_greedy(model, params, g.prompt, g.params.max_tokens)
        assert [t.id for t in g.tokens] == want


def test_a_staged_prefill_keeps_a_recurrent_state_while_others_decode():
    """Qwen3.5 (Gated DeltaNet: a per-slot state, no length axis): a 20-token prompt staged
    in 4 chunks while slot 0 decodes between them gives the one-call prefill's first-token
    log-probabilities and greedy text. Negative twin: a different first token (in the first
    chunk) moves them past the tolerance: the carry does carry chunk one to the end."""
    from easylm.qwen3_5.family import FAMILY

    # One Gated DeltaNet layer and one attention layer.
    config = FAMILY.from_preset("debug", initializer_range=0.2, num_hidden_layers=2,
                                full_attention_interval=2)
    model = FAMILY.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    engine = Engine({"batch_size": 2, "seq_length": 32, "decode_steps": 2,
                     "prefill_chunk_size": CHUNK, "min_bucket": 32}, model, params)
    prompt = [1] + list(np.random.RandomState(3).randint(3, config.vocab_size, 19))
    two = Sampling.empty(2)

    def run(prompt, staged):
        engine.reset()
        engine.prefill([SHORT], [0], Sampling.empty(1))
        if staged:
            job = engine.begin_prefill([prompt], [1], Sampling.empty(1))
            while (out := engine.prefill_step(job)) is None:
                engine.decode(two)  # slot 0 decodes; slot 1 is idle until the end
        else:
            out = engine.prefill([prompt], [1], Sampling.empty(1))
        tokens, _, _, top = engine.fetch(out)
        ids = [int(tokens[0, 0])]
        while len(ids) < 6:
            ids += [int(t) for t in engine.fetch(engine.decode(two))[0][:, 1]]
        return top[0, 0], ids

    assert engine.prefill_chunks(len(prompt)) == 4
    whole_top, whole_ids = run(prompt, staged=False)
    staged_top, staged_ids = run(prompt, staged=True)
    rel = fp32_rel(max(config.hidden_size, config.intermediate_size), 4 * config.num_hidden_layers)
    assert_close(staged_top, whole_top, rel)
    assert staged_ids == whole_ids
    other_top, _ = run([2] + prompt[1:], staged=True)
    assert_differs(other_top, whole_top, rel)


def test_a_staged_prefill_on_a_mesh_compiles_each_program_once():
    """On a (1, 2, 4) mesh, as the server runs: the carry keeps the cache's shardings from
    chunk to chunk (the chunk program compiles at the first chunk only), a second prompt
    compiles nothing, and the first token is the one-call prefill's. Compiles are counted
    by XLA's compile events (a jitted function's `_cache_size` read 0 for a program that
    had just run, in a CI worker; cause not found), with the persistent cache off."""
    from easylm.runtime.sharding import make_mesh

    batcher, _, _ = make_batcher(mesh=make_mesh("1,2,4"), batch_size=2, min_bucket=CHUNK,
                                 prefill_chunk_size=2 * CHUNK)
    batcher.stop()  # the engine alone
    engine = batcher.engine
    persistent = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        one_call = engine.fetch(engine.prefill([LONG], [0], Sampling.empty(1)))[0]
        engine.decode(Sampling.empty(2))  # compiled before the staged prefills
        per_call = []  # each prompt's compiles: (start, each chunk's)
        for _ in range(2):
            with counting_compiles() as started:
                staged = engine.begin_prefill([LONG], [1], Sampling.empty(1))
            chunks = []
            while True:
                with counting_compiles() as compiles:
                    out = engine.prefill_step(staged)
                chunks.append(len(compiles))
                if out is not None:
                    break
                with counting_compiles() as compiles:
                    engine.decode(Sampling.empty(2))
                assert compiles == []
            np.testing.assert_array_equal(engine.fetch(out)[0], one_call)
            per_call.append((len(started), chunks))
    finally:
        jax.config.update("jax_enable_compilation_cache", persistent)
    assert staged.chunks == 4
    (start, chunks), again = per_call
    # The first prompt: its start, its first chunk and its end (at the last chunk) compile.
    assert start >= 1 and chunks[0] >= 1 and chunks[1:-1] == [0, 0] and chunks[-1] >= 1
    assert again == (0, [0, 0, 0, 0])
