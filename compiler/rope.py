"""The `rope` op's semantics (compiler/ir.py): frequencies as Hugging Face computes them (default and
`llama3` scaling) in float32, the angles, and the rotation the interpreter, fold and codegen share."""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """inv_freq[head_dim/2] in float32, with Llama 3's frequency-dependent scaling applied."""
    exponent = (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)).astype(np.float32)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if not scaling:
        return inv_freq
    factor = np.float32(scaling["factor"])
    low, high = np.float32(scaling["low_freq_factor"]), np.float32(scaling["high_freq_factor"])
    old_ctx = np.float32(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    # long wavelengths are slowed by `factor`; short ones are kept; the band between is blended
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
    blended = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_angles(positions: np.ndarray, inv_freq: np.ndarray, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, hd/2] for integer positions; the product is taken in float32 as HF does."""
    ang = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    if dtype == np.float64:
        ang = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x[n, H, hd] rotated in HF's rotate_half layout: pairs are (j, j + hd/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
