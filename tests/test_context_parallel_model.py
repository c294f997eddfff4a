"""The decoder with its sequence split over the mesh axis 'sp' (context parallelism,
easylm/models/context_parallel.py wired in by easylm/models/decoder.py) against the same
model on one device: logits, the next-token loss and its gradients; then the trainer
command under sp (losses, resume, DPO with LoRA, GRPO) and the planner's long-row line.

The model is the debug LLaMA as Mistral (GQA: 4 query heads over 2 kv heads; a sliding
window of 5, shorter than its documents), and Gemma 3's debug model (a sliding and a
global layer, scanned as one block). Rows are packed: row 0 many short documents then
padding, row 1 a 3-token document then one crossing every shard boundary. The batch goes
through the trainer's `split_sequence` (zig-zag order) as in a run.
"""

import contextlib
import functools
import io
import json
import re
import shutil

import jax
import numpy as np
import optax
import pytest

from easylm.data.packing import segment_positions
from easylm.gemma.family import FAMILY as GEMMA
from easylm.llama.family import FAMILY as LLAMA
from easylm.errors import UserError
from easylm.models.context_parallel import (
    STRATEGIES,
    allow_whole_rows,
    block_work,
    from_zigzag,
    to_zigzag,
    use_strategy,
)
from easylm.objectives import preference
from easylm.objectives.next_token import NextToken
from easylm.runtime.sharding import make_mesh
from easylm.training import options, trainer
from easylm.training.state import abstract_state
from easylm.training.step import split_sequence, zigzag_tokens
from numerics import assert_close, assert_differs, forward_rel, logprob_tolerance

B, T = 4, 32  # T: a multiple of 2 * sp for sp = 8
# One layer each kind (compiling the ring's backward dominates this file's time).
MISTRAL = LLAMA.from_preset("debug", model_type="mistral", sliding_window=5,
                            initializer_range=0.1, num_hidden_layers=1)
GEMMA_CONFIG = GEMMA.from_preset("debug", initializer_range=0.1, scan_layers=True,
                                 num_hidden_layers=2)  # one sliding, one global layer


def packed_batch(vocab_size, seed=0):
    """A next-token batch of packed rows (see the module docstring), segment ids and
    positions as data/packing.py makes them."""
    rng = np.random.default_rng(seed)
    ends = np.cumsum(rng.integers(1, 6, size=(B, T)), axis=1)
    segments = np.stack([np.searchsorted(e, np.arange(T), side="right") + 1 for e in ends])
    segments[0, T - 2:] = 0  # padding at the end of a row
    segments[1] = np.where(np.arange(T) < 3, 1, 2)
    segments = segments.astype(np.int32)
    tokens = rng.integers(0, vocab_size, size=(B, T + 1)).astype(np.int32)
    return {"input_tokens": tokens[:, :-1], "target_tokens": tokens[:, 1:],
            "loss_masks": (segments > 0).astype(np.float32), "segment_ids": segments,
            "positions": segment_positions(segments)}


def split_logits(model, params, batch):
    """Logits in the row's own order, the batch in zig-zag order under a mesh with sp > 1."""
    mesh = jax.sharding.get_abstract_mesh()
    sp = 1 if mesh.empty else mesh.shape["sp"]
    order = zigzag_tokens(batch, sp) if sp > 1 else batch
    logits = model.forward(params, order["input_tokens"], positions=order["positions"],
                           segment_ids=order["segment_ids"]).logits
    return from_zigzag(logits, sp) if sp > 1 else logits


def logits_loss_grads(model, params, batch, loss_fn):
    """(logits in the row's own order, the loss's sums, its gradients)."""
    loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, jax.random.key(0), {}).loss)(
        params)
    return split_logits(model, params, batch), loss, grads


@functools.cache
def setup():
    """(model, params, batch, single-device (logits, loss, grads)) of MISTRAL."""
    model = LLAMA.bind(MISTRAL)
    params = model.init_params(jax.random.key(0))
    batch = packed_batch(MISTRAL.vocab_size)
    loss_fn = NextToken(model).loss_fn
    want = jax.jit(functools.partial(logits_loss_grads, model, loss_fn=loss_fn))(params, batch)
    return model, params, batch, want


@functools.cache
def compiled(sp, strategy):
    """The jitted (params, batch) -> (logits, loss, grads) on a mesh of sp x (8 / sp)
    fsdp devices, and its mesh."""
    model, params, batch, _ = setup()
    mesh = make_mesh(f"fsdp={8 // sp},sp={sp}")
    loss_fn = split_sequence(NextToken(model).loss_fn, sp)
    with jax.set_mesh(mesh), use_strategy(strategy):
        program = jax.jit(functools.partial(logits_loss_grads, model, loss_fn=loss_fn)).lower(
            params, batch).compile()
    return program, mesh


def run(sp, strategy, batch=None):
    _, params, default, _ = setup()
    program, mesh = compiled(sp, strategy)
    with jax.set_mesh(mesh):
        return jax.device_get(program(params, default if batch is None else batch))


def check_equal(got, want, config):
    """Logits to the forward's depth (scale: the largest logit), the summed loss to that of
    a sum of B*T log-probabilities, gradients as in tests/test_sharding.py."""
    (logits, loss, grads), (logits1, loss1, grads1) = got, want
    rel = forward_rel(config, T)
    scale = float(np.abs(logits1).max())
    assert_close(logits, logits1, rel)
    assert abs(float(loss) - float(loss1)) <= logprob_tolerance(config, T, scale, B * T)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        assert_close(g, g1, 2 * rel)


@pytest.mark.parametrize("sp", [2, 4, 8])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_split_sequence_equals_one_device(sp, strategy):
    model, params, batch, want = setup()
    check_equal(run(sp, strategy), want, MISTRAL)
    # Negative twin: the packing's segment ids dropped (every row one document).
    dropped = {**batch, "segment_ids": np.ones_like(batch["segment_ids"])}
    assert_differs(run(sp, strategy, dropped)[0], want[0], forward_rel(MISTRAL, T))


def test_gemma_sliding_and_global_layers_scanned():
    """Logits only: the gradients' path is the one the Mistral cases test."""
    assert GEMMA_CONFIG.sliding_window < T  # the window drops keys
    model = GEMMA.bind(GEMMA_CONFIG)
    params = model.init_params(jax.random.key(0))
    batch = packed_batch(GEMMA_CONFIG.vocab_size)
    want = jax.jit(functools.partial(split_logits, model))(params, batch)
    dropped = {**batch, "segment_ids": np.ones_like(batch["segment_ids"])}
    with jax.set_mesh(make_mesh("fsdp=2,sp=4")), use_strategy("ring"):
        forward = jax.jit(functools.partial(split_logits, model))
        got, leaky = forward(params, batch), forward(params, dropped)
    assert_close(got, want, forward_rel(GEMMA_CONFIG, T))
    assert_differs(leaky, want, forward_rel(GEMMA_CONFIG, T))  # twin: segment ids dropped


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_logit_of_another_document_changes(strategy):
    """One input token of a document changed: every logit of every other document stays
    bitwise the same, and later logits of its own document move."""
    _, _, batch, _ = setup()
    segments = batch["segment_ids"]
    place = int(np.flatnonzero(np.diff(segments[0]))[2]) + 1  # a document's first token

    def changed(fed_segments):
        fed = {**batch, "segment_ids": fed_segments}
        perturbed = {**fed, "input_tokens": batch["input_tokens"].copy()}
        perturbed["input_tokens"][0, place] += 1
        before, after = run(4, strategy, fed)[0], run(4, strategy, perturbed)[0]
        moved = (before != after).any(axis=-1)  # (B, T)
        own = segments == segments[0, place]
        own[1:] = False
        return moved[~own].sum(), moved[own].sum()

    other, own = changed(segments)
    assert other == 0 and own > 0
    # Negative twin: the same check with segment ids ignored finds the leak.
    other, _ = changed(np.ones_like(segments))
    assert other > 0


def full_kv_gathers(hlo: str) -> list[str]:
    """All-gathers whose result is a whole row's keys or values (b, T, K, H)."""
    c = MISTRAL
    shape = re.compile(rf"\[\d+,{T},{c.num_key_value_heads},{c.head_dim}\]")
    return [line for line in hlo.splitlines()
            if "all-gather(" in line and shape.search(line.split("all-gather(")[0])]


def test_ring_step_passes_blocks_and_never_gathers_the_whole_kv():
    ring = compiled(4, "ring")[0].as_text()
    assert "collective-permute" in ring
    assert full_kv_gathers(ring) == []
    # Twin: the same inspection finds the gathering strategy's K/V.
    assert full_kv_gathers(compiled(4, "all_gather")[0].as_text())


def test_zigzag_tokens_moves_every_per_token_array_together():
    _, _, batch, _ = setup()
    batch = {k: v for k, v in batch.items() if k != "positions"}  # filled in: 0..T-1
    batch["row_weight"] = np.ones((B,), np.float32)  # per row: left as it is
    order = zigzag_tokens(batch, 4)
    for key in ("input_tokens", "target_tokens", "loss_masks", "segment_ids"):
        np.testing.assert_array_equal(order[key], to_zigzag(batch[key], 4))
    np.testing.assert_array_equal(from_zigzag(order["positions"], 4),
                                  np.broadcast_to(np.arange(T), (B, T)))
    np.testing.assert_array_equal(order["row_weight"], batch["row_weight"])
    # A batch of an objective's own layout (no input_tokens) is left in the row's order.
    own = {"features": batch["input_tokens"]}
    assert zigzag_tokens(own, 4) == own
    with pytest.raises(Exception, match="multiple of 2\\*sp = 16"):
        zigzag_tokens({k: v[:, :24] for k, v in batch.items() if v.ndim == 2}, 8)


def pair_batch(vocab_size, seed=2):
    """Preference pairs as data/pairs.py makes them: prompt then response, padding after,
    the loss on the response; (chosen_*, rejected_*) (B, T)."""
    rng = np.random.default_rng(seed)
    batch = {}
    for side in ("chosen", "rejected"):
        tokens = rng.integers(0, vocab_size, size=(B, T + 1)).astype(np.int32)
        places = np.arange(T)
        prompt, end = rng.integers(2, 9, (B, 1)), rng.integers(12, T, (B, 1))
        batch.update({f"{side}_input_tokens": tokens[:, :-1],
                      f"{side}_target_tokens": tokens[:, 1:],
                      f"{side}_loss_masks": ((places >= prompt) & (places < end)).astype(
                          np.float32)})
    return batch


def test_pairs_and_grpo_rows_in_zigzag_order():
    """Pairs and GRPO's (B, G, T) rows are put in zig-zag order under sp like documents
    (every per-token array with its tokens, positions filled in), which balances the
    causal work of one row over the devices; SimPO's loss on pairs so reordered under
    dp=1,fsdp=2,sp=4 (ring) equals one device's. DPO and GRPO run the same reordering in
    the trainer test below."""
    model, params, _, (logits, _, _) = setup()
    batch = pair_batch(MISTRAL.vocab_size)
    options = preference.get_default_config()
    simpo = preference.make_loss_fn(
        "simpo", options, lambda p, rows: preference.row_logps(model, p, rows))
    loss = lambda p, b, rng, frozen: simpo(p, b, rng)  # noqa: E731
    want = jax.jit(loss)(params, batch, None, {})
    zigzag = split_sequence(loss, 4)
    positions_dropped = lambda p, b, rng, f: loss(  # noqa: E731
        p, {k: v for k, v in zigzag_tokens(b, 4).items() if "positions" not in k}, rng, f)
    with jax.set_mesh(make_mesh("fsdp=2,sp=4")), use_strategy("ring"):
        got, leaky = (jax.device_get(jax.jit(f)(params, batch, None, {}))
                      for f in (zigzag, positions_dropped))
    # A summed log-probability of at most T tokens; SimPO's loss moves by at most beta per
    # nat of either side's (length-normalised) log-probability.
    tolerance = logprob_tolerance(MISTRAL, T, float(np.abs(logits).max()), T)
    for key in ("logps/chosen", "logps/rejected"):
        assert abs(float(got.metrics[key]) - float(want.metrics[key])) <= B * tolerance, key
        # Negative twin: tokens reordered but attention reading their new places.
        assert abs(float(leaky.metrics[key]) - float(want.metrics[key])) > B * tolerance, key
    assert abs(float(got.loss) - float(want.loss)) <= 2 * B * options.simpo.beta * tolerance

    order = zigzag_tokens(batch, 4)
    for side in ("chosen", "rejected"):
        for key in ("input_tokens", "target_tokens", "loss_masks"):
            np.testing.assert_array_equal(order[f"{side}_{key}"],
                                          to_zigzag(batch[f"{side}_{key}"], 4))
        # Each device runs 2sp + 1 ring sub-block pairs per row, in row order 4i + 3.
        positions = order[f"{side}_positions"]
        ones = np.ones_like(positions)
        np.testing.assert_array_equal(block_work(positions, ones, 4), B * 9)
        assert np.ptp(block_work(from_zigzag(positions, 4), ones, 4)) > 1
    # GRPO's rows: (B, G, T) per token, (B, G) per completion.
    G = 2
    grpo = {"input_tokens": np.arange(B * G * T).reshape(B, G, T),
            "old_logps": -np.arange(B * G * T, dtype=np.float32).reshape(B, G, T),
            "advantages": np.arange(B * G, dtype=np.float32).reshape(B, G),
            # routing replay's experts (B, G, L, T, K), with L = T: not to be taken for T's
            "routing": np.arange(B * G * T * T * 2).reshape(B, G, T, T, 2)}
    order = zigzag_tokens(grpo, 4)
    np.testing.assert_array_equal(   # to_zigzag permutes axis 1: move T there and back
        order["routing"], np.moveaxis(to_zigzag(np.moveaxis(grpo["routing"], 3, 1), 4), 1, 3))
    for key in ("input_tokens", "old_logps"):
        np.testing.assert_array_equal(order[key].reshape(B * G, T),
                                      to_zigzag(grpo[key].reshape(B * G, T), 4))
    np.testing.assert_array_equal(order["positions"][0, 1], to_zigzag(np.arange(T)[None], 4)[0])
    np.testing.assert_array_equal(order["advantages"], grpo["advantages"])


def test_parameters_and_optimizer_state_split_over_fsdp_and_sp():
    """Under sp the train state is split as over fsdp * sp devices (MaxText's layout): each
    device holds 1/8 of every parameter and Adam moment on dp=1,fsdp=2,sp=4, as on fsdp=8.
    The trainer test below checks that the step's numbers are unchanged."""
    model, tx = LLAMA.bind(MISTRAL), optax.adamw(1e-3)

    def shards(mesh_dim):
        state = abstract_state(model, tx, make_mesh(mesh_dim), 0)
        return [x.sharding.shard_shape(x.shape) for x in jax.tree.leaves(state)]

    split = shards("fsdp=2,sp=4")
    assert split == shards("fsdp=8")
    # Twin: sp's devices holding whole fsdp shards (the layout before) is not that.
    assert split != shards("fsdp=2,ep=4")


def widest_per_row_place(hlo: str, rows: int, places: int) -> int:
    """The most float values any array of a compiled HLO holds per (row, place) of a
    (rows, places, ...) activation: D / devices where the (B, T, D) activations are split
    over all of them, D where one is whole on a device."""
    arrays = re.findall(rf"\b(?:f32|bf16)\[{rows},{places},([\d,]+)\]", hlo)
    return max((int(np.prod([int(d) for d in dims.split(",")])) for dims in arrays), default=0)


def test_the_sp_train_step_holds_no_whole_activation():
    """The compiled train step under dp=1,fsdp=2,sp=4 holds each (B, T, D) activation or
    gradient in eighths: XLA replicates none to change its split (it did for the embedding:
    from the table's D split to the batch/sp split in one move, and its gather's indices
    split over the batch while its output was not)."""
    from easylm import bench, flags, model_flags
    from easylm.training import optimizers
    from easylm.training.step import device_batch, jit_train_step

    rows, places = 8, 96  # not any dimension of the model, so the search is unambiguous
    argv = ["bench", "--llama.base_model=debug", "--llama.num_hidden_layers=1",
            f"--batch_size={rows}", f"--seq_length={places}", "--mesh_dim=dp=1,fsdp=2,sp=4"]
    config = flags.parse(bench.train_config(LLAMA), bench._train_help(LLAMA), argv)
    mesh = make_mesh(config.mesh_dim)
    model = model_flags.build(LLAMA, config)
    tx, schedule = optimizers.get_optimizer(config.optimizer)
    with jax.set_mesh(mesh):
        state = abstract_state(model, tx, mesh, 0)
        step = jit_train_step(model, tx, schedule, 0, 1, state, mesh)
        batch = device_batch(bench.synthetic_batch(config, model.vocab_size), mesh)
        hlo = step.lower(state, batch).compile().as_text()
    D = model.config["hidden_size"]
    assert 0 < widest_per_row_place(hlo, rows, places) <= D // 8

    # Twin: the move the embedding made before, in one step, and the same search finds
    # the whole (B, T, D) array XLA makes for it.
    from jax.sharding import PartitionSpec as P
    from easylm.runtime.sharding import constrain

    def one_move(x):
        x = constrain(x, P(None, None, ("fsdp", "sp")))
        return constrain(x * 2, P("fsdp", "sp", None)) * 3

    with jax.set_mesh(mesh):
        x = jax.ShapeDtypeStruct((rows, places, D), np.float32)
        twin = jax.jit(one_move).lower(x).compile().as_text()
    assert widest_per_row_place(twin, rows, places) == D


# ------------------------------------------------------------ through the trainer command


@pytest.fixture(scope="module")
def documents_path(tmp_path_factory):
    """Short JSONL documents: many packed into every row of 32 tokens."""
    rng = np.random.default_rng(0)
    words = "the a cat dog ran sat on mat sun moon red blue big small happy sad tree".split()
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, 12)))})
                            + "\n" for _ in range(200)))
    return str(path)


def train(tmp_path, name, *flags):
    """The logged steps of a run of the debug LLaMA (one layer) on rows of 32 tokens, the
    run directory `name` under tmp_path (resumed when it has a checkpoint)."""
    argv = ["train", "--llama.base_model=debug", "--llama.num_hidden_layers=1",
            "--tokenizer=embedded", "--train_dataset.json_dataset.seq_length=32",
            "--train_dataset.json_dataset.batch_size=8", "--dtype=fp32", "--log_freq=1",
            "--optimizer.adamw_optimizer.lr=1e-2", "--optimizer.adamw_optimizer.lr_warmup_steps=0",
            "--optimizer.adamw_optimizer.lr_decay_steps=3",
            f"--logger.output_dir={tmp_path}", f"--logger.experiment_id={name}",
            f"--compilation_cache_dir={tmp_path / 'xla'}", *flags]
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(options.parse_flags(LLAMA, argv), LLAMA)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
    return [row for row in rows if "loss" in row]


def test_train_command_under_sp_equals_fsdp_and_resumes_exactly(tmp_path, documents_path):
    packed = [f"--train_dataset.json_dataset.path={documents_path}",
              "--train_dataset.json_dataset.segment_ids=True"]
    sp = [*packed, "--mesh_dim=dp=1,fsdp=2,sp=4", "--context_parallel=ring"]
    fsdp = train(tmp_path, "fsdp", *packed, "--mesh_dim=1,8,1", "--total_steps=3")
    split = train(tmp_path, "sp", *sp, "--total_steps=3", "--save_model_freq=2")
    rel = 2 * forward_rel(LLAMA.from_preset("debug", num_hidden_layers=1), 32)
    # As tests/test_trainer.py: after Adam's first update only the loss is compared.
    for key in ("loss", "accuracy", "gradient_norm"):
        assert split[0][key] == pytest.approx(fsdp[0][key], rel=rel), key
    for a, b in zip(split[1:], fsdp[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel)
    # As if killed after step 2's checkpoint: its last one removed, the run resumed from
    # step 2 makes bitwise the same step 3.
    shutil.rmtree(tmp_path / "sp" / "checkpoints" / "3")
    resumed = train(tmp_path, "sp", *sp, "--total_steps=3")
    assert [row["step"] for row in resumed] == [1, 2, 3]  # the log rewound to step 2
    assert resumed[-1]["loss"] == split[2]["loss"]
    # Negative twin: the same rows without their segment ids (attention across documents).
    leaky = train(tmp_path, "leaky", *packed, "--mesh_dim=1,8,1", "--total_steps=1",
                  "--train_dataset.json_dataset.segment_ids=False")
    assert leaky[0]["loss"] != pytest.approx(fsdp[0]["loss"], rel=rel)


@pytest.fixture(scope="module")
def pairs_and_prompts(tmp_path_factory):
    """(preference pairs, GRPO prompts with answers) as JSONL, short enough for 32 tokens."""
    rng = np.random.default_rng(1)
    words = "the a cat dog ran sat on mat sun moon red blue big small happy sad tree".split()

    def text(n):
        return " ".join(rng.choice(words, n))

    root = tmp_path_factory.mktemp("objectives")
    pairs, prompts = root / "pairs.jsonl", root / "prompts.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": text(3), "chosen": text(4),
                                         "rejected": text(3)}) + "\n" for _ in range(64)))
    prompts.write_text("".join(json.dumps({"prompt": f"{i % 7} plus {i % 5} is",
                                           "answer": str(i % 7 + i % 5)}) + "\n"
                               for i in range(64)))
    return str(pairs), str(prompts)


@pytest.mark.parametrize("objective", ["dpo_lora", "grpo"])
def test_objectives_and_lora_under_sp_equal_fsdp(tmp_path, pairs_and_prompts, objective):
    pairs, prompts = pairs_and_prompts
    flags = {"dpo_lora": ["--objective=dpo", "--lora.rank=4",
                          f"--train_dataset.json_dataset.path={pairs}",
                          "--train_dataset.preference.enabled=True"],
             "grpo": ["--objective=grpo", f"--train_dataset.json_dataset.path={prompts}",
                      "--grpo.num_generations=2", "--grpo.max_new_tokens=4",
                      "--grpo.reward_funcs=answer_match"]}[objective]
    fsdp = train(tmp_path, "fsdp", "--mesh_dim=1,8,1", "--total_steps=1", *flags)
    split = train(tmp_path, "sp", "--mesh_dim=dp=1,fsdp=2,sp=4", "--total_steps=1", *flags)
    rel = 2 * forward_rel(LLAMA.from_preset("debug", num_hidden_layers=1), 32)
    for key in ("loss", "gradient_norm"):
        assert split[0][key] == pytest.approx(fsdp[0][key], rel=rel, abs=rel), key


# ------------------------------------------------------------ the planner


def test_plan_splits_activations_over_sp_and_finds_the_longest_row():
    """Per device, sp = 4 keeps at most a quarter of the activations of whole rows (whose
    attention also keeps T x T probabilities); the longest row is the one whose plan fits
    the budget exactly."""
    from easylm import flags, plan
    from easylm.llama import train as llama_train

    def parse(mesh_dim, seq_length, *more):
        return flags.parse(plan.default_config(LLAMA),
                           {**llama_train.help_entries(), **plan.HELP},
                           ["plan", "--llama.base_model=debug", "--llama.num_hidden_layers=2",
                            "--train_dataset.json_dataset.batch_size=2",
                            f"--mesh_dim={mesh_dim}",
                            f"--train_dataset.json_dataset.seq_length={seq_length}", *more])

    whole = plan.estimate(parse("1,2,1", 512), LLAMA, num_devices=2)
    split = plan.estimate(parse("dp=1,fsdp=2,sp=4", 512), LLAMA, num_devices=8)
    assert 0 < 4 * split.activations <= whole.activations
    # Parameters and optimizer state split over fsdp * sp = 8 devices, not fsdp = 2 (only
    # norm scales are replicated, so a little over a quarter of fsdp=2's).
    assert 3 * split.parameters < whole.parameters and 3 * split.optimizer < whole.optimizer
    config = parse("dp=1,fsdp=2,sp=4", 64)
    assert plan.longest_row(config, LLAMA, 8, 1, split.total, step=256) == 512
    with pytest.raises(Exception, match="multiple of 2\\*sp = 8"):
        plan.estimate(parse("dp=1,fsdp=2,sp=4", 60), LLAMA, num_devices=8)
    # --context_parallel=all_gather plans what it runs: a layer's backward over the whole
    # K/V and (T/sp) x T scores, more than the ring's blocks; its first fix is the ring.
    gather = parse("dp=1,fsdp=2,sp=4", 512, "--context_parallel=all_gather")
    assert plan.estimate(gather, LLAMA, num_devices=8).total > split.total
    assert plan.find_fix(gather, LLAMA, 8, 1, split.total) == (
        {"context_parallel": "ring"}, split)


def test_a_forward_whose_rows_do_not_split_over_sp_is_refused_in_one_line():
    """Whole-row attention would give the right numbers with none of sp's memory saving:
    the Python API refuses it as the trainer does, unless the caller takes any length."""
    model = LLAMA.bind(MISTRAL)
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    ids = np.zeros((2, 36), np.int32)  # 36: not a multiple of 2 * sp = 8
    with jax.set_mesh(make_mesh("fsdp=2,sp=4")):
        with pytest.raises(UserError) as error:
            jax.eval_shape(model.forward, params, ids)
        assert str(error.value) == ("a forward of 2 rows of 36 tokens under a mesh with sp=4 "
                                    "needs T a multiple of 2*sp = 8 and B of the batch axes' 2 "
                                    "(pad the rows, or run without sp)")
        with allow_whole_rows():
            assert jax.eval_shape(model.forward, params, ids).logits.shape[:2] == (2, 36)
    with jax.set_mesh(make_mesh("sp=8")):  # a parameter init's (1, 8) dummy is no such row
        jax.eval_shape(model.init_params, jax.random.key(0))


def test_serving_refuses_a_split_sequence_in_one_line(capsys):
    from cli_utils import one_line_error
    from easylm.llama import serve

    message = one_line_error(serve.main, ["serve", "--llama.base_model=debug",
                                          "--tokenizer=embedded", "--mesh_dim=fsdp=4,sp=2"],
                             capsys)
    assert message == ("--mesh_dim=fsdp=4,sp=2: serving does not split the sequence; give "
                       "sp=1 (split the devices over fsdp or mp instead)")
