"""CacheManager: decides when the KV cache is evicted (policy, full cache, memory pressure),
asks the policy which slots survive, and has the back end move them.

The engine calls it around every step:

    make_room(n_past, n_tokens) -> n_past              evict so that n_tokens more fit ("full")
    before_step(StepInfo)                              scores on or off for the step's rows
    record_step(n_past, start_pos, n_tokens)           RoPE positions of the slots just written
    after_step(n_past, after_prefill) -> n_past        the policy's budget, then memory pressure

Every eviction is an EvictionEvent (policy, trigger, slots before and after, seconds), kept in
`events` and passed to `on_event` (the CLI logs them).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from ...options import OptionError
from .policy import CacheView, EvictionPolicy, StepInfo



@dataclass
class MemoryStats:
    total: int        # bytes
    available: int    # bytes the kernel could give without swapping (MemAvailable)
    free: int         # bytes unused right now


class SystemMonitor(Protocol):
    def mem_stats(self) -> MemoryStats: ...


class LinuxSystemMonitor:
    """/proc/meminfo: MemTotal, MemAvailable, MemFree (kB)."""

    def __init__(self, path: str = "/proc/meminfo"):
        self.path = path

    def mem_stats(self) -> MemoryStats:
        fields = {}
        with open(self.path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key.strip()] = int(parts[0]) * 1024
        try:
            return MemoryStats(fields["MemTotal"], fields["MemAvailable"], fields["MemFree"])
        except KeyError as e:
            raise OSError(f"{self.path} has no {e.args[0]} line; a memory threshold needs Linux 3.14+") from None


class KVStore(Protocol):
    """A back end's KV caches as eviction sees them (runtime/kv/store.py)."""
    n_layers: int
    n_kv_heads: int
    slots: int

    def scores(self, n: int) -> np.ndarray: ...                 # f32 [L, KVH, n]
    def clear_scores(self) -> None: ...
    def set_score_from(self, first_slot: int | None) -> None: ...
    def compact(self, keep: np.ndarray) -> None: ...            # int [L, KVH, k], ascending
    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None: ...   # every layer's K, V rows
    def move_slots(self, src: np.ndarray, dst: np.ndarray) -> None: ...   # gathered first; src [k] | [L, KVH, k]
    def move_scores(self, src: np.ndarray, dst: np.ndarray) -> None: ...  # move_slots for the scores
    def clear_slot_scores(self, slots: np.ndarray) -> None: ...           # a paged pool's: these slots, 0
    def slot_scores(self, slots: np.ndarray) -> np.ndarray: ...           # f32 [L, KVH, len(slots)]


@dataclass
class EvictionEvent:
    policy: str
    trigger: str          # budget | full | memory
    before: int           # slots in use before
    after: int            # and after
    seconds: float
    start_pos: int        # RoPE position of the next token

    def line(self) -> str:
        return (f"llmrs: evicted KV cache ({self.policy}, {self.trigger}): {self.before} -> {self.after} "
                f"slots at position {self.start_pos} in {self.seconds * 1e3:.2f} ms")


def summarize(events: list[EvictionEvent]) -> str:
    """The --stats line: how many evictions, by trigger, slots freed and time."""
    by = {t: sum(1 for e in events if e.trigger == t) for t in ("budget", "full", "memory")}
    freed = sum(e.before - e.after for e in events)
    ms = sum(e.seconds for e in events) * 1e3
    kinds = ", ".join(f"{t} {n}" for t, n in by.items() if n)
    return f"{len(events)} ({kinds}): {freed} slots freed in {ms:.1f} ms" if events else "0"


def check_pressure(threshold_mb: float | None, target_ratio: float, evicts: bool) -> None:
    """The memory-pressure settings: a ratio of the slots to keep, a threshold only where a policy
    can evict."""
    if not 0.0 < target_ratio < 1.0:
        raise OptionError(f"{{0}} must be between 0 and 1, got {target_ratio}", "eviction_target_ratio")
    if threshold_mb is not None and threshold_mb < 0:
        raise OptionError(f"{{0}} must be 0 or more, got {threshold_mb}", "memory_threshold_mb")
    if threshold_mb is not None and not evicts:
        raise OptionError("{0} needs an {1} that evicts (sliding, snapkv or h2o)", "memory_threshold_mb",
                          "eviction_policy")


class CacheManager:
    def __init__(self, policy: EvictionPolicy, store: KVStore, monitor: SystemMonitor | None = None,
                 threshold_mb: float | None = None, target_ratio: float = 0.5,
                 on_event: Callable[[EvictionEvent], None] | None = None):
        check_pressure(threshold_mb, target_ratio, policy.name != "none")
        self.policy, self.store, self.monitor = policy, store, monitor
        self.threshold = None if threshold_mb is None else int(threshold_mb * 2**20)
        self.target_ratio = target_ratio
        self.on_event = on_event
        self.slots = store.slots
        self.budget = policy.budget(self.slots) if policy.name != "none" else self.slots
        self.events: list[EvictionEvent] = []
        self.positions = np.zeros((store.n_layers, store.n_kv_heads, self.slots), np.int64)
        self._start_pos = 0
        self._scoring: int | None = None
        store.set_score_from(None)

    @property
    def evicts(self) -> bool:
        return self.policy.name != "none"

    def reset(self) -> None:
        """After the back end forgot its cache (its reset zeroes scores and turns scoring off)."""
        self.positions[...] = 0
        self._start_pos = 0
        self._scoring = None
        self.store.set_score_from(None)

    # -- around steps -----------------------------------------------------------------------------
    def before_step(self, step: StepInfo) -> None:
        """Scores on for the rows the policy wants (off, the back ends skip the work)."""
        if not self.policy.uses_scores:
            return
        step = dataclasses.replace(step, watch_memory=self.threshold is not None)
        if self.policy.clears_scores_before(step):
            self.store.clear_scores()
        first = self.policy.score_from(step)
        if first is not None and first >= step.n_past + step.n_tokens:
            first = None                       # no row of this step is scored
        if first != self._scoring:
            self.store.set_score_from(first)
            self._scoring = first

    def record_step(self, n_past: int, start_pos: int, n_tokens: int) -> None:
        self.positions[:, :, n_past:n_past + n_tokens] = start_pos + np.arange(n_tokens)
        self._start_pos = start_pos + n_tokens

    def plain_rows(self, n_past: int, rows: int) -> int:
        """The most rows (1..rows) that one step may take from n_past on and leave the cache as
        that many one-token steps would: no eviction due between them (the cache full, the policy's
        budget, memory pressure, which may strike at any step) and none of them scored, since a
        speculative verify step may keep only some of its rows."""
        if self.evicts and self.threshold is not None:
            return 1
        rows = min(rows, self.slots - n_past)
        if self.evicts:
            for i in range(rows - 1):           # after row i, a plain step would evict here
                if self.policy.over_budget(n_past + i + 1, self.slots, False):
                    rows = i + 1
                    break
        if self.policy.uses_scores:
            first = self.policy.score_from(StepInfo("decode", n_past, rows, 0, False, self.slots))
            if first is not None:
                rows = min(rows, first - n_past)
        return max(rows, 1)

    def make_room(self, n_past: int, n_tokens: int) -> int:
        """Evict so that n_tokens more slots fit (the cache is full for them)."""
        if n_past + n_tokens <= self.slots or not self.evicts:
            return n_past
        return self._evict(n_past, min(self.budget, self.slots - n_tokens), "full")

    def after_step(self, n_past: int, after_prefill: bool = False) -> int:
        if self.evicts and self.policy.over_budget(n_past, self.slots, after_prefill):
            n_past = self._evict(n_past, self.budget, "budget")
        if self.evicts and self.threshold is not None and self.monitor is not None:
            if self.monitor.mem_stats().available < self.threshold:
                target = max(self.policy.min_keep(), int(n_past * self.target_ratio))
                if target < n_past:
                    n_past = self._evict(n_past, target, "memory")
        return n_past

    # -- eviction ---------------------------------------------------------------------------------
    def view(self, n: int) -> CacheView:
        scores = self.store.scores(n) if self.policy.uses_scores else None
        return CacheView(n, self.positions[:, :, :n].copy(), scores)

    def _evict(self, n_past: int, keep: int, trigger: str) -> int:
        t0 = time.perf_counter()
        keep_slots = np.ascontiguousarray(self.policy.select(self.view(n_past), keep), dtype=np.int64)
        self._check(keep_slots, n_past, keep)
        self.store.compact(keep_slots)
        self.positions[:, :, :keep] = np.take_along_axis(self.positions[:, :, :n_past], keep_slots, axis=-1)
        if self.policy.clears_scores_after_eviction:
            self.store.clear_scores()
        event = EvictionEvent(self.policy.name, trigger, n_past, keep, time.perf_counter() - t0, self._start_pos)
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
        return keep

    def _check(self, keep_slots: np.ndarray, n: int, keep: int) -> None:
        """A policy's answer must keep `keep` distinct old slots per head, ascending, so that
        compaction only moves rows down and every survivor precedes the slots written next."""
        want = (self.store.n_layers, self.store.n_kv_heads, keep)
        if keep_slots.shape != want:
            raise ValueError(f"eviction policy {self.policy.name} kept {keep_slots.shape}, expected {want}")
        if keep_slots.size and (keep_slots.min() < 0 or keep_slots.max() >= n
                                or np.any(np.diff(keep_slots, axis=-1) <= 0)):
            raise ValueError(f"eviction policy {self.policy.name} kept slots out of 0..{n - 1} or not ascending")
