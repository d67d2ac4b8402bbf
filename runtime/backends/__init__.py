"""Back ends: one contract (base.py) that cpu, opencl, reference and hybrid implement in full,
opened from typed options (options.py) by open_backend, the library's one way to get one."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Backend
from .options import BACKENDS, BackendOptionError, BackendOptions

if TYPE_CHECKING:
    from ..plan import Plan


def open_backend(plan: Plan, kind: str = "cpu", options: BackendOptions = BackendOptions()) -> Backend:
    """`plan` bound to a back end of `kind`: cpu, opencl, reference (numpy),
    hybrid (cpu and opencl, the KV cache handed over where the schedule switches) or auto (the
    faster side for prefill and for decode, measured once per plan and device)."""
    options.check_for(kind)
    if kind == "reference":
        from .reference import ReferenceBackend
        return ReferenceBackend(plan.graphs())
    if kind == "opencl":
        from .opencl import OpenCLBackend
        return OpenCLBackend(plan, device=options.device)
    if kind == "hybrid":
        from .hybrid import HybridBackend, Schedule
        schedule = Schedule(options.hybrid_start, options.switch_threshold, options.switch_back_at)
        return HybridBackend.load(plan, schedule, options.hybrid_kv, options.threads, options.device)
    if kind == "auto":
        from ..calibrate import auto_backend
        return auto_backend(plan, options.threads, options.device, options.recalibrate)
    from .cpu import CpuBackend
    return CpuBackend(plan, threads=options.threads)


__all__ = ["BACKENDS", "Backend", "BackendOptionError", "BackendOptions", "open_backend"]
