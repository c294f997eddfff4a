"""Chunked prefill (easylm/serving/engine.py `_prompt_forward`): a prompt run through the
model C tokens at a time, each chunk attending over the cache so far, computes what the
whole prompt at once does, and its temporary memory grows with T, not T^2."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from llama_variants import variant_config
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import full_forward_greedy, prefill_program_bytes, tiny_config

from easylm.gemma.family import FAMILY as GEMMA
from easylm.gpt_oss.family import FAMILY as GPT_OSS
from easylm.llama.family import FAMILY as LLAMA
from easylm.llama.model import LLaMAForCausalLM
from easylm.serving import engine as engine_lib, programs
from easylm.serving.memory import serving_bytes

T, CHUNK = 40, 8  # five chunks; longer than every window below (8 or 12)
LENGTHS = (40, 27)  # the second row's last token falls inside a middle chunk


def _models():
    """name -> (family, config): LLaMA with GQA (4 heads over 2), Mistral's window of 12,
    Gemma 3's sliding (8) and global layers, gpt-oss's sliding/full layers with sinks."""
    return {
        "llama_gqa": (LLAMA, tiny_config()),
        "mistral": (LLAMA, variant_config("mistral")),
        "gemma": (GEMMA, GEMMA.from_preset("debug", initializer_range=0.2)),
        "gpt_oss": (GPT_OSS, GPT_OSS.from_preset("debug", initializer_range=0.2)),
    }


def tolerance(config) -> float:
    """Two orders of the same sums: the cache's keys are attended in one (chunk, T') block
    per chunk instead of one (T, T) block. Gemma's twelve reductions per layer (the most
    of these families, tests/gemma_utils.py) plus the head, over the widest sum."""
    terms = max(config.hidden_size, config.intermediate_size, T)
    return fp32_rel(terms, 12 * config.num_hidden_layers + 2)


def _run(model, params, tokens, chunk):
    fn = jax.jit(functools.partial(programs._prompt_forward, model, chunk, False))
    fresh, last, _ = fn((params, None), tokens, jnp.asarray(LENGTHS))
    return np.asarray(last), jax.tree.map(lambda c: np.asarray(c[..., :T, :, :]), fresh)


def _shifted(model):
    """The bug the comparison must catch: every chunk after the first starts one position
    early (an off-by-one chunk offset), overwriting the last key of the chunk before."""
    def apply(params, base, rng, collections, ids, positions=None, **kwargs):
        positions = jnp.where(positions >= CHUNK, positions - 1, positions)
        return model.apply(params, base, rng, collections, ids, positions=positions, **kwargs)
    return dataclasses.replace(model, apply=apply)


@pytest.mark.parametrize("name", ["llama_gqa", "mistral", "gemma", "gpt_oss"])
def test_chunked_prefill_equals_whole_prompt(name):
    family, config = _models()[name]
    model = family.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.RandomState(1).randint(3, config.vocab_size, (2, T)))
    whole, whole_cache = _run(model, params, tokens, 0)
    chunked, chunked_cache = _run(model, params, tokens, CHUNK)
    assert np.abs(whole).max() > 1.0
    rel = tolerance(config)
    assert_close(chunked, whole, rel)
    for c, w in zip(jax.tree.leaves(chunked_cache), jax.tree.leaves(whole_cache)):
        assert_close(c, w, rel)
    if name in ("llama_gqa", "mistral"):  # two compiles more each: on the LLaMA family only
        # The short row's last-token logits are the full forward's (no cache) at its length.
        full = model.forward(params, tokens[1:, :LENGTHS[1]]).logits[0, -1]
        assert_close(chunked[1], full, rel)
        # Negative twin: an off-by-one chunk offset moves the logits far past the tolerance.
        shifted, _ = _run(_shifted(model), params, tokens, CHUNK)
        assert_differs(shifted, whole, rel)


def test_chunked_prefill_records_each_prompt_tokens_experts():
    """Routing replay's record (GRPO): the experts each prompt token chose, (n, L, T, K),
    gathered chunk by chunk equal the whole prompt's (random routers: their top-k gaps
    are far above the chunks' rounding); the forward's own choices are the reference."""
    from easylm.llama.config import LLaMAConfig

    config = LLaMAConfig.from_preset("debug_moe", num_hidden_layers=2)
    model = LLAMA.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.RandomState(1).randint(3, config.vocab_size, (2, T)))
    recorded = {}
    for chunk in (0, CHUNK):
        fn = jax.jit(functools.partial(programs._prompt_forward, model, chunk, True))
        recorded[chunk] = np.asarray(fn((params, None), tokens, jnp.asarray(LENGTHS))[2][0])
    stats = model.forward(params, tokens, router_stats=True).router_stats
    L, _, K = stats.experts.shape
    want = np.asarray(stats.experts).reshape(L, 2, T, K).swapaxes(0, 1)
    assert recorded[CHUNK].shape == (2, L, T, K)
    np.testing.assert_array_equal(recorded[0], want)
    np.testing.assert_array_equal(recorded[CHUNK], want)
    # Twin: chunks laid out one place off (a wrong (chunks, C) -> T reshape) is caught.
    assert np.any(np.roll(recorded[CHUNK], CHUNK, axis=2) != want)


def _greedy(engine, prompt, steps):
    sampling = engine_lib.Sampling.empty(engine.batch_size)
    ids = list(engine.fetch(engine.prefill([prompt], [0], sampling))[0][0])
    while len(ids) < steps:
        ids += list(engine.fetch(engine.decode(sampling))[0][:, 0])
    return [int(i) for i in ids[:steps]]


def test_chunked_engine_generates_the_same_greedy_text():
    # Mistral (GQA: 4 heads over 2; a window of 12) with a 40-token prompt in the 64 bucket:
    # chunks of 24 (three, the last past the bucket: the padded cache is cut back to 64)
    # against the whole prompt and a cacheless reference.
    config = variant_config("mistral")
    model = LLaMAForCausalLM(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    prompt = [1] + list(np.random.RandomState(2).randint(3, config.vocab_size, T - 1))
    texts = {}
    for chunk in (0, 24):
        engine = engine_lib.Engine(engine_lib.get_default_config(
            {"batch_size": 1, "seq_length": 64, "decode_steps": 4, "prefill_chunk_size": chunk}),
            LLAMA.bind(config), params)
        texts[chunk] = _greedy(engine, prompt, 8)
    reference, _ = full_forward_greedy(model, params, prompt, 8)
    assert texts[24] == texts[0] == reference


def _temp_bytes(model, n_tokens, chunk):
    shapes = (jax.eval_shape(model.init_params, jax.random.PRNGKey(0)), None)
    fn = jax.jit(functools.partial(programs._prompt_forward, model, chunk, False))
    compiled = fn.lower(shapes, jax.ShapeDtypeStruct((1, n_tokens), jnp.int32),
                        jax.ShapeDtypeStruct((1,), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_prefill_memory_grows_linearly():
    """XLA's temporary memory of the prefill (LLaMA debug: 2 layers, 4 heads, V=512) at T
    and 4T. Whole: a layer's (N, T, T) fp32 scores and probabilities dominate (4 heads x
    2048^2 x 4 B = 64 MiB each at 2,048), so 4x the tokens cost ~16x or more. Chunked by
    128: (N, 128, T) scores, (128, V) logits and the cache grow with T, so at most ~4x.
    Measured (CPU, 512 -> 2,048 tokens): whole 8.3 -> 192.9 MiB (23x), chunked 2.1 -> 8.3
    MiB (3.9x)."""
    model = LLAMA.bind(tiny_config())
    whole = [_temp_bytes(model, t, 0) for t in (512, 2048)]
    chunked = [_temp_bytes(model, t, 128) for t in (512, 2048)]
    assert whole[1] / whole[0] > 8  # quadratic
    assert chunked[1] / chunked[0] < 4.5  # linear
    assert chunked[1] * 10 < whole[1]


def test_serving_plan_is_what_xla_compiles_for_the_engines_prefill():
    """`python -m easylm.plan --plan.serve_tokens=S` states weights + KV cache + the prompt's
    cache + one chunk's activations; against XLA's analysis of the engine's prefill program
    (arguments + outputs - aliased + temporaries; debug LLaMA, fp32, one slot, a 2,048-token
    prompt in chunks of 256). Measured: planned 20.2 MiB, XLA 18.9 MiB (1.06; at 32,768
    tokens in chunks of 512: 562.8 against 549.1 MiB). The chunk's (N, C, T') fp32 scores
    and probabilities dominate; a plan that missed either, or the cache, is off by >= 25%."""
    S, C = 2048, 256
    model = LLAMA.bind(LLAMA.from_preset("debug", max_position_embeddings=S))
    xla = prefill_program_bytes(model, S, C)
    sizes = {"dp": 1, "fsdp": 1, "sp": 1, "ep": 1, "mp": 1}
    planned = serving_bytes(model, sizes, jnp.float32, 1, S, S, C)
    assert 0.8 < planned["total"] / xla < 1.25
    # The negative twin: the unchunked prefill's plan is nowhere near this program.
    assert serving_bytes(model, sizes, jnp.float32, 1, S, S, 0)["total"] > 4 * xla


def test_plan_serve_tokens_prints_the_serving_parts(capsys):
    from easylm import plan

    with pytest.raises(SystemExit) as exit_info:
        plan.main(["plan", "--llama.base_model=debug", "--mesh_dim=1,1,1",
                   "--plan.num_devices=1", "--plan.serve_tokens=512", "--dtype=fp32",
                   "--plan.prefill_chunk_size=128", "--plan.device_memory_gib=1"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    model = LLAMA.bind(LLAMA.from_preset("debug"))
    parts = serving_bytes(model, {"dp": 1, "fsdp": 1, "sp": 1, "ep": 1, "mp": 1},
                          jnp.float32, 1, 512, 512, 128)
    for name in ("weights", "kv cache", "prompt", "chunk", "total"):
        assert name in out
    assert f"{parts['total'] / 2**20:.1f} MiB" in out
    assert "chunks of 128" in out and "fits in" in out
