"""DeepSeek sparse attention (easylm/models/sparse_attention.py) through its two families,
deepseek_v32 (DeepSeek-V3.2) and glm_moe_dsa (GLM-5), against transformers 5.25: tiny
random directories saved by transformers (fp32; MLA with a q latent, an indexer keeping
16 keys of a 300-token prompt, its k_norm perturbed, 2 expert groups, a dense first
layer, the routers scaled 5x and a random correction bias; GLM-5's third layer shares
the second's keys) read through hf::DIR.

Ties: the indexer's scores are sums over heads of w * relu(q.k), exactly 0 where every
head's q.k <= 0; torch.topk and lax.top_k break such ties differently. With 32 indexer
heads no boundary of these prompts falls on a tie (measured in float64: the smallest
relative gap at the top-k boundary is ~5e-6, well above the fp32 error of the scores);
with 8 heads and a perturbed k_norm bias, several did.
"""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import jax.numpy as jnp
import hf_parity

from easylm.models import registry, sparse_attention
from easylm.serving import engine as engine_lib

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300
TOPK = 16  # below the prompt, and below the greedy test's 13 + 12 tokens
ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM",
                 "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def _save(name, directory):
    torch.manual_seed(0)
    fields = dict(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                  topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                  max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, index_topk=TOPK, index_n_heads=32,
                  index_head_dim=16)
    if name == "glm_moe_dsa":
        model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(
            **fields, indexer_types=["full", "full", "shared"]))
    else:
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**fields))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "k_norm.weight" in key:
                p.add_(0.3 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.mul_(5.0)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8))
    model.eval().save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def saved(request, tmp_path_factory):
    name = request.param
    directory = str(tmp_path_factory.mktemp(name))
    model = _save(name, directory)
    family = registry.get(registry.family_of(f"hf::{directory}"))
    assert family.name == name
    config = family.hf.read_config(directory)
    return family, directory, model, config, family.hf.read_params(directory, config)


def _rel(config, terms=PROMPT, per_layer=11):
    """Relative error of the logits: per layer 11 reductions in sequence (DeepSeek-V3's:
    the q latent and its norm, q_b, the kv latent and its norm, kv_b, scores, their
    weighted sum, o; the router, gate/up, down) over at most max(D, F, keys) terms, then
    the head; 13 where the keys are gathered (absorbed: the query through kv_b's key half
    and the output through its value half in place of kv_b). The indexer only chooses
    keys: with no tie at the boundary (module docstring) it adds no error."""
    return fp32_rel(max(config.hidden_size, config.intermediate_size, terms),
                    per_layer * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def test_served_logprobs_and_greedy_tokens_match_transformers(saved, monkeypatch):
    """The engine (its default `topk_attention=auto`: here each query attends to its 16
    kept latents only, gathered) prefilling a 300-token prompt in chunks of 64 over a cache
    of 320, then decoding over it: the prompt's log-probabilities = transformers' (the
    masked reference), 12 greedy tokens after it = `generate`. Twins (the same tolerance):
    the indexer ignored (a full forward keeping every key), and the invisible keys of
    queries that see fewer than k (the first 15 positions, whose chunk's later keys are
    already cached) left unmasked in the gather (which `auto` must have chosen to differ)."""
    family, _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config, per_layer=13) * float(np.abs(logits).max())

    def engine():
        return engine_lib.Engine({"batch_size": 1, "seq_length": 320, "min_bucket": 64,
                                  "decode_steps": 4, "prefill_chunk_size": 64},
                                 family.bind(config), params)

    served = engine()
    assert_close(served.score([prompt[:-1]], [prompt[1:]])[0][0], expected, rel=atol,
                 scale=1.0)
    out = served.fetch(served.prefill([prompt], [0], engine_lib.Sampling.empty(1)))
    tokens = [int(out[0][0, 0])]
    for _ in range(3):
        tokens += [int(t) for t in served.fetch(served.decode(
            engine_lib.Sampling.empty(1)))[0][:, 0]]
    with torch.no_grad():
        assert tokens[:12] == model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                             do_sample=False)[0, PROMPT:].tolist()
    dense = family.module_class(config.replace(index_topk=PROMPT))
    assert_differs(hf_parity.module_logprobs(dense, params, prompt), expected, rel=atol,
                   scale=1.0)
    unmasked = sparse_attention.gathered_attention
    monkeypatch.setattr(sparse_attention, "gathered_attention", lambda q, kv, keys, scale: (
        unmasked(q, kv, keys._replace(valid=keys.valid | True), scale)))
    assert_differs(engine().score([prompt[:-1]], [prompt[1:]])[0][0], expected, rel=atol,
                   scale=1.0)


@pytest.mark.extended  # CI runs the engine's default (auto) only (its time budget)
def test_masked_and_gathered_keys_serve_alike(saved):
    """`topk_attention=mask` and `gather` forced: the engine's log-probabilities of the
    prompt in chunks of 64 agree (each within the tolerance of transformers'); twin: one
    key more kept in the gather."""
    family, _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config, per_layer=13) * float(np.abs(logits).max())

    def scored(config):
        return engine_lib.Engine({"batch_size": 1, "seq_length": 320, "min_bucket": 64,
                                  "prefill_chunk_size": 64}, family.bind(config),
                                 params).score([prompt[:-1]], [prompt[1:]])[0][0]

    mask, gather = scored(config.replace(topk_attention="mask")), \
        scored(config.replace(topk_attention="gather"))
    assert_close(gather, mask, rel=2 * atol, scale=1.0)
    assert_differs(scored(config.replace(topk_attention="gather", index_topk=TOPK + 1)),
                   mask, rel=2 * atol, scale=1.0)


def test_auto_gathers_where_it_counts_fewer_flops():
    """`auto`'s rule at DeepSeek-V3.2's shape: a decode step gathers once the cache holds
    more than the 2048 kept keys; a prefill chunk of 512 over 32k positions gathers (the
    masked form would expand every cached latent), one of 2048 over 4096 does not (the
    absorbed form costs 1088 multiply-adds a head and pair against the expanded 320)."""
    config = registry.get("deepseek_v32").from_preset("deepseek_v3_2")
    mla, k = config.mla(), config.index_topk
    assert sparse_attention.gather_pays(mla, 1, 32768, k, dense_absorbs=True)
    assert not sparse_attention.gather_pays(mla, 1, 2048, k, dense_absorbs=True)
    assert sparse_attention.gather_pays(mla, 512, 32768, k, dense_absorbs=False)
    assert not sparse_attention.gather_pays(mla, 2048, 4096, k, dense_absorbs=False)


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_served_greedy_tokens_equal_transformers_generate(saved):
    family, _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, family.bind(config), params)


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    """Rows of 32 > the 16 keys kept: the loss is the sparse model's."""
    family, directory, model, config, _ = saved
    hf_parity.check_training_command(family, directory, model, tmp_path, _rel(config, 32),
                                     ARCHITECTURES[family.name])


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_export_loads_in_transformers_and_equals_served(tmp_path, saved):
    family, _, model, config, params = saved
    read = lambda d: (family.hf.read_config(d), family.hf.read_params(d, config))
    hf_parity.check_export(family, model, config, params, tmp_path, ARCHITECTURES[family.name],
                           read)


@pytest.mark.extended  # CI runs the served log-probabilities only (its time budget)
def test_lora_through_the_command_exports_a_peft_adapter_equal_to_the_merged(tmp_path, saved,
                                                                          monkeypatch):
    """test_deepseek_v3's LoRA check on a DSA directory: 2 steps of `python -m easylm.train
    --lora.*` on MLA's projections, the MLPs and the routed experts (the indexer is not a
    target: it gets no gradient); the PEFT adapter on transformers' base = the merged export
    (tolerance as there); twin: the base alone."""
    from test_deepseek_v3 import MLA_TARGETS, lora_logprobs

    _, directory, _, config, _ = saved
    before, peft, merged = lora_logprobs(
        tmp_path, directory, MLA_TARGETS,
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
         "up_proj", "down_proj"], monkeypatch)
    rel = 2 * fp32_rel(max(config.hidden_size, config.intermediate_size, 40),
                       14 * config.num_hidden_layers + 1)
    scale = float(np.abs(merged).max())
    assert_close(peft, merged, rel, scale)
    assert_differs(before, merged, rel, scale)


@pytest.mark.parametrize("name,preset", [("deepseek_v32", "deepseek_v3_2"),
                                         ("glm_moe_dsa", "glm_5")])
def test_the_planners_few_layers_of_a_released_shape_keep_one_dense_layer(name, preset):
    """The planner traces 1 and 2 layers (`shard_variant`): with 3 dense layers first in
    the preset, the few layers are checked as 1 dense first, not refused (they were)."""
    config = registry.get(name).from_preset(preset)
    assert config.first_k_dense_replace == 3
    for layers in (1, 2):
        assert config.shard_variant(layers, 1).layer_kinds()[0] == "dense"
    assert config.shard_variant(2, 1).layer_kinds()[1] == "moe"


def _loss_and_grads(model, params, ids, segment_ids):
    """Mean next-token cross-entropy of rows `ids`, its logits and its gradient."""
    def loss(p):
        logits = model.forward(p, ids[:, :-1], segment_ids=segment_ids[:, :-1]).logits
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean(), logits
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), grads


# CI runs GLM-5's (DeepSeek-V3.2's layers, and shared ones); V3.2's is extended (CI time)
@pytest.mark.parametrize("saved", [pytest.param("deepseek_v32", marks=pytest.mark.extended),
                                   "glm_moe_dsa"], indirect=True)
def test_query_blocks_equal_the_mask_in_logits_and_gradients(saved, monkeypatch):
    """`query_block=16` over rows of 45 (the last block ragged; 16 keys kept, below the
    rows; one row packed with two documents): the logits and every parameter's gradient =
    the masked form's (all queries at once). Tolerances: the same keys are kept (the same
    top_k on the same rows), so only summation order differs: the logits within
    `_rel`'s forward chain, each gradient within twice that chain (the backward walks it
    back) of its largest entry; the indexer's gradient is 0 in both (it only chooses), as
    are the routers' correction biases.
    Twin: each block's queries one position late (its causal rows shifted) differs."""
    family, _, _, config, params = saved
    ids = jnp.asarray(np.random.default_rng(1).integers(3, V, (2, 46)))
    segment_ids = jnp.asarray([[1] * 46, [1] * 20 + [2] * 26])
    expected, expected_grads = _loss_and_grads(family.bind(config), params, ids, segment_ids)
    blocked = family.bind(config.replace(query_block=16))
    logits, grads = _loss_and_grads(blocked, params, ids, segment_ids)
    rel = _rel(config, terms=45)
    assert_close(logits, expected, rel)
    flat = jax.tree_util.tree_flatten_with_path(expected_grads)[0]
    untrained = set()
    for (path, want), got in zip(flat, jax.tree.leaves(grads)):
        name = jax.tree_util.keystr(path)
        if not np.any(np.asarray(want)):  # the indexer's, the routers' correction bias
            assert not np.any(np.asarray(got)), name
            untrained.add(name)
        else:
            assert_close(got, want, 2 * rel, err_msg=name)
    assert any("indexer" in name for name in untrained) and len(untrained) < len(flat) / 2
    rows = sparse_attention.QueryBlocks.rows
    monkeypatch.setattr(sparse_attention.QueryBlocks, "rows",
                        lambda self, start, segment_ids, S: rows(self, start + 1, segment_ids, S))
    twin = jax.jit(lambda p: blocked.forward(p, ids[:, :-1], segment_ids=segment_ids[:, :-1]))
    assert_differs(twin(params).logits, expected, rel)


def test_query_blocks_hold_less_memory_than_the_mask():
    """XLA's compiled temporaries of the training gradient (one DSA layer of the debug
    preset, 4 heads, 4 indexer heads, a row of T = 512) with `query_block=32` are below the
    masked form's by at least what the blocks never hold at once: the (T - 32) other
    query rows of the fp32 attention scores (N, T, S) and of the indexer's per-head scores
    (T, H, S) that the whole form makes, (T - 32) x S x (N + H) x 4 bytes (7.5 MiB; the
    (T, S) masks and the probabilities kept for the backward pass come on top: 12.2 MB
    measured). At T = 256 the blocks' own costs (the logits, the projections) still
    weigh: 1.8 MB less measured, the bound 1.75 MiB. Compiled only, nothing run."""
    family = registry.get("deepseek_v32")
    config = family.from_preset("debug").replace(num_hidden_layers=1, first_k_dense_replace=1)
    T, block = 512, 32

    def temporaries(config):
        model = family.bind(config)
        params = jax.eval_shape(model.init_params, jax.random.key(0))

        def loss(p, ids):
            return model.forward(p, ids).logits.astype(jnp.float32).mean()
        ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
        compiled = jax.jit(jax.grad(loss)).lower(params, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    N, H = config.num_attention_heads, config.index_n_heads
    whole, blocked = temporaries(config), temporaries(config.replace(query_block=block))
    assert whole - blocked >= (T - block) * T * (N + H) * 4, (whole, blocked)


def test_a_bad_query_block_is_refused_in_one_line():
    from easylm.errors import UserError

    config = registry.get("glm_moe_dsa").from_preset("debug")
    with pytest.raises(UserError, match=r"--glm_moe_dsa.query_block=-1 must be >= 0"):
        config.replace(query_block=-1)
    with pytest.raises(UserError, match="topk_attention=gather trains through the gather"):
        config.replace(query_block=64, topk_attention="gather")
