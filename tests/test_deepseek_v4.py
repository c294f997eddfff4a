"""The deepseek_v4 family against transformers' DeepseekV4ForCausalLM: a tiny random
directory saved by transformers (fp32) with every special path active: one layer of each
attention type (sliding, compressed sparse with its indexer keeping 3 entries of up to
74, heavily compressed), compression rates and the window below the 300-token prompt,
hc_mult 2, a hash-routed layer, routers scaled 5x, a random correction bias, and the
sinks, position biases, norms and hyper-connection biases perturbed. The full forward and
the serving engine (its caches, chunked prefill, decode) both."""

import contextlib

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import jax.numpy as jnp
import hf_parity
from serving_utils import assert_engine_greedy_equals_generate

from easylm.deepseek_v4 import hf, model as v4_model
from easylm.deepseek_v4.family import FAMILY
from easylm.errors import UserError
from easylm.models import sparse_attention
from easylm.serving.engine import Engine, Sampling

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300
CHUNK = 100  # the served prompt's prefill chunk: not a multiple of either compress rate


def _save(directory, hidden_size=32):
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(
        vocab_size=V, hidden_size=hidden_size, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=2, sliding_window=16, o_groups=2, o_lora_rank=8,
        # 16 indexer heads: a score of exactly 0 (all heads' relu 0), whose ties torch's
        # top-k orders its own way, is then improbable (V4 has 64).
        index_n_heads=16, index_head_dim=8, index_topk=3, max_position_embeddings=1024,
        num_nextn_predict_layers=0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("sinks", "position_bias", "base", "scale", "norm")):
                p.add_(0.3 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(5.0)
            if hasattr(layer.mlp.gate, "tid2eid"):
                layer.mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(4)[:2]
                                                          for _ in range(V)]))
            else:
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("deepseek_v4"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _rel(config, terms=PROMPT):
    """Relative error of the logits: per layer about 20 reductions in sequence (two
    hyper-connections' norm and projection each, q_a, its norm, q_b, the head norm, kv, its
    norm, the compressor's projection, gated sum and norm, the indexer's, scores, weighted
    sum, the two output projections, the router, gate/up, down) over at most max(D, keys)
    terms, then the head."""
    return fp32_rel(max(config.hidden_size, terms), 20 * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def test_config_json_and_counts_are_transformers(saved):
    _, model, config, _ = saved
    assert config.layer_kinds() == ("sliding_attention:hash_moe",
                                    "compressed_sparse_attention:moe",
                                    "heavily_compressed_attention:moe")
    assert (config.qk_rope_head_dim, config.compress_rate_csa, config.compress_rate_hca,
            config.hc_mult) == (8, 4, 8, 2)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(UserError, match="n_shared_experts=2 is not supported"):
        FAMILY.config_class.from_hf_config({"model_type": "deepseek_v4", "n_shared_experts": 2})


@contextlib.contextmanager
def one_stream():
    """The hyper-connections collapsed to one stream (mean in, added out, no mixing): a
    twin's model."""
    def collapsed(x, fn, base, scale, c):
        C = x.shape[2]
        return (jnp.ones(x.shape[:3]), jnp.broadcast_to(jnp.eye(C), x.shape[:2] + (C, C)),
                x.mean(axis=2))

    original, v4_model.hyper_connection = v4_model.hyper_connection, collapsed
    try:
        yield
    finally:
        v4_model.hyper_connection = original


@contextlib.contextmanager
def pending_dropped():
    """Each call's compressors start from an empty cache: windows pending at a chunk's
    start (and the entries before it) lost, a twin of the served path."""
    cached = v4_model.Compressor.cached

    def fresh(self, kv, gate, inv_freq, positions, cache):
        return cached(self, kv, gate, inv_freq, positions, jax.tree.map(jnp.zeros_like, cache))

    v4_model.Compressor.cached = fresh
    try:
        yield
    finally:
        v4_model.Compressor.cached = cached


def test_logprobs_of_a_long_prompt_match_transformers(saved):
    """A full forward's log-probabilities of a 300-token prompt = transformers'; twins (the
    same tolerance): the indexer ignored (every visible entry kept), the hyper-connections
    collapsed to one stream (mean in, added out, no mixing)."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    lm = FAMILY.module_class
    assert_close(hf_parity.module_logprobs(lm(config), params, prompt), expected,
                 rel=atol, scale=1.0)
    assert_differs(hf_parity.module_logprobs(lm(config.replace(index_topk=10 ** 6)), params,
                                             prompt), expected, rel=atol, scale=1.0)
    with one_stream():
        collapsed = hf_parity.module_logprobs(lm(config), params, prompt)
    assert_differs(collapsed, expected, rel=atol, scale=1.0)


def _offset_blocks(monkeypatch):
    """A twin's blocks: each block's queries taken one position late (their windows,
    entries and causal rows shifted)."""
    blocks = sparse_attention.by_query_blocks
    monkeypatch.setattr(sparse_attention, "by_query_blocks", lambda fn, block, rows: blocks(
        lambda start, *xs: fn(start + 1, *xs), block, rows))


def test_query_blocks_score_a_long_prompt_as_transformers(saved, monkeypatch):
    """`query_block=64` (the sliding, compressed sparse and heavily compressed layers by
    blocks of 64 queries, the last of 299 ragged; each over its window's 79 tokens and the
    entries): the log-probabilities = transformers' (the full forward's tolerance); twin:
    the blocks one position late."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    blocked = FAMILY.module_class(config.replace(query_block=64))
    assert_close(hf_parity.module_logprobs(blocked, params, prompt), expected, rel=atol,
                 scale=1.0)
    _offset_blocks(monkeypatch)
    assert_differs(hf_parity.module_logprobs(blocked, params, prompt), expected, rel=atol,
                   scale=1.0)


@pytest.mark.extended  # CI: the blocks' log-probabilities = transformers' (above)
def test_query_blocks_equal_the_mask_in_gradients(saved):
    """`query_block=16` over rows of 70 (ragged; one row packed with two documents): the
    logits and every parameter's gradient = the whole form's; tolerances: the same keys
    (the same top_k over the same rows), only summation order differs: `_rel`'s chain for
    the logits, twice it (the backward walks it back) for each gradient, of its largest
    entry; the gradients that are 0 (the indexer's, the hash table, the correction bias)
    are 0 in both."""
    _, _, config, params = saved
    ids = jnp.asarray(np.random.default_rng(1).integers(3, V, (2, 71)))
    segment_ids = jnp.asarray([[1] * 70, [1] * 30 + [2] * 40])

    def loss_and_grads(config):
        model = FAMILY.bind(config)

        def loss(p):
            logits = model.forward(p, ids[:, :-1], segment_ids=segment_ids).logits
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
            return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean(), logits
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return logits, grads

    expected, expected_grads = loss_and_grads(config)
    logits, grads = loss_and_grads(config.replace(query_block=16))
    rel = _rel(config, terms=70)
    assert_close(logits, expected, rel)
    flat = jax.tree_util.tree_flatten_with_path(expected_grads)[0]
    for (path, want), got in zip(flat, jax.tree.leaves(grads)):
        name = jax.tree_util.keystr(path)
        if not np.any(np.asarray(want)):
            assert not np.any(np.asarray(got)), name
        else:
            assert_close(got, want, 2 * rel, err_msg=name)


def served(config, params, prompt, chunk=CHUNK, scored=None):
    """The engine's log-probabilities of prompt[1:], its prompt `chunk` tokens a call (and
    with `scored`, the tokens after, and whether each is the greedy choice)."""
    tokens = prompt + (scored or [])
    engine = Engine({"batch_size": 1, "seq_length": 320, "min_bucket": 320,
                     "prefill_chunk_size": chunk}, FAMILY.bind(config), params)
    logprobs, greedy = engine.score([tokens[:-1]], [tokens[1:]])[0][:2]
    return (logprobs[:len(prompt) - 1], greedy[len(prompt) - 1:]) if scored else logprobs


def test_served_logprobs_and_greedy_tokens_through_the_gather_match_transformers(
        saved, monkeypatch):
    """Through the engine's caches, 100 tokens a chunk, its default `topk_attention=auto`
    gathering each query's keys: the window's 16 and its kept entries (CSA: 3 of up to 78;
    HCA: every one, up to 39) of the 320 cached positions. The CSA (4, with the window
    before) and HCA (8) windows straddle the chunks' edges, so entries are made from
    windows pending in the cache. Log-probabilities of the 300-token prompt = transformers'
    (same tolerance as the full forward: the same sums, over fewer keys); `generate`'s 12
    greedy tokens after it, scored with it, are each the engine's greedy choice (decoding
    them one by one: the extended greedy tests). Twin: the gather's invisible keys unmasked
    (the first 15 queries' window slots before position 0, the entries past each query),
    which only the gather reads."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                do_sample=False)[0, PROMPT:].tolist()
    logprobs, chosen = served(config, params, prompt, scored=greedy)
    assert_close(logprobs, expected, rel=atol, scale=1.0)
    assert chosen.tolist() == [True] * 12
    attend = sparse_attention.attend_rows
    monkeypatch.setattr(sparse_attention, "attend_rows", lambda q, rows, valid, scale, sink: (
        attend(q, rows, valid | True, scale, sink)))
    assert_differs(served(config, params, prompt), expected, rel=atol, scale=1.0)


@pytest.mark.extended  # CI runs the served log-probabilities and the full forward's twins
def test_served_twins_differ(saved):
    """The served test's twins, each through the engine: the indexer ignored, the
    hyper-connections collapsed, the compressors' pending windows dropped at each chunk."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    assert_differs(served(config.replace(index_topk=10 ** 6), params, prompt), expected,
                   rel=atol, scale=1.0)
    for twin in (one_stream, pending_dropped):
        with twin():
            assert_differs(served(config, params, prompt), expected, rel=atol, scale=1.0)


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_served_greedy_tokens_equal_transformers_generate(saved):
    """13 + 12 tokens: the window (16), 6 CSA entries of which the indexer keeps 3, 3 HCA
    entries; prefill chunks of 8, decode steps of 4 across the entries' edges."""
    _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_paged_cache_decodes_as_generate(saved):
    """--page_size: every cache array is positional, so pages hold the compressors'
    entries and pending windows like keys and values; 12 greedy tokens = generate."""
    _, model, config, params = saved
    prompt = _prompt(21, seed=1)
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                  do_sample=False)[0, len(prompt):].tolist()
    engine = Engine({"batch_size": 2, "seq_length": 48, "min_bucket": 16, "decode_steps": 4,
                     "prefill_chunk_size": 8, "page_size": 8}, FAMILY.bind(config), params)
    engine.claim(1, len(prompt) + 12)
    out = engine.fetch(engine.prefill([prompt], [1], Sampling.empty(1)))
    tokens = [int(out[0][0, 0])]
    for _ in range(3):
        tokens += [int(t) for t in engine.fetch(engine.decode(Sampling.empty(2)))[0][:, 1]]
    assert tokens[:12] == expected


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_the_serve_command_answers_in_bf16_and_refuses_a_prompt_past_the_context(saved):
    """`python -m easylm.serve --load_checkpoint=hf::DIR --dtype=bf16`, in process: a
    greedy completion of up to 12 tokens (the end token may come first); a prompt longer
    than --seq_length is a 400 naming the limit in one line, and the server answers after
    it."""
    from fastapi.testclient import TestClient

    from easylm import flags as flag_lib
    from easylm.models import registry
    from easylm.serving import cli as serving_cli

    directory = saved[0]
    family, argv = registry.from_argv(
        ["serve", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded", "--dtype=bf16",
         "--seq_length=64", "--batch_size=2", "--prefill_chunk_size=16", "--min_bucket=16"],
        detect=True)
    assert family is FAMILY
    config = flag_lib.parse(serving_cli.default_config(family),
                            serving_cli.help_entries(family), argv)
    app, batcher = serving_cli.build(family, config)
    try:
        client = TestClient(app, base_url="http://127.0.0.1")
        ok = client.post("/v1/completions", json={"prompt": _prompt(20), "max_tokens": 12,
                                                  "temperature": 0})
        long = client.post("/v1/completions", json={"prompt": _prompt(80), "max_tokens": 4})
        again = client.post("/v1/completions", json={"prompt": _prompt(5), "max_tokens": 2})
    finally:
        batcher.stop()
    assert ok.status_code == 200, ok.text
    assert 1 <= ok.json()["usage"]["completion_tokens"] <= 12
    assert long.status_code == 400 and "64" in long.text and "\n" not in long.json()[
        "error"]["message"], long.text
    assert again.status_code == 200, again.text


@pytest.mark.extended  # ~300 s on 2 shared cores: the command compiles the 3 layers twice
def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    directory, model, config, _ = saved
    hf_parity.check_training_command(FAMILY, directory, model, tmp_path, _rel(config, 32),
                                     "DeepseekV4ForCausalLM")


def test_export_loads_in_transformers_and_equals_the_directory(tmp_path, saved):
    _, model, config, params = saved
    hf_parity.check_export(FAMILY, model, config, params, tmp_path, "DeepseekV4ForCausalLM",
                           hf.load_hf_params)


def test_the_released_shape_counts_as_its_card():
    """DeepSeek-V4-Flash: 284B parameters, 13B active (the model card)."""
    config = FAMILY.from_preset("deepseek_v4_flash")
    assert round(config.num_parameters() / 1e9) == 284
    assert round(config.num_matmul_parameters() / 1e9) == 13


# Every projection PEFT can adapt, by transformers' module names (HFAdapter.module_path):
# the attention's, the compressors' and the indexer's, the shared and routed experts. Not
# o_a_proj: transformers' grouped linear takes (B, T, G, in/G), which PEFT's LoRA layer
# would adapt as a plain Linear (its B's G * R outputs do not fit the G x R it returns);
# our model reads it in an einsum outside its module, which LoRA refuses in one line.
LORA_TARGETS = (r"(q_a_proj|q_b_proj|kv_proj|o_b_proj|gate_proj|up_proj|down_proj|"
                r"weights_proj)/kernel$|experts/(gate_up_proj|down_proj)$")
LORA_MODULES = ["down_proj", "gate_proj", "kv_proj", "o_b_proj", "q_a_proj", "q_b_proj",
                "up_proj", "weights_proj"]


def test_lora_adapters_as_peft_equal_ours_and_the_merged_export(tmp_path, saved):
    """Random adapters on every adaptable projection and the expert stacks, by PEFT's
    names on transformers' modules (self_attn.q_a_proj, mlp.shared_experts.gate_proj,
    self_attn.compressor.indexer.q_b_proj, ...): PEFT's model on transformers' base = ours
    = the merged export, within the logits' tolerance (24 tokens, 2 more reductions a
    layer for the adapters); twin: PEFT with its adapters disabled."""
    directory, _, config, params = saved
    hf_parity.check_lora_peft(FAMILY, directory, config, params, tmp_path,
                              fp32_rel(max(config.hidden_size, 24), 22 * 3 + 1),
                              LORA_MODULES, LORA_TARGETS)
    # Read back by PEFT's names onto our paths (what serve --lora_checkpoint=DIR does) and
    # written again: the same tensors under the same names.
    from safetensors.numpy import load_file

    from easylm.variants.adapters import Adapters

    adapters_of = Adapters(FAMILY)
    lora, adapters = adapters_of.load_peft(str(tmp_path / "adapter"), config)
    assert "attn/wq_a" in lora.target_modules.replace("\\", "")
    adapters_of.save_peft(str(tmp_path / "again"), adapters_of.lora_model(config, lora),
                          adapters, config)
    first, again = (load_file(tmp_path / d / "adapter_model.safetensors")
                    for d in ("adapter", "again"))
    assert sorted(first) == sorted(again)
    for name in first:
        np.testing.assert_array_equal(first[name], again[name], err_msg=name)


def test_lora_on_the_grouped_output_projection_is_one_line(saved):
    from easylm.variants.adapters import Adapters
    from easylm.variants.lora import LoraConfig

    with pytest.raises(UserError, match="could not adapt .*wo_a"):
        Adapters(FAMILY).lora_model(saved[2], LoraConfig(rank=4, target_modules="o_a_proj"))


@pytest.mark.extended  # two train runs' compiles and peft: ~5 min on two shared cores
def test_lora_through_the_command_exports_a_peft_adapter_equal_to_the_merged(tmp_path, saved,
                                                                          monkeypatch):
    """test_deepseek_v3's LoRA check on a DeepSeek-V4 directory: 2 steps of `python -m
    easylm.train --lora.*` with LORA_TARGETS (transformers' names), the PEFT adapter on
    transformers' base = the merged export, to the logits' tolerance over this model's 22
    reductions a layer (20, the adapters' 2), twice for the two exports; twin: the base
    alone."""
    from test_deepseek_v3 import lora_logprobs

    directory, _, config, _ = saved
    before, peft, merged = lora_logprobs(tmp_path, directory, LORA_TARGETS, LORA_MODULES,
                                         monkeypatch)
    rel = 2 * fp32_rel(max(config.hidden_size, 40), 22 * config.num_hidden_layers + 1)
    scale = float(np.abs(merged).max())
    assert_close(peft, merged, rel, scale)
    assert_differs(before, merged, rel, scale)
