"""Every LLVM kernel, JIT-compiled for this host, against the interpreter / numpy on random data."""
from __future__ import annotations

import ctypes
import mmap
import multiprocessing

import llvmlite.ir as ir
import numpy as np
import pytest

from llmrs.compiler import quant
from llmrs.compiler.interpret import Step
from llmrs.compiler.ir import Graph
from llmrs.compiler.codegen.llvm_builder import F32, KernelBuilder, LaneSums, vec
from llmrs.compiler.codegen.llvm_kernels import emit_op, op_scratch_bytes
from llmrs.compiler.codegen.llvm_matmul import (_align, emit_block_dot_probe, emit_q4_group_probe,
                                                 emit_q4_quad_probe, group_isa, q4_group_ok, scratch_layout,
                                                 MatmulSpec)
from llmrs.compiler.codegen.llvm_target import Target, TargetError, emit, host_target
from llmrs.runtime.backends.cpu_native import NativeCode

from .kernel_cases import (SIMPLE_KINDS, Case, attention_case, embedding_case, matmul_case,
                           scored_attention_case, simple_case)

TARGETS = {"host": host_target()}
if TARGETS["host"].int8_dot == "vnni":  # the AVX2 path too, on a machine that has VNNI
    TARGETS["avx2"] = Target(TARGETS["host"].triple, "haswell", "+avx2,+fma,+f16c")


def run_case(case: Case, target: Target, nth: int = 2) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Runs the case's kernel once per thread id (kernels have no barrier inside); returns the
    buffers after the call and thread 0's scratch."""
    module = ir.Module("t")
    module.triple = target.triple
    emit_op(module, target, case.graph, case.op, "kernel")
    code = NativeCode(str(module))
    arrays = {k: np.ascontiguousarray(v.copy()) for k, v in case.arrays.items()}
    names = case.buffers()
    ptrs = [arrays[case.graph.values[n].alias or n].ctypes.data for n in names]
    stride = _align(max(op_scratch_bytes(case.graph, case.op), 64))
    scratch = np.zeros(stride * nth, np.uint8)
    fn = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * len(names) + [ctypes.c_int64] * 5 + [ctypes.c_void_p]))(
        code.address("kernel"))
    st = case.step
    for tid in range(nth):
        fn(*ptrs, st.n_tokens, st.n_past, st.start_pos, tid, nth, scratch.ctypes.data + tid * stride)
    return arrays, scratch[:stride]


def as_float(case: Case, name: str, arr: np.ndarray) -> np.ndarray:
    v = case.graph.values[name]
    dtype = case.graph.values[v.alias].dtype if v.alias else v.dtype
    if dtype in quant.BLOCK_BYTES:
        return quant.dequantize(arr, dtype)
    return np.asarray(arr, np.float32)


CACHE_ATOL = {"q8_0": 0.02, "q4_0": 0.13, "f16": 1e-3}


def check(case: Case, arrays: dict[str, np.ndarray]) -> None:
    want, got = case.expected(), case.actual(arrays)
    for name in case.op.outputs:
        w, g = as_float(case, name, want[name]), as_float(case, name, got[name])
        alias = case.graph.values[name].alias
        cache = case.graph.values[alias].dtype if alias else None
        # a q8_0 / q4_0 cache may round one value to the next code where the float inputs differ
        # in the last bit (a step is 1/127 / 1/8 of its block's largest value), and an f16 cache
        # one to the neighbouring f16 (2^-11 of its size)
        atol = CACHE_ATOL.get(cache, 1e-5) * float(np.abs(w).max() + (cache is None))
        np.testing.assert_allclose(g, w, rtol=case.rtol, atol=atol, err_msg=f"{case.name}: {name}")
        if cache in quant.BLOCK_BYTES:   # ... but only the rare value on a rounding edge does
            assert np.mean(g != w) <= 0.01, f"{case.name}: {name}: {np.mean(g != w):.1%} of the values differ"


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1", "q8_0", "f16", "f32"])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (9, 9), (9, 6)])
def test_matmul_matches_interpreter_for_each_weight_format(target, wdtype, T, n_tokens):
    case = matmul_case(wdtype, T, n_tokens, prologue=False, epilogue=None)
    check(case, run_case(case, TARGETS[target], nth=3)[0])


@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1", "q8_0", "f16", "f32"])
@pytest.mark.parametrize("prologue,epilogue", [(True, None), (False, "add"), (True, "silu_mul"),
                                               (True, "rope_kv_store")])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (6, 5)])
def test_fused_matmul_prologue_and_epilogues_match_interpreter(wdtype, prologue, epilogue, T, n_tokens):
    case = matmul_case(wdtype, T, n_tokens, prologue, epilogue)
    check(case, run_case(case, TARGETS["host"], nth=2)[0])


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("prologue,epilogue", [(True, None), (False, "add"), (True, "silu_mul"),
                                               (True, "rope_kv_store")])
def test_q8_0_decode_one_row_tiles_match_interpreter(target, prologue, epilogue):
    """Q8_0 decode on AVX2 without VNNI takes one weight row a tile (two with silu_mul's gate and
    up); an odd N and K = 576 (18 blocks) leave nothing to a whole tile count."""
    case = matmul_case("q8_0", 1, 1, prologue, epilogue, K=576, N=45, seed=11)
    check(case, run_case(case, TARGETS[target], nth=3)[0])


@pytest.mark.parametrize("cache_dtype", ["f16", "q8_0", "q4_0"])
def test_rope_kv_store_epilogue_writes_f16_q8_0_and_q4_0_caches(cache_dtype):
    case = matmul_case("q8_0", 5, 5, True, "rope_kv_store", cache_dtype=cache_dtype)
    check(case, run_case(case, TARGETS["host"], nth=2)[0])


@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1", "q8_0"])
def test_activation_quantization_is_ggml_reference_bit_for_bit(wdtype):
    """Q8_0 codes and scales (and Q8_1's s for q4_1 weights) in the scratch, as quantize_row_q8_*_ref."""
    case = matmul_case(wdtype, 6, 6, prologue=False, epilogue=None)
    x = case.arrays["x"]
    x[2, 32:64] = np.abs(x[2, 32:64]) * 1e4 + 1e4     # s = d * sum(q) past f16's range: inf, as ggml
    _, scratch = run_case(case, TARGETS["host"], nth=1)
    x = case.arrays["x"]
    t, k = x.shape
    want_d, want_q, want_s = quant.quantize_rows_q8_1(x)
    at = scratch_layout(MatmulSpec.of(case.graph, case.op))
    got_q = scratch[at["xq"]:at["xq"] + t * k].view(np.int8).reshape(t, k // 32, 32)
    got_d = scratch[at["xd"]:at["xd"] + t * k // 32 * 4].view(np.float32).reshape(t, k // 32)
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(got_d, want_d)
    if wdtype == "q4_1":
        assert np.isinf(want_s[2, 1])
        got_s = scratch[at["xs"]:at["xs"] + t * k // 32 * 4].view(np.float32).reshape(t, k // 32)
        np.testing.assert_array_equal(got_s, want_s)


def _block_sums(emit, target, w: np.ndarray, wdtype: str, x: np.ndarray, n: int, k: int) -> None:
    """Run a generated probe that writes each block's int32 dot product of w's rows (q4_1: its
    codes 0..15) with the Q8_0 codes of each row of x, and compare with numpy's exact integer sums
    (GGML's)."""
    _, xq = quant.quantize_rows_q8_0(x)
    _, wq = quant.split_blocks(w, wdtype)
    want = np.einsum("nbk,tbk->tnb", wq.astype(np.int32), xq.astype(np.int32))   # a row of x a token
    module = ir.Module("t")
    module.triple = target.triple
    emit(KernelBuilder(module, target, "probe", 3))
    code = NativeCode(str(module))
    got = np.zeros(want.shape, np.int32)
    xq_flat = np.ascontiguousarray(xq.reshape(-1))
    fn = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_void_p]))(
        code.address("probe"))
    fn(w.ctypes.data, xq_flat.ctypes.data, got.ctypes.data, 1, 0, 0, 0, 1, None)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [4, 8, 16])
def test_lane_sums_are_each_vectors_hsum_bit_for_bit(n):
    """LaneSums (attention's L slots' dot products summed across lanes at once) gives
    each lane exactly hsum's float: the same additions in the same order, on values whose sums
    round differently in other orders."""
    rng = np.random.default_rng(n)
    vals = (rng.standard_normal((n, n)) * 10.0 ** rng.integers(-6, 7, (n, n))).astype(np.float32)
    module = ir.Module("t")
    target = TARGETS["host"]
    module.triple = target.triple
    kb = KernelBuilder(module, target, "probe", 3)
    src, one, many = kb.bufs
    vs = [kb.load(vec(F32, n), src, kb.i64(4 * n * j)) for j in range(n)]
    for j, v in enumerate(vs):
        kb.store(kb.hsum(v), one, kb.i64(4 * j))
    sums = LaneSums(kb)
    for v in vs:
        sums.push(v)
    kb.store(sums.result(), many, kb.i64(0))
    kb.finish()
    code = NativeCode(str(module))
    fn = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_void_p]))(
        code.address("probe"))
    got_one, got_many = np.zeros(n, np.float32), np.zeros(n, np.float32)
    fn(vals.ctypes.data, got_one.ctypes.data, got_many.ctypes.data, 1, 0, 0, 0, 1, None)
    np.testing.assert_array_equal(got_many.view(np.uint32), got_one.view(np.uint32))
    np.testing.assert_allclose(got_one, vals.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1", "q8_0"])
def test_int8_block_dot_products_are_ggml_integer_sums_exactly(target, wdtype):
    rng = np.random.default_rng(5)
    n, k = 7, 128
    w = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), wdtype)
    x = rng.standard_normal((1, k)).astype(np.float32) * 3
    x[0, :32] = 127.0 / np.arange(1, 33)           # a block that uses the full int8 range
    if wdtype == "q4_1":
        w[0, 4:20] = 0xFF                           # a block of 15s: the largest u8 x s8 products
    _block_sums(lambda kb: emit_block_dot_probe(kb, wdtype, k, n), TARGETS[target], w, wdtype, x, n, k)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (7, 7), (7, 4)])
def test_attention_causal_gqa_matches_interpreter(kv_dtype, T, n_tokens):
    case = attention_case(T, n_tokens, kv_dtype)
    check(case, run_case(case, TARGETS["host"], nth=3)[0])


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (7, 5)])
def test_attention_over_a_full_cache_matches_interpreter(kv_dtype, T, n_tokens):
    """Slots go in blocks of 16: the last token sees every slot of a 24-slot cache, so its last
    block runs past the cache's end and must neither read there nor count those slots."""
    case = attention_case(T, n_tokens, kv_dtype)
    S = case.graph.values["kc"].shape[0]
    rng = np.random.default_rng(11)
    for name in ("kc", "vc"):
        vals = rng.standard_normal(case.graph.values[name].shape).astype(np.float32)
        case.arrays[name] = quant.quantize(vals, kv_dtype) if kv_dtype in quant.BLOCK_BYTES else vals.astype(np.float16)
    n_past = S - n_tokens
    case.step = Step(n_tokens, n_past, n_past)
    check(case, run_case(case, TARGETS["host"], nth=2)[0])


def test_attention_with_an_odd_gqa_group_matches_interpreter():
    """Query heads go two at a time through a KV group where the group size is even; a group of 3
    takes them one at a time."""
    rng = np.random.default_rng(12)
    h, kvh, hd, S, T, n_past = 6, 2, 32, 20, 5, 7
    g = Graph("prefill", T)
    g.add_value("q", (T, h * hd), "f32", kind="input")
    g.add_value("kc", (S, kvh, hd), "f16", "state")
    g.add_value("vc", (S, kvh, hd), "f16", "state")
    g.add_value("o", (T, h * hd), "f32")
    op = g.add_op("attention", ["q", "kc", "vc"], ["o"], n_heads=h, n_kv_heads=kvh, head_dim=hd,
                  scale=1.0 / np.sqrt(hd))
    arrays = {"q": rng.standard_normal((T, h * hd)).astype(np.float32),
              "kc": rng.standard_normal((S, kvh, hd)).astype(np.float16),
              "vc": rng.standard_normal((S, kvh, hd)).astype(np.float16),
              "o": np.zeros((T, h * hd), np.float32)}
    case = Case("attention-gqa3", g, op, arrays, Step(T, n_past, n_past))
    check(case, run_case(case, TARGETS["host"], nth=2)[0])


# (n_heads, n_kv_heads, head_dim, kv dtype): head dims that are no multiple of the vector width
# (100 on AVX2 / AVX-512, 120 and 80 on AVX-512's 16 lanes, 34 ending in 2 lanes), MHA, MQA and
# a GQA group of 3; groups of 4 and 8 at head_dim <= 64 (four heads a work item on AVX-512)
ODD_HEADS = [(3, 3, 48, "f16"), (2, 1, 80, "f32"), (9, 3, 96, "q8_0"), (2, 2, 100, "f16"), (8, 1, 100, "f32"),
             (3, 1, 120, "f16"), (2, 1, 256, "q8_0"), (2, 2, 34, "f32"), (6, 2, 96, "q4_0"), (8, 2, 64, "f16"),
             (16, 2, 32, "q8_0"), (4, 1, 16, "f32")]


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("h,kvh,hd,kv_dtype", ODD_HEADS, ids=[f"{h}.{k}x{d}-{t}" for h, k, d, t in ODD_HEADS])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (7, 5)])
def test_attention_for_any_head_dim_and_group_matches_interpreter(target, h, kvh, hd, kv_dtype, T, n_tokens):
    case = attention_case(T, n_tokens, kv_dtype, seed=hd, h=h, kvh=kvh, hd=hd)
    check(case, run_case(case, TARGETS[target], nth=2)[0])


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("wdtype,cache_dtype", [("q8_0", "f16"), ("f32", "f32")])
@pytest.mark.parametrize("heads", [(2, 2, 100), (3, 1, 48), (9, 3, 40), (3, 1, 34)],
                         ids=["2.2x100", "3.1x48", "9.3x40", "3.1x34"])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (6, 5)])
def test_rope_kv_store_epilogue_for_any_head_dim_matches_interpreter(target, wdtype, cache_dtype, heads, T, n_tokens):
    # head_dim 100: RoPE halves of 50 and cache rows of 100 end in narrower vectors
    case = matmul_case(wdtype, T, n_tokens, True, "rope_kv_store", cache_dtype=cache_dtype, heads=heads)
    check(case, run_case(case, TARGETS[target], nth=2)[0])


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("wdtype", ["f32", "f16"])
@pytest.mark.parametrize("prologue,epilogue", [(False, None), (True, None), (False, "add")])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (6, 5)])
def test_float_matmul_with_k_not_a_multiple_of_the_vector_width_matches_interpreter(target, wdtype, prologue,
                                                                                   epilogue, T, n_tokens):
    # K = 9 heads x 100: o_proj of a model whose attention width is no multiple of 32
    case = matmul_case(wdtype, T, n_tokens, prologue, epilogue, K=900, N=24)
    check(case, run_case(case, TARGETS[target], nth=2)[0])


@pytest.mark.parametrize("kind", ["rope", "kv_store:f16"])
def test_rope_and_kv_store_ops_with_head_dim_100_match_interpreter(kind):
    case = simple_case(kind, hd=100)
    check(case, run_case(case, TARGETS["host"], nth=2)[0])


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q4_0", "q4_1", "q8_0"])
def test_embedding_rows_match_dequantized_table_exactly(dtype):
    case = embedding_case(dtype)
    check(case, run_case(case, TARGETS["host"], nth=2)[0])


@pytest.mark.parametrize("kind", SIMPLE_KINDS)
def test_norm_elementwise_argmax_rope_and_kv_store_match_interpreter(kind):
    case = simple_case(kind)
    check(case, run_case(case, TARGETS["host"], nth=2)[0])


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("dtype,hd", [("q8_0", 64), ("q4_0", 64), ("q4_0", 96)])
def test_kv_store_writes_the_ggml_reference_blocks_byte_for_byte(target, dtype, hd):
    """From exact f32 rows the stored blocks are quant.quantize's (ggml's quantize_row_*_ref, checked
    against ggml's own bytes in test_quant.py): the scale, the signed largest value q4_0 divides
    by -8 (the first of a +a / -a tie), the truncation after + 8.5, the nibble order."""
    case = simple_case(f"kv_store:{dtype}", hd=hd)
    a = case.arrays["a"]
    a[0, :32] = np.linspace(-3, 3, 32, dtype=np.float32)      # -3 first and +3 last: -3 wins
    a[1, 32:64] = -np.abs(a[1, 32:64]) - 0.5                  # a block whose largest is negative
    got = run_case(case, TARGETS[target], nth=2)[0]["kc"]
    want = case.expected()["kc2"]
    np.testing.assert_array_equal(got, want)
    rows = a[:case.step.n_tokens].reshape(case.step.n_tokens, 2, hd)
    np.testing.assert_array_equal(got[2:2 + case.step.n_tokens], quant.quantize(rows, dtype))


def test_bad_target_is_an_error_not_a_crash():
    with pytest.raises(TargetError, match="no-such-arch"):
        emit("define void @f() {\n  ret void\n}\n", Target("no-such-arch-linux-gnu"))


# the grouped q4 path (q4_0 and q4_1, any K): AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw +
# vpmaddwd; on a VNNI machine both run (TARGETS["avx2"])
GROUPED = [name for name in sorted(TARGETS) if q4_group_ok(TARGETS[name], "q4_0")]
NO_GROUPED = "host CPU has neither AVX2 nor AVX-512 VNNI (the grouped q4 path)"
VNNI512 = Target("x86_64-unknown-linux-gnu", "icelake-server",
                 "+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni")
AVX2 = Target("x86_64-unknown-linux-gnu", "znver3", "+avx2,+fma,+f16c")


@pytest.mark.skipif(not GROUPED, reason=NO_GROUPED)
@pytest.mark.parametrize("target", GROUPED)
@pytest.mark.parametrize("prologue,epilogue", [(False, None), (True, None), (False, "add"),
                                               (True, "silu_mul"), (True, "rope_kv_store")])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (11, 11), (11, 6)])
def test_grouped_q4_0_matmul_matches_interpreter(target, prologue, epilogue, T, n_tokens):
    case = matmul_case("q4_0", T, n_tokens, prologue, epilogue, K=256, N=48)
    check(case, run_case(case, TARGETS[target], nth=3)[0])


@pytest.mark.skipif(not GROUPED, reason=NO_GROUPED)
@pytest.mark.parametrize("target", GROUPED)
@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1"])
@pytest.mark.parametrize("prologue,epilogue", [(True, None), (False, "add"), (True, "silu_mul")])
def test_grouped_decode_of_long_rows_matches_interpreter(target, wdtype, prologue, epilogue):
    """K = 2048: rows of 1152 (q4_0) / 1280 (q4_1) bytes, which AVX-512 VNNI decode walks in
    4-row tiles (llvm_matmul.py DECODE_ROWS_LONG), shorter rows in 8-row ones; 44 rows, so the
    tiles do not divide them evenly into 8s."""
    case = matmul_case(wdtype, 1, 1, prologue, epilogue, K=2048, N=88 if epilogue == "silu_mul" else 44, seed=5)
    check(case, run_case(case, TARGETS[target], nth=3)[0])


@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1"])
@pytest.mark.parametrize("T", [1, 8])
def test_grouped_q4_code_uses_each_isas_dot_product_instructions(wdtype, T):
    """Compile-only where the host cannot run it: AVX-512 VNNI's kernel does its dot products with
    vpdpbusd on zmm registers; AVX2's with vpmaddubsw / vpmaddwd on ymm, and no AVX-512 at all."""
    case = matmul_case(wdtype, T, T, True, None, K=576, N=48)
    asm = {}
    for name, target in (("vnni512", VNNI512), ("avx2", AVX2)):
        module = ir.Module("t")
        module.triple = target.triple
        emit_op(module, target, case.graph, case.op, "kernel")
        asm[name] = emit(str(module), target, "asm").decode()
    assert "vpdpbusd" in asm["vnni512"] and "zmm" in asm["vnni512"]
    assert "vpmaddubsw" in asm["avx2"] and "vpmaddwd" in asm["avx2"]
    assert "zmm" not in asm["avx2"] and "vpdpbusd" not in asm["avx2"]


@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1", "q8_0"])
def test_aarch64_prefill_uses_smmla_exactly_where_the_target_has_i8mm(wdtype):
    """Compile-only (tests/qemu runs them): with +i8mm, prefill's row and token pairs go through
    smmla, 4 per block of a 2 x 2 pair; without it, sdot; decode (one token) never smmla."""
    from llmrs.compiler.codegen.llvm_target import aarch64_target
    counts = {}
    for i8mm in (False, True):
        target = aarch64_target(True, i8mm=i8mm)
        for T in (1, 8):
            case = matmul_case(wdtype, T, T, True, None)
            module = ir.Module("t")
            module.triple = target.triple
            emit_op(module, target, case.graph, case.op, "kernel")
            counts[i8mm, T] = emit(str(module), target, "asm").decode().count("smmla")
    assert counts[True, 8] > 0
    assert counts[False, 8] == counts[False, 1] == counts[True, 1] == 0


@pytest.mark.skipif(not GROUPED, reason=NO_GROUPED)
@pytest.mark.parametrize("target", GROUPED)
def test_grouped_q4_0_block_sums_are_ggml_integer_sums_exactly(target):
    rng = np.random.default_rng(6)
    n, k = 5, 256
    w = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), "q4_0")
    x = rng.standard_normal((1, k)).astype(np.float32) * 3
    x[0, :32] = 127.0 / np.arange(1, 33)           # a block that uses the full int8 range
    w[0, 2:18] = 0xFF                               # a block of 15s: the largest u8 x s8 products
    _block_sums(lambda kb: emit_q4_group_probe(kb, k, n), TARGETS[target], w, "q4_0", x, n, k)


# the grouped q4 path takes every K: whole groups of 4 blocks, then 1..3 blocks masked in
ODD_K = [(576, "2-block tail, SmolLM2-135M's hidden size"), (672, "1-block tail"), (352, "3-block tail"),
         (96, "the tail alone")]


@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("K", [k for k, _ in ODD_K], ids=[why for _, why in ODD_K])
@pytest.mark.parametrize("prologue,epilogue", [(False, None), (True, None), (False, "add"),
                                               (True, "silu_mul"), (True, "rope_kv_store")])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (11, 6)])
def test_q4_matmul_with_odd_k_and_n_matches_interpreter(wdtype, K, prologue, epilogue, T, n_tokens):
    """Every fusion at decode and prefill, K not a multiple of 128 and (where the epilogue leaves
    N free) an odd N, on the host's path (grouped where AVX-512 VNNI is) and on AVX2's."""
    for target in TARGETS.values():
        case = matmul_case(wdtype, T, n_tokens, prologue, epilogue, K=K, N=45, seed=K + T)
        check(case, run_case(case, target, nth=3)[0])


@pytest.mark.skipif(not GROUPED, reason=NO_GROUPED)
@pytest.mark.parametrize("target", GROUPED)
@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1"])
@pytest.mark.parametrize("K", [k for k, _ in ODD_K] + [512], ids=[why for _, why in ODD_K] + ["whole groups"])
def test_grouped_q4_block_sums_with_a_partial_group_are_ggml_integer_sums_exactly(target, wdtype, K):
    rng = np.random.default_rng(K)
    n = 5
    w = quant.quantize(rng.standard_normal((n, K)).astype(np.float32) + 1.0, wdtype)
    x = rng.standard_normal((1, K)).astype(np.float32) * 3
    x[0, -32:] = -127.0 / np.arange(1, 33)         # the last block (a tail's) uses the full int8 range
    w[0, -16:] = 0xFF                               # and meets 15s: the largest u8 x s8 products
    _block_sums(lambda kb: emit_q4_group_probe(kb, K, n, wdtype), TARGETS[target], w, wdtype, x, n, K)


# AVX2's q4_0 prefill sums 4 tokens' products per block in i16 (quad_dot)
QUADS = [name for name in GROUPED if group_isa(TARGETS[name]) == "avx2"]


@pytest.mark.skipif(not QUADS, reason="host CPU lacks AVX2")
@pytest.mark.parametrize("target", QUADS)
@pytest.mark.parametrize("tokens", [1, 3, 4])
@pytest.mark.parametrize("K", [k for k, _ in ODD_K] + [512], ids=[why for _, why in ODD_K] + ["whole groups"])
def test_avx2_quad_block_sums_are_ggml_integer_sums_exactly(target, tokens, K):
    """Blocks of 15s against blocks of +-127 (16 of the largest products in one i16 before
    vpmaddwd: 30480, no overflow), a partial last group, 1..4 tokens."""
    rng = np.random.default_rng(K + tokens)
    n = 5
    w = quant.quantize(rng.standard_normal((n, K)).astype(np.float32), "q4_0")
    x = rng.standard_normal((tokens, K)).astype(np.float32) * 3
    x[:, :32] = 127.0                               # every token's first block all 127 ...
    x[-1, -32:] = -127.0                            # ... and the last token's last block all -127
    w[:2].reshape(2, -1, 18)[:, :, 2:] = 0xFF       # two rows of 15s: the largest u8 x s8 products
    _block_sums(lambda kb: emit_q4_quad_probe(kb, K, n, tokens), TARGETS[target], w, "q4_0", x, n, K)


@pytest.mark.skipif("host" not in GROUPED or not q4_group_ok(TARGETS["host"], "q8_0"),
                    reason="host CPU lacks AVX-512 VNNI (the grouped q8_0 path)")
@pytest.mark.parametrize("K", [k for k, _ in ODD_K] + [512], ids=[why for _, why in ODD_K] + ["whole groups"])
def test_grouped_q8_0_block_sums_are_ggml_integer_sums_exactly(K):
    """q8_0's codes through vpdpbusd as w + 128 with the start taking 128 * sum(x) back: exact for
    every code, -128 (which ggml never writes, a GGUF may hold) and +-127 included, whole and
    partial groups."""
    rng = np.random.default_rng(K + 1)
    n = 5
    w = quant.quantize(rng.standard_normal((n, K)).astype(np.float32), "q8_0")
    x = rng.standard_normal((1, K)).astype(np.float32) * 3
    x[0, -32:] = -127.0 / np.arange(1, 33)         # the last block uses the full int8 range
    x[0, :32] = 127.0 / np.arange(1, 33)
    w[0, 2:34] = np.int8(-128).view(np.uint8)      # the extremes of the codes meet them
    w[1, -32:] = np.int8(127).view(np.uint8)
    w[2, -32:] = np.int8(-128).view(np.uint8)
    _block_sums(lambda kb: emit_q4_group_probe(kb, K, n, "q8_0"), TARGETS["host"], w, "q8_0", x, n, K)


def test_q8_0_is_grouped_on_avx512_vnni_only():
    """Compile-only: q8_0 takes the grouped vpdpbusd path on AVX-512 VNNI and stays off it on
    AVX2, where vpmaddubsw's i16 pairs of (w + 128) * x would saturate."""
    assert q4_group_ok(VNNI512, "q8_0") and not q4_group_ok(AVX2, "q8_0")
    case = matmul_case("q8_0", 8, 8, True, None, K=576, N=48)
    module = ir.Module("t")
    module.triple = VNNI512.triple
    emit_op(module, VNNI512, case.graph, case.op, "kernel")
    asm = emit(str(module), VNNI512, "asm").decode()
    assert "vpdpbusd" in asm and "zmm" in asm


def _run_with_guard_page(case: Case, target: str, queue) -> None:
    """Child process: the weight rows end where a PROT_NONE page begins, so a load past the last
    row's end faults (prefetches never do)."""
    page = mmap.PAGESIZE
    w = case.arrays["w"]
    size = -(-w.nbytes // page) * page
    buf = mmap.mmap(-1, size + page)
    libc = ctypes.CDLL(None)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if libc.mprotect(ctypes.c_void_p(base + size), page, 0) != 0:
        queue.put("mprotect failed")
        return
    guarded = np.frombuffer(buf, np.uint8, w.nbytes, size - w.nbytes).reshape(w.shape)
    guarded[...] = w
    case.arrays["w"] = guarded
    arrays, _ = run_case(case, TARGETS[target], nth=2)
    try:
        check(case, arrays)
        queue.put("ok")
    except AssertionError as e:
        queue.put(str(e))


@pytest.mark.skipif(not GROUPED, reason=NO_GROUPED)
@pytest.mark.parametrize("target", GROUPED)
@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1"])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (5, 5)])
def test_grouped_q4_partial_group_never_reads_past_the_weights(target, wdtype, T, n_tokens):
    case = matmul_case(wdtype, T, n_tokens, False, None, K=576, N=9)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_run_with_guard_page, args=(case, target, queue))
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the kernel died (exit code {child.exitcode}): a read past the weights"
    assert queue.get(timeout=5) == "ok"


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("T,n_tokens,first", [(1, 1, 0), (7, 7, 0), (7, 5, 8), (7, 4, None), (1, 1, 99)])
def test_attention_eviction_scores_match_interpreter(kv_dtype, T, n_tokens, first):
    """Each scored row (slot >= first) adds its softmax weights per KV head; the control off or
    past the step leaves the scores untouched (the check compares them with the interpreter's)."""
    case = scored_attention_case(T, n_tokens, kv_dtype, first)
    arrays = run_case(case, TARGETS["host"], nth=3)[0]
    check(case, arrays)
    untouched = first is None or first >= case.step.n_past + n_tokens
    assert np.array_equal(arrays["sc"], case.arrays["sc"]) == untouched


# -- Qwen: biases (Qwen2) and per-head q/k norms (Qwen3) --------------------------------------

BIASED = [(False, None), (True, None), (False, "add"), (True, "silu_mul"), (True, "rope_kv_store")]


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1", "q8_0", "f16", "f32"])
@pytest.mark.parametrize("prologue,epilogue", BIASED, ids=[f"{'rms' if p else 'x'}-{e}" for p, e in BIASED])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (6, 5)])
def test_matmul_with_a_bias_matches_interpreter(target, wdtype, prologue, epilogue, T, n_tokens):
    """The bias is added to every dot product before the epilogue: a plain matmul's third input
    (--no-fuse), and attr bias of each fused form; K = 160 and N = 45 leave partial tiles."""
    case = matmul_case(wdtype, T, n_tokens, prologue, epilogue, K=160, N=45, seed=T + 3, bias=True)
    check(case, run_case(case, TARGETS[target], nth=3)[0])


# (n_heads, n_kv_heads, head_dim): Qwen3-0.6B's 16:8 x 128 scaled down, head_dim 48 (no power of
# 2), 100 (rows end in narrower vectors), 64 with MQA
QK_HEADS = [(4, 2, 128), (4, 2, 48), (3, 1, 100), (6, 1, 64)]


# (weights, cache): a q8_0 / q4_0 cache holds whole 32-value blocks of a head, so not with head_dim 100
QK_RUNS = [(w, c, h) for w, c in [("q4_0", "f16"), ("q8_0", "q8_0"), ("f32", "f32"), ("f16", "f16"), ("q4_1", "f32"),
                                  ("q4_1", "q4_0")]
           for h in QK_HEADS if c not in quant.BLOCK_BYTES or h[2] % 32 == 0]


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("wdtype,cache_dtype,heads", QK_RUNS, ids=[f"{w}-{c}-{h}.{k}x{d}" for w, c, (h, k, d) in QK_RUNS])
@pytest.mark.parametrize("T,n_tokens", [(1, 1), (6, 5)])
def test_qk_norm_rope_kv_store_epilogue_matches_interpreter(target, wdtype, cache_dtype, heads, T, n_tokens):
    case = matmul_case(wdtype, T, n_tokens, True, "rope_kv_store", cache_dtype=cache_dtype, heads=heads,
                       qk_norm=True, seed=heads[2] + T)
    check(case, run_case(case, TARGETS[target], nth=2)[0])


@pytest.mark.parametrize("norm_dtype", ["f32", "f16", "bf16"])
def test_qk_norm_with_a_bias_and_each_norm_weight_dtype_matches_interpreter(norm_dtype):
    for T, n in ((1, 1), (7, 6)):
        case = matmul_case("q4_0", T, n, True, "rope_kv_store", cache_dtype="f16", heads=(4, 2, 48),
                           qk_norm=True, qk_norm_dtype=norm_dtype, bias=True, seed=T)
        check(case, run_case(case, TARGETS["host"], nth=2)[0])
