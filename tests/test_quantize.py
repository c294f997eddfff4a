"""Int8 weight-only serving (--quantize=int8): what the quantized model computes, how far
its logits are from the float model's, and the serving command with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from serving_utils import make_tokenizer
from transformers import LlamaForCausalLM as HFLlama

from easylm import flags as flag_lib
from easylm.errors import UserError
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM
from easylm.models import moe
from easylm.runtime.sharding import make_mesh
from easylm.serving import cli as serving_cli
from easylm.variants.lora import dequantize, flat, nested
from easylm.variants.quantize import Int8Model, weight_bytes

IDS = np.random.RandomState(0).randint(0, 512, (8, 64))


def relative(a, b) -> float:
    """Relative RMS deviation of a from b, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def model():
    """(config, fp32 module, params, Int8Model, quantized params) of a random debug model at
    the training init (its logits are what a model of that shape computes, not peaked)."""
    config = LLaMAConfig.from_preset("debug")
    module = LLaMAForCausalLM(config)
    params = jax.jit(module.init_params)(jax.random.key(1))
    int8 = Int8Model(module)
    return config, module, params, int8, int8.quantize(params)


def kernel_error(int8, params, quantized) -> float:
    """The largest relative RMS rounding error of a quantized kernel: for a uniform
    rounding error of at most half a step s = absmax/127.5, about absmax/(127.5 sqrt(12) rms)."""
    q, p = flat(quantized), flat(params)
    return max(relative(dequantize(q[path]), p[path]) for path in int8.targets)


def test_the_int8_model_computes_with_its_dequantized_kernels(model):
    config, module, params, int8, quantized = model
    assert len(int8.targets) == 2 * 7 + 1  # the projections of both layers, and the head
    q = flat(quantized)
    assert all(q[path].array.qvalue.dtype == jnp.int8 for path in int8.targets)
    dequantized = nested({path: dequantize(leaf) for path, leaf in q.items()})
    got = int8.apply(quantized, IDS)
    # The same weights in an fp32 model: the same numbers but for fp32 rounding (the
    # scale is applied to the kernel, not the product, in both).
    expected = module.apply({"params": dequantized}, IDS)
    assert relative(got, expected) < 1e-5
    assert relative(got, module.apply({"params": params}, IDS)) > 1e-3  # it is quantized


def test_int8_logits_stay_within_the_kernels_rounding_error(model):
    """The bound: the logits' relative RMS deviation from the float model is at most twice
    the largest kernel's relative rounding error (measured: 1.2x in fp32 at this init), and
    in bf16 compute at most that plus twice bf16's own deviation from fp32."""
    config, module, params, int8, quantized = model
    eps = kernel_error(int8, params, quantized)
    assert 0.003 < eps < 0.01  # the uniform-rounding estimate for Gaussian kernels
    reference = module.apply({"params": params}, IDS)
    assert relative(int8.apply(quantized, IDS), reference) <= 2 * eps

    bf16 = LLaMAForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    bf16_logits = bf16.apply({"params": jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)},
                             IDS)
    int8_bf16 = Int8Model(bf16)
    got = int8_bf16.apply(int8_bf16.quantize(params), IDS)
    assert relative(got, bf16_logits) <= 2 * eps + 2 * relative(bf16_logits, reference)
    # Teacher-forced greedy choices: the same next token at nearly every position.
    assert np.mean(np.argmax(got, -1) == np.argmax(bf16_logits, -1)) >= 0.95

    # The bound catches a wrong scale: the head's 10% off.
    head = flat(quantized)["lm_head/kernel"]
    wrong = {**flat(quantized), "lm_head/kernel": head.replace(
        array=head.array.replace(scale=head.array.scale * 1.1))}
    assert relative(int8.apply(nested(wrong), IDS), reference) > 2 * eps


def test_sharded_quantization_and_the_kv_cache_give_the_same_logits(model):
    config, module, params, int8, quantized = model
    mesh = make_mesh("1,2,-1") if jax.device_count() >= 4 else make_mesh("1,1,-1")
    sharded = int8.quantize_sharded(params, PARTITION_RULES, mesh)
    assert weight_bytes(sharded) == weight_bytes(quantized)
    full = np.asarray(int8.apply(quantized, IDS[:2, :16]))
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    with jax.set_mesh(mesh):
        logits, _ = int8.apply(sharded, IDS[:2, :16], positions=positions,
                               cache=module.init_cache(2, 32))
    np.testing.assert_allclose(np.asarray(logits), full, rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_int8_weights_take_about_half_of_bf16s_bytes(model):
    config, module, params, int8, quantized = model
    kernels = sum(flat(params)[p].size for p in int8.targets)
    others = sum(x.size for x in jax.tree.leaves(params)) - kernels
    scales = sum(flat(params)[p].shape[-1] for p in int8.targets)
    int8_bf16 = Int8Model(LLaMAForCausalLM(config, dtype=jnp.bfloat16))
    # 1 byte a weight, bf16 scales and the rest (the embedding: a large share of this tiny
    # model, a small one of a real one).
    assert weight_bytes(int8_bf16.quantize(params)) == kernels + 2 * (others + scales)
    # llama_1b, abstractly (nothing allocated): 0.54 of bf16's bytes.
    big = LLaMAForCausalLM(LLaMAConfig.from_preset("llama_1b"), dtype=jnp.bfloat16,
                           param_dtype=jnp.bfloat16)
    shapes = jax.eval_shape(big.init_params, jax.random.key(0))
    stored = jax.eval_shape(Int8Model(big).quantize, shapes)
    assert weight_bytes(stored) < 0.55 * weight_bytes(shapes)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    torch.manual_seed(0)
    HFLlama(LLaMAConfig.from_preset("debug", initializer_range=0.2).to_hf_config()).save_pretrained(
        root / "model")
    make_tokenizer().save_pretrained(root / "tokenizer")
    return root


def serve_config(hf_dir, *flags):
    return flag_lib.parse(serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY), [
        "serve", f"--load_checkpoint=hf::{hf_dir / 'model'}", f"--tokenizer={hf_dir / 'tokenizer'}",
        "--seq_length=64", "--min_bucket=64", "--batch_size=2", *flags])


def greedy(engine, prompt, steps):
    from easylm.serving.engine import Sampling

    tokens, *_ = engine.fetch(engine.prefill([prompt], [0], Sampling.empty(1)))
    out = [int(tokens[0, 0])]
    while len(out) < steps:
        step, *_ = engine.fetch(engine.decode(Sampling.empty(engine.batch_size)))
        out += [int(t) for t in step[:, 0]]
    return out[:steps]


def test_serve_quantizes_a_hf_directory_at_load(hf_dir):
    # bf16: what --dtype=auto serves on a GPU (fp32 is the unit tests' above).
    engine, _, _ = serving_cli.load_engine(FAMILY, serve_config(hf_dir, "--dtype=bf16", "--quantize=int8"))
    leaves = flat(engine.params)
    kernels = [leaf for path, leaf in leaves.items() if path.endswith("/kernel")]
    assert len(kernels) == 15 and all(k.array.qvalue.dtype == jnp.int8 for k in kernels)
    assert leaves["model/embed_tokens/embedding"].dtype == jnp.bfloat16
    # Decoding with the cache gives the int8 model's greedy tokens: each is the argmax
    # of one full forward over the prompt and the tokens before it.
    prompt, steps = [1, 5, 9, 13], 8
    tokens = greedy(engine, prompt, steps)
    logits = jax.jit(engine.model.forward)(engine.params, jnp.array([prompt + tokens])).logits
    assert tokens == np.argmax(logits[0, len(prompt) - 1:-1], -1).tolist()


def test_an_unknown_quantization_is_one_clear_error(hf_dir):
    with pytest.raises(UserError, match=r"--quantize='int4': expected one of none, int8"):
        serving_cli.load_engine(FAMILY, serve_config(hf_dir, "--quantize=int4"))


def test_int8_of_a_variant_quantizes_the_projections_and_keeps_biases_and_norms():
    # Qwen3 with attention_bias: its biases and q/k norms (random, from the HF model) stay
    # in the compute dtype; the projections and the head are int8 as in LLaMA, and the
    # model is the float model on the dequantized kernels.
    from llama_variants import hf_variant, variant_config

    from easylm.llama.hf import from_hf

    config = variant_config("qwen3", attention_bias=True)
    module = LLaMAForCausalLM(config)
    params = from_hf(hf_variant(config).state_dict(), config)
    int8 = Int8Model(module)
    quantized = flat(int8.quantize(params))
    assert len(int8.targets) == 2 * 7 + 1
    vectors = [path for path in quantized if path.endswith(("/bias", "norm/weight"))]
    assert len(vectors) == 2 * (4 + 2 + 2) + 1  # per layer 4 biases, 2 q/k norms, 2 norms
    for path in vectors:
        np.testing.assert_array_equal(quantized[path], flat(params)[path])
    ids = IDS[:2, :32]
    dequantized = nested({path: dequantize(leaf) for path, leaf in quantized.items()})
    got = int8.apply(nested(quantized), ids)
    assert relative(got, module.apply({"params": dequantized}, ids)) < 1e-5  # as for LLaMA
    assert relative(got, module.apply({"params": params}, ids)) > 1e-3  # it is quantized


# ------------------------------------------------------------ a mixture of experts
#
# The expert stacks (E, in, out) are read by grouped matmuls, which qwix does not
# intercept: they are stored int8 with one scale per (expert, output channel) and
# dequantized inside the layer before the grouped matmul.


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE (2 layers, 8 experts, 2 per token) saved by transformers at
    its training init, as `hf::DIR` serves it."""
    from llama_variants import hf_variant

    root = tmp_path_factory.mktemp("int8-moe")
    torch.manual_seed(0)
    hf_variant(LLaMAConfig.from_preset("debug_moe")).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def moe_model(moe_dir):
    from easylm.llama.hf import load_hf_params

    config, params = load_hf_params(str(moe_dir))
    module = LLaMAForCausalLM(config)
    int8 = Int8Model(module)
    return config, module, params, int8, int8.quantize(params)


def test_int8_stores_each_expert_stack_int8_per_expert_and_output(moe_model):
    config, module, params, int8, quantized = moe_model
    E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
    q = flat(quantized)
    assert len(int8.stacks) == 3 * config.num_hidden_layers
    for path in int8.stacks:
        out = F if path.endswith(("gate_proj", "up_proj")) else D
        assert q[path].array.qvalue.dtype == jnp.int8
        assert q[path].array.scale.shape == (E, 1, out)  # one per (expert, output channel)
    assert all(q[path].array.qvalue.dtype == jnp.int8 for path in int8.targets)
    # bf16: 1 byte a weight of the kernels and stacks, bf16 scales and the rest
    weights = sum(flat(params)[path].size for path in (*int8.targets, *int8.stacks))
    scales = sum(q[path].array.scale.size for path in (*int8.targets, *int8.stacks))
    others = sum(x.size for x in jax.tree.leaves(params)) - weights
    bf16 = Int8Model(LLaMAForCausalLM(config, dtype=jnp.bfloat16))
    assert weight_bytes(bf16.quantize(params)) == weights + 2 * (others + scales)
    # qwen3_30b_a3b, abstractly: the experts are most of it, so about half of bf16's bytes.
    big = LLaMAForCausalLM(LLaMAConfig.from_preset("qwen3_30b_a3b", scan_layers=True),
                           dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    shapes = jax.eval_shape(big.init_params, jax.random.key(0))
    stored = jax.eval_shape(Int8Model(big).quantize, shapes)
    assert weight_bytes(stored) < 0.51 * weight_bytes(shapes)


def test_int8_moe_logits_stay_within_the_weights_rounding_error(moe_model):
    """The dense bound (twice the largest relative rounding error of a quantized weight),
    with the float model's expert choices replayed: a token whose router gap is below the
    rounding picks other experts (a discontinuity no weight error bounds). Routed anew,
    the served argmax stays the float model's at nearly every position. Negative twin: each
    expert read with its neighbour's scales (the E axis of the scales off by one)."""
    config, module, params, int8, quantized = moe_model
    q, p = flat(quantized), flat(params)
    eps = max(relative(dequantize(q[path]), p[path]) for path in (*int8.targets, *int8.stacks))
    assert 0.003 < eps < 0.01  # the uniform-rounding estimate for Gaussian weights
    float_model = FAMILY.bind(config)
    out = float_model.forward(params, IDS, router_stats=True)
    reference, stats = out.logits, out.router_stats
    replay = {moe.REPLAY: moe.replay_collection(params, stats.experts)}
    assert relative(int8.apply(quantized, IDS, collections=replay), reference) <= 2 * eps
    served = int8.apply(quantized, IDS)
    print(f"\nint8 MoE logits vs fp32: {relative(served, reference):.4f} routed anew, "
          f"{relative(int8.apply(quantized, IDS, collections=replay), reference):.4f} "
          f"replayed (bound {2 * eps:.4f})")
    assert np.mean(np.argmax(served, -1) == np.argmax(reference, -1)) >= 0.95

    wrong = dict(q)
    for path in int8.stacks:
        array = q[path].array
        wrong[path] = q[path].replace(array=array.replace(scale=jnp.roll(array.scale, 1, 0)))
    assert relative(int8.apply(nested(wrong), IDS, collections=replay), reference) > 2 * eps


def test_serve_int8_moe_answers_the_openai_api(moe_dir):
    """`python -m easylm.serve --load_checkpoint=hf::DIR --quantize=int8` on the MoE, in
    process, the experts split over ep=4: every expert stack on the devices is int8 (values
    and scales split by expert), and /v1/completions answers with
    the int8 model's greedy continuation (each token the argmax of a full forward)."""
    from fastapi.testclient import TestClient

    from easylm.data.tokenizer import load_tokenizer

    argv = ["serve", f"--load_checkpoint=hf::{moe_dir}", "--tokenizer=embedded",
            "--seq_length=32", "--min_bucket=32", "--batch_size=1", "--dtype=fp32",
            "--quantize=int8", "--mesh_dim=dp=1,fsdp=2,ep=4"]
    app, batcher = serving_cli.build(FAMILY, flag_lib.parse(
        serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY), argv))
    prompt, steps = [1, 7, 8, 9, 10], 6
    try:
        response = TestClient(app, base_url="http://127.0.0.1").post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": steps,
                                     "temperature": 0}).json()
    finally:
        batcher.stop()
    engine = batcher.engine
    stacks = [leaf for path, leaf in flat(engine.params).items() if "/experts/" in path]
    assert len(stacks) == 6 and all(s.array.qvalue.dtype == jnp.int8 for s in stacks)
    # split over the experts: each device holds its experts' values and scales
    assert all(s.array.qvalue.sharding.spec[0] == s.array.scale.sharding.spec[0] == "ep"
               for s in stacks)
    tokens = greedy(engine, prompt, steps)
    logits = jax.jit(engine.model.forward)(engine.params, jnp.array([prompt + tokens])).logits
    assert tokens == np.argmax(logits[0, len(prompt) - 1:-1], -1).tolist()
    eos = engine.model.eos_token_id
    tokens = tokens[:tokens.index(eos)] if eos in tokens else tokens
    text = load_tokenizer("embedded").decode(tokens, skip_special_tokens=True)
    assert response["choices"][0]["text"] == text


# ------------------------------------------------- a variant, in every command
#
# --quantize=int8 is the int8 variant (easylm.variants.build): serve, eval, bench decode
# and plan take it alike, refuse another value in one line, and training refuses it.


def old_int8_path(engine_params, dtype):
    """What the server did before int8 was a variant: the float engine's parameters
    quantized by `Int8Model` of the unfused module, on the devices."""
    config = LLaMAConfig.from_preset("debug", initializer_range=0.2)
    int8 = Int8Model(LLaMAForCausalLM(config.unfused(), dtype=dtype, param_dtype=dtype))
    return int8.quantize_sharded(engine_params, PARTITION_RULES, make_mesh("1,1,-1"))


def test_serve_and_eval_build_the_int8_variant_as_the_old_path_did(hf_dir):
    from easylm.evaluation import cli as eval_cli

    def engine(*flags):
        return serving_cli.load_engine(FAMILY, serve_config(hf_dir, "--pre_compile=False",
                                                            *flags))[0]

    served_engine, float_params = engine("--quantize=int8"), engine().params
    served = served_engine.params
    want = old_int8_path(float_params, jnp.float32)
    leaves = jax.tree.leaves(want)
    assert any(x.dtype == jnp.int8 for x in leaves)
    assert jax.tree.structure(served) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(served), leaves):
        np.testing.assert_array_equal(a, b)  # bit for bit: the same weights, the same numbers
    config = flag_lib.parse(eval_cli.model_config(FAMILY), eval_cli.help_entries(FAMILY), [
        "eval", f"--load_checkpoint=hf::{hf_dir / 'model'}", f"--tokenizer={hf_dir / 'tokenizer'}",
        "--seq_length=64", "--min_bucket=64", "--batch_size=2", "--pre_compile=False",
        "--quantize=int8"])
    evaluated = eval_cli.load(FAMILY, config).engine
    prompt = [1, 5, 9, 13]
    assert greedy(evaluated, prompt, 4) == greedy(served_engine, prompt, 4)
    for a, b in zip(jax.tree.leaves(evaluated.params), leaves):
        np.testing.assert_array_equal(a, b)
    # Negative twin: the float engine's parameters are not these.
    assert not any(x.dtype == jnp.int8 for x in jax.tree.leaves(float_params))


def serving_plan(capsys, *flags) -> dict:
    from easylm import plan

    with pytest.raises(SystemExit) as exit_code:
        plan.main(["plan", "--llama.base_model=debug", "--dtype=bf16", "--plan.serve_tokens=64",
                   "--plan.device_memory_gib=1", "--plan.num_devices=1", *flags])
    assert exit_code.value.code == 0
    out = capsys.readouterr().out
    return {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")} | {
        "header": out.splitlines()[0]}


def test_plan_counts_the_int8_variants_weights(capsys):
    from easylm import plan, variants

    int8, bf16 = serving_plan(capsys, "--quantize=int8"), serving_plan(capsys)
    config = flag_lib.parse(plan.default_config(FAMILY), plan.help_entries(FAMILY), [
        "plan", "--llama.base_model=debug", "--dtype=bf16", "--quantize=int8"])
    model = variants.build(FAMILY, config, serving=True)
    stored = jax.eval_shape(model.init_params, jax.random.key(0))
    assert any(x.dtype == jnp.int8 for x in jax.tree.leaves(stored))
    # one device: every weight whole, int8 values in a byte, the rest in bf16
    assert int8["weights"].split()[1:] == plan._size(weight_bytes(stored)).split()
    assert "int8 weights" in int8["header"] and "int8" not in bf16["header"]
    # Negative twin: without the variant, every weight in bf16, more bytes.
    assert int8["weights"] != bf16["weights"]


@pytest.mark.parametrize("command", ["serve", "eval", "bench decode", "plan", "bench train",
                                     "train"])
def test_every_command_refuses_another_quantization_in_one_line(command, hf_dir, capsys):
    from cli_utils import one_line_error

    from easylm import bench, plan
    from easylm.errors import exit_on_user_error
    from easylm.evaluation import cli as eval_cli
    from easylm.llama import train

    load = f"--load_checkpoint=hf::{hf_dir / 'model'}"
    engines = {
        "serve": lambda argv: serving_cli.load_engine(FAMILY, serve_config(hf_dir, *argv[1:])),
        "eval": lambda argv: eval_cli.load(FAMILY, flag_lib.parse(
            eval_cli.model_config(FAMILY), eval_cli.help_entries(FAMILY), [*argv, load])),
    }
    main = {"bench decode": lambda argv: bench.main(["bench", "decode", *argv[1:]]),
            "bench train": lambda argv: bench.main(["bench", "train", *argv[1:]]),
            "plan": plan.main, "train": train.main}.get(command) or \
        exit_on_user_error(engines[command])
    error = one_line_error(main, [command, "--quantize=int4"], capsys)
    listed = "a comma-separated list of" if command == "bench decode" else "one of"
    assert error == f"--quantize='int4': expected {listed} none, int8"
    if command in ("bench train", "plan", "train"):  # training: int8 is a served model's
        error = one_line_error(main, [command, "--quantize=int8"], capsys)
        assert error.startswith("--quantize=int8 stores a served model's weights in int8")
        assert error.endswith("--lora.base_dtype=int8")


def test_bench_decode_times_the_int8_variant():
    from easylm.serving import decode_bench

    config = decode_bench.default_config(FAMILY)
    config.update({"batch_sizes": "1", "prompt_length": 8, "new_tokens": 4, "hf": "false",
                   "mesh_dim": "1,1,-1", "quantize": "int8"})
    (row,) = decode_bench.run(config, FAMILY)
    assert row["easylm_int8_tokens_per_s"] > 0 and "easylm_tokens_per_s" not in row


# Qwen3.5's case extended (15.5 s of CI's summed time): tests/test_qwen3_5_int8.py serves
# its int8 model (dense and MoE) through the engine and checks every kernel in CI.
@pytest.mark.parametrize("name,part", [("deepseek_v3", "shared_experts/"),
                                       ("glm4_moe", "shared_experts/"), ("gemma4", "mlp/"),
                                       pytest.param("qwen3_5", "mlp/",
                                                    marks=pytest.mark.extended)])
def test_the_newer_families_serve_int8(name, part):
    """Every family that names the int8 variant serves with it: DeepSeek-V3's and GLM-4.5's
    shared experts' kernels, whose partition rules are anchored at the kernel (`kernel$`),
    are placed by the rules extended to their int8 values and scales; Gemma 4's and
    Qwen3.5's MLPs are int8 too (tests/test_qwen3_5_int8.py checks Qwen3.5's every
    kernel); the engine's greedy tokens are the int8 model's (each the argmax of a full
    forward)."""
    from easylm.models import registry

    family = registry.get(name)
    config = flag_lib.parse(serving_cli.default_config(family), serving_cli.help_entries(family), [
        "serve", "--tokenizer=embedded", "--seq_length=32", "--min_bucket=32", "--batch_size=1",
        "--dtype=fp32", "--quantize=int8", "--pre_compile=False"])
    engine = serving_cli.load_engine(family, config)[0]
    kernels = [leaf for path, leaf in flat(engine.params).items() if part in path
               and hasattr(leaf, "array")]
    assert kernels and all(leaf.array.qvalue.dtype == jnp.int8 for leaf in kernels)
    prompt, steps = [1, 5, 9, 13], 5
    tokens = greedy(engine, prompt, steps)
    logits = jax.jit(engine.model.forward)(engine.params, jnp.array([prompt + tokens])).logits
    assert tokens == np.argmax(logits[0, len(prompt) - 1:-1], -1).tolist()
