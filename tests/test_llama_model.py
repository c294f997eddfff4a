import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util
from llama_variants import VARIANTS, hf_variant, variant_config
from numerics import EPS_BF16, assert_close, assert_differs, forward_rel, fp32_rel
from transformers import LlamaForCausalLM as HFLlama
from transformers.masking_utils import sliding_window_causal_mask_function

from easylm.llama.config import LLaMAConfig
from easylm.models.remat import NAMES as REMAT_POLICIES
from easylm.llama.hf import from_hf, to_hf
from easylm.llama.model import LLaMAForCausalLM
from easylm.models.attention import causal_mask, segment_mask, xla_attention
from easylm.models.decoder import stack_layers, unstack_layers

# Larger-than-default init so attention is peaked and a wrong rotary angle or
# mask shows up far above the tolerance.
PARITY_CONFIGS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "tied": dict(tie_word_embeddings=True),
    # Positions run to 95, past original_max_position_embeddings=32.
    "llama3_rope": dict(rope_scaling_type="llama3", rope_scaling_factor=8.0,
                        rope_original_max_position_embeddings=32, rope_theta=500000.0),
}


def hf_model(config):
    torch.manual_seed(0)
    return HFLlama(config.to_hf_config()).eval()


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_logits_match_hf(name):
    config = LLaMAConfig.from_preset("debug", initializer_range=0.2, **PARITY_CONFIGS[name])
    hf = hf_model(config)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 96))
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    params = from_hf(hf.state_dict(), config)
    logits = LLaMAForCausalLM(config).apply({"params": params}, jnp.asarray(ids))
    assert np.abs(expected).max() > 1.0  # a real signal, not near-zero logits
    # torch and XLA: the same sums in other orders (observed: 2-3e-6 of the scale).
    assert_close(logits, expected, forward_rel(config, 96))


def test_parity_test_detects_a_wrong_rope():
    # The parity check above must be able to fail: a different rope_theta changes logits.
    config = LLaMAConfig.from_preset("debug", initializer_range=0.2)
    hf = hf_model(config)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (1, 96))
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    params = from_hf(hf.state_dict(), config)
    wrong = LLaMAForCausalLM(config.replace(rope_theta=20000.0)).apply({"params": params}, jnp.asarray(ids))
    assert_differs(wrong, expected, forward_rel(config, 96))


def test_hf_weight_mapping_round_trip():
    config = LLaMAConfig.from_preset("debug", tie_word_embeddings=True)
    state = hf_model(config).state_dict()
    back = dict(to_hf(from_hf(state, config), config))
    assert set(back) == set(state) - {"lm_head.weight"}  # tied: HF lists the shared tensor twice
    for key, tensor in back.items():
        np.testing.assert_array_equal(tensor, state[key].numpy())
    # Scanned parameters map to the same HF tensors.
    scanned = config.replace(scan_layers=True)
    back_scanned = dict(to_hf(from_hf(state, scanned), scanned))
    for key, tensor in back_scanned.items():
        np.testing.assert_array_equal(tensor, state[key].numpy())


def loss_and_grads(config, params, ids, segment_ids=None):
    model = LLaMAForCausalLM(config)

    def loss_fn(params):
        logits = model.apply({"params": params}, ids, segment_ids=segment_ids).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean(), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return loss, logits, grads


@pytest.fixture(scope="module")
def reference():
    config = LLaMAConfig.from_preset("debug", initializer_range=0.2, attention="xla")
    params = LLaMAForCausalLM(config).init_params(jax.random.PRNGKey(1))
    ids = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (2, 32)))
    segment_ids = jnp.asarray(np.repeat([[0] * 10 + [1] * 22], 2, axis=0))
    return config, params, ids, segment_ids, loss_and_grads(config, params, ids)


@pytest.mark.parametrize(
    "attention, remat_policy, scan_layers",
    [(a, "none", False) for a in ("dot_product", "auto")]
    + list(itertools.product(["xla"], [p for p in REMAT_POLICIES if p != "none"], [False, True]))
    + [("xla", "none", True), ("auto", "checkpoint_dots", True)],
)
def test_implementations_give_the_same_numbers(reference, attention, remat_policy, scan_layers):
    config = reference[0]
    assert_same_numbers(reference, config.replace(attention=attention, remat_policy=remat_policy,
                                                  scan_layers=scan_layers))


def assert_same_numbers(reference, variant):
    """`variant` (the reference config with implementation choices changed) gives the
    reference's logits, loss and gradients on the reference's parameters, up to the
    reordered sums of another XLA program (fused kernels block their matmuls otherwise:
    observed up to 2e-6 of the logits' scale, 3e-6 of a gradient's)."""
    config, params, ids, _, (loss, logits, grads) = reference
    if variant.scan_layers:
        params = stack_layers(params)
    loss2, logits2, grads2 = loss_and_grads(variant, params, ids)
    if variant.scan_layers:
        grads2 = unstack_layers(grads2)
    rel = forward_rel(config, ids.shape[1])
    assert_close(logits2, logits, rel)
    # A log-softmax moves by at most twice the largest logit error, and so does its mean.
    assert abs(float(loss2) - float(loss)) <= 2 * rel * float(jnp.abs(logits).max())
    for (path, g), g2 in zip(jax.tree_util.tree_leaves_with_path(grads),
                             jax.tree_util.tree_leaves(grads2)):
        assert_close(g2, g, 2 * rel, err_msg=str(path))  # backward: the depth twice


@pytest.mark.parametrize("fused_qkv, fused_mlp, scan_layers",
                         [(True, False, False), (False, True, False), (True, True, True)])
def test_fused_projections_give_the_same_numbers(reference, fused_qkv, fused_mlp, scan_layers):
    config, params = reference[:2]
    variant = config.replace(fused_qkv=fused_qkv, fused_mlp=fused_mlp, scan_layers=scan_layers)
    # Same parameter names, shapes and initial values: checkpoints and converters don't care.
    fresh = LLaMAForCausalLM(variant.replace(scan_layers=False)).init_params(jax.random.PRNGKey(1))
    for a, b in zip(jax.tree_util.tree_leaves_with_path(fresh), jax.tree_util.tree_leaves_with_path(params)):
        assert a[0] == b[0]
        np.testing.assert_array_equal(a[1], b[1])
    assert_same_numbers(reference, variant)


def test_implementation_parity_detects_a_real_difference(reference):
    # The negative twin of the two tests above: a model that computes something else
    # (another rope theta) fails the same comparison.
    with pytest.raises(AssertionError):
        assert_same_numbers(reference, reference[0].replace(rope_theta=20000.0))


def test_segment_ids_block_attention_across_documents(reference):
    config, params, ids, segment_ids, _ = reference
    model = LLaMAForCausalLM(config)
    rel = forward_rel(config, ids.shape[1])
    packed = model.apply({"params": params}, ids, segment_ids=segment_ids)
    # The second document alone, at the positions it had in the packed row.
    alone = model.apply({"params": params}, ids[:, 10:], positions=jnp.broadcast_to(jnp.arange(10, 32), (2, 22)))
    assert_close(packed[:, 10:], alone, rel)
    unmasked = model.apply({"params": params}, ids)  # the first document seen: no mask
    assert_differs(unmasked[:, 10:], alone, rel)
    for implementation in ("dot_product", "auto"):
        other = LLaMAForCausalLM(config.replace(attention=implementation))
        assert_close(other.apply({"params": params}, ids, segment_ids=segment_ids), packed, rel)


def test_gqa_reference_equals_repeated_heads():
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(2, 5, 8, 4), jnp.float32)
    k = jnp.asarray(rng.randn(2, 5, 2, 4), jnp.float32)
    v = jnp.asarray(rng.randn(2, 5, 2, 4), jnp.float32)
    mask = segment_mask(jnp.zeros((2, 5), jnp.int32))
    grouped = xla_attention(q, k, v)
    repeated = xla_attention(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2), mask)
    rel = fp32_rel(terms=5, depth=2)  # scores over head_dim 4, a weighted sum of 5 values
    assert_close(grouped, repeated, rel)
    # Query heads paired with the wrong kv heads (tiled, not repeated) must not pass.
    assert_differs(grouped, xla_attention(q, jnp.tile(k, (1, 1, 4, 1)),
                                          jnp.tile(v, (1, 1, 4, 1)), mask), rel)


def test_bf16_compute_with_fp32_params_runs_close():
    config = LLaMAConfig.from_preset("debug")
    params = LLaMAForCausalLM(config).init_params(jax.random.PRNGKey(0))
    ids = jnp.zeros((1, 16), jnp.int32)
    full = LLaMAForCausalLM(config).apply({"params": params}, ids)
    half = LLaMAForCausalLM(config, dtype=jnp.bfloat16).apply({"params": params}, ids)
    assert half.dtype == jnp.bfloat16 and jax.tree_util.tree_leaves(params)[0].dtype == jnp.float32
    # Each of the 13 reductions in sequence rounds its inputs and output to bf16 (half
    # an ulp each, accumulating in fp32): their errors add as a random walk.
    rel = math.sqrt(6 * config.num_hidden_layers + 1) * EPS_BF16
    assert_close(np.asarray(half, np.float32), full, rel)
    assert_differs(np.asarray(half, np.float32), full, forward_rel(config, 16))  # really bf16


# ------------------------------------------------------------------ LLaMA variants
# Qwen2, Qwen3, Mistral and LLaMA's own biases, each against its transformers class.


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request):
    """(name, config, our parameters from the HF model's tensors, ids, HF's logits)."""
    config = variant_config(request.param)
    hf = hf_variant(config)
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 48))
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    return request.param, config, from_hf(hf.state_dict(), config), ids, expected


@pytest.mark.parametrize("changes", [dict(attention="xla"), dict(attention="dot_product"),
                                     dict(fused_qkv=True, fused_mlp=True, scan_layers=True)])
def test_variant_logits_match_hf(variant, changes):
    _, config, params, ids, expected = variant
    implementation = config.replace(**changes)
    if implementation.scan_layers:
        params = stack_layers(params)
    logits = LLaMAForCausalLM(implementation).apply({"params": params}, jnp.asarray(ids))
    assert np.abs(expected).max() > 1.0  # a real signal, not near-zero logits
    assert_close(logits, expected, forward_rel(config, ids.shape[1]))  # reordered sums only


# A model that forgets a variant's switch: its config changes, and the parameters it no
# longer has. Each must fail the parity test above.
FORGOTTEN = {
    "llama_bias": [(dict(attention_bias=False), r"self_attn/.*/bias$"),
                   (dict(mlp_bias=False), r"mlp/.*/bias$")],
    "qwen2": [(dict(model_type="llama"), r"/bias$")],
    "qwen3": [(dict(model_type="llama"), r"/(q_norm|k_norm)/")],
    # No window, and a window one position too long (transformers' boundary, not ours).
    "mistral": [(dict(sliding_window=0), None), (dict(sliding_window=13), None)],
}


def test_variant_parity_detects_a_forgotten_switch(variant):
    name, config, params, ids, expected = variant
    flat = traverse_util.flatten_dict(params, sep="/")
    for changes, dropped in FORGOTTEN[name]:
        kept = {path: x for path, x in flat.items() if dropped is None or not re.search(dropped, path)}
        assert dropped is None or len(kept) < len(flat)
        wrong = LLaMAForCausalLM(config.replace(**changes)).apply(
            {"params": traverse_util.unflatten_dict(kept, sep="/")}, jnp.asarray(ids))
        assert_differs(wrong, expected, forward_rel(config, ids.shape[1]))


def test_fused_and_scanned_variants_give_the_same_gradients():
    # Biases and q/k norms inside the fused projections and the scanned layer: the same
    # loss and gradients (incl. the biases' and norms') as the plain model. (Forward
    # parity of every variant so is in test_variant_logits_match_hf.)
    config = variant_config("qwen3", attention="xla", attention_bias=True)
    params = hf_params_of(config)
    ids = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (2, 32)))
    reference = (config, params, ids, None, loss_and_grads(config, params, ids))
    assert_same_numbers(reference, config.replace(fused_qkv=True, fused_mlp=True, scan_layers=True))


def hf_params_of(config):
    return from_hf(hf_variant(config).state_dict(), config)


def test_sliding_window_is_transformers_and_keeps_documents_apart():
    # The boundary: our mask is transformers' own mask function, position by position.
    window, T = 3, 7
    theirs = sliding_window_causal_mask_function(window)
    expected = np.array([[bool(theirs(0, 0, torch.tensor(q), torch.tensor(kv))) for kv in range(T)]
                         for q in range(T)])
    np.testing.assert_array_equal(causal_mask(T, T, window), expected)
    # Packed documents: the second one alone equals its part of the packed row, the window
    # biting inside it (22 positions, window 8), on every implementation.
    config = variant_config("mistral", sliding_window=8, attention="xla")
    params = hf_params_of(config)
    ids = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (2, 32)))
    segment_ids = jnp.asarray(np.repeat([[0] * 10 + [1] * 22], 2, axis=0))
    rel = forward_rel(config, 32)
    model = LLaMAForCausalLM(config)
    packed = model.apply({"params": params}, ids, segment_ids=segment_ids)
    alone = model.apply({"params": params}, ids[:, 10:],
                        positions=jnp.broadcast_to(jnp.arange(10, 32), (2, 22)))
    assert_close(packed[:, 10:], alone, rel)
    no_window = LLaMAForCausalLM(config.replace(sliding_window=0))
    assert_differs(no_window.apply({"params": params}, ids, segment_ids=segment_ids)[:, 10:],
                   alone, rel)
    # dot_product: the mask given, as auto picks it off-GPU and wherever there is a mask.
    other = LLaMAForCausalLM(config.replace(attention="dot_product"))
    assert_close(other.apply({"params": params}, ids, segment_ids=segment_ids), packed, rel)
