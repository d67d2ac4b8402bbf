"""GGML's block formats, byte for byte, in vectorised numpy.

    block_q4_0 (18 B per 32 values): f16 d, then 16 bytes; byte j holds value j in its low
        nibble and value j+16 in its high nibble; value = (nibble - 8) * d
    block_q8_0 (34 B per 32 values): f16 d, then 32 int8; value = q * d
    block_q4_1 (20 B per 32 values): f16 d, f16 m, then 16 bytes as q4_0; value = nibble * d + m

Rounding follows ggml-quants.c's reference quantizers (quantize_row_q4_0_ref,
quantize_row_q8_0_ref), which is what llama.cpp's quantize tool writes:
  q4_0: m = the first value of largest magnitude, d = m / -8, id = 1/d (in f32, before d is
        rounded to f16), q = min(15, trunc(x*id + 8.5))
  q8_0: d = amax / 127, id = 1/d, q = roundf(x*id) (half away from zero)
  q4_1: m = min, d = (max - min) / 15, id = 1/d, q = min(15, trunc((x - m)*id + 0.5))
Q4_1 weights meet activations quantized as Q8_1 (Q8_0's codes and scale, plus s = d * sum(q)
rounded to f16), and a block's result is d_w*d_x*sum(q_w*q_x) + m_w*s_x (ggml_vec_dot_q4_1_q8_1).
and matches them at the edges too: an all-zero block gets d = -0.0 (q4_0) / +0.0 (q8_0); a
block of subnormals, whose id overflows to inf, gets all-zero codes (x86 ggml's behaviour); a
scale beyond f16's range is stored as inf. tests/compiler/test_quant.py checks all of this
against bytes written by ggml itself (tools/make_ggml_quant_ref.sh).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK = 32
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34, "q4_1": 20}
_CHUNK_BLOCKS = 1 << 13  # 256K values per chunk: the f32 temporaries (1 MB each) stay in cache


def _blocks(x: np.ndarray) -> np.ndarray:
    """x[..., K] -> [n_blocks, 32] in x's own dtype; chunks are converted to f32 one at a time."""
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % QK:
        raise ValueError(f"cannot quantize shape {list(x.shape)}: last axis must be a multiple of {QK}")
    return x.reshape(-1, QK)


def _chunked(blocks: np.ndarray, bytes_per_block: int, fn) -> np.ndarray:
    out = np.empty((blocks.shape[0], bytes_per_block), dtype=np.uint8)
    starts = range(0, blocks.shape[0], _CHUNK_BLOCKS)

    def one(s: int) -> None:
        out[s:s + _CHUNK_BLOCKS] = fn(np.asarray(blocks[s:s + _CHUNK_BLOCKS], dtype=np.float32))

    if len(starts) < 4:
        for s in starts:
            one(s)
    else:  # numpy drops the GIL inside ufuncs, so chunks run in parallel
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(one, starts))
    return out


def _reciprocal(d: np.ndarray) -> np.ndarray:
    # C: id = d ? 1.0f/d : 0.0f; overflows to inf when |d| < 2^-128 (blocks of subnormals)
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)


def _f16(d: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # GGML stores inf when a scale exceeds f16's range
        return d.astype(np.float16)


def _signed_absmax(b: np.ndarray) -> np.ndarray:
    """The first value of largest magnitude in each block, as quantize_row_q4_0_ref finds it."""
    hi, lo = b.max(axis=1), b.min(axis=1)
    m = np.where(hi >= -lo, hi, lo)
    tie = (hi == -lo) & (hi != 0)        # +a and -a both present: the earlier one wins
    if tie.any():
        rows = np.nonzero(tie)[0]
        m[rows] = b[rows, np.argmax(np.abs(b[rows]), axis=1)]
    # C starts from max = 0.0f and keeps it for an all-zero block: -0.0 never gets through
    return m + np.float32(0.0)


def _zero_overflowed_rows(q: np.ndarray, inv: np.ndarray) -> None:
    # an inf id makes x*id inf or NaN; C's float->int8 conversion of those is x86's
    # "integer indefinite" 0x80000000, whose low byte is 0
    rows = np.isinf(inv)
    if rows.any():
        q[rows] = 0


def _q4_0_blocks(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / np.float32(-8.0)
    inv = _reciprocal(d)
    with np.errstate(invalid="ignore"):                     # NaN rows are zeroed below
        v = b * inv[:, None]
        v += np.float32(8.5)
        np.trunc(v, out=v)
        np.minimum(v, np.float32(15.0), out=v)              # C: MIN(15, (int8_t)(x*id + 8.5f))
    _zero_overflowed_rows(v, inv)
    q = v.astype(np.uint8)
    out = np.empty((b.shape[0], 18), dtype=np.uint8)
    out[:, :2] = _f16(d).view(np.uint8).reshape(-1, 2)
    np.left_shift(q[:, 16:], 4, out=out[:, 2:])
    out[:, 2:] |= q[:, :16]
    return out


def _first_min(b: np.ndarray) -> np.ndarray:
    """Each block's minimum as C's `if (v < min) min = v` finds it: the first of equal minima,
    which decides the sign of a zero minimum."""
    return np.take_along_axis(b, np.argmin(b, axis=1)[:, None], axis=1)[:, 0]


def _q4_1_blocks(b: np.ndarray) -> np.ndarray:
    lo = _first_min(b)
    d = (b.max(axis=1) - lo) / np.float32(15.0)
    inv = _reciprocal(d)
    with np.errstate(invalid="ignore"):                     # NaN rows are zeroed below
        v = (b - lo[:, None]) * inv[:, None]
        v += np.float32(0.5)
        np.trunc(v, out=v)
        np.minimum(v, np.float32(15.0), out=v)              # C: MIN(15, (int8_t)(x0 + 0.5f))
    _zero_overflowed_rows(v, inv)
    q = v.astype(np.uint8)
    out = np.empty((b.shape[0], 20), dtype=np.uint8)
    out[:, 0:2] = _f16(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = _f16(lo).view(np.uint8).reshape(-1, 2)
    np.left_shift(q[:, 16:], 4, out=out[:, 4:])
    out[:, 4:] |= q[:, :16]
    return out


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf, in place, with float ops only: f = v - trunc(v) is exact and |f| < 1, so
    trunc(2f) is sign(v) exactly when |f| >= 0.5."""
    t = np.trunc(v)
    v -= t
    v += v
    np.trunc(v, out=v)
    v += t
    return v


def _q8_parts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d f32, q int8) of Q8_0 and Q8_1, whose codes are the same; d is not yet rounded to f16."""
    amax = np.maximum(b.max(axis=1), -b.min(axis=1)) + np.float32(0.0)  # +0.0: no -0.0 scale
    d = amax / np.float32(127.0)
    inv = _reciprocal(d)
    with np.errstate(invalid="ignore"):                     # NaN rows are zeroed below
        v = _round_half_away(b * inv[:, None])
    _zero_overflowed_rows(v, inv)
    return d, v.astype(np.int8)


def _q8_0_blocks(b: np.ndarray) -> np.ndarray:
    d, q = _q8_parts(b)
    d = _f16(d)
    out = np.empty((b.shape[0], 34), dtype=np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


def quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    """x[..., K] float -> uint8[..., K/32*bytes] of GGML blocks."""
    if dtype not in BLOCK_BYTES:
        raise ValueError(f"quantize: unknown block type {dtype!r}; use one of {sorted(BLOCK_BYTES)}")
    b = _blocks(x)
    fn = {"q4_0": _q4_0_blocks, "q8_0": _q8_0_blocks, "q4_1": _q4_1_blocks}[dtype]
    out = _chunked(b, BLOCK_BYTES[dtype], fn)
    return out.reshape(*np.shape(x)[:-1], np.shape(x)[-1] // QK * BLOCK_BYTES[dtype])


def _raw_blocks(data: np.ndarray, dtype: str) -> np.ndarray:
    bb = BLOCK_BYTES[dtype]
    return np.ascontiguousarray(data).reshape(*data.shape[:-1], data.shape[-1] // bb, bb)


def _f16_field(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0]


def split_blocks(data: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8[..., nb*bytes] -> (d f16[..., nb], q int8[..., nb, 32]); q4_0's codes come offset
    by -8, q4_1's as stored (0..15: its minimum is in split_min)."""
    raw = _raw_blocks(data, dtype)
    d = _f16_field(raw, 0)
    if dtype == "q8_0":
        return d, raw[..., 2:].view(np.int8)
    qs = raw[..., 4:] if dtype == "q4_1" else raw[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8)
    return d, (q if dtype == "q4_1" else q - np.int8(8))


def split_min(data: np.ndarray) -> np.ndarray:
    """q4_1 blocks -> each block's minimum m, f16[..., nb]."""
    return _f16_field(_raw_blocks(data, "q4_1"), 2)


def dequantize(data: np.ndarray, dtype: str) -> np.ndarray:
    """uint8 GGML blocks -> float32[..., K]."""
    d, q = split_blocks(data, dtype)
    with np.errstate(invalid="ignore"):  # code 0 times an inf scale is NaN, as in ggml
        x = q.astype(np.float32) * d.astype(np.float32)[..., None]
        if dtype == "q4_1":
            x += split_min(data).astype(np.float32)[..., None]
    return x.reshape(*x.shape[:-2], -1)


def quantize_rows_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activations x[T, K] -> (d f32[T, K/32], q int8[T, K/32, 32]), as kernels quantize them."""
    t, k = x.shape
    d, q = _q8_parts(np.asarray(_blocks(x), dtype=np.float32))
    return _f16(d).astype(np.float32).reshape(t, k // QK), q.reshape(t, k // QK, QK)


def quantize_rows_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activations x[T, K] -> Q8_1 as quantize_row_q8_1_ref makes it: Q8_0's (d, q) and
    s f32[T, K/32] = f16(d * sum(q)), with d the f32 scale before it is rounded to f16."""
    t, k = x.shape
    d, q = _q8_parts(np.asarray(_blocks(x), dtype=np.float32))
    s = _f16(d * q.astype(np.int32).sum(axis=1).astype(np.float32))
    return (_f16(d).astype(np.float32).reshape(t, k // QK), q.reshape(t, k // QK, QK),
            s.astype(np.float32).reshape(t, k // QK))


def block_sums(xq: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """Integer dot product of every activation block with every weight block, as GGML's
    vec_dot kernels form it before scaling: xq int8[T, nb, 32], wq int8[N, nb, 32] ->
    int32[T, N, nb]; exact (|sum| <= 32 * 127 * 128)."""
    return np.einsum("tbk,nbk->tnb", xq.astype(np.int32), wq.astype(np.int32), optimize=True)


def matmul_quantized(x: np.ndarray, w_data: np.ndarray, w_dtype: str) -> np.ndarray:
    """x[T,K] @ W.T for GGML-quantized W[N,K]: x is quantized to Q8_0 per row (Q8_1 for q4_1
    weights), each block's integer dot product is exact, then scaled by both block scales and,
    for q4_1, the weight block's minimum times the activation block's s (GGML's arithmetic)."""
    x = np.asarray(x, dtype=np.float32)
    if w_dtype == "q4_1":
        xd, xq, xs = quantize_rows_q8_1(x)
    else:
        xd, xq = quantize_rows_q8_0(x)
    wd, wq = split_blocks(w_data, w_dtype)                  # [N, nb], [N, nb, 32]
    isum = block_sums(xq, wq)                               # [T, N, nb]
    scale = xd[:, None, :] * wd.astype(np.float32)[None, :, :]
    out = np.einsum("tnb,tnb->tn", isum.astype(np.float64), scale.astype(np.float64))
    if w_dtype == "q4_1":
        wm = split_min(w_data).astype(np.float64)           # [N, nb]
        out += xs.astype(np.float64) @ wm.T
    return out
