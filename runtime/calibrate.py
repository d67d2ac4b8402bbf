"""--backend auto: which back end prefills and which decodes, from a short measurement on this
machine, cached per plan and device in the user cache dir (next to the built-in plans).

A calibration loads both sides (as --backend hybrid would), and on each times one prefill chunk
of the plan's prefill size and a few decode steps after it (medians over repeats, after a warm-up
step that pays for first-use costs: kernel builds, command-buffer recording). The faster side takes
each phase; when one side takes both, the run is that side alone (a hybrid that never switches,
which still falls back to the CPU if the device fails).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backends.base import Backend
from .backends.cpu import CpuBackend
from .backends.hybrid import HybridBackend, Schedule
from .backends.opencl import OpenCLBackend
from .backends.opencl_device import OpenCLError
from .kv.store import NEVER
from .plan import Plan, cache_dir

PREFILL_REPEATS = 3
DECODE_STEPS = 5
SLOW_S = 1.0          # a warm-up prefill slower than this is timed once more, not PREFILL_REPEATS times


@dataclass(frozen=True)
class Speeds:
    prefill_tok_s: float
    decode_tok_s: float


def calibration_file() -> Path:
    return cache_dir() / "calibration.json"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(plan: Plan, threads: int, opencl: OpenCLBackend) -> str:
    """The plan (its manifest: shapes, dtypes, sizes) and both devices, as the figures depend on them."""
    manifest = json.dumps(plan.manifest, sort_keys=True, default=str)
    plan_id = hashlib.sha256(manifest.encode()).hexdigest()[:16]
    dev = opencl.device
    return (f"plan {plan_id} | cpu {_cpu_name()} x{threads} | opencl {dev.platform.name.strip()}: "
            f"{dev.name.strip()} {dev.driver_version}")


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(hybrid: HybridBackend, side: str) -> Speeds:
    """Prefill and decode speeds of one side of a loaded HybridBackend (its cache is reset after)."""
    be = hybrid.backends[side]
    hybrid.reset()
    hybrid.use(side)
    g = be.graphs["prefill"] if "prefill" in be.graphs else be.graphs["decode"]
    vocab = next(g.values[op.inputs[0]].shape[0] for op in g.ops if op.kind == "embedding")
    n = min(g.T, be.prefill_rows or g.T, hybrid.slots - DECODE_STEPS - 1)   # a step as the engine feeds it
    tokens = np.random.default_rng(0).integers(0, vocab, n + DECODE_STEPS + 1).astype(np.int32)
    phase = g.name
    t0 = time.perf_counter()
    be.run(phase, tokens[:n], 0, 0)                          # warm-up
    slow = time.perf_counter() - t0 > SLOW_S                 # one timed chunk is enough (and all we wait for)
    prefill_s = _median_s(lambda: be.run(phase, tokens[:n], 0, 0), 1 if slow else PREFILL_REPEATS)
    steps = iter(range(n, n + DECODE_STEPS + 1))

    def step() -> None:
        i = next(steps)
        be.run("decode", tokens[i:i + 1], i, i)
    step()                                                   # warm-up
    decode_s = _median_s(step, DECODE_STEPS)
    hybrid.reset()
    return Speeds(n / prefill_s, 1.0 / decode_s)


def calibrate(hybrid: HybridBackend, plan: Plan, threads: int, recalibrate: bool = False) -> tuple[dict[str, Speeds], str]:
    """Speeds of both sides, from the cache file or measured now (and stored); with where they came from."""
    path = calibration_file()
    key = cache_key(plan, threads, hybrid.opencl)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    entry = table.get(key) if not recalibrate else None
    if entry:
        return {side: Speeds(**entry[side]) for side in ("cpu", "opencl")}, f"cached in {path}"
    print("llmrs-run: --backend auto: measuring prefill and decode on cpu and opencl (once per plan and device)",
          file=sys.stderr)
    speeds = {side: measure(hybrid, side) for side in ("cpu", "opencl")}
    table[key] = {side: vars(s) for side, s in speeds.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
        where = f"measured now, cached in {path}"
    except OSError:
        where = "measured now (the cache dir is not writable)"
    return speeds, where


def choose(speeds: dict[str, Speeds]) -> tuple[str, str]:
    """(prefill side, decode side): the faster of each."""
    prefill = max(speeds, key=lambda s: speeds[s].prefill_tok_s)
    decode = max(speeds, key=lambda s: speeds[s].decode_tok_s)
    return prefill, decode


def explain(speeds: dict[str, Speeds], prefill: str, decode: str, where: str) -> str:
    other = lambda s: "opencl" if s == "cpu" else "cpu"  # noqa: E731
    return (f"llmrs-run: --backend auto: prefill on {prefill} ({speeds[prefill].prefill_tok_s:.1f} tok/s; "
            f"{other(prefill)} {speeds[other(prefill)].prefill_tok_s:.1f}), decode on {decode} "
            f"({speeds[decode].decode_tok_s:.1f} tok/s; {other(decode)} {speeds[other(decode)].decode_tok_s:.1f}); "
            f"{where}")


def auto_backend(plan: Plan, threads: int | None, device: int | str | None, recalibrate: bool = False) -> Backend:
    """A HybridBackend whose schedule the calibration chose; the CPU alone where no OpenCL device works."""
    try:
        import pyopencl as cl
        device_errors: tuple[type, ...] = (OpenCLError, cl.Error)
    except ImportError as e:
        print(f"llmrs-run: --backend auto: cpu for prefill and decode (no pyopencl: {e})", file=sys.stderr)
        return CpuBackend(plan, threads=threads)
    try:
        hybrid = HybridBackend.load(plan, Schedule("cpu", NEVER), "auto", threads, device)
    except device_errors as e:
        print(f"llmrs-run: --backend auto: cpu for prefill and decode (OpenCL unusable: "
              f"{' '.join(str(e).split())})", file=sys.stderr)
        return CpuBackend(plan, threads=threads)
    speeds, where = calibrate(hybrid, plan, hybrid.cpu.threads if threads is None else threads, recalibrate)
    prefill, decode = choose(speeds)
    print(explain(speeds, prefill, decode, where), file=sys.stderr)
    schedule = Schedule(prefill, None if prefill != decode else NEVER)
    hybrid.schedule = schedule
    hybrid.reset()                   # the cache now starts on the prefill side
    hybrid.clear_report()
    return hybrid


__all__ = ["Speeds", "auto_backend", "cache_key", "calibrate", "calibration_file", "choose", "explain", "measure"]
