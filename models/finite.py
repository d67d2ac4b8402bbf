"""Whether a tensor's stored values are all finite numbers: a NaN or an infinity in any weight makes
every logit NaN, so the readers refuse such a file when they hand its tensors out."""
from __future__ import annotations

import numpy as np

# where a quantized block keeps its f16 scales: (block bytes, byte offsets of the scales)
_SCALES = {"q4_0": (18, (0,)), "q4_1": (20, (0, 2)), "q8_0": (34, (0,))}
_CHUNK = 1 << 22   # values (or blocks) looked at a time: the temporaries stay a few MB


def _chunk_finite(chunk: np.ndarray, dtype: str) -> bool:
    if dtype in _SCALES:
        return all(np.isfinite(np.ascontiguousarray(chunk[:, o:o + 2]).view(np.float16)).all()
                   for o in _SCALES[dtype][1])
    if dtype == "bf16":                      # uint16 bits: exponent all ones is NaN or infinity
        return not np.any((chunk & 0x7F80) == 0x7F80)
    return bool(np.isfinite(chunk).all())


def all_finite(data: np.ndarray, dtype: str) -> bool:
    """Whether every value of a tensor in storage layout is a finite number: its floats (bf16 as
    uint16 bits), or a quantized type's block scales."""
    flat = np.asarray(data)
    flat = flat.reshape(-1, _SCALES[dtype][0]) if dtype in _SCALES else flat.reshape(-1)
    return all(_chunk_finite(flat[i:i + _CHUNK], dtype) for i in range(0, len(flat), _CHUNK))
