"""GRPO (easylm/objectives/grpo.py, rollouts.py, rewards.py): the loss and its gradient
against an independent float64 computation of TRL's formulas, the advantages against
TRL's, the reward functions, bad setups, and the command learning a synthetic verifiable
task with rollouts that compile nothing after the first step and resume to the same
numbers."""

import collections
import json
import random
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from easylm import variants
from easylm.errors import UserError
from easylm.llama import train as llama_train
from easylm.objectives import grpo, rewards
from easylm.objectives.rollouts import advantages, token_logps

EPS32 = float(np.finfo(np.float32).eps)


# ------------------------------------------------------------ the loss, against float64


def reference_loss(logps, old, ref, adv, masks, o, kl_sign=1.0, clip=True, is_ratio=None,
                   bias_correction=None, level=None):
    """TRL's GRPOTrainer._compute_loss (1.16) in float64 numpy, written from its source
    (not from grpo.py). kl_sign=-1, clip=False and the other bias_correction or level than
    o's are the negative twins' bugs. level sequence (GSPO, trl/trainer/grpo_trainer.py
    at f2cd577): log_importance_weights = (log_ratio * mask).sum(-1) /
    mask.sum(-1).clamp(min=1), one per completion, as coef_1 in the clip and the KL."""
    if bias_correction is None:
        bias_correction = o.use_bias_correction_kl
    level = level or o.importance_sampling_level
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = (log_ratio * masks).sum(-1, keepdims=True) / np.maximum(
            masks.sum(-1, keepdims=True), 1.0)
    ratio = np.exp(log_ratio)
    eps_high = o.epsilon_high or o.epsilon
    clipped = np.clip(ratio, 1 - o.epsilon, 1 + eps_high) if clip else ratio
    a = adv[:, None]
    per_token = -np.minimum(ratio * a, clipped * a)
    if is_ratio is not None:  # vllm_importance_sampling_correction
        per_token = per_token * is_ratio
    if o.beta:
        d = kl_sign * (ref - logps)
        kl = np.exp(d) - d - 1
        if bias_correction:  # use_bias_correction_kl: times the ratio (coef_1)
            kl = kl * ratio
        per_token = per_token + o.beta * kl
    if o.loss_type == "grpo":
        return np.mean((per_token * masks).sum(-1) / np.maximum(masks.sum(-1), 1.0))
    if o.loss_type in ("bnpo", "dapo"):
        return (per_token * masks).sum() / max(masks.sum(), 1.0)
    return (per_token * masks).sum() / (per_token.shape[0] * o.max_new_tokens)  # dr_grpo


def parity_inputs(seed=0, N=6, T=7):
    """float64 inputs: ratios spread over both clip edges (none within 1e-3 of an edge,
    where the branch taken could differ by a rounding), rows of 0 to T completion tokens."""
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.05, 3.0, (N, T))
    shift = rng.uniform(-0.5, 0.5, (N, T))
    for edge in (np.log(0.8), np.log(1.2), np.log(1.28)):
        shift = np.where(np.abs(shift - edge) < 1e-3, shift + 3e-3, shift)
    old = logps - shift
    ref = logps + rng.normal(0, 0.5, (N, T))
    adv = rng.normal(0, 1, N)
    masks = (np.arange(T)[None] < np.asarray([0, 2, 7, 5, 3, 6])[:, None]).astype(np.float64)
    return logps, old, ref, adv, masks


def ours(logps, old, ref, adv, masks, o, is_ratio=None):
    """grpo.py's loss (the mean the step divides out) and its gradient in logps, fp32."""
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)  # noqa: E731

    def loss(lp):
        sums = grpo.grpo_sums(lp, f32(old), f32(ref), f32(adv), f32(masks),
                              jnp.ones(len(adv), jnp.float32), o, is_ratio=f32(is_ratio))
        return sums.loss / sums.weight

    value, grad = jax.value_and_grad(loss)(f32(logps))
    return float(value), np.asarray(grad, np.float64)


def numeric_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += h
        down[i] -= h
        g[i] = (f(up) - f(down)) / (2 * h)
    return g


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("iterations,weights", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_loss_and_gradient_are_trls_formula_in_float64(loss_type, iterations, weights,
                                                       bias_correction):
    """Clipping on both sides (DAPO's clip-higher: epsilon_high 0.28), the k3 KL at beta
    0.1 (times the ratio with use_bias_correction_kl, TRL 1.16's default), each
    aggregation. One iteration: the ratio is exp(logp - logp.detach()) = 1 and the
    gradient the plain policy gradient (plus KL x grad(logp) with the correction); two:
    against the rollouts' old_logps; with weights: truncated importance weights in
    [0.5, 3] on the clipped term. Fails on 4280dbe with the correction on (no such
    option: the gradient lacked KL x grad(logp), 24% of the KL term's)."""
    o = grpo.get_default_config({"loss_type": loss_type, "beta": 0.1, "epsilon": 0.2,
                                 "epsilon_high": 0.28, "max_new_tokens": 7,
                                 "use_bias_correction_kl": bias_correction})
    logps, old, ref, adv, masks = parity_inputs()
    is_ratio = np.random.default_rng(2).uniform(0.5, 3.0, logps.shape) if weights else None
    if iterations == 1:
        old = logps.copy()
    value, grad = ours(logps, None if iterations == 1 else old, ref, adv, masks, o, is_ratio)
    expected = reference_loss(logps, old, ref, adv, masks, o, is_ratio=is_ratio)
    expected_grad = numeric_grad(
        lambda lp: reference_loss(lp, old, ref, adv, masks, o, is_ratio=is_ratio), logps)
    # fp32 rounds each input and each of ~5 operations per token by eps/2; the sum of
    # n <= 23 masked tokens drifts by n*eps times the sum of |terms|. Derived bound:
    # 8 * n * eps * scale, scale = sum |per-token loss| / the denominator.
    n = masks.sum()
    scale = 3 * reference_loss(logps, old, ref, np.abs(adv), masks, o) + 2 * o.beta * n
    assert abs(value - expected) <= 8 * n * EPS32 * scale, (value, expected)
    # Each gradient entry is a few fp32 operations on one token's numbers (|r A| <= 5,
    # |beta (1 - e^(ref - lp))| <= 1) over the denominator: 16 eps of the largest entry.
    atol = 16 * EPS32 * np.abs(expected_grad).max() * 8
    np.testing.assert_allclose(grad, expected_grad, rtol=0, atol=atol)
    assert np.count_nonzero(expected_grad) > n / 2  # the comparison covers real numbers
    if iterations == 2:  # both clip edges are hit
        ratio = np.exp(logps - old)[masks > 0]
        assert (ratio < 0.8).any() and (ratio > 1.28).any()
    # The negative twins: a KL of the wrong sign, no clipping, or the other KL
    # correction, is seen.
    for bug in (dict(kl_sign=-1.0), dict(clip=False), dict(bias_correction=not bias_correction)):
        if bug.get("clip") is False and iterations == 1:
            continue  # a ratio of 1 is never clipped
        wrong = reference_loss(logps, old, ref, adv, masks, o, is_ratio=is_ratio, **bug)
        wrong_grad = numeric_grad(
            lambda lp: reference_loss(lp, old, ref, adv, masks, o, is_ratio=is_ratio, **bug),
            logps)
        assert abs(value - wrong) > 8 * n * EPS32 * scale or \
            np.abs(grad - wrong_grad).max() > atol, bug


MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's


def trl_sampling_weights(old, sampling, mask, mode, cap):
    """TRL's vllm importance sampling weights (trl/trainer/grpo_trainer.py at f2cd577,
    _generate_and_score_completions) in float64: the difference (old - sampling) * mask,
    summed over the completion for sequence_* modes; exp; *_truncate clamps at the cap,
    *_mask fills 0 above it. (N, T), a sequence's weight repeated over its tokens."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = np.repeat(diff.sum(-1, keepdims=True), diff.shape[1], axis=1)
    ratio = np.exp(diff)
    return np.minimum(ratio, cap) if mode.endswith("truncate") else np.where(ratio > cap, 0.0, ratio)


def close_to(value, grad, expected, expected_grad, masks, scale):
    """The bounds of test_loss_and_gradient_are_trls_formula_in_float64."""
    n = masks.sum()
    atol = 16 * EPS32 * np.abs(expected_grad).max() * 8
    return abs(value - expected) <= 8 * n * EPS32 * scale and \
        np.abs(grad - expected_grad).max() <= atol


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("iterations", [1, 2])
def test_sequence_level_ratio_is_trls_gspo(loss_type, iterations):
    """--grpo.importance_sampling_level=sequence: the loss and its gradient equal TRL's
    (float64, from its source) with the length-normalised sequence ratio in the clip and
    the bias-corrected KL; negative twin: the token-level ratio is not within the bound."""
    o = grpo.get_default_config({"loss_type": loss_type, "beta": 0.1, "epsilon": 0.2,
                                 "epsilon_high": 0.28, "max_new_tokens": 7,
                                 "importance_sampling_level": "sequence"})
    logps, old, ref, adv, masks = parity_inputs()
    if iterations == 1:
        old = logps.copy()
    value, grad = ours(logps, None if iterations == 1 else old, ref, adv, masks, o)
    f = lambda lp, **bug: reference_loss(lp, old, ref, adv, masks, o, **bug)  # noqa: E731
    scale = 3 * reference_loss(logps, old, ref, np.abs(adv), masks, o) + 2 * 0.1 * masks.sum()
    assert close_to(value, grad, f(logps), numeric_grad(f, logps), masks, scale)
    wrong = lambda lp: f(lp, level="token")  # noqa: E731
    assert not close_to(value, grad, wrong(logps), numeric_grad(wrong, logps), masks, scale)
    if iterations == 2:  # sequence ratios on both clip edges
        seq = np.exp((np.where(masks > 0, logps - old, 0)).sum(-1) / np.maximum(masks.sum(-1), 1))
        assert ((seq < 0.8) | (seq > 1.28))[masks.sum(-1) > 0].any()


def trl_clip_ratios(logps, old, adv, masks, o, per_token=False):
    """TRL's clip_ratio/low_mean, high_mean, region_mean (trl/trainer/grpo_trainer.py at
    f2cd577, _compute_loss's global_masked_mean): the clipped share of the completion
    tokens, or with a sequence-level ratio ((N, 1), one per completion) of the completions,
    each counted once (x.sum() / x.shape[0]). per_token: the negative twin's bug, a
    sequence's flag counted once per token (easylm before issue 60)."""
    log_ratio = logps - old
    if o.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * masks).sum(-1, keepdims=True) / np.maximum(
            masks.sum(-1, keepdims=True), 1.0)
    ratio, a = np.exp(log_ratio), adv[:, None]
    low = (ratio < 1 - o.epsilon) & (a < 0)
    high = (ratio > 1 + (o.epsilon_high or o.epsilon)) & (a > 0)
    mean = (lambda x: x.sum() / x.shape[0]) if ratio.shape[1] == 1 and not per_token else \
        (lambda x: (x * masks).sum() / masks.sum())
    return {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
            "clip_ratio/region_mean": mean(low | high)}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_ratio_metrics_are_trls(level):
    """The logged clip ratios of each importance_sampling_level are TRL's: with GSPO's
    sequence ratio, the share of completions clipped (each counted once), not of tokens.
    The batch is one where the two counts differ (its completions have 1 to 7 tokens);
    the negative twin, GSPO's flags counted per token, gives other numbers."""
    o = grpo.get_default_config({"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28,
                                 "max_new_tokens": 7, "importance_sampling_level": level})
    rng = np.random.default_rng(5)
    N, T = 8, 7
    logps = -rng.uniform(0.05, 3.0, (N, T))
    old = logps - rng.choice([-0.6, 0.0, 0.6], (N, 1)) - rng.uniform(-0.05, 0.05, (N, T))
    adv = np.asarray([1.0, -1.0] * 4)
    masks = (np.arange(T)[None] < np.asarray([7, 1, 3, 7, 2, 5, 6, 4])[:, None]).astype(
        np.float64)
    sums = grpo.grpo_sums(*(jnp.asarray(x, jnp.float32) for x in (logps, old)), None,
                          jnp.asarray(adv, jnp.float32), jnp.asarray(masks, jnp.float32),
                          jnp.ones(N, jnp.float32), o)
    got = {k: float(v) for k, v in sums.means().items() if k.startswith("clip_ratio/")}
    expected = trl_clip_ratios(logps, old, adv, masks, o)
    # Counts of whole tokens or completions over a count: exact but for one fp32 division.
    assert got == pytest.approx(expected, rel=EPS32, abs=0)
    assert 0 < expected["clip_ratio/low_mean"] and 0 < expected["clip_ratio/high_mean"]
    if level == "sequence":
        wrong = trl_clip_ratios(logps, old, adv, masks, o, per_token=True)
        assert all(abs(wrong[k] - expected[k]) > 0.01 for k in expected), (wrong, expected)


@pytest.mark.parametrize("mode", MODES)
def test_sampling_correction_modes_are_trls(mode):
    """Each --grpo.importance_sampling_mode: the weights from fixed training and sampler
    log-probabilities equal TRL's, and the loss and gradient with them TRL's; negative
    twin: every other mode's weights give another loss or gradient."""
    from easylm.objectives.rollouts import sampling_weights

    o = grpo.get_default_config({"loss_type": "grpo", "beta": 0.1, "max_new_tokens": 7,
                                 "epsilon_high": 0.28})
    logps, old, ref, adv, masks = parity_inputs()
    # the sampler: per-token differences in [-0.9, 0.9] (some above log 2), sums beyond it
    sampling = old - np.random.default_rng(3).uniform(-0.9, 0.9, old.shape)
    cap = 2.0
    diff = (old - sampling) * masks
    got = np.asarray(sampling_weights(jnp.asarray(diff, jnp.float32),
                                      jnp.asarray(masks, jnp.float32), mode, cap))
    expected_w = trl_sampling_weights(old, sampling, masks, mode, cap)
    on = masks > 0
    # exp of a sum of <= 7 fp32 differences: relative error ~ 8 * 7 * eps * |sum|
    np.testing.assert_allclose(got[on], expected_w[on], rtol=64 * 7 * EPS32, atol=0)
    assert ((expected_w[on] == 0) | (expected_w[on] == cap)).any()  # the cap acts
    assert ((expected_w[on] > 0) & (expected_w[on] < cap)).any()
    value, grad = ours(logps, old, ref, adv, masks, o, got)
    f = lambda lp, w: reference_loss(lp, old, ref, adv, masks, o, is_ratio=w)  # noqa: E731
    scale = 3 * 2 * reference_loss(logps, old, ref, np.abs(adv), masks, o) + 2 * 0.1 * masks.sum()
    assert close_to(value, grad, f(logps, expected_w),
                    numeric_grad(lambda lp: f(lp, expected_w), logps), masks, scale)
    for other in MODES:
        if other != mode:
            w = trl_sampling_weights(old, sampling, masks, other, cap)
            assert not close_to(value, grad, f(logps, w),
                                numeric_grad(lambda lp, w=w: f(lp, w), logps), masks,
                                scale), other


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_masked_truncated_completions_change_only_their_rows(loss_type):
    """mask_truncated_completions zeroes a truncated completion's loss mask (rollouts'
    `keep`): its rows' gradient becomes 0 and no other row's changes, but for the token
    count's denominator under bnpo / dapo (every other row scaled alike)."""
    o = grpo.get_default_config({"loss_type": loss_type, "beta": 0.1, "max_new_tokens": 7})
    logps, old, ref, adv, masks = parity_inputs()
    truncated = masks.sum(-1) == masks.shape[1]  # the row of 7 (max_new_tokens) tokens
    assert truncated.sum() == 1
    kept = masks * ~truncated[:, None]
    _, full = ours(logps, old, ref, adv, masks, o)
    _, masked = ours(logps, old, ref, adv, kept, o)
    assert np.abs(full[truncated]).max() > 0 and (masked[truncated] == 0).all()
    factor = masks.sum() / kept.sum() if loss_type in ("bnpo", "dapo") else 1.0
    np.testing.assert_allclose(masked[~truncated], full[~truncated] * factor,
                               rtol=16 * EPS32, atol=16 * EPS32 * np.abs(full).max())


def test_token_logps_are_a_tempered_log_softmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (2, 5, 11))
    targets = rng.integers(0, 11, (2, 5))
    logps, entropy = token_logps(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), 0.7)
    z = logits / 0.7
    log_p = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - z.max(-1, keepdims=True)
    expected = np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
    # logits up to ~15 after the temperature: fp32 keeps ~15 * eps per operation
    np.testing.assert_allclose(logps, expected, atol=64 * 15 * EPS32)
    np.testing.assert_allclose(entropy, -(np.exp(log_p) * log_p).sum(-1), atol=64 * 15 * EPS32)


def trl_advantages(rewards_per_function, weights, scale, G):
    """TRL's sum_then_normalize, row by row with `statistics` (Bessel-corrected std)."""
    out = []
    totals = []
    for row in rewards_per_function:
        known = [w * r for w, r in zip(weights, row) if r is not None]
        totals.append(sum(known) if known else None)
    groups = [totals[i:i + G] for i in range(0, len(totals), G)]
    everything = [t for t in totals if t is not None]
    for group in groups:
        known = [t for t in group if t is not None]
        mean = statistics.fmean(known)
        std = statistics.stdev(everything if scale == "batch" else known)
        for t in group:
            if t is None:
                out.append(0.0)
            elif scale == "none":
                out.append(t - mean)
            else:
                out.append((t - mean) / (std + 1e-4))
    return out


@pytest.mark.parametrize("scale", grpo.SCALE_REWARDS)
def test_advantages_are_trls(scale):
    rng = random.Random(0)
    B, G = 3, 4
    rows = [[rng.choice([0.0, 1.0]), rng.uniform(-1, 0)] for _ in range(B * G)]
    rows[1][0] = None  # one function does not apply
    rows[6] = [None, None]  # no function applies: advantage 0, in no baseline
    weights = np.asarray([1.0, 0.5])
    per_function = np.asarray([[np.nan if r is None else r for r in col] for col in
                               zip(*rows)]).reshape(2, B, G)
    _, adv, _ = advantages(per_function, weights, scale, np.ones((B, G), bool))
    np.testing.assert_allclose(adv.ravel(), trl_advantages(rows, weights, scale, G),
                               rtol=1e-12, atol=1e-12)
    assert adv.ravel()[6] == 0.0


def test_rows_put_the_loss_and_the_engine_logps_on_the_completion_targets():
    """Prompt + completion in a row: the loss mask and the engine's log-probabilities sit
    where the targets are the completion's tokens (EOS included); a row not kept (a
    truncated completion under mask_truncated_completions) has no loss."""
    from easylm.objectives.rollouts import completion_values, token_rows

    prompts, completions = [[1, 5, 6]], [[7, 8, 2], [9, 9]]
    batch = token_rows(prompts, completions, 2, 8, 0, np.asarray([True, False]))
    assert batch["input_tokens"].tolist() == [[1, 5, 6, 7, 8, 2, 0, 0], [1, 5, 6, 9, 9, 0, 0, 0]]
    assert batch["target_tokens"][0].tolist() == [5, 6, 7, 8, 2, 0, 0, 0]
    assert batch["loss_masks"].tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [0] * 8]
    values = completion_values(prompts, [[-0.1, -0.2, -0.3], [-1.0, -2.0]], 2, 8)
    np.testing.assert_array_equal(values[0], np.float32([0, 0, -0.1, -0.2, -0.3, 0, 0, 0]))
    np.testing.assert_array_equal(values[1], np.float32([0, 0, -1, -2, 0, 0, 0, 0]))


# ------------------------------------------------------------ rewards


@pytest.mark.parametrize("completion,answer,expected", [
    ("so the total is #### 1,000", "1000", 1.0),
    ("we get \\boxed{\\frac{3}{4}} done", "0.75", 1.0),
    ("\\boxed{x^{2}} then \\boxed{5}", "#### 5", 1.0),  # the last box; GSM8K's answer
    ("#### $5.00.", "5", 1.0),
    ("#### 6", "5", 0.0),
    ("the answer is 5", "5", 0.0),  # no marker: nothing stated
    ("#### blue", "Blue", 0.0),
    ("#### blue  sky", "blue sky", 1.0),
])
def test_answer_match(completion, answer, expected):
    assert rewards.answer_match(["p"], [completion], answer=[answer]) == [expected]


def test_math_verify_reward():
    pytest.importorskip("math_verify")
    reward = rewards.make_math_verify()
    got = reward(None, ["so \\boxed{\\frac{1}{2}}", "it is $x^2+1$", "\\boxed{3}",
                        [{"role": "assistant", "content": "\\boxed{7}"}]],
                 answer=["0.5", "$1+x^2$", "#### 4", None])
    assert got == [1.0, 1.0, 0.0, None]


def test_format_and_length_penalty():
    fmt = rewards.make_format(rewards.DEFAULT_FORMAT)
    assert fmt(None, ["work #### 4", "\\boxed{4}", "4"]) == [1.0, 1.0, 0.0]
    penalty = rewards.make_length_penalty(8, 4)
    assert penalty(None, None, completion_ids=[[1] * n for n in (3, 4, 6, 8)]) == \
        [0.0, 0.0, -0.5, -1.0]


def test_a_bad_reward_function_is_one_line_naming_it():
    def raises(prompts, completions, **kw):
        raise ValueError("no answer field")

    def short(prompts, completions, **kw):
        return [1.0]

    def text(prompts, completions, **kw):
        return ["1"] * len(completions)

    for function, message in ((raises, "reward function f raised ValueError: no answer field"),
                              (short, "reward function f returned 1 values for 2 completions"),
                              (text, "reward function f returned '1', expected a float or None")):
        with pytest.raises(UserError, match="^" + message.replace("(", r"\(")):
            rewards.score([("f", function)], ["p", "p"], ["a", "b"], [[3], [4]], {})


# ------------------------------------------------------------ the command

REWARD_MODULE = '''
def parity(prompts, completions, completion_ids, target, **fields):
    """The fraction of the completion's tokens (EOS aside) whose id has the parity the
    prompt asks for."""
    out = []
    for ids, t in zip(completion_ids, target):
        ids = [i for i in ids if i != 2]
        out.append(sum(i % 2 == t for i in ids) / len(ids) if ids else 0.0)
    return out


def raises(prompts, completions, **fields):
    raise KeyError("answer")


def too_few(prompts, completions, **fields):
    return [0.0]


def constant(prompts, completions, **fields):
    return [1.0] * len(completions)


def odd_only(prompts, completions, completion_ids, target, **fields):
    """'odd' prompts: whether the first token is odd (a group of G is all 0 or all 1 with
    probability 2 / 2**G); 'even' prompts: 0 (every group without a signal)."""
    return [float(t == 1 and bool(ids) and ids[0] % 2 == 1)
            for ids, t in zip(completion_ids, target)]
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(train prompts, held-out prompts): 'WORD odd:' or 'WORD even:', the reward the
    share of completion tokens of that parity (a random model: 1/2). A policy that ignores
    the prompt stays at 1/2; only one that reads it gains."""
    directory = tmp_path_factory.mktemp("grpo-task")
    (directory / "grpo_task_rewards.py").write_text(REWARD_MODULE)
    words = "the cat dog sun big red day one".split()
    paths = []
    for name, n, seed in (("train", 512, 0), ("held_out", 16, 1)):
        rng = random.Random(seed)
        path = directory / f"{name}.jsonl"
        with open(path, "w") as f:
            for _ in range(n):
                t = rng.randint(0, 1)
                f.write(json.dumps({"prompt": f"{rng.choice(words)} {'odd' if t else 'even'}:",
                                    "target": t}) + "\n")
        paths.append(str(path))
    sys.path.insert(0, str(directory))
    yield paths
    sys.path.remove(str(directory))


STEPS = 30


def command(task, output_dir, **flags):
    train, held_out = task
    flags = {"objective": "grpo", "llama.base_model": "debug", "llama.num_hidden_layers": 1,
             "train_dataset.json_dataset.path": train,
             "train_dataset.json_dataset.seq_length": 24,
             "train_dataset.json_dataset.batch_size": 8, "grpo.num_generations": 8,
             "grpo.max_new_tokens": 8, "grpo.reward_funcs": "grpo_task_rewards:parity",
             "eval_dataset.json_dataset.path": held_out, "eval_freq": 1, "total_steps": STEPS,
             "log_freq": 1, "optimizer.adamw_optimizer.lr": 1e-2,
             "optimizer.adamw_optimizer.lr_warmup_steps": 1,
             "optimizer.adamw_optimizer.lr_decay_steps": STEPS, "compilation_cache_dir": "",
             "logger.output_dir": str(output_dir), "logger.experiment_id": "run", **flags}
    return ["train", *(f"--{k}={v}" for k, v in flags.items())]


@pytest.fixture(scope="module")
def learned(task, tmp_path_factory):
    """(metrics by step, programs lowered per step, per rollout) of STEPS steps of the
    command, in this process. A program lowered while step k's batch is made or trained,
    or k-1's hooks run, counts at k; the final save's are not counted."""
    from jax import monitoring
    from test_checkpoint import metrics

    from easylm.objectives.rollouts import Rollouts
    from easylm.training import logger, run

    output_dir = tmp_path_factory.mktemp("grpo-run")
    step, per_step, per_rollout, saving = [1], collections.Counter(), [], [False]

    def on_compile(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and not saving[0]:
            per_step[step[0]] += 1
            if per_rollout and per_rollout[-1] is not None:
                per_rollout[-1] += 1

    def rollout(self, *args):
        per_rollout.append(0)
        try:
            return real_rollout(self, *args)
        finally:
            per_rollout.append(None)

    real_rollout, real_advance, real_save = Rollouts.rollout, logger.Logger.advance, run.Run.save
    monitoring.register_event_duration_secs_listener(on_compile)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        patch.setattr(Rollouts, "rollout", rollout)
        patch.setattr(logger.Logger, "advance",
                      lambda self, *a: (step.__setitem__(0, step[0] + 1), real_advance(self, *a)))
        patch.setattr(run.Run, "save",
                      lambda self, s: (saving.__setitem__(0, True), real_save(self, s)))
        try:
            llama_train.main(command(task, output_dir))
        finally:
            monitoring.unregister_event_duration_listener(on_compile)
    return metrics(output_dir), per_step, [c for c in per_rollout if c is not None]


def test_grpo_command_learns_a_held_out_verifiable_task(learned):
    """Acceptance 2: the held-out mean reward rises from r0 (step 1's evaluation: its
    update is at learning rate 0, so it is the starting policy's) to at least
    r0 + (1 - r0) / 2."""
    got, _, _ = learned
    assert sorted(got) == list(range(1, STEPS + 1))
    r0, final = got[1]["eval_reward"], got[STEPS]["eval_reward"]
    assert 0.35 <= r0 <= 0.65, r0  # a random model: each parity about half the time
    assert final >= r0 + 0.5 * (1 - r0), (r0, final)
    last = got[STEPS]
    assert 16 * 8 <= last["eval_tokens"] <= 16 * 8 * 8  # dapo's count: completion tokens
    for key in ("reward", "reward_std", "rewards/parity/mean", "completions/mean_length",
                "completions/clipped_ratio", "entropy", "clip_ratio/region_mean",
                "data/rollout/seconds", "data/rollout/train_seconds",
                "data/rollout/tokens_per_second", "data/completions/max_length"):
        assert isinstance(last[key], float), key
    assert last["reward"] == last["rewards/parity/mean"]  # one function, weight 1
    # The engine (KV cache, one token a call) against the training forward, same weights:
    # fp32 rounding of log-probabilities of ~6 (ln 512), a few ulps each.
    assert 0 < last["sampling/sampling_logp_difference/mean"] < 1e-4
    assert abs(last["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4


LORA = {"lora.rank": 8, "lora.target_modules": "(q_proj|v_proj|down_proj|lm_head)/kernel$",
        "grpo.beta": 0.01, "optimizer.adamw_optimizer.lr": 2e-2}


def test_grpo_with_lora_learns_against_the_base_as_its_reference(task, tmp_path):
    """The same task with LoRA adapters (on lm_head too: the random base's body gives the
    others little to steer) and a KL to the base with the adapters off. Steps 1 and 2
    run on unchanged adapters (step 1's update is at lr 0; B is 0), so the reference,
    computed in the rollout's scoring program, equals the policy scored beside it bit
    for bit: KL exactly 0. Later it is not (the negative twin)."""
    from test_checkpoint import metrics

    steps = 24
    llama_train.main(command(task, tmp_path, total_steps=steps, **LORA, **{
        "optimizer.adamw_optimizer.lr_decay_steps": steps}))
    got = metrics(tmp_path)
    assert got[1]["kl"] == 0.0 and got[2]["kl"] == 0.0
    assert got[steps]["kl"] > 1e-3
    r0, final = got[1]["eval_reward"], got[steps]["eval_reward"]
    assert 0.35 <= r0 <= 0.65 and final >= r0 + 0.5 * (1 - r0), (r0, final)


def test_gspo_and_a_sampling_mode_run_with_lora_accumulation_and_iterations(task, tmp_path):
    """The public command with --grpo.importance_sampling_level=sequence and
    --grpo.importance_sampling_mode=sequence_mask under LoRA (a KL to the base), two
    micro-batches and two iterations on each rollout: it trains (a loss, a gradient), and
    the sequence weights, exp of a completion's summed sampler-vs-trainer difference, are
    1 to rounding (the engine samples from the trained forward), none masked."""
    from test_checkpoint import metrics

    steps = 4
    llama_train.main(command(task, tmp_path, total_steps=steps, eval_freq=0, **LORA, **{
        "eval_dataset.json_dataset.path": "", "grpo.num_generations": 4,
        "train_dataset.json_dataset.batch_size": 16, "optimizer.accumulate_gradient_steps": 2,
        "grpo.num_iterations": 2, "grpo.importance_sampling_level": "sequence",
        "grpo.importance_sampling_mode": "sequence_mask",
        "optimizer.adamw_optimizer.lr_decay_steps": steps}))
    got = metrics(tmp_path)
    assert sorted(got) == list(range(1, steps + 1))
    for step, line in got.items():
        assert np.isfinite(line["loss"]) and line["gradient_norm"] > 0, (step, line)
        # a sum of <= 8 per-token differences, each ~1e-6 at fp32 (the rollout's own bound)
        assert abs(line["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, (step, line)
    assert got[steps]["kl"] > 0


def test_dynamic_sampling_trains_no_group_without_a_signal_and_resumes_exactly(task, tmp_path):
    """--grpo.dynamic_sampling=True: half the prompts give every completion reward 0, so
    without it a good share of each step's groups teach nothing; with it no trained group
    has equal rewards, more prompts are rolled out to fill the batch (rounds and drops
    logged), and a run killed (SIGKILL) after step 2's checkpoint and resumed draws the
    same prompts and samples: step 3 bitwise. Twin: the same run without dynamic sampling trains zero-signal groups."""
    import os
    import signal

    from cli_utils import xla_flags
    from test_checkpoint import ENV, metrics, run_until

    def run(directory, steps=3, **flags):
        llama_train.main(command(task, directory, total_steps=steps, eval_freq=0, **{
            "eval_dataset.json_dataset.path": "", "grpo.num_generations": 4,
            "grpo.reward_funcs": "grpo_task_rewards:odd_only",
            "optimizer.adamw_optimizer.lr_decay_steps": 3, **flags}))
        return metrics(directory)

    dynamic = {"grpo.dynamic_sampling": True, "save_model_freq": 2}
    got = run(tmp_path / "dynamic", **dynamic)
    for step, line in got.items():
        assert line["frac_reward_zero_std"] == 0 and line["reward_std"] > 0, (step, line)
        assert line["data/dynamic_sampling/rounds"] >= 2, (step, line)  # half the groups drop
        assert line["data/dynamic_sampling/dropped_groups"] >= 4, (step, line)
        assert line["data/dynamic_sampling/sampled_groups"] == \
            8 * line["data/dynamic_sampling/rounds"], (step, line)
        assert line["data/dynamic_sampling/empty_groups"] == 0 or \
            line["data/dynamic_sampling/rounds"] == 4, (step, line)
    # Killed (SIGKILL) once step 2's checkpoint is complete, then the same command.
    killed = tmp_path / "killed"
    killed.mkdir()
    argv = command(task, killed, total_steps=3, eval_freq=0, **{
        "eval_dataset.json_dataset.path": "", "grpo.num_generations": 4,
        "grpo.reward_funcs": "grpo_task_rewards:odd_only",
        "optimizer.adamw_optimizer.lr_decay_steps": 3, **dynamic})
    env = dict(ENV, XLA_FLAGS=xla_flags(8),
               PYTHONPATH=os.pathsep.join([ENV["PYTHONPATH"], os.path.dirname(task[0])]))
    code, _, _ = run_until([sys.executable, "-m", "easylm.train", *argv[1:]], killed, 2,
                           signal.SIGKILL, env)
    assert code == -signal.SIGKILL
    resumed = run(killed, **dynamic)
    for key in ("loss", "reward", "gradient_norm", "data/dynamic_sampling/rounds",
                "data/dynamic_sampling/dropped_groups", "data/dataset_batches"):
        assert resumed[3][key] == got[3][key], key
    plain = run(tmp_path / "plain", steps=1)
    assert plain[1]["frac_reward_zero_std"] > 0, plain[1]


def test_rollouts_compile_nothing_after_the_first_step(learned):
    """Acceptance 4 (the compilation half): the first rollout lowers the engine's
    programs, and no later step (rollouts, train steps, evaluations) lowers any."""
    _, per_step, per_rollout = learned
    assert per_rollout[0] > 0 and per_step[1] > 0
    assert sum(per_rollout[1:]) == 0, per_rollout
    assert {k: v for k, v in per_step.items() if k > 2 and v} == {}, per_step


@pytest.mark.slow
def test_sigkill_then_resume_regenerates_the_same_rollouts(task, learned, tmp_path):
    """Killed (SIGKILL) at a random step after a checkpoint, then the same command to step
    8: every step's loss, rewards and gradient norm are bitwise those of the uninterrupted
    run (JSON floats round-trip exactly), so the rollouts after the resume were the same:
    their keys come from the seed and the step, the prompts from the data state."""
    import os
    import signal

    from cli_utils import xla_flags
    from test_checkpoint import ENV, metrics, run_until

    got, _, _ = learned
    # Without the evaluations: they draw their own keys and change nothing trained.
    argv = command(task, tmp_path, total_steps=8, eval_freq=0, save_model_freq=3)
    env = dict(ENV, XLA_FLAGS=xla_flags(8),
               PYTHONPATH=os.pathsep.join([ENV["PYTHONPATH"], os.path.dirname(task[0])]))
    code, _, _ = run_until([sys.executable, "-m", "easylm.llama.train", *argv[1:]], tmp_path,
                           np.random.randint(4, 8), signal.SIGKILL, env)
    assert code == -signal.SIGKILL
    llama_train.main(argv)
    resumed = metrics(tmp_path)
    assert sorted(resumed) == list(range(1, 9))
    for s in range(1, 9):
        for key in ("loss", "reward", "reward_std", "gradient_norm",
                    "completions/mean_length", "sampling/sampling_logp_difference/mean"):
            assert resumed[s][key] == got[s][key], (s, key)


# ------------------------------------------------------------ bad setups


def long_prompts(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt": "the cat " * 20, "target": 0}) + "\n"
                            for _ in range(16)))
    return str(path)


@pytest.mark.parametrize("flags,message", [
    ({"grpo.reward_funcs": "nope"}, "--grpo.reward_funcs: unknown reward function 'nope': "
     "not a built-in (answer_match, environment, format, length_penalty, math_verify) "
     "nor module:function"),
    ({"grpo.reward_funcs": "no_such_module_here:f"}, "--grpo.reward_funcs="
     "no_such_module_here:f: cannot import 'no_such_module_here' (ModuleNotFoundError: No "
     "module named 'no_such_module_here')"),
    ({"grpo.reward_funcs": "grpo_task_rewards:nothing"}, "--grpo.reward_funcs="
     "grpo_task_rewards:nothing: module 'grpo_task_rewards' has no function 'nothing'"),
    ({"grpo.reward_funcs": "grpo_task_rewards:parity,format", "grpo.reward_weights": "1"},
     "--grpo.reward_weights has 1 weights for the 2 functions of --grpo.reward_funcs"),
    ({"grpo.num_generations": 1}, "--grpo.num_generations must be >= 2 (a group's rewards "
     "are compared with each other), got 1"),
    ({"grpo.max_new_tokens": 24}, "--grpo.max_new_tokens must be >= 1 and below the row's "
     "seq_length=24, leaving room for a prompt, got 24"),
    ({"grpo.max_sampling_rounds": 0}, "--grpo.max_sampling_rounds must be >= 1, got 0"),
    ({"grpo.decode_from_pages": True}, "--grpo.decode_from_pages needs pages: set "
     "--grpo.page_size"),
    ({"grpo.decode_kernel": "rpa"}, "--grpo.decode_kernel=rpa needs "
     "--grpo.decode_from_pages"),
    ({"grpo.page_size": 2, "grpo.decode_from_pages": True, "grpo.decode_kernel": "rpa",
      "grpo.shared_prefix_attention": True}, "--grpo.shared_prefix_attention needs "
     "--grpo.decode_kernel=batched or batched_vpu and --grpo.share_prompts"),
    ({"grpo.loss_type": "ppo"}, "--grpo.loss_type must be one of grpo, bnpo, dr_grpo, dapo, "
     "got 'ppo'"),
    ({"grpo.importance_sampling_level": "seq"}, "--grpo.importance_sampling_level must be "
     "one of token, sequence, got 'seq'"),
    ({"grpo.importance_sampling_mode": "truncate"}, "--grpo.importance_sampling_mode must be "
     "one of token_truncate, token_mask, sequence_truncate, sequence_mask, got 'truncate'"),
    ({"grpo.importance_sampling_mode": "token_mask", "grpo.temperature": 0.7},
     "--grpo.importance_sampling_mode=token_mask needs the engine's log-probabilities to be "
     "the sampler's: --grpo.temperature=1, --grpo.top_p=1 and --grpo.importance_sampling_cap "
     "> 0 (got 0.7, 1, 3)"),
    ({"train_dataset.json_dataset.path": "embedded"}, "--objective=grpo makes rollouts from "
     "prompts: set --train_dataset.json_dataset.path to JSON lines with a prompt (and the "
     "fields your reward functions read, e.g. answer; docs/rl.md)"),
    ({"lora.rank": 4, "lora.dropout": 0.1}, "--lora.dropout=0.1 does not act in "
     "--objective=grpo (its forward is the serving engine's, which has none): set it to 0"),
    ({"train_dataset.json_dataset.batch_size": 3}, "--train_dataset batch size 3 must be a "
     "multiple of the dp*fsdp=8 batch shards times --optimizer.accumulate_gradient_steps=1"),
])
def test_bad_setup_is_one_line(task, flags, message, capsys, tmp_path):
    from cli_utils import one_line_error

    argv = command(task, tmp_path / "runs", **flags)
    assert one_line_error(llama_train.main, argv, capsys) == message
    assert not (tmp_path / "runs").exists()  # refused before writing anything


def test_prompts_longer_than_the_row_are_one_line(task, capsys, tmp_path, monkeypatch):
    from cli_utils import one_line_error

    monkeypatch.setattr(__import__("logging").getLogger("easylm.data.dataset"), "disabled", True)
    argv = command(task, tmp_path / "runs", eval_freq=0,
                   **{"train_dataset.json_dataset.path": long_prompts(tmp_path)})
    error = one_line_error(llama_train.main, argv, capsys)
    assert error.startswith("no usable document") and "the prompt is 43 tokens, longer than " \
        "the 16 a row leaves it (seq_length - --grpo.max_new_tokens)" in error, error


def test_a_failing_reward_function_stops_the_first_step(task, capsys, tmp_path):
    """At the first step's rollout, before any update (a wrong length is the same path:
    rewards.score, test_a_bad_reward_function_is_one_line_naming_it)."""
    from cli_utils import one_line_error

    argv = command(task, tmp_path, eval_freq=0, total_steps=3,
                   **{"grpo.reward_funcs": "grpo_task_rewards:raises"})
    assert one_line_error(llama_train.main, argv, capsys) == \
        "reward function grpo_task_rewards:raises raised KeyError: 'answer'"
    assert not (tmp_path / "run" / "checkpoints" / "1").exists()


# ------------------------------------------------------------ sharded = single device


def synthetic_batch(B=8, G=4, T=16, seed=0):
    """A GRPO batch as rollouts make one: prompts of 3-6 tokens, completions of 1-9,
    advantages, a reference's log-probabilities, a reward to sum."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 512, (B, G, T + 1)).astype(np.int32)
    masks = np.zeros((B, G, T + 1), np.float32)
    prompts = rng.integers(3, 7, B)
    for b, g in np.ndindex(B, G):
        masks[b, g, prompts[b]:prompts[b] + rng.integers(1, 10)] = 1
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return {"input_tokens": tokens[..., :-1], "target_tokens": tokens[..., 1:],
            "loss_masks": masks[..., 1:], "advantages": f32(rng.normal(0, 1, (B, G))),
            "valid": np.ones((B, G), np.float32),
            "ref_logps": f32(-rng.uniform(3, 8, (B, G, T))),
            "reward": f32(rng.uniform(0, 1, (B, G)))}


def test_trainer_step_sharded_equals_single_device(task):
    """Two train steps of the GRPO loss (beta 0.1) on one device, on a 1,1,8 mesh and on a
    2,2,2 mesh with 2 micro-batches: the same metrics, to the drift of fp32 sums over the batch's
    completion tokens in another order. Negative twin: one prompt's advantages negated."""
    import optax

    from easylm.llama.family import FAMILY
    from easylm.objectives import build
    from easylm.runtime.sharding import make_mesh
    from easylm.training.state import init_state
    from easylm.training.step import device_batch, jit_train_step

    argv = command(task, "/unused", **{"grpo.beta": 0.1, "grpo.num_generations": 4})
    config = llama_train.parse_flags(argv)
    model = variants.build(FAMILY, config)
    objective = build(config, model, None)
    tx = optax.adam(1e-2)
    batch = synthetic_batch()
    flipped = dict(batch, advantages=batch["advantages"].copy())
    flipped["advantages"][0] *= -1

    def run(mesh_dim, devices, accumulate, batches):
        """For each batch, the metrics of two steps from the initialisation (one compile)."""
        mesh = make_mesh(mesh_dim, jax.devices()[:devices])
        with jax.set_mesh(mesh):
            initial = init_state(model, tx, mesh, config.seed)
            initial = initial.replace(frozen={"reference": jax.tree.map(jnp.copy,
                                                                        initial.params)})
            step = jit_train_step(model, tx, optax.constant_schedule(1e-2), config.seed,
                                  accumulate, initial, mesh, objective.loss_fn)
            runs = []
            for batch in batches:
                state, out = jax.tree.map(jnp.copy, initial), []
                for _ in range(2):
                    state, m = step(state, device_batch(batch, mesh))
                    out.append({k: float(v) for k, v in m.items()})
                runs.append(out)
        return runs

    keys = ("loss", "gradient_norm", "param_norm", "kl", "entropy", "reward",
            "clip_ratio/region_mean")
    single, wrong = run("1,1,1", 1, 1, [batch, flipped])
    # Sums over n completion tokens in another order drift by ~n eps relative.
    rtol = batch["loss_masks"].sum() * EPS32
    close = lambda a, b: all(np.isclose(a[k], b[k], rtol=rtol, atol=rtol * 1e-2)  # noqa: E731
                             for k in keys)
    for mesh_dim, accumulate in (("1,1,8", 1), ("2,2,2", 2)):  # all mp; dp x fsdp x mp
        (sharded,) = run(mesh_dim, 8, accumulate, [batch])
        assert all(close(a, b) for a, b in zip(sharded, single)), (mesh_dim, sharded, single)
    assert single[1]["kl"] > 0 and single[0]["loss_tokens"] == batch["loss_masks"].sum()
    assert not close(wrong[0], single[0])


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_a_step_with_no_signal_leaves_the_parameters_bitwise_unchanged(task, tmp_path, beta):
    """Every reward equal: every advantage 0, and on the starting policy the KL to the
    reference (a copy of it) is 0 with a gradient of 0, so two steps at a constant
    learning rate, with no weight decay, change no parameter by a single bit. Fails on
    4280dbe with beta 0.1: the reference's log-probabilities came from the rollout's
    scoring program, the policy's from the train step, and the two forwards differ in
    the last bits, a gradient of ~1e-9 that Adam scales to a full step."""
    from easylm.llama.family import FAMILY
    from easylm.runtime import checkpoint
    from easylm.runtime.sharding import make_mesh
    from easylm.training import trainer
    from easylm.training.state import init_state

    argv = command(task, tmp_path, total_steps=2, eval_freq=0, **{
        "grpo.reward_funcs": "grpo_task_rewards:constant", "grpo.beta": beta,
        "grpo.num_generations": 4,
        "optimizer.adamw_optimizer.init_lr": 1e-2, "optimizer.adamw_optimizer.end_lr": 1e-2,
        "optimizer.adamw_optimizer.weight_decay": 0.0,
        "eval_dataset.json_dataset.path": ""})
    config = llama_train.parse_flags(argv)
    final = trainer.train(config, FAMILY)
    model = variants.build(FAMILY, config)
    import optax

    with jax.set_mesh(make_mesh(config.mesh_dim)):
        start = jax.device_get(init_state(model, optax.adam(1e-2), make_mesh(config.mesh_dim),
                                          config.seed).params)
    after = jax.device_get(checkpoint.load_params(
        f"params::{final}", jax.eval_shape(model.init_params, jax.random.key(0))))
    from test_checkpoint import metrics

    got = metrics(tmp_path)
    assert [got[s]["reward_std"] for s in (1, 2)] == [0.0, 0.0]
    start, after = (traverse_util.flatten_dict(p, sep="/") for p in (start, after))
    assert start.keys() == after.keys()
    assert [key for key in start if not np.array_equal(start[key], after[key])] == []


def test_a_group_prefills_its_prompt_once_and_samples_what_sharing_off_does(task, tmp_path):
    """--grpo.num_generations=8 on a paged cache (--grpo.page_size=2): a step's rollout runs
    each prompt through the model once (rollout/prefill_tokens: the distinct prompts' tokens
    once, the other copies' cached) and its copies hold its full pages once
    (rollout/cache_pages), and its rows (tokens, masks, rewards, advantages) are bitwise
    those of the dense engine with --grpo.share_prompts=False, which prefills all 8 copies
    (the twin: 8x the tokens).
    The engine's log-probabilities and so the loss agree to fp32 rounding, not bitwise:
    XLA's CPU matmul sums a forward of 8 prompt rows in another order than one of 64."""
    from test_checkpoint import metrics

    from easylm.objectives.rollouts import Rollouts
    from easylm.serving.pages import group_pages

    made, firsts, real_rollout = [], [], Rollouts.rollout

    def rollout(self, state, prompts, *args):
        batch, out = real_rollout(self, state, prompts, *args)
        rows = [tuple(t[:n]) for t, n in zip(prompts["prompt_tokens"], prompts["prompt_lengths"])]
        made.append((sum(map(len, rows)), sum(map(len, set(rows))), batch))
        firsts.append(rows)
        return batch, out

    got = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Rollouts, "rollout", rollout)
        for share in (True, False):
            llama_train.main(command(task, tmp_path / str(share), total_steps=1, eval_freq=0,
                                     **{"eval_dataset.json_dataset.path": "",
                                        "grpo.share_prompts": share,
                                        "grpo.page_size": 2 if share else 0}))
            got[share] = metrics(tmp_path / str(share))[1]
    (prompt_tokens, distinct, shared), (_, _, dense) = made
    rows_of_first = firsts[0]
    # A prompt the batch holds twice (the task repeats some) runs once as well.
    assert got[True]["data/rollout/prefill_tokens"] == distinct < prompt_tokens
    assert got[True]["data/rollout/cached_prompt_tokens"] == 8 * prompt_tokens - distinct
    assert got[False]["data/rollout/prefill_tokens"] == 8 * prompt_tokens
    assert got[False]["data/rollout/cached_prompt_tokens"] == 0
    # Each copy of a prompt but the first holds none of its (len - 1) // 2 full pages
    # before its last token; a row holds at most 24 / 2 pages.
    copies = collections.Counter(r for r in rows_of_first for _ in range(8))
    saved = sum((n - 1) * ((len(r) - 1) // 2) for r, n in copies.items())
    assert saved > 0 and 0 < got[True]["data/rollout/cache_pages"] <= 64 * 12 - saved
    assert "data/rollout/cache_pages" not in got[False]
    # The pool is sized for what the groups need (`pages.group_pages`: 8 groups' prompts
    # of up to 24 - 8 tokens once, each row's own pages), not 64 rows x 12 pages, so the
    # rollout holds fewer bytes than the dense cache of its 64 rows (and the rows above
    # show it is enough).
    pool = group_pages(64, 8, 16, 8, 24, 2)
    assert got[True]["data/rollout/cache_pool_pages"] == pool < 64 * 12 + 1
    assert got[True]["data/rollout/cache_bytes"] < got[True]["data/rollout/dense_cache_bytes"]
    _same_rows(shared, dense, got[True]["loss"], got[False]["loss"])


def _same_rows(a: dict, b: dict, loss_a: float, loss_b: float):
    """Two rollouts' rows bitwise equal but the sampler's log-probabilities, and those and
    the losses to fp32 rounding."""
    assert a.keys() == b.keys()
    for key in a:
        if key != "sampling_logps":
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # One layer's forward (D=64, F=256, 24 positions: about 8 reductions) to a log-softmax
    # (twice the logits' error) at the logits' scale, about their log-probabilities'.
    scale = float(np.abs(b["sampling_logps"]).max())
    np.testing.assert_allclose(a["sampling_logps"], b["sampling_logps"], rtol=0,
                               atol=2 * 8 * np.sqrt(256) * EPS32 * scale)
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)


def test_decode_from_pages_samples_the_rows_of_the_window_path(task, tmp_path):
    """--grpo.decode_from_pages (the engine's decode straight from the pages, ragged paged
    attention: its XLA path here) against the same paged rollout gathering windows: the
    engine is the direct one (no window program), and the step's rows (tokens, masks,
    rewards, advantages) are bitwise the window path's. The sampler's log-probabilities
    and the loss (importance-sampled by them) agree to fp32 rounding, not bitwise: the
    paged path scores a query against all of a row's pages (masked) in one einsum, the
    window path against its window, so XLA sums the softmax in another order.
    Without --grpo.page_size the option is refused (test_bad_setup_is_one_line)."""
    from easylm.objectives.rollouts import Rollouts

    direct, real_engine = [], Rollouts._engine

    def engine(self, *args):
        e = real_engine(self, *args)
        direct.append(e.layout.direct)
        return e
    made, got = _paged_steps(task, tmp_path, {
        pages: {"grpo.decode_from_pages": pages} for pages in (True, False)},
        [(Rollouts, "_engine", engine)])
    assert set(direct[:1]) == {True} and set(direct[-1:]) == {False}
    _same_rows(*made, got[True]["loss"], got[False]["loss"])


def test_shared_prefix_attention_samples_the_rows_of_every_row_on_its_own_pages(task,
                                                                                 tmp_path):
    """--grpo.shared_prefix_attention (the engine's --prefix_groups, one group a prompt:
    a group's prompt pages read once a step, paged_attention.shared_prefix_attention's
    XLA path here) against the same rollout with every row over its own page table: the
    rows bitwise, the sampler's log-probabilities and the loss to fp32 rounding (two
    softmaxes merged by log-sum-exp). The engine had a group per prompt and its rows
    were grouped: 8 prompts of 8 copies, every one of the 64 rows in its prompt's group
    (a group per distinct prompt: the task repeats some)."""
    from easylm.serving.pages import PageBook

    grouped, real_groups = [], PageBook.shared_groups

    def groups(book, *args):
        out = real_groups(book, *args)
        grouped.append((int((out["shared"] > 0).sum()), int((out["length"] > 0).sum())))
        return out
    made, got = _paged_steps(task, tmp_path, {shared: {
        "grpo.decode_from_pages": True, "grpo.decode_kernel": "batched",
        "grpo.shared_prefix_attention": shared} for shared in (True, False)},
        [(PageBook, "shared_groups", groups)])
    assert max(grouped)[0] == 64 and 2 <= max(grouped)[1] <= 8
    _same_rows(*made, got[True]["loss"], got[False]["loss"])


def _paged_steps(task, tmp_path, runs: dict, patches=()):
    """One GRPO step on a paged rollout (--grpo.page_size=2) per entry of `runs` (a name
    -> its flags): each step's rows (`Rollouts.rollout`'s batch, in order) and the
    metrics it logged, by name; `patches` (object, attribute, value) set meanwhile."""
    from test_checkpoint import metrics

    from easylm.objectives.rollouts import Rollouts

    made, got, real_rollout = [], {}, Rollouts.rollout

    def rollout(self, state, prompts, *args):
        batch, out = real_rollout(self, state, prompts, *args)
        made.append(batch)
        return batch, out
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Rollouts, "rollout", rollout)
        for target, name, value in patches:
            patch.setattr(target, name, value)
        for name, flags in runs.items():
            llama_train.main(command(task, tmp_path / str(name), total_steps=1, eval_freq=0,
                                     **{"eval_dataset.json_dataset.path": "",
                                        "grpo.page_size": 2, **flags}))
            got[name] = metrics(tmp_path / str(name))[1]
    return made, got
