"""The DeepSeek sparse attention indexer's KL loss (easylm/models/sparse_attention.py
`indexer_kl`, objectives/indexer_loss.py) against transformers 5.25's own modules on a
tiny random DeepSeek-V3.2 directory (fp32, 2 layers, 16 keys kept of a 40-token row, 32
indexer heads so that no top-k boundary falls on a tie: test_sparse_attention.py's
module docstring): the target p_t is the eager attention's probabilities
(`output_attentions`) summed over heads and L1-normalized, I_t the indexer's scores as its
module computes them (read where it takes its top-k); dense: over every visible key,
sparse: over the kept keys (the indexer's own output), both renormalized there. The dense
target of a layer is its dense attention over what the sparse layers before it give
(that layer's indexer keeping every key), as the model being trained computes it.
"""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax
import jax.numpy as jnp

from easylm.models import registry

V = 512
T = 40
TOPK = 16


ARCHITECTURES = {"deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa"}


@pytest.fixture(scope="module")
def saved(request, tmp_path_factory):
    """DeepSeek-V3.2's directory (2 layers), or where a test asks, GLM-5's (3 layers, the
    third sharing the second's keys: no indexer of its own)."""
    name = getattr(request, "param", "deepseek_v32")
    directory = str(tmp_path_factory.mktemp(name))
    torch.manual_seed(0)
    fields = dict(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        index_topk=TOPK, index_n_heads=32, index_head_dim=16)
    if name == "glm_moe_dsa":
        fields.update(num_hidden_layers=3, indexer_types=["full", "full", "shared"])
    config = getattr(transformers, ARCHITECTURES[name] + "Config")(**fields)
    model = getattr(transformers, ARCHITECTURES[name] + "ForCausalLM")(config)
    model.eval().save_pretrained(directory)
    family = registry.get(name)
    ours = family.hf.read_config(directory)
    return family, directory, ours, family.hf.read_params(directory, ours)


def _ids(seed=0):
    return np.random.default_rng(seed).integers(3, V, (1, T))


def _reference(family, directory, ids, monkeypatch):
    """Per layer: the sparse model's attention probabilities (B, N, T, S), the dense ones
    (that layer's indexer keeping every key, the layers before it as they are: the input
    the sparse model gives it), the indexer's masked scores (B, T, S) and its top-k (B,
    T, k)."""
    scores, kept, inside = [], [], []
    topk = torch.Tensor.topk

    def recording(self, *args, **kwargs):  # the indexer's scores, where it takes the top-k
        if inside:
            scores.append(self.detach().double())
        return topk(self, *args, **kwargs)

    def done(module, args, out):  # a hook that returns None leaves the output as it is
        inside.clear()
        kept.append(out.long())

    model = getattr(transformers, ARCHITECTURES[family.name] + "ForCausalLM").from_pretrained(
        directory, attn_implementation="eager").eval()
    indexers = {i: layer.self_attn.indexer for i, layer in enumerate(model.model.layers)
                if layer.self_attn.indexer is not None}  # GLM-5's shared layers have none
    hooks = [h for indexer in indexers.values() for h in (
        indexer.register_forward_pre_hook(lambda *a: inside.append(1)),
        indexer.register_forward_hook(done))]
    monkeypatch.setattr(torch.Tensor, "topk", recording)

    def attentions():
        with torch.no_grad():
            return [a.double() for a in model(torch.tensor(ids), output_attentions=True).attentions]

    sparse = attentions()
    for hook in hooks:
        hook.remove()
    inside.clear()
    dense = []
    for layer, indexer in indexers.items():
        indexer.index_topk = T
        dense.append(attentions()[layer])
        indexer.index_topk = TOPK
    return {"sparse": [sparse[i] for i in indexers], "dense": dense}, scores, kept


def _kl(probs, scores, allowed, normalize=True):
    """Each query's KL(p || softmax(I)) over `allowed` (B, T, S), in float64: p the heads'
    sum of `probs` (B, N, T, S), L1-normalized (or not: a twin)."""
    p = probs.sum(1)
    p = p / p.sum(-1, keepdim=True) if normalize else p
    log_q = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    terms = torch.where(allowed & (p > 0), p * (torch.log(p.clamp_min(1e-300)) - log_q), 0.0)
    return terms.sum(-1)


def _sowed(family, config, params, ids, **fields):
    """The per-layer KL the layers sow (L,), through the module as training runs it: a
    batch of the row twice (a mean over queries, so the row's)."""
    model = family.bind(config.replace(indexer_loss_coef=1.0, **fields))
    _, variables = model.apply(params, None, None, {}, jnp.asarray(np.concatenate([ids, ids])),
                               mutable=["indexer"])
    return np.concatenate([np.atleast_1d(v) for v in jax.tree.leaves(variables["indexer"])])


# CI runs DeepSeek-V3.2's; GLM-5's (interleaved rotary, a shared layer) is extended
@pytest.mark.parametrize("saved", ["deepseek_v32", pytest.param(
    "glm_moe_dsa", marks=pytest.mark.extended)], indirect=True)
def test_sowed_kl_equals_transformers_dense_and_sparse(saved, monkeypatch):
    """Each layer's KL (the mean over the row's queries), dense and sparse, = the one
    computed in float64 from transformers' attention probabilities and indexer scores.
    Tolerance: the probabilities and the scores come out of at most 2 layers of fp32
    reductions (`fp32_rel` over the widest sum, 11 in sequence a layer as
    test_sparse_attention's `_rel`), so p and I carry that relative error; the KL's terms
    p (log p - log q) then move by p's error times |log p - log q| plus p times the error
    of log p (relative error of p) and of log q (twice the largest score's absolute error:
    I_s and the log-sum-exp): bounded by rel x (1 + max |log p - log q| + 2 max |I|) a
    query, and so a mean. Twins: p not L1-normalized (the heads' sum), and the sparse KL
    with its restriction dropped on I (softmax over every visible key)."""
    family, directory, config, params = saved
    ids = _ids()
    attentions, scores, kept = _reference(family, directory, ids, monkeypatch)
    visible = torch.ones(T, T, dtype=torch.bool).tril()[None]
    rel = fp32_rel(max(config.hidden_size, config.intermediate_size, T),
                   11 * config.num_hidden_layers + 1)
    for form in ("dense", "sparse"):
        want, twins, bound = [], [], 0.0
        for layer, I in enumerate(scores):
            chosen = torch.zeros(1, T, T, dtype=torch.bool).scatter(-1, kept[layer], True)
            allowed = visible & chosen if form == "sparse" else visible
            probs = attentions[form][layer]
            want.append(float(_kl(probs, I, allowed).mean()))
            twins.append(float(_kl(probs, I, allowed, normalize=False).mean()))
            if form == "sparse":
                twins.append(float(_kl(probs, I, visible).mean()))
            heads = probs.sum(1) / probs.sum(1).sum(-1, keepdim=True)
            bound = max(bound, 1 + 2 * float(I[allowed].abs().max()) + float(
                torch.log(heads[allowed & (heads > 0)]).abs().max()))
        got = _sowed(family, config, params, ids, indexer_loss=form)
        assert got.shape == (len(scores),)
        assert np.all(np.asarray(want) > 0)
        assert_close(got, np.asarray(want), rel * bound, scale=1.0)
        twin = np.asarray(twins).reshape(len(scores), -1)
        for column in twin.T:
            assert_differs(got, column, rel * bound, scale=1.0)


def _grads(family, config, params, ids, segment_ids):
    """The next-token objective's summed loss (with the KL term where the config asks) and
    its gradient, and the logged means, over rows `ids`."""
    from easylm.objectives.next_token import next_token_sums

    model = family.bind(config)
    batch = {"input_tokens": ids[:, :-1], "target_tokens": ids[:, 1:],
             "loss_masks": jnp.ones_like(ids[:, 1:], jnp.float32),
             "segment_ids": segment_ids[:, :-1]}

    def loss(p):
        sums = next_token_sums(model, p, batch, None)
        return sums.loss, sums.means()
    (_, means), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return means, jax.tree_util.tree_flatten_with_path(grads)[0]


def _same(got, want, rel, name):
    """assert_close, or both 0 (the routers' correction bias gets no gradient)."""
    if np.any(np.asarray(want)):
        assert_close(got, want, rel, err_msg=name)
    else:
        assert not np.any(np.asarray(got)), name


def test_the_kl_trains_the_indexer_only_and_blocks_equal_the_whole(saved, monkeypatch):
    """Rows of 40 (one packed with two documents): with the loss on (sparse, coef 1) each
    indexer parameter gets a gradient (0 with it off: the top-k has none) and every other
    parameter's gradient = the loss-off run's (the indexer's inputs detached, the target
    stop-gradient; the same arithmetic: to fp32 rounding of the chain as
    test_sparse_attention's query-block test, twice `rel` of each gradient's largest entry);
    the logged loss = ce_loss + indexer_loss. `query_block=16` (the last block ragged):
    the same KL and indexer gradients (the same keys, summation order only). Twin: without
    the detachment (stop_gradient a no-op) other gradients differ."""
    family, _, config, params = saved
    ids = jnp.asarray(np.random.default_rng(1).integers(3, V, (2, T + 1)))
    segment_ids = jnp.asarray([[1] * (T + 1), [1] * 18 + [2] * (T + 1 - 18)])
    rel = 2 * fp32_rel(max(config.hidden_size, config.intermediate_size, T),
                       11 * config.num_hidden_layers + 1)
    _, off = _grads(family, config, params, ids, segment_ids)
    on = config.replace(indexer_loss_coef=1.0)
    means, grads = _grads(family, on, params, ids, segment_ids)
    assert means["indexer_loss"] > 0
    assert_close(means["loss"], means["ce_loss"] + means["indexer_loss"], rel)
    trained = set()
    for (path, want), (_, got) in zip(off, grads):
        name = jax.tree_util.keystr(path)
        if "indexer" in name:
            assert not np.any(np.asarray(want)) and np.any(np.asarray(got)), name
            trained.add(name.split("indexer")[1])
        else:
            _same(got, want, rel, name)
    assert len(trained) == 5, trained  # wq_b, wk, k_norm's weight and bias, weights_proj
    blocked_means, blocked = _grads(family, on.replace(query_block=16), params, ids,
                                    segment_ids)
    assert_close(blocked_means["indexer_loss"], means["indexer_loss"], rel)
    for (path, want), (_, got) in zip(grads, blocked):
        _same(got, want, 2 * rel, jax.tree_util.keystr(path))
    monkeypatch.setattr(jax.lax, "stop_gradient", lambda x: x)
    _, attached = _grads(family, on, params, ids, segment_ids)
    assert any(np.abs(np.asarray(got) - np.asarray(want)).max() > rel * np.abs(want).max()
               for (path, want), (_, got) in zip(off, attached)
               if "indexer" not in jax.tree_util.keystr(path))


def _command_losses(directory, output_dir, *flags):
    """The logged indexer_loss of 6 steps of `python -m easylm.train --load_checkpoint=
    hf::DIR --deepseek_v32.indexer_loss_coef=1` (rows of 32 > the 16 keys kept, lr 1e-2
    after one warm-up step at 0), run in process."""
    import contextlib
    import io
    import json

    from easylm import train

    with contextlib.redirect_stdout(io.StringIO()):
        train.main(["train", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
                    "--total_steps=6", "--log_freq=1", "--mesh_dim=1,1,-1",
                    "--train_dataset.json_dataset.seq_length=32",
                    "--train_dataset.json_dataset.batch_size=4", "--compilation_cache_dir=",
                    f"--logger.output_dir={output_dir}", "--logger.experiment_id=run",
                    "--optimizer.adamw_optimizer.lr=1e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=1", "--save_model_freq=0",
                    "--deepseek_v32.indexer_loss_coef=1", *flags])
    with open(f"{output_dir}/run/metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "indexer_loss" in row]


@pytest.mark.extended  # CI: the gradients test covers what trains (its time budget)
@pytest.mark.parametrize("flags", [("--dtype=fp32",),
                                   ("--dtype=bf16", "--deepseek_v32.indexer_loss=dense")])
def test_the_train_command_lowers_the_logged_indexer_loss(saved, tmp_path, flags):
    """fp32 with the sparse loss (the model trains too, so its target moves: the loss
    falls over the 6 steps, not at each), bf16 with the dense warm-up (everything but the
    indexers frozen: `ce_loss` moves with the batch only). Each step logs `indexer_loss`
    and a `loss` = ce_loss + the KL (coef 1)."""
    _, directory, _, _ = saved
    rows = _command_losses(directory, tmp_path, *flags)
    assert len(rows) == 6
    kl = [row["indexer_loss"] for row in rows]
    assert kl[-1] < kl[0], kl
    for row in rows:
        assert abs(row["loss"] - row["ce_loss"] - row["indexer_loss"]) < 1e-3 * row["loss"]


def test_bad_indexer_loss_flags_are_one_line(saved, capsys, tmp_path):
    from cli_utils import one_line_error

    from easylm import train

    _, directory, _, _ = saved
    base = ["train", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
            f"--logger.output_dir={tmp_path}"]
    assert one_line_error(train.main, [*base, "--deepseek_v32.indexer_loss=warm"], capsys) \
        == "--deepseek_v32.indexer_loss='warm' is not one of dense, sparse"
    assert "must be >= 0" in one_line_error(
        train.main, [*base, "--deepseek_v32.indexer_loss_coef=-1"], capsys)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    with pytest.raises(SystemExit) as e:  # after the embedded tokenizer's warning line
        train.main([*base, "--deepseek_v32.indexer_loss_coef=1", "--objective=dpo",
                    "--train_dataset.preference.enabled=True",
                    f"--train_dataset.json_dataset.path={pairs}"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and "Traceback" not in "".join(err), err
    assert err[-1] == ("error: --deepseek_v32.indexer_loss_coef=1.0: the indexer's KL loss "
                       "is added by --objective=next_token only, not dpo; set it to 0")


def test_the_dense_warm_up_leaves_all_but_the_indexers_untrained():
    """`indexer_loss=dense` (with a coef) is DeepSeek-V3.2's warm-up: the family's
    `untrained_parameters` (optimizers.leave_untrained: no update, no optimizer state)
    match every path but the indexers'; sparse or off, none. GLM-5 alike (its family is
    V3.2's)."""
    import re

    paths = ["model/layers/0/self_attn/q_a_proj/kernel", "model/embed_tokens/embedding",
             "model/layers/1/mlp/experts/gate_proj", "model/layers/0/self_attn/indexer/wq_b/kernel",
             "model/layers/1/self_attn/indexer/k_norm/bias",
             "model/layers/1/self_attn/indexer/weights_proj/kernel_lora_a"]
    for name in ("deepseek_v32", "glm_moe_dsa"):
        family = registry.get(name)
        config = family.from_preset("debug")
        for fields, frozen in ((dict(indexer_loss_coef=1.0, indexer_loss="dense"), 3),
                               (dict(indexer_loss_coef=1.0), 0),
                               (dict(indexer_loss="dense"), 0)):
            patterns = family.untrained_parameters(config.replace(**fields))
            matched = [p for p in paths if any(re.search(r, p) for r in patterns)]
            assert matched == paths[:frozen], (name, fields, matched)
