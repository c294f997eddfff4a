"""The Gated DeltaNet layer against transformers' Qwen3.5 and Qwen3-Next modules, and its
forms (chunked, recurrent, prefill then decode) against each other.

Tolerances (tests/numerics.py): a layer output is about eight reductions in sequence (the
input projection over D, the conv over W, the L2 norm over H, the UT solve over a chunk,
the state's sum over all T earlier tokens, its read over H, the gated norm over U, the
output projection over N U), the widest over T, so `fp32_rel(max(D, T, N U), 8)`
relative to the output's magnitude; bf16 rounds each of those eight stages' results to
2^-7 relative (`EPS_BF16`), errors that add as a random walk: sqrt(8) EPS_BF16.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from numerics import EPS_BF16, assert_close, assert_differs, fp32_rel
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from easylm.models import gated_deltanet as gdn
from easylm.models.gated_deltanet import DeltaNetState, GatedDeltaNet, GatedDeltaNetConfig

# GQA-style heads: two value heads per key head. T = 100 is past one chunk of 64 and not a
# multiple of it.
SIZES = {"hidden_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
         "num_hidden_layers": 4}
B, T = 2, 100
REL = fp32_rel(max(32, T, 4 * 8), depth=8)
LAYOUTS = {"separate": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet),
           "fused": (Qwen3NextConfig, Qwen3NextGatedDeltaNet)}


def torch_layer(layout: str):
    """A transformers layer with random weights, its decay mild (A in [0.01, 0.1], not up
    to 16 as at init) so the state carries information across chunks, and the norm's
    weight away from ones."""
    config_class, layer_class = LAYOUTS[layout]
    torch.manual_seed(0)
    layer = layer_class(config_class(**SIZES), layer_idx=0).eval()
    with torch.no_grad():
        layer.A_log.copy_(torch.empty(layer.num_v_heads).uniform_(0.01, 0.1).log())
        layer.dt_bias.normal_()
        layer.norm.weight.normal_(1.0, 0.2)
    return layer


def flax_params(layer) -> dict:
    """transformers' names -> ours: Linear weights (out, in) become kernels (in, out), the
    conv's (F, 1, W) a kernel (W, F); the rest as they are."""
    params = {}
    for name, value in layer.state_dict().items():
        value = value.detach().numpy()
        if name == "conv1d.weight":
            params["conv1d"] = {"kernel": value[:, 0, :].T}
        elif name.startswith(("in_proj", "out_proj")):
            params[name.split(".")[0]] = {"kernel": value.T}
        elif name == "norm.weight":
            params["norm"] = {"weight": value}
        else:
            params[name] = value
    return params


def flax_config(layout: str) -> GatedDeltaNetConfig:
    fields = {k: v for k, v in SIZES.items() if k != "num_hidden_layers"}
    return GatedDeltaNetConfig(**fields, rms_norm_eps=1e-6, fused_projections=layout == "fused")


def inputs(length: int = T, seed: int = 0):
    return np.random.RandomState(seed).randn(B, length, SIZES["hidden_size"]).astype(np.float32)


@functools.cache
def applier(layout: str, **module_fields):
    """One jitted apply per module variant, shared by the tests (compiles dominate)."""
    layer = GatedDeltaNet(flax_config(layout), **module_fields)
    return jax.jit(lambda p, x, state, seg: layer.apply({"params": p}, x, state, seg))


def run(layout, params, x, state=None, segment_ids=None, **module_fields):
    seg = None if segment_ids is None else jnp.asarray(segment_ids)
    return applier(layout, **module_fields)(params, jnp.asarray(x), state, seg)


@functools.cache
def reference(layout: str):
    """(transformers layer, our params, x, transformers' output)."""
    layer = torch_layer(layout)
    x = inputs()
    return layer, flax_params(layer), x, torch_apply(layer, x)


def torch_apply(layer, x, attention_mask=None):
    with torch.no_grad():
        mask = None if attention_mask is None else torch.from_numpy(attention_mask)
        return layer(torch.from_numpy(np.asarray(x)), attention_mask=mask).numpy()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parameters_match_transformers_names_and_shapes(layout):
    _, params, x, _ = reference(layout)
    init = GatedDeltaNet(flax_config(layout)).init
    ours = jax.eval_shape(init, jax.random.PRNGKey(0), jnp.asarray(x[:, :4]))["params"]
    assert jax.tree.map(np.shape, ours) == jax.tree.map(np.shape, params)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_transformers(layout):
    _, params, x, expected = reference(layout)
    out, _ = run(layout, params, x)
    assert_close(out, expected, REL)


# Bugs a conversion or the layer could have, as parameters (the compiled layer is reused):
# the conv read as a convolution instead of transformers' cross-correlation, and the decay
# lost (exp(A_log) = 0: g = 0, the state never forgets).
BUGS = {
    "conv reversed in time": lambda p: {**p, "conv1d": {"kernel": p["conv1d"]["kernel"][::-1]}},
    "decay dropped": lambda p: {**p, "A_log": np.full_like(p["A_log"], -1e30)},
}


@pytest.mark.parametrize("layout, bug", [("separate", "conv reversed in time"),
                                         ("fused", "decay dropped")])
def test_matches_transformers_negative_twin(layout, bug):
    """The same comparison fails on a real bug."""
    _, params, x, expected = reference(layout)
    out, _ = run(layout, BUGS[bug](params), x)
    assert_differs(out, expected, REL)


def random_state(seed: int = 1) -> DeltaNetState:
    """A state as a previous call could leave it: conv inputs of the projections' size,
    and a recurrent state of about a few tokens' writes."""
    state = DeltaNetState.init(B, flax_config("separate"))
    rng = np.random.RandomState(seed)
    return DeltaNetState(*(jnp.asarray(rng.randn(*s.shape).astype(np.float32) * 0.5)
                           for s in state))


def test_recurrent_form_equals_chunked_form(monkeypatch):
    """From a non-zero state, chunks of 16 over 100 tokens (the last chunk partial) give
    the token-by-token outputs and final state; dropping the decay of the state carried
    from chunk to chunk is caught."""
    _, params, x, _ = reference("separate")
    state = random_state()
    recurrent, recurrent_state = run("separate", params, x, state, form="recurrent")
    chunked, chunked_state = run("separate", params, x, state, form="chunked", chunk_size=16)
    assert_close(chunked, recurrent, REL)
    for ours, theirs in zip(chunked_state, recurrent_state):
        assert_close(ours, theirs, REL)

    terms = gdn.chunk_terms
    monkeypatch.setattr(gdn, "chunk_terms",
                        lambda *a: (*terms(*a)[:5], jnp.ones_like(terms(*a)[5])))
    wrong, _ = jax.jit(GatedDeltaNet(flax_config("separate"), form="chunked", chunk_size=16)
                       .apply)({"params": params}, jnp.asarray(x), state)
    assert_differs(wrong, recurrent, REL)


def test_gradients_of_the_two_forms_agree():
    """Training differentiates the chunked form (its masked exp, the UT inverse):
    over packed rows its parameter gradients are the token-by-token form's, within twice
    a forward's depth (a parameter's gradient sums over all B T tokens); a gradient that
    leaks across documents is caught."""
    _, params, x, _ = reference("separate")
    rel = fp32_rel(max(32, B * T, 4 * 8), depth=16)

    def grads(form):
        layer = GatedDeltaNet(flax_config("separate"), form=form, chunk_size=16)
        loss = lambda p, seg: jnp.sum(jnp.sin(layer.apply({"params": p}, x, None, seg)[0]))
        return jax.jit(jax.grad(loss))

    recurrent = grads("recurrent")(params, jnp.asarray(PACKED))
    chunked = grads("chunked")
    leaked = chunked(params, ONE_DOCUMENT)  # the same program, the rows not split
    chunked = chunked(params, jnp.asarray(PACKED))
    for ours, theirs in zip(jax.tree.leaves(chunked), jax.tree.leaves(recurrent)):
        assert_close(ours, theirs, rel)
    assert_differs(leaked["A_log"], recurrent["A_log"], rel)


def ut_system(C: int, seed: int = 0):
    """A chunk's UT system as `chunk_terms` builds it, float64 (4, C, C): beta k k^T with
    unit keys, times the decay between the tokens, its strictly lower part."""
    rng = np.random.RandomState(seed)
    k = rng.randn(4, C, 8)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0, 1, (4, C, 1))
    cum = np.cumsum(-rng.uniform(0, 0.1, (4, C)), axis=1)
    return np.tril(beta * k @ k.transpose(0, 2, 1) * np.exp(cum[:, :, None] - cum[:, None]), -1)


@pytest.mark.parametrize("C", [1, 24, 64])
def test_unit_lower_inverse_is_the_inverse(C):
    """(I + a)^-1 by block merges equals float64's inverse, for chunks of 1, 24 (padded to
    32 rows) and 64, within 2 log2(C) matmuls in sequence of C terms each; the inverse
    missing its last merge (its lower-left quarter zero) is caught."""
    a = ut_system(C)
    expected = np.linalg.inv(np.eye(C) + a)
    rel = fp32_rel(C, depth=2 * max(1, math.ceil(math.log2(C))))
    assert_close(jax.jit(gdn.unit_lower_inverse)(jnp.asarray(a, jnp.float32)), expected, rel)
    if C > 1:
        unmerged = expected.copy()
        unmerged[:, C // 2:, :C // 2] = 0
        assert_differs(unmerged, expected, rel)


def test_the_chunked_form_calls_no_lapack():
    """The chunked form's CPU program, forward and backward, is matmuls: no LAPACK call.
    XLA:CPU's LAPACK kernels hand a batch to the intra-op thread pool and wait for it, which
    deadlocked Qwen3.5 rollouts whose batch was split over 8 CPU devices (each pool thread
    running one device's program, all waiting). Negative twin: `lax.linalg.triangular_solve`,
    what the UT transform used before, lowers to such a call."""
    _, params, x, _ = reference("separate")
    layer = GatedDeltaNet(flax_config("separate"), form="chunked", chunk_size=16)
    loss = lambda p: jnp.sum(layer.apply({"params": p}, jnp.asarray(x))[0])
    assert "lapack" not in jax.jit(jax.value_and_grad(loss)).lower(params).as_text()

    a = jnp.asarray(ut_system(16), jnp.float32)
    solve = functools.partial(jax.lax.linalg.triangular_solve, left_side=True, lower=True,
                              unit_diagonal=True)
    assert "lapack" in jax.jit(solve).lower(a, a).as_text()


def decode(layout, params, x, state):
    """One call per token (the recurrent form), the state carried: outputs (B, t, D)."""
    outs = []
    for i in range(x.shape[1]):
        out, state = run(layout, params, x[:, i:i + 1], state)
        outs.append(out)
    return np.concatenate(outs, axis=1), state


def test_prefill_then_decode_equals_full_forward():
    """70 tokens prefilled (two chunks), then 6 decoded one at a time = transformers over all
    76; decoding from a state whose conv window was lost is caught."""
    layer, params, _, _ = reference("fused")
    x = inputs(76, seed=3)
    expected = torch_apply(layer, x)
    prefill, state = run("fused", params, x[:, :70])
    decoded, _ = decode("fused", params, x[:, 70:], state)
    assert_close(np.concatenate([prefill, decoded], axis=1), expected, REL)

    lost, _ = decode("fused", params, x[:, 70:], state._replace(conv=0 * state.conv))
    assert_differs(lost, expected[:, 70:], REL, scale=np.abs(expected).max())


def test_bf16_compute_stays_close():
    """bf16 activations, fp32 parameters and state: within sqrt(8) bf16 roundings of
    transformers' fp32 output, and a conv reversed in time still fails that bound."""
    _, params, x, expected = reference("separate")
    rel = math.sqrt(8) * EPS_BF16
    out, state = run("separate", params, x, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and state.recurrent.dtype == jnp.float32
    assert_close(out, expected, rel)


    wrong, _ = run("separate", BUGS["conv reversed in time"](params), x, dtype=jnp.bfloat16)
    assert_differs(wrong, expected, rel)


def continued(layer, x_real, x_next):
    """transformers' output for x_next after x_real, with x_real alone in its row."""
    return torch_apply(layer, np.concatenate([x_real, x_next])[None])[0, -1]


def alone(layer, x, segment_ids):
    """transformers' outputs with each document of each row alone in its own row, in the
    packed layout (zeros at padding), and each row's last document."""
    out = np.zeros_like(x)
    last = []
    for row, seg in enumerate(segment_ids):
        for doc in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == doc)
            out[row, where] = torch_apply(layer, x[row, where][None])[0]
        last.append(x[row, where])
    return out, last


PACKED = np.array([[1] * 37 + [2] * 63,  # the boundary inside the first chunk of 64
                   [1] * 80 + [2] * 20])  # inside the second
ONE_DOCUMENT = np.ones((B, T), np.int32)  # what the negative twins pass instead: one program


@pytest.mark.parametrize("form", ["auto", "recurrent"])  # auto: chunked at T = 100
def test_packed_documents_restart_the_state(form):
    """Each document of a packed row = transformers on it alone, the decoded token after
    the row continues its last document alone, and perturbing a token of the first
    document moves no position of the second. Without segment ids the same comparison
    fails."""
    layer, params, x, _ = reference("separate")
    expected, last = alone(layer, x, PACKED)
    out, state = run("separate", params, x, None, PACKED, form=form)
    assert_close(out, expected, REL)
    x_next = inputs(1, seed=5)
    step, _ = run("separate", params, x_next, state)
    for row in range(B):
        assert_close(step[row, 0], continued(layer, last[row], x_next[row]), REL,
                     scale=np.abs(expected).max())

    perturbed = x.copy()
    perturbed[:, 10] += 1.0
    moved, _ = run("separate", params, perturbed, None, PACKED, form=form)
    second = PACKED == 2
    assert_close(np.asarray(moved)[second], np.asarray(out)[second], 1e-6,
                 scale=np.abs(expected).max())
    assert_differs(np.asarray(moved)[~second], np.asarray(out)[~second], REL,
                   scale=np.abs(expected).max())

    leaked, _ = run("separate", params, x, None, ONE_DOCUMENT, form=form)
    assert_differs(leaked, expected, REL)


def test_padding_leaves_the_state_alone():
    """A left-padded row (transformers' attention mask zeroes it) and a right-padded one
    both equal their 60 real tokens alone, and the token decoded after each continues
    them; treating the padding as tokens is caught."""
    layer, params, x, _ = reference("separate")
    segment_ids = np.zeros((B, T), np.int32)
    segment_ids[0, 40:] = 1
    segment_ids[1, :60] = 1
    expected, real = alone(layer, x, segment_ids)
    assert_close(torch_apply(layer, x[:1], segment_ids[:1])[0, 40:], expected[0, 40:], REL)
    out, state = run("separate", params, x, None, segment_ids)
    real_positions = segment_ids > 0
    assert_close(np.asarray(out)[real_positions], expected[real_positions], REL)

    x_next = inputs(1, seed=6)
    scale = np.abs(expected).max()
    want = np.stack([continued(layer, real[row], x_next[row]) for row in range(B)])
    step, _ = run("separate", params, x_next, state)
    assert_close(step[:, 0], want, REL, scale=scale)
    _, padded_state = run("separate", params, x, None, ONE_DOCUMENT)
    wrong, _ = run("separate", params, x_next, padded_state)
    assert_differs(wrong[1, 0], want[1], REL, scale=scale)


# ------------------------------------------------------------------ the sequence split over sp

# Rows of 96 cut into 8 pieces of 12 (sp = 4): documents crossing piece boundaries, one
# starting exactly on one (48), one two tokens before one (70: the conv window of the
# piece at 72 reads one token of the document before), padding at both ends of row 0.
SPLIT_T = 96
SPLIT_SEGMENTS = np.array([[0] * 3 + [1] * 26 + [2] * 41 + [3] * 23 + [0] * 3,
                           [1] * 48 + [2] * 48])


def split_outputs(params, x, segments, order: str | None, grads: bool = True):
    """(out, parameter gradients of sum(sin(out)) or None) with the rows split over
    fsdp=2,sp=4 in `order` (`zigzag`: permuted before, un-permuted after), chunks of 8;
    order None: whole rows, one device."""
    from easylm.models.context_parallel import from_zigzag, to_zigzag
    from easylm.runtime.sharding import make_mesh

    layer = GatedDeltaNet(flax_config("separate"), chunk_size=8)
    sp = 4

    def forward(p):
        if order == "zigzag":
            out = layer.apply({"params": p}, to_zigzag(x, sp), None, to_zigzag(segments, sp),
                              order)[0]
            out = from_zigzag(out, sp)
        else:
            out = layer.apply({"params": p}, x, None, segments, order)[0]
        return jnp.sum(jnp.sin(out)), out

    step = jax.jit(jax.value_and_grad(forward, has_aux=True) if grads
                   else lambda p: (forward(p), None))
    with contextlib.ExitStack() as stack:
        if order is not None:
            stack.enter_context(jax.set_mesh(make_mesh("fsdp=2,sp=4")))
        (_, out), gradients = step(params)
    return np.asarray(out), gradients


def test_sequence_split_over_sp_equals_whole_rows(monkeypatch):
    """Under fsdp=2,sp=4 (zig-zag order) each device runs its two pieces from [0 | I] and
    composes the all-gathered (M, C) of the pieces before: outputs and parameter gradients
    are the whole rows' (the gradients within twice a forward's depth, summed over all
    B T tokens); in the row's own order the outputs too. Twins: the state entering each
    piece zeroed (the composed stack, the only (2 sp, b, N, H, U) that `_mine` picks
    from), and the conv's inputs from the piece before zeroed (its (2 sp, b, W - 1, F));
    each alone is caught."""
    _, params, x, _ = reference("separate")
    x, segments = jnp.asarray(x[:, :SPLIT_T]), jnp.asarray(SPLIT_SEGMENTS)
    expected, expected_grads = split_outputs(params, x, segments, None)
    out, grads = split_outputs(params, x, segments, "zigzag")
    assert_close(out, expected, REL)
    rel = fp32_rel(max(32, B * SPLIT_T, 4 * 8), depth=16)
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        assert_close(ours, theirs, rel)
    assert_close(split_outputs(params, x, segments, "rows", grads=False)[0], expected, REL)

    mine = gdn._mine
    for ndim in (5, 4):  # the entering states, then the conv's inputs before each piece
        monkeypatch.setattr(gdn, "_mine", lambda a, o, n=ndim: jnp.zeros_like(mine(a, o))
                            if a.ndim == n else mine(a, o))
        wrong = split_outputs(params, x, segments, "zigzag", grads=False)[0]
        print(f"zeroed ndim {ndim}: max |difference| {np.abs(wrong - expected).max():.3g}, "
              f"tolerance {REL * np.abs(expected).max():.3g}")
        assert_differs(wrong, expected, REL)


def test_pieces_shorter_than_the_conv_window_are_one_line():
    """Rows of 16 under sp=4 are pieces of 2, fewer than the conv's 3 inputs from the piece
    before: refused (a UserError, one line) before anything compiles."""
    from easylm.errors import UserError
    from easylm.runtime.sharding import make_mesh

    _, params, x, _ = reference("separate")
    layer = GatedDeltaNet(flax_config("separate"))
    with jax.set_mesh(make_mesh("fsdp=2,sp=4")), pytest.raises(UserError) as error:
        jax.eval_shape(lambda: layer.apply({"params": params}, x[:, :16], None, None, "zigzag"))
    assert str(error.value) == (
        "Gated DeltaNet under sp=4: rows of 16 tokens cut into 8 pieces of 2, shorter than "
        "the conv's 3 inputs of the piece before (linear_conv_kernel_dim=4); give longer "
        "rows or a smaller sp")
