"""The generation engine: KV-cache parity with a full forward pass, HF parity, decode
windows, compiled programs, sharding."""


import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P
from llama_variants import VARIANTS, hf_variant, variant_config
from numerics import assert_close, assert_differs, forward_rel, fp32_rel
from serving_utils import (  # noqa: F401 (a fixture)
    GREEDY,
    PROMPTS,
    SHORT,
    full_forward_greedy,
    make_batcher,
    tiny_config,
    tokenizer,
)
from transformers import LlamaForCausalLM as HFLlama

from easylm.llama.hf import from_hf
from easylm.runtime.compilation import counting_compiles
from easylm.runtime.sharding import make_mesh
from easylm.serving import engine as engine_lib
from easylm.serving import sampling as sampling_lib
from easylm.serving.batcher import SamplingParams


@pytest.mark.parametrize("scan_layers, variant", [(False, None), (True, None)]
                         + [(False, name) for name in sorted(VARIANTS)])
def test_cache_logits_match_full_forward(scan_layers, variant):
    # Prefill 5 tokens, then decode one at a time; rows at different positions. The
    # variants' biases and q/k norms are random (from their HF model), Mistral's window
    # (12) is passed at position 12.
    from easylm.llama.model import LLaMAForCausalLM

    if variant is None:
        config = tiny_config(scan_layers=scan_layers, num_attention_heads=8, head_dim=8)
        params = jax.jit(LLaMAForCausalLM(config).init_params)(jax.random.PRNGKey(0))
    else:
        config = variant_config(variant)
        params = from_hf(hf_variant(config).state_dict(), config)
    model = LLaMAForCausalLM(config)
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
    if config.sliding_window:  # the window bites: without it these logits are others
        windowless = LLaMAForCausalLM(config.replace(sliding_window=0))
        assert_differs(windowless.apply({"params": params}, ids), full, forward_rel(config, 32))


def test_engine_greedy_and_logprobs_match_full_forward(served, tokenizer, logprob_atol):
    batcher, model, params = served
    gens = batcher.generate(PROMPTS, GREEDY, tokenizer)  # 5 prompts on 4 slots
    for prompt, g in zip(PROMPTS, gens):
        expected, logprobs = full_forward_greedy(model, params, prompt, GREEDY.max_tokens)
        assert [t.id for t in g.tokens] == expected
        np.testing.assert_allclose([t.logprob for t in g.tokens], logprobs,
                                   atol=logprob_atol(), rtol=0)
        assert g.finish_reason == "length"


def held(engine):
    """A decode program's `ends` and `stop` (what a state cache holds; every slot live)."""
    return np.full(engine.batch_size, np.iinfo(np.int32).max, np.int32), np.int32(-1)


def test_decode_attends_over_the_shortest_window_covering_active_slots(tokenizer, logprob_atol):
    # seq_length 64: decode calls read 16, 32 or all 64 cache positions. A short request
    # next to a long one, and a request that outlives a long one, get the same tokens as
    # a full forward pass, and short ones really ran on a short window.
    batcher, model, params = make_batcher()
    engine, lengths = batcher.engine, []
    decode = engine._decode
    engine._decode = lambda sampling, length, *held: lengths.append(length) or decode(
        sampling, length, *held)
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
        args = (engine.weights, engine.state, *held(engine),
                engine_lib.Sampling.empty(engine.batch_size))
        for unroll, fns in ((True, engine._decode_fns), (False, looped.engine._decode_fns)):
            hlo = fns[False, 16].lower(*args).as_text()
            assert ("stablehlo.while" in hlo) != unroll
    finally:
        unrolled.stop()


# The variants whose cache holds something new: Qwen3's keys normalised before they are
# cached, Mistral's window over the cache. (Biases: test_cache_logits_match_full_forward.)
@pytest.mark.parametrize("variant", [None, "qwen3", "mistral"])
def test_greedy_matches_hf_generate(tokenizer, variant):
    # The variants on two prompts (fewer programs to compile), the longest (24 tokens) and a
    # short one, then 20 new tokens: Mistral's window (12) slides throughout.
    prompts = PROMPTS
    if variant is None:
        config = tiny_config(tie_word_embeddings=True)
        torch.manual_seed(0)
        hf = HFLlama(config.to_hf_config()).eval()
    else:
        config, prompts = variant_config(variant), [PROMPTS[2], PROMPTS[0]]
        hf = hf_variant(config)
    hf.generation_config.eos_token_id = None  # compare fixed-length outputs
    hf.generation_config.pad_token_id = 0
    batcher, _, _ = make_batcher(config, params=from_hf(hf.state_dict(), config))
    try:
        gens = batcher.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0), tokenizer)
    finally:
        batcher.stop()
    for prompt, g in zip(prompts, gens):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
        assert [t.id for t in g.tokens] == out[0, len(prompt):].tolist()


def _programs(compiles) -> dict:
    """The engine's programs among `counting_compiles`' entries, counted by program
    (prefill, decode, extend, score): each (kind, window, bucket) is a compile of its
    program. (A jitted function's `_cache_size()` is not used: it read 0 for programs
    that had just run in a long CI worker.)"""
    names = (c.program.removeprefix("jit(_").removesuffix(")") for c in compiles)
    return dict(collections.Counter(n for n in names if n in PROGRAMS))


PROGRAMS = ("prefill", "decode", "extend", "score")  # the engine's jitted `_<name>`s


def _by_program(expected: dict) -> dict:
    """{(program, ...): compiles} summed per program."""
    out = collections.Counter()
    for key, n in expected.items():
        out[key[0]] += n
    return dict(out)


def _doublings(start: int, stop: int) -> list[int]:
    out = [start]
    while out[-1] < stop:
        out.append(min(2 * out[-1], stop))
    return out


@pytest.mark.parametrize("page_size, mesh_dim", [(0, "1,2,4"), (8, "1,4,2")])
def test_warmup_compiles_a_fixed_set_and_no_mix_of_requests_compiles_after(
        tokenizer, page_size, mesh_dim):
    """Warm-up compiles each program once, a set derived here from the flags (seq_length
    32, min_bucket 16, batch_size 4): prompts in length buckets 16, 32 (doubling from
    min_bucket), prefill_budget // bucket rows a call (so one program per bucket,
    whatever the number of prompts); decode windows over 16, 32 cache positions
    (doubling from max(min_bucket, seq_length / 8)); each for greedy and for sampling;
    with pages (and sharing), per page length and length bucket the extend of B rows
    that runs the rest of a prompt after the pages it shares (`prefill_after`).
    Then a random mix of requests (prompt lengths, max_tokens, shared prompts, greedy and
    sampled, more than the slots; with pages, prompts that start with a finished one's
    pages) compiles nothing at all: no program and no eager operation. Negative twins:
    the first prefill on a cold engine compiles, and so does an `extend` of other shapes
    (multi-turn episodes'), which warm-up leaves out.

    On a mesh, as the server runs: the state must not change shardings after warm-up.
    With pages the pool's heads are split over mp as the dense cache's and its pages
    whole on each device, and the greedy requests get the tokens of one device's full
    forward."""
    seq_length, min_bucket, budget = 32, 16, 40
    lengths = _doublings(min_bucket, seq_length)
    windows = _doublings(max(min_bucket, seq_length // 8), seq_length)
    # Greedy and sampling rows (the mix below has no top-k/top-p: the third kind, which
    # the server's warm-up also compiles, is left out to keep this test's compiles).
    # With pages (CI time), greedy rows only and no score programs.
    kinds = (sampling_lib.GREEDY,) + (() if page_size else (sampling_lib.SAMPLE,))
    expected = {**{("prefill", sample): len(lengths) for sample in kinds},
                **{("decode", sample, w): 1 for sample in kinds for w in windows},
                **{("extend", sample): len({page_size, *lengths}) for sample in kinds
                   if page_size},
                **({} if page_size else {("score",): len(lengths)})}
    batcher, model, params = make_batcher(
        mesh=make_mesh(mesh_dim), seq_length=seq_length, batch_size=4,
        min_bucket=min_bucket, prefill_budget=budget, page_size=page_size,
        pages=16 if page_size else 0)  # 16: pages the batch axes (fsdp 4) would divide
    try:
        engine = batcher.engine
        if page_size:  # (pages, 8, K=2, H) keys and values: K over mp=2, pages whole
            leaf = engine.cache.pool["0"]["k"]
            assert leaf.sharding.is_equivalent_to(
                NamedSharding(engine.mesh, P(None, None, "mp", None)), leaf.ndim)
        assert engine.prefill_rows == {16: 2, 32: 1}
        with counting_compiles() as programs:
            with counting_compiles() as cold:
                engine.fetch(engine.prefill([[1, 2]], [0], engine_lib.Sampling.empty(1)))
            assert cold  # the counter sees a compile
            print(engine.warmup(sample=kinds, score=not page_size))
        assert _programs(programs) == _by_program(expected)
        rs = np.random.RandomState(0)
        prompts = [[1, *rs.randint(3, 300, rs.randint(0, 28)).tolist()] for _ in range(9)]
        prompts += prompts[:3]  # shared prompts in one prefill
        # Then a prompt alone, and three that start with its full pages (a finished
        # request's: with pages, they run the rest only).
        first = [1, *rs.randint(3, 300, 19).tolist()]
        later = [first] + [first[:16] + rs.randint(3, 300, n).tolist() for n in (1, 5, 12)]
        after = []
        engine.prefill_after = lambda *a, run=engine.prefill_after: after.append(1) or run(*a)
        with counting_compiles() as compiles:
            sampled = [SamplingParams(max_tokens=int(rs.randint(1, seq_length - len(p) + 1)),
                                      temperature=float(rs.choice([0.0, 0.8])) * (
                                          len(kinds) - 1), seed=i)
                       for i, p in enumerate(prompts + later)]
            n = len(prompts)
            gens = batcher.generate(prompts, sampled[:n], tokenizer)
            gens += batcher.generate(later[:1], sampled[n:n + 1], tokenizer)
            gens += batcher.generate(later[1:], sampled[n + 1:], tokenizer)
            assert [len(g.tokens) for g in gens] == [q.max_tokens for q in sampled]
            if not page_size:
                engine.score([[1, 2, 3]] * 3 + [list(range(30))], [[2, 3, 4]] * 3 + [[0] * 30])
        assert compiles == []
        assert bool(after) == bool(page_size)  # the pages' programs ran
        for g, q in zip(gens, sampled):  # (the dense engine's: tests above)
            if page_size and q.temperature == 0:
                want, _ = full_forward_greedy(model, params, g.prompt, q.max_tokens)
                assert [t.id for t in g.tokens] == want
        with counting_compiles() as compiles:  # not among warm-up's programs
            batcher.run(lambda: engine.fetch(engine.extend(
                [[5, 6]], [0], [3], engine_lib.Sampling.empty(1)))).result()
        assert compiles
    finally:
        batcher.stop()


def test_device_programs_have_no_data_dependent_branch(served):
    # On GPU a `lax.cond` on device data copies its predicate to the host, every token:
    # whether a call samples is decided on the host instead.
    batcher, _, _ = served
    engine = batcher.engine
    for (sample, _), fn in engine._decode_fns.items():
        sampling = engine_lib.Sampling.empty(engine.batch_size)
        sampling.temperature[:] = float(sample > 0)
        hlo = fn.lower(engine.weights, engine.state, *held(engine), sampling).as_text()
        assert "conditional" not in hlo and "stablehlo.case" not in hlo
        # Only a call whose rows truncate (top-k, top-p) sorts the vocabulary.
        assert ("stablehlo.sort" in hlo) == (sample == sampling_lib.TRUNCATE)


def test_sharded_cache_serves_the_same_tokens(served, tokenizer, logprob_atol):
    batcher, _, params = served
    expected = batcher.generate(PROMPTS, GREEDY, tokenizer)
    mesh = make_mesh("2,2,2")
    sharded, _, _ = make_batcher(mesh=mesh)
    try:
        leaf = sharded.engine.cache["0"]["k"]  # (B=4, S, K=2, H)
        # Rows over the batch axes (dp, fsdp, ep; ep is 1 here), heads over mp.
        assert leaf.sharding.is_equivalent_to(
            NamedSharding(mesh, P(("dp", "fsdp"), None, "mp", None)), leaf.ndim)
        got = sharded.generate(PROMPTS, GREEDY, tokenizer)
        # Scoring's outputs are replicated: on several hosts, sharded ones would span other
        # processes' devices and jax.device_get could not read them.
        engine, ids = sharded.engine, np.ones((4, 16), np.int32)
        outputs = engine._run(engine._score_fn, engine.weights, ids, ids)
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


def _sharing_models():
    """name -> (family, config): each kind of cache the engine holds. LLaMA's K/V, a
    sliding window (Mistral's 12), gpt-oss's sinks, Qwen3.5's Gated DeltaNet state
    beside full attention, DeepSeek-V3's latent (and its experts: routing recorded),
    Gemma 4's K/V stored once for the layers that share it."""
    from easylm.deepseek_v3.family import FAMILY as DEEPSEEK_V3
    from easylm.gemma4.family import FAMILY as GEMMA4
    from easylm.gpt_oss.family import FAMILY as GPT_OSS
    from easylm.llama.family import FAMILY as LLAMA
    from easylm.qwen3_5.family import FAMILY as QWEN3_5

    return {"llama": (LLAMA, tiny_config()), "mistral": (LLAMA, variant_config("mistral")),
            "gpt_oss": (GPT_OSS, GPT_OSS.from_preset("debug", initializer_range=0.2)),
            # Fewer layers than the presets' (compile time), each kind of layer kept: a
            # Gated DeltaNet and an attention layer; a dense and an MoE layer; a sliding,
            # a full, and a sliding layer reading the first one's K/V.
            "qwen3_5": (QWEN3_5, QWEN3_5.from_preset("debug", initializer_range=0.2,
                                                     num_hidden_layers=2,
                                                     full_attention_interval=2)),
            "deepseek_v3": (DEEPSEEK_V3, DEEPSEEK_V3.from_preset("debug", initializer_range=0.2,
                                                                 num_hidden_layers=2)),
            "gemma4": (GEMMA4, GEMMA4.from_preset(
                "debug", initializer_range=0.2, num_hidden_layers=3, num_kv_shared_layers=1,
                layer_types="sliding_attention,full_attention,sliding_attention"))}


def _shared_rollout(engine, share: bool, prompts, staged: bool, wrong=False):
    """Greedy outputs of `prompts` on the engine's 8 slots (a prefill, then two decode
    calls): per call (tokens, logprobs, top ids, top logprobs[, routing]), and the
    engine's prompt-token counts. `wrong`: each shared prompt's copies are given the
    cache and logits of the next distinct prompt (the bug the comparison must catch)."""
    engine.reset()
    engine.config.share_prompts = share  # read at each prefill: one engine, its programs
    calls = engine._calls

    def misplaced(prompts, slots, *images):
        out = calls(prompts, slots, *images)
        for rows, requests in out:
            n, distinct = len(requests), int(rows.source[:len(requests)].max()) + 1
            rows.source[:n] = (rows.source[:n] + 1) % distinct
        return out

    sampling = engine_lib.Sampling.empty(8)
    slots = list(range(len(prompts)))
    engine._calls = misplaced if wrong else calls
    try:
        if staged:
            run = engine.begin_prefill(prompts, slots, sampling)
            while (first := engine.prefill_step(run)) is None:
                pass
        else:
            first = engine.prefill(prompts, slots, sampling)
    finally:
        del engine._calls
    calls = [engine.fetch(first)] + [engine.fetch(engine.decode(sampling)) for _ in range(2)]
    return calls, dict(engine.prompt_tokens)


@pytest.mark.parametrize("name, staged", [(name, False) for name in (
    "llama", "mistral", "gpt_oss", "qwen3_5", "deepseek_v3", "gemma4")]
                         + [("qwen3_5", True)])
def test_a_shared_prompt_is_prefilled_once_and_serves_what_each_copy_would(name, staged):
    # Two prompts three times each (GRPO's groups) and one alone, 7 requests: with
    # sharing their 29 distinct tokens run (2 chunks of 8 in the 16 bucket; staged: a
    # chunk per call, the server's long prompts), the other
    # 38 are copies; every request's tokens, log-probabilities (and recorded expert
    # choices) are those of the engine that prefills every copy.
    family, config = _sharing_models()[name]
    model = family.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    rs = np.random.RandomState(3)
    a, b, c = (rs.randint(3, config.vocab_size, n).tolist() for n in (13, 6, 10))
    prompts = [a, a, b, a, b, c, b]
    engine = engine_lib.Engine({"batch_size": 8, "seq_length": 32, "decode_steps": 4,
                                "min_bucket": 16, "prefill_chunk_size": 8}, model, params,
                               record_routing=model.router_loss is not None)
    dense, dense_count = _shared_rollout(engine, False, prompts, staged)
    shared, shared_count = _shared_rollout(engine, True, prompts, staged)
    assert dense_count == {"prefilled": 67, "cached": 0}
    assert shared_count == {"prefilled": 29, "cached": 38}
    # The same sums in another order: XLA's CPU matmul blocks a forward of 4 prompt rows
    # otherwise than one of 8 (logits of one row differ by ~1e-6 between the two). A
    # log-probability moves by at most twice its logits' error; these logits and
    # log-probabilities are both of order log(V), so the scale is the log-probabilities'.
    rel = 2 * fp32_rel(max(config.hidden_size, config.intermediate_size, 32),
                       12 * config.num_hidden_layers + 2)
    for d, s in zip(dense, shared):
        np.testing.assert_array_equal(s[0][:, :7], d[0][:, :7])  # tokens
        assert_close(s[1][:, :7], d[1][:, :7], rel)  # log-probabilities
        if len(d) > 4:  # each fed token's expert choices
            np.testing.assert_array_equal(s[4][:, :7], d[4][:, :7])
    if name == "llama" and not staged:
        # Negative twin: copies handed another prompt's cache and logits.
        wrong, _ = _shared_rollout(engine, True, prompts, staged, wrong=True)
        assert_differs(np.concatenate([w[1][:, :7] for w in wrong]),
                       np.concatenate([d[1][:, :7] for d in dense]), rel)


def _renamed_cache_family():
    """The test-only family whose layers keep their keys and values under other names
    ("keys", "values"): a positional cache that only its shapes declare."""
    import toy_family

    from easylm.models.decoder import Attention

    class Layer(toy_family.ParallelLayer):
        def __call__(self, x, context, positions=None, cache=None):
            inner = None if cache is None else {"k": cache["keys"], "v": cache["values"]}
            x, inner = super().__call__(x, context, positions, inner)
            return x, (None if inner is None else {"keys": inner["k"], "values": inner["v"]})

    class LM(toy_family.ToyLM):
        layer = Layer

        @classmethod
        def layer_cache(cls, config, kind, batch_size, length, dtype):
            kv = Attention.init_cache(config, batch_size, length, dtype)
            return {"keys": kv["k"], "values": kv["v"]}

    class Family(toy_family.ToyFamily):
        module_class = LM

    return toy_family.FAMILY, Family()


def test_a_positional_cache_under_other_names_is_masked_and_served_alike():
    # The decoder's masks and the engine read a cache's length by one rule (the axis
    # its shapes grow along), not by the arrays' names: the renamed family's tokens and
    # log-probabilities are the plain one's, bit for bit (the same operations).
    plain, renamed = _renamed_cache_family()
    config = plain.config_class()
    prompts = [[1, 5, 9, 33, 7], [1, *range(40, 50)]]
    served = []
    for family in (plain, renamed):
        model = family.bind(config)
        params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
        engine = engine_lib.Engine({"batch_size": 2, "seq_length": 16, "decode_steps": 3,
                                    "min_bucket": 16}, model, params)
        sampling = engine_lib.Sampling.empty(2)
        calls = [engine.fetch(engine.prefill(prompts, [0, 1], sampling))]
        calls += [engine.fetch(engine.decode(sampling)) for _ in range(2)]
        served.append([c[:2] for c in calls])  # tokens, logprobs
        assert engine.layout.length == (1,) * 4  # (B, S, K, H) keys and values, 2 layers
    for x, y in zip(*served):
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[1], y[1])
