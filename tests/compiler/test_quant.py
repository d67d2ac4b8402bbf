"""compiler/quant.py against bytes and floats written by ggml itself.

tests/data/ggml_quant_ref.npz comes from tools/make_ggml_quant_ref.sh (ggml's
quantize_row_{q4_0,q8_0,q4_1,q8_1}_ref, dequantize_row_*, and the CPU backend's vec_dot kernels)
on inputs built to hit the quantizers' edge cases: several scales, all-equal blocks, zeros and
-0.0, subnormals, values past f16's range, ties of x*id on .5, signed maxima, blocks far from
zero and zero minima of either sign (q4_1), K = 32..4096.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler import quant
from llmrs.compiler.quant import BLOCK_BYTES, QK

REF = Path(__file__).resolve().parents[1] / "data" / "ggml_quant_ref.npz"
DTYPES = ("q4_0", "q8_0", "q4_1")
F16_HALF_SUBNORMAL_STEP = 2.0 ** -25     # largest absolute f16 rounding error below 6.1e-5
F16_REL = 2.0 ** -11                     # largest relative f16 rounding error


@dataclass
class Case:
    name: str
    x: np.ndarray                        # f32[K], quantized as a weight row
    y: np.ndarray                        # f32[K], quantized as an activation row
    ggml: dict[str, np.ndarray]          # the same fields as the npz, sliced to this case


def _load_cases() -> list[Case]:
    ref = np.load(REF)
    k = ref["k"]
    val = np.concatenate([[0], np.cumsum(k)])
    blk = val // QK
    per_value = {"x", "y", "deq_q4_0", "deq_q8_0", "deq_q4_1"}
    per_block_bytes = {"q4_0": 18, "q8_0": 34, "q4_1": 20, "y_q8_0": 34, "y_q8_0_cpu": 34}
    per_block = {"isum_q4_0", "isum_q8_0", "isum_q4_1", "s_q8_1", "s_q8_1_cpu"}   # s: Q8_1's f16 s
    per_case = {"dot_q4_0", "dot_q8_0", "dot_q4_1"}
    cases = []
    for i, name in enumerate(ref["names"]):
        g: dict[str, np.ndarray] = {}
        for f in per_value:
            g[f] = ref[f][val[i]:val[i + 1]]
        for f, nbytes in per_block_bytes.items():
            g[f] = ref[f][blk[i] * nbytes:blk[i + 1] * nbytes]
        for f in per_block:
            g[f] = ref[f][blk[i]:blk[i + 1]]
        for f in per_case:
            g[f] = ref[f][i]
        cases.append(Case(str(name), g.pop("x"), g.pop("y"), g))
    return cases


CASES = _load_cases()
IDS = [c.name for c in CASES]


def _finite_scales(data: np.ndarray, dtype: str) -> bool:
    d, _ = quant.split_blocks(data, dtype)
    return bool(np.isfinite(d).all())


def test_reference_data_covers_the_edge_cases():
    names = " ".join(IDS)
    for needle in ("ties", "subnormal", "tiny", "huge_6e4", "huge_1e30", "all_equal",
                   "max_negative", "max_pos_then_neg", "zeros", "mixed_blocks", "q4_1_offset_blocks",
                   "q4_1_ties", "q4_1_zero_minimum_signs"):
        assert needle in names
    ks = {c.x.size for c in CASES}
    assert min(ks) == 32 and max(ks) == 4096
    assert all(np.any(c.x != 0) for c in CASES)
    assert REF.stat().st_size < 250_000


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_quantize_is_byte_identical_to_ggml_ref(case: Case, dtype: str):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # edge cases must not leak numpy warnings either
        got = quant.quantize(case.x, dtype)
    np.testing.assert_array_equal(got, case.ggml[dtype])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_activation_quantizer_is_byte_identical_to_ggml_ref(case: Case):
    d, q = quant.quantize_rows_q8_0(case.y[None])
    raw = case.ggml["y_q8_0"].reshape(-1, BLOCK_BYTES["q8_0"])
    np.testing.assert_array_equal(d[0].astype(np.float16).view(np.uint8).reshape(-1, 2), raw[:, :2])
    np.testing.assert_array_equal(q[0].view(np.uint8), raw[:, 2:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dequantize_matches_ggml_dequantize(case: Case, dtype: str):
    got = quant.dequantize(case.ggml[dtype], dtype)
    want = case.ggml[f"deq_{dtype}"]
    # bitwise, NaN included (a zero code times an inf scale is NaN in both)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_q8_1_activation_quantizer_is_byte_identical_to_ggml_ref(case: Case):
    """Q8_1 = Q8_0's d and codes (the generator checks ggml's bytes agree) plus s = f16(d * sum(q))."""
    d, q, s = quant.quantize_rows_q8_1(case.y[None])
    d0, q0 = quant.quantize_rows_q8_0(case.y[None])
    np.testing.assert_array_equal(d, d0)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(s[0].astype(np.float16).view(np.uint16), case.ggml["s_q8_1"].view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_block_sums_equal_ggml_vec_dot_integer_sums(case: Case, dtype: str):
    _, xq = quant.quantize_rows_q8_0(case.y[None])
    _, wq = quant.split_blocks(quant.quantize(case.x, dtype)[None], dtype)
    got = quant.block_sums(xq, wq)                          # [1, 1, nb]
    np.testing.assert_array_equal(got[0, 0], case.ggml[f"isum_{dtype}"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matmul_quantized_matches_ggml_vec_dot(case: Case, dtype: str):
    w = quant.quantize(case.x, dtype)
    with np.errstate(invalid="ignore", over="ignore"):   # inf scales and sums: NaN in both
        got = quant.matmul_quantized(case.y[None], w[None], dtype)[0, 0]
    want = np.float64(case.ggml[f"dot_{dtype}"])
    finite = _finite_scales(w, dtype) and _finite_scales(case.ggml["y_q8_0"], "q8_0")
    if dtype == "q4_1":
        finite = finite and np.isfinite(quant.split_min(w)).all() and np.isfinite(case.ggml["s_q8_1"]).all()
    if not finite:
        # an inf scale: ggml's lanes meet +inf and -inf (NaN), ours only one of them
        assert not np.isfinite(got) and not np.isfinite(want)
        return
    # ggml accumulates in f32 across SIMD lanes, we in f64: agreement to f32 rounding of the
    # result, or, where the blocks' terms cancel, to a few f32 ulps of the terms
    d, q, s = quant.quantize_rows_q8_1(case.y[None])
    wd, wq = quant.split_blocks(w, dtype)
    terms = np.abs(d[0] * wd.astype(np.float64) * quant.block_sums(q, wq[None])[0, 0]).sum()
    if dtype == "q4_1":
        terms += np.abs(quant.split_min(w).astype(np.float64) * s[0]).sum()
    assert abs(got - want) <= max(1e-6 * abs(want), 4 * 2.0 ** -24 * terms, 1e-30)


def _roundtrip_error_bound(d16: np.ndarray, q: np.ndarray) -> np.ndarray:
    """|x - q*d16| <= |d32|/2 + |q|*|d16 - d32|, where d32 is the f32 scale the codes were
    computed with and d16 its stored f16 rounding."""
    e = np.maximum(np.abs(d16) * F16_REL, F16_HALF_SUBNORMAL_STEP)[..., None]   # |d16 - d32|
    d32 = np.abs(d16)[..., None] + e
    return (d32 / 2 + np.abs(q) * e) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", ("q4_0", "q8_0"))   # q4_1's bound: test_q4_1_roundtrip_...
@pytest.mark.parametrize("case", [c for c in CASES if not c.name.startswith("huge_5e5")
                                  and not c.name.startswith("huge_1e30")], ids=lambda c: c.name)
def test_roundtrip_error_is_within_half_a_step(case: Case, dtype: str):
    data = quant.quantize(case.x, dtype)
    d, q = quant.split_blocks(data, dtype)                  # f16[nb], int8[nb, 32]
    back = quant.dequantize(data, dtype)
    assert np.isfinite(back).all()
    err = np.abs(case.x.astype(np.float64) - back).reshape(-1, QK)
    bound = _roundtrip_error_bound(d.astype(np.float64), q.astype(np.float64))
    if dtype == "q4_0":
        # +8 steps has no code (nibbles stop at 15 = +7): those values land one step short
        clamped = q == 7
        bound = np.where(clamped, bound + np.abs(d.astype(np.float64))[:, None] / 2, bound)
    assert (err <= bound).all(), f"worst excess {np.max(err - bound)}"


@pytest.mark.parametrize("case", [c for c in CASES if not c.name.startswith(("huge_5e5", "huge_1e30"))],
                         ids=lambda c: c.name)
def test_q4_1_roundtrip_error_is_within_half_a_step_plus_the_minimums_rounding(case: Case):
    data = quant.quantize(case.x, "q4_1")
    d, q = quant.split_blocks(data, "q4_1")
    m = quant.split_min(data).astype(np.float64)
    back = quant.dequantize(data, "q4_1")
    assert np.isfinite(back).all()
    err = np.abs(case.x.astype(np.float64) - back).reshape(-1, QK)
    bound = _roundtrip_error_bound(d.astype(np.float64), q.astype(np.float64))
    bound += np.maximum(np.abs(m) * F16_REL, F16_HALF_SUBNORMAL_STEP)[:, None]     # |m16 - m32|
    bound += np.spacing(np.abs(back.reshape(-1, QK)).astype(np.float32))          # q*d + m in f32
    assert (err <= bound).all(), f"worst excess {np.max(err - bound)}"


def test_q4_0_clamp_at_plus_eight_costs_a_whole_step():
    # max +1.5 first, -1.5 later in the same block: d = -1.5/8, and -1.5 would need code +8
    x = np.linspace(-1, 1, QK, dtype=np.float32)
    x[0], x[5] = 1.5, -1.5
    data = quant.quantize(x, "q4_0")
    d, q = quant.split_blocks(data, "q4_0")
    assert q[0, 5] == 7
    assert np.isclose(abs(quant.dequantize(data, "q4_0")[5] - x[5]), abs(float(d[0])), rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_beyond_f16_range_is_stored_as_inf_like_ggml(dtype: str):
    case = next(c for c in CASES if c.name.startswith("huge_1e30"))
    d, _ = quant.split_blocks(quant.quantize(case.x, dtype), dtype)
    assert np.isinf(d).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_and_subnormal_blocks_dequantize_to_zero_without_nan(dtype: str):
    for case in (c for c in CASES if c.name.startswith(("tiny", "subnormal"))):
        back = quant.dequantize(quant.quantize(case.x, dtype), dtype)
        assert np.isfinite(back).all() and not back.any(), case.name


def test_ggml_cpu_activation_quantizer_differs_from_ref_only_at_ties_and_subnormals():
    # llama.cpp's CPU backend quantizes activations with SIMD code that rounds half to even and
    # uses id = 127/amax; we (and the weight files) use the reference. Outside exact ties and
    # subnormal blocks the two agree, so llmrs and llama.cpp logits are comparable.
    # Q8_1's s (d * sum(q)) follows the codes: it differs only where they do
    for case in CASES:
        ref_d, ref_q = quant.split_blocks(case.ggml["y_q8_0"], "q8_0")
        cpu_d, cpu_q = quant.split_blocks(case.ggml["y_q8_0_cpu"], "q8_0")
        np.testing.assert_array_equal(ref_d.view(np.uint16), cpu_d.view(np.uint16))
        diff = np.abs(ref_q.astype(np.int16) - cpu_q)
        s_diff = case.ggml["s_q8_1"].view(np.uint16) != case.ggml["s_q8_1_cpu"].view(np.uint16)
        if case.name.startswith(("ties", "near_ties")):
            assert diff.max() == 1
            assert not (s_diff & ~diff.any(axis=1)).any(), case.name
        elif not case.name.startswith("subnormal"):
            assert not diff.any() and not s_diff.any(), case.name


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_tensor_in_parallel_chunks_equals_row_by_row(dtype: str):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((160, 8192)) * 0.02).astype(np.float32)  # 40960 blocks: 5 chunks
    whole = quant.quantize(w, dtype)
    assert whole.shape == (160, 8192 // QK * BLOCK_BYTES[dtype])
    for r in (0, 37, 159):
        np.testing.assert_array_equal(whole[r], quant.quantize(w[r], dtype))
    np.testing.assert_array_equal(quant.quantize(w.astype(np.float64), dtype), whole)


def test_unknown_block_type_is_a_one_line_error():
    with pytest.raises(ValueError, match="q4_0"):
        quant.quantize(np.ones(QK, np.float32), "q5_0")
