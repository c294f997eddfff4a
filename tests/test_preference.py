"""DPO, SimPO and ORPO against each paper's formula computed with torch from HF logits;
the objective through the trainer's step and command."""

import json
import logging
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import NamedSharding, PartitionSpec as P
from transformers import LlamaForCausalLM as HFLlama

from easylm import objectives, variants
from easylm.llama import train as llama_train
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.hf import from_hf
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM
from easylm.objectives import preference
from easylm.runtime.sharding import (
    BATCH_AXES,
    make_mesh,
    match_partition_rules,
    named_shardings,
)
from easylm.training.options import run_directory
from easylm.training.state import init_state
from easylm.training.step import device_batch, jit_train_step

T = 16
CONFIG = preference.get_default_config({
    "dpo": {"beta": 0.5, "label_smoothing": 0.1}, "simpo": {"beta": 2.0, "gamma": 0.3},
    "orpo": {"lambda": 0.2}})
SIDES = ("chosen", "rejected")


@pytest.fixture(scope="module")
def models():
    """(our config, policy params, reference params, HF policy, HF reference); the HF
    models in float64, so torch's numbers are the reference for our fp32 ones."""
    config = LLaMAConfig.from_preset("debug", initializer_range=0.2)
    ours, theirs = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        hf = HFLlama(config.to_hf_config()).eval()
        ours.append(from_hf(hf.state_dict(), config))
        theirs.append(hf.double())
    return config, *ours, *theirs


def make_batch(lengths, vocab=512, seed=0):
    """Pairs of (prompt, chosen, rejected) lengths -> a pair batch, each side BOS, the
    prompt, the response, cut at T + 1 tokens and padded with 0; loss on the response."""
    rng = np.random.RandomState(seed)
    batch = {f"{side}_{k}": [] for side in SIDES for k in preference.ROW_KEYS}
    for prompt_length, *response_lengths in lengths:
        prompt = rng.randint(3, vocab, prompt_length)
        for side, n in zip(SIDES, response_lengths):
            tokens = np.concatenate([[1], prompt, rng.randint(3, vocab, n)])[:T + 1]
            masks = np.zeros(T + 1, np.float32)
            masks[1 + prompt_length:len(tokens)] = 1
            tokens = np.pad(tokens, (0, T + 1 - len(tokens)))
            batch[f"{side}_input_tokens"].append(tokens[:-1])
            batch[f"{side}_target_tokens"].append(tokens[1:])
            batch[f"{side}_loss_masks"].append(masks[1:])
    return {k: np.asarray(v, np.float32 if k.endswith("masks") else np.int32)
            for k, v in batch.items()}


def row_logps_fn(config):
    model = LLaMAForCausalLM(config)

    def row_logps(params, rows):
        logits = model.apply({"params": params}, rows["input_tokens"])
        return preference.sequence_logps(logits, rows["target_tokens"], rows["loss_masks"])

    return row_logps


def torch_logps(hf, batch, side):
    """(summed log-probabilities of the masked targets, their count) in float64."""
    with torch.no_grad():
        logits = hf(torch.tensor(batch[f"{side}_input_tokens"], dtype=torch.long)).logits
    targets = torch.tensor(batch[f"{side}_target_tokens"], dtype=torch.long)
    masks = torch.tensor(batch[f"{side}_loss_masks"], dtype=torch.float64)
    token_logps = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    return (token_logps * masks).sum(-1), masks.sum(-1)


def paper_formula(objective, hf_policy, hf_reference, batch):
    """Each paper's loss and the metrics, mean over the pairs, written out in torch."""
    (pc, nc), (pr, nr) = (torch_logps(hf_policy, batch, side) for side in SIDES)
    if objective == "dpo":  # Rafailov et al. 2023 eq. 7; label smoothing: Mitchell 2023
        beta, eps = CONFIG.dpo.beta, CONFIG.dpo.label_smoothing
        rc, rr = (beta * (p - torch_logps(hf_reference, batch, side)[0])
                  for p, side in ((pc, "chosen"), (pr, "rejected")))
        loss = -(1 - eps) * F.logsigmoid(rc - rr) - eps * F.logsigmoid(rr - rc)
    elif objective == "simpo":  # Meng et al. 2024
        beta, gamma = CONFIG.simpo.beta, CONFIG.simpo.gamma
        rc, rr = beta * pc / nc, beta * pr / nr
        loss = -F.logsigmoid(rc - rr - gamma)
    else:  # Hong et al. 2024, odds of the length-normalised likelihood
        lam = CONFIG.orpo["lambda"]
        prob_c, prob_r = torch.exp(pc / nc), torch.exp(pr / nr)
        log_odds_ratio = torch.log((prob_c / (1 - prob_c)) / (prob_r / (1 - prob_r)))
        loss = -pc / nc - lam * F.logsigmoid(log_odds_ratio)
        rc, rr = lam * pc / nc, lam * pr / nr
    return {"loss": loss.mean(), "rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(),
            "rewards/margin": (rc - rr).mean(), "rewards/accuracy": (rc > rr).double().mean(),
            "logps/chosen": pc.mean(), "logps/rejected": pr.mean()}


@pytest.fixture(scope="module")
def evaluate(models):
    """(batch, params=the policy's) -> the PreferenceSums of every objective: one program,
    compiled once per batch shape and sharding. "dpo" takes the reference live, and
    "dpo_precomputed" the logps that `reference_logps` stored in the batch beforehand."""
    config, policy, reference, *_ = models
    row_logps = row_logps_fn(config)
    live = lambda _, rows: row_logps(reference, rows)  # noqa: E731
    loss_fns = {objective: preference.make_loss_fn(objective, CONFIG, row_logps, live)
                for objective in preference.OBJECTIVES}
    loss_fns["dpo_precomputed"] = preference.make_loss_fn("dpo", CONFIG, row_logps)
    program = jax.jit(lambda params, batch: {
        name: loss_fn(params, batch, None) for name, loss_fn in loss_fns.items()})
    precompute = jax.jit(lambda params, batch: preference.reference_logps(row_logps, params,
                                                                           batch))

    def run(batch, params=policy, reference_params=reference):
        batch = dict(batch, **precompute(reference_params, batch))
        return program(params, batch)

    return run


def means(sums):
    return {k: float(v) for k, v in sums.means().items()}


# 8 pairs (one per device of a 1,1,8 mesh): unequal responses, padding, a side that
# exactly fills its row, one-token responses.
LENGTHS = [(3, 5, 9), (6, 10, 2), (1, 1, 12), (4, 7, 7), (2, 12, 3), (8, 1, 4), (5, 3, 3),
           (1, 14, 9)]


@pytest.fixture(scope="module")
def batch():
    return make_batch(LENGTHS)


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_each_loss_is_its_papers_formula(models, evaluate, batch, objective):
    want = paper_formula(objective, *models[3:], batch)
    got = means(evaluate(batch)[objective])
    # fp32 logits of a 2-layer model agree with float64 to ~1e-6 relative; a summed
    # log-probability of <= 15 tokens (|sum| < 100) to ~15 eps |sum| ~ 1e-5 relative at
    # worst, and differences of such sums (DPO's rewards, the margins) keep that
    # absolute error: hence rtol 1e-5 with atol 1e-5. Measured: <= 2e-6 absolute.
    for key, value in want.items():
        np.testing.assert_allclose(got[key], float(value), rtol=1e-5, atol=1e-5, err_msg=key)
    # Negative twin: one more trained token (the prompt's last) must show.
    wrong = dict(batch, chosen_loss_masks=batch["chosen_loss_masks"].copy())
    wrong["chosen_loss_masks"][0, 2] = 1.0
    assert not np.isclose(means(evaluate(wrong)[objective])["loss"], float(want["loss"]),
                          rtol=1e-5, atol=1e-5)


def test_precomputed_reference_gives_the_live_references_losses(models, evaluate, batch):
    sums = evaluate(batch)
    live, precomputed = means(sums["dpo"]), means(sums["dpo_precomputed"])
    # The stored reference log-probabilities come from another program (reference_logps,
    # jitted alone): each a sum of <= 15 tokens (|sum| < 100) that may add in another
    # order, 15 eps of |sum| apart. They enter a reward times beta, and the margin and the
    # loss (a log-sigmoid, slope < 1, of the margin) as a difference of two rewards; the
    # policy's own sums are the same program's in both. (It was atol 1e-5 on sums near
    # -50: 1.7 eps, no room for another order; equal to the bit on this machine.)
    atol = 2 * CONFIG.dpo.beta * 15 * float(np.finfo(np.float32).eps) * 100
    for key, value in live.items():
        np.testing.assert_allclose(precomputed[key], value, rtol=0, atol=atol, err_msg=key)
    # Negative twin: the policy stored as its own reference gives another loss.
    policy = models[1]
    wrong = means(evaluate(batch, reference_params=policy)["dpo_precomputed"])
    assert abs(wrong["loss"] - live["loss"]) > 100 * atol
    loss_fn = preference.make_loss_fn("dpo", CONFIG, row_logps_fn(models[0]))
    with pytest.raises(ValueError, match="dpo needs a reference"):
        loss_fn(policy, batch, None)


def test_sums_add_over_micro_batches_and_empty_pairs_count_nowhere(evaluate, batch):
    """Two micro-batches of 4 pairs (each filled up with 4 empty pairs, as an eval batch's
    end is) add up to the 8 pairs at once: the step's mean over pairs stays exact."""
    empty = {k: np.zeros_like(v[:4]) for k, v in batch.items()}
    halves = [evaluate({k: np.concatenate([v[i:i + 4], empty[k]]) for k, v in batch.items()})
              for i in (0, 4)]
    whole = evaluate(batch)
    for name in whole:
        assert float(halves[0][name].pairs) == float(halves[1][name].pairs) == 4
        added = jax.tree.map(lambda a, b: a + b, halves[0][name], halves[1][name])
        # Sums of 4 + 4 terms against 8 at once: fp32 rounding of a few additions.
        for got, want in zip(jax.tree.leaves(added), jax.tree.leaves(whole[name])):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_an_empty_pair_gives_finite_gradients(objective):
    # ORPO's odds of an empty side would be log(1 - exp(0)) = -inf without the guard.
    policy = preference.Pair(jnp.array([-3.0, 0.0]), jnp.array([-5.0, 0.0]))
    lengths = preference.Pair(jnp.array([2.0, 0.0]), jnp.array([3.0, 0.0]))
    reference = preference.Pair(jnp.array([-4.0, 0.0]), jnp.array([-4.0, 0.0]))

    def loss(policy):
        return preference.preference_sums(objective, policy, reference, lengths, CONFIG).loss

    grads = jax.grad(loss)(policy)
    assert all(np.isfinite(g).all() for g in grads)
    assert grads.chosen[1] == grads.rejected[1] == 0 and grads.chosen[0] != 0


def test_every_option_is_a_flag_with_help():
    from easylm import flags

    assert set(flags.flatten(preference.get_default_config())) == set(preference.HELP)
    parsed = flags.parse(preference.get_default_config(), preference.HELP,
                         ["x", "--orpo.lambda=0.3", "--dpo.label_smoothing=0.2"])
    assert parsed.orpo["lambda"] == 0.3 and parsed.dpo.label_smoothing == 0.2
    with pytest.raises(ValueError, match="unknown preference objective 'ipo'"):
        preference.make_loss_fn("ipo", None, None)


def test_chunked_logps_equal_full_logits():
    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.randn(4, 16, 8), jnp.float32)
    weight = jnp.asarray(rng.randn(8, 32), jnp.float32)
    targets = jnp.asarray(rng.randint(0, 32, (4, 16)))
    masks = jnp.asarray(rng.rand(4, 16) > 0.4, jnp.float32)

    def weighted(logps_fn):
        def f(h, w):
            logps, lengths = logps_fn(h, w)
            return jnp.sum(logps * jnp.arange(1.0, 5.0)), (logps, lengths)
        return jax.value_and_grad(f, (0, 1), has_aux=True)

    full = weighted(lambda h, w: preference.sequence_logps(h @ w, targets, masks))
    chunked = weighted(lambda h, w: preference.chunked_sequence_logps(h, w, targets, masks, 4))
    ((_, want), want_grads), ((_, got), grads) = jax.jit(
        lambda h, w: (full(h, w), chunked(h, w)))(hidden, weight)
    np.testing.assert_array_equal(got[1], masks.sum(1))
    # 16-term sums of fp32 log-probabilities (|logp| < 60): 16 eps relative.
    np.testing.assert_allclose(got[0], want[0], rtol=2e-6)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_dim", ["1,1,8", "2,2,2"])
def test_sharded_equals_single_device(models, evaluate, batch, mesh_dim):
    config, policy, reference, *_ = models
    row_logps = row_logps_fn(config)

    def dpo_sums(params, reference_params, batch):   # the frozen reference an argument
        return preference.make_loss_fn("dpo", CONFIG, row_logps,
                                       lambda _, rows: row_logps(reference_params, rows))(
            params, batch, None)

    mesh = make_mesh(mesh_dim)
    place = lambda params: jax.device_put(  # noqa: E731
        params, named_shardings(mesh, match_partition_rules(PARTITION_RULES, params)))
    with jax.set_mesh(mesh):
        got = jax.jit(dpo_sums)(place(policy), place(reference),
                                jax.device_put(batch, NamedSharding(mesh, P(BATCH_AXES))))
    # The same sums in another order across devices: a few fp32 roundings of sums of
    # 8 pairs' terms (|sum of logps| < 800).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(evaluate(batch)["dpo"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def rule_pairs(rng, n, vocab=64, prompt_length=4, response_length=6):
    """The synthetic task: after a random prompt, the chosen response has only even
    token ids and the rejected one only odd ids (BOS 1 first; no padding)."""
    prompts = rng.randint(3, vocab, (n, prompt_length))
    batch = {}
    for side, parity in zip(SIDES, (0, 1)):
        response = 2 * rng.randint(2, vocab // 2, (n, response_length)) + parity
        tokens = np.concatenate([np.ones((n, 1), np.int64), prompts, response], 1)
        masks = np.zeros(tokens.shape, np.float32)
        masks[:, 1 + prompt_length:] = 1
        batch.update({f"{side}_input_tokens": tokens[:, :-1].astype(np.int32),
                      f"{side}_target_tokens": tokens[:, 1:].astype(np.int32),
                      f"{side}_loss_masks": masks[:, 1:]})
    return batch


def test_a_tiny_model_learns_a_synthetic_preference():
    """DPO: reward accuracy on held-out pairs goes from chance to >= 0.9 and the margin
    grows, with a plain optax loop over make_loss_fn (the trainer's step makes the same
    sums). SimPO and ORPO learn it as fast (measured), and their losses are checked above."""
    config = LLaMAConfig.from_preset("debug", vocab_size=64, hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1)
    reference = jax.jit(LLaMAForCausalLM(config).init_params)(jax.random.PRNGKey(0))
    row_logps = row_logps_fn(config)
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state, batch, reference):
        """One update; the metrics are the batch's before it (so a step on held-out
        pairs whose update is dropped evaluates them, with no second program)."""
        loss_fn = preference.make_loss_fn("dpo", CONFIG, row_logps,
                                          lambda _, rows: row_logps(reference, rows))

        def loss(p):
            sums = loss_fn(p, batch, None)
            return sums.loss / sums.pairs, sums.means()

        grads, metrics = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    def held_out_metrics(params):
        return {k: float(v) for k, v in step(params, opt_state, held_out, reference)[2].items()}

    rng = np.random.RandomState(0)
    held_out = rule_pairs(rng, 32)
    params, opt_state = reference, tx.init(reference)
    before = held_out_metrics(params)
    for _ in range(15):   # measured: accuracy 1.0 after 5 updates, for all three objectives
        params, opt_state, _ = step(params, opt_state, rule_pairs(rng, 32), reference)
    after = held_out_metrics(params)
    # Policy = reference: rewards are 0 up to rounding (the policy's forward pass is
    # differentiated, the reference's is not), so accuracy is a coin toss.
    assert 0.3 <= before["rewards/accuracy"] <= 0.7 and abs(before["rewards/margin"]) < 1e-4, \
        before
    assert after["rewards/accuracy"] >= 0.9, after
    assert after["rewards/margin"] > 0.5, after
    assert after["loss"] < before["loss"]


# -------------------------------------------------------------- through the trainer

WORDS = {"chosen": "red green blue yellow pink brown black white".split(),
         "rejected": "one two three four five six seven eight".split(),
         "prompt": "the cat dog sat on a mat sun moon tree".split()}


def write_rule_pairs(path, n, seed):
    """The synthetic task as text: after a prompt of random words, the chosen response
    names colours and the rejected one numbers."""
    rng = np.random.RandomState(seed)
    words = lambda kind, k: " ".join(rng.choice(WORDS[kind], k))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": words("prompt", 4) + ":", "chosen": " " + words(
                "chosen", 5), "rejected": " " + words("rejected", 5)}) + "\n")
    return str(path)


def trainer_config(**flags):
    """The command's flags for the debug model training DPO on pairs (as parsed)."""
    argv = ["train", "--llama.base_model=debug", "--llama.num_hidden_layers=1", "--objective=dpo",
            *(f"--{k}={v}" for k, v in flags.items())]
    return llama_train.parse_flags(argv)


@pytest.fixture(scope="module")
def step_runs():
    """run(mesh_dim, devices, accumulate, batches) -> for each batch, the metrics of two
    train steps from the initialisation (jit_train_step, compiled once, with the
    objective's loss and the frozen reference in the state)."""
    config = trainer_config(**{"train_dataset.json_dataset.path": "pairs.jsonl"})
    model = variants.build(FAMILY, config)
    objective = objectives.build(config, model, None)
    tx, schedule = optax.adam(1e-2), optax.constant_schedule(1e-2)

    def run(mesh_dim, devices, accumulate, batches):
        mesh = make_mesh(mesh_dim, jax.devices()[:devices])
        with jax.set_mesh(mesh):
            initial = init_state(model, tx, mesh, config.seed)
            # the frozen reference: a copy of the starting parameters, in the state
            initial = initial.replace(frozen={"reference": jax.tree.map(jnp.copy,
                                                                        initial.params)})
            step = jit_train_step(model, tx, schedule, config.seed, accumulate, initial,
                                  mesh, objective.loss_fn)
            runs = []
            for batch in batches:
                state, placed, metrics = (jax.tree.map(jnp.copy, initial),
                                          device_batch(batch, mesh), [])
                for _ in range(2):
                    state, m = step(state, placed)
                    metrics.append({k: float(v) for k, v in m.items()})
                runs.append(metrics)
        return runs

    return run


def test_trainer_step_sharded_equals_single_device(step_runs):
    rules = rule_pairs(np.random.RandomState(0), 8, vocab=512)
    swapped = {k: v.copy() for k, v in rules.items()}   # pair 0 with its sides swapped
    for k in preference.ROW_KEYS:
        swapped[f"chosen_{k}"][0], swapped[f"rejected_{k}"][0] = (rules[f"rejected_{k}"][0],
                                                                  rules[f"chosen_{k}"][0])
    single, wrong = step_runs("1,1,1", 1, 1, [rules, swapped])
    assert single[0]["loss_pairs"] == 8 and single[1]["rewards/margin"] > 0.1, single
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen",
            "logps/rejected", "gradient_norm", "param_norm")
    close = lambda a, b: np.allclose([a[k] for k in keys], [b[k] for k in keys],  # noqa: E731
                                     rtol=1e-5, atol=1e-5)
    # Sums over 8 pairs of 6-token log-probabilities (|sum| < 400) in another order across
    # devices: a few fp32 roundings (phase A's bound for the same sums). 2,2,2 also
    # accumulates 2 micro-batches of 4 pairs, whose sums add to the batch's.
    for mesh_dim, accumulate in (("1,1,8", 1), ("2,2,2", 2)):
        (sharded,) = step_runs(mesh_dim, 8, accumulate, [rules])
        assert all(close(a, b) for a, b in zip(sharded, single)), (mesh_dim, sharded, single)
    # The negative twin: one pair's sides swapped is seen (the comparison can fail).
    assert not close(wrong[1], single[1]), (wrong, single)


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pairs")
    return (write_rule_pairs(directory / "train.jsonl", 256, 0),
            write_rule_pairs(directory / "held_out.jsonl", 16, 1))


def command(pair_files, output_dir, **flags):
    """`python -m easylm.llama.train` flags: DPO on the synthetic task, the held-out pairs
    evaluated after every step, every step logged, a checkpoint every 3 steps."""
    train_path, held_out = pair_files
    flags = {"llama.base_model": "debug", "llama.num_hidden_layers": 1, "objective": "dpo",
             "train_dataset.json_dataset.path": train_path,
             "train_dataset.json_dataset.seq_length": 32,
             "train_dataset.json_dataset.batch_size": 8,
             "eval_dataset.json_dataset.path": held_out, "eval_freq": 1, "total_steps": 10,
             "log_freq": 1, "save_model_freq": 3, "optimizer.adamw_optimizer.lr": 1e-3,
             "optimizer.adamw_optimizer.lr_warmup_steps": 2,
             "optimizer.adamw_optimizer.lr_decay_steps": 10,
             "logger.output_dir": str(output_dir), "logger.experiment_id": "run", **flags}
    return [f"--{k}={v}" for k, v in flags.items()]


@pytest.fixture(scope="module")
def live_run(pair_files, tmp_path_factory):
    """10 steps with a live reference (the initialisation from the seed), uninterrupted,
    in this process (8 devices, as the subprocesses below get)."""
    from test_checkpoint import metrics

    output_dir = tmp_path_factory.mktemp("live")
    llama_train.main(["train", *command(pair_files, output_dir)])
    return metrics(output_dir)


def test_dpo_command_learns_held_out_pairs(live_run):
    first, last = live_run[1], live_run[10]
    # Step 1's update is at lr 0 (warmup), so its evaluation is the reference's own:
    # rewards 0 up to rounding, accuracy a coin toss.
    assert 0.3 <= first["eval_rewards/accuracy"] <= 0.7 and abs(first["eval_rewards/margin"]) < 1e-3
    assert last["eval_rewards/accuracy"] >= 0.9, last
    assert last["eval_rewards/margin"] > first["eval_rewards/margin"] + 0.5, last
    assert last["eval_pairs"] == 16 and last["eval_loss"] < first["eval_loss"]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin",
                "rewards/accuracy", "logps/chosen", "logps/rejected", "tokens_per_second"):
        assert isinstance(last[key], float), key
    assert last["loss_pairs"] == 8 and last["tokens_seen"] == 10 * 2 * 8 * 32  # 2 rows a pair


# Step 1 computes the policy against a reference that is the same model (the starting
# parameters; under LoRA the base with the adapters off, where B = 0 makes them add
# exactly 0): every reward is exactly 0, the loss log(2) = -log_sigmoid(0) in fp32 and the
# accuracy the tie's 1/2. ln 2's fp32 significand ends in three zero bits, so a sum of up
# to 8 copies of it, in any order, is exact. The trainer's own jitted step, on the
# command's data: XLA compiles the policy's forward (under value_and_grad, beside the
# optimizer) and the reference's apart, and they must still agree bitwise.
@pytest.mark.parametrize("lora", [[], ["--lora.rank=4", "--lora.dropout=0.1"]])
def test_dpo_step_one_is_an_exact_tie(pair_files, tmp_path, lora):
    import contextlib

    from easylm.training.setup import start

    tie = {"loss": float(-jax.nn.log_sigmoid(jnp.float32(0))), "rewards/chosen": 0.0,
           "rewards/rejected": 0.0, "rewards/margin": 0.0, "rewards/accuracy": 0.5}
    assert tie["loss"] == float(np.float32(np.log(2)))
    for mesh_dim in ("1,-1,1", "2,2,2"):
        argv = command(pair_files, tmp_path / mesh_dim, eval_freq=0, mesh_dim=mesh_dim,
                       **{"optimizer.adamw_optimizer.lr_warmup_steps": 0})
        with contextlib.ExitStack() as cleanup:
            run = start(llama_train.parse_flags(["train", *argv, *lora]), FAMILY, cleanup)
            batch, _ = next(run.objective.batches(run.dataset, run.place))
            state, first = run.train_step(run.state, batch)
            _, second = run.train_step(state, batch)
        assert {k: float(first[k]) for k in tie} == tie, (mesh_dim, first)
        assert float(second["rewards/margin"]) != 0.0  # the negative twin: step 2 has moved


def test_dpo_sigkill_then_resume_is_bitwise_identical(pair_files, live_run, tmp_path):
    from cli_utils import xla_flags
    from test_checkpoint import ENV, metrics, run_until

    cmd = [sys.executable, "-m", "easylm.llama.train", *command(pair_files, tmp_path)]
    env = dict(ENV, XLA_FLAGS=xla_flags(8))
    code, _, _ = run_until(cmd, tmp_path, np.random.randint(4, 9), signal.SIGKILL, env)
    assert code == -signal.SIGKILL
    # The resumed run reloads the reference from where the run started: the seed's init.
    llama_train.main(["train", *command(pair_files, tmp_path)])
    got = metrics(tmp_path)
    assert sorted(got) == list(range(1, 11))
    for step, line in got.items():  # JSON floats round-trip exactly: this is bitwise
        for key in ("loss", "rewards/margin", "gradient_norm", "eval_loss", "eval_rewards/margin"):
            assert line[key] == live_run[step][key], (step, key)


def test_precomputed_reference_gives_the_live_losses(pair_files, live_run, tmp_path, capsys):
    from test_checkpoint import metrics

    precomputed = command(pair_files, tmp_path, **{"dpo.precompute_reference": True})
    llama_train.main(["train", *precomputed, "--total_steps=5"])
    path = tmp_path / "run" / preference.REFERENCE_FILE
    assert f"into {path}" in capsys.readouterr().out
    llama_train.main(["train", *precomputed])   # resumes at step 5, reading the stored logps
    assert f"reference log-probabilities: {path} (272 pairs)" in capsys.readouterr().out
    got = metrics(tmp_path)
    assert sorted(got) == list(range(1, 11))
    # The stored logps are the live reference's numbers from another program: equal, or a
    # rounding apart (|logps| < 200, and the loss 0.1 * their difference away).
    for step, line in got.items():
        for key in ("loss", "eval_loss"):
            assert line[key] == pytest.approx(live_run[step][key], rel=1e-6, abs=1e-7), (step, key)


# QLoRA: adapters on an nf4 base drawn from the seed, at LoRA's higher learning rate.
QLORA = {"lora.rank": 8, "lora.base_dtype": "nf4", "optimizer.adamw_optimizer.lr": 1e-2}


@pytest.fixture(scope="module")
def qlora_run(pair_files, tmp_path_factory):
    from test_checkpoint import metrics

    output_dir = tmp_path_factory.mktemp("qlora")
    llama_train.main(["train", *command(pair_files, output_dir, **QLORA)])
    return metrics(output_dir), output_dir


def test_dpo_with_qlora_learns_with_the_base_as_its_reference(qlora_run):
    from easylm.runtime import checkpoint

    got, output_dir = qlora_run
    first, last = got[1], got[10]
    # The reference is the base with the adapters off (B zeroed), and B starts at zero:
    # after step 1's lr-0 update policy and reference are the same numbers, bitwise.
    assert first["eval_rewards/margin"] == 0.0 and first["eval_rewards/chosen"] == 0.0
    assert first["eval_loss"] == pytest.approx(np.log(2), rel=1e-6)
    assert last["eval_rewards/accuracy"] >= 0.9, last
    assert last["eval_rewards/margin"] > 0.5, last
    # No second copy of the model: the checkpoint holds the adapters and their optimizer
    # state, and names the base it was trained on.
    step = os.path.join(output_dir, "run", "checkpoints", "10")
    assert checkpoint.read_metadata(step)["frozen"]["source"] == "init"
    assert not os.path.exists(os.path.join(output_dir, "run", preference.REFERENCE_FILE))


def test_qlora_precomputed_reference_gives_the_live_losses(pair_files, qlora_run, tmp_path,
                                                           capsys):
    from test_checkpoint import metrics

    llama_train.main(["train", *command(pair_files, tmp_path, **QLORA,
                                        **{"dpo.precompute_reference": True})])
    assert "objective dpo (precomputed reference)" in capsys.readouterr().out
    live, _ = qlora_run
    got = metrics(tmp_path)
    for step, line in got.items():   # as for the full model's precomputed reference
        for key in ("loss", "eval_loss"):
            assert line[key] == pytest.approx(live[step][key], rel=1e-6, abs=1e-7), (step, key)


def test_mfu_counts_the_reference_forward_with_and_without_lora():
    flags = {"train_dataset.json_dataset.path": "pairs.jsonl"}
    full = variants.build(FAMILY, trainer_config(**flags))
    lora = variants.build(FAMILY, trainer_config(**flags, **{"lora.rank": 4}))
    seq = 32
    # Full: 6N + attention, and the reference's forward, a third of that.
    assert objectives.build(trainer_config(**flags), full, None).flops_per_token(
        seq) == pytest.approx(full.flops_per_token(seq) * 4 / 3, rel=1e-12)
    # LoRA: its own step (no base weight gradients) and the base's forward with the
    # adapters' (2 a weight), not 4/3 of the LoRA step.
    objective = objectives.build(trainer_config(**flags, **{"lora.rank": 4}), lora, None)
    want = lora.flops_per_token(seq) + full.flops_per_token(seq) / 3 + 2 * lora.num_parameters
    assert objective.flops_per_token(seq) == pytest.approx(want, rel=1e-12)
    assert objective.flops_per_token(seq) != pytest.approx(lora.flops_per_token(seq) * 4 / 3,
                                                           rel=1e-3)


@pytest.mark.parametrize("argv, message", [
    (["--objective=ipo"], "--objective='ipo' is not one of next_token, dpo, simpo, orpo, grpo, "
     "distill"),
    (["--objective=dpo"], "--objective=dpo trains on preference pairs: set "
     "--train_dataset.json_dataset.path to JSON lines with prompt, chosen and rejected "
     "(docs/preference.md)"),
    (["--objective=simpo", "--train_dataset.json_dataset.path=PAIRS",
      "--train_dataset.preference.enabled=False"],
     "--objective=simpo trains on preference pairs, but --train_dataset.preference.enabled=False"),
    (["--train_dataset.json_dataset.path=PAIRS", "--train_dataset.preference.enabled=True"],
     "--train_dataset.preference.enabled=True makes batches of preference pairs, which train "
     "with --objective=dpo, simpo, orpo, not the default --objective=next_token"),
    (["--objective=dpo", "--train_dataset.json_dataset.path=PAIRS", "--dpo.beta=0"],
     "--dpo.beta must be > 0, got 0.0"),
    (["--objective=dpo", "--train_dataset.json_dataset.path=PAIRS",
      "--dpo.label_smoothing=0.5"], "--dpo.label_smoothing must be in [0, 0.5), got 0.5"),
])
def test_bad_objective_setup_is_one_clear_line(argv, message, pair_files, capsys, tmp_path):
    from cli_utils import one_line_error

    argv = [a.replace("PAIRS", pair_files[0]) for a in argv]
    assert one_line_error(llama_train.main, ["train", *argv, f"--logger.output_dir={tmp_path}"],
                          capsys) == message
    assert os.listdir(tmp_path) == []  # failed before writing anything


def test_dpo_on_plain_text_blames_the_data_not_the_order(capsys, tmp_path, monkeypatch):
    # Every line lacks prompt/chosen/rejected: no row finds a pair, and shuffling (which
    # the message once suggested) cannot help.
    from cli_utils import one_line_error

    # The skipped lines' warnings go to the log, not to the one line on stderr (a handler
    # an earlier test left on a closed stream would write there).
    monkeypatch.setattr(logging.getLogger("easylm.data.dataset"), "disabled", True)
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(40)))
    error = one_line_error(llama_train.main, [
        "train", "--objective=dpo", f"--train_dataset.json_dataset.path={data}",
        "--llama.base_model=debug", f"--logger.output_dir={tmp_path}/runs", "--total_steps=1"],
        capsys)
    assert error.startswith("no usable document") and error.endswith("fix the data"), error
    assert "prompt" in error  # the skip names the missing field


def test_objective_options_name_the_run_directory_only_when_they_train():
    def run_dir(*argv):
        config = llama_train.parse_flags(["train", "--train_dataset.json_dataset.path=p.jsonl",
                                          *argv])
        return run_directory(config, "llama")

    # Next-token runs keep the directories they had before these flags existed.
    text = run_dir()
    assert run_dir("--dpo.beta=0.3", "--orpo.lambda=0.5") == text
    dpo = run_dir("--objective=dpo")
    assert len({text, dpo, run_dir("--objective=simpo")}) == 3
    assert run_dir("--objective=dpo", "--orpo.lambda=0.5") == dpo   # another objective's
    assert run_dir("--objective=dpo", "--dpo.beta=0.3") != dpo
