"""Rotary position embeddings (Su et al. 2021), with Llama 3's frequency scaling, and
the check of their settings."""

from __future__ import annotations

import math

import jax.numpy as jnp

from framework.config import RopeScaling, not_one_of


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None):
    """Rotary inverse frequencies theta^(-2i/dim), i < dim/2 (Su et al. 2021): [dim/2] f32.

    With Llama 3's scaling (Dubey et al. 2024; the `apply_scaling` of Meta's reference
    code), a frequency whose wavelength 2*pi/f exceeds L/low_freq_factor is divided by
    `factor`, one whose wavelength is below L/high_freq_factor is kept, and in between
    f' = (1 - a) f / factor + a f with a = (L / wavelength - low) / (high - low), where
    L = original_max_position_embeddings. Computed in float32, as transformers does."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    if scaling is None or scaling.rope_type == "none":
        return inv_freq
    s, length = scaling, float(scaling.original_max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    stretched = jnp.where(wavelength > length / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    a = (length / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - a) * stretched / s.factor + a * stretched
    middle = ((wavelength >= length / s.high_freq_factor)
              & (wavelength <= length / s.low_freq_factor))
    return jnp.where(middle, blended, stretched)


def rotary(x, theta: float, positions, scaling: RopeScaling | None = None):
    """Rotary position embedding (Su et al. 2021), rotate-half form.
    x: [batch, seq, ..., head_dim]; positions: [seq] int, the absolute position of each
    row (0..seq-1 in training; offset by the cache length when decoding), or [batch,
    seq] per row (positions within each document, framework/model/documents.py)."""
    dim = x.shape[-1]
    inv_freq = rope_frequencies(dim, theta, scaling)  # [dim/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [(batch,) seq, dim/2]
    lead = angles.shape[0] if positions.ndim == 2 else 1
    angles = angles.reshape((lead, x.shape[1]) + (1,) * (x.ndim - 3) + (dim // 2,))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def check_rope_scaling(r: RopeScaling) -> list[str]:
    problem = not_one_of("model.rope_scaling.rope_type", r.rope_type)
    if problem:
        return [problem]
    if r.rope_type == "none":
        return []
    errs = []
    if r.factor < 1:
        errs.append(f"model.rope_scaling.factor={r.factor} must be >= 1")
    if not 0 < r.low_freq_factor < r.high_freq_factor:
        errs.append(f"model.rope_scaling.low_freq_factor={r.low_freq_factor} must be > 0 and "
                    f"< model.rope_scaling.high_freq_factor={r.high_freq_factor}")
    if r.original_max_position_embeddings < 1:
        errs.append(f"model.rope_scaling.original_max_position_embeddings="
                    f"{r.original_max_position_embeddings} must be >= 1")
    return errs
