"""attention=splash (easylm/models/splash.py) in Pallas interpret mode against the xla
reference of easylm/models/attention.py in float64: outputs and gradients (q, k, v and
gpt-oss's sinks) for causal, packed, windowed, sinks, GQA and soft-capped attention, each
with a negative twin; then a LLaMA (Mistral's window, GQA, packed rows, scanned, remat)
end to end. The TPU gives the speed (docs/benchmarks.md), this the correctness.

Tolerances (tests/numerics.py): splash runs in fp32 against a float64 reference. Its
forward is three reductions in sequence (scores over H, the softmax's denominator and the
weighted sum over S, blockwise with the running max rescaling in between), hence
fp32_rel(max(S, H), 3) of the output's scale; the backward runs them again (dS, dq/dk/dv):
twice that, of each gradient's scale. A dropped mask, window, sink or cap or a wrong
kv head moves the output by a sizeable part of its scale, far above either.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from numerics import assert_close, assert_differs, forward_rel, fp32_rel

from easylm.errors import UserError
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.model import LLaMAForCausalLM
from easylm.models import splash
from easylm.models.attention import attention, resolve_implementation, xla_attention
from easylm.models.decoder import stack_layers, unstack_layers
from easylm.runtime.sharding import make_mesh
from llama_variants import variant_config

N, K, H = 4, 2, 32  # GQA: two query heads per kv head


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setattr(splash, "INTERPRET", True)
    # 128-wide blocks: a few blocks per row, so the masks' skipped blocks are exercised.
    monkeypatch.setattr(splash, "BLOCKS", (128,))


def inputs(B, T, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)]  # q, k, v, cotangent
    q, k, v, dout = (rng.normal(size=s).astype(np.float32) for s in shapes)
    return q * 2, k, v, dout  # sharper scores: a wrong mask moves more


def packed_ids(B, T, seed=0):
    """Documents of 1 to 90 tokens, then padding (id 0), as packing lays them out."""
    rng = np.random.default_rng(seed)
    ids = np.searchsorted(np.cumsum(rng.integers(1, 90, size=T)), np.arange(T), side="right")
    ids = np.broadcast_to(ids + 1, (B, T)).copy()
    ids[:, T - 5:] = 0
    return ids.astype(np.int32)


def run(fn, q, k, v, dout, sinks=None):
    """fn's output and its gradients against `dout` (and the sinks' when given)."""
    args = (q, k, v) if sinks is None else (q, k, v, sinks)
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(dout)


def reference(q, k, v, dout, mask=None, window=0, sinks=None, soft_cap=None):
    """xla_attention's output and gradients in float64."""
    with jax.enable_x64(True):
        q, k, v, dout = (jnp.asarray(x, jnp.float64) for x in (q, k, v, dout))
        sinks = None if sinks is None else jnp.asarray(sinks, jnp.float64)
        mask = None if mask is None else jnp.asarray(mask)

        def fn(q, k, v, sinks=None):
            return xla_attention(q, k, v, mask, window, sinks=sinks, soft_cap=soft_cap)
        out, grads = run(fn, q, k, v, dout, sinks)
        return np.asarray(out), [np.asarray(g) for g in grads]


def splash_and_reference(B, T, **kw):
    """(splash's (output, gradients), the float64 reference's, the inputs) under `kw`."""
    q, k, v, dout = inputs(B, T)
    sinks = kw.pop("sinks", None)
    mask = kw.pop("mask", None)

    def fn(q, k, v, sinks=None):
        return attention(q, k, v, None if mask is None else jnp.asarray(mask),
                         implementation="splash", sinks=sinks, **kw)
    extra = () if sinks is None else (sinks,)
    got = jax.jit(lambda *a: run(fn, *a))(q, k, v, dout, *extra)
    expected = reference(q, k, v, dout, mask, sinks=sinks, **kw)
    return got, expected, (q, k, v, dout)


def assert_matches(got, expected, T):
    (out, grads), (ref_out, ref_grads) = got, expected
    rel = fp32_rel(max(T, H), 3)
    assert_close(out, ref_out, rel)
    for g, ref_g, what in zip(grads, ref_grads, ("dq", "dk", "dv", "dsinks")):
        assert_close(g, ref_g, 2 * rel, err_msg=what)
    return out, rel


# Each case compiles the kernel's three passes in interpret mode (~5 s): a case holds
# several of the features, each with its own twin.


def test_packed_windowed_gqa_padded():
    # T = 300: padded to 384, three 128-blocks; a 40-key window leaves block (2, 0) wholly
    # outside (skipped); documents of 1 to 90 tokens and padding; two query heads per kv head.
    T, window, ids = 300, 40, packed_ids(1, 300)
    got, expected, (q, k, v, dout) = splash_and_reference(1, T, mask=ids, window=window)
    out, rel = assert_matches(got, expected, T)
    assert_differs(out, reference(q, k, v, dout, window=window)[0], rel)  # documents dropped
    assert_differs(out, reference(q, k, v, dout, ids)[0], rel)  # window dropped
    G = N // K  # kv head n % K instead of n // G: heads tiled, not repeated
    wrong_k, wrong_v = (np.tile(x, (1, 1, G, 1)) for x in (k, v))
    right_k, right_v = (np.repeat(x, G, axis=2) for x in (k, v))
    assert_close(out, reference(q, right_k, right_v, dout, ids, window)[0], rel)
    assert_differs(out, reference(q, wrong_k, wrong_v, dout, ids, window)[0], rel)


def test_causal_sinks_soft_cap():
    # Plain causal (no segment ids), gpt-oss's sinks (their gradient too), a soft cap.
    T, sinks, cap = 128, np.linspace(-1.0, 3.0, N).astype(np.float32), 2.0
    got, expected, (q, k, v, dout) = splash_and_reference(1, T, sinks=sinks, soft_cap=cap)
    out, rel = assert_matches(got, expected, T)
    assert_differs(out, reference(q, k, v, dout, soft_cap=cap)[0], rel)  # sinks dropped
    assert_differs(out, reference(q, k, v, dout, sinks=sinks)[0], rel)  # cap dropped


def test_sharded_rows_and_heads_equal_one_device():
    # Under a mesh the kernel runs in shard_map: rows over fsdp and ep, heads (and their
    # sinks) over mp; the sinks' gradient is summed over the row shards.
    axes = ("dp", "fsdp", "sp", "ep", "mp")
    mesh = jax.make_mesh((1, 2, 1, 2, 2), axes, axis_types=(AxisType.Auto,) * 5)
    T, ids = 128, packed_ids(4, 128)
    sinks = np.linspace(-1.0, 3.0, N).astype(np.float32)
    q, k, v, dout = inputs(4, T)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P(("dp", "fsdp", "ep"), "sp", "mp", None))
        q, k, v = (jax.device_put(x, rows) for x in (q, k, v))

        def fn(q, k, v, sinks):
            return attention(q, k, v, jnp.asarray(ids), "splash", sinks=sinks)
        got = jax.jit(lambda *a: run(fn, *a))(q, k, v, dout, sinks)
    assert_matches(got, reference(q, k, v, dout, ids, sinks=sinks), T)


def test_splash_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(splash, "INTERPRET", False)
    with pytest.raises(UserError, match="attention=splash needs a TPU"):
        LLaMAConfig.from_preset("debug", attention="splash")
    assert LLaMAConfig.from_preset("debug").attention == "auto"  # auto: no TPU, no splash


def test_llama_with_splash_equals_xla():
    # Mistral's window (8) biting inside packed documents, GQA, layers scanned under remat:
    # logits and every parameter's gradient as with attention=xla.
    config = variant_config("mistral", sliding_window=8, attention="xla")
    params = LLaMAForCausalLM(config).init_params(jax.random.PRNGKey(1))
    ids = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (2, 40)))
    segment_ids = jnp.asarray(np.repeat([[1] * 13 + [2] * 27], 2, axis=0))

    def loss_and_grads(config, params):
        model = LLaMAForCausalLM(config)

        def loss_fn(params):
            logits = model.apply({"params": params}, ids, segment_ids=segment_ids)
            logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
            return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean(), logits
        return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)

    (_, logits), grads = loss_and_grads(config, params)
    variant = config.replace(attention="splash", scan_layers=True,
                             remat_policy="nothing_saveable")
    (_, logits2), grads2 = loss_and_grads(variant, stack_layers(params))
    rel = forward_rel(config, 40)
    assert_close(logits2, logits, rel)
    for (path, g), g2 in zip(jax.tree_util.tree_leaves_with_path(grads),
                             jax.tree_util.tree_leaves(unstack_layers(grads2))):
        assert_close(g2, g, 2 * rel, err_msg=str(path))
    # The twin: the model without its window is another model.
    no_window = LLaMAForCausalLM(config.replace(sliding_window=0))
    assert_differs(no_window.apply({"params": params}, ids, segment_ids=segment_ids), logits2,
                   rel)


def test_a_cache_falls_back_with_the_same_numbers():
    # Chunked prefill over a KV cache: a (B, T, S) mask by position, which splash's static
    # masks do not take; such a call runs dot_product (xla with sinks) under any name.
    q, k = jnp.zeros((1, 4, N, H)), jnp.zeros((1, 12, K, H))
    cache_mask = jnp.ones((1, 4, 12), bool)
    assert resolve_implementation("splash", q, k, cache_mask) == "dot_product"
    assert resolve_implementation("splash", q, k, cache_mask, sinks=jnp.zeros(N)) == "xla"
    assert resolve_implementation("auto", q, q, None) == "splash"  # interpret mode: "a TPU"
    config = variant_config("mistral", sliding_window=8, attention="xla")
    params = LLaMAForCausalLM(config).init_params(jax.random.PRNGKey(1))
    ids = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (2, 24)))
    logits = {}
    for name in ("xla", "splash"):
        model = LLaMAForCausalLM(config.replace(attention=name))
        cache, chunks = model.init_cache(2, 32), []
        for start in (0, 12):  # two chunks of 12 into a cache of 32
            positions = jnp.broadcast_to(jnp.arange(start, start + 12), (2, 12))
            out, cache = model.apply({"params": params}, ids[:, start:start + 12],
                                     positions=positions, cache=cache)
            chunks.append(out)
        logits[name] = jnp.concatenate(chunks, axis=1)
    rel = forward_rel(config, 32)
    assert_close(logits["splash"], logits["xla"], rel)
    whole = LLaMAForCausalLM(config).apply({"params": params}, ids)  # no cache: the twin's base
    assert_close(logits["xla"], whole, rel)
    no_window = LLaMAForCausalLM(config.replace(sliding_window=0)).apply({"params": params}, ids)
    assert_differs(logits["splash"], no_window, rel)


def test_splash_under_sequence_parallelism_is_refused_in_one_line():
    model = FAMILY.bind(variant_config("mistral", sliding_window=8, attention="splash"))
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    with jax.set_mesh(make_mesh("fsdp=2,sp=4")), pytest.raises(UserError) as error:
        jax.eval_shape(model.forward, params, np.zeros((2, 32), np.int32))
    assert str(error.value).startswith("attention=splash under context parallelism")
