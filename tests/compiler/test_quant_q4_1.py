"""Q4_1 blocks and the Q4_1 x Q8_1 dot product against ggml-org's own Python quantizer (gguf)
and a block-by-block loop written from ggml_vec_dot_q4_1_q8_1."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.compiler import quant

gguf = pytest.importorskip("gguf")
Q4_1 = gguf.GGMLQuantizationType.Q4_1


def _weights(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    # offsets per row so blocks are not centred on zero (what q4_1's minimum is for)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.random((rows, 1)).astype(np.float32) * 3
    return x + rng.standard_normal((rows, 1)).astype(np.float32)


def test_q4_1_blocks_are_byte_identical_to_gguf_quantizer():
    rng = np.random.default_rng(7)
    x = _weights(rng, 48, 256)
    x[3, :32] = 0.0
    x[3, 5] = -0.0               # a zero minimum's sign: the first of equal minima wins
    x[4, :32] = -0.0
    x[5, :32] = 1.5              # a constant block: d = 0
    got = quant.quantize(x, "q4_1")
    assert got.shape == (48, 256 // 32 * 20)
    np.testing.assert_array_equal(got, gguf.quants.quantize(x, Q4_1))


def test_q4_1_dequantize_matches_gguf_and_is_close_to_the_input():
    rng = np.random.default_rng(8)
    x = _weights(rng, 16, 128)
    blocks = quant.quantize(x, "q4_1")
    ours = quant.dequantize(blocks, "q4_1")
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(blocks, Q4_1))
    b = x.reshape(16, 4, 32)
    span = (b.max(axis=2) - b.min(axis=2))[..., None]
    assert np.all(np.abs(ours - x).reshape(16, 4, 32) <= span / 15 * 0.5 + 1e-3)


def test_q4_1_matmul_is_ggml_block_arithmetic_with_q8_1_activations():
    rng = np.random.default_rng(9)
    w = quant.quantize(_weights(rng, 6, 128), "q4_1")
    x = rng.standard_normal((3, 128)).astype(np.float32)
    got = quant.matmul_quantized(x, w, "q4_1")
    xd, xq, xs = quant.quantize_rows_q8_1(x)
    wd, wq = quant.split_blocks(w, "q4_1")
    wm = quant.split_min(w)
    assert wq.min() >= 0 and wq.max() <= 15
    for t in range(3):
        for b in range(4):  # s = f16(d * sum(q)) with d still in f32, as quantize_row_q8_1_ref
            d32 = np.float32(np.abs(x[t, 32 * b:32 * b + 32]).max()) / np.float32(127.0)
            assert xs[t, b] == np.float32(np.float16(d32 * np.float32(xq[t, b].astype(np.int32).sum())))
        for n in range(6):
            ref = np.float32(0.0)
            for b in range(4):
                sumi = int(np.dot(wq[n, b].astype(np.int64), xq[t, b].astype(np.int64)))
                ref += np.float32(wd[n, b]) * xd[t, b] * np.float32(sumi) + np.float32(wm[n, b]) * xs[t, b]
            assert got[t, n] == pytest.approx(float(ref), rel=1e-5, abs=1e-5)
    dense = x @ quant.dequantize(w, "q4_1").T
    assert np.max(np.abs(got - dense)) / np.max(np.abs(dense)) < 2e-2
