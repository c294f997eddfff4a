"""The deepseek_v3 family against transformers' DeepseekV3ForCausalLM: a tiny random
directory saved by transformers (q_lora_rank set or null, YaRN with mscale, n_group > 1,
a dense first layer, a correction bias far from zero) read through hf::DIR."""

import numpy as np
import pytest
from cli_utils import train_losses
from serving_utils import assert_engine_greedy_equals_generate, prefill_program_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import jax.numpy as jnp

from easylm.deepseek_v3 import hf
from easylm.deepseek_v3.family import FAMILY
from easylm.deepseek_v3.model import DeepseekV3ForCausalLM

T = 24


def _save(directory, q_lora_rank):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
        max_position_embeddings=256, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        initializer_range=0.2)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        for layer in model.model.layers[1:]:  # a bias that changes choices
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8))
    model.save_pretrained(directory)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module", params=[12, None], ids=["q_lora", "q_proj"])
def saved(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ds"))
    model = _save(directory, request.param)
    ids = np.random.default_rng(0).integers(0, 512, (2, T))
    config, params = hf.load_hf_params(directory)
    return directory, model, ids, config, params


def _one_variant(saved):
    if not saved[3].q_lora_rank:
        pytest.skip("the q_lora_rank variant is enough for this")


def _tolerance(reference):
    # fp32 through 3 layers: tens of ulps of the logits' magnitude (measured ~6e-6 of 2.4).
    return 64 * np.finfo(np.float32).eps * float(np.abs(reference).max())


def test_logits_match_transformers(saved):
    _, model, ids, config, params = saved
    ref = _logits(model, ids)
    ours = np.asarray(DeepseekV3ForCausalLM(config).apply({"params": params}, jnp.asarray(ids)))
    tol = _tolerance(ref)
    np.testing.assert_allclose(ours, ref, atol=tol, rtol=0)
    # Negative twins: the correction bias ignored, the group limit ignored.
    unbiased = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "e_score_correction_bias" in str(p) else x, params)
    off = np.asarray(DeepseekV3ForCausalLM(config).apply({"params": unbiased}, jnp.asarray(ids)))
    assert np.abs(off - ref).max() > 100 * tol
    ungrouped = config.replace(topk_group=config.n_group)
    off = np.asarray(DeepseekV3ForCausalLM(ungrouped).apply({"params": params},
                                                           jnp.asarray(ids)))
    assert np.abs(off - ref).max() > 100 * tol


def test_written_back_directory_loads_in_transformers(tmp_path, saved):
    from easylm.models.hf_checkpoint import write_safetensors

    _, model, ids, config, params = saved
    write_safetensors(FAMILY.hf.write_params(params, config), str(tmp_path))
    config.to_hf_config().save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    np.testing.assert_array_equal(_logits(back.eval(), ids), _logits(model, ids))
    again = hf.load_hf_params(str(tmp_path))[1]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_prefill_then_absorbed_decode_equals_the_full_forward(saved):
    """16 tokens prefilled (expanded), then one at a time (kv_b_proj absorbed, the
    cache holding latents): the full forward's logits and argmax."""
    _, model, ids, config, params = saved
    ref = _logits(model, ids)
    m = FAMILY.bind(config)
    step = jax.jit(m.forward)
    B, P = ids.shape[0], 16
    positions = np.broadcast_to(np.arange(T), ids.shape)
    cache = m.init_cache(B, T)
    assert cache["0"].kv.shape[-1] == config.kv_lora_rank + config.qk_rope_head_dim
    out = step(params, jnp.asarray(ids[:, :P]), jnp.asarray(positions[:, :P]), cache=cache)
    logits, cache = [out.logits], out.cache
    for t in range(P, T):
        out = step(params, jnp.asarray(ids[:, t:t + 1]), jnp.asarray(positions[:, t:t + 1]),
                   cache=cache)
        logits.append(out.logits)
        cache = out.cache
    decoded = np.concatenate(logits, axis=1)
    tol = _tolerance(ref)
    np.testing.assert_allclose(decoded, ref, atol=tol, rtol=0)
    np.testing.assert_array_equal(decoded.argmax(-1), ref.argmax(-1))
    assert np.abs(decoded[:, P:] - ref[:, P - 1:T - 1]).max() > 100 * tol  # one position off


def test_training_through_the_command_lowers_the_loss(tmp_path, saved):
    """hf::DIR trained by `python -m easylm.train`: step 1's loss = transformers' on the
    same batch is checked by the logits test; here the loss falls after updates."""
    _one_variant(saved)
    losses = train_losses(saved[0], tmp_path)
    assert len(losses) == 3 and np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_the_training_loss_is_transformers_loss(saved):
    """The next-token objective the trainer runs (step 1's loss) = transformers' `labels`
    loss on the same rows; the twin drops the correction bias."""
    from easylm.objectives.next_token import next_token_sums

    _, model, ids, config, params = saved
    with torch.no_grad():
        loss = float(model(torch.tensor(ids), labels=torch.tensor(ids)).loss)
    batch = dict(input_tokens=jnp.asarray(ids),
                 target_tokens=jnp.asarray(np.concatenate([ids[:, 1:], ids[:, :1]], axis=1)),
                 loss_masks=jnp.asarray(np.arange(T) < T - 1, jnp.float32)[None].repeat(2, 0))
    atol = 64 * np.finfo(np.float32).eps * loss
    ours = float(next_token_sums(FAMILY.bind(config), params, batch, None).means()["loss"])
    assert abs(ours - loss) <= atol, (ours, loss)
    unbiased = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "e_score_correction_bias" in str(p) else x, params)
    off = float(next_token_sums(FAMILY.bind(config), unbiased, batch, None).means()["loss"])
    assert abs(off - loss) > atol


def test_served_greedy_tokens_equal_transformers_generate(saved):
    """The serving engine on the latent cache (chunked prefill in the expanded form, decode
    with the absorbed weights, its positional (B, S, C) latents sliced and written by
    position as K/V are) = transformers' generate, 12 greedy tokens."""
    _one_variant(saved)
    _, model, _, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


def test_training_leaves_the_correction_bias_as_it_is(saved):
    """No gradient reaches the bias (it only picks experts) and the default weight-decay
    exclusions skip it: a step of the default AdamW leaves it bit for bit."""
    _one_variant(saved)
    import re

    from easylm.training import optimizers

    _, _, ids, config, params = saved
    model = FAMILY.bind(config)
    grads = jax.grad(lambda p: model.forward(p, jnp.asarray(ids)).logits.std())(params)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): g
            for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    biases = [k for k in flat if k.endswith("e_score_correction_bias")]
    assert biases and all(not np.any(flat[k]) for k in biases)
    assert any(np.any(flat[k]) for k in flat if k.endswith("router/kernel"))
    exclusions = optimizers.get_default_config().adamw_optimizer.weight_decay_exclusions
    assert all(any(re.search(r, k) for r in exclusions.split(",")) for k in biases)


def test_a_train_step_over_ep_equals_one_over_fsdp():
    """--mesh_dim=dp=1,fsdp=2,ep=4 (each device 2 of the 8 routed experts, pairs exchanged
    by all-to-all) and --mesh_dim=1,8,1: the same step's loss, expert load, gradient norm
    and updated parameters, the routers' correction biases moved by the step's load."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    from ml_collections import ConfigDict
    from numerics import fp32_rel
    from test_trainer import Runner, make_batch, sgd

    from easylm import model_flags, variants

    flags = model_flags.flag_config(FAMILY, "debug")
    # One layer, of experts: two compiles of a sharded step.
    flags.num_hidden_layers, flags.first_k_dense_replace = 1, 0
    flags.routed_bias_update_rate = 1e-2
    model = variants.build(FAMILY, ConfigDict(dict(deepseek_v3=flags, dtype="fp32",
                                                   param_dtype="fp32")))
    batch = make_batch(batch_size=8, seq_length=T)
    runners = [Runner(model, sgd(1e-2), mesh, devices=8)  # parameters: lr x gradient
               for mesh in ("dp=1,fsdp=2,ep=4", "1,8,1")]
    ep, fsdp = [r.step(batch) for r in runners]
    # One layer's sums reordered over the widest reduction (the hidden size 64, the
    # latent's 32 + 8, the rows' 32), then the head: relative to the loss (~ln 512).
    rel = fp32_rel(64, 8 + 1)
    for key in ("loss", "gradient_norm", "param_norm"):
        assert ep[key] == pytest.approx(fsdp[key], rel=rel), key
    for key in ("moe_load_max", "moe_load_min"):
        assert ep[key] == fsdp[key], key
    params = [jax.device_get(r.state.params) for r in runners]
    biases = [np.concatenate([np.ravel(x) for path, x in
                              jax.tree_util.tree_flatten_with_path(p)[0]
                              if "e_score_correction_bias" in str(path[-1])]) for p in params]
    np.testing.assert_array_equal(biases[0], biases[1])
    assert np.any(biases[0])  # the bias moved from its zeros
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1])):
        np.testing.assert_allclose(a, b, rtol=0, atol=rel * max(1.0, float(np.abs(b).max())))


# MLA's projections by transformers' module names, the shared experts' and the dense MLP's
# (gate_proj, up_proj, down_proj) and the routed experts' stacks (PEFT's target_parameters).
MLA_TARGETS = (r"(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|"
               r"up_proj|down_proj)/kernel$|experts/(gate_up_proj|down_proj)$")


def lora_logprobs(tmp_path, directory, targets, expected_modules, monkeypatch,
                  model_class=None):
    """Two steps of `python -m easylm.train --lora.*` on hf::`directory`, exported as a PEFT
    adapter and merged: (transformers' base, the base + PEFT adapter, the merged export)
    log-probabilities of 2 random rows of 40; the adapter's target_modules checked.
    `model_class`: transformers' class (default AutoModelForCausalLM, which knows no
    mistral4).

    peft 0.21 reads target_modules gate_proj, up_proj and down_proj of a deepseek_v3 or
    glm4_moe model as transformers 4's per-expert projections and moves them onto the fused
    experts (`_convert_peft_config_moe`, at twice the rank), so adapters on the dense and
    shared-expert MLPs, which transformers 5 still names so, would not load: that
    conversion is left out here, the adapter loaded as written."""
    import contextlib
    import io
    import json

    from peft import PeftModel
    from peft.utils import transformers_weight_conversion

    monkeypatch.setattr(transformers_weight_conversion, "_convert_peft_config_moe",
                        lambda config, model: None)

    from easylm import convert_easylm_to_hf, train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(["train", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
                    "--total_steps=2", "--dtype=fp32", "--mesh_dim=1,1,-1",
                    "--train_dataset.json_dataset.seq_length=32",
                    "--train_dataset.json_dataset.batch_size=2", "--compilation_cache_dir=",
                    f"--logger.output_dir={tmp_path / 'runs'}",
                    "--optimizer.adamw_optimizer.lr=5e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=0", "--lora.rank=4",
                    "--lora.alpha=8", f"--lora.target_modules={targets}"])
    final = out.getvalue().split("checkpoint: ")[1].split()[0]
    for mode in ("adapter", "merged"):
        with contextlib.redirect_stdout(io.StringIO()):
            convert_easylm_to_hf.main(["convert", f"--load_checkpoint=params::{final}",
                                       f"--output_dir={tmp_path / mode}",
                                       f"--lora_mode={mode}", "--verify=False"])
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(written["target_modules"]) == sorted(expected_modules)
    assert written["target_parameters"]  # the routed experts' gate_up_proj and down_proj
    ids = torch.tensor(np.random.RandomState(2).randint(3, 512, (2, 40)))
    load = (model_class or transformers.AutoModelForCausalLM).from_pretrained
    base = load(directory, dtype=torch.float32).eval()
    merged = load(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        before = torch.log_softmax(base(ids).logits, -1).numpy()
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        peft = torch.log_softmax(peft(ids).logits, -1).numpy()
        merged = torch.log_softmax(merged(ids).logits, -1).numpy()
    return before, peft, merged


def test_lora_on_mla_and_experts_exports_a_peft_adapter_equal_to_the_merged(tmp_path, saved,
                                                                           monkeypatch):
    """LoRA through the train command on MLA's projections (q_a_proj, q_b_proj,
    kv_a_proj_with_mqa, kv_b_proj, o_proj), the dense and shared MLPs and the routed
    experts: the PEFT adapter loaded by peft onto transformers' base = the merged export.
    Both are transformers' sums, the adapter's x A B added beside x W instead of folded in:
    per layer a dozen reductions in sequence reordered, two more for the adapters; a
    log-probability moves by twice the logits' error. The twin: the base alone."""
    from numerics import assert_close, assert_differs, fp32_rel

    _one_variant(saved)
    directory, _, _, config, _ = saved
    before, peft, merged = lora_logprobs(
        tmp_path, directory, MLA_TARGETS,
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
         "up_proj", "down_proj"], monkeypatch)
    rel = 2 * fp32_rel(max(config.hidden_size, config.intermediate_size, 40),
                       14 * config.num_hidden_layers + 1)
    scale = float(np.abs(merged).max())
    assert_close(merged, peft, rel, scale)
    assert_differs(before, peft, rel, scale)  # the adapters moved the log-probabilities


def test_live_adapters_decode_absorbed_as_the_merged_model_computes(saved):
    """Adapters served live on their base (GRPO's rollouts, the trainer's eval hook): the
    24 tokens through an empty cache, few enough that kv_b_proj is absorbed (its kernel as
    qwix computes it, W + s A B) = the merged model's full forward (expanded); the twin:
    the base's."""
    from easylm.models.mla import MultiHeadLatentAttention
    from easylm.variants.adapters import Adapters
    from easylm.variants.lora import LoraConfig, flat, nested

    _one_variant(saved)
    _, _, ids, config, params = saved
    attention = MultiHeadLatentAttention(config.mla())
    assert attention.absorbs(T, cache=True) and not attention.absorbs(T, cache=None)
    lm = Adapters(FAMILY).lora_model(config, LoraConfig(rank=2, target_modules=MLA_TARGETS))
    leaves = flat(lm.adapter_shapes)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapters = nested({path: 0.2 * jax.random.normal(key, leaf.shape)
                       for key, (path, leaf) in zip(keys, leaves.items())})
    base = lm.store_base(params)
    merged = _logits_of(config, lm.merge(base, adapters), ids)
    positions = jnp.broadcast_to(jnp.arange(T), ids.shape)
    cache = FAMILY.bind(config).init_cache(ids.shape[0], T)
    decoded, _ = jax.jit(lambda *a: lm.apply(*a))(base, adapters, jnp.asarray(ids), positions,
                                                None, cache)
    tol = 3 * _tolerance(merged)  # the adapters' two products a projection
    np.testing.assert_allclose(decoded, merged, atol=tol, rtol=0)
    assert np.abs(_logits_of(config, params, ids) - merged).max() > 100 * tol


def _logits_of(config, params, ids):
    return np.asarray(DeepseekV3ForCausalLM(config).apply({"params": params}, jnp.asarray(ids)))


def test_served_int8_logprobs_are_the_float_models_within_the_rounding(saved):
    """--quantize=int8: every MLA projection (kv_b_proj absorbed as well as expanded), the
    MLPs', the shared and routed experts' and the head are int8. Bound (as
    tests/test_qwen3_5_int8.py derives it): a kernel off by a relative eps puts its matmul
    off by eps, and a chain of n by n eps; n on the deepest path is 5 a layer (q_a then q_b
    or kv_a then kv_b, o_proj; gate/up then down), then the head. The float model's expert
    choices are replayed (routing is discontinuous). The engine's prompt log-probabilities
    (prefilled, expanded) = the int8 forward's within the fp32 tolerance of
    `_tolerance`, twice for a log-probability. Twins: kv_b_proj's scales 10% off leave
    the bound; the float model's log-probabilities leave the engine's tolerance."""
    from test_quantize import relative

    from easylm.runtime.sharding import make_mesh
    from easylm.serving import scoring
    from easylm.serving.engine import Engine
    from easylm.variants import quantize
    from easylm.variants.lora import dequantize, flat, nested

    _one_variant(saved)
    _, _, ids, config, params = saved
    model = quantize.int8_variant(FAMILY, config, jnp.float32, FAMILY.bind(config))
    int8 = quantize.Int8Model(DeepseekV3ForCausalLM(config))
    quantized = int8.quantize_sharded(params, FAMILY.partition_rules(config),
                                      make_mesh("1,1,-1"))
    q, p = flat(quantized), flat(params)
    kernels = sorted(path for path, leaf in q.items() if hasattr(leaf, "array"))
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                 "shared_experts/down_proj", "experts/gate_proj", "lm_head"):
        assert any(name in path for path in kernels), name
    eps = max(relative(dequantize(q[path]), p[path]) for path in kernels)
    ids = jnp.asarray(ids)
    floats = jax.jit(lambda p: FAMILY.bind(config).forward(p, ids, router_stats=True))(params)
    routing, reference = floats.router_stats.experts, floats.logits
    bound = (5 * config.num_hidden_layers + 1) * eps
    expanded = jax.jit(lambda p: model.forward(p, ids, routing=routing).logits)
    # T tokens into an empty cache: kv_b_proj absorbed, as in decoding
    absorbed = jax.jit(lambda p: model.forward(p, ids, routing=routing,
                                               cache=model.init_cache(ids.shape[0], T)).logits)
    for forward in (expanded, absorbed):
        assert relative(forward(quantized), reference) <= bound
    path = [path for path in kernels if path.endswith("kv_b_proj/kernel")][0]
    wrong = {**q, path: q[path].replace(array=q[path].array.replace(
        scale=q[path].array.scale * 1.1))}
    assert relative(absorbed(nested(wrong)), reference) > bound

    prompt = [int(t) for t in np.asarray(ids[0])]
    engine = Engine({"batch_size": 1, "seq_length": 32, "decode_steps": 4,
                     "prefill_chunk_size": 16}, model, quantized)
    ((logps, _),) = scoring.prompt_logprobs(engine, [prompt])
    logits = jax.jit(lambda p: model.forward(p, ids[:1]).logits[0])(quantized)
    expected = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(T - 1), prompt[1:]]
    atol = 2 * _tolerance(logits)
    np.testing.assert_allclose(np.array(logps[1:]), expected, rtol=0, atol=atol)
    as_float = np.asarray(jax.nn.log_softmax(reference[0], -1))[np.arange(T - 1), prompt[1:]]
    assert np.abs(as_float - expected).max() > 10 * atol


def test_the_serving_plan_counts_the_latent_cache_and_xla_agrees():
    """`--plan.serve_tokens`' cache: per slot and layer, C + R values a token (the latent
    and the rotary key), not N (P + R + V) keys and values (the twin); the whole plan
    against XLA's analysis of the engine's prefill (arguments + outputs - aliased +
    temporaries; 256 tokens in chunks of 64). Measured at 1,024 tokens in chunks of 128:
    planned 7.25 MB, XLA 7.21 MB."""
    from easylm.serving.memory import serving_bytes

    S = 256
    config = FAMILY.from_preset("debug", max_position_embeddings=S)
    model = FAMILY.bind(config)
    sizes = {"dp": 1, "fsdp": 1, "sp": 1, "ep": 1, "mp": 1}
    mla = config.mla()
    expanded = mla.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim)
    for length in (S // 2, S):
        planned = serving_bytes(model, sizes, jnp.bfloat16, 2, length, length, 64)["kv cache"]
        assert planned == 2 * config.num_hidden_layers * length * mla.cache_width * 2
        assert planned != 2 * config.num_hidden_layers * length * expanded * 2
    xla = prefill_program_bytes(model, S, 64)
    assert 0.8 < serving_bytes(model, sizes, jnp.float32, 1, S, S, 64)["total"] / xla < 1.25


def test_moonlight_counts_as_its_card():
    """moonlight_16b_a3b: 15.29B parameters and 2.24B active without the embedding and the
    head (163,840 x 2,048 each), as its card counts; transformers builds the same count
    from the exported config."""
    config = FAMILY.from_preset("moonlight_16b_a3b")
    table = config.vocab_size * config.hidden_size
    assert round((config.num_parameters() - 2 * table) / 1e9, 2) == 15.29
    assert round((config.num_matmul_parameters() - table) / 1e9, 2) == 2.24
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config.to_hf_config())
    assert sum(p.numel() for p in built.parameters()) == config.num_parameters()


def test_routing_replay_matches_the_sampler_and_routing_anew_does_not():
    """GRPO's routing replay (`--grpo.routing_replay=True`) on DeepSeek's sigmoid routers:
    tests/test_routing_replay.py's check with the debug model's router columns tied to a
    relative 1e-6 (choices decided at rounding level). The engine records each token's
    choices while sampling; the training forward replaying them gives the sampler's
    log-probabilities within twice the logits' fp32 error (per layer a dozen reductions in
    sequence over the widest of D, F, C and T); routing anew does not."""
    from types import SimpleNamespace

    from numerics import assert_close, assert_differs, fp32_rel
    from test_routing_replay import NEW, ROWS, TIE, sample, trainer_logps

    from easylm.variants.lora import flat, nested

    config = FAMILY.from_preset("debug", routed_bias_update_rate=0.0)
    model = FAMILY.bind(config)
    assert model.router_loss is not None  # what the GRPO objective asks of replay
    params = flat(jax.jit(model.init_params)(jax.random.key(0)))
    noise = jax.random.split(jax.random.key(1), len(params))
    params = nested({path: x[:, :1] * (1 + TIE * jax.random.normal(key, x.shape))
                     if path.endswith("router/kernel") else x
                     for key, (path, x) in zip(noise, params.items())})
    rows = sample(config, model, params)
    fast = SimpleNamespace(forward=jax.jit(model.forward))  # what trainer_logps calls
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    assert rows["routing"].shape[:2] == (ROWS, moe_layers) and NEW
    logits = fast.forward(params, jnp.asarray(rows["input_tokens"])).logits
    terms = max(config.hidden_size, config.moe_intermediate_size, config.kv_lora_rank,
                rows["input_tokens"].shape[1])
    atol = 2 * fp32_rel(terms, 12 * config.num_hidden_layers + 1) * float(jnp.abs(logits).max())
    sampler = rows["sampling_logps"] * rows["loss_masks"]
    assert_close(trainer_logps(fast, params, rows, rows["routing"]), sampler, atol, scale=1.0)
    assert_differs(trainer_logps(fast, params, rows), sampler, atol, scale=1.0)
