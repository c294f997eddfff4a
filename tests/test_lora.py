"""LoRA and QLoRA (easylm/variants/lora.py, easylm/variants/adapters.py): step 0 is the base model, only
adapters train, merged = unmerged on every mesh, PEFT interop both ways, quantization
error within each format's bound, and the frozen base stored in its format."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
import torch
from transformers import LlamaForCausalLM as HFLlama

from easylm.errors import UserError
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.hf import from_hf
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM
from easylm.models.decoder import stack_layers
from easylm.runtime.sharding import (
    make_mesh,
    match_partition_rules,
    named_shardings,
    path_to_string,
)
from easylm.variants.adapters import Adapters
from easylm.variants.lora import (
    NF4_BLOCK,
    LoraConfig,
    flat,
    partition_rules,
    quantize_kernel,
    read_peft,
)

ADAPTERS = Adapters(FAMILY)  # LLaMA's
load_peft, lora_model, save_peft = ADAPTERS.load_peft, ADAPTERS.lora_model, ADAPTERS.save_peft
from_peft = ADAPTERS.from_peft

# Larger-than-default init (as the HF parity tests use) so that logits are O(1) and a
# wrong adapter shows far above the tolerances.
CONFIG = LLaMAConfig.from_preset("debug", initializer_range=0.2, attention="xla")
IDS = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (2, 24)))
# The 16 NF4 levels as QLoRA defines them (Dettmers et al. 2023, appendix E; bitsandbytes'
# table); nearest-level rounding is off by at most half the widest gap, -1 to -0.696.
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
NF4_MAX_HALF_GAP = float(np.max(np.diff(NF4_LEVELS)) / 2)


def same_bits(a, b) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(leaves_a, leaves_b))


def random_adapters(lm, seed=1, scale=0.2):
    """Adapters with B != 0, so that they change the output (drawn on the host)."""
    rng = np.random.RandomState(seed)
    return jax.tree.map(lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype),
                        lm.adapter_shapes)


@pytest.fixture(scope="module")
def params():
    """CONFIG's random parameters (unscanned), made once."""
    return jax.jit(LLaMAForCausalLM(CONFIG).init_params)(jax.random.key(0))


def build(params, lora: LoraConfig, dtype=jnp.float32, **config_changes):
    """(config, LoRA model, frozen base) on the fixture's parameters."""
    config = CONFIG.replace(**config_changes)
    lm = lora_model(config, lora, dtype=dtype)
    if config.scan_layers:
        params = stack_layers(params)
    return config, lm, jax.jit(lm.store_base)(params)


def fresh_adapters(lm):
    return jax.jit(lm.init_adapters)(jax.random.key(1))


def base_logits(config, lm, base, dtype=jnp.float32):
    """The unadapted model on the stored (dequantized) base, jitted as training runs it."""
    model = LLaMAForCausalLM(config, dtype=dtype)
    return jax.jit(lambda b: model.apply({"params": lm.dequantized_base(b)}, IDS))(base)


def logits_fn(lm):
    """Jitted `(base, adapters[, rng]) -> logits` of the adapted model on IDS."""
    return jax.jit(lambda base, adapters, rng=None: lm.apply(base, adapters, IDS, rng=rng))


# ------------------------------------------------------------- acceptance 1


@pytest.mark.parametrize("base_dtype, dtype, changes", [
    ("int8", jnp.float32, {}),
    ("nf4", jnp.bfloat16, {"scan_layers": True, "remat_policy": "nothing_saveable",
                           "fused_qkv": True, "fused_mlp": True}),
])
def test_step0_logits_are_the_base_models_bitwise(params, base_dtype, dtype, changes):
    config, lm, base = build(params, LoraConfig(rank=4, base_dtype=base_dtype), dtype, **changes)
    adapters = fresh_adapters(lm)
    # Fused projections too: LoRA computes them unfused, so every one gets adapters.
    assert len(lm.targets) == 7 * (1 if config.scan_layers else config.num_hidden_layers)
    expected = base_logits(config, lm, base, dtype)
    logits = logits_fn(lm)
    got = logits(base, adapters)
    assert got.dtype == dtype
    assert same_bits(got, expected)
    # Negative twin: the comparison sees an adapter that is not zero.
    assert not same_bits(logits(base, random_adapters(lm)), expected)


def train_adapters(lm, config, base, adapters, steps, seed=0):
    """`steps` AdamW updates (weight decay on) of the adapters on one batch; the loss
    differentiates the adapters only, as the LoRA train step does."""
    tx = optax.adamw(1e-2, weight_decay=0.1)
    ids = jnp.asarray(np.random.RandomState(seed).randint(0, config.vocab_size, (4, 17)))

    def loss_fn(adapters, base, rng):
        logits = lm.apply(base, adapters, ids[:, :-1], rng=rng).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    @jax.jit
    def step(adapters, opt_state, base, rng):
        loss, grads = jax.value_and_grad(loss_fn)(adapters, base, rng)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    opt_state, losses = tx.init(adapters), []
    for i in range(steps):
        adapters, opt_state, loss = step(adapters, opt_state, base, jax.random.key(i))
        losses.append(float(loss))
    return adapters, opt_state, losses


def test_training_changes_adapters_only(params):
    # QLoRA with adapter dropout in scanned layers, which get a 'dropout' stream of their
    # own (model.py's split_rngs): without it flax passes no key into the scan.
    lora = LoraConfig(rank=4, base_dtype="nf4", dropout=0.1)
    config, lm, base = build(params, lora, scan_layers=True)
    adapters = fresh_adapters(lm)
    frozen = jax.tree.map(np.array, base)  # a host copy to compare against
    trained, opt_state, losses = train_adapters(lm, config, base, adapters, steps=4)
    assert losses[-1] < losses[0]
    assert same_bits(base, frozen)
    assert not same_bits(trained, adapters)
    # Optimizer state exists for the adapters alone: AdamW's moments have their structure.
    mu, nu = opt_state[0].mu, opt_state[0].nu
    assert jax.tree.structure(mu) == jax.tree.structure(nu) == jax.tree.structure(adapters)
    moments = sum(x.size for x in jax.tree.leaves((mu, nu)))
    assert moments == 2 * lm.num_adapter_parameters()
    assert lm.num_adapter_parameters() < sum(x.size for x in jax.tree.leaves(base)) / 10
    # Negative twin of the frozen check: one ulp anywhere in the base is seen.
    leaves, treedef = jax.tree.flatten(frozen)
    leaves[-1] = leaves[-1].copy()
    leaves[-1].flat[0] = np.nextafter(leaves[-1].flat[0], np.inf)
    assert not same_bits(base, jax.tree.unflatten(treedef, leaves))


# ------------------------------------------------------------- acceptance 2


@pytest.fixture(scope="module")
def merged_reference(params):
    """Single-device logits of base + random adapters, unmerged and merged."""
    config, lm, base = build(params, LoraConfig(rank=4, alpha=8.0, base_dtype="fp32"))
    adapters = random_adapters(lm)
    apply = jax.jit(lambda p: LLaMAForCausalLM(config).apply({"params": p}, IDS))
    return (lm, base, adapters, np.asarray(logits_fn(lm)(base, adapters)),
            np.asarray(apply(lm.merge(base, adapters))), apply)


# fp32 logits after 2 layers: reordering a contraction of n terms (a merged kernel, or
# other devices' partial sums) moves a result by up to ~n * 2^-24 times the magnitude
# of what is summed, which is the logits' scale, not each logit's: the bound is 1e-5
# of the largest |logit| (|logit| reaches ~3 here).
def assert_logits_close(actual, expected):
    scale = np.abs(expected).max()
    assert scale > 1.0
    np.testing.assert_allclose(actual, expected, atol=1e-5 * scale, rtol=0)


def test_merged_equals_unmerged(merged_reference):
    lm, base, adapters, unmerged, merged, apply = merged_reference
    assert_logits_close(merged, unmerged)
    assert np.abs(merged - np.asarray(apply(lm.dequantized_base(base)))).max() > 1e-2
    # Negative twin: folding A B in without the alpha / r scaling (2 here) is caught.
    unscaled = lora_model(CONFIG, dataclasses.replace(lm.config, alpha=float(lm.config.rank)))
    assert np.abs(np.asarray(apply(unscaled.merge(base, adapters))) - unmerged).max() > 1e-3


@pytest.mark.parametrize("mesh_dim", ["1,1,8", "2,2,2", "1,8,1"])
def test_sharded_unmerged_equals_single_device_merged(merged_reference, mesh_dim):
    lm, base, adapters, unmerged, merged, _ = merged_reference
    mesh = make_mesh(mesh_dim)
    rules = partition_rules(PARTITION_RULES)

    def shard(tree):
        return jax.device_put(tree, named_shardings(mesh, match_partition_rules(rules, tree)))

    with jax.set_mesh(mesh):
        sharded_base, sharded_adapters = shard(base), shard(adapters)
        q = sharded_adapters["model"]["layers"]["0"]["self_attn"]["q_proj"]
        assert len(q["kernel_lora_a"].sharding.device_set) == 8
        logits = np.asarray(logits_fn(lm)(sharded_base, sharded_adapters))
    assert_logits_close(logits, unmerged)
    assert_logits_close(logits, merged)


def test_adapter_rules_follow_their_kernels(params):
    config, lm, base = build(params, LoraConfig(rank=4, base_dtype="nf4"), scan_layers=True)
    adapters = lm.adapter_shapes
    rules = partition_rules(PARTITION_RULES)
    P = jax.sharding.PartitionSpec

    def by_path(tree):
        specs = match_partition_rules(rules, tree)
        return {path_to_string(path): spec for path, spec in jax.tree_util.tree_leaves_with_path(
            specs, is_leaf=lambda x: isinstance(x, P))}

    specs, base_specs = by_path(adapters), by_path(base)
    layers = "model/layers/"
    # q: kernel (fsdp, mp) -> A (fsdp, -), B (-, mp); o: kernel (mp, fsdp).
    assert specs[layers + "self_attn/q_proj/kernel_lora_a"] == P(None, "fsdp", None)
    assert specs[layers + "self_attn/q_proj/kernel_lora_b"] == P(None, None, "mp")
    assert specs[layers + "self_attn/o_proj/kernel_lora_a"] == P(None, "mp", None)
    assert specs[layers + "self_attn/o_proj/kernel_lora_b"] == P(None, None, "fsdp")
    assert base_specs[layers + "mlp/down_proj/kernel/array/qvalue"] == P(None, "mp", "fsdp")
    assert base_specs[layers + "mlp/down_proj/kernel/array/scale"] == P(None, None, "fsdp")
    # An adapter whose kernel no rule matches is an error, as for parameters.
    without_q = [(p, s) for p, s in PARTITION_RULES if "q_proj" not in p]
    with pytest.raises(UserError, match=r"no partition rule matches parameter .*_proj/kernel_lora_a"):
        match_partition_rules(partition_rules(without_q), adapters)


# ------------------------------------------------------------- acceptance 3


@pytest.fixture(scope="module")
def hf_base():
    torch.manual_seed(0)
    hf = HFLlama(CONFIG.to_hf_config()).eval()
    return hf, from_hf(hf.state_dict(), CONFIG)


def peft_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(IDS))).logits.numpy()


# Two fp32 implementations of 2 layers: (1e-4 is the bound; this run is ~1e-5).
PEFT_ATOL = 1e-4


def test_exported_adapter_loads_in_peft_with_our_logits(hf_base, tmp_path):
    from peft import PeftModel

    hf, _ = hf_base
    config = CONFIG.replace(scan_layers=True)
    lm = lora_model(config, LoraConfig(rank=4, alpha=8.0, base_dtype="fp32"))
    adapters = random_adapters(lm)
    ours = np.asarray(logits_fn(lm)(lm.store_base(from_hf(hf.state_dict(), config)), adapters))
    save_peft(str(tmp_path), lm, adapters, config, base_model="/models/tiny")
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert written["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert written["base_model_name_or_path"] == "/models/tiny"
    model = PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    try:
        theirs = peft_logits(model)
        np.testing.assert_allclose(ours, theirs, atol=PEFT_ATOL, rtol=0)
        with model.disable_adapter():  # negative twin: the adapters are what agrees
            assert np.abs(peft_logits(model) - ours).max() > 100 * PEFT_ATOL
    finally:
        model.unload()  # leaves the shared HF base without adapters


def test_adapter_written_by_peft_loads_with_peft_logits(hf_base, tmp_path):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    hf, hf_params = hf_base
    torch.manual_seed(1)
    peft_config = PeftLoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                 init_lora_weights=False, use_rslora=True)  # random A and B
    model = get_peft_model(hf, peft_config).eval()
    try:
        theirs = peft_logits(model)
        model.save_pretrained(str(tmp_path))
    finally:
        model.unload()
    lora, adapters = load_peft(str(tmp_path), CONFIG)
    assert (lora.rank, lora.alpha, lora.use_rslora) == (8, 16.0, True)
    lm = lora_model(CONFIG, dataclasses.replace(lora, base_dtype="fp32"))
    assert sorted({p.split("/")[-2] for p in lm.targets}) == ["down_proj", "q_proj", "v_proj"]
    ours = np.asarray(logits_fn(lm)(lm.store_base(hf_params), adapters))
    np.testing.assert_allclose(ours, theirs, atol=PEFT_ATOL, rtol=0)
    # Negative twin: read without rsLoRA's alpha / sqrt(r) the logits are off.
    plain = lora_model(CONFIG, dataclasses.replace(lora, base_dtype="fp32", use_rslora=False))
    assert np.abs(np.asarray(logits_fn(plain)(plain.store_base(hf_params), adapters))
                  - theirs).max() > 100 * PEFT_ATOL


def test_bad_peft_directories_are_named(params, tmp_path):
    with pytest.raises(UserError, match="not a PEFT adapter directory"):
        read_peft(str(tmp_path))
    config, lm, base = build(params, LoraConfig(rank=2, base_dtype="fp32"))
    adapters = random_adapters(lm)
    save_peft(str(tmp_path), lm, adapters, config)
    path = tmp_path / "adapter_config.json"
    good = json.loads(path.read_text())
    path.write_text(json.dumps({**good, "use_dora": True}))
    with pytest.raises(UserError, match="use_dora=True is not supported"):
        load_peft(str(tmp_path), config)
    path.write_text(json.dumps({**good, "r": 3}))
    with pytest.raises(UserError, match=r"lora_A.weight has shape \(2, \d+\), but rank 3"):
        load_peft(str(tmp_path), config)
    path.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_peft(str(tmp_path), config)
    path.write_text(json.dumps(good))
    tensors = dict(read_peft(str(tmp_path))[1])
    for change, message in [({"base_model.model.model.layers.0.self_attn.wq.lora_A.weight": 1},
                             "1 tensor.s. that are no LoRA adapter of this model's kernels: "
                             r"base_model.model.model.layers.0.self_attn.wq.lora_A.weight"),
                            ({name: None for name in tensors if "q_proj.lora_B" in name},
                             "needs lora_A and lora_B; missing for model/layers/0/self_attn/q_proj")]:
        broken = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        broken = {k: (np.zeros((2, 64), np.float32) if isinstance(v, int) else v)
                  for k, v in broken.items()}
        with pytest.raises(UserError, match=message):
            from_peft(broken, config, rank=2)


# ------------------------------------------------------------- acceptance 4


def weight_with_outliers(shape=(256, 96), seed=0):
    """Normal weights with one large input row and one large output column, so that a
    scale taken along the wrong axis shows."""
    w = np.random.RandomState(seed).standard_normal(shape).astype(np.float32)
    w[3] *= 40.0
    w[:, 5] *= 40.0
    return jnp.asarray(w)


def block_absmax(w, base_dtype):
    """|w|'s max over what shares one scale: an output column (int8), or 64 consecutive
    inputs of one output (nf4), broadcast back to w's shape."""
    a = np.abs(np.asarray(w))
    if base_dtype == "int8":
        return np.broadcast_to(a.max(axis=0, keepdims=True), a.shape)
    blocks = a.reshape(a.shape[0] // NF4_BLOCK, NF4_BLOCK, a.shape[1]).max(axis=1, keepdims=True)
    return np.broadcast_to(blocks, (a.shape[0] // NF4_BLOCK, NF4_BLOCK, a.shape[1])).reshape(a.shape)


# The bound on |w - dequantize(quantize(w))|, per element, for w's block absmax m:
#   int8: scale = m / 127.5 (qwix's symmetric bound), rounding to the nearest integer is
#         off by <= scale / 2 = m / 255;
#   nf4:  w / m in [-1, 1] is rounded to the nearest NF4 level, off by <= half the widest
#         gap between adjacent levels (0.1519, from -1 to -0.696), times m.
# Plus fp32 rounding of the division and product: a few ulps of m.
BOUND = {"int8": 1.0 / 255.0, "nf4": NF4_MAX_HALF_GAP}


@pytest.mark.parametrize("base_dtype", ["int8", "nf4"])
def test_quantization_error_within_the_formats_bound(base_dtype):
    w = weight_with_outliers()
    q = quantize_kernel(w, base_dtype, jnp.float32)
    assert q.qvalue.dtype == (jnp.int8 if base_dtype == "int8" else jnp.uint4)
    dequantized = np.asarray(qwix.dequantize(q))
    error = np.abs(dequantized - np.asarray(w))
    m = block_absmax(w, base_dtype)
    assert np.all(error <= BOUND[base_dtype] * m + 4 * np.finfo(np.float32).eps * m)
    if base_dtype == "nf4":  # and the values are the format's: a level times the absmax
        nearest = np.min(np.abs(dequantized[..., None] / m[..., None] - NF4_LEVELS), axis=-1)
        assert nearest.max() < 1e-6
    assert (error / m).max() > 0.5 * BOUND[base_dtype]  # the bound is nearly reached
    # Negative twin: scales taken along the input axis instead break the bound.
    if base_dtype == "int8":
        wrong = qwix.quantize(w, jnp.int8, channelwise_axes=[0])
    else:
        # w.T is (out, in): blocks of 32 outputs of one input.
        wrong = qwix.quantize(w.T, "nf4", channelwise_axes=[1], tiled_axes={0: 32})
    wrong_w = np.asarray(qwix.dequantize(wrong))
    wrong_w = wrong_w if base_dtype == "int8" else wrong_w.T
    assert np.any(np.abs(wrong_w - np.asarray(w)) > BOUND[base_dtype] * m * 1.5)


def test_quantized_base_is_stored_in_its_bits(params):
    # Through XLA itself: the arguments' bytes on the device.
    _, lm, base = build(params, LoraConfig(rank=4, base_dtype="nf4"), scan_layers=True)
    kernel = base["model"]["layers"]["mlp"]["down_proj"]["kernel"]
    qvalue, scale = kernel.array.qvalue, kernel.array.scale
    assert qvalue.dtype == jnp.uint4 and scale.shape == (2, 128 // NF4_BLOCK, 64)
    compiled = jax.jit(lambda x: x).lower(qvalue).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == qvalue.size // 2
    with pytest.raises(UserError, match="multiple of 64"):
        quantize_kernel(jnp.ones((96, 8)), "nf4", jnp.float32)
    # A model whose kernels nf4 cannot block is refused by name before qwix sees it.
    with pytest.raises(UserError, match=r"multiple of 64: model/layers/0/\S+/kernel has shape "
                                        r"\(96, "):
        lora_model(CONFIG.replace(hidden_size=96, num_attention_heads=2, num_key_value_heads=2),
                   LoraConfig(rank=4, base_dtype="nf4"))


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("changes, message", [
    ({"rank": -1}, "--lora.rank must be >= 0"),
    ({"alpha": 0.0}, "--lora.alpha must be > 0"),
    ({"dropout": 1.0}, r"--lora.dropout must be in \[0, 1\)"),
    ({"base_dtype": "int4"}, "--lora.base_dtype='int4' is not one of auto, bf16, fp32, int8, nf4"),
    ({"target_modules": "q_proj("}, "is not a regular expression"),
])
def test_bad_lora_flags_are_named(changes, message):
    with pytest.raises(UserError, match=message):
        LoraConfig(**changes)


def test_targets_and_scaling():
    assert LoraConfig(rank=16, alpha=32).scaling == 2.0
    assert LoraConfig(rank=16, alpha=32, use_rslora=True).scaling == 8.0
    lm = lora_model(CONFIG, LoraConfig(rank=2, target_modules=r"layers/1/.*(q_proj|v_proj)"))
    assert lm.targets == ("model/layers/1/self_attn/q_proj/kernel",
                          "model/layers/1/self_attn/v_proj/kernel")
    with pytest.raises(UserError, match="matches none of the model's kernels"):
        lora_model(CONFIG, LoraConfig(rank=2, target_modules="wq"))
    with pytest.raises(UserError, match="--lora.rank must be >= 1"):
        lora_model(CONFIG, LoraConfig(rank=0))
    # A defaults round trip through the flag tree.
    assert LoraConfig.from_flags(LoraConfig.get_default_config()) == LoraConfig()
    assert math.isclose(LoraConfig(rank=8).scaling, 2.0)


def test_a_variant_adapts_kernels_with_biases_and_norms_frozen(tmp_path):
    # Qwen3 with attention_bias: its biases and q/k norms (random, from the HF model) stay
    # in the frozen base; adapters sit on the seven projections' kernels. Step 0 is the
    # base model; the PEFT export loads onto transformers' Qwen3 with our logits.
    from llama_variants import hf_variant, variant_config
    from peft import PeftModel

    config = variant_config("qwen3", attention_bias=True, scan_layers=True)
    hf = hf_variant(config)
    lm = lora_model(config, LoraConfig(rank=4, alpha=8.0, base_dtype="fp32"))
    base = lm.store_base(from_hf(hf.state_dict(), config))
    assert sorted({path.split("/")[-2] for path in lm.targets}) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    vectors = [path for path in flat(base) if path.endswith(("/bias", "q_norm/weight"))]
    assert vectors and not any(path.endswith("/bias") for path in flat(lm.adapter_shapes))
    # Step 0 is the base model: to the fp32 tolerance, not bitwise as without biases (XLA
    # fuses o_proj's bias add with the adapter's zero term in another order; measured
    # 8e-7 of the logits' scale).
    from numerics import assert_close, forward_rel

    assert_close(logits_fn(lm)(base, fresh_adapters(lm)), base_logits(config, lm, base),
                 forward_rel(config, IDS.shape[1]))
    adapters = random_adapters(lm)
    ours = np.asarray(logits_fn(lm)(base, adapters))
    save_peft(str(tmp_path), lm, adapters, config)
    model = PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    np.testing.assert_allclose(ours, peft_logits(model), atol=PEFT_ATOL, rtol=0)
    with model.disable_adapter():  # negative twin: the adapters are what agrees
        assert np.abs(peft_logits(model) - ours).max() > 100 * PEFT_ATOL
