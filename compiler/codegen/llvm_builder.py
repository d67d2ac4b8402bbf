"""Small helpers over llvmlite.ir for writing kernels: loops, typed loads, vectors, intrinsics."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import llvmlite.ir as ir

from .llvm_target import Target

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()
PTR = ir.PointerType()
VOID = ir.VoidType()

# every kernel: (ptr buffers..., i64 n_tokens, n_past, start_pos, tid, nth, ptr scratch
#                [, ptr work]): `work` (i64, zero on entry, shared by the team) only in kernels built
#                with shared_work=True, i.e. inside a step function, where a barrier resets it
SCALAR_ARGS = ("n_tokens", "n_past", "start_pos", "tid", "nth")


def vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def tail_widths(n: int, width: int) -> list[int]:
    """Vector widths, halving from width / 2, that together cover the n % width values a loop
    of `width`-wide steps leaves over (binary digits of the remainder, largest first)."""
    rest, w, out = n % width, width // 2, []
    while rest:
        if w <= rest:
            out.append(w)
            rest -= w
        else:
            w //= 2
    return out


def _type_name(t: ir.Type) -> str:
    if isinstance(t, ir.VectorType):
        return f"v{t.count}{_type_name(t.element)}"
    return {id(F32): "f32", id(F16): "f16"}.get(id(t), str(t))


# the thread team's barrier block (compiler/codegen/llvm.py, u32[64]): byte offsets of the shared
# work counter, and of the team's scratch base (thread 0's scratch) for kernels whose threads
# prepare one input together (llvm_matmul's prefill)
WORK_OFFSET = 128
SCRATCH_BASE_OFFSET = 192


class KernelBuilder:
    """One kernel function under construction: its builder, arguments and target."""

    def __init__(self, module: ir.Module, target: Target, name: str, n_buffers: int,
                 internal: bool = False, shared_work: bool = False):
        self.module = module
        self.target = target
        self.vw = target.float_lanes
        trailing = [PTR, PTR] if shared_work else [PTR]          # scratch [, work]
        fnty = ir.FunctionType(VOID, [PTR] * n_buffers + [I64] * len(SCALAR_ARGS) + trailing)
        self.fn = ir.Function(module, fnty, name)
        if internal:
            self.fn.linkage = "internal"
        self.fn.attributes.add("nounwind")
        args = list(self.fn.args)
        self.bufs = args[:n_buffers]  # no `noalias`: an epilogue may write in place over its residual
        s = args[n_buffers:n_buffers + len(SCALAR_ARGS)]
        self.n_tokens, self.n_past, self.start_pos, self.tid, self.nth = s
        self.scratch = args[n_buffers + len(SCALAR_ARGS)]
        self.work = args[-1] if shared_work else None
        self.entry = self.fn.append_basic_block("entry")
        self.b = ir.IRBuilder(self.entry)

    def finish(self) -> ir.Function:
        self.b.ret_void()
        return self.fn

    # -- constants and variables ----------------------------------------------------------------
    @staticmethod
    def i64(v: int) -> ir.Constant:
        return ir.Constant(I64, int(v))

    @staticmethod
    def f32(v: float) -> ir.Constant:
        return ir.Constant(F32, float(v))

    def var(self, ty: ir.Type, init: ir.Value | None = None, count: int | None = None) -> ir.Value:
        """A stack slot made in the entry block, so LLVM promotes it to registers."""
        with self.b.goto_entry_block():
            if self.entry.instructions:
                self.b.position_before(self.entry.instructions[0])
            slot = self.b.alloca(ty, size=None if count is None else self.i64(count))
        if init is not None:
            self.b.store(init, slot)
        if count is None:
            return slot
        # arrays are addressed bytewise through at(); llvmlite types an alloca's pointer and would
        # refuse vector stores into it, so hand out an untyped `ptr` to the same slot
        with self.b.goto_entry_block():
            self.b.position_after(slot)
            return self.b.inttoptr(self.b.ptrtoint(slot, I64), PTR)

    # -- control flow --------------------------------------------------------------------------
    @contextmanager
    def loop(self, start: ir.Value | int, stop: ir.Value | int, step: int = 1) -> Iterator[ir.Value]:
        b = self.b
        start = self.i64(start) if isinstance(start, int) else start
        stop = self.i64(stop) if isinstance(stop, int) else stop
        pre = b.block
        cond = b.append_basic_block("loop")
        body = b.append_basic_block("body")
        end = b.append_basic_block("endloop")
        b.branch(cond)
        b.position_at_end(cond)
        i = b.phi(I64)
        i.add_incoming(start, pre)
        b.cbranch(b.icmp_signed("<", i, stop), body, end)
        b.position_at_end(body)
        yield i
        nxt = b.add(i, self.i64(step))
        i.add_incoming(nxt, b.block)
        b.branch(cond)
        b.position_at_end(end)

    def for_chunks(self, n: int, body: Callable[[ir.Value, int], None], width: int | None = None) -> None:
        """body(index, lanes) over [0, n): a loop of `width`-lane steps (default VW), then the rest
        in narrower vectors, unrolled, so a row length need not be a multiple of the vector width
        (head_dim 100 on AVX2). Where it is, this is the plain loop alone."""
        w = width or self.vw
        main = n - n % w
        if main:
            with self.loop(0, main, w) as j:
                body(j, w)
        for lanes in tail_widths(n, w):
            body(self.i64(main), lanes)
            main += lanes

    @contextmanager
    def if_(self, cond: ir.Value) -> Iterator[None]:
        with self.b.if_then(cond):
            yield

    def split(self, units: ir.Value | int) -> tuple[ir.Value, ir.Value]:
        """This thread's share [lo, hi) of `units` work items, contiguous, sizes within one."""
        b = self.b
        u = self.i64(units) if isinstance(units, int) else units
        lo = b.udiv(b.mul(u, self.tid), self.nth)
        hi = b.udiv(b.mul(u, b.add(self.tid, self.i64(1))), self.nth)
        return lo, hi

    @contextmanager
    def shared_loop(self, units: ir.Value | int, grain: int) -> Iterator[ir.Value]:
        """Every u in [0, units) once across the team. Without a shared work counter: split().
        With one, the first 7/8 of the units are split as split() does (each thread streams one
        contiguous run of weight rows, which DRAM and the prefetchers like best), and the last
        1/8 is handed out `grain` units at a time from the counter, so a thread that falls behind
        (a busy core, a late wake-up) is covered by the others instead of holding up the barrier."""
        if self.work is None:
            lo, hi = self.split(units)
            with self.loop(lo, hi) as u:
                yield u
            return
        b = self.b
        u_end = self.i64(units) if isinstance(units, int) else units
        fixed = b.sub(u_end, b.udiv(u_end, self.i64(8)))
        lo = b.udiv(b.mul(fixed, self.tid), self.nth)
        hi = b.udiv(b.mul(fixed, b.add(self.tid, self.i64(1))), self.nth)
        pre = b.block
        body = b.append_basic_block("share")
        grab = b.append_basic_block("grab")
        after = b.append_basic_block("grabbed")
        b.branch(body)
        # one loop over [lo, hi): first this thread's fixed run, then each grain it grabs
        b.position_at_end(body)
        u = b.phi(I64)
        end = b.phi(I64)
        u.add_incoming(lo, pre)
        end.add_incoming(hi, pre)
        run = b.append_basic_block("run")
        b.cbranch(b.icmp_signed("<", u, end), run, grab)
        b.position_at_end(grab)
        g_lo = b.add(fixed, b.atomic_rmw("add", self.work, self.i64(grain), "monotonic"))
        g_hi = b.add(g_lo, self.i64(grain))
        g_hi = b.select(b.icmp_signed("<", g_hi, u_end), g_hi, u_end)
        u.add_incoming(g_lo, grab)
        end.add_incoming(g_hi, grab)
        b.cbranch(b.icmp_signed("<", g_lo, u_end), body, after)
        b.position_at_end(run)
        yield u
        u.add_incoming(b.add(u, self.i64(1)), b.block)
        end.add_incoming(end, b.block)
        b.branch(body)
        b.position_at_end(after)

    # -- memory --------------------------------------------------------------------------------
    def team_barrier(self) -> None:
        """Wait for the whole team inside a kernel (only with a shared work counter: in a step
        function, where every thread runs every kernel); the barrier also zeroes the counter."""
        bar = self.b.gep(self.work, [self.i64(-WORK_OFFSET)], source_etype=I8)
        self.b.call(self.module.globals["llmrs_barrier"], [bar, self.nth])

    def at(self, ptr: ir.Value, byte_offset: ir.Value | int) -> ir.Value:
        off = self.i64(byte_offset) if isinstance(byte_offset, int) else byte_offset
        return self.b.gep(ptr, [off], inbounds=True, source_etype=I8)

    def load(self, ty: ir.Type, ptr: ir.Value, byte_offset: ir.Value | int = 0) -> ir.Value:
        return self.b.load(self.at(ptr, byte_offset), typ=ty, align=1)

    def store(self, val: ir.Value, ptr: ir.Value, byte_offset: ir.Value | int = 0) -> None:
        self.b.store(val, self.at(ptr, byte_offset), align=1)

    def idx(self, *terms: tuple[ir.Value | int, int]) -> ir.Value:
        """sum of value * constant: byte offsets from indices and strides."""
        b = self.b
        acc: ir.Value = self.i64(0)
        for v, k in terms:
            v = self.i64(v) if isinstance(v, int) else v
            acc = b.add(acc, v if k == 1 else b.mul(v, self.i64(k)))
        return acc

    def load_floats(self, dtype: str, ptr: ir.Value, elem_index: ir.Value, n: int) -> ir.Value:
        """n consecutive elements of an f32/f16/bf16 array as <n x float>."""
        b = self.b
        if dtype == "f32":
            return self.load(vec(F32, n), ptr, b.mul(elem_index, self.i64(4)))
        raw = self.load(vec(I16, n), ptr, b.mul(elem_index, self.i64(2)))
        if dtype == "f16":
            return b.fpext(b.bitcast(raw, vec(F16, n)), vec(F32, n))
        if dtype == "bf16":
            return b.bitcast(b.shl(b.zext(raw, vec(I32, n)), self.splat(ir.Constant(I32, 16), n)), vec(F32, n))
        raise ValueError(f"no float load for dtype {dtype!r}")

    def store_floats(self, dtype: str, val: ir.Value, ptr: ir.Value, elem_index: ir.Value) -> None:
        b = self.b
        n = val.type.count
        if dtype == "f32":
            self.store(val, ptr, b.mul(elem_index, self.i64(4)))
        elif dtype == "f16":
            self.store(b.fptrunc(val, vec(F16, n)), ptr, b.mul(elem_index, self.i64(2)))
        else:
            raise ValueError(f"no float store for dtype {dtype!r}")

    # -- vectors -------------------------------------------------------------------------------
    def splat(self, x: ir.Value, n: int) -> ir.Value:
        b = self.b
        v = b.insert_element(ir.Constant(vec(x.type, n), None), x, ir.Constant(I32, 0))
        return b.shuffle_vector(v, ir.Constant(vec(x.type, n), None), ir.Constant(vec(I32, n), [0] * n))

    def shuffle(self, a: ir.Value, b_: ir.Value | None, mask: Sequence[int]) -> ir.Value:
        other = b_ if b_ is not None else ir.Constant(a.type, None)
        return self.b.shuffle_vector(a, other, ir.Constant(vec(I32, len(mask)), list(mask)))

    def halves(self, v: ir.Value) -> tuple[ir.Value, ir.Value]:
        n = v.type.count // 2
        return self.shuffle(v, None, range(n)), self.shuffle(v, None, range(n, 2 * n))

    def concat(self, a: ir.Value, c: ir.Value) -> ir.Value:
        return self.shuffle(a, c, range(2 * a.type.count))

    def hsum(self, v: ir.Value) -> ir.Value:
        """Pairwise tree sum of a vector's lanes (fixed order, so every run rounds alike)."""
        b = self.b
        while v.type.count > 1:
            lo, hi = self.halves(v)
            v = b.fadd(lo, hi) if isinstance(v.type.element, ir.FloatType) else b.add(lo, hi)
        return b.extract_element(v, ir.Constant(I32, 0))

    def hmax(self, v: ir.Value) -> ir.Value:
        while v.type.count > 1:
            lo, hi = self.halves(v)
            v = self.maxnum(lo, hi)
        return self.b.extract_element(v, ir.Constant(I32, 0))

    # -- intrinsics ----------------------------------------------------------------------------
    def intrinsic(self, name: str, ret: ir.Type, args: Sequence[ir.Type]) -> ir.Function:
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ret, list(args)), name)
        return fn

    def call_math(self, base: str, *xs: ir.Value) -> ir.Value:
        t = xs[0].type
        fn = self.intrinsic(f"llvm.{base}.{_type_name(t)}", t, [x.type for x in xs])
        return self.b.call(fn, list(xs))

    def maxnum(self, a: ir.Value, c: ir.Value) -> ir.Value:
        return self.call_math("maxnum", a, c)

    def fabs(self, a: ir.Value) -> ir.Value:
        return self.call_math("fabs", a)

    def sqrt(self, a: ir.Value) -> ir.Value:
        return self.call_math("sqrt", a)

    def exp(self, a: ir.Value) -> ir.Value:
        """e^a inline (no libm call, so loops over it vectorise): a = n ln2 + r, |r| <= ln2/2,
        e^r by its Taylor series to r^7 (error < 1e-8 relative), times 2^n built in the exponent
        bits. Below -87.3 the result is 0 and above 88.3 it is e^88.3 (the callers' arguments are
        softmax logits minus their max, and SiLU's -x, where either end rounds the same)."""
        b = self.b
        n_lanes = a.type.count if isinstance(a.type, ir.VectorType) else None
        c = (lambda v: self.f32(v)) if n_lanes is None else (lambda v: self.splat(self.f32(v), n_lanes))  # noqa: E731
        ity = I32 if n_lanes is None else vec(I32, n_lanes)
        ci = (lambda v: ir.Constant(I32, v)) if n_lanes is None else (lambda v: ir.Constant(ity, [v] * n_lanes))  # noqa: E731
        x = self.call_math("minnum", self.maxnum(a, c(-87.3)), c(88.3))
        n = self.call_math("rint", b.fmul(x, c(1.4426950408889634)))
        r = self.fma(n, c(-0.693145751953125), x)              # ln2 in two parts: exact n * hi
        r = self.fma(n, c(-1.428606765330187e-06), r)
        p = c(1.0 / 5040)
        for k in (720, 120, 24, 6, 2, 1, 1):
            p = self.fma(p, r, c(1.0 / k))
        scale = b.bitcast(b.shl(b.add(b.fptosi(n, ity), ci(127)), ci(23)), a.type)
        y = b.fmul(p, scale)
        return b.select(b.fcmp_ordered("<", a, c(-87.3)), c(0.0), y)

    def round_away(self, a: ir.Value) -> ir.Value:
        return self.call_math("round", a)   # half away from zero, as C's roundf

    def fma(self, a: ir.Value, c: ir.Value, d: ir.Value) -> ir.Value:
        return self.call_math("fma", a, c, d)

    def to_f16_and_back(self, x: ir.Value) -> ir.Value:
        return self.b.fpext(self.b.fptrunc(x, F16), F32)

    def load_f16(self, ptr: ir.Value, byte_offset: ir.Value | int) -> ir.Value:
        return self.b.fpext(self.b.bitcast(self.load(I16, ptr, byte_offset), F16), F32)

    def store_f16(self, x: ir.Value, ptr: ir.Value, byte_offset: ir.Value | int) -> None:
        self.store(self.b.bitcast(self.b.fptrunc(x, F16), I16), ptr, byte_offset)

    def silu(self, x: ir.Value) -> ir.Value:
        """x / (1 + exp(-x)), operation for operation as the interpreter."""
        b = self.b
        one = self.f32(1.0) if x.type == F32 else self.splat(self.f32(1.0), x.type.count)
        return b.fdiv(x, b.fadd(one, self.exp(b.fneg(x))))


class LaneSums:
    """hsum of n vectors of n lanes into one vector, pushed one at a time, so at most log2(n) + 1
    partial vectors are live (a kernel can push each as soon as it is made). A partial vector of
    level l holds 2^l sums in progress, n / 2^l lanes each; two of one level make one of the next
    by adding each sum's low half to its high half, as hsum does to one vector: every lane sees
    hsum's additions in hsum's order, and n vectors cost 2(n - 1) shuffles and n - 1 adds instead
    of n hsums' n log2(n) of each."""

    def __init__(self, kb: KernelBuilder):
        self.kb = kb
        self.stack: list[tuple[int, ir.Value]] = []     # (level, partial vector), levels decreasing

    def push(self, v: ir.Value) -> None:
        level = 0
        while self.stack and self.stack[-1][0] == level:
            _, a = self.stack.pop()
            v = self._join(a, v, level)
            level += 1
        self.stack.append((level, v))

    def _join(self, a: ir.Value, c: ir.Value, level: int) -> ir.Value:
        n = a.type.count
        w = n >> level                                  # lanes a sum in progress takes now
        lows = [r * w + i for r in range(1 << level) for i in range(w // 2)]
        lo = lows + [n + j for j in lows]
        hi = [j + w // 2 for j in lo]
        return self.kb.b.fadd(self.kb.shuffle(a, c, lo), self.kb.shuffle(a, c, hi))

    def result(self) -> ir.Value:
        (level, v), = self.stack                        # n pushes of n lanes: one vector of n sums
        assert 1 << level == v.type.count, "LaneSums: push exactly as many vectors as they have lanes"
        return v
