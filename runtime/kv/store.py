"""The KV caches of a back end as eviction sees them: scores to read, scoring to switch, rows to
move. Host memory (the reference back end's state arrays, the CPU back end's KV region) is
handled here with numpy; OpenCL device buffers by runtime/kv/opencl.py's compaction kernel.

Which state is which comes from the graph, not from names: every attention op that writes
scores reads (q, k, v, scores, score_ctl), with k and v the caches it attends over.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ...compiler.ir import Graph

NEVER = np.iinfo(np.int32).max


class KVStoreError(ValueError):
    """A plan or back end that eviction cannot work with; one line, says what to do."""


@dataclass(frozen=True)
class LayerStates:
    k: str           # state [S, KVH, hd] (f32 | f16 | q8_0 / q4_0: rows of whole 34 / 18-byte blocks)
    v: str
    scores: str      # state f32 [KVH, S]


def layer_states(graph: Graph) -> tuple[list[LayerStates], str]:
    """Each layer's cache states in the graph's layer order, and the score control state."""
    layers, ctl = [], None
    for op in graph.ops:
        if op.kind != "attention":
            continue
        if len(op.inputs) != 5:
            raise KVStoreError(f"graph {graph.name}: attention op {op.name} writes no scores; this plan "
                               "predates eviction scores, recompile it with llmrs-compile")
        state = lambda n: graph.values[n].alias or n  # noqa: E731
        layers.append(LayerStates(state(op.inputs[1]), state(op.inputs[2]), op.inputs[3]))
        ctl = op.inputs[4]
    if not layers or ctl is None:
        raise KVStoreError(f"graph {graph.name} has no attention op; nothing to evict")
    return layers, ctl


def _runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(destination, source, length) of each run of consecutive slots in an ascending keep list."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(a), int(slots[a]), int(b - a)) for a, b in zip(starts, ends) if slots[a] != a]


def _move_rows(cache: np.ndarray, runs: list[tuple[int, int, int]]) -> None:
    """Whole slots (every head at once) moved down by memmove, in order: a policy that keeps the
    same slots in every head (sliding) evicts at memory speed, with no gathered copy (a Llama-3.2-1B
    f16 cache of 1024 slots: 13 ms by numpy slices, 62 ms by a gather, for all 32 caches)."""
    row = cache.strides[0]
    base = cache.ctypes.data
    for dst, src, n in runs:
        ctypes.memmove(base + dst * row, base + src * row, n * row)


class HostKV:
    """KV caches held in numpy arrays (storage dtype, storage shape) that the back end reads
    directly: state name -> array. A compaction is a gather per KV head, in place."""

    def __init__(self, graph: Graph, arrays: dict[str, np.ndarray]):
        self.layers, self.ctl_name = layer_states(graph)
        self.arrays = arrays
        first = arrays[self.layers[0].k]
        self.n_layers = len(self.layers)
        self.slots, self.n_kv_heads = first.shape[0], first.shape[1]

    def scores(self, n: int) -> np.ndarray:
        return np.stack([self.arrays[layer.scores][:, :n] for layer in self.layers]).astype(np.float32)

    def clear_scores(self) -> None:
        for layer in self.layers:
            self.arrays[layer.scores][...] = 0

    def set_score_from(self, first_slot: int | None) -> None:
        ctl = self.arrays[self.ctl_name]
        ctl[0], ctl[1] = (0, NEVER) if first_slot is None else (1, first_slot)

    def compact(self, keep: np.ndarray) -> None:
        """Slot j of KV head h becomes old slot keep[layer, h, j], for K, V and the scores; score
        slots past the survivors are zeroed (later steps add to them)."""
        k = keep.shape[-1]
        heads = np.arange(self.n_kv_heads)
        runs = _runs(keep[0, 0]) if np.all(keep == keep[0, 0]) else None
        for li, layer in enumerate(self.layers):
            idx = keep[li]                                            # [KVH, k]
            for name in (layer.k, layer.v):
                cache = self.arrays[name]
                if runs is None:
                    cache[:k] = cache[idx.T, heads[None, :]]          # the gather copies first
                else:
                    _move_rows(cache, runs)
            sc = self.arrays[layer.scores]
            sc[:, :k] = sc[heads[:, None], idx]
            sc[:, k:] = 0

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot dst[i] of every layer's K and V becomes a copy of slot src[i] (a paged cache's
        copy-on-write: a sequence about to change a block it shares gets its own copy first)."""
        for layer in self.layers:
            for name in (layer.k, layer.v):
                cache = self.arrays[name]
                cache[dst] = cache[src]

    def move_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot dst[j] of every layer's K and V takes the row of slot src[j] (a paged compaction,
        runtime/kv/paged.py): src int [k] for every KV head alike, or [L, KVH, k] per layer and KV
        head; dst int [k]. Every source is gathered before anything is written (a destination may
        be another entry's source). The scores stay (move_scores moves them, for the policies that
        keep them)."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        heads = np.arange(self.n_kv_heads)
        for li, layer in enumerate(self.layers):
            s = src if src.ndim == 1 else src[li]                    # [k] or [KVH, k]
            for name in (layer.k, layer.v):
                cache = self.arrays[name]
                if s.ndim == 1:
                    cache[dst] = cache[s]                             # fancy indexing gathers a copy first
                else:
                    cache[dst[:, None], heads[None, :]] = cache[s.T, heads[None, :]]

    def move_scores(self, src: np.ndarray, dst: np.ndarray) -> None:
        """move_slots for the attention scores."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        heads = np.arange(self.n_kv_heads)
        for li, layer in enumerate(self.layers):
            s = src if src.ndim == 1 else src[li]
            sc = self.arrays[layer.scores]
            sc[:, dst] = sc[:, s] if s.ndim == 1 else sc[heads[:, None], s]

    def clear_slot_scores(self, slots: np.ndarray) -> None:
        """Zero the scores of these slots in every layer (one sequence's, in a paged pool)."""
        for layer in self.layers:
            self.arrays[layer.scores][:, slots] = 0

    def slot_scores(self, slots: np.ndarray) -> np.ndarray:
        """f32 [L, KVH, n]: the scores of these slots (one sequence's KV entries, in order)."""
        return np.stack([self.arrays[layer.scores][:, slots] for layer in self.layers]).astype(np.float32)

    def cache(self, layer: int, which: str) -> np.ndarray:
        """A layer's K or V cache in storage form (tests compare them)."""
        return self.arrays[getattr(self.layers[layer], which)]
