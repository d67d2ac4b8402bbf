"""One LLVM kernel per graph op. Every kernel takes (ptr op.inputs..., ptr op.outputs..., i64 n_tokens,
n_past, start_pos, tid, nth, ptr scratch) and does this thread's share of the op's rows."""
from __future__ import annotations

import math

import llvmlite.ir as ir

from ..rope import rope_inv_freq
from ..ir import QK, Graph, Op
from .llvm_builder import F32, I1, I8, I32, KernelBuilder, LaneSums, tail_widths, vec
from .llvm_matmul import (BLOCK_BYTES, MatmulSpec, cache_row_bytes, check_matmul, emit_matmul,
                          load_block_min, load_weight_block, normalized, prefetch, rms_scale_row,
                          rope_row, store_cache_row)
from .llvm_target import Target


class CodegenError(ValueError):
    """An op the CPU back end cannot compile; the message names the op and what to change."""


def cache_dtype(graph: Graph, name: str) -> str:
    v = graph.values[name]
    return graph.values[v.alias].dtype if v.alias else v.dtype


def op_scratch_bytes(graph: Graph, op: Op) -> int:
    if op.kind in ("matmul", "fused_matmul"):
        return MatmulSpec.of(graph, op).scratch_bytes()
    return 0


def emit_op(module: ir.Module, target: Target, graph: Graph, op: Op, name: str,
            internal: bool = False, shared_work: bool = False) -> ir.Function:
    """The op's kernel; with shared_work it takes a trailing `ptr work` counter (see KernelBuilder)
    and matmuls hand out their rows from it instead of a fixed split."""
    where = f"op {op.name} ({op.kind}) of graph {graph.name}"
    kb = KernelBuilder(module, target, name, len(op.inputs) + len(op.outputs), internal, shared_work)
    if op.kind in ("matmul", "fused_matmul"):
        spec = MatmulSpec.of(graph, op)
        try:
            check_matmul(spec, where)
        except ValueError as e:
            raise CodegenError(str(e)) from None
        emit_matmul(kb, spec)
        return kb.fn
    emitter = _EMITTERS.get(op.kind)
    if emitter is None:
        raise CodegenError(f"{where}: no CPU kernel for this op kind; run the fuse pass or use "
                           "--backend reference")
    emitter(kb, graph, op)
    return kb.finish()


def _shape(graph: Graph, name: str) -> tuple[int, ...]:
    return graph.values[name].shape


def _at_most(kb: KernelBuilder, rows: int) -> ir.Value:
    """n_tokens, but never past a value's `rows` (a step graph's logit rows are fewer than its
    tokens: compiler/codegen/llvm.py)."""
    most = kb.i64(rows)
    return kb.b.select(kb.b.icmp_unsigned(">", kb.n_tokens, most), most, kb.n_tokens)


def _embedding(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    table, tokens, out = kb.bufs
    b, vw = kb.b, kb.vw
    tv = graph.values[op.inputs[0]]
    d = tv.shape[1]
    lo, hi = kb.split(kb.n_tokens)
    with kb.loop(lo, hi) as t:
        tok = b.sext(kb.load(I32, tokens, b.mul(t, kb.i64(4))), ir.IntType(64))
        if tv.dtype in BLOCK_BYTES:
            rb = d // QK * BLOCK_BYTES[tv.dtype]
            with kb.loop(0, d // QK) as blk:
                scale, q = load_weight_block(kb, tv.dtype, table, tok, blk, rb)
                low = load_block_min(kb, table, tok, blk, rb) if tv.dtype == "q4_1" else None
                for j in range(0, QK, vw):
                    part = kb.shuffle(q, None, range(j, j + vw))
                    val = b.fmul(b.sitofp(part, vec(F32, vw)), kb.splat(scale, vw))
                    if low is not None:  # q*d + m as two roundings, as ggml's dequantize_row_q4_1
                        val = b.fadd(val, kb.splat(low, vw))
                    kb.store(val, out, b.mul(kb.idx((t, d), (blk, QK), (j, 1)), kb.i64(4)))
        else:
            with kb.loop(0, d, vw) as k:
                val = kb.load_floats(tv.dtype, table, b.add(b.mul(tok, kb.i64(d)), k), vw)
                kb.store(val, out, b.mul(kb.idx((t, d), (k, 1)), kb.i64(4)))


def _rms_norm(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    """Each run of G values (G = the weight's length) of a row normalised on its own: G == D is
    the usual norm, G == head_dim Qwen3's per-head q/k norms. A work item is one run."""
    x, w, out = kb.bufs
    b = kb.b
    d = _shape(graph, op.inputs[0])[1]
    group = _shape(graph, op.inputs[1])[0]
    wdt = graph.values[op.inputs[1]].dtype
    # runs lie end to end through the rows: run i starts at value i * G (rows capped at the
    # activation's: a step graph's head has fewer rows than the step has tokens)
    rows = _at_most(kb, _shape(graph, op.inputs[0])[0])
    lo, hi = kb.split(rows if group == d else b.mul(rows, kb.i64(d // group)))
    with kb.loop(lo, hi) as t:
        row = b.mul(t, kb.i64(group * 4))
        den = rms_scale_row(kb, x, row, group, float(op.attrs["eps"]))

        def norm_chunk(k: ir.Value, lanes: int) -> None:
            kb.store(normalized(kb, x, row, k, den, w, wdt, lanes), out, b.add(row, b.mul(k, kb.i64(4))))
        kb.for_chunks(group, norm_chunk)


def _elementwise(kind: str):
    def emit(kb: KernelBuilder, graph: Graph, op: Op) -> None:
        b, vw = kb.b, kb.vw
        d = _shape(graph, op.inputs[0])[-1]
        if d % vw:
            raise CodegenError(f"op {op.name} ({kind}): last axis {d} is not a multiple of {vw}")
        rows = _shape(graph, op.inputs[0])[0] if len(_shape(graph, op.inputs[0])) > 1 else 1
        n_rows = kb.n_tokens if rows == graph.T and rows > 1 else kb.i64(rows)
        lo, hi = kb.split(b.mul(n_rows, kb.i64(d // vw)))
        with kb.loop(lo, hi) as i:
            off = b.mul(i, kb.i64(vw * 4))
            args = [kb.load(vec(F32, vw), p, off) for p in kb.bufs[:-1]]
            if kind == "add":
                y = b.fadd(*args)
            elif kind == "mul":
                y = b.fmul(*args)
            elif kind == "silu":
                y = kb.silu(args[0])
            else:
                y = b.fmul(kb.silu(args[0]), args[1])
            kb.store(y, kb.bufs[-1], off)
    return emit


def _argmax(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    x, out = kb.bufs
    b = kb.b
    v = _shape(graph, op.inputs[0])[1]
    rows = _shape(graph, op.inputs[0])[0]
    lo, hi = kb.split(kb.n_tokens if rows == graph.T and rows > 1 else kb.i64(rows))
    with kb.loop(lo, hi) as t:
        row = b.mul(t, kb.i64(v * 4))
        best = kb.var(F32, kb.load(F32, x, row))
        arg = kb.var(ir.IntType(64), kb.i64(0))
        with kb.loop(1, v) as j:
            val = kb.load(F32, x, b.add(row, b.mul(j, kb.i64(4))))
            better = b.fcmp_ordered(">", val, b.load(best))  # strict: the first maximum wins
            b.store(b.select(better, val, b.load(best)), best)
            b.store(b.select(better, j, b.load(arg)), arg)
        kb.store(b.trunc(b.load(arg), I32), out, b.mul(t, kb.i64(4)))


def _slice(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    x, out = kb.bufs
    b = kb.b
    d = _shape(graph, op.inputs[0])[1]
    lo, hi = kb.split(d // kb.vw)
    last = b.sub(kb.n_tokens, kb.i64(1))
    with kb.loop(lo, hi) as i:
        off = b.mul(i, kb.i64(kb.vw * 4))
        kb.store(kb.load(vec(F32, kb.vw), x, b.add(b.mul(last, kb.i64(d * 4)), off)), out, off)


def _step_index(graph: Graph, op: Op, at: int) -> bool:
    """Whether op.inputs[at] is one of a step graph's i32 row indices (compiler/ir.py "Step graphs")."""
    return len(op.inputs) > at and graph.values[op.inputs[at]].dtype == "i32"


def _row_index(kb: KernelBuilder, buf: ir.Value, t: ir.Value) -> ir.Value:
    """i32 entry t of a step graph's row-index input, as i64."""
    return kb.b.sext(kb.load(I32, buf, kb.b.mul(t, kb.i64(4))), ir.IntType(64))


def _called_not_inlined(kb: KernelBuilder) -> None:
    """A step graph's RoPE and KV store run once a layer, unfused: inlined into the step function
    at each of those calls, they doubled LLVM's time for the whole plan (SmolLM2, 30 layers: the
    step function alone 4.1 s); a call costs nothing beside the kernel."""
    kb.fn.attributes.add("noinline")


def _inv_freq_ptr(kb: KernelBuilder, graph: Graph, op: Op) -> tuple[ir.Value, str]:
    """The folded inv_freq input, or a constant table made from the op's RoPE attributes."""
    if len(op.inputs) > 1 and not _step_index(graph, op, 1):
        return kb.bufs[1], "f32"
    a = op.attrs
    table = rope_inv_freq(a["head_dim"], a["theta"], a.get("scaling"))
    name = f"inv_freq.{kb.fn.name}"
    g = ir.GlobalVariable(kb.module, ir.ArrayType(F32, len(table)), name)
    g.linkage, g.global_constant = "internal", True
    g.initializer = ir.Constant(ir.ArrayType(F32, len(table)), [float(f) for f in table])
    return g, "f32"


def _rope(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    x, out = kb.bufs[0], kb.bufs[-1]
    b = kb.b
    h, hd = op.attrs["n_heads"], op.attrs["head_dim"]
    inv, inv_dt = _inv_freq_ptr(kb, graph, op)
    positions = kb.bufs[len(op.inputs) - 1] if _step_index(graph, op, len(op.inputs) - 1) else None
    if positions is not None:
        _called_not_inlined(kb)
    lo, hi = kb.split(b.mul(kb.n_tokens, kb.i64(h)))
    with kb.loop(lo, hi) as i:
        t = b.udiv(i, kb.i64(h))
        pos = b.add(kb.start_pos, t) if positions is None else _row_index(kb, positions, t)
        off = b.mul(i, kb.i64(hd * 4))   # rows of [T, H*hd] are heads laid end to end
        rope_row(kb, kb.at(x, off), kb.at(out, off), pos, inv, inv_dt, hd)


def _kv_store(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    """Row t to cache row n_past + t, or in a step graph to slots[t]; a slot outside the cache
    stores nothing (the back ends refuse such a step before it runs: this keeps the kernel from
    ever writing outside the cache whatever it is given)."""
    src, cache = kb.bufs[0], kb.bufs[1]
    b = kb.b
    S, kvh, hd = _shape(graph, op.inputs[1])
    dt = cache_dtype(graph, op.inputs[1])
    slots = kb.bufs[2] if len(op.inputs) == 3 else None
    if slots is not None:
        _called_not_inlined(kb)
    lo, hi = kb.split(b.mul(kb.n_tokens, kb.i64(kvh)))
    with kb.loop(lo, hi) as i:
        t, kh = b.udiv(i, kb.i64(kvh)), b.urem(i, kb.i64(kvh))
        row = kb.at(src, b.mul(i, kb.i64(hd * 4)))
        if slots is None:
            store_cache_row(kb, row, cache, b.add(kb.n_past, t), kh, kvh, hd, dt)
        else:
            slot = _row_index(kb, slots, t)
            with kb.if_(b.icmp_unsigned("<", slot, kb.i64(S))):
                store_cache_row(kb, row, cache, slot, kh, kvh, hd, dt)


def _gather(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    """y[r] = x[rows[r]] for the first n_tokens rows of y (a step function passes its logit row
    count; at most all of them); an index past x's rows copies row 0 instead of reading outside x."""
    x, rows, out = kb.bufs
    b = kb.b
    T, d = _shape(graph, op.inputs[0])
    lo, hi = kb.split(_at_most(kb, _shape(graph, op.inputs[1])[0]))
    with kb.loop(lo, hi) as r:
        src = _row_index(kb, rows, r)
        src = b.select(b.icmp_unsigned("<", src, kb.i64(T)), src, kb.i64(0))

        def copy(j: ir.Value, lanes: int) -> None:
            val = kb.load(vec(F32, lanes), x, b.mul(b.add(b.mul(src, kb.i64(d)), j), kb.i64(4)))
            kb.store(val, out, b.mul(b.add(b.mul(r, kb.i64(d)), j), kb.i64(4)))
        kb.for_chunks(d, copy)


def load_kv(kb: KernelBuilder, dtype: str, cache: ir.Value, slot: ir.Value, kh: ir.Value,
            kvh: int, hd: int, j: ir.Value, lanes: int | None = None) -> ir.Value:
    """`lanes` (default VW) floats cache[slot, kh, j:j+lanes], dequantized."""
    b, vw = kb.b, lanes or kb.vw
    rb = cache_row_bytes(dtype, hd)
    base = kb.idx((slot, kvh * rb), (kh, rb))
    if dtype in ("f32", "f16"):
        return kb.load_floats(dtype, kb.at(cache, base), j, vw)
    off = b.add(base, b.mul(b.udiv(j, kb.i64(QK)), kb.i64(BLOCK_BYTES[dtype])))
    d = kb.load_f16(cache, off)
    k = b.urem(j, kb.i64(QK))
    if dtype == "q8_0":
        q = kb.load(vec(I8, vw), cache, b.add(b.add(off, kb.i64(2)), k))
    else:   # q4_0: values k..k+vw lie in one half of the block (vw divides 16): low or high nibbles
        qs = kb.load(vec(I8, vw), cache, b.add(b.add(off, kb.i64(2)), b.urem(k, kb.i64(QK // 2))))
        nib = b.select(b.icmp_unsigned("<", k, kb.i64(QK // 2)), b.and_(qs, ir.Constant(vec(I8, vw), [15] * vw)),
                       b.lshr(qs, ir.Constant(vec(I8, vw), [4] * vw)))
        q = b.sub(nib, ir.Constant(vec(I8, vw), [8] * vw))
    return b.fmul(b.sitofp(q, vec(F32, vw)), kb.splat(d, vw))


# how many slots ahead K/V rows are prefetched (Llama-3.2-1B, 1 thread, n_past 900, ms per token:
# no prefetch 32.5, 16 ahead 29.7, 32 ahead 28.9, 48 ahead 28.6)
ATTN_PREFETCH_SLOTS = 32


def head_chunks(hd: int, lanes: int) -> list[tuple[int, int]]:
    """(offset, width) pieces of a head row: `lanes`-wide vectors, then narrower ones for the rest
    (head_dim 100 on AVX2: twelve of 8 and one of 4)."""
    chunks = [(k * lanes, lanes) for k in range(hd // lanes)]
    off = hd - hd % lanes
    for w in tail_widths(hd, lanes):
        chunks.append((off, w))
        off += w
    return chunks


class _CausalSlots:
    """Where row t's keys are in a prefill or decode graph: slots 0 .. n_past + t, in order."""

    def __init__(self, kb: KernelBuilder):
        self.kb = kb

    def row(self, t: ir.Value) -> ir.Value:
        """Entries row t attends (this sets up the row for chunk())."""
        return self.kb.b.add(self.kb.b.add(self.kb.n_past, t), self.kb.i64(1))

    def chunk(self, s0: ir.Value, lanes: int, length: ir.Value) -> list[tuple[ir.Value, ir.Value, ir.Value]]:
        """(slot, live, slot to prefetch) of entries s0 .. s0 + lanes - 1: past `length` an entry
        is not live and reads the chunk's first slot (always written) instead."""
        b, out = self.kb.b, []
        for j in range(lanes):
            slot = b.add(s0, self.kb.i64(j))
            live = b.icmp_signed("<", slot, length)
            out.append((b.select(live, slot, s0), live, b.add(slot, self.kb.i64(ATTN_PREFETCH_SLOTS))))
        return out


class _PagedSlots:
    """Where row t's keys are in a step graph (compiler/ir.py "Step graphs"): logical entry j at
    block_tables[row_seq[t], j // bs] * bs + j % bs. Where bs is a multiple of the chunk (16 and
    L = 8 or 16), a chunk lies in one block: one table lookup a chunk, and the identity table
    costs a load and a multiply-add per chunk over the contiguous kernel. Indices from the step's
    inputs are clamped into range (sequence row, entry count, block id), so no input makes the
    kernel read outside the table or the cache; the back ends refuse such steps before they run."""

    def __init__(self, kb: KernelBuilder, graph: Graph, op: Op):
        self.kb = kb
        self.row_seq, self.ctx_len, self.tables = kb.bufs[3:6]
        self.B, self.M = _shape(graph, op.inputs[5])
        self.bs = op.attrs["block_size"]
        self.n_blocks = _shape(graph, op.inputs[1])[0] // self.bs
        self.table_row: ir.Value | None = None

    def row(self, t: ir.Value) -> ir.Value:
        kb, b = self.kb, self.kb.b
        seq = _row_index(kb, self.row_seq, t)
        seq = b.select(b.icmp_unsigned("<", seq, kb.i64(self.B)), seq, kb.i64(0))
        self.table_row = kb.at(self.tables, b.mul(seq, kb.i64(self.M * 4)))
        length = _row_index(kb, self.ctx_len, t)
        most = kb.i64(self.M * self.bs)
        return b.select(b.icmp_signed(">", length, most), most, length)

    def _first_slot(self, entry: ir.Value) -> ir.Value:
        """Cache slot of logical entry `entry` (< M * bs)."""
        kb, b = self.kb, self.kb.b
        block = _row_index(kb, self.table_row, b.udiv(entry, kb.i64(self.bs)))
        block = b.select(b.icmp_unsigned("<", block, kb.i64(self.n_blocks)), block, kb.i64(0))
        return b.add(b.mul(block, kb.i64(self.bs)), b.urem(entry, kb.i64(self.bs)))

    def _ahead(self, entry: ir.Value) -> ir.Value:
        kb, b = self.kb, self.kb.b
        last = kb.i64(self.M * self.bs - 1)
        at = b.add(entry, kb.i64(ATTN_PREFETCH_SLOTS))
        return self._first_slot(b.select(b.icmp_signed(">", at, last), last, at))

    def chunk(self, s0: ir.Value, lanes: int, length: ir.Value) -> list[tuple[ir.Value, ir.Value, ir.Value]]:
        kb, b, out = self.kb, self.kb.b, []
        whole = self.bs % lanes == 0 and ATTN_PREFETCH_SLOTS % lanes == 0
        if whole:
            base, ahead = self._first_slot(s0), self._ahead(s0)
        for j in range(lanes):
            entry = b.add(s0, kb.i64(j))
            live = b.icmp_signed("<", entry, length)
            if whole:
                slot = b.add(base, kb.i64(j))
                out.append((b.select(live, slot, base), live, b.add(ahead, kb.i64(j))))
            else:
                out.append((self._first_slot(b.select(live, entry, s0)), live, self._ahead(entry)))
        return out


def _attention(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    """Causal GQA with an online softmax. One work item is one token and E query heads of one KV
    group (E = 2 or 3 where the group allows): each K/V vector is loaded and converted once for the E
    heads, whose independent FMA chains keep the core busy. KV slots go in blocks of L (the
    vector width; 16 on AVX-512): L scores per head, one max and one vector exp per block (not
    two scalar exps per slot), and each head's output row stays in registers, as L-wide pieces
    plus narrower ones where L does not divide head_dim. A step graph's attention (attr
    block_size) reads each row's keys through its sequence's block table (_PagedSlots); a row's
    result depends on its own entries only, summed in one order whatever else is in the step."""
    q, k_cache, v_cache = kb.bufs[:3]
    out = kb.bufs[len(op.inputs)]
    b = kb.b
    a = op.attrs
    h, kvh, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    lanes = 16 if kb.target.has("avx512f") and hd % 16 == 0 else kb.vw
    kdt, vdt = cache_dtype(graph, op.inputs[1]), cache_dtype(graph, op.inputs[2])
    group, chunks = h // kvh, head_chunks(hd, lanes)
    # E = 3 for groups of 3 (SmolLM2's 9 heads over 3 KV heads): a K/V vector serves the whole
    # group (8 rows at 700 slots: 11.8 -> 10.7 ms a step). E = 4 with AVX-512 at head_dim <= 64
    # (the 1B's groups of 4): its queries and output rows fill the 32 registers, but each K/V row
    # then comes from DRAM once, not once for each pair of heads (Zen 5, 2 threads, the 1B's
    # decode step after 2000 tokens 21.4 -> 17.6 ms; every head's sums are unchanged, so the bits
    # are; BENCHMARKS.md round 21)
    E = (4 if group % 4 == 0 and lanes == 16 and hd <= 64 else
         2 if group % 2 == 0 else 3 if group % 3 == 0 else 1)
    # head rows of whole vectors: the L slots' dot products are summed across lanes together
    # (LaneSums: hsum's additions, 2 (L - 1) shuffles for L slots where L hsums took L log2 L)
    whole = hd % lanes == 0
    fvec = vec(F32, lanes)
    zeros = {w: ir.Constant(vec(F32, w), [0.0] * w) for _, w in chunks}
    zero = ir.Constant(fvec, [0.0] * lanes)
    acc = [[kb.var(vec(F32, w)) for _, w in chunks] for _ in range(E)]   # E x o[hd]: sum of p * v so far
    m = [kb.var(F32) for _ in range(E)]                                 # largest score so far
    total = [kb.var(F32) for _ in range(E)]                             # sum of exp(score - m) so far

    def splats(x: ir.Value) -> dict[int, ir.Value]:
        return {w: kb.splat(x, w) for w in zeros}

    where = _PagedSlots(kb, graph, op) if "block_size" in a else _CausalSlots(kb)
    lo, hi = kb.split(b.mul(kb.n_tokens, kb.i64(h // E)))
    with kb.loop(lo, hi) as i:
        t, hh = b.udiv(i, kb.i64(h // E)), b.mul(b.urem(i, kb.i64(h // E)), kb.i64(E))
        kh = b.udiv(hh, kb.i64(group))
        row0 = b.add(b.mul(t, kb.i64(h)), hh)                     # q / out row of head hh
        qv = [[kb.load(vec(F32, w), q, kb.idx((row0, hd * 4), (e * hd + off, 4))) for off, w in chunks]
              for e in range(E)]
        for e in range(E):
            for x, (_, w) in zip(acc[e], chunks):
                b.store(zeros[w], x)
            b.store(kb.f32(-math.inf), m[e])
            b.store(kb.f32(0.0), total[e])
        length = where.row(t)
        with kb.loop(0, length, lanes) as s0:
            # past `length` a lane reads a slot that is always written and scores -inf
            slots, lives = [], []
            scores = [ir.Constant(fvec, None) for _ in range(E)]
            sums = [LaneSums(kb) for _ in range(E)] if whole else None
            for j, (slot, live, ahead_slot) in enumerate(where.chunk(s0, lanes, length)):
                # K/V rows of later slots: a head's rows are kvh rows apart, a stride the hardware
                # prefetcher follows poorly, and the caches come from DRAM (the weights stream
                # through the LLC between layers)
                for cache, dt in ((k_cache, kdt), (v_cache, vdt)):
                    rb = cache_row_bytes(dt, hd)
                    ahead = kb.idx((ahead_slot, kvh * rb), (kh, rb))
                    for line in range(0, rb, 64):
                        prefetch(kb, cache, b.add(ahead, kb.i64(line)))
                kv = [load_kv(kb, kdt, k_cache, slot, kh, kvh, hd, kb.i64(off), w) for off, w in chunks]
                lives.append(live)
                for e in range(E):
                    dot = zero
                    for (_, w), qk, kk in zip(chunks, qv[e], kv):
                        if w == lanes:
                            dot = kb.fma(qk, kk, dot)
                    if whole:
                        sums[e].push(dot)
                        continue
                    score = kb.hsum(dot)
                    for (_, w), qk, kk in zip(chunks, qv[e], kv):
                        if w != lanes:
                            score = b.fadd(score, kb.hsum(b.fmul(qk, kk)))
                    sc = b.select(live, b.fmul(score, kb.f32(a["scale"])), kb.f32(-math.inf))
                    scores[e] = b.insert_element(scores[e], sc, ir.Constant(I32, j))
                slots.append(slot)
            if whole:    # each slot's dot summed across its lanes as hsum would, L slots at once
                live_v = ir.Constant(vec(I1, lanes), None)
                for j, live in enumerate(lives):
                    live_v = b.insert_element(live_v, live, ir.Constant(I32, j))
                for e in range(E):
                    sc = b.fmul(sums[e].result(), kb.splat(kb.f32(a["scale"]), lanes))
                    scores[e] = b.select(live_v, sc, kb.splat(kb.f32(-math.inf), lanes))
            ps, o = [], []
            for e in range(E):
                m_old = b.load(m[e])
                m_new = kb.maxnum(m_old, kb.hmax(scores[e]))
                corr = kb.exp(b.fsub(m_old, m_new))
                p = kb.exp(b.fsub(scores[e], kb.splat(m_new, lanes)))
                b.store(m_new, m[e])
                b.store(b.fadd(b.fmul(b.load(total[e]), corr), kb.hsum(p)), total[e])
                corr_v = splats(corr)
                ps.append(p)
                o.append([b.fmul(b.load(x), corr_v[w]) for x, (_, w) in zip(acc[e], chunks)])
            for j, slot in enumerate(slots):
                vv = [load_kv(kb, vdt, v_cache, slot, kh, kvh, hd, kb.i64(off), w) for off, w in chunks]
                for e in range(E):
                    p_j = splats(b.extract_element(ps[e], ir.Constant(I32, j)))
                    o[e] = [kb.fma(p_j[w], vk, ok) for (_, w), vk, ok in zip(chunks, vv, o[e])]
            for e in range(E):
                for x, val in zip(acc[e], o[e]):
                    b.store(val, x)
        for e in range(E):
            inv = splats(b.load(total[e]))
            base = b.mul(b.add(row0, kb.i64(e)), kb.i64(hd * 4))
            for x, (off, w) in zip(acc[e], chunks):
                kb.store(b.fdiv(b.load(x), inv[w]), out, b.add(base, kb.i64(off * 4)))
    # no barrier between: both parts only read q and the caches, and write disjoint outputs
    if len(op.inputs) == 5 and "block_size" not in a:
        _attention_scores(kb, graph, op)
    elif len(op.inputs) == 8:
        _paged_attention_scores(kb, graph, op)


def _score_queries(kb: KernelBuilder, q: ir.Value, t: ir.Value, kh: ir.Value, h: int, group: int, hd: int,
                   lanes: int) -> list[list[ir.Value]]:
    """Row t's queries of KV head kh's `group` query heads, as lanes-wide vectors."""
    b = kb.b
    row0 = b.add(b.mul(t, kb.i64(h)), b.mul(kh, kb.i64(group)))
    return [[kb.load(vec(F32, lanes), q, kb.idx((row0, hd * 4), (g * hd * 4 + k * lanes * 4, 1)))
             for k in range(hd // lanes)] for g in range(group)]


def _head_scores(kb: KernelBuilder, qv: list[list[ir.Value]], kv: list[ir.Value], scale: ir.Value) -> list[ir.Value]:
    """Each query head's q . k * scale, the K row (kv) loaded once for all of them."""
    b = kb.b
    zero = ir.Constant(kv[0].type, [0.0] * kv[0].type.count)
    out = []
    for qg in qv:
        d = kb.fma(qg[0], kv[0], zero)
        for k in range(1, len(kv)):
            d = kb.fma(qg[k], kv[k], d)
        out.append(b.fmul(kb.hsum(d), scale))
    return out


def _softmax_start(kb: KernelBuilder, m: list[ir.Value], total: list[ir.Value]) -> None:
    """Each head's running max (m) and sum of exp(score - max) (total), before a row's first pass."""
    for g in range(len(m)):
        kb.b.store(kb.f32(-math.inf), m[g])
        kb.b.store(kb.f32(0.0), total[g])


def _softmax_add(kb: KernelBuilder, m: list[ir.Value], total: list[ir.Value], vals: list[ir.Value]) -> None:
    """The first pass: a block of each head's scores (-inf past the row) into its m and total."""
    b = kb.b
    for g, x in enumerate(vals):
        m_old = b.load(m[g])
        m_new = kb.maxnum(m_old, kb.hmax(x))
        e = kb.exp(b.fsub(x, kb.splat(m_new, x.type.count)))
        b.store(b.fadd(b.fmul(b.load(total[g]), kb.exp(b.fsub(m_old, m_new))), kb.hsum(e)), total[g])
        b.store(m_new, m[g])


def _summed_weights(kb: KernelBuilder, m: list[ir.Value], total: list[ir.Value], vals: list[ir.Value]) -> ir.Value:
    """A block's softmax weights, summed over the query heads: what the scores add."""
    b = kb.b
    acc = None
    for g, x in enumerate(vals):
        n = x.type.count
        p = b.fdiv(kb.exp(b.fsub(x, kb.splat(b.load(m[g]), n))), kb.splat(b.load(total[g]), n))
        acc = p if acc is None else b.fadd(acc, p)
    return acc


def _score_setup(kb: KernelBuilder, graph: Graph, op: Op, scores_at: int) -> tuple:
    """What both eviction-score emitters start from: (n_heads, n_kv_heads, head_dim, K cache dtype,
    score slots, lanes of a dot-product vector (any head_dim: a power of 2 dividing it), slots a
    block, query heads a KV head, vectors a head row, <block x f32>, scale, and each query head's
    running max and sum of exp(score - max))."""
    a = op.attrs
    h, kvh, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    width = 16 if kb.target.has("avx512f") else kb.vw
    lanes, group = math.gcd(hd, width), h // kvh
    return (h, kvh, hd, cache_dtype(graph, op.inputs[1]), graph.values[op.inputs[scores_at]].shape[1],
            lanes, width, group, hd // lanes, vec(F32, width), kb.f32(a["scale"]),
            [kb.var(F32) for _ in range(group)], [kb.var(F32) for _ in range(group)])


def _attention_scores(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    """Eviction scores (compiler/ir.py, attention): when score_ctl[0] != 0, each row t at slot
    n_past + t >= score_ctl[1] adds softmax(q_t,h . k * scale) over slots [0, n_past + t] to
    scores[kvh, :] for every query head h of the KV head. A work item is one KV head with all its
    query heads and rows, so a thread owns its scores row and adds without atomics. Per row, two
    passes over the slots in blocks of B: the query heads' running maxima and sums (one vector
    exp per block and head), then the weights, summed over the heads, added to the scores B at a
    time (the last partial block one slot at a time, so no store passes the row). Each K vector
    is loaded once for all the group's heads; the dot products are recomputed in the second pass
    (this runs only when a policy asks, and leaves the attention loop above untouched)."""
    q, k_cache, scores, ctl = kb.bufs[0], kb.bufs[1], kb.bufs[3], kb.bufs[4]
    b = kb.b
    h, kvh, hd, kdt, slots, lanes, blk, group, nv, bvec, scale, m, total = _score_setup(kb, graph, op, 3)
    on = b.icmp_signed("!=", kb.load(I32, ctl, 0), ir.Constant(I32, 0))
    with kb.if_(on):
        first = b.sub(b.sext(kb.load(I32, ctl, 4), ir.IntType(64)), kb.n_past)   # first scored row
        t0 = b.select(b.icmp_signed("<", first, kb.i64(0)), kb.i64(0), first)
        lo, hi = kb.split(kvh)
        with kb.loop(lo, hi) as kh:
            with kb.loop(t0, kb.n_tokens) as t:
                length = b.add(b.add(kb.n_past, t), kb.i64(1))
                qv = _score_queries(kb, q, t, kh, h, group, hd, lanes)

                def dots(slot: ir.Value) -> list[ir.Value]:
                    kv = [load_kv(kb, kdt, k_cache, slot, kh, kvh, hd, kb.i64(k * lanes), lanes) for k in range(nv)]
                    return _head_scores(kb, qv, kv, scale)

                def block(s0: ir.Value, masked: bool) -> list[ir.Value]:
                    """Each head's scores of slots s0 .. s0 + B - 1 (-inf past the row's length)."""
                    vals = [ir.Constant(bvec, None) for _ in range(group)]
                    for j in range(blk):
                        slot = b.add(s0, kb.i64(j))
                        live = b.icmp_signed("<", slot, length) if masked else None
                        d = dots(b.select(live, slot, s0) if masked else slot)
                        for g in range(group):
                            x = b.select(live, d[g], kb.f32(-math.inf)) if masked else d[g]
                            vals[g] = b.insert_element(vals[g], x, ir.Constant(I32, j))
                    return vals

                _softmax_start(kb, m, total)
                with kb.loop(0, length, blk) as s0:
                    _softmax_add(kb, m, total, block(s0, masked=True))
                full = b.sub(length, b.urem(length, kb.i64(blk)))
                with kb.loop(0, full, blk) as s0:
                    acc = _summed_weights(kb, m, total, block(s0, masked=False))
                    at = kb.idx((kh, slots * 4), (s0, 4))
                    kb.store(b.fadd(kb.load(bvec, scores, at), acc), scores, at)
                with kb.loop(full, length) as slot:
                    acc = None
                    for g, x in enumerate(dots(slot)):
                        p = b.fdiv(kb.exp(b.fsub(x, b.load(m[g]))), b.load(total[g]))
                        acc = p if acc is None else b.fadd(acc, p)
                    at = kb.idx((kh, slots * 4), (slot, 4))
                    kb.store(b.fadd(kb.load(F32, scores, at), acc), scores, at)



def _paged_attention_scores(kb: KernelBuilder, graph: Graph, op: Op) -> None:
    """A step graph's eviction scores (compiler/ir.py "Step graphs"): each row t whose own KV
    index ctx_len[t] - 1 >= score_from[t] adds the weights of _attention_scores to
    scores[kvh, slot] at the physical slot of each entry it attends (_PagedSlots). A thread owns
    whole KV heads and walks the step's rows in order, so the rows of a sequence add in step order
    and no two threads touch one score. The two passes are _attention_scores', in chunks of B
    entries through the block table; the second adds a chunk's weights one slot at a time."""
    q, k_cache, scores, score_from = kb.bufs[0], kb.bufs[1], kb.bufs[6], kb.bufs[7]
    b = kb.b
    h, kvh, hd, kdt, slots, lanes, blk, group, nv, bvec, scale, m, total = _score_setup(kb, graph, op, 6)
    where = _PagedSlots(kb, graph, op)
    lo, hi = kb.split(kvh)
    with kb.loop(lo, hi) as kh:
        with kb.loop(0, kb.n_tokens) as t:
            length = where.row(t)
            own = b.sub(length, kb.i64(1))
            with kb.if_(b.icmp_signed(">=", own, _row_index(kb, score_from, t))):
                qv = _score_queries(kb, q, t, kh, h, group, hd, lanes)

                def block(s0: ir.Value) -> tuple[list[ir.Value], list]:
                    """Each head's scores of entries s0 .. s0 + B - 1 (-inf past the row's length),
                    and the entries' (slot, live)."""
                    vals = [ir.Constant(bvec, None) for _ in range(group)]
                    chunk = where.chunk(s0, blk, length)
                    for j, (slot, live, _) in enumerate(chunk):
                        kv = [load_kv(kb, kdt, k_cache, slot, kh, kvh, hd, kb.i64(k * lanes), lanes) for k in range(nv)]
                        for g, x in enumerate(_head_scores(kb, qv, kv, scale)):
                            vals[g] = b.insert_element(vals[g], b.select(live, x, kb.f32(-math.inf)),
                                                       ir.Constant(I32, j))
                    return vals, [(slot, live) for slot, live, _ in chunk]

                _softmax_start(kb, m, total)
                with kb.loop(0, length, blk) as s0:
                    _softmax_add(kb, m, total, block(s0)[0])
                with kb.loop(0, length, blk) as s0:
                    vals, chunk = block(s0)
                    acc = _summed_weights(kb, m, total, vals)
                    for j, (slot, live) in enumerate(chunk):
                        add = b.select(live, b.extract_element(acc, ir.Constant(I32, j)), kb.f32(0.0))
                        at = kb.idx((kh, slots * 4), (slot, 4))
                        kb.store(b.fadd(kb.load(F32, scores, at), add), scores, at)


_EMITTERS = {
    "embedding": _embedding,
    "rms_norm": _rms_norm,
    "add": _elementwise("add"),
    "mul": _elementwise("mul"),
    "silu": _elementwise("silu"),
    "silu_mul": _elementwise("silu_mul"),
    "argmax": _argmax,
    "slice": _slice,
    "rope": _rope,
    "kv_store": _kv_store,
    "attention": _attention,
    "gather": _gather,
}
