"""Tolerances for comparing floating-point results, derived rather than picked.

Two computations of the same math in fp32 (torch and XLA, fused and unfused kernels,
one device and eight, another processor's matmul blocking) differ only in the order
they add things up. Each reordered sum of n terms moves its result by rounding errors
that behave as a random walk: about sqrt(n) ulps of the magnitudes summed (Higham and
Mary, "A new approach to probabilistic rounding error analysis", 2019; the worst case,
n ulps, is far rarer). Sums in sequence add their errors. Hence the tolerance for a
result is `depth * sqrt(terms) * eps` RELATIVE TO THE MAGNITUDE THE COMPUTATION CARRIED:
a logit near 0 carries the same absolute error as its neighbours of size 7, so the
scale is the largest |value| compared, never each element's own.

A real bug moves results by far more: a wrong rope theta or a dropped mask changes the
debug model's logits by about their own size (relative 1), a missing or doubled token
changes a log-likelihood by a whole log-probability. Each parity test keeps such a
negative twin, asserting that the same comparison fails on it.
"""

import math

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23: one ulp at 1.0
EPS_BF16 = 2.0 ** -7  # bfloat16 keeps 8 significant bits


def fp32_rel(terms: int, depth: int = 1) -> float:
    """Relative tolerance of `depth` reductions in sequence over `terms` terms each."""
    return depth * math.sqrt(terms) * EPS32


def forward_rel(config, seq_length: int) -> float:
    """A LLaMA forward pass to the logits: per layer six reductions in sequence (q/k/v
    projections, attention scores, their weighted sum, the output projection, gate/up,
    down; Qwen3's q/k norms a seventh, the mean square of each head), then the head; the
    widest over the hidden size, the MLP width or the keys."""
    terms = max(config.hidden_size, config.intermediate_size, seq_length)
    per_layer = 7 if getattr(config, "qk_norm", False) else 6
    return fp32_rel(terms, per_layer * config.num_hidden_layers + 1)


def max_error(actual, expected) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))))


def assert_close(actual, expected, rel: float, scale: float | None = None, err_msg: str = ""):
    """|actual - expected| <= rel * scale everywhere; scale defaults to max|expected|."""
    expected = np.asarray(expected, np.float64)
    scale = float(np.max(np.abs(expected))) if scale is None else scale
    assert scale > 0, "nothing to compare: all zeros"
    error = max_error(actual, expected)
    assert error <= rel * scale, (
        f"{err_msg} max |difference| {error:.3g} > {rel:.3g} x scale {scale:.3g}".strip())


def assert_differs(actual, expected, rel: float, scale: float | None = None):
    """The negative twin: `assert_close` with the same tolerance fails."""
    try:
        assert_close(actual, expected, rel, scale)
    except AssertionError:
        return
    raise AssertionError(f"no difference above {rel:.3g} x scale: the comparison could not "
                         f"have caught this")


def logprob_tolerance(config, seq_length: int, logits_scale: float, terms: int = 1) -> float:
    """Absolute tolerance of a sum of `terms` log-probabilities: a log-softmax moves by at
    most twice the largest logit error, and `terms` of them add (the worst case: a
    scoring bug, a token missed or counted twice, moves the sum by a whole log-probability,
    several nats at these models' random initialisation)."""
    return terms * 2 * forward_rel(config, seq_length) * logits_scale


def logprob_atol_for(model, params, seq_length: int = 64):
    """terms -> `logprob_tolerance` of a LLaMA module and its parameters, the logits'
    scale measured on random ids."""
    import jax.numpy as jnp

    ids = np.random.RandomState(0).randint(0, model.config.vocab_size, (4, seq_length))
    scale = float(jnp.abs(model.apply({"params": params}, jnp.asarray(ids))).max())
    return lambda terms=1: logprob_tolerance(model.config, seq_length, scale, terms)


# optax's Newton-Schulz quintic for Muon (Keller Jordan's coefficients).
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz_growth(steps: int = 5) -> float:
    """How much Muon's Newton-Schulz iteration can amplify a relative error in its input:
    each step by its polynomial's largest slope, max |p'(s)| over the singular values it
    visits (s in [0, 1.2])."""
    a, b, c = NS_COEFFS
    s = np.linspace(0.0, 1.2, 1201)
    return float(np.max(np.abs(a + 3 * b * s ** 2 + 5 * c * s ** 4))) ** steps


def newton_schulz64(g, steps: int = 5):
    """optax's iteration in float64: Frobenius-normalize, then x <- a x + (b A + c A^2) x
    with A = x x^T, on the wide orientation of the matrix."""
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-8)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x
