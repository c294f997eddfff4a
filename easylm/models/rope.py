"""Rotary frequencies every family can use: the default and YaRN's, as transformers'
`modeling_rope_utils` computes them (`_compute_default_rope_parameters`,
`_compute_yarn_parameters`), in float32 as it does.

Each returns (inverse frequencies (H/2,), attention factor): the factor multiplies cos and
sin (decoder.rotary_embedding), so it scales every attention score by its square. It is 1
but for YaRN, whose factor is 0.1 * ln(factor) + 1 (the paper's "mscale") unless a config
gives `attention_factor`, or DeepSeek's `mscale`/`mscale_all_dim` pair.

YaRN keeps the fast-rotating dimensions (those that turn more than `beta_fast` times over
the original context) as they were, slows the slow ones (fewer than `beta_slow` turns) by
`factor`, and blends linearly between; `truncate` rounds the blend's ends outwards to
whole dimensions (transformers' default; gpt-oss turns it off).
"""

import math

import jax.numpy as jnp
import numpy as np

# YaRN's fields besides the base, as a rope_parameters dict names them.
YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
               "truncate", "attention_factor", "mscale", "mscale_all_dim")


def default(theta: float, dim: int) -> tuple[np.ndarray, float]:
    """theta ** (-2i / dim) for i < dim / 2, and no attention factor."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32), 1.0


def llama3(inv_freq, factor: float, low: float, high: float, original: int):
    """Llama 3.1's long-context scaling of inverse frequencies (H/2,) (Llama 3.1-3.3,
    Llama 4): wavelengths longer than original / low slowed down by `factor`, those shorter
    than original / high kept, and the band between interpolated smoothly."""
    wavelength = 2 * np.pi / inv_freq
    scaled = jnp.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(in_band, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, attention_factor=None, mscale=None,
                          mscale_all_dim=None) -> float:
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
    return _mscale(factor)


def yarn(theta: float, dim: int, factor: float, original_max_position_embeddings: int,
         beta_fast: float | None = 32.0, beta_slow: float | None = 1.0, truncate: bool = True,
         attention_factor: float | None = None, mscale: float | None = None,
         mscale_all_dim: float | None = None) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies (dim/2,) and attention factor (see the module docstring).
    A None beta takes the paper's default, as transformers does."""
    beta_fast, beta_slow = beta_fast or 32.0, beta_slow or 1.0

    def correction_dim(rotations):
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
            / np.float32(high - low))
    extrapolate = np.float32(1) - np.clip(ramp, 0, 1).astype(np.float32)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(theta), exponents)
    extrapolated = np.float32(1) / pos_freqs
    interpolated = np.float32(1) / (np.float32(factor) * pos_freqs)
    inv_freq = interpolated * (np.float32(1) - extrapolate) + extrapolated * extrapolate
    return inv_freq.astype(np.float32), yarn_attention_factor(
        factor, attention_factor, mscale, mscale_all_dim)


def yarn_softmax_scale(scale: float, factor: float, mscale_all_dim: float | None) -> float:
    """DeepSeek's softmax scale under YaRN: `scale` times mscale(factor, mscale_all_dim)
    squared, on every query/key dimension, rotary or not (transformers'
    `yarn_apply_mscale`); unchanged without `mscale_all_dim`."""
    if not mscale_all_dim:
        return scale
    return scale * _mscale(factor, mscale_all_dim) ** 2
