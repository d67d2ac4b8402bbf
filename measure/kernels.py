"""Every distinct kernel of a plan, run alone on a back end on random inputs and compared with the
interpreter (llama.cpp's test-backend-ops, for one plan): what llmrs-check (check.py) reports and
llmrs-bench's per-kernel timings (bench_kernels.py) run.

A kernel is an op of the prefill or decode graph, deduplicated by kind, shapes, dtypes and
attributes (layer 0's QKV kernel stands for every layer's). One pair is checked as one kernel: a
decode QKV with per-head norms and the attention that reads its q, because OpenCL's decode may
finish q and k in that attention kernel (deferred_pair). For each one a one-op graph is made:
the op's activations become graph inputs filled with random non-zero data, its weights are the
plan's own, its KV caches hold random history with n_past > 0. The error of a back end on a
kernel is max |out - ref| / max |ref| over all the op's outputs (caches compared whole, so a
write outside the step's rows shows too).
"""
from __future__ import annotations

import ctypes
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import numpy as np

from ..compiler import quant
from ..compiler.interpret import OPS, Interpreter, Step
from ..compiler.ir import Graph, Op, storage_shape
from ..runtime.plan import OPENCL_ONLY, Plan

BACKENDS = ("cpu", "opencl")

# max |out - ref| / max |ref| allowed, by what the kernel computes
TOL_FLOAT = 1e-4     # f32/f16/bf16 weights: the same float math in another order
TOL_QUANT = 2e-3     # quantized weights: activations are quantized to Q8_0/Q8_1 as GGML does on every
                     # back end, but a rounding tie resolved differently moves a block one step
TOL_F16_OUT = 1e-3   # an f16 output (KV cache) may round one value to the neighbouring f16
TOL_Q8_OUT = 2e-2    # a q8_0 cache may put one value one quantization step (1/127 of a block) off
TOL_Q4_OUT = 0.13    # a q4_0 cache likewise, a step there being 1/8 of its block's largest value
TOL_F16_ATT = 2e-3   # prefill attention over an f16 cache: NVIDIA's tensor cores take Q (times the
                     # scale) and the softmax weights P rounded to f16 (attention.cl's ATT_MMA_BODY)
TOL_F16_MMA = 1e-3   # prefill matmuls with f16 weights: NVIDIA's tensor cores take x rounded to f16
                     # (matmul.cl's stage_x for the MMA body)

HELP_TOLERANCES = f"""\
error: max |backend - interpreter| / max |interpreter| over a kernel's outputs (dimensionless).
tolerance per kernel, the largest that applies:
  {TOL_FLOAT:.0e}  every kernel (f32/f16/bf16 weights, attention, norms, elementwise)
  {TOL_QUANT:.0e}  matmuls with q4_0/q4_1/q8_0 weights (Q8 activations; a rounding tie may differ)
  {TOL_F16_ATT:.0e}  prefill attention over an f16 KV cache (NVIDIA tensor cores: Q and P in f16)
  {TOL_F16_MMA:.0e}  prefill matmuls with f16 weights (NVIDIA tensor cores: x in f16)
  {TOL_F16_OUT:.0e}  kernels writing an f16 KV cache
  {TOL_Q8_OUT:.0e}  kernels writing a q8_0 KV cache
  {TOL_Q4_OUT:.0e}  kernels writing a q4_0 KV cache
  exact  i32 outputs (argmax): error is the fraction of entries that differ
exit status: 0 every kernel passes, 1 a kernel fails on a back end, 2 bad plan or arguments.
a back end that cannot run here (no OpenCL device, no code for it in the plan) is SKIP, not FAIL.
"""


class Unavailable(Exception):
    """A back end that cannot run on this machine or for this plan; str() says why."""


@dataclass
class Kernel:
    """One distinct kernel of the plan and the one-op graph that runs it alone."""
    name: str            # "k<i>": the one-op graph's name, unique in the check
    phase: str           # the plan graph it comes from
    op: Op               # the first op of the plan with this kernel
    graph: Graph         # one op; activations are inputs, weights the plan's, caches state
    ops: int             # how many ops of the phase it stands for
    label: str           # kind, fusion and dtypes, for the table
    tolerance: float
    before: list[Op] = field(default_factory=list)   # ops the graph runs first, their outputs
                                                     # the op's inputs (deferred_pair)

    @property
    def all_ops(self) -> list[Op]:
        return [*self.before, self.op]


@dataclass
class Case:
    """Random inputs for one kernel and the step they run at."""
    arrays: dict[str, np.ndarray]   # every non-weight input by value name, in storage dtype
    step: Step


@dataclass
class Result:
    kernel: Kernel
    backend: str
    error: float | None      # None when skipped or when the back end raised
    status: str              # PASS | FAIL | SKIP
    note: str = ""


class Runner(Protocol):
    name: str

    def run(self, kernel: Kernel, case: Case) -> dict[str, np.ndarray]:
        """The op's outputs in storage dtype: activations' first rows, caches whole."""


# -- kernels ----------------------------------------------------------------------------------

def _kernel_key(g: Graph, op: Op) -> str:
    def val(n: str) -> tuple:
        v = g.values[n]
        return (v.shape, v.dtype, g.values[v.alias].dtype if v.alias else None, v.kind)
    return json.dumps([g.name, op.kind, g.T, [val(i) for i in op.inputs], [val(o) for o in op.outputs],
                       sorted((k, repr(a)) for k, a in op.attrs.items())])


def _label(g: Graph, op: Op) -> str:
    """kind(fusion) and the input types, 1-D weights (norm weights, inv_freq, biases) left out.
    The fusion names the prologue, the epilogue, Qwen3's per-head q/k norms and a bias."""
    a = op.attrs
    bias = a.get("bias") or (op.kind == "matmul" and len(op.inputs) == 3)
    fusion = "+".join(p for p in (a.get("prologue"), a.get("epilogue"), "qk_norm" if a.get("qk_norm") else None,
                                  "bias" if bias else None) if p)
    kind = f"{op.kind}({fusion})" if fusion else op.kind
    shown = [n for n in op.inputs if g.values[n].kind not in ("param", "const") or len(g.values[n].shape) > 1]
    types = " ".join(f"{g.values[n].dtype}[{','.join(map(str, g.values[n].shape))}]" for n in shown)
    return f"{kind} {types}"


def _tolerance(g: Graph, op: Op) -> float:
    tol = TOL_FLOAT
    if op.kind in ("matmul", "fused_matmul") and g.values[op.inputs[1]].dtype in quant.BLOCK_BYTES:
        tol = max(tol, TOL_QUANT)
    if op.kind == "attention" and g.T > 1 and g.values[op.inputs[1]].dtype == "f16":
        tol = max(tol, TOL_F16_ATT)
    if op.kind in ("matmul", "fused_matmul") and g.T > 1 and g.values[op.inputs[1]].dtype == "f16":
        tol = max(tol, TOL_F16_MMA)
    for o in op.outputs:
        v = g.values[o]
        dtype = g.values[v.alias].dtype if v.alias else v.dtype
        tol = max(tol, {"f16": TOL_F16_OUT, "q8_0": TOL_Q8_OUT, "q4_0": TOL_Q4_OUT}.get(dtype, tol))
    if all(g.values[o].dtype == "i32" for o in op.outputs):
        tol = 0.0
    return tol


def one_op_graph(g: Graph, op: Op, name: str, before: list[Op] | None = None) -> Graph:
    """op alone (after `before`): its activation inputs become graph inputs (written before the
    run), weights keep their plan data, caches are state. With `before`, the values they make
    stay inside; the outputs compared are the op's and the caches they write."""
    one = Graph(name, g.T, meta={})
    ops = [*(before or []), op]
    made: set[str] = set()
    for o in ops:
        for n in o.inputs:
            if n in made or n in one.values:
                continue
            v = g.values[n]
            # a cache written by an earlier op (an alias of a state) is this graph's own state
            kind = v.kind if v.kind in ("param", "const", "state") else "state" if v.alias else "input"
            one.add_value(n, v.shape, v.dtype, kind)
            if kind in ("param", "const"):
                one.weights[n] = g.weights[n]
        for n in o.outputs:
            v = g.values[n]
            one.add_value(n, v.shape, v.dtype, "act", v.alias)
            made.add(n)
        one.ops.append(Op(o.kind, list(o.inputs), list(o.outputs), dict(o.attrs), o.name))
    # no graph inputs: the check writes every activation itself
    one.outputs = [n for o in ops[:-1] for n in o.outputs if g.values[n].alias] + list(op.outputs)
    return one.verify()


def deferred_pair(g: Graph, op: Op) -> Op | None:
    """The fused QKV with per-head norms whose q a decode attention op reads: OpenCL's decode may
    leave the norms, RoPE and the key's store to that attention kernel (compiler/codegen/opencl.py
    _qk_defer), so neither kernel is whole alone and the check runs the two together."""
    if op.kind != "attention" or "block_size" in op.attrs or g.T != 1 or g.name in ("step", "verify"):
        return None
    qkv = next((o for o in g.ops if op.inputs[0] in o.outputs), None)
    if qkv is None or qkv.kind != "fused_matmul" or not qkv.attrs.get("qk_norm"):
        return None
    return qkv


def plan_kernels(graphs: dict[str, Graph]) -> list[Kernel]:
    """The distinct kernels of the plan's graphs, in phase and schedule order."""
    found: dict[str, Kernel] = {}
    for phase, g in graphs.items():
        pairs = {op.name: qkv for op in g.ops if (qkv := deferred_pair(g, op)) is not None}
        paired = {qkv.name for qkv in pairs.values()}
        for op in g.ops:
            if op.name in paired:       # checked with the attention that reads its q
                continue
            before = [pairs[op.name]] if op.name in pairs else []
            key = "".join(_kernel_key(g, o) for o in [*before, op])
            if key in found:
                found[key].ops += 1 + len(before)
                continue
            name = f"k{len(found)}"
            label = " -> ".join(_label(g, o) for o in [*before, op])
            tol = max(_tolerance(g, o) for o in [*before, op])
            found[key] = Kernel(name, phase, op, one_op_graph(g, op, name, before), 1 + len(before), label, tol,
                                before)
    return list(found.values())


# -- inputs and the reference -----------------------------------------------------------------

def to_storage(vals: np.ndarray, dtype: str) -> np.ndarray:
    """float values -> the bytes a value of dtype holds (blocks as uint8, bf16 as uint16)."""
    if dtype in quant.BLOCK_BYTES:
        return quant.quantize(vals, dtype)
    if dtype == "bf16":
        return (vals.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return vals.astype(storage_shape((1,), dtype)[1])


def to_float(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in quant.BLOCK_BYTES:
        return quant.dequantize(arr, dtype).astype(np.float64)
    if dtype == "bf16":
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(arr, np.float64)


def _nonzero_normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    x[np.abs(x) < 1e-3] = 0.5   # never zero: a kernel that skips a term must show
    return x


def _step_index(g: Graph, op: Op, name: str, n_tokens: int, rng: np.random.Generator) -> np.ndarray | None:
    """A step graph's row indices (compiler/ir.py "Step graphs") that the op reads as `name`, valid
    as the runtime would give them: distinct KV slots, sequences and blocks inside the table and
    the cache, logit rows among the step's; None for any other input."""
    i, shape = op.inputs.index(name), g.values[name].shape
    if op.kind == "kv_store" and i == 2:
        return rng.permutation(g.values[op.inputs[1]].shape[0])[:shape[0]].astype(np.int32)
    if op.kind == "fused_matmul" and op.attrs.get("step_rows") and name == op.inputs[-1 - bool(op.attrs.get("bias"))]:
        cache = g.values[g.values[op.outputs[1]].alias]             # the slots of the fused QKV
        return rng.permutation(cache.shape[0])[:shape[0]].astype(np.int32)
    if op.kind == "gather" and i == 1:
        return rng.integers(0, n_tokens, shape).astype(np.int32)
    if op.kind == "attention" and "block_size" in op.attrs and i >= 3:
        seqs, per_seq = g.values[op.inputs[5]].shape                # block_tables [B, M]
        slots, bs = g.values[op.inputs[1]].shape[0], op.attrs["block_size"]
        if i == 6:
            return None                                             # the scores state
        if i == 5:      # a sequence's blocks are its own: distinct within its table
            return np.stack([rng.permutation(slots // bs)[:per_seq] for _ in range(seqs)]).astype(np.int32)
        # score_from (7): a row scores from a random KV index on
        low, high = {3: (0, seqs), 4: (1, per_seq * bs + 1), 5: (0, slots // bs), 7: (0, per_seq * bs)}[i]
        return rng.integers(low, high, shape).astype(np.int32)
    return None


def _one_scoring_sequence(op: Op, arrays: dict[str, np.ndarray]) -> None:
    """Only the first row's sequence scores: random tables share blocks between sequences, which
    the runtime's never do under a scoring policy, and two sequences adding to one slot race."""
    row_seq, score_from = arrays[op.inputs[3]], arrays[op.inputs[7]]
    score_from[row_seq != row_seq[0]] = np.iinfo(np.int32).max


def make_case(kernel: Kernel, rng: np.random.Generator) -> Case:
    """A partial step (n_tokens < T where T > 1) after real cache history (n_past > 0), with
    start_pos ahead of n_past so a kernel that confuses the two is caught."""
    g, op = kernel.graph, kernel.op
    n_tokens = g.T - 1 if g.T > 2 else g.T
    seq = g.kv_slots or n_tokens + 7
    n_tokens = min(n_tokens, seq)
    n_past = max(0, min(7, seq - n_tokens))
    arrays: dict[str, np.ndarray] = {}
    made = {n for o in kernel.before for n in o.outputs}
    for reader, n in ((o, n) for o in kernel.all_ops for n in o.inputs):
        v = g.values[n]
        if v.kind in ("param", "const") or n in made or n in arrays:
            continue
        step_index = _step_index(g, reader, n, n_tokens, rng)
        if step_index is not None:
            arrays[n] = step_index
        elif v.kind == "state" and v.dtype == "i32":  # attention's score control: on from the 2nd row
            arrays[n] = np.array([1, n_past + 1], np.int32)
        elif v.dtype == "i32":  # token ids: rows of the embedding table
            arrays[n] = rng.integers(0, g.values[reader.inputs[0]].shape[0], v.shape).astype(np.int32)
        else:
            arrays[n] = to_storage(_nonzero_normal(rng, v.shape), v.dtype)
    if op.kind == "attention" and "block_size" in op.attrs and len(op.inputs) == 8:
        _one_scoring_sequence(op, arrays)
    return Case(arrays, Step(n_tokens, n_past, n_past + 3))


def _rows(g: Graph, name: str, step: Step) -> int | None:
    """Rows of a value that the step defines: n_tokens for [T, ...] activations, else all."""
    v = g.values[name]
    return step.n_tokens if v.kind != "state" and not v.alias and v.shape[0] == g.T else None


def reference(kernel: Kernel, case: Case) -> dict[str, np.ndarray]:
    """The interpreter's outputs in storage dtype (caches: the whole updated cache)."""
    g = kernel.graph
    it = Interpreter(g)
    vals: dict[str, np.ndarray] = {}
    for op in kernel.all_ops:
        args = [it.raw(n) if g.values[n].kind in ("param", "const") else vals[n] if n in vals
                else case.arrays[n][:_rows(g, n, case.step)].copy() for n in op.inputs]
        vals.update((n, np.asarray(o)) for n, o in zip(op.outputs, OPS[op.kind](it, op, case.step, *args)))
    return {n: vals[n] for n in g.outputs}


def _storage_dtype(g: Graph, name: str) -> str:
    v = g.values[name]
    return g.values[v.alias].dtype if v.alias else v.dtype


def kernel_error(kernel: Kernel, want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> float:
    """max |got - want| / max |want| over the outputs; NaN, inf or a wrong shape count as inf."""
    worst = 0.0
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape:
            return float("inf")
        dtype = _storage_dtype(kernel.graph, name)
        if dtype == "i32":
            worst = max(worst, float(np.mean(g != w)))
            continue
        wf, gf = to_float(w, dtype), to_float(g, dtype)
        if not np.all(np.isfinite(gf)):
            return float("inf")
        scale = float(np.max(np.abs(wf))) or 1.0
        worst = max(worst, float(np.max(np.abs(gf - wf))) / scale)
    return worst


# -- back ends --------------------------------------------------------------------------------

def with_layout(kernel: Kernel) -> Graph:
    from ..runtime.backends.opencl_memory import naive_layout  # plain Python; pyopencl is imported on use only
    if "layout" not in kernel.graph.meta:
        kernel.graph.meta["layout"] = naive_layout({kernel.name: kernel.graph})[kernel.name]
    return kernel.graph


class _OneGraphPlan:
    """What CpuBackend reads from a plan, for one kernel's graph: weights from the real plan."""

    def __init__(self, graph: Graph, plan: Plan):
        self._graph, self._plan = graph, plan

    def graphs(self) -> dict[str, Graph]:
        return {self._graph.name: self._graph}

    def weight(self, name: str) -> np.ndarray:
        return self._plan.weight(name)

    def section(self, name: str) -> memoryview:
        raise KeyError(name)


class CpuRunner:
    """Each kernel JIT-compiled alone by the plan compiler's LLVM codegen for this host (the
    plan's CPU code is one function per step, whose kernels cannot be called one by one), run
    by CpuBackend's memory (arena, weight table, KV, scratch) on `threads` threads."""
    name = "cpu"

    def __init__(self, plan: Plan, threads: int):
        missing = plan.missing_code("cpu")
        if missing:
            raise Unavailable(missing)
        try:
            from ..compiler.codegen.llvm import build_module
            from ..compiler.codegen.llvm_target import host_target
            from ..runtime.backends.cpu import CpuBackend
            from ..runtime.backends.cpu_native import NativeCode
        except ImportError as e:
            raise Unavailable(f"llvmlite is not usable here ({e})") from None
        self.plan, self.threads = plan, threads
        self._build, self._target, self._backend, self._native = build_module, host_target(), CpuBackend, NativeCode

    def run(self, kernel: Kernel, case: Case) -> dict[str, np.ndarray]:
        if kernel.phase in OPENCL_ONLY:
            raise Unavailable(f"the {kernel.phase} graph is OpenCL's alone")
        g = with_layout(kernel)
        code = self._native(str(self._build([g], self._target)))
        be = self._backend(_OneGraphPlan(g, self.plan), threads=self.threads, code=code)
        try:
            return self._run(be, code, kernel, case)
        finally:
            be.close()

    def _run(self, be: Any, code: Any, kernel: Kernel, case: Case) -> dict[str, np.ndarray]:
        g, lay = kernel.graph, kernel.graph.meta["layout"]

        def view(name: str) -> np.ndarray:
            v = g.values[name]
            shape, np_dtype = storage_shape(v.shape, v.dtype)
            region, off = (be.kv, lay["kv"][v.alias or name]) if v.kind == "state" or v.alias \
                else (be.arena, lay["arena"][name])
            return region[off:off + v.nbytes].view(np_dtype).reshape(shape)

        be.arena[:] = 0xFF   # NaN in every f32: an output the kernel never writes shows
        for name, arr in case.arrays.items():
            view(name)[...] = arr
        step = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 5, *[ctypes.c_int64] * 5)(
            code.address(f"llmrs_{g.name}"))
        bases = [a.ctypes.data for a in (be.arena, be.weight_table, be.kv, be.scratch, be.barrier)]
        st = case.step
        team = [threading.Thread(target=step, args=(*bases, st.n_tokens, st.n_past, st.start_pos, t, self.threads))
                for t in range(self.threads)]
        for t in team:
            t.start()
        for t in team:
            t.join()
        return {n: view(n)[:_rows(g, n, st)].copy() for n in g.outputs}


class OpenCLRunner:
    """Each kernel as the plan ships it: its launch from the plan's "opencl" section, bound on
    its own on the chosen device."""
    name = "opencl"

    def __init__(self, plan: Plan, device: int | str | None):
        missing = plan.missing_code("opencl")
        if missing:
            raise Unavailable(missing)
        try:
            from ..runtime.backends.opencl import OpenCLBackend, OpenCLError, list_devices, pick_device
            dev = pick_device(device)
            found = [d for _, d in list_devices()]
        except (ImportError, OpenCLError) as e:
            raise Unavailable(str(e)) from None
        self._backend, self._error = OpenCLBackend, OpenCLError
        self.device = found.index(dev)  # an index: no device probe per kernel
        self.program = json.loads(bytes(plan.section("opencl")).decode())

    def parts(self, kernel: Kernel) -> list[str]:
        """A step graph's row-split matmul runs as two kernels (prompt rows tiled, generated rows
        in the matvec: compiler/codegen/opencl.py ROW_SPLIT), each checked on its own."""
        found = {e.get("part", "") + (f"@{e['rows_from']}" if e.get("rows_from") else "")
                 for e in self.program["graphs"].get(kernel.phase, []) if e["op"] == kernel.op.name}
        return sorted(found) if found - {""} else [""]

    def run(self, kernel: Kernel, case: Case, part: str = "") -> dict[str, np.ndarray]:
        if kernel.phase not in self.program["graphs"]:
            raise Unavailable(f"the plan's OpenCL code has no {kernel.phase} graph")
        g = with_layout(kernel)
        names = [o.name for o in kernel.all_ops]
        # "rest@N": the variant a plan runs from N generated rows a step on (matvec.cl MV_SX), run
        # here on every row of the case, as is its one-token twin
        part, _, rows_from = part.partition("@")
        launches = [{**e, "rows_from": 0, "rows_below": 0} for e in self.program["graphs"].get(kernel.phase, [])
                    if e["op"] in names and e.get("part", "") == part and e.get("rows_from", 0) == int(rows_from or 0)]
        # an attention's scores launch goes along, a matmul's stage_x (its activations prepared
        # once) comes first, and paged attention's tiles kernel follows its rows kernel
        if sum(1 for e in launches if not e.get("scores")
               and e["kernel"] not in ("stage_x", "matvec_stage", "attention_paged_tiles")) != len(names):
            raise self._error(f"the plan's OpenCL launch table has {len(launches)} launches for op(s) "
                              f"{', '.join(names)} of {kernel.phase}; recompile the plan")
        program = {**self.program, "graphs": {g.name: launches}}
        be = self._backend.from_graphs({g.name: g}, program, device=self.device)
        be.scoring = True   # the case's score control decides which rows add scores
        for name in (n for o in kernel.all_ops for n in o.outputs):
            v = g.values[name]
            if not v.alias:
                shape, np_dtype = storage_shape(v.shape, v.dtype)
                be.write_value(g.name, name, np.full(shape, 0xFF, np.uint8).view(np_dtype))
        for name, arr in case.arrays.items():
            be.write_value(g.name, name, arr)
        st = case.step
        be.enqueue(g.name, np.zeros(st.n_tokens, np.int32), st.n_past, st.start_pos,
                   generated=st.n_tokens if part == "rest" else 0)
        be.queue.finish()
        return {n: be.read_value(g.name, n, rows=_rows(g, n, st)) for n in g.outputs}


# -- the check --------------------------------------------------------------------------------

def open_runners(plan: Plan, backends: Iterable[str], threads: int = 2,
                 device: int | str | None = None) -> dict[str, Runner | Unavailable]:
    made: dict[str, Runner | Unavailable] = {}
    for b in backends:
        try:
            made[b] = CpuRunner(plan, threads) if b == "cpu" else OpenCLRunner(plan, device)
        except Unavailable as e:
            made[b] = e
    return made


def check_kernels(kernels: list[Kernel], runners: dict[str, Runner | Unavailable], seed: int = 0,
                  progress: Callable[[int, Kernel], None] | None = None) -> list[Result]:
    """Every kernel on every runner against the interpreter on the same random inputs."""
    results = []
    for i, kernel in enumerate(kernels):
        if progress:
            progress(i, kernel)
        case = make_case(kernel, np.random.default_rng([seed, i]))
        want = reference(kernel, case)
        for name, runner in runners.items():
            if isinstance(runner, Unavailable):
                results.append(Result(kernel, name, None, "SKIP", str(runner)))
                continue
            for part in runner.parts(kernel) if hasattr(runner, "parts") else [""]:
                base, _, rows_from = part.partition("@")
                label = name + {"": "", "lead": " (prompt rows)", "rest": " (generated rows)",
                                "logits": " (logit rows)"}[base] + (f" ({rows_from}+ a step)" if rows_from else "")
                try:
                    got = runner.run(kernel, Case({k: v.copy() for k, v in case.arrays.items()}, case.step),
                                     *([part] if part else []))
                except Unavailable as e:    # this back end runs the plan but not this kernel's graph
                    results.append(Result(kernel, label, None, "SKIP", str(e)))
                    continue
                except Exception as e:  # one broken kernel must not hide the others' results
                    results.append(Result(kernel, label, None, "FAIL",
                                          " ".join(f"{type(e).__name__}: {e}".split())))
                    continue
                err = kernel_error(kernel, want, got)
                results.append(Result(kernel, label, err, "PASS" if err <= kernel.tolerance else "FAIL"))
    return results


def format_table(results: list[Result]) -> str:
    """One row per kernel and back end; errors are relative to the output's scale."""
    head = ("kernel", "phase", "first op (ops)", "backend", "max rel err", "tolerance", "result")
    rows = []
    for r in results:
        k = r.kernel
        err = "-" if r.error is None else "inf" if r.error == float("inf") else f"{r.error:.2e}"
        result = r.status + (f": {r.note}" if r.note else "")
        rows.append((k.label, k.phase, f"{k.op.name} ({k.ops})", r.backend, err, f"{k.tolerance:.0e}", result))
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in [head, *rows]]
    lines.append("max rel err = max |backend - interpreter| / max |interpreter| over the kernel's outputs "
                 "(dimensionless; caches compared whole)")
    return "\n".join(lines)
