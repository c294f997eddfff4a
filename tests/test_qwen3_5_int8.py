"""Int8 weight-only serving (`--quantize=int8`) of Qwen3.5 dense and MoE, on tiny random
directories transformers saved (fp32; tests/test_qwen3_5_moe.py's weights): the Gated
DeltaNet's wide projections, the gated attention's, the MLPs', the experts' stacks and
the head are int8; the engine serves the int8 model's log-probabilities (a 150-token
prompt, prefilled 64 at a time, the DeltaNet state over int8 kernels); and those are the
float model's within the weights' rounding error.

Tolerances: the int8 bound, to first order: a matmul whose kernel is off by a relative eps
(the largest relative RMS rounding error of a quantized weight, as tests/test_quantize.py
measures it) is off by eps, and a chain of n such matmuls by n eps; n counts the quantized
matmuls in series on the deepest path (each layer's mixer 2: in_proj then out_proj, q/k/v
then o_proj; each MLP 2; the head 1). tests/test_quantize.py's 2 eps for LLaMA at its
init is too tight here: the DeltaNet layer alone moves these logits by 3 eps (its
normalised q/k and recurrent state amplify), and the layers' errors add about in
quadrature to 4 eps of the 9 eps bound. The MoE's float expert choices are replayed
(routing is discontinuous). The engine
against the int8 forward: tests/test_qwen3_5_moe.py's fp32 `rel_of`, twice the largest
logit for a log-probability."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_qwen3_5_moe import rel_of, torch_model
from test_quantize import relative

from easylm.qwen3_5.family import FAMILY
from easylm.runtime.sharding import make_mesh
from easylm.serving import scoring
from easylm.serving.engine import Engine
from easylm.variants import quantize
from easylm.variants.lora import dequantize, flat, nested

T = 150
PROMPT = [int(t) for t in np.random.RandomState(0).randint(3, 512, T)]
ENGINE = {"batch_size": 1, "seq_length": 160, "decode_steps": 4, "prefill_chunk_size": 64}


@pytest.fixture(scope="module", params=("debug", "debug_moe"))
def served(request, tmp_path_factory):
    """(config, float params, the int8 Model and its params) of a two-layer model (one
    Gated DeltaNet, one full attention) read from a directory transformers saved."""
    config = FAMILY.from_preset(request.param, num_hidden_layers=2, full_attention_interval=2)
    directory = tmp_path_factory.mktemp(request.param)
    torch_model(config).save_pretrained(directory)
    config = FAMILY.hf.read_config(str(directory))
    params = FAMILY.hf.read_params(str(directory), config)
    model = quantize.int8_variant(FAMILY, config, jnp.float32, FAMILY.bind(config))
    int8 = quantize.Int8Model(FAMILY.module_class(config.unfused(), dtype=jnp.float32,
                                                  param_dtype=jnp.float32))
    quantized = int8.quantize_sharded(params, FAMILY.partition_rules(config),
                                      make_mesh("1,1,-1"))
    return config, params, model, quantized


def test_served_int8_logprobs_are_the_float_models_within_the_rounding(served):
    config, params, model, quantized = served
    q, p = flat(quantized), flat(params)
    int8 = sorted(path for path, leaf in q.items() if hasattr(leaf, "array"))
    for name in ("linear_attn/in_proj_qkv", "linear_attn/in_proj_z", "linear_attn/out_proj",
                 "self_attn/q_proj", "self_attn/o_proj", "lm_head"):
        assert any(name in path for path in int8), name
    assert all(q[path].array.qvalue.dtype == jnp.int8 for path in int8)
    # the DeltaNet's 3, the attention's 4, each MLP's 3 (and the MoE's 3 stacks), the head
    assert len(int8) == 3 + 4 + 2 * (6 if config.num_experts else 3) + 1
    eps = max(relative(dequantize(q[path]), p[path]) for path in int8)
    assert 0.003 < eps < 0.01  # the uniform-rounding estimate for Gaussian weights

    ids = jnp.asarray([PROMPT])
    float_out = FAMILY.bind(config).forward(params, ids, router_stats=bool(config.num_experts))
    routing = float_out.router_stats.experts if config.num_experts else None
    reference = float_out.logits
    got = model.forward(quantized, ids, routing=routing).logits
    bound = (4 * config.num_hidden_layers + 1) * eps
    assert relative(got, reference) <= bound
    # The bound catches a wrong scale: the DeltaNet out_proj's 10% off.
    path = "model/layers/0/linear_attn/out_proj/kernel"
    wrong = {**q, path: q[path].replace(array=q[path].array.replace(
        scale=q[path].array.scale * 1.1))}
    assert relative(model.forward(nested(wrong), ids, routing=routing).logits,
                    reference) > bound

    # The engine serves the int8 model (routed anew, as the forward without replay).
    ((logps, _),) = scoring.prompt_logprobs(Engine(ENGINE, model, quantized), [PROMPT])
    logits = model.forward(quantized, ids).logits[0]
    expected = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(T - 1), PROMPT[1:]]
    atol = 2 * rel_of(config) * float(jnp.abs(logits).max())
    np.testing.assert_allclose(np.array(logps[1:]), expected, rtol=0, atol=atol)
    # ... and it is quantized: the float model's log-probabilities are further off.
    floats = np.asarray(jax.nn.log_softmax(reference[0], -1))[np.arange(T - 1), PROMPT[1:]]
    assert np.abs(floats - expected).max() > 10 * atol
