"""Hybrid back end: one plan on the CPU and on an OpenCL device at once, each step run on the side
the schedule names, the KV cache handed over at a switch.

Both sides load the plan's weights at once, so a switch moves only the KV cache, and of it only the
live slots: the engine's n_past per layer and KV head (the eviction manager keeps every head at the
same count, so the live rows of a state are its first n_past slots, one contiguous block). Two ways
to hand it over (--hybrid-kv):

    map   the OpenCL KV buffers are made over the CPU back end's KV memory (CL_MEM_USE_HOST_PTR):
          while the CPU runs they are mapped, while the device runs unmapped; a switch is a map or an
          unmap, no bytes copied by us. For devices that share memory with the host (phones' GPUs,
          PoCL): CL_DEVICE_HOST_UNIFIED_MEMORY, or a CPU device.
    copy  separate memory on each side; a switch copies each state's live rows (K and V, and the
          live attention scores when an eviction policy keeps them) and zeroes the score tail on
          the other side. For discrete GPUs.

Activations need nothing: every step writes its own tokens and reads its logits back, and each
side keeps its own arena (the OpenCL one already CL_MEM_ALLOC_HOST_PTR).

Schedule (positions are RoPE positions, the engine's start_pos, which carries across switches):
the start side runs positions below --switch-threshold and the other side the rest; with no
threshold, prefill steps run on the start side and decode steps on the other (CPU prefill, GPU
decode). At --switch-back-at the start side takes over again. A prefill step that a switch
position cuts is run as two chunks, one per side. An OpenCL error mid-generation moves the cache to
the CPU (or, when the device cannot give it back, refills it from the tokens fed) and every later
step runs there.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..kv.store import NEVER
from .base import Backend, StepRows
from .cpu import CpuBackend
from .opencl import OpenCLBackend
from .opencl_device import OpenCLError, pick_device
from .options import KV_MODES, SIDES


class HybridError(ValueError):
    """A hybrid setting or situation that cannot work; one line, names the flag."""


def _other(side: str) -> str:
    return "opencl" if side == "cpu" else "cpu"


def _device_errors() -> tuple[type, ...]:
    try:
        import pyopencl as cl
        return (OpenCLError, cl.Error)
    except ImportError:
        return (OpenCLError,)


def shares_host_memory(device: Any) -> bool:
    """Whether the device reads host memory directly (a unified-memory GPU, or a CPU device such
    as PoCL), so that a mapped buffer costs no transfer."""
    import pyopencl as cl
    if device.type & cl.device_type.CPU:
        return True
    try:
        return bool(device.host_unified_memory)   # CL_DEVICE_HOST_UNIFIED_MEMORY (deprecated in 2.0, still answered)
    except Exception:   # a driver that no longer answers the query: treat as discrete
        return False


@dataclass(frozen=True)
class Schedule:
    start: str = "cpu"
    threshold: int | None = None      # None: prefill on start, decode on the other side
    back_at: int | None = None

    def check(self) -> "Schedule":
        if self.start not in SIDES:
            raise HybridError(f"--hybrid-start {self.start!r}: choose cpu or opencl")
        if self.threshold is not None and self.threshold < 0:
            raise HybridError(f"--switch-threshold must be 0 or more, got {self.threshold}")
        if self.back_at is not None:
            if self.back_at < 1:
                raise HybridError(f"--switch-back-at must be at least 1, got {self.back_at}")
            if self.threshold is not None and self.back_at <= self.threshold:
                raise HybridError(f"--switch-back-at {self.back_at} must come after --switch-threshold {self.threshold}")
        return self

    def side(self, phase: str, position: int) -> str:
        if self.back_at is not None and position >= self.back_at:
            return self.start
        if self.threshold is None:
            return self.start if phase == "prefill" else _other(self.start)
        return self.start if position < self.threshold else _other(self.start)

    def cuts(self) -> list[int]:
        """Positions where the side changes within a step's run of positions."""
        return [p for p in (self.threshold, self.back_at) if p is not None]


@dataclass
class SwitchEvent:
    src: str
    dst: str
    position: int        # RoPE position of the first token run on dst
    phase: str
    live_slots: int      # n_past handed over
    kv_bytes: int        # K and V bytes copied (0 when mapped)
    score_bytes: int     # attention-score bytes copied
    seconds: float
    mode: str            # copy | map | refill (the device failed: the CPU recomputed the cache)
    reason: str = "schedule"

    def line(self) -> str:
        moved = ("mapped, 0 B copied" if self.mode == "map" else
                 f"refilled from {self.live_slots} tokens" if self.mode == "refill" else
                 f"{_size(self.kv_bytes)} K/V" + (f" + {_size(self.score_bytes)} scores" if self.score_bytes else "")
                 + " copied")
        why = "" if self.reason == "schedule" else f" [{self.reason}]"
        return (f"{self.src} -> {self.dst} at position {self.position} ({self.phase}), {self.live_slots} live slots: "
                f"{moved} in {self.seconds * 1e3:.2f} ms{why}")


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB"


@dataclass
class _State:
    name: str
    offset: int          # byte offset in the KV region (the plan's layout, the same on both sides)
    nbytes: int
    rows: int            # K/V: slots; scores: KV heads
    row_bytes: int       # K/V: one slot, every KV head; scores: one head, every slot


def _kv_states(graph) -> tuple[list[_State], list[_State], int]:
    """The decode graph's K/V states, score states and slot count, from its attention ops."""
    offsets = graph.meta["layout"]["kv"]
    kv, scores, slots = [], [], 0
    for op in graph.ops:
        if op.kind != "attention":
            continue
        for i in (1, 2):
            v = graph.values[op.inputs[i]]
            name = v.alias or v.name
            st = graph.values[name]
            slots = st.shape[0]
            kv.append(_State(name, offsets[name], st.nbytes, st.shape[0], st.nbytes // st.shape[0]))
        if len(op.inputs) == 5:
            sc = graph.values[op.inputs[3]]
            scores.append(_State(sc.name, offsets[sc.name], sc.nbytes, sc.shape[0], sc.nbytes // sc.shape[0]))
    if not kv:
        raise HybridError(f"graph {graph.name} has no attention op: nothing to hand over")
    return kv, scores, slots


def live_kv_bytes(graph, n_past: int) -> int:
    """Bytes a copy switch moves for K and V with n_past slots in use: every layer's live slots
    times a slot's row bytes (all KV heads), for K and for V."""
    return sum(n_past * s.row_bytes for s in _kv_states(graph)[0])


class HybridKV:
    """The eviction store (runtime/kv) of whichever side owns the cache; the score control is
    remembered and given to the other side at a switch."""

    def __init__(self, hybrid: "HybridBackend"):
        self.h = hybrid
        self.stores = {side: be.kv_store() for side, be in hybrid.backends.items()}
        first = self.stores["cpu"]
        self.n_layers, self.n_kv_heads, self.slots = first.n_layers, first.n_kv_heads, first.slots
        self.score_from: int | None = None

    @property
    def active(self):
        return self.stores[self.h.active]

    def scores(self, n: int) -> np.ndarray:
        return self.active.scores(n)

    def clear_scores(self) -> None:
        self.active.clear_scores()

    def set_score_from(self, first_slot: int | None) -> None:
        self.score_from = first_slot
        if first_slot is not None:
            self.h.scores_live = True
        self.active.set_score_from(first_slot)

    def compact(self, keep: np.ndarray) -> None:
        self.active.compact(keep)
        self.h.evicted = True

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.active.copy_slots(src, dst)

    def move_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.active.move_slots(src, dst)
        self.h.evicted = True

    def move_scores(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.active.move_scores(src, dst)

    def clear_slot_scores(self, slots: np.ndarray) -> None:
        self.active.clear_slot_scores(slots)

    def slot_scores(self, slots: np.ndarray) -> np.ndarray:
        return self.active.slot_scores(slots)

    def handed_over(self) -> None:
        self.active.set_score_from(self.score_from)


@dataclass
class _Phase:
    tokens: int = 0
    seconds: float = 0.0


class HybridBackend(Backend):
    """run(phase, tokens, n_past, start_pos) on the side the schedule names; see the module doc."""
    device_argmax = True     # the OpenCL side's; the CPU side takes the argmax of its logits

    def __init__(self, cpu: CpuBackend, opencl: OpenCLBackend, schedule: Schedule, kv_mode: str = "auto",
                 notice: Callable[[str], None] | None = None):
        if kv_mode not in KV_MODES:
            raise HybridError(f"--hybrid-kv {kv_mode!r}: choose one of {', '.join(KV_MODES)}")
        self.schedule = schedule.check()
        self.backends: dict[str, Backend] = {"cpu": cpu, "opencl": opencl}
        self.cpu, self.opencl = cpu, opencl
        self.graphs = cpu.graphs
        self.device_name = opencl.device_name
        shared = opencl.shares_kv
        if (kv_mode == "map") != shared and kv_mode != "auto":
            raise HybridError(f"--hybrid-kv {kv_mode}: the OpenCL KV buffers are {'' if shared else 'not '}made over "
                              "the CPU's memory (HybridBackend.load makes them as the mode needs)")
        self.kv_mode = "map" if shared and kv_mode != "copy" else "copy"
        self.graph = cpu.graphs["decode"]
        self.kv_states, self.score_states, self.slots = _kv_states(self.graph)
        self.prefill_T = cpu.graphs["prefill"].T if "prefill" in cpu.graphs else 1
        self.notice = notice or (lambda line: print(line, file=sys.stderr))
        self.switches: list[SwitchEvent] = []
        self.phases: dict[tuple[str, str], _Phase] = {}
        self.failed: str | None = None       # the device error that moved everything to the CPU
        self.store: HybridKV | None = None
        self._maps: list[tuple[int, np.ndarray]] | None = None   # the OpenCL KV region, mapped while the CPU runs
        self.active = schedule.start
        self.scores_live = False             # an eviction policy keeps attention scores
        self.evicted = False                 # slots no longer hold positions 0..n_past-1
        self._fed: list[int] = []            # token fed at each position (refills the cache after a device failure)
        if self.kv_mode == "map" and self.active == "cpu":
            self._map()

    @classmethod
    def load(cls, plan: Any, schedule: Schedule, kv_mode: str = "auto", threads: int | None = None,
             device: int | str | None = None, notice: Callable[[str], None] | None = None) -> "HybridBackend":
        """Both sides of `plan`; with kv_mode map (or auto on a device sharing host memory) the
        OpenCL KV buffers are made over the CPU back end's KV memory."""
        if kv_mode not in KV_MODES:
            raise HybridError(f"--hybrid-kv {kv_mode!r}: choose one of {', '.join(KV_MODES)}")
        schedule.check()
        cpu = CpuBackend(plan, threads=threads)
        try:
            dev = pick_device(device)
            share = kv_mode == "map" or (kv_mode == "auto" and shares_host_memory(dev))
            opencl = OpenCLBackend(plan, device=dev, kv_host=cpu.kv_region() if share else None)
        except BaseException:
            cpu.close()
            raise
        return cls(cpu, opencl, schedule, kv_mode, notice)

    @property
    def name(self) -> str:
        s = self.schedule
        if s.threshold is None:
            plan = f"{s.start} prefill, {_other(s.start)} decode"
        elif s.threshold >= NEVER:
            plan = f"{s.start} only"
        else:
            plan = f"{s.start} to position {s.threshold}, then {_other(s.start)}"
        if s.back_at is not None:
            plan += f", {s.start} again from position {s.back_at}"
        return f"hybrid ({plan}; KV {self.kv_mode}; {self.opencl.device_name})"

    @property
    def prefill_rows(self) -> int | None:
        """The feed of the side a prompt starts on (a prompt's first chunk fixes the engine's)."""
        return self.backends[self._side("prefill", 0)].prefill_rows

    # -- the engine's interface ---------------------------------------------------------------
    def run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        return self._steps(phase, tokens, n_past, start_pos, argmax=False)

    def run_argmax(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        return self._steps(phase, tokens, n_past, start_pos, argmax=True)

    def run_step(self, rows: StepRows) -> np.ndarray:
        """On the side that holds the cache now: a step's rows carry one position each, so the
        schedule has no one position to switch at, and the cache stays where it is."""
        return self.backends[self.active].run_step(rows)

    def run_step_argmax(self, rows: StepRows) -> np.ndarray:
        return self.backends[self.active].run_step_argmax(rows)

    def reset(self) -> None:
        if self._maps is not None:
            self._unmap()
        self.opencl.reset()
        if self.kv_mode == "copy":
            self.cpu.reset()
        self.active = self._first_side()
        if self.kv_mode == "map" and self.active == "cpu":
            self._map()
        self.evicted = self.scores_live = False
        self._fed.clear()
        if self.store is not None:
            self.store.score_from = None

    def kv_store(self) -> HybridKV:
        if self.store is None:
            self.store = HybridKV(self)
        return self.store

    def close(self) -> None:
        if self._maps is not None:
            self._unmap()
        self.opencl.close()
        self.cpu.close()

    def use(self, side: str, n_past: int = 0, position: int = 0, phase: str = "prefill") -> None:
        """Hand the cache (n_past live slots) to `side` now (calibration, tests)."""
        if side != self.active:
            self._switch(side, n_past, position, phase)

    # -- steps --------------------------------------------------------------------------------
    def _first_side(self) -> str:
        return "cpu" if self.failed else self.schedule.start

    def _side(self, phase: str, position: int) -> str:
        return "cpu" if self.failed else self.schedule.side(phase, position)

    def _steps(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int, argmax: bool) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = len(tokens)
        del self._fed[start_pos:]            # a rewound cache is written over from here
        self._fed.extend(int(t) for t in tokens)
        bounds = [0, *sorted({c - start_pos for c in self.schedule.cuts() if 0 < c - start_pos < n}), n]
        out = None
        for a, b in zip(bounds, bounds[1:]):
            out = self._run(self._side(phase, start_pos + a), phase, tokens[a:b], n_past + a, start_pos + a, argmax)
        return out

    def _run(self, side: str, phase: str, tokens: np.ndarray, n_past: int, start_pos: int, argmax: bool) -> np.ndarray:
        if side != self.active:
            try:
                self._switch(side, n_past, start_pos, phase)
            except _device_errors() as err:
                if side != "opencl":
                    raise
                # the CPU still holds the cache it was handing over: it just keeps it
                self._note_failure(err, start_pos)
        be = self.backends[self.active]
        t0 = time.perf_counter()
        try:
            if argmax:
                out = be.run_argmax(phase, tokens, n_past, start_pos)
            else:
                out = be.run(phase, tokens, n_past, start_pos)
        except _device_errors() as err:
            if self.active != "opencl":
                raise
            self._device_failed(err, phase, n_past, start_pos)
            return self._run("cpu", phase, tokens, n_past, start_pos, argmax)
        ph = self.phases.setdefault((phase, self.active), _Phase())
        ph.tokens += len(tokens)
        ph.seconds += time.perf_counter() - t0
        return out

    # -- switches -----------------------------------------------------------------------------
    def _switch(self, dst: str, n_past: int, position: int, phase: str, reason: str = "schedule") -> None:
        src = self.active
        t0 = time.perf_counter()
        kv_bytes = score_bytes = 0
        if self.kv_mode == "map":
            if dst == "opencl":
                self._unmap()
            else:
                self._map()
        else:
            kv_bytes, score_bytes = self._copy(dst, n_past)
        self.active = dst
        if self.store is not None:
            self.store.handed_over()
        self.switches.append(SwitchEvent(src, dst, position, phase, n_past, kv_bytes, score_bytes,
                                         time.perf_counter() - t0, self.kv_mode, reason))

    def _copy(self, dst: str, n_past: int) -> tuple[int, int]:
        """The live rows of every state to `dst`; returns (K/V bytes, score bytes) copied."""
        host = self.cpu.kv_region()
        to_device = dst == "opencl"
        kv = [(s.offset, n_past * s.row_bytes) for s in self.kv_states]
        scores, tails = [], []
        if self.scores_live:
            # scores are [KV head, slot]: each head's live run, and a zero tail where later steps add
            for s in self.score_states:
                for h in range(s.rows):
                    start = s.offset + h * s.row_bytes
                    scores.append((start, 4 * n_past))
                    if s.row_bytes > 4 * n_past:
                        tails.append((start + 4 * n_past, s.row_bytes - 4 * n_past))
        spans = [(off, n) for off, n in kv + scores if n]
        if to_device:
            self.opencl.copy_kv(host, spans, True, zeros=tails)
        else:
            self.opencl.copy_kv(host, spans, False)
            for off, n in tails:
                host[off:off + n] = 0
        return sum(n for _, n in kv), sum(n for _, n in scores)

    def _map(self) -> None:
        maps = self.opencl.map_kv()
        host = self.cpu.kv_region()
        if any(ary.ctypes.data != host[s:].ctypes.data for s, ary in maps):  # the spec says it is: a driver that breaks it
            self.opencl.unmap_kv(maps)
            raise HybridError(f"{self.opencl.device_name} mapped the shared KV cache elsewhere; use --hybrid-kv copy")
        self._maps = maps

    def _unmap(self) -> None:
        maps, self._maps = self._maps or [], None    # none is released twice, even after a failure
        self.opencl.unmap_kv(maps)

    # -- device failure -----------------------------------------------------------------------
    def _device_failed(self, err: BaseException, phase: str, n_past: int, position: int) -> None:
        """The device failed in a step: its rows past n_past may be half written, the ones before
        are whole. Take those back to the CPU; a device that cannot give them back leaves the
        CPU to recompute them from the tokens fed (only while no eviction has moved them)."""
        what = self._note_failure(err, position)
        try:
            self._switch("cpu", n_past, position, phase, reason="device failure")
            return
        except _device_errors() + (HybridError,):
            pass
        if self._maps is not None:          # a failed map leaves nothing mapped
            self._maps = None
        if self.evicted or self.scores_live or len(self._fed) < n_past:
            # evicted slots are no longer positions, and scores summed on the device over many steps
            # cannot be summed again: neither can be recomputed from the tokens
            raise OpenCLError(f"the OpenCL device failed ({what}) and its KV cache, kept by an eviction policy, "
                              "could not be read back; start again with --backend cpu") from None
        t0 = time.perf_counter()
        self.active = "cpu"
        if self.kv_mode == "map":           # the CPU's memory is the device's: rebuild it in place
            self.cpu.reset()
        for s in range(0, n_past, self.prefill_T):
            part = np.asarray(self._fed[s:min(n_past, s + self.prefill_T)], np.int32)
            self.cpu.run("prefill" if "prefill" in self.cpu.graphs else "decode", part, s, s)
        if self.store is not None:
            self.store.handed_over()
        self.switches.append(SwitchEvent("opencl", "cpu", position, phase, n_past, 0, 0,
                                         time.perf_counter() - t0, "refill", "device failure"))

    def _note_failure(self, err: BaseException, position: int) -> str:
        what = " ".join(str(err).split())
        self.failed = what
        self.notice(f"llmrs: the OpenCL device failed at position {position} ({what}); "
                    "going on on the CPU for the rest of the run")
        return what

    # -- report -------------------------------------------------------------------------------
    def report_lines(self) -> list[str]:
        """--stats: every switch, then tokens and tok/s per phase and side."""
        lines = [f"switch            {e.line()}" for e in self.switches] or ["switch            none"]
        for (phase, side), ph in sorted(self.phases.items(), key=lambda kv: (kv[0][0] != "prefill", kv[0])):
            rate = ph.tokens / ph.seconds if ph.seconds else 0.0
            lines.append(f"{phase + ' on ' + side:<17} {ph.tokens} tokens in {ph.seconds * 1e3:.1f} ms ({rate:.1f} tok/s)")
        return lines

    def clear_report(self) -> None:
        self.switches.clear()
        self.phases.clear()


__all__ = ["KV_MODES", "SIDES", "HybridBackend", "HybridError", "HybridKV", "Schedule", "SwitchEvent",
           "live_kv_bytes", "shares_host_memory"]
