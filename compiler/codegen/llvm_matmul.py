"""matmul / fused_matmul kernels: x[T,K] @ w[N,K].T with an optional RMSNorm prologue, an optional
bias, and an add / silu_mul / rope_kv_store (per-head q/k norms optional) epilogue (compiler/ir.py
gives the exact semantics).

q4_0 / q8_0 weights: each thread quantizes the activation rows to Q8_0 in its own scratch
(GGML's reference rounding), then every 32-value block is an int8 x int8 -> int32 dot product,
scaled by d_w * d_x and accumulated in f32 lanes, as GGML's CPU kernels do. q4_1 weights take the
same codes as Q8_1 (plus s = f16(d * sum(q)) per activation block, made once per row here, not
per weight row), and a block adds d_w*d_x*sum(q_w*q_x) + m_w*s_x (ggml_vec_dot_q4_1_q8_1).
A tile is R weight rows x TT tokens: each weight block is loaded and unpacked once per TT tokens
(prefill), and tokens are walked in chunks of TC so the quantized activations stay in L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import llvmlite.ir as ir

from ..ir import QK, Graph, Op
from .llvm_builder import (F16, F32, I1, I8, I16, I32, PTR, SCRATCH_BASE_OFFSET, WORK_OFFSET, KernelBuilder,
                           tail_widths, vec)
from .llvm_target import Target

BLOCK_BYTES = {"q4_0": 18, "q8_0": 34, "q4_1": 20}
TOKEN_TILE = 4     # tokens per tile in prefill
TOKEN_CHUNK = 64   # tokens whose quantized rows are walked per pass over a thread's weight rows
PREFETCH_BYTES = 1024  # weight rows stream from DRAM: ask for them this far ahead
DECODE_ROWS = 8         # weight rows per tile in decode on the grouped q4_0 path
DECODE_ROWS_LONG = 1    # the same where a row is at least LONG_ROW bytes: one row a tile, so a
LONG_ROW = 1024         # thread's rows are one sequential stream, as on AVX2. On a Zen 5 (2 threads,
# one process, interleaved) the Llama-3.2-1B all-Q4_0 (rows of 1152 and 4608 bytes) ran 1-row tiles
# 1.077x and 1.081x the 4-row ones (9 and 15 rounds; 2 rows 1.025x; round 22: 4 rows 1.016-1.060x
# 8); SmolLM2's Q4_1 (rows of 360 and 960 bytes) keeps 8: 1 row 0.997x, 4 rows 0.969x and 0.960x
# (BENCHMARKS.md rounds 22, 23)
# (measured on Llama-3.2-1B, 1 thread, same run: 4 rows with the prefetch one tile ahead (4.6 KB)
# 34 tok/s, two tiles ahead 37, 8 rows one tile ahead (9.2 KB) 39, two tiles ahead 36)
SHARED_PREPARE = True   # prefill in a step: the team quantizes / normalizes x together (MatmulEmitter)
ONE_ROW_TILES = True    # a prefill-shaped kernel (a step graph's) given one row takes decode's tiles
AVX2_DECODE_ROWS = 1    # the same on AVX2: one row a tile, so a thread's rows are one sequential
# stream, as llama.cpp's gemv reads them (AMD EPYC Zen 3, Llama-3.2-1B all-Q4_0, interleaved in one
# process, 2 threads: 4 rows 32.4 tok/s, 2 rows 33.0, 1 row 39.3 (38.5 without the prefetch);
# 1 thread: 17.6 -> 20.7. SmolLM2 Q4_1: 2 threads 216 -> 208 (noise), 1 thread 114 -> 123)
AVX2_DECODE_PREFETCH = 3072  # ... prefetching this many bytes ahead where rows are long (LONG_ROW),
# not one row (1152 bytes at K = 2048, likely too close to hide DRAM's latency). Zen 5, 2 threads,
# Llama-3.2-1B all-Q4_0, decode interleaved in one process (11-21 rounds) against one row ahead:
# 2048 bytes 1.07x and 1.08x, 3072 1.09x, 4096 1.05x, 8192 1.00x (BENCHMARKS.md round 24)
AVX2_PREFILL_ACC8 = True  # AVX2 grouped prefill: a (row, token)'s <16 x f32> sums fold into one
# <8 x f32> accumulator (8 ymm of 16 for the 4 x 4 tile, not 16 spilled around every FMA)
AVX2_QUADS = True      # AVX2 q4_0 prefill sums 4 tokens' products per block in i16 (quad_dot),
QUAD_TILE_ROWS = 4     # in tiles of 4 weight rows x 8 tokens (a multiple of 4). 1 thread, alone,
QUAD_TOKEN_TILE = 8    # K 2048 and 8192 x 64 tokens took 4 x 4 tiles 1.10x the time, 2 x 8
# 0.95-1.19x, 2 x 16 1.08-1.32x (BENCHMARKS.md round 24)
GRAB_BYTES = 64 << 10  # weight bytes a thread takes from the shared work counter at a time
FLOAT_WEIGHTS = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class MatmulSpec:
    T: int                      # max tokens (graph's T)
    K: int
    N: int                      # weight rows
    wdtype: str                 # q4_0 | q4_1 | q8_0 | f16 | bf16 | f32
    prologue: bool = False      # rms_norm of x first
    eps: float = 0.0
    norm_dtype: str = "f32"
    epilogue: str | None = None  # None | add | silu_mul | rope_kv_store
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    inv_freq_dtype: str = "f32"
    cache_dtype: str = "f32"    # k/v cache dtype (rope_kv_store)
    bias: bool = False          # b[N] f32 added to x @ w.T before the epilogue
    qk_norm: bool = False       # rope_kv_store: each q and k head RMS-normed before RoPE
    qk_eps: float = 0.0
    qk_norm_dtype: str = "f32"  # q_norm_w[hd], k_norm_w[hd]
    step_rows: bool = False     # rope_kv_store in a step graph: row t at positions[t], stored at slots[t]
    cache_rows: int = 0         # rope_kv_store: the caches' rows S (a slot outside them stores nothing)

    @staticmethod
    def of(graph: Graph, op: Op) -> "MatmulSpec":
        v = graph.values
        x, w = v[op.inputs[0]], v[op.inputs[1]]
        a = op.attrs
        pro = op.kind == "fused_matmul" and a.get("prologue") == "rms_norm"
        epi = a.get("epilogue") if op.kind == "fused_matmul" else None
        kw = {}
        if pro:
            kw.update(eps=float(a["eps"]), norm_dtype=v[op.inputs[2]].dtype)
        if epi == "rope_kv_store":
            n_extra = 3 if pro else 2
            cache = v[op.inputs[n_extra + 1]]
            cache_dtype = v[cache.alias].dtype if cache.alias else cache.dtype
            kw.update(n_heads=a["n_heads"], n_kv_heads=a["n_kv_heads"], head_dim=a["head_dim"],
                      inv_freq_dtype=v[op.inputs[n_extra]].dtype, cache_dtype=cache_dtype,
                      step_rows=bool(a.get("step_rows")), cache_rows=cache.shape[0])
            if a.get("qk_norm"):
                kw.update(qk_norm=True, qk_eps=float(a["qk_eps"]), qk_norm_dtype=v[op.inputs[n_extra + 3]].dtype)
        if (op.kind == "matmul" and len(op.inputs) == 3) or (op.kind == "fused_matmul" and a.get("bias")):
            kw.update(bias=True)
        # rows of x, not the graph's T: a prefill's last_token_logits matmul takes one row
        return MatmulSpec(x.shape[0], x.shape[1], w.shape[0], w.dtype, pro, epilogue=epi, **kw)

    @property
    def quantized(self) -> bool:
        return self.wdtype in BLOCK_BYTES

    @property
    def row_bytes(self) -> int:
        if self.quantized:
            return self.K // QK * BLOCK_BYTES[self.wdtype]
        return self.K * (4 if self.wdtype == "f32" else 2)

    def scratch_bytes(self) -> int:
        """Per-thread scratch: Q8 activations (quantized weights) or normalised f32 rows."""
        if self.quantized:
            return scratch_layout(self)["end"]
        return self.T * self.K * 4 if self.prologue else 0


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def scratch_layout(spec: MatmulSpec) -> dict[str, int]:
    """Byte offsets, in a thread's scratch, of the quantized activations of the step's rows:

        xq    i8[T, K]          Q8 codes (Q8_0's; Q8_1 has the same)
        xd    f32[T, K/32]      their scales, rounded to f16
        xs    f32[T, K/32]      Q8_1's s = f16(d * sum(q))                       (q4_1 only)
        xg    i8[T, Kg]         the codes in q4_group_dot's order, rows padded to whole
                                groups of 128 (Kg), the padding zero      (q4_0, q4_1, q8_0;
                                quad_dot's rows xg_stride apart)
        gaux  [T, Kg/8]         per lane: q4_0's / q8_0's bias (i32), or q4_1's s (f32)
        gdx   f32[T, Kg/8]      per lane: the block's scale

    and `end`. The grouped layout is reserved whichever target runs the kernel."""
    T, K = spec.T, spec.K
    at: dict[str, int] = {}
    end = 0
    parts = [("xq", T * K), ("xd", T * K // QK * 4)]
    if spec.wdtype == "q4_1":
        parts.append(("xs", T * K // QK * 4))
    if spec.wdtype in GROUPED:
        kg = padded_k(K)
        parts += [("xg", T * xg_stride(kg, True)), ("gaux", T * kg), ("gdx", T * kg)]   # aux, dx need T*kg/2
    for name, size in parts:
        at[name] = end
        end += _align(size)
    at["end"] = end
    return at


def check_matmul(spec: MatmulSpec, where: str) -> None:
    if spec.quantized and spec.K % QK:
        raise ValueError(f"{where}: K={spec.K} is not a multiple of {QK}, so {spec.wdtype} rows do not "
                         "split into blocks; use --weights f16")
    if spec.wdtype not in BLOCK_BYTES and spec.wdtype not in FLOAT_WEIGHTS:
        raise ValueError(f"{where}: weight dtype {spec.wdtype} has no CPU matmul kernel")
    if spec.epilogue == "rope_kv_store" and spec.head_dim % 2:
        raise ValueError(f"{where}: head_dim {spec.head_dim} is odd; RoPE rotates pairs")


def prefetch(kb: KernelBuilder, ptr: ir.Value, byte_offset: ir.Value) -> None:
    """Read hint for ptr + byte_offset; past the end of a buffer it is harmless (never faults)."""
    fn = kb.intrinsic("llvm.prefetch.p0", ir.VoidType(), [ir.PointerType(), I32, I32, I32])
    addr = kb.b.gep(ptr, [byte_offset], source_etype=I8)   # not inbounds: may point past the end
    kb.b.call(fn, [addr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


# -- q4_0 x Q8_0 and q4_1 x Q8_1 in groups of 4 blocks (x86: AVX-512 VNNI, or AVX2) -------------
#
# Four q4 blocks (72 / 80 bytes) are one step: their 64 nibble bytes are unpacked to unsigned 0..15
# in two <64 x i8> (low nibbles = values 0..15 of each block, high nibbles = values 16..31), and
# the activations are kept in the matching order, so two vpdpbusd give 16 i32 lanes, 4 per block.
# The -8 offset of q4_0 is folded into the accumulator's start value, bias = -8 * (the lane's 8 x
# values), so every lane is an exact integer sum of (w - 8) * x and the block's integer dot product
# is the sum of its 4 lanes, as GGML's. q4_1's codes need no offset (its lanes start at 0); its
# m_w * s_x terms are one more FMA per group for 4 rows at once (pack_q4_1_mins).
# A row whose K is not a multiple of 128 ends in a partial group, loaded through a byte mask (so
# it never reads past the row), against activations whose padding is zero. AVX2 has the same
# layout and lanes, with vpdpbusd emulated (q4_group_dot) and blocks loaded one by one.
#
# q8_0 takes the same steps on AVX-512 VNNI: four blocks' first 16 codes in one <64 x i8>, their
# last 16 in the other, i.e. the activations' grouped order unchanged, and each code moved to
# unsigned by w + 128 (one xor), which the start value takes back: bias = -128 * (the lane's 8 x
# values). Per-block 256-bit dot products with the sign moved onto x for every (row, token) cost a
# q8_0 row of a step 3.4x one row's time at 8 rows (SmolLM2's tied head, issue 29). Not on AVX2:
# vpmaddubsw's i16 pairs would saturate at 255 * 127 * 2.

GROUP = 4 * QK          # values per step
Q4 = ("q4_0", "q4_1")
GROUPED = Q4 + ("q8_0",)   # weight types with a grouped activation layout


def group_bytes(wdtype: str) -> int:
    return 4 * BLOCK_BYTES[wdtype]


def padded_k(K: int) -> int:
    """K rounded up to whole groups: the row length of the grouped activation layout."""
    return -(-K // GROUP) * GROUP


def group_isa(target: Target) -> str | None:
    """How the grouped q4 path computes its dot products on this target: vnni512 (vpdpbusd on
    512-bit vectors), avx2 (vpmaddubsw + vpmaddwd on 256-bit halves, GGML's AVX2 sequence, the
    same integer lanes), or None (no grouped path: the per-block 4-row tile)."""
    if not target.is_x86:
        return None
    if all(target.has(f) for f in ("avx512f", "avx512bw", "avx512vnni")):
        return "vnni512"
    return "avx2" if target.has("avx2") else None


def q4_group_ok(target: Target, wdtype: str) -> bool:
    """Whether wdtype's matmuls take the grouped path here: q4_0 / q4_1 wherever group_isa has
    one, q8_0 on AVX-512 VNNI only."""
    isa = group_isa(target)
    return (wdtype in Q4 and isa is not None) or (wdtype == "q8_0" and isa == "vnni512")


def _q8_mask(bb: int, half: int, base: int) -> list[int]:
    # codes [16 half, 16 half + 16) of blocks 0..3 (the quants follow a 2-byte d), from two 64-byte
    # loads at group bytes `base` and `base + 64`
    return [bb * k + 2 + 16 * half + j - base for k in range(4) for j in range(16)]


def _load_q8_group(kb: KernelBuilder, w: ir.Value, off: ir.Value,
                   blocks: int) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
    """load_q4_group for q8_0 (AVX-512): codes 0..15 and 16..31 of each block as unsigned w + 128,
    and d; a partial group's loads are masked to its blocks (the rest zero, d 0)."""
    b = kb.b
    bb, n = BLOCK_BYTES["q8_0"], blocks * BLOCK_BYTES["q8_0"]
    v64 = vec(I8, 64)

    def part(at: int) -> ir.Value:     # group bytes [at, at + 64), nothing past the blocks read
        if at + 64 <= n:
            return kb.load(v64, w, b.add(off, kb.i64(at)))
        if at >= n:
            return ir.Constant(v64, None)
        return masked_load(kb, v64, w, b.add(off, kb.i64(at)), n - at)
    # A's codes lie in group bytes [2, 120), B's in [18, 136): two loads each
    a0, a1, b0, b1 = part(0), part(64), part(8), part(72)
    flip = ir.Constant(v64, [-128] * 64)
    lo = b.xor(kb.shuffle(a0, a1, _q8_mask(bb, 0, 0)), flip)
    hi = b.xor(kb.shuffle(b0, b1, _q8_mask(bb, 1, 8)), flip)
    dbytes = kb.shuffle(a0, a1, [bb * (lane // 4) + byte for lane in range(16) for byte in (0, 1)])
    return lo, hi, _f16x16(kb, dbytes), a0


def _qs_mask(bb: int) -> list[int]:
    # byte j of block k's quants is at bb*k + bb-16 + j of the group (the quants end each block);
    # loads A = bytes [0,64), B = [4bb-64, 4bb)
    out = []
    for k in range(4):
        for j in range(16):
            src = bb * k + bb - 16 + j
            out.append(src if src < 64 else 64 + src - (4 * bb - 64))
    return out


def masked_load(kb: KernelBuilder, ty: ir.VectorType, ptr: ir.Value, off: ir.Value, n: int) -> ir.Value:
    """The first n bytes at ptr + off, the rest of the vector zero; nothing past them is read."""
    mask = vec(I1, ty.count)
    fn = kb.intrinsic(f"llvm.masked.load.v{ty.count}i8.p0", ty, [PTR, I32, mask, ty])
    return kb.b.call(fn, [kb.at(ptr, off), ir.Constant(I32, 1),
                          ir.Constant(mask, [int(i < n) for i in range(ty.count)]), ir.Constant(ty, None)])


def load_q4_group(kb: KernelBuilder, w: ir.Value, off: ir.Value, wdtype: str = "q4_0",
                  blocks: int = 4) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
    """(low nibbles <64 x u8>, high nibbles <64 x u8>, d <16 x f32> = each block's d 4 times,
    the group's first 64 bytes, which hold every block's header: pack_q4_1_mins reads q4_1's m
    there) of `blocks` blocks at w + off; missing blocks are all zero. q8_0: _load_q8_group."""
    if wdtype == "q8_0":
        return _load_q8_group(kb, w, off, blocks)
    if group_isa(kb.target) == "avx2":
        return _load_q4_group_by_block(kb, w, off, wdtype, blocks)
    b = kb.b
    bb = BLOCK_BYTES[wdtype]
    v64 = vec(I8, 64)
    if blocks == 4:
        a = kb.load(v64, w, off)
        c = kb.load(v64, w, b.add(off, kb.i64(4 * bb - 64)))
    else:   # at most 3 blocks (60 bytes): all in A
        a = masked_load(kb, v64, w, off, blocks * bb)
        c = ir.Constant(v64, None)
    qs = kb.shuffle(a, c, _qs_mask(bb))
    lo = b.and_(qs, ir.Constant(v64, [0x0F] * 64))
    hi = b.lshr(qs, ir.Constant(v64, [4] * 64))

    dbytes = kb.shuffle(a, None, [bb * (lane // 4) + byte for lane in range(16) for byte in (0, 1)])
    return lo, hi, _f16x16(kb, dbytes), a


def _load_q4_group_by_block(kb: KernelBuilder, w: ir.Value, off: ir.Value, wdtype: str,
                            blocks: int) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
    """load_q4_group on AVX2: each block's 16 quant bytes and 4 header bytes are loaded apiece,
    which x86 without AVX-512 does with plain 16-byte loads and lane inserts where the 64-byte
    gather shuffle (and a partial group's masked load) would become byte-by-byte code. The 4th
    value is the compact header <16 x i8>, block k's d and (q4_1) m at bytes 4k..4k+3."""
    b = kb.b
    bb = BLOCK_BYTES[wdtype]
    zero = ir.Constant(vec(I8, 16), None)
    qs = [kb.load(vec(I8, 16), w, b.add(off, kb.i64(bb * k + bb - 16))) if k < blocks else zero
          for k in range(4)]
    q = kb.concat(kb.concat(qs[0], qs[1]), kb.concat(qs[2], qs[3]))
    lo = b.and_(q, ir.Constant(vec(I8, 64), [0x0F] * 64))
    hi = b.lshr(q, ir.Constant(vec(I8, 64), [4] * 64))
    heads = load_q4_heads(kb, w, off, wdtype, blocks)
    dbytes = kb.shuffle(heads, None, [4 * (lane // 4) + byte for lane in range(16) for byte in (0, 1)])
    return lo, hi, _f16x16(kb, dbytes), heads


def load_q4_heads(kb: KernelBuilder, w: ir.Value, off: ir.Value, wdtype: str, blocks: int) -> ir.Value:
    """The group headers pack_q4_1_mins reads, in the target's form: the group's first 64 bytes
    (AVX-512; a partial group's through a byte mask), or the compact <16 x i8> of 4 bytes a block
    (AVX2; absent blocks zero). Nothing past the row is read."""
    b = kb.b
    bb = BLOCK_BYTES[wdtype]
    if group_isa(kb.target) != "avx2":
        if blocks == 4:
            return kb.load(vec(I8, 64), w, off)
        return masked_load(kb, vec(I8, 64), w, off, blocks * bb)
    heads = ir.Constant(vec(I32, 4), None)
    for k in range(blocks):
        heads = b.insert_element(heads, kb.load(I32, w, b.add(off, kb.i64(bb * k))), ir.Constant(I32, k))
    return b.bitcast(heads, vec(I8, 16))


def head_stride(kb: KernelBuilder, wdtype: str) -> int:
    """Bytes from one block's header to the next in load_q4_heads' value."""
    return 4 if group_isa(kb.target) == "avx2" else BLOCK_BYTES[wdtype]


def _f16x16(kb: KernelBuilder, raw: ir.Value) -> ir.Value:
    """<32 x i8> holding 16 f16 -> <16 x f32>."""
    b = kb.b
    return b.fpext(b.bitcast(b.bitcast(raw, vec(I16, 16)), vec(F16, 16)), vec(F32, 16))


def pack_q4_1_mins(kb: KernelBuilder, heads: list[ir.Value]) -> ir.Value:
    """<16 x f32>, lane 4k+j = m of block k of row j, from the group headers of up to 4 rows
    (load_q4_group's 4th value, or load_q4_heads'; absent rows give 0). One vector carries the
    minima of 4 rows, so m_w * s_x costs one FMA per 4 rows and group, against s_x broadcast to
    its block's lanes."""
    bb = head_stride(kb, "q4_1")
    n = heads[0].type.count
    zero = ir.Constant(vec(I8, n), None)
    heads = heads + [zero] * (4 - len(heads))

    def pair(j0: int) -> ir.Value:   # rows j0, j0+1 in their lanes (the others: don't care, 0)
        return kb.shuffle(heads[j0], heads[j0 + 1],
                          [n * (j - j0) + bb * k + 2 + byte if j in (j0, j0 + 1) else 0
                           for k in range(4) for j in range(4) for byte in (0, 1)])
    lo, hi = pair(0), pair(2)
    both = kb.shuffle(lo, hi, [i if (i // 2) % 4 < 2 else 32 + i for i in range(32)])
    return _f16x16(kb, both)


def q4_group_dot(kb: KernelBuilder, start: ir.Value, lo: ir.Value, hi: ir.Value, xlo: ir.Value,
                 xhi: ir.Value) -> ir.Value:
    """<16 x i32>: lane 4k+j = start + exact sum over lane j's 8 values of block k of w * x
    (start = q4_0's bias makes it (w - 8) * x)."""
    v64 = vec(I8, 64)
    b = kb.b
    if group_isa(kb.target) == "avx2":
        # per 256-bit half: u8 x s8 pairs as i16 (|15 * 127 * 2| and the lo + hi sum of two such
        # stay far below 2^15: no saturation), then pairs of those summed to i32 by vpmaddwd
        # against ones, so i32 lane i is bytes 4i..4i+3 of lo.xlo + hi.xhi: vpdpbusd's lanes
        v32, i16x16 = vec(I8, 32), vec(I16, 16)
        madd = kb.intrinsic("llvm.x86.avx2.pmadd.ub.sw", i16x16, [v32, v32])
        wd = kb.intrinsic("llvm.x86.avx2.pmadd.wd", vec(I32, 8), [i16x16, i16x16])
        ones = ir.Constant(i16x16, [1] * 16)
        halves = []
        for l_, h_, xl, xh in zip(kb.halves(lo), kb.halves(hi), kb.halves(xlo), kb.halves(xhi)):
            pairs = b.add(b.call(madd, [l_, xl]), b.call(madd, [h_, xh]))
            halves.append(b.call(wd, [pairs, ones]))
        return b.add(start, kb.concat(*halves))
    fn = kb.intrinsic("llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), [vec(I32, 16), v64, v64])
    return b.call(fn, [b.call(fn, [start, lo, xlo]), hi, xhi])


def quad_dot(kb: KernelBuilder, lo: ir.Value, hi: ir.Value, xs: list[tuple[ir.Value, ir.Value]]) -> ir.Value:
    """AVX2, q4_0 prefill: <16 x i32>, lane 4k + t = the exact sum over block k of w * x of token
    t, for the activations xs = [(xlo, xhi)] of up to 4 tokens (an absent token's lanes 0). Per
    256-bit half and token, vpmaddubsw of the low and the high nibbles added (4 products an i16),
    then two rounds of vphaddw across the tokens (16 products an i16, at most 16 * 15 * 127 =
    30480: no overflow) and one vpmaddwd against ones: a block's sum per token in 3 vphaddw and 1
    vpmaddwd a half for 4 tokens, where q4_group_dot spends 4 vpmaddwd and leaves 4 lanes a block
    for the float scaling to go through."""
    b = kb.b
    v32, i16x16 = vec(I8, 32), vec(I16, 16)
    madd = kb.intrinsic("llvm.x86.avx2.pmadd.ub.sw", i16x16, [v32, v32])
    hadd = kb.intrinsic("llvm.x86.avx2.phadd.w", i16x16, [i16x16, i16x16])
    wd = kb.intrinsic("llvm.x86.avx2.pmadd.wd", vec(I32, 8), [i16x16, i16x16])
    zero, ones = ir.Constant(i16x16, None), ir.Constant(i16x16, [1] * 16)
    halves = []
    for h, (l_, h_) in enumerate(zip(kb.halves(lo), kb.halves(hi))):
        pairs = [b.add(b.call(madd, [l_, kb.halves(xlo)[h]]), b.call(madd, [h_, kb.halves(xhi)[h]]))
                 for xlo, xhi in xs]
        pairs += [zero] * (4 - len(pairs))
        quad = b.call(hadd, [b.call(hadd, pairs[:2]), b.call(hadd, pairs[2:])])
        halves.append(b.call(wd, [quad, ones]))
    return kb.concat(*halves)


def store_q4_group_activation(kb: KernelBuilder, wdtype: str, q: ir.Value, d: ir.Value, s: ir.Value | None,
                              blk: ir.Value, t: ir.Value, Kg: int, xg: ir.Value, aux: ir.Value,
                              dx: ir.Value, quads: bool = False) -> None:
    """Block blk of activation row t (q <32 x i8>, d its f16-rounded scale, s Q8_1's sum term for
    q4_1) in the grouped layout: xg i8[T,Kg] (per group: 4 x 16 low values, then 4 x 16 high
    values), aux [T,Kg/8] (q4_0, q8_0: bias i32; q4_1: s f32), dx f32[T,Kg/8]; per lane, 4 per
    block. quads (q4_0 only): aux and dx one value a block, in quad_lane's order."""
    b = kb.b
    g, k = b.udiv(blk, kb.i64(4)), b.urem(blk, kb.i64(4))
    xo = kb.idx((t, xg_stride(Kg, quads)), (g, GROUP), (k, 16))
    kb.store(kb.shuffle(q, None, range(16)), xg, xo)
    kb.store(kb.shuffle(q, None, range(16, 32)), xg, b.add(xo, kb.i64(64)))
    offset = {"q4_0": -8, "q8_0": -128}.get(wdtype)   # the codes' offset: 8 below q4_0's, 128 above q8_0's
    if offset is not None:
        wide = b.sext(q, vec(I32, 32))
        s16 = b.add(kb.shuffle(wide, None, range(16)), kb.shuffle(wide, None, range(16, 32)))
        s4 = kb.shuffle(s16, None, range(0, 16, 4))
        for j in (1, 2, 3):
            s4 = b.add(s4, kb.shuffle(s16, None, range(j, 16, 4)))
    if quads:
        lane = quad_lane(kb, t, g, Kg, k)
        kb.store(b.mul(kb.hsum(s4), ir.Constant(I32, offset)), aux, b.mul(lane, kb.i64(4)))
        kb.store(d, dx, b.mul(lane, kb.i64(4)))
        return
    lane = kb.idx((t, Kg // 8), (g, 16), (k, 4))
    aux_val = b.mul(s4, ir.Constant(vec(I32, 4), [offset] * 4)) if offset is not None else kb.splat(s, 4)
    kb.store(aux_val, aux, b.mul(lane, kb.i64(4)))
    kb.store(kb.splat(d, 4), dx, b.mul(lane, kb.i64(4)))


def xg_stride(Kg: int, quads: bool) -> int:
    """Bytes from one row of the grouped activations to the next. quad_dot's tiles read 8 rows at
    a time: a 64-byte gap keeps the rows of a power-of-two K (8 KB apart at K = 8192) from all
    falling into one L1 set."""
    return Kg + 64 if quads else Kg


def quad_lane(kb: KernelBuilder, t: ir.Value, g: ir.Value, Kg: int, k: ir.Value | int = 0) -> ir.Value:
    """Index of (token t, block k of group g) in quad_dot's aux / dx layout: per 4 tokens and
    group, 16 lanes, lane 4k + t % 4 (quad_dot's)."""
    b = kb.b
    quad, t4 = b.udiv(t, kb.i64(4)), b.urem(t, kb.i64(4))
    return kb.idx((quad, Kg // 8), (g, 16), (k, 4), (t4, 1))


# -- int8 block dot products ------------------------------------------------------------------

def dot_i8x32(kb: KernelBuilder, w: ir.Value, x: ir.Value, unsigned_w: bool = False) -> ir.Value:
    """<32 x i8> . <32 x i8> as <VW x i32> partial sums; exact (no saturation for |w|,|x| <= 127).
    unsigned_w: w is q4_1's codes 0..15, which x86's u8 x s8 instructions take as they are."""
    b, t, vw = kb.b, kb.target, kb.vw
    how = t.int8_dot
    v32i8 = vec(I8, 32)
    if how in ("vnni", "avx2"):
        # u8 x s8 instructions: move w's sign onto x (GGML's trick), multiply |w| by it
        if unsigned_w:
            absw, sx = w, x
        else:
            absw = kb.call_math("abs", w, ir.Constant(ir.IntType(1), 0))
            sx = b.call(kb.intrinsic("llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8]), [x, w])
        zero = ir.Constant(vec(I32, 8), None)
        if how == "vnni":
            fn = kb.intrinsic("llvm.x86.avx512.vpdpbusd.256", vec(I32, 8), [vec(I32, 8), v32i8, v32i8])
            return b.call(fn, [zero, absw, sx])
        i16x16 = vec(ir.IntType(16), 16)
        pairs = b.call(kb.intrinsic("llvm.x86.avx2.pmadd.ub.sw", i16x16, [v32i8, v32i8]), [absw, sx])
        ones = ir.Constant(i16x16, [1] * 16)
        return b.call(kb.intrinsic("llvm.x86.avx2.pmadd.wd", vec(I32, 8), [i16x16, i16x16]), [pairs, ones])
    if how == "sdot":
        fn = kb.intrinsic("llvm.aarch64.neon.sdot.v4i32.v16i8", vec(I32, 4), [vec(I32, 4), vec(I8, 16), vec(I8, 16)])
        wl, wh = kb.halves(w)
        xl, xh = kb.halves(x)
        acc = b.call(fn, [ir.Constant(vec(I32, 4), None), wl, xl])
        return b.call(fn, [acc, wh, xh])
    prod = b.mul(b.sext(w, vec(I32, 32)), b.sext(x, vec(I32, 32)))
    while prod.type.count > vw:
        lo, hi = kb.halves(prod)
        prod = b.add(lo, hi)
    return prod


def smmla_pairs(kb: KernelBuilder, ws: list[tuple[ir.Value, ir.Value]], xs: list[tuple[ir.Value, ir.Value]],
                accs: list[list[ir.Value]]) -> None:
    """accs[rp][tp] (<4 x f32>: (row 2rp, token 2tp), (2rp, 2tp+1), (2rp+1, 2tp), (2rp+1, 2tp+1))
    += d_w * d_x * the exact int8 dot of one 32-value block, for weight blocks ws = [(d, <32 x
    i8>)] of the rows and activation blocks xs of the tokens. smmla (i8mm) takes two rows' 8
    values as one operand and two tokens' as the other and adds their 2 x 2 products to 4 i32
    lanes, so 4 smmla cover a block of 4 (row, token) pairs."""
    b = kb.b
    v16, i32x4 = vec(I8, 16), vec(I32, 4)
    fn = kb.intrinsic("llvm.aarch64.neon.smmla.v4i32.v16i8", i32x4, [i32x4, v16, v16])

    def pairs(u: ir.Value, v: ir.Value) -> list[ir.Value]:   # 8 values of u, then of v, per 8 of K
        return [kb.shuffle(u, v, list(range(8 * c, 8 * c + 8)) + list(range(32 + 8 * c, 40 + 8 * c)))
                for c in range(4)]

    for rp in range(len(ws) // 2):
        (d0, w0), (d1, w1) = ws[2 * rp], ws[2 * rp + 1]
        wa = pairs(w0, w1)
        for tp in range(len(xs) // 2):
            (e0, x0), (e1, x1) = xs[2 * tp], xs[2 * tp + 1]
            s = ir.Constant(i32x4, None)
            for a, c in zip(wa, pairs(x0, x1)):
                s = b.call(fn, [s, a, c])
            sc = ir.Constant(vec(F32, 4), None)
            for j, (d, e) in enumerate(((d0, e0), (d0, e1), (d1, e0), (d1, e1))):
                sc = b.insert_element(sc, b.fmul(e, d), ir.Constant(I32, j))
            acc = accs[rp][tp]
            b.store(kb.fma(b.sitofp(s, vec(F32, 4)), sc, b.load(acc)), acc)


def load_weight_block(kb: KernelBuilder, dtype: str, w: ir.Value, row: ir.Value, blk: ir.Value,
                      row_bytes: int) -> tuple[ir.Value, ir.Value]:
    """(d as f32, <32 x i8> values) of block blk of weight row `row`: signed for q4_0 / q8_0,
    q4_1's codes 0..15 (its minimum: load_block_min)."""
    b = kb.b
    bb = BLOCK_BYTES[dtype]
    off = kb.idx((row, row_bytes), (blk, bb))
    d = kb.load_f16(w, off)
    if dtype == "q8_0":
        return d, kb.load(vec(I8, 32), w, b.add(off, kb.i64(2)))
    qs = kb.load(vec(I8, 16), w, b.add(off, kb.i64(bb - 16)))
    lo = b.and_(qs, ir.Constant(vec(I8, 16), [0x0F] * 16))
    hi = b.lshr(qs, ir.Constant(vec(I8, 16), [4] * 16))
    if dtype == "q4_1":
        return d, kb.concat(lo, hi)
    return d, b.sub(kb.concat(lo, hi), ir.Constant(vec(I8, 32), [8] * 32))


def load_block_min(kb: KernelBuilder, w: ir.Value, row: ir.Value, blk: ir.Value, row_bytes: int) -> ir.Value:
    """m as f32 of q4_1 block blk of weight row `row`."""
    return kb.load_f16(w, kb.b.add(kb.idx((row, row_bytes), (blk, BLOCK_BYTES["q4_1"])), kb.i64(2)))


def q8_1_sum(kb: KernelBuilder, d: ir.Value, q: ir.Value) -> ir.Value:
    """Q8_1's s of a block quantized to (d f32 before f16 rounding, q <32 x i8>): f16(d * sum(q))."""
    b = kb.b
    total = kb.hsum(b.sext(q, vec(I32, 32)))
    return kb.to_f16_and_back(b.fmul(d, b.sitofp(total, F32)))


def quantize_block(kb: KernelBuilder, vals: list[ir.Value]) -> tuple[ir.Value, ir.Value]:
    """32 floats (as VW-lane vectors) -> (d f32, <32 x i8>) by GGML's quantize_row_q8_0_ref."""
    b = kb.b
    amax = kb.fabs(vals[0])
    for v in vals[1:]:
        amax = kb.maxnum(amax, kb.fabs(v))
    d = b.fdiv(kb.hmax(amax), kb.f32(127.0))
    inv = b.select(b.fcmp_ordered("!=", d, kb.f32(0.0)), b.fdiv(kb.f32(1.0), d), kb.f32(0.0))
    invv = kb.splat(inv, kb.vw)
    qs = [b.fptosi(kb.round_away(b.fmul(v, invv)), vec(I8, kb.vw)) for v in vals]
    while len(qs) > 1:
        qs = [kb.concat(qs[i], qs[i + 1]) for i in range(0, len(qs), 2)]
    return d, qs[0]


def quantize_block_q4_0(kb: KernelBuilder, vals: list[ir.Value], src: ir.Value, first: ir.Value
                        ) -> tuple[ir.Value, ir.Value]:
    """32 floats (as VW-lane vectors, also at byte offset `first` of src) -> (d f32, <16 x i8>
    packed nibbles) by GGML's quantize_row_q4_0_ref: m = the first value of largest magnitude,
    d = m / -8, q = min(15, trunc(x / d + 8.5)); byte j holds q[j] low and q[j + 16] high."""
    b, vw = kb.b, kb.vw
    amax = kb.fabs(vals[0])
    for v in vals[1:]:
        amax = kb.maxnum(amax, kb.fabs(v))
    amax_v = kb.splat(kb.hmax(amax), vw)
    # the first lane holding amax (C keeps the first: `if (amax < fabsf(v))`), then its value
    ivec = vec(I32, vw)
    first_at = ir.Constant(ivec, [QK] * vw)
    for k, v in enumerate(vals):
        at = b.select(b.fcmp_ordered("==", kb.fabs(v), amax_v), ir.Constant(ivec, list(range(k * vw, k * vw + vw))),
                      ir.Constant(ivec, [QK] * vw))
        first_at = b.select(b.icmp_signed("<", at, first_at), at, first_at)
    while first_at.type.count > 1:
        lo, hi = kb.halves(first_at)
        first_at = b.select(b.icmp_signed("<", lo, hi), lo, hi)
    at = b.extract_element(first_at, ir.Constant(I32, 0))
    at = b.select(b.icmp_signed("<", at, ir.Constant(I32, QK)), at, ir.Constant(I32, 0))   # all NaN
    m = kb.load(F32, src, b.add(first, b.mul(b.zext(at, ir.IntType(64)), kb.i64(4))))
    # + 0.0: C starts from max = 0.0f and keeps it for an all-zero block, never -0.0
    d = b.fdiv(b.fadd(m, kb.f32(0.0)), kb.f32(-8.0))
    inv = b.select(b.fcmp_ordered("!=", d, kb.f32(0.0)), b.fdiv(kb.f32(1.0), d), kb.f32(0.0))
    invv, half = kb.splat(inv, vw), kb.splat(kb.f32(8.5), vw)
    top = ir.Constant(vec(I8, vw), [15] * vw)
    qs = []
    for v in vals:   # fmul then fadd, each rounded, as C without contraction and as numpy
        q = b.fptosi(b.fadd(b.fmul(v, invv), half), vec(I8, vw))
        qs.append(b.select(b.icmp_signed(">", q, top), top, q))
    while len(qs) > 1:
        qs = [kb.concat(qs[i], qs[i + 1]) for i in range(0, len(qs), 2)]
    lo, hi = kb.halves(qs[0])
    return d, b.or_(lo, b.shl(hi, ir.Constant(vec(I8, 16), [4] * 16)))


def fma_into(kb: KernelBuilder, acc: ir.Value, a: ir.Value, c: ir.Value) -> None:
    """acc (a VW-lane variable) += a * c; a narrower tail vector's products go into lane 0 as
    one sum."""
    b = kb.b
    if a.type.count == kb.vw:
        b.store(kb.fma(a, c, b.load(acc)), acc)
        return
    cur = b.load(acc)
    lane0 = b.fadd(b.extract_element(cur, ir.Constant(I32, 0)), kb.hsum(b.fmul(a, c)))
    b.store(b.insert_element(cur, lane0, ir.Constant(I32, 0)), acc)


def rms_scale_row(kb: KernelBuilder, x: ir.Value, row_off: ir.Value, K: int, eps: float) -> ir.Value:
    """sqrt(mean(x^2) + eps) of the f32 row at byte offset row_off."""
    b, vw = kb.b, kb.vw
    acc = kb.var(vec(F32, vw), ir.Constant(vec(F32, vw), [0.0] * vw))

    def squares(k: ir.Value, lanes: int) -> None:
        v = kb.load(vec(F32, lanes), x, b.add(row_off, b.mul(k, kb.i64(4))))
        fma_into(kb, acc, v, v)
    kb.for_chunks(K, squares)
    var = b.fdiv(kb.hsum(b.load(acc)), kb.f32(K))
    return kb.sqrt(b.fadd(var, kb.f32(eps)))


def normalized(kb: KernelBuilder, x: ir.Value, row_off: ir.Value, k: ir.Value, den: ir.Value | None,
               norm_w: ir.Value | None, norm_dtype: str, lanes: int | None = None) -> ir.Value:
    """`lanes` (default VW) floats of row x at element k, as x / den * w when a norm is fused in."""
    b, vw = kb.b, lanes or kb.vw
    v = kb.load(vec(F32, vw), x, b.add(row_off, b.mul(k, kb.i64(4))))
    if den is None:
        return v
    return b.fmul(b.fdiv(v, kb.splat(den, vw)), kb.load_floats(norm_dtype, norm_w, k, vw))


# -- the kernel -------------------------------------------------------------------------------

class MatmulEmitter:
    def __init__(self, kb: KernelBuilder, spec: MatmulSpec):
        self.kb, self.s = kb, spec
        bufs = list(kb.bufs)
        self.x, self.w = bufs[0], bufs[1]
        self.norm_w = bufs[2] if spec.prologue else None
        extra = bufs[3 if spec.prologue else 2:]
        self.extra = extra
        self.nb = spec.K // QK
        self.grouped = q4_group_ok(kb.target, spec.wdtype)
        # AVX2 q4_0 prefill: 4 tokens' block sums at a time (quad_dot), aux / dx in quad_lane's order
        self.quads = AVX2_QUADS and spec.wdtype == "q4_0" and spec.T > 1 and group_isa(kb.target) == "avx2"
        self.token_tile = QUAD_TOKEN_TILE if self.quads else TOKEN_TILE
        self.kg = padded_k(spec.K)
        # prefill inside a step: the team prepares the rows together into thread 0's scratch
        # (each thread a share of them, then a barrier) instead of every thread all of them
        self.team_prepare = (SHARED_PREPARE and kb.work is not None and spec.T > 1
                             and (spec.quantized or spec.prologue))
        scratch = kb.scratch
        self.one_row = spec.T == 1                  # tiles for one row (decode's); emit() may set it
        self.team: ir.Value | None = None          # i1: the team prepares this step's rows together
        if self.team_prepare:
            # the barrier block sits WORK_OFFSET bytes before the work counter; the step function
            # stored the scratch base at SCRATCH_BASE_OFFSET of it (compiler/codegen/llvm.py)
            base = kb.b.load(kb.at(kb.work, SCRATCH_BASE_OFFSET - WORK_OFFSET), typ=ir.PointerType())
            # one row each thread prepares itself, as decode does, sparing the barrier (more rows:
            # the team, or each thread would redo all of them; SmolLM2, 2 threads: one row through
            # a step graph 2.99 -> 2.94 ms, 8 rows 8.67 -> 8.92 ms had it been 8)
            self.team = kb.b.icmp_unsigned(">", kb.n_tokens, kb.i64(1))
            scratch = kb.b.select(self.team, base, scratch)
        self.xf = scratch                                              # f32[T, K] (float weights)
        if spec.quantized:                                             # see scratch_layout
            at = scratch_layout(spec)
            self.xq = scratch                                          # at["xq"] == 0
            self.xd = kb.at(scratch, at["xd"])
            self.xs = kb.at(scratch, at["xs"]) if "xs" in at else None
            if "xg" in at:
                self.xg, self.gaux, self.gdx = (kb.at(scratch, at[n]) for n in ("xg", "gaux", "gdx"))

    @property
    def tile_rows(self) -> int:
        # decode: more rows in flight per thread hide DRAM latency, and each tile's horizontal
        # sums are spread over more bytes; prefill keeps R x TOKEN_TILE accumulators in registers
        if self.one_row and self.grouped:
            if group_isa(self.kb.target) != "vnni512":
                return AVX2_DECODE_ROWS
            return DECODE_ROWS_LONG if self.s.row_bytes >= LONG_ROW else DECODE_ROWS
        if self.quads:
            return QUAD_TILE_ROWS
        return 1 if self.q8_stream else 4

    @property
    def q8_stream(self) -> bool:
        """Q8_0 decode on AVX2 without AVX-512 VNNI walks one weight row at a time, without prefetch: the
        thread's rows are then one sequential stream, which the hardware prefetcher follows where
        4 interleaved rows 612 bytes apart (SmolLM2's lm_head) stall it. Measured on an AMD EPYC
        (Zen 3, 2 threads, one process, medians of 9): lm_head [49152, 576] 3.95 ms with 4-row
        tiles and prefetch 1 KB ahead, 2.79 ms with 1 row and the prefetch, 2.13 ms without it."""
        return self.one_row and self.s.wdtype == "q8_0" and group_isa(self.kb.target) == "avx2"

    @property
    def n_rows(self) -> ir.Value:
        """The step's rows, at most x's: a step graph's head has fewer rows than the step's tokens
        (compiler/codegen/llvm.py passes it the logit rows), and no count may take it past them."""
        kb = self.kb
        most = kb.i64(self.s.T)
        return kb.b.select(kb.b.icmp_unsigned(">", kb.n_tokens, most), most, kb.n_tokens)

    def emit(self) -> None:
        self.prepare()
        if self.team_prepare:
            with self.kb.if_(self.team):     # the same branch on every thread: n_tokens is the team's
                self.kb.team_barrier()       # every row prepared before any thread's tiles read them
        kb, b = self.kb, self.kb.b
        if self.s.T == 1:
            self.one_row_loop()
            return
        if not ONE_ROW_TILES:
            self.rows_loop()
            return
        # a step of one row (one sequence decoding through a step graph) walks the weights as a
        # decode graph does (its tile rows, prefetch and shares); each row's sums are the same
        # either way, so its result does not depend on the step's row count
        with b.if_else(b.icmp_unsigned("==", self.n_rows, kb.i64(1))) as (one, many):
            with one:
                self.one_row = True
                self.one_row_loop()
                self.one_row = False
            with many:
                self.rows_loop()

    def units(self) -> int:
        """Work items over the weight rows: one head (rope_kv_store), or one tile of rows."""
        s = self.s
        if s.epilogue == "rope_kv_store":
            return s.n_heads + 2 * s.n_kv_heads
        if s.epilogue == "silu_mul":
            return s.N // 2 // self._rows_per_tile(s.N // 2, max(1, self.tile_rows // 2))
        return s.N // self._rows_per_tile(s.N, self.tile_rows)

    def one_row_loop(self) -> None:
        units = self.units()
        with self.kb.shared_loop(units, self.grain(units)) as u:
            self.unit(u, self.kb.i64(0), 1)

    def rows_loop(self) -> None:
        kb, b = self.kb, self.kb.b
        units = self.units()
        grain = self.grain(units)
        # one item = one unit over one chunk of tokens, chunk-major (unit-major, to reuse a unit's
        # rows from L2 for its next chunk, measured no faster: prefill is bound by the dot products)
        n = self.n_rows
        n_chunks = b.udiv(b.add(n, kb.i64(TOKEN_CHUNK - 1)), kb.i64(TOKEN_CHUNK))
        with kb.shared_loop(b.mul(n_chunks, kb.i64(units)), max(1, grain // 16)) as item:
            u = b.urem(item, kb.i64(units))
            c0 = b.mul(b.udiv(item, kb.i64(units)), kb.i64(TOKEN_CHUNK))
            c_end = b.add(c0, kb.i64(TOKEN_CHUNK))
            c_end = b.select(b.icmp_signed("<", c_end, n), c_end, n)
            rem = b.urem(b.sub(c_end, c0), kb.i64(self.token_tile))
            full_end = b.sub(c_end, rem)
            with kb.loop(c0, full_end, self.token_tile) as t0:
                self.unit(u, t0, self.token_tile)
            # the chunk's last 1..3 rows in one tile: a speculative verify step is 2-9 rows, and
            # a row apiece unpacks each weight group once per row (SmolLM2, 2 threads, interleaved
            # in one process: 2 rows 4.87 -> 4.31 ms, 3 rows 5.78 -> 4.58, a decode step 2.9). A
            # row sums in the same order in any tile width
            for n in range(1, self.token_tile):
                with kb.if_(b.icmp_unsigned("==", rem, kb.i64(n))):
                    self.unit(u, full_end, n)

    def grain(self, units: int) -> int:
        """Units a thread takes from the shared counter at a time: about GRAB_BYTES of weight rows
        (few atomics), but at most 1/64 of the op, so the shared 1/8 is several grabs."""
        s = self.s
        rows = s.N // units
        return max(1, min(GRAB_BYTES // (rows * s.row_bytes), units // 64))

    @staticmethod
    def _rows_per_tile(n: int, most: int) -> int:
        r = most
        while n % r:
            r //= 2
        return r

    # activations: quantized to Q8_0, or normalised f32, for every row of the step
    def prepare(self) -> None:
        s, kb = self.s, self.kb
        b = kb.b
        if not s.quantized and not s.prologue:
            return
        lo, hi = kb.i64(0), self.n_rows if s.T > 1 else kb.i64(1)
        if self.team_prepare:
            share = kb.split(hi)
            lo, hi = b.select(self.team, share[0], lo), b.select(self.team, share[1], hi)
        with kb.loop(lo, hi) as t:
            row_off = b.mul(t, kb.i64(s.K * 4))
            den = rms_scale_row(kb, self.x, row_off, s.K, s.eps) if s.prologue else None
            if not s.quantized:
                def norm_chunk(k: ir.Value, lanes: int) -> None:
                    v = normalized(kb, self.x, row_off, k, den, self.norm_w, s.norm_dtype, lanes)
                    kb.store(v, self.xf, b.add(row_off, b.mul(k, kb.i64(4))))
                kb.for_chunks(s.K, norm_chunk)
            else:
                with kb.loop(0, self.nb) as blk:
                    k0 = b.mul(blk, kb.i64(QK))
                    vals = [normalized(kb, self.x, row_off, b.add(k0, kb.i64(j)), den, self.norm_w, s.norm_dtype)
                            for j in range(0, QK, kb.vw)]
                    d, q = quantize_block(kb, vals)
                    i = kb.idx((t, self.nb), (blk, 1))
                    d16 = kb.to_f16_and_back(d)
                    kb.store(d16, self.xd, b.mul(i, kb.i64(4)))
                    kb.store(q, self.xq, b.mul(i, kb.i64(QK)))
                    sq = None
                    if s.wdtype == "q4_1":
                        sq = q8_1_sum(kb, d, q)
                        kb.store(sq, self.xs, b.mul(i, kb.i64(4)))
                    if self.grouped:
                        store_q4_group_activation(kb, s.wdtype, q, d16, sq, blk, t, self.kg, self.xg,
                                                  self.gaux, self.gdx, self.quads)
                if self.grouped:  # a partial last group reads these blocks: zeros add nothing
                    for blk in range(self.nb, self.kg // QK):
                        store_q4_group_activation(kb, s.wdtype, ir.Constant(vec(I8, 32), None), kb.f32(0.0),
                                                  kb.f32(0.0), kb.i64(blk), t, self.kg, self.xg, self.gaux,
                                                  self.gdx, self.quads)

    def tile(self, rows: list[ir.Value], t0: ir.Value, tt: int, run: int) -> list[list[ir.Value]]:
        """y[t0+t, rows[r]] for r < R, t < tt, as f32 scalars; rows come in runs of `run`
        consecutive rows, and the next unit's rows are `run` rows on."""
        s, kb = self.s, self.kb
        if self.quads:
            return self.tile_q4_quads(rows, t0, tt, run)
        if self.grouped:
            return self.tile_q4_groups(rows, t0, tt, run)
        b, vw = kb.b, kb.vw
        zero = ir.Constant(vec(F32, vw), [0.0] * vw)
        accs = [[kb.var(vec(F32, vw), zero) for _ in range(tt)] for _ in rows]
        q4_1 = s.wdtype == "q4_1"
        # q4_1: sum of m_w * s_x per (row, token), one scalar FMA a block beside the 32-value dot
        mins = [[kb.var(F32, kb.f32(0.0)) for _ in range(tt)] for _ in rows] if q4_1 else None
        # i8mm: rows and tokens in pairs, one smmla per 8 values of a block gives all 4 (row,
        # token) dot products of a pair of each; accumulators <4 x f32> per pair of pairs. In
        # prefill a lone tail token goes with a copy of itself, so each (row, token) sums in one
        # order whatever the step's token count (batch invariance: a step graph's rows)
        mm = s.quantized and kb.target.int8_matmul and s.T > 1 and len(rows) % 2 == 0
        pair_accs = [[kb.var(vec(F32, 4), ir.Constant(vec(F32, 4), [0.0] * 4)) for _ in range((tt + 1) // 2)]
                     for _ in range(len(rows) // 2)] if mm else None
        if s.quantized:
            with kb.loop(0, self.nb) as blk:
                if not self.q8_stream:   # one row's stream: the hardware prefetcher follows it
                    for r in rows:
                        prefetch(kb, self.w, kb.idx((r, s.row_bytes), (blk, BLOCK_BYTES[s.wdtype]), (PREFETCH_BYTES, 1)))
                ws = [load_weight_block(kb, s.wdtype, self.w, r, blk, s.row_bytes) for r in rows]
                ms = [load_block_min(kb, self.w, r, blk, s.row_bytes) for r in rows] if q4_1 else None
                xs_ = []
                for t in range(tt):
                    i = kb.idx((t0, self.nb), (t, self.nb), (blk, 1))
                    xd = kb.load(F32, self.xd, b.mul(i, kb.i64(4)))
                    xq = kb.load(vec(I8, 32), self.xq, b.mul(i, kb.i64(QK)))
                    xs = kb.load(F32, self.xs, b.mul(i, kb.i64(4))) if q4_1 else None
                    xs_.append((xd, xq))
                    for r, (wd, wq) in enumerate(ws):
                        if not mm:
                            p = b.sitofp(dot_i8x32(kb, wq, xq, unsigned_w=q4_1), vec(F32, vw))
                            sc = kb.splat(b.fmul(xd, wd), vw)
                            b.store(kb.fma(p, sc, b.load(accs[r][t])), accs[r][t])
                        if q4_1:
                            b.store(kb.fma(ms[r], xs, b.load(mins[r][t])), mins[r][t])
                if mm:
                    smmla_pairs(kb, ws, xs_ + xs_[-1:] * (tt % 2), pair_accs)
            if mm:
                ys = [[None] * tt for _ in rows]
                for rp, row_accs in enumerate(pair_accs):
                    for tp, acc in enumerate(row_accs):
                        v = b.load(acc)
                        for j, (r, t) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                            if 2 * tp + t < tt:
                                ys[2 * rp + r][2 * tp + t] = b.extract_element(v, ir.Constant(I32, j))
                if q4_1:
                    ys = [[b.fadd(ys[r][t], b.load(mins[r][t])) for t in range(tt)] for r in range(len(rows))]
                return ys
            if q4_1:
                return [[b.fadd(kb.hsum(b.load(accs[r][t])), b.load(mins[r][t])) for t in range(tt)]
                        for r in range(len(rows))]
        else:
            x = self.xf if s.prologue else self.x

            def dots(k: ir.Value, lanes: int) -> None:
                ws = [kb.load_floats(s.wdtype, self.w, b.add(b.mul(r, kb.i64(s.K)), k), lanes) for r in rows]
                for t in range(tt):
                    xv = kb.load(vec(F32, lanes), x, b.mul(kb.idx((t0, s.K), (t, s.K), (k, 1)), kb.i64(4)))
                    for r, wv in enumerate(ws):
                        fma_into(kb, accs[r][t], wv, xv)
            kb.for_chunks(s.K, dots)
        return [[kb.hsum(b.load(accs[r][t])) for t in range(tt)] for r in range(len(rows))]

    def tile_q4_groups(self, rows: list[ir.Value], t0: ir.Value, tt: int, run: int) -> list[list[ir.Value]]:
        """tile() for q4_0 / q4_1 on the grouped path: each group of 4 weight blocks of a row is
        unpacked once and used for tt tokens; accumulators are <16 x f32> per (row, token). The
        next unit's rows are `run` rows on from these."""
        s, kb = self.s, self.kb
        b = kb.b
        gb, q4_1 = group_bytes(s.wdtype), s.wdtype == "q4_1"
        zero = ir.Constant(vec(F32, 16), [0.0] * 16)
        # the accumulator's lanes only meet in the final hsum, so on AVX2 (two ymm per <16 x f32>)
        # a prefill tile folds the halves into one <8 x f32>: half the registers it holds
        # (every tile of a prefill kernel, its one-token tail too: a row sums in one order
        # whatever the step's token count)
        acc8 = AVX2_PREFILL_ACC8 and s.T > 1 and group_isa(kb.target) == "avx2"
        acc_zero = ir.Constant(vec(F32, 8), [0.0] * 8) if acc8 else zero
        accs = [[kb.var(acc_zero.type, acc_zero) for _ in range(tt)] for _ in rows]
        quads = [list(range(i, min(i + 4, len(rows)))) for i in range(0, len(rows), 4)]
        # q4_1: m_w * s_x of the rows of quads[i], lane 4k+j for row 4i+j (pack_q4_1_mins)
        maccs = [[kb.var(vec(F32, 16), zero) for _ in range(tt)] for _ in quads] if q4_1 else []

        def aux_lanes(row: ir.Value, g: ir.Value) -> ir.Value:   # byte offset of (row, group g) in aux, dx
            return b.mul(kb.idx((row, self.kg // 8), (g, 16)), kb.i64(4))

        def add_mins(heads: list[ir.Value], g: ir.Value) -> None:
            mins = [pack_q4_1_mins(kb, [heads[r] for r in quad]) for quad in quads]
            for t in range(tt):
                sx = kb.load(vec(F32, 16), self.gaux, aux_lanes(b.add(t0, kb.i64(t)), g))
                for i, m in enumerate(mins):
                    b.store(kb.fma(m, sx, b.load(maccs[i][t])), maccs[i][t])

        def step(g: ir.Value, blocks: int) -> None:
            ws = self.weight_groups(rows, g, blocks, run)
            for t in range(tt):
                row = b.add(t0, kb.i64(t))
                xo = kb.idx((row, self.kg), (g, GROUP))
                xlo = kb.load(vec(I8, 64), self.xg, xo)
                xhi = kb.load(vec(I8, 64), self.xg, b.add(xo, kb.i64(64)))
                lane = aux_lanes(row, g)
                start = ir.Constant(vec(I32, 16), None) if q4_1 else kb.load(vec(I32, 16), self.gaux, lane)
                dx = kb.load(vec(F32, 16), self.gdx, lane)
                for r, (lo, hi, d, _) in enumerate(ws):
                    isum = b.sitofp(q4_group_dot(kb, start, lo, hi, xlo, xhi), vec(F32, 16))
                    scale = b.fmul(d, dx)
                    if acc8:
                        (i0, i1), (s0, s1) = kb.halves(isum), kb.halves(scale)
                        b.store(kb.fma(i1, s1, kb.fma(i0, s0, b.load(accs[r][t]))), accs[r][t])
                    else:
                        b.store(kb.fma(isum, scale, b.load(accs[r][t])), accs[r][t])
            if q4_1 and tt == 1:
                add_mins([w[3] for w in ws], g)

        with kb.loop(0, s.K // GROUP) as g:
            step(g, 4)
        if s.K % GROUP:
            step(kb.i64(s.K // GROUP), s.K % GROUP // QK)
        if q4_1 and tt > 1:
            # prefill: the minima in a second pass over the tile's group headers (L1-hot by now),
            # which leaves the first pass the registers of q4_0's, with no accumulator spilled
            with kb.loop(0, s.K // GROUP) as g:
                add_mins([load_q4_heads(kb, self.w, kb.idx((r, s.row_bytes), (g, gb)), "q4_1", 4)
                          for r in rows], g)
            if s.K % GROUP:
                g = kb.i64(s.K // GROUP)
                add_mins([load_q4_heads(kb, self.w, kb.idx((r, s.row_bytes), (g, gb)), "q4_1",
                                        s.K % GROUP // QK) for r in rows], g)
        ys = [[kb.hsum(b.load(accs[r][t])) for t in range(tt)] for r in range(len(rows))]
        for i, quad in enumerate(quads if q4_1 else []):
            for t in range(tt):
                macc = b.load(maccs[i][t])
                for j, r in enumerate(quad):
                    ys[r][t] = b.fadd(ys[r][t], kb.hsum(kb.shuffle(macc, None, range(j, 16, 4))))
        return ys

    def weight_groups(self, rows: list[ir.Value], g: ir.Value, blocks: int, run: int) -> list[tuple]:
        """load_q4_group of group g of each row, prefetching the same group `run` rows on."""
        s, kb = self.s, self.kb
        b = kb.b
        ws = []
        for r in rows:
            off = kb.idx((r, s.row_bytes), (g, group_bytes(s.wdtype)))
            # the same group of the row `run` rows on: the next unit's, so rows stream without
            # a stall where a unit starts (a unit's rows are short: 1152 bytes at K=2048)
            ahead = b.add(off, kb.i64(self.prefetch_distance(run)))
            prefetch(kb, self.w, ahead)
            prefetch(kb, self.w, b.add(ahead, kb.i64(blocks * BLOCK_BYTES[s.wdtype] - 1)))
            ws.append(load_q4_group(kb, self.w, off, s.wdtype, blocks))
        return ws

    def prefetch_distance(self, run: int) -> int:
        """Bytes from a weight group to the one weight_groups prefetches: `run` rows, or on AVX2
        decode's one-row tiles of long rows a fixed AVX2_DECODE_PREFETCH (its row's stream,
        then the next rows in memory)."""
        s = self.s
        if self.one_row and group_isa(self.kb.target) == "avx2" and s.row_bytes >= LONG_ROW:
            return AVX2_DECODE_PREFETCH
        return run * s.row_bytes

    def tile_q4_quads(self, rows: list[ir.Value], t0: ir.Value, tt: int, run: int) -> list[list[ir.Value]]:
        """tile() for q4_0 prefill on AVX2: quad_dot's block sums of 4 tokens at a time, scaled
        and summed into an <8 x f32> per (row, 4 tokens), lane 4 * (k % 2) + t for block k (so
        blocks 0 and 2 of a group meet in a lane, 1 and 3 in another). t0 is a multiple of 4; a
        token's lanes take the same steps in any tile, so a row sums alike whatever the step's
        token count."""
        kb = self.kb
        b = kb.b
        nq = -(-tt // 4)
        zero = ir.Constant(vec(F32, 8), [0.0] * 8)
        accs = [[kb.var(zero.type, zero) for _ in range(nq)] for _ in rows]

        def step(g: ir.Value, blocks: int) -> None:
            for r, row in enumerate(rows):
                # a compiler-only fence: LLVM may not share one row's activation loads with the
                # next row's, so they stay memory operands of vpmaddubsw instead of 32 registers
                # spilled to the stack (1 thread, alone, K = 2048 x 64 tokens: 4.35 -> 3.22 ms)
                b.asm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", [], True)
                (lo, hi, d, _), = self.weight_groups([row], g, blocks, run)
                for q in range(nq):
                    xs = []
                    for t in range(4 * q, min(tt, 4 * q + 4)):
                        xo = kb.idx((b.add(t0, kb.i64(t)), xg_stride(self.kg, True)), (g, GROUP))
                        xs.append((kb.load(vec(I8, 64), self.xg, xo), kb.load(vec(I8, 64), self.xg, b.add(xo, kb.i64(64)))))
                    lane = b.mul(quad_lane(kb, b.add(t0, kb.i64(4 * q)), g, self.kg), kb.i64(4))
                    bias = kb.load(vec(I32, 16), self.gaux, lane)
                    dx = kb.load(vec(F32, 16), self.gdx, lane)
                    isum = b.sitofp(b.add(quad_dot(kb, lo, hi, xs), bias), vec(F32, 16))
                    (i0, i1), (s0, s1) = kb.halves(isum), kb.halves(b.fmul(d, dx))
                    b.store(kb.fma(i1, s1, kb.fma(i0, s0, b.load(accs[r][q]))), accs[r][q])

        with kb.loop(0, self.s.K // GROUP) as g:
            step(g, 4)
        if self.s.K % GROUP:
            step(kb.i64(self.s.K // GROUP), self.s.K % GROUP // QK)
        ys = [[None] * tt for _ in rows]
        for r in range(len(rows)):
            for q in range(nq):
                v = b.load(accs[r][q])
                for t in range(4 * q, min(tt, 4 * q + 4)):
                    lane = lambda i: b.extract_element(v, ir.Constant(I32, i))  # noqa: E731
                    ys[r][t] = b.fadd(lane(t % 4), lane(4 + t % 4))
        return ys

    def biased(self, ys: list[list[ir.Value]], rows: list[ir.Value]) -> list[list[ir.Value]]:
        """ys[r][t] + b[rows[r]] where the op has a bias (added before any epilogue)."""
        if not self.s.bias:
            return ys
        kb = self.kb
        bs = [kb.load(F32, self.bias, kb.b.mul(r, kb.i64(4))) for r in rows]
        return [[kb.b.fadd(y, bv) for y in row] for row, bv in zip(ys, bs)]

    def unit(self, u: ir.Value, t0: ir.Value, tt: int) -> None:
        s, kb = self.s, self.kb
        b = kb.b
        out_f32 = lambda val, t, n, width: kb.store(val, self.out, b.mul(kb.idx((t0, width), (t, width), (n, 1)), kb.i64(4)))  # noqa: E731
        if s.epilogue in (None, "add"):
            r = self._rows_per_tile(s.N, self.tile_rows)
            n0 = b.mul(u, kb.i64(r))
            rows = [b.add(n0, kb.i64(j)) for j in range(r)]
            ys = self.biased(self.tile(rows, t0, tt, r), rows)
            for j in range(r):
                for t in range(tt):
                    y = ys[j][t]
                    if s.epilogue == "add":
                        res = kb.load(F32, self.extra[0], b.mul(kb.idx((t0, s.N), (t, s.N), (rows[j], 1)), kb.i64(4)))
                        y = b.fadd(res, y)
                    out_f32(y, t, rows[j], s.N)
        elif s.epilogue == "silu_mul":
            f = s.N // 2
            r = self._rows_per_tile(f, max(1, self.tile_rows // 2))
            n0 = b.mul(u, kb.i64(r))
            feats = [b.add(n0, kb.i64(j)) for j in range(r)]
            rows = feats + [b.add(n, kb.i64(f)) for n in feats]
            ys = self.biased(self.tile(rows, t0, tt, r), rows)
            for j in range(r):
                for t in range(tt):
                    out_f32(b.fmul(kb.silu(ys[j][t]), ys[r + j][t]), t, feats[j], f)
        else:
            self.rope_unit(u, t0, tt)

    @property
    def out(self) -> ir.Value:
        # output buffer follows the inputs: x, w, [norm_w], extra..., then outputs
        return self.extra[self._n_extra_inputs()]

    @property
    def bias(self) -> ir.Value:
        return self.extra[self._n_extra_inputs() - 1]   # the last input (compiler/ir.py)

    def _n_extra_inputs(self) -> int:
        s = self.s
        return ({None: 0, "add": 1, "silu_mul": 0, "rope_kv_store": 3}[s.epilogue] + 2 * s.qk_norm
                + 2 * s.step_rows + s.bias)

    # rope_kv_store: one unit is one head of the stacked [q; k; v] rows
    def rope_unit(self, head: ir.Value, t0: ir.Value, tt: int) -> None:
        s, kb = self.s, self.kb
        b, hd = kb.b, s.head_dim
        inv_freq, k_cache, v_cache = self.extra[0], self.extra[1], self.extra[2]
        buf = kb.var(F32, count=tt * hd)                                # f32[tt, hd]
        r = self._rows_per_tile(hd, self.tile_rows)
        with kb.loop(0, hd, r) as j0:
            base = b.add(b.mul(head, kb.i64(hd)), j0)
            rows = [b.add(base, kb.i64(j)) for j in range(r)]
            ys = self.biased(self.tile(rows, t0, tt, r), rows)
            for j in range(r):
                for t in range(tt):
                    kb.store(ys[j][t], buf, b.mul(b.add(b.add(j0, kb.i64(j)), kb.i64(t * hd)), kb.i64(4)))
        h, kvh = s.n_heads, s.n_kv_heads
        is_q = b.icmp_signed("<", head, kb.i64(h))
        is_v = b.icmp_signed(">=", head, kb.i64(h + kvh))
        # a step graph's rows: their positions and KV slots, after the per-head norm weights
        positions, slots = (self.extra[3 + 2 * s.qk_norm], self.extra[4 + 2 * s.qk_norm]) if s.step_rows else (None, None)

        def row_index(buf: ir.Value, t: int) -> ir.Value:
            return b.sext(kb.load(I32, buf, b.mul(b.add(t0, kb.i64(t)), kb.i64(4))), ir.IntType(64))
        for t in range(tt):
            row = kb.at(buf, t * hd * 4)
            pos = b.add(b.add(kb.start_pos, t0), kb.i64(t)) if positions is None else row_index(positions, t)
            with b.if_then(b.not_(is_v)):
                if s.qk_norm:   # Qwen3: the head RMS-normed with q_norm_w or k_norm_w first
                    norm_w = b.select(is_q, self.extra[3], self.extra[4])
                    # times 1 / rms, not over it: a division a value cost 8% of the prefill QKV
                    inv = b.fdiv(kb.f32(1.0), rms_scale_row(kb, row, kb.i64(0), hd, s.qk_eps))

                    def norm_chunk(k: ir.Value, lanes: int) -> None:
                        off = b.mul(k, kb.i64(4))
                        val = b.fmul(kb.load(vec(F32, lanes), row, off), kb.splat(inv, lanes))
                        kb.store(b.fmul(val, kb.load_floats(s.qk_norm_dtype, norm_w, k, lanes)), row, off)
                    kb.for_chunks(hd, norm_chunk)
                rope_row(kb, row, row, pos, inv_freq, s.inv_freq_dtype, hd)
            if slots is None:
                slot, stored = b.add(b.add(kb.n_past, t0), kb.i64(t)), ir.Constant(I1, 1)
            else:   # a slot outside the cache stores nothing, as the step graph's kv_store
                slot = row_index(slots, t)
                stored = b.icmp_unsigned("<", slot, kb.i64(s.cache_rows))
            with b.if_else(is_q) as (then, other):
                with then:
                    q_off = b.mul(kb.idx((t0, h * hd), (t, h * hd), (head, hd)), kb.i64(4))
                    copy_row(kb, row, kb.at(self.out, q_off), hd)
                with other:
                    with b.if_then(stored):
                        kh = b.select(is_v, b.sub(head, kb.i64(h + kvh)), b.sub(head, kb.i64(h)))
                        cache = b.select(is_v, v_cache, k_cache)
                        store_cache_row(kb, row, cache, slot, kh, kvh, hd, s.cache_dtype)


def copy_row(kb: KernelBuilder, src: ir.Value, dst: ir.Value, n: int) -> None:
    b = kb.b

    def copy(j: ir.Value, lanes: int) -> None:
        off = b.mul(j, kb.i64(4))
        kb.store(kb.load(vec(F32, lanes), src, off), dst, off)
    kb.for_chunks(n, copy)


def rope_row(kb: KernelBuilder, src: ir.Value, dst: ir.Value, pos: ir.Value, inv_freq: ir.Value,
             inv_dtype: str, hd: int) -> None:
    """HF rotate_half on one head row: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), angle pos * inv_freq."""
    b = kb.b
    half = hd // 2
    posf = b.sitofp(pos, F32)
    posv = {n: kb.splat(posf, n) for n in (kb.vw, *tail_widths(half, kb.vw))}

    def rotate(j: ir.Value, n: int) -> None:
        ang = b.fmul(posv[n], kb.load_floats(inv_dtype, inv_freq, j, n))
        c, s = kb.call_math("cos", ang), kb.call_math("sin", ang)
        o1, o2 = b.mul(j, kb.i64(4)), b.mul(b.add(j, kb.i64(half)), kb.i64(4))
        x1, x2 = kb.load(vec(F32, n), src, o1), kb.load(vec(F32, n), src, o2)
        kb.store(b.fsub(b.fmul(x1, c), b.fmul(x2, s)), dst, o1)
        kb.store(b.fadd(b.fmul(x2, c), b.fmul(x1, s)), dst, o2)
    kb.for_chunks(half, rotate)


KV_DTYPES = ("f32", "f16", "q8_0", "q4_0")    # KV caches the CPU kernels store and read


def cache_row_bytes(dtype: str, hd: int) -> int:
    """Bytes of one head's row of a KV cache: q8_0 / q4_0 rows are whole 34 / 18-byte blocks."""
    return {"f32": hd * 4, "f16": hd * 2}.get(dtype) or hd // QK * BLOCK_BYTES[dtype]


def store_cache_row(kb: KernelBuilder, row: ir.Value, cache: ir.Value, slot: ir.Value, kh: ir.Value,
                    kvh: int, hd: int, dtype: str) -> None:
    """cache[slot, kh, :] = row (f32[hd]), converted to the cache dtype."""
    b, vw = kb.b, kb.vw
    rb = cache_row_bytes(dtype, hd)
    base = kb.idx((slot, kvh * rb), (kh, rb))
    if dtype in ("f32", "f16"):
        def store(j: ir.Value, lanes: int) -> None:
            kb.store_floats(dtype, kb.load(vec(F32, lanes), row, b.mul(j, kb.i64(4))), kb.at(cache, base), j)
        kb.for_chunks(hd, store)
        return
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {dtype} has no CPU kernel ({', '.join(KV_DTYPES)})")
    with kb.loop(0, hd // QK) as blk:
        first = b.mul(blk, kb.i64(QK * 4))
        vals = [kb.load(vec(F32, vw), row, b.add(first, kb.i64(4 * j))) for j in range(0, QK, vw)]
        d, q = quantize_block(kb, vals) if dtype == "q8_0" else quantize_block_q4_0(kb, vals, row, first)
        off = b.add(base, b.mul(blk, kb.i64(BLOCK_BYTES[dtype])))
        kb.store_f16(d, cache, off)
        kb.store(q, cache, b.add(off, kb.i64(2)))


def emit_matmul(kb: KernelBuilder, spec: MatmulSpec) -> None:
    MatmulEmitter(kb, spec).emit()
    kb.finish()


def emit_block_dot_probe(kb: KernelBuilder, wdtype: str, K: int, N: int) -> None:
    """Diagnostic kernel (w[N,K] blocks, xq i8[K] -> isum i32[N, K/32]): each block's integer dot
    product (of q4_1's codes 0..15, for q4_1) through the same instructions the matmul uses, so
    tests can check them exactly."""
    w, xq, out = kb.bufs
    b, nb = kb.b, K // QK
    row_bytes = nb * BLOCK_BYTES[wdtype]
    lo, hi = kb.split(N)
    with kb.loop(lo, hi) as n:
        with kb.loop(0, nb) as blk:
            _, wq = load_weight_block(kb, wdtype, w, n, blk, row_bytes)
            x = kb.load(vec(I8, 32), xq, b.mul(blk, kb.i64(QK)))
            dot = dot_i8x32(kb, wq, x, unsigned_w=wdtype == "q4_1")
            kb.store(kb.hsum(dot), out, b.mul(kb.idx((n, nb), (blk, 1)), kb.i64(4)))
    kb.finish()


def emit_q4_group_probe(kb: KernelBuilder, K: int, N: int, wdtype: str = "q4_0") -> None:
    """Diagnostic kernel (w q4[N,K], xq i8[K] -> isum i32[N, K/32]): each block's integer dot
    product through the grouped path (layout, q4_0's bias, vpdpbusd, a partial last group), so
    tests can check them exactly."""
    w, xq, out = kb.bufs
    b, nb, kg = kb.b, K // QK, padded_k(K)
    xg = kb.var(I8, count=kg)                      # i8[Kg] grouped order
    aux = kb.var(I32, count=kg // 8)               # [Kg/8] q4_0's bias (q4_1's s: unused here)
    dx = kb.var(F32, count=kg // 8)                # f32[Kg/8] (unused here)
    with kb.loop(0, nb) as blk:
        q = kb.load(vec(I8, 32), xq, b.mul(blk, kb.i64(QK)))
        store_q4_group_activation(kb, wdtype, q, kb.f32(1.0), kb.f32(0.0), blk, kb.i64(0), kg, xg, aux, dx)
    for blk in range(nb, kg // QK):
        store_q4_group_activation(kb, wdtype, ir.Constant(vec(I8, 32), None), kb.f32(0.0), kb.f32(0.0),
                                  kb.i64(blk), kb.i64(0), kg, xg, aux, dx)
    lo_n, hi_n = kb.split(N)
    with kb.loop(lo_n, hi_n) as n:
        def step(g: ir.Value, blocks: int) -> None:
            lo, hi, _, _ = load_q4_group(kb, w, kb.idx((n, nb * BLOCK_BYTES[wdtype]), (g, group_bytes(wdtype))),
                                         wdtype, blocks)
            xo = b.mul(g, kb.i64(GROUP))
            start = (kb.load(vec(I32, 16), aux, b.mul(g, kb.i64(64))) if wdtype != "q4_1"
                     else ir.Constant(vec(I32, 16), None))
            lanes = q4_group_dot(kb, start, lo, hi, kb.load(vec(I8, 64), xg, xo),
                                 kb.load(vec(I8, 64), xg, b.add(xo, kb.i64(64))))
            for blk4 in range(blocks):
                s = kb.hsum(kb.shuffle(lanes, None, range(4 * blk4, 4 * blk4 + 4)))
                kb.store(s, out, b.mul(kb.idx((n, nb), (g, 4), (blk4, 1)), kb.i64(4)))
        with kb.loop(0, K // GROUP) as g:
            step(g, 4)
        if K % GROUP:
            step(kb.i64(K // GROUP), K % GROUP // QK)
    kb.finish()


def emit_q4_quad_probe(kb: KernelBuilder, K: int, N: int, tokens: int) -> None:
    """Diagnostic kernel (w q4_0[N,K], xq i8[tokens,K] -> isum i32[tokens, N, K/32], tokens <= 4):
    each block's integer dot product through AVX2 prefill's quad_dot (the quad layout, q4_0's bias,
    a partial last group), so tests can check them exactly."""
    w, xq, out = kb.bufs
    b, nb, kg = kb.b, K // QK, padded_k(K)
    xg = kb.var(I8, count=tokens * xg_stride(kg, True))   # i8[tokens, Kg] grouped order
    aux = kb.var(I32, count=kg // 8)               # one quad's biases, quad_lane's order
    dx = kb.var(F32, count=kg // 8)                # (unused here)
    for t in range(tokens):
        with kb.loop(0, nb) as blk:
            q = kb.load(vec(I8, 32), xq, kb.idx((t, K), (blk, QK)))
            store_q4_group_activation(kb, "q4_0", q, kb.f32(1.0), None, blk, kb.i64(t), kg, xg, aux, dx, True)
        for blk in range(nb, kg // QK):
            store_q4_group_activation(kb, "q4_0", ir.Constant(vec(I8, 32), None), kb.f32(0.0), None,
                                      kb.i64(blk), kb.i64(t), kg, xg, aux, dx, True)
    lo_n, hi_n = kb.split(N)
    with kb.loop(lo_n, hi_n) as n:
        def step(g: ir.Value, blocks: int) -> None:
            lo, hi, _, _ = load_q4_group(kb, w, kb.idx((n, nb * BLOCK_BYTES["q4_0"]), (g, group_bytes("q4_0"))),
                                         "q4_0", blocks)
            xo = [kb.idx((t, xg_stride(kg, True)), (g, GROUP)) for t in range(tokens)]
            xs = [(kb.load(vec(I8, 64), xg, o), kb.load(vec(I8, 64), xg, b.add(o, kb.i64(64)))) for o in xo]
            bias = kb.load(vec(I32, 16), aux, b.mul(quad_lane(kb, kb.i64(0), g, kg), kb.i64(4)))
            lanes = b.add(quad_dot(kb, lo, hi, xs), bias)
            for t in range(tokens):
                for k in range(blocks):
                    kb.store(b.extract_element(lanes, ir.Constant(I32, 4 * k + t)), out,
                             b.mul(kb.idx((t, N * nb), (n, nb), (g, 4), (k, 1)), kb.i64(4)))
        with kb.loop(0, K // GROUP) as g:
            step(g, 4)
        if K % GROUP:
            step(kb.i64(K // GROUP), K % GROUP // QK)
    kb.finish()


__all__ = ["MatmulSpec", "emit_matmul", "check_matmul", "dot_i8x32", "load_weight_block", "load_block_min",
           "q8_1_sum", "quantize_block", "quantize_block_q4_0", "rope_row", "store_cache_row", "cache_row_bytes", "emit_block_dot_probe",
           "q4_group_ok", "load_q4_group", "q4_group_dot", "store_q4_group_activation", "masked_load",
           "emit_q4_group_probe", "emit_q4_quad_probe", "quad_dot", "scratch_layout", "padded_k", "group_bytes", "KV_DTYPES"]
