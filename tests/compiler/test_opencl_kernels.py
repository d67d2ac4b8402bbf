"""Every OpenCL kernel family against the numpy interpreter, on PoCL, on random non-zero data.

Each test builds a one-op graph, runs it through OpenCLBackend.from_graphs (the same codegen,
build and binding path a plan takes) and compares with interpret.OPS for that op.
Tolerances: f32/f16/bf16 weights 1e-4 relative to the output's scale; q4_0/q4_1/q8_0 weights
the same, since the kernels quantize activations to Q8_0 (Q8_1 for q4_1) exactly as the
interpreter does (a rounding tie resolved differently moves one block by one step: covered by
2e-3). On NVIDIA (sm_80+) the prefill matmul runs on tensor cores: quantized weights keep the
exact integer block sums (same tolerance), f16 weights multiply f16-rounded activations (1e-3).
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np
import pytest

from llmrs.compiler import quant
from llmrs.compiler.codegen.opencl import generate, matvec_shape, tile_shape
from llmrs.compiler.codegen.opencl_tuning import OpenCLTuning
from llmrs.compiler.interpret import OPS, Interpreter, Step
from llmrs.compiler.ir import Graph, LazyTensor
from llmrs.compiler.rope import rope_inv_freq

cl = pytest.importorskip("pyopencl")
from llmrs.runtime.backends.opencl import OpenCLBackend, device_options, pick_device  # noqa: E402
from llmrs.runtime.backends.opencl_device import _cl  # noqa: E402

# skipped, naming Debian's PoCL, where no OpenCL device can build kernels (pip's PoCL on a Zen 5)
pytestmark = pytest.mark.usefixtures("opencl_device")

WEIGHT_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
QUANT_DTYPES = ("q4_0", "q4_1", "q8_0")
# The epilogues are shared by every weight dtype (only the block loads differ, covered by the
# plain matmul tests), so fused variants run on a few dtypes: each variant is a PoCL compile of
# a few seconds on a cold cache. q4_1 is among them: its blocks add a term (the minimum times
# the activations' sum) in every K loop the epilogues follow.
EPILOGUE_DTYPES = ("q4_0", "f16", "q8_0", "q4_1")
TUNING = OpenCLTuning()   # a case that needs other shapes passes replace(TUNING, field=value)


def _storage(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in QUANT_DTYPES:
        return quant.quantize(arr, dtype)
    if dtype == "bf16":
        return (arr.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return arr.astype({"f32": np.float32, "f16": np.float16, "i32": np.int32}[dtype])


class OneOp:
    """A graph of one op; `acts` are written to the device, `params` stored as weights."""

    def __init__(self, T: int, name: str = "decode"):
        self.g = Graph(name, T, meta={})
        self.data: dict[str, np.ndarray] = {}

    def act(self, name: str, arr: np.ndarray, dtype: str = "f32") -> str:
        self.g.add_value(name, arr.shape, dtype, kind="input")
        self.data[name] = arr.astype(np.int32 if dtype == "i32" else np.float32)
        return name

    def param(self, name: str, arr: np.ndarray, dtype: str, kind: str = "param") -> str:
        raw = _storage(arr, dtype)
        self.g.add_value(name, arr.shape, dtype, kind=kind)
        self.g.weights[name] = LazyTensor.of(raw, dtype)
        return name

    def state(self, name: str, arr: np.ndarray, dtype: str) -> str:
        self.g.add_value(name, arr.shape, dtype, kind="state")
        self.data[name] = _storage(arr, dtype)
        return name

    def out(self, name: str, shape, dtype: str = "f32", alias: str | None = None) -> str:
        return self.g.add_value(name, shape, dtype, alias=alias)

    def run(self, kind: str, inputs: list[str], outputs: list[str], n_tokens: int, n_past: int = 0,
            start_pos: int | None = None, again: bool = False, tuning: OpenCLTuning = TUNING,
            oracle: bool = True, **attrs) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(opencl outputs, interpreter outputs), each trimmed to the step's rows, the kernels
        generated with `tuning`; self.launches: the launch table. again: the step runs twice, and
        the second run's outputs must equal the first's bit for bit (state a kernel leaves for the
        next launch, such as ticket counters, is put back). oracle=False: no interpreter outputs
        (inputs it refuses, which a kernel must survive)."""
        g = self.g
        op = g.add_op(kind, inputs, outputs, **attrs)
        g.inputs = []   # acts are written below; enqueue() then writes no tokens
        g.outputs = list(outputs)
        g.verify()
        start_pos = n_past if start_pos is None else start_pos
        program = generate({g.name: g}, tuning)
        self.launches = program["graphs"][g.name]
        be = OpenCLBackend.from_graphs({g.name: g}, program)
        self.kernels = [b.kernel.function_name for b in be.launches[g.name]]
        self.build_options = be.build_options
        for name, arr in self.data.items():
            be.write_value(g.name, name, arr)
        be.enqueue(g.name, np.zeros(n_tokens, np.int32), n_past, start_pos)
        be.queue.finish()
        it = Interpreter(g)
        args = []
        for name in inputs:
            v = g.values[name]
            if v.kind in ("param", "const"):
                args.append(it.raw(name))
            else:  # the interpreter holds only the step's rows of an activation
                rows = n_tokens if v.kind == "input" and v.shape[0] == g.T else None
                args.append(self.data[name][:rows].copy())
        want = OPS[kind](it, op, Step(n_tokens, n_past, start_pos), *args) if oracle else []

        def read() -> list[np.ndarray]:
            got = []
            for name in outputs:
                v = g.values[name]
                rows = None if v.alias or v.shape[0] == 1 else n_tokens
                got.append(be.read_value(g.name, name, rows=rows))
            return got

        got = read()
        if again:
            be.enqueue(g.name, np.zeros(n_tokens, np.int32), n_past, start_pos)
            be.queue.finish()
            for first, second in zip(got, read()):
                np.testing.assert_array_equal(first, second)
        return got, want


def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = np.max(np.abs(want)) + 1e-30
    err = np.max(np.abs(got - want)) / scale
    assert err <= rtol, f"max error {err:.2e} of the output's scale (tolerance {rtol:.0e})"


# a cache block's codes may round one value to the next code where the kernel's floats differ from
# the interpreter's in the last bit: a step is 1/127 (q8_0) or 1/8 (q4_0) of the block's largest
# value; only the rare value on a rounding edge does
BLOCK_KV_TOL = {"q8_0": 1e-2, "q4_0": 0.13}


def _close_cache(got: np.ndarray, want: np.ndarray, kv: str, share: float = 0.01) -> None:
    """Caches of 32-value blocks (GGML bytes): what they decode to; at most `share` of the
    values a code away from the interpreter's."""
    got, want = quant.dequantize(got, kv), quant.dequantize(want, kv)
    _close(got, want, BLOCK_KV_TOL[kv])
    assert np.mean(got != want) <= share, f"{np.mean(got != want):.1%} of the cache values differ"


def _rand(rng, *shape, scale=1.0):
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[x == 0] = 0.5
    return x


@functools.cache
def _tensor_core_prefill() -> bool:
    """Whether the test device runs the prefill matmul's tensor-core body (NVIDIA, sm_80+)."""
    return "-DUSE_NV_MMA" in device_options(pick_device())


def _tol(dtype: str) -> float:
    # The tensor-core body rounds f16-weight activations to f16 (2^-11 relative per value);
    # over a dot product that stays under 1e-3 of the output's scale.
    if dtype == "f16" and _tensor_core_prefill():
        return 1e-3
    return 2e-3 if dtype in QUANT_DTYPES else 1e-4


# attention_tiled's tensor-core body rounds Q (times the scale) and P to f16
ATT_MMA_TOL = 2e-3


def _attention_mma(kv_dtype: str, hd: int, graph_rows: int, bq: int = TUNING.att_bq) -> bool:
    """Whether the test device runs this attention's prefill on tensor cores (attention.cl's
    ATT_MMA_BODY: NVIDIA sm_80+, f16 caches, head_dim % 16 == 0 and <= 128, 128-row groups)."""
    return graph_rows > 1 and kv_dtype == "f16" and hd % 16 == 0 and hd <= 128 and bq == 128 and _tensor_core_prefill()


def _att_tol(kv_dtype: str, hd: int, graph_rows: int, bq: int = TUNING.att_bq) -> float:
    return ATT_MMA_TOL if _attention_mma(kv_dtype, hd, graph_rows, bq) else 1e-4


@pytest.mark.parametrize("wdt", WEIGHT_DTYPES)
@pytest.mark.parametrize("rows,n_tokens,n", [(1, 1, 136), (70, 67, 136), (1, 1, 8200)])
def test_matmul_matches_interpreter(wdt, rows, n_tokens, n):
    rng = np.random.default_rng(1)
    k = 96
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, k))
    w = b.param("w", _rand(rng, n, k), wdt)
    y = b.out("y", (rows, n))
    got, want = b.run("matmul", [x, w], [y], n_tokens)
    _close(got[0], want[0], _tol(wdt))


@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (70, 67)])
def test_q4_1_blocks_add_the_minimum_times_the_q8_1_sum_rounded_as_ggml(rows, n_tokens):
    """Weights far from zero make m_w * s_x most of every output. s_x = f16(d_x * sum(q_x)) with
    d_x before its own f16 rounding (quantize_row_q8_1_ref); an s_x left unrounded, or made from
    the rounded d_x, moves these outputs by 7e-5 to 2e-4 of their scale. Without a prologue the
    kernels quantize x bit for bit as the interpreter (1 / d correctly rounded, which codegen
    asks for where the device has it), so only the order of float sums differs: 1e-5."""
    if "-cl-fp32-correctly-rounded-divide-sqrt" not in device_options(pick_device()):
        pytest.skip("the device rounds 1 / d its own way: activation codes may differ at ties")
    rng = np.random.default_rng(25)
    k, n = 352, 75                  # 11 blocks (no multiple of 4 or 8 blocks); N odd
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, k))
    w = b.param("w", _rand(rng, n, k) + 3.0, "q4_1")
    got, want = b.run("matmul", [x, w], [b.out("y", (rows, n))], n_tokens)
    _close(got[0], want[0], 1e-5)


@pytest.mark.parametrize("wdt", EPILOGUE_DTYPES)
@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (9, 9)])
def test_fused_rms_silu_mul_matches_interpreter(wdt, rows, n_tokens):
    rng = np.random.default_rng(2)
    k, f = 64, 96
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, k, scale=3.0))
    w = b.param("w", _rand(rng, 2 * f, k), wdt)
    nw = b.param("nw", _rand(rng, k), "f32")
    y = b.out("y", (rows, f))
    got, want = b.run("fused_matmul", [x, w, nw], [y], n_tokens, prologue="rms_norm", epilogue="silu_mul", eps=1e-5)
    _close(got[0], want[0], _tol(wdt))


@pytest.mark.parametrize("wdt", ["q4_0", "q4_1", "f16"])
def test_prefill_matmul_with_wide_row_tiles_matches_interpreter(wdt):
    rng = np.random.default_rng(15)
    k, f = 64, 136
    b = OneOp(70)
    x = b.act("x", _rand(rng, 70, k, scale=3.0))
    w = b.param("w", _rand(rng, 2 * f, k), wdt)
    nw = b.param("nw", _rand(rng, k), "f32")
    y = b.out("y", (70, f))
    got, want = b.run("fused_matmul", [x, w, nw], [y], 67, prologue="rms_norm", epilogue="silu_mul", eps=1e-5,
                      tuning=replace(TUNING, tile_n_min_groups=0))   # 128-row tiles whatever N
    _close(got[0], want[0], _tol(wdt))


@pytest.mark.parametrize("wdt", ["q4_0", "q4_1", "q8_0", "f16"])
@pytest.mark.parametrize("wide", [False, True])
def test_prefill_matmul_over_several_k_stages_and_token_tiles_matches_interpreter(wdt, wide):
    # K = 352 is 11 blocks: 2 full tensor-core stages of 4 blocks and a partial one (f16: 5.5
    # stages of 64); 130 of 131 rows is three 64-token tiles, the last of 2 tokens
    rng = np.random.default_rng(16)
    k, n = 352, 200
    b = OneOp(131)
    x = b.act("x", _rand(rng, 131, k, scale=2.0))
    w = b.param("w", _rand(rng, n, k), wdt)
    nw = b.param("nw", _rand(rng, k), "f16")
    y = b.out("y", (131, n))
    got, want = b.run("fused_matmul", [x, w, nw], [y], 130, prologue="rms_norm", eps=1e-5,
                      tuning=replace(TUNING, tile_n_min_groups=0) if wide else TUNING)
    _close(got[0], want[0], _tol(wdt))


@pytest.mark.parametrize("wdt", ["q4_0", "q4_1", "q8_0", "f16"])
@pytest.mark.parametrize("prologue", ["rms_norm", None])
def test_prefill_matmul_with_activations_staged_once_matches_interpreter(wdt, prologue):
    # stage_x quantizes x once per matmul (RMS prologue included) and the tiled kernel reads its
    # codes; K = 352 (11 blocks: a partial last tensor-core stage), 130 of 131 rows (3 token
    # tiles, rows past 130 of the staging buffer never read); stage_x's 256 threads take 88
    # float4 of a row with K = 352, 2.5 passes of them with K = 2560. f16 weights: only the tensor-core body reads
    # the staged f16 x; the fp32 body's stage_x does nothing
    rng = np.random.default_rng(26)
    for k, n in [(352, 200), (2560, 72)]:
        b = OneOp(131)
        x = b.act("x", _rand(rng, 131, k, scale=2.0))
        w = b.param("w", _rand(rng, n, k), wdt)
        y = b.out("y", (131, n))
        if prologue:
            nw = b.param("nw", _rand(rng, k), "f16")
            got, want = b.run("fused_matmul", [x, w, nw], [y], 130, prologue="rms_norm", eps=1e-5)
        else:
            got, want = b.run("matmul", [x, w], [y], 130)
        assert b.kernels == ["stage_x", "matmul_tiled"]
        _close(got[0], want[0], _tol(wdt))


def _tiled_launch(b: OneOp) -> dict:
    """The op's matmul_tiled launch (its stage_x launch aside)."""
    launch, = [entry for entry in b.launches if entry["kernel"] == "matmul_tiled"]
    return launch


def _prefill_rms_matmul(wdt: str, epilogue: str | None, rows: int, k: int, n: int, seed: int,
                        again: bool = False, tuning: OpenCLTuning = TUNING,
                        ) -> tuple[OneOp, list[np.ndarray], list[np.ndarray]]:
    """A prefill fused_matmul with the RMS prologue and `epilogue` over rows - 1 of `rows` tokens
    (the last token tile partial), on random data: the op, its opencl and interpreter outputs."""
    rng = np.random.default_rng(seed)
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, k, scale=2.0))
    w = b.param("w", _rand(rng, n, k), wdt)
    nw = b.param("nw", _rand(rng, k), "f16")
    ins = [x, w, nw] + ([b.act("res", _rand(rng, rows, n))] if epilogue == "add" else [])
    y = b.out("y", (rows, n // 2 if epilogue == "silu_mul" else n))
    got, want = b.run("fused_matmul", ins, [y], rows - 1, again=again, tuning=tuning, prologue="rms_norm",
                      epilogue=epilogue, eps=1e-5)
    return b, got, want


# each weight type, split count, epilogue kind and body at least once (the emulated tensor-core
# body is slow on PoCL)
SPLIT_K_CASES = [("q4_0", 2, "add", "mma"), ("f16", 2, "silu_mul", "mma"), ("q8_0", 4, None, "mma"),
                 ("q4_1", 2, None, "fp32"), ("f16", 4, None, "fp32")]


@pytest.mark.parametrize("wdt,split,epilogue,body", SPLIT_K_CASES,
                         ids=[f"{w}-s{s}-{e}-{b}" for w, s, e, b in SPLIT_K_CASES])
def test_prefill_matmul_split_over_k_matches_interpreter(wdt, split, epilogue, body, monkeypatch):
    # Split-K (matmul.cl MM_SPLIT): a tile's `split` groups each sum K / split, the last to take a
    # ticket adds the partials and runs the epilogue. K = 512 (stages of 128 / 64 / 32 within each
    # split), 69 of 70 rows: two token tiles x three 128-row tiles, each with its counter; the
    # step runs twice, so counters left at anything but 0 would show. Both bodies: the tensor-core
    # one (emulated off NVIDIA; f16: the cp.async one) and the portable fp32 one.
    if body == "mma":
        _emulate_mma(monkeypatch)
    else:
        monkeypatch.setenv("LLMRS_OPENCL_NO_MMA", "1")   # NVIDIA too: the fp32 body
    tuning = replace(TUNING, tile_split_k_f16=split, tile_split_k_quant=split,
                     tile_n_min_groups=10 ** 6)   # always too few tiles: split (and no pairs)
    b, got, want = _prefill_rms_matmul(wdt, epilogue, 70, 512, 272, seed=29, again=True, tuning=tuning)
    launch = _tiled_launch(b)
    assert f"-DMM_SPLIT={split}" in launch["options"] and "-DTN=128" in launch["options"]
    assert launch["groups"] == split * 3   # 272 rows (silu_mul: 136 pairs, 64 a group)
    assert ("-DUSE_NV_MMA" in b.build_options) == (body == "mma")
    _close(got[0], want[0], 1e-3 if wdt == "f16" else _tol(wdt))


TENSOR_CORE_CASES = [(w, e, v) for w in ("q4_0", "q4_1", "q8_0", "f16")
                     for e, v in [(None, "default"), ("silu_mul", "default"), ("add", "default"), (None, "wide")]]


@pytest.mark.parametrize("wdt,epilogue,variant", TENSOR_CORE_CASES,
                         ids=[f"{w}-{e}-{v}" for w, e, v in TENSOR_CORE_CASES])
def test_tensor_core_prefill_body_matches_interpreter(wdt, epilogue, variant, monkeypatch):
    # The tensor-core body (USE_NV_MMA) with mma.sync emulated in C (common.cl EMU_MMA) where the
    # device has no tensor cores, on them where it has: its fragment layouts, staging and
    # epilogues checked on any device. K = 352: a partial last
    # stage (f16: 5.5 stages of 64); 130 of 131 rows: three token tiles, the last of 2, taken
    # one at a time (paired tiles: test_prefill_matmul_token_pairs_*). Variant wide: 128-row
    # tiles, whose f16 stages come by cp.async and ldmatrix (emulated; 3 stages)
    _emulate_mma(monkeypatch)
    tuning = replace(TUNING, tile_pair_f16=False, tile_n_min_groups=1 if variant == "wide" else TUNING.tile_n_min_groups)
    b, got, want = _prefill_rms_matmul(wdt, epilogue, 131, 352, 272, seed=27, tuning=tuning)
    # a device with tensor cores runs these cases on them (its real mma.sync, cp.async, ldmatrix)
    assert "-DUSE_NV_MMA" in b.build_options and b.kernels == ["stage_x", "matmul_tiled"]
    assert ("-DMMA_ASYNC" in _tiled_launch(b)["options"]) == (wdt == "f16" and variant == "wide")
    _close(got[0], want[0], 1e-3 if wdt == "f16" else _tol(wdt))   # f16: x rounded to f16


def test_prefill_tile_shapes_of_a_1b_layer():
    # codegen's tile policy on Llama-3.2-1B's matmuls at prefill 512 (H200 round 13): f16 gate_up
    # has groups to spare and pairs its token tiles; qkv / o / down must split K and keep
    # unpaired tiles (pairs that split were slower); q4_0 never pairs, and halves narrow tiles
    a = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 64}
    shapes = {"qkv": (2048, 3072, "rope_kv_store"), "o": (2048, 2048, "add"),
              "gate_up": (2048, 16384, "silu_mul"), "down": (8192, 2048, "add")}
    got = {(name, wt): tile_shape(TUNING, 512, k, n, wt, epi, a) for name, (k, n, epi) in shapes.items()
           for wt in ("f16", "q4_0")}
    assert got == {("qkv", "f16"): (128, 2, False), ("o", "f16"): (128, 2, False),
                   ("gate_up", "f16"): (128, 1, True), ("down", "f16"): (128, 2, False),
                   ("qkv", "q4_0"): (64, 1, False), ("o", "q4_0"): (64, 1, False),
                   ("gate_up", "q4_0"): (128, 1, False), ("down", "q4_0"): (64, 1, False)}
    assert tile_shape(TUNING, 64, 2048, 16384, "f16", "silu_mul", a)[2] is False   # one token tile: no pair


# (body, epilogue, cp.async stage K, ring depth): the cp.async body (emulated off NVIDIA) at both
# stage shapes, and the portable fp32 body, which takes the two tiles one after the other
TOKEN_PAIR_CASES = [("mma", None, 32, 2), ("mma", "silu_mul", 16, 3), ("mma", "add", 32, 3),
                    ("fp32", "silu_mul", 32, 2)]


@pytest.mark.parametrize("body,epilogue,stage_k,stages", TOKEN_PAIR_CASES,
                         ids=[f"{b}-{e}-k{k}x{s}" for b, e, k, s in TOKEN_PAIR_CASES])
def test_prefill_matmul_token_pairs_match_interpreter(body, epilogue, stage_k, stages, monkeypatch):
    # MM_TPAIR: a group takes two 64-token tiles. 130 of 131 rows: two pairs, the second holding
    # a partial tile and an empty one; f16 weights, 128-row tiles, the RMS prologue through
    # stage_x; K = 352 (11 stages of 32, 22 of 16).
    if body == "mma":
        _emulate_mma(monkeypatch)
        monkeypatch.setenv("LLMRS_OPENCL_NO_WGMMA", "1")   # Hopper: mma.sync, not wgmma
    else:
        monkeypatch.setenv("LLMRS_OPENCL_NO_MMA", "1")
    tuning = replace(TUNING, tile_n_min_groups=1, async_pair_k=stage_k, async_pair_stages=stages)
    b, got, want = _prefill_rms_matmul("f16", epilogue, 131, 352, 272, seed=31, tuning=tuning)
    launch = _tiled_launch(b)
    assert "-DMM_TPAIR" in launch["options"] and "-DTN=128" in launch["options"] and launch["row_tile"] == 128
    assert not any(o.startswith("-DMM_SPLIT") for o in launch["options"]) and launch["groups"] == 3
    assert ("-DUSE_NV_MMA" in b.build_options) == (body == "mma")
    _close(got[0], want[0], 1e-3)


# (token tiles paired, split-K groups, epilogue, wgmma stage K): each wgmma N (128 paired, 64
# unpaired), merged splits, both stage sizes
WGMMA_CASES = [(True, 1, "silu_mul", 16), (False, 2, None, 16), (True, 1, None, 32), (False, 2, "add", 32)]


@pytest.mark.parametrize("pair,split,epilogue,wg_k", WGMMA_CASES,
                         ids=[f"{'pair' if p else 'single'}-s{s}-{e}-k{k}" for p, s, e, k in WGMMA_CASES])
def test_prefill_matmul_wgmma_matches_interpreter(pair, split, epilogue, wg_k, monkeypatch):
    # USE_NV_WGMMA: the f16 cp.async body multiplied by Hopper's warpgroup MMA from descriptors of
    # its stage layouts; on the card its real wgmma (the PTX patched to sm_90a), elsewhere
    # emulated in C from the same local memory. 130 of 131 rows, K = 512 (split: each group's
    # share a whole number of stages); the step runs twice (split counters back at 0).
    from llmrs.runtime.backends.opencl import device_options, pick_device
    device = device_options(pick_device())
    if "-DUSE_NV_MMA" in device and "-DUSE_NV_WGMMA" not in device:
        pytest.skip("tensor cores without wgmma (compute capability 8.x or 10+)")
    monkeypatch.setenv("LLMRS_OPENCL_EMULATE_WGMMA", "1")
    tuning = replace(TUNING, tile_pair_f16=pair, tile_split_k_f16=split, wgmma_k=wg_k,
                     tile_n_min_groups=1 if split == 1 else 10 ** 6)
    b, got, want = _prefill_rms_matmul("f16", epilogue, 131, 512, 272, seed=37, again=True, tuning=tuning)
    options = _tiled_launch(b)["options"]
    assert "-DTN=128" in options and "-DMMA_ASYNC" in options and ("-DMM_TPAIR" in options) == pair
    assert (f"-DMM_SPLIT={split}" in options) == (split > 1)
    assert "-DUSE_NV_WGMMA" in b.build_options
    _close(got[0], want[0], 1e-3)


def test_decode_matvec_binds_only_the_arguments_its_variant_reads():
    # a plain matvec binds x, w, y and 3 ints; the RMS prologue adds nw and eps, the residual add e0
    rng = np.random.default_rng(28)
    k, n = 128, 96
    for prologue, epilogue, want_args in [(None, None, 6), ("rms_norm", None, 8), (None, "add", 7),
                                          ("rms_norm", "silu_mul", 8)]:
        b = OneOp(1)
        x = b.act("x", _rand(rng, 1, k))
        w = b.param("w", _rand(rng, n, k), "q4_0")
        ins = [x, w] + ([b.param("nw", _rand(rng, k), "f32")] if prologue else [])
        ins += [b.act("res", _rand(rng, 1, n))] if epilogue == "add" else []
        y = b.out("y", (1, n // 2 if epilogue == "silu_mul" else n))
        got, want = b.run("fused_matmul", ins, [y], 1, prologue=prologue, epilogue=epilogue, eps=1e-5)
        launch, = b.launches
        assert len(launch["args"]) == want_args
        _close(got[0], want[0], _tol("q4_0"))


@pytest.mark.parametrize("wdt", EPILOGUE_DTYPES)
@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (66, 65)])
def test_fused_add_epilogue_matches_interpreter(wdt, rows, n_tokens):
    rng = np.random.default_rng(3)
    k, n = 128, 64
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, k))
    res = b.act("res", _rand(rng, rows, n))
    w = b.param("w", _rand(rng, n, k), wdt)
    y = b.out("y", (rows, n))
    got, want = b.run("fused_matmul", [x, w, res], [y], n_tokens, prologue=None, epilogue="add")
    _close(got[0], want[0], _tol(wdt))


@pytest.mark.parametrize("wdt,kv_dtype", [("q4_0", "f16"), ("f16", "f32"), ("q8_0", "f16"), ("q4_1", "f16")])
@pytest.mark.parametrize("rows,n_tokens,n_past,start_pos", [(1, 1, 5, 9), (12, 7, 3, 3)])
def test_fused_qkv_rope_kv_store_matches_interpreter(wdt, kv_dtype, rows, n_tokens, n_past, start_pos):
    rng = np.random.default_rng(4)
    h, kvh, hd, d, s = 4, 2, 16, 64, 24
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, d))
    w = b.param("w", _rand(rng, (h + 2 * kvh) * hd, d), wdt)
    nw = b.param("nw", _rand(rng, d), "f16")
    inv = b.param("inv_freq", rope_inv_freq(hd, 10000.0, None), "f32", kind="const")
    kc = b.state("kc", _rand(rng, s, kvh, hd), kv_dtype)
    vc = b.state("vc", _rand(rng, s, kvh, hd), kv_dtype)
    q = b.out("q", (rows, h * hd))
    kc2 = b.out("kc2", (s, kvh, hd), kv_dtype, alias="kc")
    vc2 = b.out("vc2", (s, kvh, hd), kv_dtype, alias="vc")
    got, want = b.run("fused_matmul", [x, w, nw, inv, kc, vc], [q, kc2, vc2], n_tokens, n_past, start_pos,
                      prologue="rms_norm", epilogue="rope_kv_store", eps=1e-5, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, theta=10000.0, scaling=None)
    tol = max(_tol(wdt), 1e-3 if kv_dtype == "f16" else 0)
    for gt, wt in zip(got, want):
        _close(gt.astype(np.float32), wt.astype(np.float32), tol)


@pytest.mark.parametrize("wdt", ["f32", "f16"])
@pytest.mark.parametrize("k", [900, 360])       # o_proj of 9 heads x 100 (no whole 16-byte units) and x 40
@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (70, 67)])
def test_float_matmul_with_k_not_a_multiple_of_32_matches_interpreter(wdt, k, rows, n_tokens):
    rng = np.random.default_rng(k)
    n = 72
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, k))
    res = b.act("res", _rand(rng, rows, n))
    w = b.param("w", _rand(rng, n, k, scale=0.1), wdt)
    y = b.out("y", (rows, n))
    got, want = b.run("fused_matmul", [x, w, res], [y], n_tokens, prologue=None, epilogue="add")
    _close(got[0], want[0], _tol(wdt))


@pytest.mark.parametrize("wdt,k", [("q4_0", 8256), ("q4_1", 8256), ("q8_0", 8256), ("f16", 2304), ("f32", 2304)])
def test_decode_matvec_with_k_longer_than_one_pass_of_its_threads_matches_interpreter(wdt, k):
    # several batches of weight loads per warp; float weights issue the first before x is
    # prepared (the RMS prologue's sum), quantized ones after the Q8_0 copy (on NVIDIA quantized
    # 8 lanes a block, by shuffles; elsewhere a thread a block)
    rng = np.random.default_rng(11)
    b = OneOp(1)
    x = b.act("x", _rand(rng, 1, k))
    w = b.param("w", _rand(rng, 40, k), wdt)
    nw = b.param("nw", _rand(rng, k), "f32")
    y = b.out("y", (1, 40))
    got, want = b.run("fused_matmul", [x, w, nw], [y], 1, prologue="rms_norm", eps=1e-5)
    _close(got[0], want[0], _tol(wdt))


def _matvec_splits(b: OneOp) -> set[int]:
    return {int(o.split("=")[1]) for launch in b.launches for o in launch["options"] if o.startswith("-DMV_SPLIT=")}


# Split-K decode matvec (float weights: quantized ones prepare x's Q8_0 copy, which every split
# group would repeat): K long enough for 4 warps per row, with a last slice that only some lanes
# of one warp reach (132 16-byte units, 2 passes of 4 x 32).
@pytest.mark.parametrize("epilogue", [None, "add", "silu_mul", "rope_kv_store"])
@pytest.mark.parametrize("max_split", [2, 4])
def test_split_k_decode_matvec_with_each_epilogue_matches_interpreter(epilogue, max_split):
    tuning = replace(TUNING, mv_max_split=max_split)
    wdt, k = "f16", 1056
    rng = np.random.default_rng(17)
    b = OneOp(1)
    x = b.act("x", _rand(rng, 1, k, scale=2.0))
    nw = b.param("nw", _rand(rng, k), "f16")
    if epilogue == "rope_kv_store":
        h, kvh, hd, s = 4, 2, 16, 8
        w = b.param("w", _rand(rng, (h + 2 * kvh) * hd, k, scale=0.05), wdt)
        inv = b.param("inv_freq", rope_inv_freq(hd, 10000.0, None), "f32", kind="const")
        kc = b.state("kc", _rand(rng, s, kvh, hd), "f32")
        vc = b.state("vc", _rand(rng, s, kvh, hd), "f32")
        outs = [b.out("q", (1, h * hd)), b.out("kc2", (s, kvh, hd), "f32", alias="kc"),
                b.out("vc2", (s, kvh, hd), "f32", alias="vc")]
        got, want = b.run("fused_matmul", [x, w, nw, inv, kc, vc], outs, 1, 5, 11, tuning=tuning,
                          prologue="rms_norm", epilogue=epilogue, eps=1e-5, n_heads=h, n_kv_heads=kvh,
                          head_dim=hd, theta=10000.0, scaling=None)
    elif epilogue == "silu_mul":
        f = 45                                  # 23 groups of 2 + 2 rows, the last half empty
        w = b.param("w", _rand(rng, 2 * f, k, scale=0.05), wdt)
        got, want = b.run("fused_matmul", [x, w, nw], [b.out("y", (1, f))], 1, tuning=tuning,
                          prologue="rms_norm", epilogue=epilogue, eps=1e-5)
    elif epilogue == "add":
        n = 70
        w = b.param("w", _rand(rng, n, k, scale=0.05), wdt)
        res = b.act("res", _rand(rng, 1, n))
        got, want = b.run("fused_matmul", [x, w, res], [b.out("y", (1, n))], 1, tuning=tuning, prologue=None,
                          epilogue="add")
    else:
        w = b.param("w", _rand(rng, 70, k, scale=0.05), wdt)
        got, want = b.run("matmul", [x, w], [b.out("y", (1, 70))], 1, tuning=tuning)
    assert _matvec_splits(b) == {max_split}
    for gt, wt in zip(got, want):
        _close(gt.astype(np.float32), wt.astype(np.float32), _tol(wdt))


def test_split_k_is_chosen_only_for_narrow_matrices_whose_groups_prepare_nothing_from_x():
    t = TUNING
    assert matvec_shape(t, 8192, 2048, False, "add", False) == (t.mv_wg, t.mv_wg // 32 // t.mv_max_split,
                                                                  t.mv_max_split)
    assert matvec_shape(t, 2048, 2048, False, "add", False)[2] == t.mv_max_split
    assert matvec_shape(t, 8192, 2048, True, "add", False)[2] == 1        # quantized: x's Q8_0 copy
    assert matvec_shape(t, 8192, 2048, True, "add", False)[0] == t.mv_wg_quant
    # float weights' RMS prologue rides in the K loop where K splits: nothing prepared, so split
    assert matvec_shape(t, 2048, 3072, False, "rope_kv_store", False)[2] > 1
    assert matvec_shape(t, 2048, 128256, False, None, False)[2] == 1      # wide: more rows per warp
    assert matvec_shape(t, 2048, 3072, False, "rope_kv_store", True) == (t.mv_wg, 64, 1)   # q8_0 blocks
    assert matvec_shape(t, 128, 40, False, None, False)[2] == 1           # 16 units: nothing to split


@pytest.mark.parametrize("wdt", ["q4_0", "q4_1", "f16", "f32"])
@pytest.mark.parametrize("max_split", [1, 2])
@pytest.mark.parametrize("wg_quant", [256, 512])
def test_decode_rms_prologue_late_or_prepared_and_each_group_size_matches_interpreter(wdt, max_split, wg_quant):
    # float weights: unsplit, the group sums x's squares first (prepared); split 2 ways, each warp
    # sums them in its K loop and scales its dot products at the end (-DMV_RMS_LATE)
    tuning = replace(TUNING, mv_max_split=max_split, mv_wg_quant=wg_quant)
    rng = np.random.default_rng(23)
    k, f = 2080 if wdt in QUANT_DTYPES else 1056, 40   # f16: 132 units, over 4 passes of 32 lanes
    b = OneOp(1)
    x = b.act("x", _rand(rng, 1, k, scale=3.0))
    w = b.param("w", _rand(rng, 2 * f, k, scale=0.05), wdt)
    nw = b.param("nw", _rand(rng, k), "f16")
    got, want = b.run("fused_matmul", [x, w, nw], [b.out("y", (1, f))], 1, tuning=tuning, prologue="rms_norm",
                      epilogue="silu_mul", eps=1e-5)
    late = any("-DMV_RMS_LATE" in launch["options"] for launch in b.launches)
    assert late == (wdt not in QUANT_DTYPES and max_split > 1)
    _close(got[0], want[0], _tol(wdt))


@pytest.mark.parametrize("wdt", ["f16", "f32", "q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 9])
def test_rms_prologue_with_a_folded_norm_weight_matches_interpreter(wdt, rows):
    # norm_folded (fuse.py norm_weight_fold): the kernels load no norm weight (-DNORM_UNIT)
    rng = np.random.default_rng(24)
    k, n = 2080, 72
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, k, scale=3.0))
    w = b.param("w", _rand(rng, n, k, scale=0.05), wdt)
    ones = b.param("ones", np.ones(k, np.float32), "f32", kind="const")
    got, want = b.run("fused_matmul", [x, w, ones], [b.out("y", (rows, n))], rows, prologue="rms_norm",
                      eps=1e-5, norm_folded=True)
    _close(got[0], want[0], _tol(wdt))


@pytest.mark.parametrize("wdt", ["q4_0", "q4_1", "f16"])
@pytest.mark.parametrize("rows,n_tokens,n_past,start_pos,wide", [(1, 1, 5, 9, False), (9, 7, 3, 3, False),
                                                                (9, 7, 3, 3, True)])
@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_fused_qkv_rope_into_block_kv_cache_matches_interpreter(wdt, rows, n_tokens, n_past, start_pos, wide, kv):
    rng = np.random.default_rng(12)
    h, kvh, hd, d, s = 2, 1, 64, 64, 16
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, d))
    w = b.param("w", _rand(rng, (h + 2 * kvh) * hd, d), wdt)
    nw = b.param("nw", _rand(rng, d), "f32")
    inv = b.param("inv_freq", rope_inv_freq(hd, 500000.0, None), "f32", kind="const")
    kc = b.state("kc", _rand(rng, s, kvh, hd), kv)
    vc = b.state("vc", _rand(rng, s, kvh, hd), kv)
    q = b.out("q", (rows, h * hd))
    kc2 = b.out("kc2", (s, kvh, hd), kv, alias="kc")
    vc2 = b.out("vc2", (s, kvh, hd), kv, alias="vc")
    got, want = b.run("fused_matmul", [x, w, nw, inv, kc, vc], [q, kc2, vc2], n_tokens, n_past, start_pos,
                      tuning=replace(TUNING, tile_n_min_groups=0) if wide else TUNING,
                      prologue="rms_norm", epilogue="rope_kv_store", eps=1e-5, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, theta=500000.0, scaling=None)
    _close(got[0], want[0], _tol(wdt))
    for gt, wt in zip(got[1:], want[1:]):
        _close_cache(gt, wt, kv)


@pytest.mark.parametrize("wdt,h,kvh,hd", [("q4_0", 3, 1, 96), ("f16", 4, 2, 32), ("q8_0", 2, 1, 160)])
@pytest.mark.parametrize("rows,n_tokens,n_past,start_pos", [(1, 1, 5, 9), (9, 7, 3, 3)])
@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_fused_qkv_rope_into_a_block_cache_for_head_dim_an_odd_multiple_of_32_matches_interpreter(
        wdt, h, kvh, hd, rows, n_tokens, n_past, start_pos, kv):
    # a cache block of such a head spans both RoPE halves: one group per head (ROPE_HEADS)
    rng = np.random.default_rng(hd)
    d, s = 64, 16
    b = OneOp(rows)
    x = b.act("x", _rand(rng, rows, d))
    w = b.param("w", _rand(rng, (h + 2 * kvh) * hd, d), wdt)
    nw = b.param("nw", _rand(rng, d), "f32")
    inv = b.param("inv_freq", rope_inv_freq(hd, 500000.0, None), "f32", kind="const")
    kc = b.state("kc", _rand(rng, s, kvh, hd), kv)
    vc = b.state("vc", _rand(rng, s, kvh, hd), kv)
    q = b.out("q", (rows, h * hd))
    kc2 = b.out("kc2", (s, kvh, hd), kv, alias="kc")
    vc2 = b.out("vc2", (s, kvh, hd), kv, alias="vc")
    got, want = b.run("fused_matmul", [x, w, nw, inv, kc, vc], [q, kc2, vc2], n_tokens, n_past, start_pos,
                      prologue="rms_norm", epilogue="rope_kv_store", eps=1e-5, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, theta=500000.0, scaling=None)
    assert b.kernels == ["matvec"]
    _close(got[0], want[0], _tol(wdt))
    for gt, wt in zip(got[1:], want[1:]):
        _close_cache(gt, wt, kv)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("rows,n_tokens,n_past", [(1, 1, 0), (1, 1, 600), (40, 37, 5)])
def test_attention_matches_interpreter(kv_dtype, rows, n_tokens, n_past):
    rng = np.random.default_rng(5)
    h, kvh, hd, s = 8, 2, 32 if kv_dtype in BLOCK_KV_TOL else 16, 640
    b = OneOp(rows)
    q = b.act("q", _rand(rng, rows, h * hd))
    kc = b.state("kc", _rand(rng, s, kvh, hd), kv_dtype)
    vc = b.state("vc", _rand(rng, s, kvh, hd), kv_dtype)
    o = b.out("o", (rows, h * hd))
    got, want = b.run("attention", [q, kc, vc], [o], n_tokens, n_past, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, scale=1.0 / math.sqrt(hd))
    _close(got[0], want[0], _att_tol(kv_dtype, hd, rows))


# head_dim / 4 not dividing the split kernel's 128 threads (48, 80, 100), past the key-per-lane
# decode kernel (256, with half-size prefill key tiles), or through it at 3 dims a lane (96);
# MHA, MQA and a GQA group of 3
ODD_HEADS = [(3, 3, 48, "f16"), (2, 1, 80, "f32"), (9, 3, 96, "f16"), (3, 1, 96, "q8_0"), (2, 2, 100, "f32"),
             (4, 1, 100, "f16"), (2, 1, 256, "f16"), (6, 2, 96, "q4_0")]


@pytest.mark.parametrize("h,kvh,hd,kv_dtype", ODD_HEADS, ids=[f"{h}.{k}x{d}-{t}" for h, k, d, t in ODD_HEADS])
@pytest.mark.parametrize("rows,n_tokens,n_past", [(1, 1, 600), (40, 37, 5)])
def test_attention_for_any_head_dim_and_group_matches_interpreter(h, kvh, hd, kv_dtype, rows, n_tokens, n_past):
    rng = np.random.default_rng(hd)
    s = 640
    b = OneOp(rows)
    q = b.act("q", _rand(rng, rows, h * hd, scale=0.5))
    kc = b.state("kc", _rand(rng, s, kvh, hd), kv_dtype)
    vc = b.state("vc", _rand(rng, s, kvh, hd), kv_dtype)
    o = b.out("o", (rows, h * hd))
    got, want = b.run("attention", [q, kc, vc], [o], n_tokens, n_past, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, scale=1.0 / math.sqrt(hd))
    _close(got[0], want[0], _att_tol(kv_dtype, hd, rows))


def test_split_decode_attention_over_a_gqa_group_matches_interpreter():
    # head_dim 16 (no multiple of 32): attention_split, a group per query head and split
    rng = np.random.default_rng(13)
    h, kvh, hd, s = 8, 2, 16, 96
    b = OneOp(1)
    q = b.act("q", _rand(rng, 1, h * hd))
    kc = b.state("kc", _rand(rng, s, kvh, hd), "f16")
    vc = b.state("vc", _rand(rng, s, kvh, hd), "f16")
    o = b.out("o", (1, h * hd))
    got, want = b.run("attention", [q, kc, vc], [o], 1, 70, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, scale=1.0 / math.sqrt(hd))
    assert b.kernels == ["attention_split"]
    _close(got[0], want[0], 1e-4)


@pytest.mark.parametrize("bq", [64, 128])
def test_prefill_attention_with_more_query_rows_per_group_matches_interpreter(bq):
    rng = np.random.default_rng(17)
    h, kvh, hd, s, rows = 4, 2, 64, 320, 150
    b = OneOp(rows, name="prefill")
    q = b.act("q", _rand(rng, rows, h * hd, scale=0.5))
    kc = b.state("kc", _rand(rng, s, kvh, hd), "f16")
    vc = b.state("vc", _rand(rng, s, kvh, hd), "f16")
    o = b.out("o", (rows, h * hd))
    got, want = b.run("attention", [q, kc, vc], [o], 141, 30, tuning=replace(TUNING, att_bq=bq), n_heads=h,
                      n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd))
    _close(got[0], want[0], _att_tol("f16", hd, rows, bq))


# f16 caches through attention_tiled: the tensor-core body's shapes (head_dim 64: two 16-row
# tiles a warp; 128 and 48: one, in two passes over the keys; 100: the fp32 body on any device),
# GQA groups 4, 2 and 3, one 128-row group or two (the second partial), n_tokens under the
# graph's rows, n_past 0 or not, key tiles cut by the causal edge (49 and 33: a warp's last row
# sees just the first key of a 64-key tile, the edge of the body's tile skip); the cache ends at the step's
# last slot, so a read past it would fault (or read garbage) where buffers are checked
PREFILL_F16 = [(4, 1, 64, 141, 141, 0), (4, 1, 64, 141, 137, 70), (8, 2, 128, 141, 141, 49),
               (2, 1, 64, 100, 97, 33), (3, 1, 48, 40, 37, 5), (4, 1, 100, 141, 141, 30)]


def _prefill_f16(h, kvh, hd, rows, n_tokens, n_past, seed=23):
    rng = np.random.default_rng(seed)
    b = OneOp(rows, name="prefill")
    q = b.act("q", _rand(rng, rows, h * hd))
    kc = b.state("kc", _rand(rng, n_past + n_tokens, kvh, hd), "f16")
    vc = b.state("vc", _rand(rng, n_past + n_tokens, kvh, hd), "f16")
    o = b.out("o", (rows, h * hd))
    got, want = b.run("attention", [q, kc, vc], [o], n_tokens, n_past, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, scale=1.0 / math.sqrt(hd))
    assert b.kernels == ["attention_tiled"]
    return got[0], want[0]


def _emulate_mma(monkeypatch) -> None:
    """The tensor-core bodies on any device, mma.sync and shuffles emulated through local memory
    (-DUSE_NV_MMA -DEMU_MMA; a device with tensor cores keeps its real ones)."""
    monkeypatch.setenv("LLMRS_OPENCL_EMULATE_MMA", "1")


def _err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


# each case on the device's own body, and (where head_dim allows it) on the emulated tensor-core body
PREFILL_F16_RUNS = [(c, e) for c in PREFILL_F16 for e in (False, True) if not e or (c[2] % 16 == 0 and c[2] <= 128)]


@pytest.mark.parametrize("case,emulate", PREFILL_F16_RUNS,
                         ids=[f"{h}.{k}x{d}-{r}.{n}+{p}-{'emulated' if e else 'device'}"
                              for (h, k, d, r, n, p), e in PREFILL_F16_RUNS])
def test_prefill_attention_f16_cache_matches_interpreter(case, emulate, monkeypatch):
    h, kvh, hd, rows, n_tokens, n_past = case
    if emulate:
        _emulate_mma(monkeypatch)
    got, want = _prefill_f16(h, kvh, hd, rows, n_tokens, n_past)
    _close(got, want, ATT_MMA_TOL if emulate else _att_tol("f16", hd, rows))
    if emulate or _attention_mma("f16", hd, rows):
        assert _err(got, want) > 1e-6, "Q and P rounded to f16 leave no trace: the fp32 body ran"


@pytest.mark.parametrize("kv_dtype,hd", [("f16", 64), ("f32", 32), ("q8_0", 64), ("f16", 128), ("q4_0", 64)])
@pytest.mark.parametrize("n_past", [0, 70, 127, 128, 600])
def test_decode_attention_key_per_lane_matches_interpreter(kv_dtype, hd, n_past):
    # attention_decode (HEAD_DIM % 32 == 0): one split, several (ticket merge), split edges
    rng = np.random.default_rng(15)
    h, kvh, s = 4, 2, 640
    b = OneOp(1)
    q = b.act("q", _rand(rng, 1, h * hd, scale=0.5))
    kc = b.state("kc", _rand(rng, s, kvh, hd), kv_dtype)
    vc = b.state("vc", _rand(rng, s, kvh, hd), kv_dtype)
    o = b.out("o", (1, h * hd))
    got, want = b.run("attention", [q, kc, vc], [o], 1, n_past, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, scale=1.0 / math.sqrt(hd))
    assert b.kernels == ["attention_decode"]
    _close(got[0], want[0], 1e-4)


def test_decode_attention_key_per_lane_over_several_passes_matches_interpreter():
    rng = np.random.default_rng(16)
    h, kvh, hd, s = 2, 1, 64, 768
    b = OneOp(1)
    q = b.act("q", _rand(rng, 1, h * hd, scale=0.5))
    kc = b.state("kc", _rand(rng, s, kvh, hd), "f16")
    vc = b.state("vc", _rand(rng, s, kvh, hd), "f16")
    o = b.out("o", (1, h * hd))
    got, want = b.run("attention", [q, kc, vc], [o], 1, 700, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, scale=1.0 / math.sqrt(hd),
                      tuning=replace(TUNING, att_dec_max_splits=2))   # 3 passes of 128 keys per split
    _close(got[0], want[0], 1e-4)


def test_decode_attention_over_more_keys_per_split_than_one_chunk_matches_interpreter():
    rng = np.random.default_rng(14)
    h, kvh, hd, s = 2, 1, 16, 17000      # 32 splits of 532 keys: two 512-key chunks each
    b = OneOp(1)
    q = b.act("q", _rand(rng, 1, h * hd, scale=0.3))
    kc = b.state("kc", _rand(rng, s, kvh, hd), "f16")
    vc = b.state("vc", _rand(rng, s, kvh, hd), "f16")
    o = b.out("o", (1, h * hd))
    got, want = b.run("attention", [q, kc, vc], [o], 1, s - 1, n_heads=h, n_kv_heads=kvh,
                      head_dim=hd, scale=1.0 / math.sqrt(hd))
    _close(got[0], want[0], 1e-4)


@pytest.mark.parametrize("ndt", ["f32", "bf16"])
def test_rms_norm_matches_interpreter(ndt):
    rng = np.random.default_rng(6)
    b = OneOp(5)
    x = b.act("x", _rand(rng, 5, 96, scale=4.0))
    w = b.param("w", _rand(rng, 96), ndt)
    y = b.out("y", (5, 96))
    got, want = b.run("rms_norm", [x, w], [y], 4, eps=1e-5)
    _close(got[0], want[0], 1e-5)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0", "q4_0"])
def test_rope_and_kv_store_match_interpreter(kv_dtype):
    rng = np.random.default_rng(7)
    h, hd, s = 3, 32, 20
    b = OneOp(6)
    x = b.act("x", _rand(rng, 6, h * hd))
    inv = b.param("inv_freq", rope_inv_freq(hd, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), "f32", kind="const")
    y = b.out("y", (6, h * hd))
    got, want = b.run("rope", [x, inv], [y], 5, 2, 1000, n_heads=h, head_dim=hd, theta=500000.0, scaling=None)
    _close(got[0], want[0], 1e-4)

    b = OneOp(6)
    src = b.act("src", _rand(rng, 6, h * hd))
    cache = b.state("cache", _rand(rng, s, h, hd), kv_dtype)
    c2 = b.out("cache2", (s, h, hd), kv_dtype, alias="cache")
    got, want = b.run("kv_store", [src, cache], [c2], 5, 11)
    # from exact f32 rows a q8_0 / q4_0 cache holds the interpreter's blocks (quant.quantize,
    # ggml's reference quantizers) byte for byte
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("tdt", WEIGHT_DTYPES)
def test_embedding_matches_interpreter(tdt):
    rng = np.random.default_rng(8)
    b = OneOp(7)
    table = b.param("table", _rand(rng, 50, 64), tdt)
    tokens = b.act("tokens", rng.integers(0, 50, 7), "i32")
    y = b.out("y", (7, 64))
    got, want = b.run("embedding", [table, tokens], [y], 6)
    _close(got[0], want[0], 0)


@pytest.mark.parametrize("kind", ["add", "mul", "silu_mul", "silu"])
def test_elementwise_matches_interpreter(kind):
    rng = np.random.default_rng(9)
    b = OneOp(4)
    a = b.act("a", _rand(rng, 4, 100, scale=3.0))
    ins = [a] if kind == "silu" else [a, b.act("b", _rand(rng, 4, 100))]
    y = b.out("y", (4, 100))
    got, want = b.run(kind, ins, [y], 3)
    _close(got[0], want[0], 1e-6)


def test_softmax_argmax_and_last_row_match_interpreter():
    rng = np.random.default_rng(10)
    x = _rand(rng, 5, 1000, scale=5.0)
    x[1, 7] = x[1, 900] = 99.0            # a tie: the first index wins, as numpy's argmax
    for kind, shape, dtype in (("softmax", (5, 1000), "f32"), ("argmax", (5,), "i32"),
                               ("slice", (1, 1000), "f32")):
        b = OneOp(5)
        xv = b.act("x", x)
        y = b.out("y", shape, dtype)
        attrs = {"rows": "last"} if kind == "slice" else {}
        got, want = b.run(kind, [xv], [y], 4, **attrs)
        if dtype == "i32":
            assert got[0].tolist() == want[0].tolist()
        else:
            _close(got[0], want[0], 1e-6)


# -- Qwen: per-head norms (rms_norm over runs of head_dim), biases, qk_norm in the QKV epilogue ---

@pytest.mark.parametrize("group", [96, 16, 48])
def test_rms_norm_over_runs_of_a_row_matches_interpreter(group):
    rng = np.random.default_rng(group)
    b = OneOp(5)
    x = b.act("x", _rand(rng, 5, 96, scale=4.0))
    w = b.param("w", _rand(rng, group), "bf16")
    got, want = b.run("rms_norm", [x, w], [b.out("y", (5, 96))], 4, eps=1e-6)
    assert b.launches[0]["groups"] == 96 // group
    _close(got[0], want[0], 1e-5)


BIAS_CASES = [("matmul", None, None), ("fused_matmul", "rms_norm", None), ("fused_matmul", None, "add"),
              ("fused_matmul", "rms_norm", "silu_mul")]


@pytest.mark.parametrize("wdt", ["q4_0", "f16", "q8_0", "f32"])
@pytest.mark.parametrize("kind,prologue,epilogue", BIAS_CASES, ids=[f"{k}-{p}-{e}" for k, p, e in BIAS_CASES])
@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (70, 67)])
def test_matmul_with_a_bias_matches_interpreter(wdt, kind, prologue, epilogue, rows, n_tokens):
    """b[N] on every dot product before the epilogue: a plain matmul's third input (--no-fuse) and
    attr bias; N = 90 (45 gate/up pairs) leaves the last group partly empty."""
    rng = np.random.default_rng(41)
    k, n = 128, 90
    b = OneOp(rows)
    ins = [b.act("x", _rand(rng, rows, k)), b.param("w", _rand(rng, n, k), wdt)]
    ins += [b.param("nw", _rand(rng, k), "f16")] if prologue else []
    ins += [b.act("res", _rand(rng, rows, n))] if epilogue == "add" else []
    ins.append(b.param("bias", _rand(rng, n), "f32"))
    y = b.out("y", (rows, n // 2 if epilogue == "silu_mul" else n))
    attrs = dict(prologue=prologue, epilogue=epilogue, eps=1e-5, bias=True) if kind == "fused_matmul" else {}
    got, want = b.run(kind, ins, [y], n_tokens, **attrs)
    assert all("-DBIAS" in launch["options"] for launch in b.launches if launch["kernel"] != "stage_x")
    _close(got[0], want[0], _tol(wdt))


def _qkv(wdt: str, kv: str, heads: tuple[int, int, int], rows: int, n_tokens: int, n_past: int = 3,
         start_pos: int = 11, qk_norm: bool = True, bias: bool = False, norm_dtype: str = "bf16",
         d: int = 64, tuning: OpenCLTuning = TUNING, seed: int = 43, again: bool = False,
         slots: np.ndarray | None = None, x: np.ndarray | None = None,
         positions: np.ndarray | None = None, oracle: bool = True) -> tuple[OneOp, list, list]:
    """A fused QKV (RMS prologue, rope_kv_store) with Qwen3's per-head norms and / or Qwen2's
    bias on random data: the op, its opencl and interpreter outputs. slots (a step graph's, attr
    step_rows): row t stored at cache row slots[t] and roped at positions[t] (else positions far
    apart, out of order), n_past and start_pos unused; x: the activations, else random."""
    rng = np.random.default_rng(seed)
    h, kvh, hd = heads
    s, n = n_past + rows + 5, (h + 2 * kvh) * hd
    b = OneOp(rows, name="decode" if slots is None else "step")
    xs = _rand(rng, rows, d)
    ins = [b.act("x", xs if x is None else x), b.param("w", _rand(rng, n, d), wdt), b.param("nw", _rand(rng, d), "f32"),
           b.param("inv_freq", rope_inv_freq(hd, 1000000.0, None), "f32", kind="const"),
           b.state("kc", _rand(rng, s, kvh, hd), kv), b.state("vc", _rand(rng, s, kvh, hd), kv)]
    attrs = dict(prologue="rms_norm", epilogue="rope_kv_store", eps=1e-5, n_heads=h, n_kv_heads=kvh, head_dim=hd,
                 theta=1000000.0, scaling=None)
    if qk_norm:
        ins += [b.param("qn", 1.0 + 0.3 * _rand(rng, hd), norm_dtype), b.param("kn", 1.0 + 0.3 * _rand(rng, hd), norm_dtype)]
        attrs.update(qk_norm=True, qk_eps=1e-6)
    if slots is not None:
        drawn = rng.permutation(np.arange(0, 61 * rows, 61))[:rows] + rng.integers(0, 61, rows)
        ins += [b.act("positions", drawn if positions is None else positions, "i32"), b.act("slots", slots, "i32")]
        attrs["step_rows"] = True
    if bias:
        ins.append(b.param("bias", _rand(rng, n), "f32"))
        attrs["bias"] = True
    outs = [b.out("q", (rows, h * hd)), b.out("kc2", (s, kvh, hd), kv, alias="kc"),
            b.out("vc2", (s, kvh, hd), kv, alias="vc")]
    got, want = b.run("fused_matmul", ins, outs, n_tokens, n_past, start_pos, tuning=tuning, again=again,
                      oracle=oracle, **attrs)
    return b, got, want


def _close_qkv(got: list, want: list, wdt: str, kv: str, tol: float | None = None) -> None:
    tol = tol or max(_tol(wdt), 1e-3 if kv == "f16" else 0)
    _close(got[0], want[0], tol)
    for gt, wt in zip(got[1:], want[1:]):   # caches: what their rows decode to
        if kv in BLOCK_KV_TOL:
            # f16 weights on tensor cores (NVIDIA) multiply x rounded to f16: values move by
            # ~1e-3, enough to cross a q8_0 code edge often (11.7 % of them on an H100)
            _close_cache(gt, wt, kv, 0.25 if wdt in ("f16", "bf16") else 0.01)
        else:
            _close(gt.astype(np.float32), wt.astype(np.float32), tol)


# (weights, cache, heads): Qwen3-0.6B's head_dim 128 (a group per head), 64 (two heads a 128-row
# tile), 48 (no power of 2: idle slots), 16 (eight heads a tile), 32 and 96 into Q8_0 caches
# (a group per head, ROPE_HEADS); MQA and GQA
QK_CASES = [("q4_0", "f16", (4, 2, 128)), ("f16", "f32", (6, 1, 64)), ("q8_0", "f32", (4, 2, 48)),
            ("q4_1", "f16", (8, 2, 16)), ("q4_0", "q8_0", (4, 2, 64)), ("f16", "q8_0", (2, 1, 128)),
            ("q8_0", "q8_0", (3, 1, 96)), ("q4_0", "q8_0", (4, 2, 32)), ("q4_1", "q4_0", (4, 2, 64)),
            ("f16", "q4_0", (3, 1, 96))]


@pytest.mark.parametrize("wdt,kv,heads", QK_CASES, ids=[f"{w}-{k}-{h}.{g}x{d}" for w, k, (h, g, d) in QK_CASES])
@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (70, 67)])
def test_qk_norm_rope_kv_store_matches_interpreter(wdt, kv, heads, rows, n_tokens):
    # decode splits a head over groups where its head_dim allows (QK_SPLIT: tickets in scratch,
    # put back to zero, so the step runs twice with the same bits), else takes whole heads
    b, got, want = _qkv(wdt, kv, heads, rows, n_tokens, again=True)
    launch = b.launches[-1]
    assert "-DQK_NORM" in launch["options"]
    hd = heads[2]
    splits = rows == 1 and not (kv in BLOCK_KV_TOL and hd % 64) and hd > (16 if wdt in QUANT_DTYPES else 8)
    assert any(o.startswith("-DQK_SPLIT=") for o in launch["options"]) == splits
    _close_qkv(got, want, wdt, kv)


def _qkv_then_attention(wdt: str, kv: str, heads: tuple[int, int, int], n_past: int, start_pos: int,
                        defer: bool, bias: bool = False, seed: int = 47):
    """Decode's QKV (RMS prologue, per-head norms, rope_kv_store) and the attention on its q and
    caches, adding eviction scores, one graph: (launches, opencl [o, k cache, v cache, q, scores],
    interpreter's)."""
    rng = np.random.default_rng(seed)
    h, kvh, hd = heads
    d, s = 64, n_past + 6
    b = OneOp(1)
    g = b.g
    ins = [b.act("x", _rand(rng, 1, d)), b.param("w", _rand(rng, (h + 2 * kvh) * hd, d), wdt),
           b.param("nw", _rand(rng, d), "f32"),
           b.param("inv_freq", rope_inv_freq(hd, 1000000.0, None), "f32", kind="const"),
           b.state("kc", _rand(rng, s, kvh, hd), kv), b.state("vc", _rand(rng, s, kvh, hd), kv),
           b.param("qn", 1.0 + 0.3 * _rand(rng, hd), "bf16"), b.param("kn", 1.0 + 0.3 * _rand(rng, hd), "bf16")]
    attrs = dict(prologue="rms_norm", epilogue="rope_kv_store", eps=1e-5, n_heads=h, n_kv_heads=kvh, head_dim=hd,
                 theta=1000000.0, scaling=None, qk_norm=True, qk_eps=1e-6)
    if bias:
        ins.append(b.param("bias", _rand(rng, (h + 2 * kvh) * hd), "f32"))
        attrs["bias"] = True
    qkv_out = [b.out("q", (1, h * hd)), b.out("kc2", (s, kvh, hd), kv, alias="kc"),
               b.out("vc2", (s, kvh, hd), kv, alias="vc")]
    qkv = g.add_op("fused_matmul", ins, qkv_out, **attrs)
    o = b.out("o", (1, h * hd))
    sc = b.state("sc", rng.random((kvh, s)).astype(np.float32) + 0.5, "f32")
    ctl = b.state("ctl", np.array([1, 0]), "i32")      # scores on, every row
    sc_out = b.out("sc_out", (kvh, s), alias="sc")
    att_attrs = dict(n_heads=h, n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd))
    att = g.add_op("attention", qkv_out + [sc, ctl], [o, sc_out], **att_attrs)
    g.inputs, g.outputs = [], [o, "q", sc_out]
    g.verify()
    program = generate({g.name: g}, replace(TUNING, qk_defer=defer))
    be = OpenCLBackend.from_graphs({g.name: g}, program)
    be.scoring = True
    for name, arr in b.data.items():
        be.write_value(g.name, name, arr)
    be.enqueue(g.name, np.zeros(1, np.int32), n_past, start_pos)
    be.queue.finish()
    got = [be.read_value(g.name, name) for name in (o, "kc2", "vc2")]
    # the finished q, for the eviction scores: after the raw k in the staging buffer (deferred)
    if defer:
        staged = np.empty(4 * (h + kvh) * hd, np.uint8)
        _cl().enqueue_copy(be.queue, staged, be.staging_buf)
        got.append(staged.view(np.float32)[kvh * hd:].reshape(1, h * hd))
    else:
        got.append(be.read_value(g.name, "q"))
    got.append(be.read_value(g.name, sc_out))
    it, st = Interpreter(g), Step(1, n_past, start_pos)
    args = [b.data["x"]] + [it.raw(n) for n in ins[1:4]] + [b.data["kc"].copy(), b.data["vc"].copy()] + \
        [it.raw(n) for n in ins[6:]]
    q, kc, vc = OPS["fused_matmul"](it, qkv, st, *args)
    att_o, scores = OPS["attention"](it, att, st, q, kc, vc, b.data["sc"].copy(), b.data["ctl"])
    want = [att_o, kc, vc, q, scores]
    return program["graphs"][g.name], got, want


# head_dim 128 (Qwen3-0.6B, GQA), 64 (MQA), 32; contexts of one split of the decode attention and
# of several (n_past 300: the row's own key in the third), the key of a bias-free f32 cache and f16
@pytest.mark.parametrize("wdt,kv,heads,bias", [("q4_0", "f16", (4, 2, 128), False), ("f16", "f32", (6, 1, 64), False),
                                               ("q8_0", "f16", (4, 1, 32), True)])
@pytest.mark.parametrize("n_past,start_pos", [(3, 11), (300, 300)])
def test_qk_norms_finished_by_the_decode_attention_match_interpreter(wdt, kv, heads, bias, n_past, start_pos):
    launches, got, want = _qkv_then_attention(wdt, kv, heads, n_past, start_pos, defer=True, bias=bias)
    assert [(launch["kernel"], "-DQK_DEFER" in launch["options"]) for launch in launches] == [
        ("matvec", True), ("attention_decode", True), ("attention_scores", False)]
    assert not any("-DQK_NORM" in o or "QK_SPLIT" in o for o in launches[0]["options"])
    tol = max(_tol(wdt), 1e-3 if kv == "f16" else 0)
    _close(got[0], want[0][:1], tol)                    # o
    for gt, wt in zip(got[1:3], want[1:3]):             # the caches: the new key and value rows too
        _close(gt.astype(np.float32), wt.astype(np.float32), tol)
    _close(got[3], want[3], tol)                        # q as the attention finished it, for the scores
    _close(got[4], want[4], tol)                        # the scores, launched after the attention
    # the same within rounding as the matvec finishing them (QK_SPLIT), which it replaces
    launches_off, off, _ = _qkv_then_attention(wdt, kv, heads, n_past, start_pos, defer=False, bias=bias)
    assert not any("-DQK_DEFER" in launch["options"] for launch in launches_off)
    _close(got[0], off[0], 1e-5)


@pytest.mark.parametrize("norm_dtype", ["f32", "f16"])
@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (70, 67)])
def test_qk_norm_with_a_bias_matches_interpreter(norm_dtype, rows, n_tokens):
    b, got, want = _qkv("q4_0", "f16", (4, 2, 48), rows, n_tokens, bias=True, norm_dtype=norm_dtype)
    _close_qkv(got, want, "q4_0", "f16")


@pytest.mark.parametrize("wdt,kv", [("q4_0", "f16"), ("f16", "q8_0"), ("q8_0", "q4_0")])
@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (70, 67)])
def test_qkv_with_only_a_bias_matches_interpreter(wdt, kv, rows, n_tokens):
    """Qwen2: biased q, k, v stacked into the fused QKV, no per-head norms."""
    b, got, want = _qkv(wdt, kv, (6, 1, 64), rows, n_tokens, qk_norm=False, bias=True)
    _close_qkv(got, want, wdt, kv)


@pytest.mark.parametrize("rows,n_tokens", [(1, 1), (9, 7)])
def test_qk_norm_for_heads_wider_than_a_tile_takes_the_matvec_and_matches_interpreter(rows, n_tokens):
    # head_dim 256: no 128-row tile holds a head, so prefill runs the matvec a token a group row
    b, got, want = _qkv("q8_0", "f16", (2, 1, 256), rows, n_tokens, bias=True)
    assert [launch["kernel"] for launch in b.launches] == ["matvec"]
    _close_qkv(got, want, "q8_0", "f16")


# each prefill body with the per-head norms and a bias: the tensor-core body (mma.sync, emulated off
# NVIDIA) on quantized tiles, f16 128-row tiles by cp.async (alone, paired, split over K), split-K
# merges of quantized tiles, and the portable fp32 body (split and not). 131 rows, 130 tokens.
QK_BODY_CASES = [("mma", "q4_0", {}, False, 1), ("mma", "f16", {"tile_pair_f16": False, "tile_n_min_groups": 1}, False, 1),
                 ("mma", "f16", {"tile_n_min_groups": 1}, True, 1), ("mma", "f16", {}, False, 2),
                 ("mma", "q8_0", {"tile_split_k_quant": 2}, False, 2), ("fp32", "f16", {}, False, 2),
                 ("fp32", "q4_1", {}, False, 1)]


@pytest.mark.parametrize("body,wdt,change,pair,split", [   # the emulated bodies are slow on PoCL: a sweep
    pytest.param(*c, id=f"{c[0]}-{c[1]}-{'pair' if c[3] else 'single'}-s{c[4]}", marks=[pytest.mark.slow] * (i > 0))
    for i, c in enumerate(QK_BODY_CASES)])
def test_qk_norm_and_bias_on_each_prefill_body_match_interpreter(body, wdt, change, pair, split, monkeypatch):
    if body == "mma":
        _emulate_mma(monkeypatch)
        monkeypatch.setenv("LLMRS_OPENCL_NO_WGMMA", "1")   # Hopper: mma.sync, not wgmma
    else:
        monkeypatch.setenv("LLMRS_OPENCL_NO_MMA", "1")
    b, got, want = _qkv(wdt, "f16", (4, 2, 128), 131, 130, bias=True, d=512, tuning=replace(TUNING, **change),
                        seed=47)
    options = _tiled_launch(b)["options"]
    assert "-DTN=128" in options and "-DQK_HPG=1" in options and ("-DMM_TPAIR" in options) == pair
    assert (f"-DMM_SPLIT={split}" in options) == (split > 1)
    assert ("-DUSE_NV_MMA" in b.build_options) == (body == "mma")
    _close_qkv(got, want, wdt, "f16", 1e-3 if wdt == "f16" else None)


def test_qk_norm_and_bias_on_the_wgmma_body_match_interpreter(monkeypatch):
    device = device_options(pick_device())
    if "-DUSE_NV_MMA" in device and "-DUSE_NV_WGMMA" not in device:
        pytest.skip("tensor cores without wgmma (compute capability 8.x or 10+)")
    monkeypatch.setenv("LLMRS_OPENCL_EMULATE_WGMMA", "1")
    b, got, want = _qkv("f16", "f16", (4, 2, 64), 131, 130, bias=True, d=512, seed=53)
    assert "-DUSE_NV_WGMMA" in b.build_options and "-DQK_HPG=2" in _tiled_launch(b)["options"]
    _close_qkv(got, want, "f16", "f16", 1e-3)


def test_every_ticket_kernel_fences_its_partials_for_the_whole_device():
    """A group that writes a partial and takes a ticket (atomic_inc) must make the partial visible
    to the group that takes the last ticket, on another SM. OpenCL 1.2's mem_fence only orders
    within a work-group, and NVIDIA's compiler emits membar.cta for it: the Qwen3 shape's split
    q/k norms read stale partials now and then on an H200 (BENCHMARKS.md round 23). So ticket
    kernels use DEVICE_FENCE (common.cl), PTX fence.acq_rel.gpu on NVIDIA."""
    from importlib import resources
    folder = resources.files("llmrs.templates").joinpath("opencl")
    common = folder.joinpath("common.cl").read_text()
    nv = common[common.index("#ifdef USE_NV_PTX\n#define DEVICE_FENCE"):]
    assert 'asm volatile("fence.acq_rel.gpu;" ::: "memory")' in nv.split("#else")[0]
    ticketed = 0
    for path in sorted((p for p in folder.iterdir() if p.name.endswith(".cl")), key=lambda p: p.name):
        text = path.read_text()
        if path.name != "common.cl":
            assert "mem_fence(CLK_GLOBAL_MEM_FENCE)" not in text, path.name
        if "atomic_inc(" in text and path.name != "common.cl":
            ticketed += 1
            assert text.count("DEVICE_FENCE()") >= 2, path.name   # before the ticket, and after it
    assert ticketed >= 5
