"""The paged cache (easylm/serving/pages.py): served tokens and log-probabilities with pages
= the dense engine's for every kind of cache array, and the page book's accounting."""

import importlib

import jax
import numpy as np
import pytest

from easylm.models import paged_attention
from easylm.serving import engine as engine_lib
from easylm.serving import programs
from easylm.serving.engine import Engine, Sampling
from easylm.serving.pages import SCRATCH, PageBook
from serving_utils import GREEDY, PROMPTS, full_forward_greedy, make_batcher, tiny_config
from serving_utils import tokenizer  # noqa: F401 (a fixture)

# 2 slots of 32 positions, prompts prefilled 8 tokens at a time, 4 decode steps a call,
# one length bucket (few programs to compile); pages of 8 positions, so a prompt spans
# pages and decoding crosses page boundaries.
ENGINE = {"batch_size": 2, "seq_length": 32, "min_bucket": 32, "decode_steps": 4,
          "prefill_chunk_size": 8}
PROMPT_A = [5, 77, 300, 12, 9, 450, 31, 8, 200, 64, 3, 99, 17]  # 13 tokens: two chunks
PROMPT_B = [41, 7, 260, 88, 5, 123, 19]
PROMPT_C = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 20


def _family(name):
    return importlib.import_module(f"easylm.{name}.family").FAMILY


# Each kind of cache array: LLaMA's keys and values, a sliding window (LLaMA's, window 8:
# the prompts and decoding pass it), gpt-oss's sinks over sliding and full layers,
# DeepSeek-V3's latent, Gemma 4's keys and values stored once and shared by later layers,
# Qwen3.5's Gated DeltaNet state (per slot) beside its attention layers' keys and values.
KINDS = {
    "llama": lambda: (_family("llama"), tiny_config()),
    "sliding": lambda: (_family("llama"), tiny_config(model_type="mistral", sliding_window=8)),
    "gpt_oss": lambda: (_family("gpt_oss"), _family("gpt_oss").from_preset("debug")),
    "deepseek_v3": lambda: (_family("deepseek_v3"), _family("deepseek_v3").from_preset("debug")),
    "gemma4": lambda: (_family("gemma4"), _family("gemma4").from_preset("debug")),
    "qwen3_5": lambda: (_family("qwen3_5"), _family("qwen3_5").from_preset("debug")),
}


def _serve(engine: Engine, corrupt: bool = False):
    """A session on 2 slots: A twice prefilled together (in chunks of 8: with pages and
    sharing, the copy holds A's first page once), 8 tokens decoded, then slot 1 takes D,
    which starts with A's first page (with pages and sharing: that page, indexed, and
    only the rest run, `claim` and `prefill_after`), 4 more tokens each. Returns every
    drawn token and its log-probability. `corrupt`: after the prefill, slot 0's page table
    points one page off. D's prefill, where it runs whole, has a padding row (slot index
    B, its writes dropped) to reuse the first prefill's program."""
    vocab = engine.model.vocab_size
    a, c = ([t % vocab for t in p] for p in (PROMPT_A, PROMPT_C))
    d = a[:8] + c[:9]
    tokens, logprobs = [], []

    def take(out, slots=slice(None)):
        out = engine.fetch(out)
        tokens.append(out[0][:, slots])
        logprobs.append(out[1][:, slots])

    take(engine.prefill([a, a], [0, 1], Sampling.empty(2)))
    if corrupt:
        held = int(engine.pages.held[0])
        engine.pages.table[0, :held] = engine.pages.table[0, :held] + 1
        engine.pages.dirty = True
    for _ in range(2):
        take(engine.decode(Sampling.empty(2)))
    start = engine.claim(1, 32, d)
    if start:
        take(engine.prefill_after([d], [1], [start], Sampling.empty(1)), slice(0, 1))
    else:
        take(engine.prefill([d, a], [1, 2], Sampling.empty(2)), slice(0, 1))
    take(engine.decode(Sampling.empty(2)))
    return [np.concatenate([x.reshape(-1) for x in xs]) for xs in (tokens, logprobs)], start


# The three slowest to compile are `extended` (CI's time budget leaves them out): their
# cache kinds (sinks, a latent, shared K/V) only change what the gathered window holds.
EXTENDED = ("gpt_oss", "deepseek_v3", "gemma4")


@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.extended)
                                        if k in EXTENDED else k for k in KINDS])
def kind(request):
    family, config = KINDS[request.param]()
    model = family.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    dense = _serve(Engine(ENGINE, model, params))
    return request.param, model, params, dense


def test_pages_serve_what_the_dense_cache_serves(kind, monkeypatch):
    """Same greedy tokens; log-probabilities equal to fp32 rounding: the model reads the
    same values at every position its mask admits (a gather instead of a slice, or, with
    --decode_from_pages, LLaMA's decode straight from the pages through the ragged paged
    attention's XLA path), and the masked ones weigh exactly 0; a prompt that shares
    pages (a copy in one prefill, a later prompt's first page) reads what its own would
    hold. The other tests here decode over gathered windows (--decode_from_pages off).
    XLA may fuse the programs differently (and D's rest runs as an extend, not a
    prefill), and the paged path scales scores where the dense one scales queries, so
    allow a few ulps of the fp32 log-probabilities (|logp| < ~10: 1e-5 absolute). The
    negative twin, on the same programs: slot 0's page table one page off changes what
    it draws. Qwen3.5's recurrent state cannot start mid-prompt: it shares no page (D
    runs whole), and its copies of A share the prompt's run, not its pages
    (`_share_pages`)."""
    name, model, params, ((tokens, logprobs), _) = kind
    traced = []  # decode programs that attend from the pages (traced once each)
    attend = paged_attention.decode_attention
    monkeypatch.setattr(paged_attention, "decode_attention",
                        lambda *args, **kw: traced.append(1) or attend(*args, **kw))
    engine = Engine({**ENGINE, "page_size": 8, "decode_from_pages": True}, model, params)
    (paged_tokens, paged_logprobs), start = _serve(engine)
    assert start == (0 if name == "qwen3_5" else 8)
    # Plain attention layers (LLaMA's, a sliding window's) decode straight from the
    # pool; sinks, a latent, shared K/V and a state keep their dense path.
    assert bool(traced) == (name in ("llama", "sliding")), (name, len(traced))
    assert engine.layout.direct == (name in ("llama", "sliding", "gpt_oss", "gemma4"))
    np.testing.assert_array_equal(paged_tokens, tokens)
    np.testing.assert_allclose(paged_logprobs, logprobs, atol=1e-5, rtol=0)
    assert engine.pages.in_use > 0 and not engine.pages.dirty
    # Sharing off (read at `reset` and each prefill: the same programs), every prompt in
    # pages of its own: the dense engine's tokens too.
    engine.config.share_prompts = False
    engine.reset()
    (alone_tokens, alone_logprobs), alone_start = _serve(engine)
    assert alone_start == 0
    np.testing.assert_array_equal(alone_tokens, tokens)
    np.testing.assert_allclose(alone_logprobs, logprobs, atol=1e-5, rtol=0)
    engine.config.share_prompts = True
    engine.reset()
    (_, bad_logprobs), _ = _serve(engine, corrupt=True)
    assert np.abs(bad_logprobs - logprobs).max() > 1e-3


def test_the_batched_decode_kernel_serves_what_the_dense_cache_serves(kind, monkeypatch):
    """--decode_kernel=batched (paged_decode_kernel.py, in Pallas interpret mode here):
    the dense engine's greedy tokens, log-probabilities to fp32 rounding as above (the
    kernel's online softmax sums in another order); twin: a page table one page off.
    LLaMA only: the sliding window is the kernel's test's (test_paged_decode_kernel.py),
    the other kinds decode over a dense window."""
    name, model, params, ((tokens, logprobs), _) = kind
    if name != "llama":
        pytest.skip("the kernel's engine check runs on LLaMA (CI time)")
    monkeypatch.setattr(paged_attention, "INTERPRET", True)
    calls = []
    kernel = paged_attention.batched_decode_attention
    monkeypatch.setattr(paged_attention, "batched_decode_attention",
                        lambda *args, **kw: calls.append(1) or kernel(*args, **kw))
    engine = Engine({**ENGINE, "page_size": 8, "decode_from_pages": True,
                     "decode_kernel": "batched"}, model, params)
    (paged_tokens, paged_logprobs), _ = _serve(engine)
    assert calls  # traced into the decode program
    np.testing.assert_array_equal(paged_tokens, tokens)
    np.testing.assert_allclose(paged_logprobs, logprobs, atol=1e-5, rtol=0)
    engine.reset()
    (_, bad_logprobs), _ = _serve(engine, corrupt=True)
    assert np.abs(bad_logprobs - logprobs).max() > 1e-3


def test_a_recurrent_state_prefills_in_full(kind):
    """Gated DeltaNet's state at a page's end is not kept, so a prompt that starts with
    another's indexed pages cannot start there: Qwen3.5 shares no page (`claim` gives 0);
    attention-only caches share the full pages before the prompt's last token."""
    name, model, params, _ = kind
    engine = Engine({**ENGINE, "page_size": 8}, model, params)  # only its state compiles
    prompt = list(range(3, 23))  # 20 tokens: two full pages
    assert engine.claim(0, 24, prompt) == 0
    engine.pages.register(0, prompt)  # indexed as a prefill would (sharing on or not)
    assert engine.claim(1, 24, prompt) == (0 if name == "qwen3_5" else 16)


def test_page_book_hands_out_and_takes_back_pages():
    book = PageBook(slots=2, length=32, page_size=8, pages=6)  # 5 usable
    assert book.reserve(0, 13) and book.table[0, :2].tolist() == [1, 2]
    assert book.reserve(1, 17) and book.table[1, :3].tolist() == [3, 4, 5]
    assert not book.reserve(0, 17) and book.held[0] == 2  # one short: nothing taken
    book.release(1)
    assert book.in_use == 2 and (book.table[1] == SCRATCH).all()
    assert book.reserve(0, 32) and book.in_use == 4


def test_too_few_pages_for_one_request_is_refused():
    from easylm.errors import UserError

    with pytest.raises(UserError, match="--pages=4"):
        engine_lib.check_config(engine_lib.get_default_config(
            {"seq_length": 64, "page_size": 16, "pages": 4}))


@pytest.mark.parametrize("flags,message", [
    ({"decode_kernel": "rpa"}, "--decode_kernel=rpa needs --decode_from_pages"),
    ({"page_size": 8, "decode_from_pages": True, "decode_kernel": "fast"},
     "--decode_kernel must be one of rpa, batched, batched_vpu, got 'fast'")])
def test_a_decode_kernel_is_refused_where_it_cannot_run(flags, message):
    from easylm.errors import UserError

    with pytest.raises(UserError, match=message):
        engine_lib.check_config(engine_lib.get_default_config({"seq_length": 32, **flags}))


def test_requests_wait_for_pages_and_get_their_tokens(tokenizer, caplog, monkeypatch):
    """10 requests on 4 slots with pages for about 3 of them at once (8 pages of 8
    positions; a request holds its prompt's and 12 new tokens' pages, 2 to 5): each waits
    for finished requests' pages, none fails, each gets the tokens a full forward greedily
    gives, and every page is back in the pool at the end. Prompts are prefilled 16 tokens
    at a time, so the 24-token one is staged (a chunk per batcher step, written into its
    pages at the last). The batcher's use line (logged at every step here) says how many
    pages are held."""
    import logging
    import re

    from easylm.serving import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "USE_LOG_SECONDS", 0.0)
    batcher, model, params = make_batcher(page_size=8, pages=9, prefill_chunk_size=16)
    staged = []
    begin = batcher.engine.begin_prefill
    batcher.engine.begin_prefill = lambda *a: staged.append(1) or begin(*a)
    try:
        with caplog.at_level(logging.INFO, logger=batcher_module.log.name):
            gens = batcher.generate(PROMPTS * 2, GREEDY, tokenizer)
        held = [int(m.group(1)) for r in caplog.records
                if (m := re.search(r"(\d+) of 8 pages in use \(\d+ free\)", r.getMessage()))]
        assert held and max(held) > 0 and staged
        for g in gens:
            assert g.finish_reason == "length", g.finish_reason
            expected, _ = full_forward_greedy(model, params, g.prompt, GREEDY.max_tokens)
            assert [t.id for t in g.tokens] == expected
        assert batcher.engine.pages.in_use == 0
    finally:
        batcher.stop()


SYSTEM = [1] + list(range(40, 63))  # 24 tokens: three full pages of 8


def test_a_request_that_shares_pages_with_a_finished_one_gets_its_own_tokens(tokenizer):
    """A prompt's full pages outlive its request (indexed, unreferenced); prompts that
    start with the same 16+ tokens then take them and run only the rest (`extend`), and
    get the tokens a full forward greedily gives: one after the first finished, then
    four at once (GRPO's completions of one prompt, a repeated system prompt). The twin
    with sharing off computes every prompt whole (`cached` 0) and gets the same tokens."""
    later = [SYSTEM + [7, 8, 9], SYSTEM + [100], SYSTEM[:20], SYSTEM + [7, 8, 9], SYSTEM]
    for share in (True, False):
        batcher, model, params = make_batcher(page_size=8, share_prompts=share)
        try:
            engine = batcher.engine
            (first,) = batcher.generate([SYSTEM], GREEDY, tokenizer)
            assert engine.pages.in_use == 0 and len(engine.pages.unused) == (3 if share else 0)
            gens = batcher.generate(later[:1], GREEDY, tokenizer)
            gens += batcher.generate(later[1:], GREEDY, tokenizer)
            for g in [first] + gens:
                expected, _ = full_forward_greedy(model, params, g.prompt, GREEDY.max_tokens)
                assert [t.id for t in g.tokens] == expected, (share, g.prompt)
            # The first request computes its 24 tokens; later[i] shares 16 (SYSTEM[:20],
            # SYSTEM: pages of tokens before their last) or 24 positions.
            cached = engine.prompt_tokens["cached"]
            assert cached == (24 + 24 + 16 + 24 + 16 if share else 0), cached
            # Per request: what /v1's usage.prompt_tokens_details.cached_tokens reports.
            assert [g.cached_tokens for g in [first] + gens] == \
                ([0, 24, 24, 16, 24, 16] if share else [0] * 6)
        finally:
            batcher.stop()


def _group_rollout(engine: Engine, twin: bool = False):
    """GRPO's rollout on 8 slots: 4 completions each of PROMPT_C (20 tokens: 2 full pages
    before its last token) and PROMPT_A (13: 1), sampled with a key per row, prefilled in
    one call, then 3 decode calls. Returns (tokens, logprobs, pages in use after the
    prefill). `twin`: slot 1 (a copy of C) also takes slot 0's third page, the one C's
    last token and slot 0's new tokens are written to (what must stay private)."""
    vocab = engine.model.vocab_size
    a, c = ([t % vocab for t in p] for p in (PROMPT_A, PROMPT_C))
    sampling = Sampling.empty(8)
    sampling.keys[:] = np.arange(16, dtype=np.uint32).reshape(8, 2)
    sampling.temperature[:] = 1.0
    out = [engine.fetch(engine.prefill([c] * 4 + [a] * 4, list(range(8)), sampling))]
    in_use = engine.pages.in_use if engine.pages else None
    if twin:
        engine.pages.table[1, 2] = engine.pages.table[0, 2]
        engine.pages.dirty = True
        engine._reserve([], [])
    out += [engine.fetch(engine.decode(sampling)) for _ in range(3)]
    return (np.concatenate([o[0].reshape(-1) for o in out]),
            np.concatenate([o[1].reshape(-1) for o in out]), in_use)


def test_a_group_shares_its_prompt_pages_and_samples_what_it_samples_alone():
    """A prefill's requests with one prompt (GRPO's num_generations completions) hold its
    full pages before its last token once: 3 x 2 + 3 x 1 = 9 pages fewer than with sharing
    off, and bitwise the same sampled tokens and log-probabilities (the same programs read
    the same values; the prompt's cache written into shared pages is one row's). The
    twin: a copy that shares the page its last token and the owner's new tokens go to
    draws other tokens. One engine, sharing switched in its config: one set of programs."""
    family, config = KINDS["llama"]()
    model = family.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    engine = Engine({**ENGINE, "batch_size": 8, "page_size": 8}, model, params)
    shared = _group_rollout(engine)
    engine.config.share_prompts = False
    engine.reset()
    alone = _group_rollout(engine)
    assert shared[2] == alone[2] - 9
    for got, want in zip(shared[:2], alone[:2]):
        np.testing.assert_array_equal(got, want)
    engine.config.share_prompts = True
    engine.reset()
    twin = _group_rollout(engine, twin=True)
    assert np.abs(twin[1] - shared[1]).max() > 1e-3


def test_prefix_groups_read_a_groups_pages_once_and_sample_what_each_samples_alone(
        monkeypatch):
    """--prefix_groups (cascade attention, paged_attention.shared_prefix_attention, its
    XLA path here): the group rollout's two groups (4 copies of C on 2 shared pages, 4 of
    A on 1) attend their shared pages once a group and their own after them; the same
    sampled tokens as every slot over its own table, log-probabilities to fp32 rounding
    (two softmaxes merged by log-sum-exp sum in another order). Twin: each slot of C's
    group read as its first member takes the first copy's queries over the prefix."""
    family, config = KINDS["llama"]()
    model = family.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    settings = {**ENGINE, "batch_size": 8, "page_size": 8, "decode_from_pages": True,
                "decode_kernel": "batched"}
    plain = _group_rollout(Engine(settings, model, params))
    engine = Engine({**settings, "prefix_groups": 2}, model, params)
    grouped = _group_rollout(engine)
    groups = engine.pages.shared_groups(2, 8)
    assert groups["length"].tolist() == [16, 8]
    assert groups["shared"].tolist() == [16] * 4 + [8] * 4
    np.testing.assert_array_equal(grouped[0], plain[0])
    np.testing.assert_allclose(grouped[1], plain[1], atol=1e-5, rtol=0)
    shared_groups = PageBook.shared_groups

    def first_member(book, *args):
        out = shared_groups(book, *args)
        out["member"][:4] = 0
        return out
    monkeypatch.setattr(PageBook, "shared_groups", first_member)
    engine.reset()
    twin = _group_rollout(engine)
    assert np.abs(twin[1] - plain[1]).max() > 1e-3


def test_prefix_groups_are_refused_without_a_kernel_that_merges():
    from easylm.errors import UserError

    with pytest.raises(UserError, match="--prefix_groups needs --decode_kernel=batched"):
        engine_lib.check_config(engine_lib.get_default_config(
            {"seq_length": 64, "page_size": 16, "decode_from_pages": True,
             "decode_kernel": "rpa", "prefix_groups": 4}))


def _long_generation(engine: Engine):
    """PROMPT_A and PROMPT_B on 2 slots, then 4 decode calls of 4 greedy tokens (to
    position 30 of 32). Returns (tokens, logprobs, the most pages one slot held after a
    decode call's pages were given)."""
    vocab = engine.model.vocab_size
    a, b = ([t % vocab for t in p] for p in (PROMPT_A, PROMPT_B))
    out, most = [engine.fetch(engine.prefill([a, b], [0, 1], Sampling.empty(2)))], 0
    for _ in range(4):
        call = engine.decode(Sampling.empty(2))
        if engine.pages:
            most = max(most, int((engine.pages.held - engine.pages.dropped).max()))
        out.append(engine.fetch(call))
    return (np.concatenate([o[0].reshape(-1) for o in out]),
            np.concatenate([o[1].reshape(-1) for o in out]), most)


def test_a_sliding_window_gives_back_the_pages_it_has_passed():
    """Mistral's window of 8 on pages of 4 (every layer windowed: `Model.cache_reach` 8):
    before a decode call of 4 steps from position p, a slot gives back its pages wholly
    below p - 7, so it holds at most ceil((8 - 1 + 4) / 4) + 1 = 4 pages however long it
    generates. The twin keeps every page (the engine's model with no reach declared: 8
    pages by position 30) and draws bitwise the same tokens and log-probabilities (the
    same programs; the window's mask weighs the given-back positions 0 as it weighs the
    kept ones), which are the dense engine's (`test_pages_serve_what_the_dense_cache_serves`)."""
    import dataclasses

    family, config = KINDS["sliding"]()
    model = family.bind(config)
    assert model.cache_reach == 8 and family.bind(tiny_config()).cache_reach == 0
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    engine = Engine({**ENGINE, "page_size": 4}, model, params)
    tokens, logprobs, most = _long_generation(engine)
    assert most <= 4
    engine.reset()
    engine.model = dataclasses.replace(model, cache_reach=0)  # only `_drop_passed` reads it
    kept_tokens, kept_logprobs, kept = _long_generation(engine)
    assert kept == 8
    np.testing.assert_array_equal(tokens, kept_tokens)
    np.testing.assert_array_equal(logprobs, kept_logprobs)


def test_a_grpo_pool_holds_what_its_groups_need_and_no_more():
    """`pages.group_pages`, the pool GRPO's one-turn rollouts get (rollouts.py
    `_pool_pages`): 8 rows in 2 groups of 4 with one prompt each, prompts of up to 20
    tokens, 12 new tokens (3 decode calls of 4 steps, `rollouts.generate` with no EOS so
    every row decodes to the end). Over every prompt length the most pages the engine
    ever holds, plus the scratch page, is the figure: enough (no rollout runs out) and
    no more (some length uses every page). Its bytes are below the dense cache's."""
    from easylm.objectives.rollouts import generate
    from easylm.serving.pages import group_pages

    family, config = KINDS["llama"]()
    model = family.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    engine = Engine({**ENGINE, "batch_size": 8, "min_bucket": 20, "page_size": 8}, model, params)
    most = 0
    for length in range(1, 21):
        engine.reset()
        prompts = [[(7 * i + group) % 300 + 3 for i in range(length)] for group in (0, 1)]
        generate(engine, [p for p in prompts for _ in range(4)], Sampling.empty(8), 12, -1)
        most = max(most, engine.pages.in_use)
    pool = group_pages(8, 4, 20, 12, 32, 8)
    assert most + 1 == pool < engine.layout.pages  # the default: every row's 4 pages
    page = sum(x.nbytes for x in jax.tree.leaves(engine.cache.pool)) // engine.layout.pages
    dense = sum(x.nbytes for x in jax.tree.leaves(model.init_cache(8, 32)))
    assert pool * page < dense


def _prompt_program_temporaries(model, params) -> dict[str, int]:
    """XLA's temporary bytes of the greedy prefill and extend programs of 4 rows of 128
    tokens (unchunked) on pages of 16 with sharing: what warm-up compiles."""
    engine = Engine({"batch_size": 4, "seq_length": 128, "min_bucket": 128,
                     "decode_steps": 1, "prefill_chunk_size": 0, "page_size": 16}, model, params)
    (rows, _), = engine._calls(*engine._dummy_prompts(128))
    calls = {"prefill": (engine._prefill_fns[False], rows),
             "extend": (engine._extend_fns[False], engine._dummy_suffixes(128))}
    return {name: fn.lower(engine.weights, engine.state, rows, engine._dummy_sampling(4, False))
            .compile().memory_analysis().temp_size_in_bytes
            for name, (fn, rows) in calls.items()}


def test_prompt_programs_make_logits_at_each_rows_last_token_only(monkeypatch):
    """A prefill or an extend draws from each row's last token only, so its head makes
    (rows, 1, V) logits, not (rows, T, V): at GRPO's shape (64 rows of 512 after shared
    pages, qwen3_0.6b's 151,936 tokens) the extend's whole logits were 21 GB of
    temporaries and did not fit a v5e. Here 4 x 128 tokens of a 16,384-token vocabulary
    over a 64-wide model: whole fp32 logits are 32 MiB.
    Twin: the head over every position again (as before), then the pick."""
    model = _family("llama").bind(tiny_config(vocab_size=16384))
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    whole = 4 * 128 * 16384 * 4
    assert max(_prompt_program_temporaries(model, params).values()) < whole / 8
    forward = programs._forward

    def every_position(*args, logits_at=None, **kwargs):
        logits, *rest = forward(*args, **kwargs)
        if logits_at is not None:
            logits = logits[np.arange(logits.shape[0]), logits_at][:, None]
        return (logits, *rest)

    monkeypatch.setattr(programs, "_forward", every_position)
    assert min(_prompt_program_temporaries(model, params).values()) >= whole


def test_a_rest_within_a_page_runs_through_a_page_long_extend(monkeypatch):
    """A prompt whose pages but the last are shared (a GRPO copy, a repeated conversation)
    runs its rest padded to one page, not to a prompt length bucket, and draws what the
    dense engine draws for the whole prompt. Twin: padded to the prompt bucket as before
    (32 positions for a 2-token rest): the same token, 4x the positions run."""
    family, config = KINDS["llama"]()
    model = family.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    engine = Engine({**ENGINE, "page_size": 8}, model, params)
    a = [t % model.vocab_size for t in PROMPT_A]
    e = a[:8] + [3, 4]  # A's first page, then a rest of 2
    dense = Engine(ENGINE, model, params)
    want = dense.fetch(dense.prefill([e], [1], Sampling.empty(1)))
    assert engine.after_buckets == [8, 32]
    padded, extend = [], engine._extend
    engine._extend = lambda *args: padded.append(args[-1]) or extend(*args)
    for twin in (False, True):
        if twin:
            monkeypatch.setattr(Engine, "after_buckets", property(lambda e: e.length_buckets))
        engine.reset()
        engine.fetch(engine.prefill([a], [0], Sampling.empty(1)))
        start = engine.claim(1, 32, e)
        assert start == 8
        got = engine.fetch(engine.prefill_after([e], [1], [start], Sampling.empty(1)))
        np.testing.assert_array_equal(got[0][:, :1], want[0][:, :1])
        np.testing.assert_allclose(got[1][:, :1], want[1][:, :1], atol=1e-5, rtol=0)
    assert padded == [8, 32]
