"""Eviction per sequence of a paged KV pool: each sequence of a batch is evicted as the
single-sequence CacheManager evicts its one cache, by the same policy, triggers and budget.

Each sequence has `slots` KV entries of its own at most (the plan's max_seq_len, as the Engine's
cache) and the policy's budget of them. The scheduler (runtime/scheduler.py) calls, between steps:

    chunk(seq, n_past, remaining, n) -> n    a prompt chunk that cannot overflow the sequence
    make_room(seq, n_past, n)                evict so that n more entries fit ("full")
    record(seq, n_past, start_pos, n)        RoPE positions of the entries a step wrote
    after_step(seq, n_past, after_prefill)   the policy's budget, then memory pressure
    forget(seq)                              the sequence left (finished or preempted)

An eviction asks the policy which KV indices survive (per layer and KV head for SnapKV and H2O),
has BlockManager.compact move them down inside the sequence's own blocks (copying a block it
shares through the prefix cache before changing it) and free its tail blocks, and has the back
end's KVStore do the block copies, then the row moves (move_slots), then the scores'. The
scheduler's kv_start is the sequence's KV entry count, so it shrinks with the compaction while
the RoPE positions (num_computed) keep growing: an evicted sequence attends over a subset of its
past at the true relative distances, and may generate past max_seq_len and past its share of
the pool.

Scores (SnapKV, H2O) are per pool slot: a slot's start from zero when a step writes it (another
sequence may have left its own there), a sequence's are cleared when the policy starts a new
observation window, and they move with its rows. A block shared through the prefix cache would
collect every sharer's scores in one place, so a batch under a policy with scores runs without
the prefix cache (runtime/batch.py). Which of a step's rows add to them is the per-row score_from input of
the step graph (compiler/ir.py, "Step graphs"): score_rows() gives it.

Equality with the single-sequence Engine: decode steps are one token in both, so every eviction
falls at the same point and a batched sequence gives the Engine's tokens whenever its prompt fits
its budget. A prompt longer than the budget is evicted after each of its chunks, as in the
Engine; its chunks are the Engine's (the step's rows, at most slots - budget) only when the
sequence has the step to itself, so in a busy batch it may see a slightly different subset.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable
from typing import Callable

import numpy as np

from .manager import EvictionEvent, SystemMonitor
from .paged import BlockManager, Compaction
from .policy import CacheView, EvictionPolicy, StepInfo


class SeqEviction:
    """The per-sequence CacheManager of a batch (see the module docstring)."""

    def __init__(self, policy: EvictionPolicy, slots: int, blocks: BlockManager, store,
                 monitor: SystemMonitor | None = None, threshold_mb: float | None = None,
                 target_ratio: float = 0.5, on_event: Callable[[EvictionEvent], None] | None = None):
        self.policy, self.slots, self.blocks, self.store = policy, slots, blocks, store
        self.budget = policy.budget(slots)
        self.monitor = monitor
        self.threshold = None if threshold_mb is None else int(threshold_mb * 2**20)
        self.target_ratio = target_ratio
        self.on_event = on_event
        self.events: list[EvictionEvent] = []
        # positions of each KV entry: one row for every head unless the policy keeps per head
        self._heads = (store.n_layers, store.n_kv_heads) if policy.uses_scores else (1, 1)
        self._positions: dict[Hashable, np.ndarray] = {}
        self._next_pos: dict[Hashable, int] = {}

    @property
    def uses_scores(self) -> bool:
        return self.policy.uses_scores

    # -- around steps ---------------------------------------------------------------------------
    def chunk(self, seq_id: Hashable, n_past: int, remaining: int, n: int) -> int:
        """At most n rows of a prompt with `remaining` tokens left: where the prompt overflows the
        sequence's slots, chunks of at most slots - budget, as the Engine's prefill takes them."""
        if n_past + remaining > self.slots:
            return max(1, min(n, self.slots - self.budget))
        return n

    def make_room(self, seq_id: Hashable, n_past: int, n: int) -> None:
        """Evict so that n more entries fit the sequence's slots."""
        if n_past + n > self.slots:
            self._evict(seq_id, n_past, min(self.budget, self.slots - n), "full")

    def before_step(self, seq_id: Hashable, step: StepInfo, new_slots: np.ndarray) -> int | None:
        """The first KV index of seq_id whose rows add to the scores in the coming step (None:
        none). The slots the step writes start from zero scores (another sequence may have left
        its own there), and the sequence's scores are cleared where the policy starts a new window."""
        if not self.policy.uses_scores:
            return None
        self.store.clear_slot_scores(new_slots)
        step = dataclasses.replace(step, watch_memory=self.threshold is not None)
        if self.policy.clears_scores_before(step):
            self.store.clear_slot_scores(self.blocks.table(seq_id).slots(0, step.n_past))
        first = self.policy.score_from(step)
        if first is not None and first >= step.n_past + step.n_tokens:
            first = None
        return first

    def start(self, seq_id: Hashable, n_cached: int) -> None:
        """seq_id holds its first n_cached entries (a prefix-cache hit): tokens 0..n_cached-1."""
        self._positions[seq_id] = np.zeros((*self._heads, self.slots), np.int64)
        self._positions[seq_id][..., :n_cached] = np.arange(n_cached)
        self._next_pos[seq_id] = n_cached

    def record(self, seq_id: Hashable, n_past: int, start_pos: int, n: int) -> None:
        pos = self._positions[seq_id]
        pos[..., n_past:n_past + n] = start_pos + np.arange(n)
        self._next_pos[seq_id] = start_pos + n

    def after_step(self, seq_id: Hashable, n_past: int, after_prefill: bool, memory_low: bool = False) -> None:
        if self.policy.over_budget(n_past, self.slots, after_prefill):
            n_past = self._evict(seq_id, n_past, self.budget, "budget")
        if memory_low:
            target = max(self.policy.min_keep(), int(n_past * self.target_ratio))
            if target < n_past:
                self._evict(seq_id, n_past, target, "memory")

    def memory_low(self) -> bool:
        """MemAvailable under the threshold (read once a step, for every sequence in it)."""
        return self.threshold is not None and self.monitor is not None \
            and self.monitor.mem_stats().available < self.threshold

    def forget(self, seq_id: Hashable) -> None:
        self._positions.pop(seq_id, None)
        self._next_pos.pop(seq_id, None)

    # -- eviction -------------------------------------------------------------------------------
    def view(self, seq_id: Hashable, n: int) -> CacheView:
        layers, heads = self.store.n_layers, self.store.n_kv_heads
        positions = np.broadcast_to(self._positions[seq_id][..., :n], (layers, heads, n))
        scores = self.store.slot_scores(self.blocks.table(seq_id).slots(0, n)) if self.policy.uses_scores else None
        return CacheView(n, positions, scores)

    def _evict(self, seq_id: Hashable, n_past: int, keep: int, trigger: str) -> int:
        t0 = time.perf_counter()
        chosen = np.ascontiguousarray(self.policy.select(self.view(seq_id, n_past), keep), dtype=np.int64)
        self._check(chosen, n_past, keep)
        same = bool(np.all(chosen == chosen[:1, :1]))       # sliding: one list for every head
        plan = self.blocks.compact(seq_id, chosen[0, 0] if same else chosen)
        self.apply(plan)
        pos = self._positions[seq_id]
        sel = chosen[:1, :1] if pos.shape[:2] == (1, 1) else chosen
        pos[..., :keep] = np.take_along_axis(pos[..., :n_past], sel, axis=-1)
        if self.policy.uses_scores:
            if self.policy.clears_scores_after_eviction:
                self.store.clear_slot_scores(plan.dst_slots)
        event = EvictionEvent(self.policy.name, trigger, n_past, keep, time.perf_counter() - t0,
                              self._next_pos[seq_id])
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
        return keep

    def apply(self, plan: Compaction) -> None:
        """The back end's part of a compaction: block copies, then row moves (and scores)."""
        bs = self.blocks.block_size
        if plan.copies:
            src = np.concatenate([np.arange(s * bs, (s + 1) * bs) for s, _ in plan.copies])
            dst = np.concatenate([np.arange(d * bs, (d + 1) * bs) for _, d in plan.copies])
            self.store.copy_slots(src.astype(np.int32), dst.astype(np.int32))
            if self.policy.uses_scores:
                self.store.move_scores(src, dst)
        src, dst = plan.src_slots, plan.dst_slots
        moved = (src != dst).any(axis=tuple(range(src.ndim - 1))) if src.ndim > 1 else src != dst
        if moved.any():
            first = int(np.argmax(moved))                   # entries before it stay where they are
            self.store.move_slots(src[..., first:], dst[first:])
            if self.policy.uses_scores:
                self.store.move_scores(src[..., first:], dst[first:])

    def _check(self, chosen: np.ndarray, n: int, keep: int) -> None:
        want = (self.store.n_layers, self.store.n_kv_heads, keep)
        if chosen.shape != want:
            raise ValueError(f"eviction policy {self.policy.name} kept {chosen.shape}, expected {want}")
        if chosen.size and (chosen.min() < 0 or chosen.max() >= n or np.any(np.diff(chosen, axis=-1) <= 0)):
            raise ValueError(f"eviction policy {self.policy.name} kept slots out of 0..{n - 1} or not ascending")
