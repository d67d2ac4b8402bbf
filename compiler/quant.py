"""GGML's block formats, byte for byte, in vectorised numpy.

    block_q4_0 (18 B per 32 values): f16 d, then 16 bytes; byte j holds value j in its low
        nibble and value j+16 in its high nibble; value = (nibble - 8) * d
    block_q8_0 (34 B per 32 values): f16 d, then 32 int8; value = q * d

Rounding follows ggml-quants.c's reference quantizers (quantize_row_q4_0_ref,
quantize_row_q8_0_ref), which is what llama.cpp's quantize tool writes:
  q4_0: m = the first value of largest magnitude, d = m / -8, id = 1/d (in f32, before d is
        rounded to f16), q = min(15, trunc(x*id + 8.5))
  q8_0: d = amax / 127, id = 1/d, q = roundf(x*id) (half away from zero)
"""
from __future__ import annotations

import numpy as np

QK = 32
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34}
_CHUNK_BLOCKS = 1 << 20  # bounds the f32 temporaries of a large tensor to ~128 MB


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK:
        raise ValueError(f"cannot quantize shape {list(x.shape)}: last axis must be a multiple of {QK}")
    return x.reshape(-1, QK)


def _chunked(blocks: np.ndarray, bytes_per_block: int, fn) -> np.ndarray:
    out = np.empty((blocks.shape[0], bytes_per_block), dtype=np.uint8)
    for s in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[s:s + _CHUNK_BLOCKS] = fn(blocks[s:s + _CHUNK_BLOCKS])
    return out


def _q4_0_blocks(b: np.ndarray) -> np.ndarray:
    idx = np.argmax(np.abs(b), axis=1)                       # first occurrence, as the C loop
    m = b[np.arange(b.shape[0]), idx]
    d = (m / np.float32(-8.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    v = (b * inv[:, None]).astype(np.float32) + np.float32(8.5)
    q = np.minimum(15, np.trunc(v)).astype(np.uint8)
    out = np.empty((b.shape[0], 18), dtype=np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out


def _q8_0_parts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    amax = np.max(np.abs(b), axis=1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    v = (b * inv[:, None]).astype(np.float32).astype(np.float64)  # exact; round in f64
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    return d.astype(np.float16), q


def _q8_0_blocks(b: np.ndarray) -> np.ndarray:
    d, q = _q8_0_parts(b)
    out = np.empty((b.shape[0], 34), dtype=np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


def quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    """x[..., K] float -> uint8[..., K/32*bytes] of GGML blocks."""
    b = _blocks(x)
    fn = {"q4_0": _q4_0_blocks, "q8_0": _q8_0_blocks}[dtype]
    out = _chunked(b, BLOCK_BYTES[dtype], fn)
    return out.reshape(*np.shape(x)[:-1], np.shape(x)[-1] // QK * BLOCK_BYTES[dtype])


def split_blocks(data: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8[..., nb*bytes] -> (d f16[..., nb], q int8[..., nb, 32]) with q already offset."""
    bb = BLOCK_BYTES[dtype]
    raw = np.ascontiguousarray(data).reshape(*data.shape[:-1], data.shape[-1] // bb, bb)
    d = raw[..., :2].copy().view(np.float16)[..., 0]
    if dtype == "q8_0":
        q = raw[..., 2:].view(np.int8)
    else:
        qs = raw[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - np.int8(8)
    return d, q


def dequantize(data: np.ndarray, dtype: str) -> np.ndarray:
    """uint8 GGML blocks -> float32[..., K]."""
    d, q = split_blocks(data, dtype)
    x = q.astype(np.float32) * d.astype(np.float32)[..., None]
    return x.reshape(*x.shape[:-2], -1)


def quantize_rows_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activations x[T, K] -> (d f32[T, K/32], q int8[T, K/32, 32]), as kernels quantize them."""
    t, k = x.shape
    d, q = _q8_0_parts(_blocks(x))
    return d.astype(np.float32).reshape(t, k // QK), q.reshape(t, k // QK, QK)


def matmul_quantized(x: np.ndarray, w_data: np.ndarray, w_dtype: str) -> np.ndarray:
    """x[T,K] @ W.T for GGML-quantized W[N,K]: x is quantized to Q8_0 per row, each block's
    integer dot product is exact, then scaled by both block scales (GGML's arithmetic)."""
    xd, xq = quantize_rows_q8_0(np.asarray(x, dtype=np.float32))
    wd, wq = split_blocks(w_data, w_dtype)                  # [N, nb], [N, nb, 32]
    # integer block sums: [T, N, nb]; exact in int32 (|sum| <= 32 * 127 * 128)
    isum = np.einsum("tbk,nbk->tnb", xq.astype(np.int32), wq.astype(np.int32), optimize=True)
    scale = xd[:, None, :] * wd.astype(np.float32)[None, :, :]
    return np.einsum("tnb,tnb->tn", isum.astype(np.float64), scale.astype(np.float64))
