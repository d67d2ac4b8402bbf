"""llmrs-run --profile trace.json: where a token's time goes, one slice per kernel per step.

The file is Chrome's trace-event JSON (open it in https://ui.perfetto.dev or chrome://tracing):
each step is a slice named by its phase ("prefill" / "decode") with one child slice per kernel,
named by what the kernel computes and its layer ("rms_norm+matmul+rope_kv_store L3").

Nothing here runs unless asked for: the normal path has no timers at all.
  cpu     the plan's graphs are compiled again (JIT, on load) with clock stamps: the team meets
          at a barrier, then thread 0 reads CLOCK_MONOTONIC, and again after every kernel's
          barrier (which ends a kernel for every thread), so a slice is the kernel's time as the
          step sees it, and the threads' hand-off is the step's time before its first kernel
  opencl  a profiling-enabled queue, an event per launch (pyopencl's enqueue), the device's own
          start and end of each kernel; device time is placed on the host's clock at the step's
          first launch
"""
from __future__ import annotations

import ctypes
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..compiler.outputs import write_output
from ..compiler.ir import Op
from ..runtime.backends.base import Backend

_LAYER = re.compile(r"^l(\d+)\.")


def op_layer(op: Op) -> int | None:
    """The transformer layer an op belongs to, read from its outputs' names (l<i>.*)."""
    for name in op.outputs:
        m = _LAYER.match(name)
        if m:
            return int(m.group(1))
    return None


def kernel_title(op: Op) -> str:
    """What a kernel computes: a fused matmul as prologue+matmul+epilogue, else the op kind."""
    if op.kind == "fused_matmul":
        return "+".join(p for p in (op.attrs.get("prologue"), "matmul", op.attrs.get("epilogue")) if p)
    return op.kind


def slice_name(op: Op) -> str:
    layer = op_layer(op)
    return kernel_title(op) + (f" L{layer}" if layer is not None else "")


@dataclass
class Trace:
    """Chrome trace events, timestamps in microseconds on the host's monotonic clock."""
    meta: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        self.t0_ns = time.perf_counter_ns()

    def us(self, ns: int) -> float:
        return (ns - self.t0_ns) / 1e3

    def add_step(self, phase: str, start_ns: int, end_ns: int, kernels: list[tuple[str, int, int, dict]],
                 args: dict[str, Any]) -> None:
        """A step's slice and its kernels' (name, start ns, end ns, args); the step's slice
        widens to hold every kernel (a device may finish after the host's read returns)."""
        lo = min([start_ns] + [k[1] for k in kernels])
        hi = max([end_ns] + [k[2] for k in kernels])
        self.events.append({"name": phase, "cat": "step", "ph": "X", "pid": 1, "tid": 1, "ts": self.us(lo),
                            "dur": (hi - lo) / 1e3, "args": {"step": self.steps, **args}})
        for name, s, e, kargs in kernels:
            self.events.append({"name": name, "cat": "kernel", "ph": "X", "pid": 1, "tid": 1, "ts": self.us(s),
                                "dur": max(e - s, 0) / 1e3, "args": {"phase": phase, "step": self.steps, **kargs}})
        self.steps += 1

    def write(self, path: Path) -> None:
        head = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "llmrs-run"}},
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1,
                 "args": {"name": f"{self.meta.get('backend', '')} steps"}}]
        write_output(path, json.dumps({"traceEvents": head + self.events, "displayTimeUnit": "ms",
                                       "otherData": self.meta}) + "\n", "--profile")


def _op_args(op: Op) -> dict[str, Any]:
    layer = op_layer(op)
    return {"op": op.name, "kernel": kernel_title(op), **({"layer": layer} if layer is not None else {})}


# -- back ends that time their kernels --------------------------------------------------------

def profiled_cpu(plan: Any, threads: int | None) -> Any:
    """A CpuBackend on instrumented code: take_stamps(phase) after a step gives its clock stamps."""
    from ..compiler.codegen.llvm import build_module
    from ..compiler.codegen.llvm_target import host_target
    from ..runtime.backends.cpu import CpuBackend
    from ..runtime.backends.cpu_native import NativeCode

    missing = plan.missing_code("cpu")
    if missing:
        raise ValueError(f"{plan.path}: {missing}")
    print("llmrs-run: --profile: compiling the plan's CPU code again with clock stamps", file=sys.stderr)
    from ..runtime.plan import cpu_graphs
    graphs = cpu_graphs(plan.graphs())
    code = NativeCode(ir_text=str(build_module(graphs, host_target(), profile=True)))

    class ProfiledCpu(CpuBackend):
        def __init__(self) -> None:
            super().__init__(plan, threads=threads, code=code)
            self._set = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(code.address("llmrs_profile_set"))
            self.stamps = {p: np.zeros(len(g.ops) + 1, np.int64) for p, g in self.graphs.items()}

        # run, run_argmax and their step-graph pair all go through these two
        def _run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
            buf = self.stamps.get(phase)
            if buf is not None:
                buf[:] = 0
                self._set(buf.ctypes.data)
            return super()._run(phase, tokens, n_past, start_pos)

        def _run_step(self, rows: Any) -> np.ndarray:
            buf = self.stamps.get("step")
            if buf is not None:
                buf[:] = 0
                self._set(buf.ctypes.data)
            return super()._run_step(rows)

        def kernel_slices(self, phase: str) -> list[tuple[str, int, int, dict]]:
            g, ns = self.graphs[phase], self.stamps[phase]
            return [(slice_name(op), int(ns[i]), int(ns[i + 1]), _op_args(op)) for i, op in enumerate(g.ops)]

    return ProfiledCpu()


def profiled_opencl(plan: Any, device: Any) -> Any:
    """An OpenCLBackend whose queue has profiling on and whose launches go through pyopencl,
    one event each (no command buffers, no event-free launches: those are what it measures)."""
    import pyopencl as cl

    from ..runtime.backends.opencl import OpenCLBackend

    class ProfiledOpenCL(OpenCLBackend):
        def __init__(self) -> None:
            super().__init__(plan, device=device)
            self.queue.finish()
            self.queue = cl.CommandQueue(self.ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
            self.direct, self.use_command_buffers = None, False
            # inputs and reads through this queue too: left on CUDA's stream (NVIDIA), a step's
            # input writes were not ordered before its launches here, and a kernel read the
            # last step's token ids and positions (or none: an invalid command queue on the H200)
            self._cuda_live = False
            self._events: list[tuple[Any, Any]] = []
            self._who: dict[int, tuple[str | None, str]] = {}
            bound = [b for bs in self.launches.values() for b in bs] + list(self.greedy.values())
            for b in bound:
                self._who[b.kernel.int_ptr] = (b.op, b.kernel.function_name)
            self._ops = {p: {op.name: op for op in g.ops} for p, g in self.graphs.items()}

        def _enqueue_launches(self, key, launches, repeat: int = 1) -> None:
            for _ in range(repeat):
                for kern, gsize, lsize in launches:
                    self._events.append((kern, cl.enqueue_nd_range_kernel(self.queue, kern, gsize, lsize)))

        def kernel_slices(self, phase: str, host_start_ns: int) -> list[tuple[str, int, int, dict]]:
            self.queue.finish()
            events, self._events = self._events, []
            if not events:
                return []
            origin = min(ev.profile.queued for _, ev in events)   # the first launch, on the device's clock
            out = []
            for kern, ev in events:
                op_name, fn = self._who.get(kern.int_ptr, (None, kern.function_name))
                op = self._ops.get(phase, {}).get(op_name)
                name = slice_name(op) if op is not None else fn
                args = {**(_op_args(op) if op is not None else {"op": op_name, "kernel": fn}), "cl_kernel": fn}
                out.append((name, host_start_ns + ev.profile.start - origin,
                            host_start_ns + ev.profile.end - origin, args))
            return out

    return ProfiledOpenCL()


class Profiler(Backend):
    """A profiled back end for the Engine: each step's host time and its kernels' slices go into
    `trace`; everything else is the back end's own."""

    def __init__(self, backend: Any, kind: str, meta: dict[str, Any]):
        self._backend, self._kind = backend, kind
        self.trace = Trace(meta={**meta, "backend": kind})
        self.name, self.device_name, self.graphs = backend.name, backend.device_name, backend.graphs
        self.device_argmax = backend.device_argmax

    def run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        return self._step(self._backend.run, phase, tokens, n_past, start_pos)

    def run_argmax(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        return self._step(self._backend.run_argmax, phase, tokens, n_past, start_pos)

    def run_step(self, rows: Any) -> np.ndarray:
        return self._backend.run_step(rows)

    def reset(self) -> None:
        self._backend.reset()

    def kv_store(self) -> Any:
        return self._backend.kv_store()

    def report_lines(self) -> list[str]:
        return self._backend.report_lines()

    def close(self) -> None:
        self._backend.close()

    def _step(self, fn, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        t0 = time.perf_counter_ns()
        out = fn(phase, tokens, n_past, start_pos)
        t1 = time.perf_counter_ns()
        be = self._backend
        kernels = be.kernel_slices(phase, t0) if self._kind == "opencl" else be.kernel_slices(phase)
        self.trace.add_step(phase, t0, t1, kernels, {"tokens": int(np.size(tokens)), "n_past": int(n_past)})
        return out

    def write(self, path: Path) -> int:
        self.trace.write(path)
        return sum(1 for e in self.trace.events if e["cat"] == "kernel")


def profiling_backend(name: str, plan: Any, threads: int | None, device: Any) -> Profiler:
    if name == "cpu":
        be = profiled_cpu(plan, threads)
    elif name == "opencl":
        be = profiled_opencl(plan, device)
    else:
        raise ValueError(f"--profile times kernels on --backend cpu or opencl, not {name}")
    return Profiler(be, name, {"plan": str(plan.path), "device": be.device_name})


def kernel_totals(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{phase: {kernel title: total us}} over a trace's kernel slices (layers summed): the
    per-kernel breakdown a picture or table shows."""
    out: dict[str, dict[str, float]] = {}
    for e in trace["traceEvents"]:
        if e.get("cat") != "kernel":
            continue
        title = e["args"].get("kernel", e["name"])
        per = out.setdefault(e["args"]["phase"], {})
        per[title] = per.get(title, 0.0) + e["dur"]
    return out
