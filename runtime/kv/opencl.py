"""The OpenCL back end's KV caches as eviction sees them: device buffers, moved on the device.

Compaction runs templates/opencl/kv_compact.cl as the plan's "kv_compact" entries describe it
(compiler/codegen/opencl.py): one launch gathers one kind of state (K, V or scores) for a run of
layers whose states lie in one buffer at a constant stride (all of them, unless the KV region
was split over several buffers), so an eviction is three launches and one index upload. Scores
are read back for the policy; the score control is written, and the back end's `scoring` flag
puts the scoring launches into its steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.opencl_program import build_program
from .store import NEVER, KVStoreError, layer_states


@dataclass
class _Run:
    kernel: Any
    buf: Any
    offset: int          # byte offset of the first layer's state in buf
    stride: int          # bytes from one layer's state to the next
    first_layer: int
    layers: int
    spec: dict


class OpenCLKV:
    def __init__(self, backend: Any):   # runtime/backends/opencl.OpenCLBackend, which makes it
        import pyopencl as cl

        self.be = backend
        g = backend.graphs["decode"]
        self.layers, self.ctl_name = layer_states(g)
        k0 = g.values[self.layers[0].k]
        self.slots, self.n_kv_heads, self.n_layers = k0.shape[0], k0.shape[1], len(self.layers)
        specs = {c["state"]: c for c in backend.program.get("kv_compact", [])}
        states = [n for layer in self.layers for n in (layer.k, layer.v, layer.scores)]
        if any(n not in specs for n in states) or "kv_compact" not in backend.program["sources"]:
            raise KVStoreError("this plan's OpenCL program has no KV compaction kernel; recompile it with "
                               "llmrs-compile to evict on the OpenCL back end")
        built: dict[tuple[str, ...], Any] = {}
        self.runs: list[_Run] = []
        for names in ([layer.k for layer in self.layers], [layer.v for layer in self.layers],
                      [layer.scores for layer in self.layers]):
            where = [backend.locate("decode", n) for n in names]
            i = 0
            while i < len(names):
                j = i + 1
                stride = where[j][1] - where[i][1] if j < len(names) and where[j][0] is where[i][0] else 0
                while j < len(names) and where[j][0] is where[i][0] and where[j][1] - where[j - 1][1] == stride:
                    j += 1
                spec = specs[names[i]]
                key = tuple(spec["options"])
                if key not in built:
                    built[key] = build_program(backend.ctx, backend.device, backend.program["sources"]["kv_compact"],
                                               list(spec["options"]), "kv_compact")
                self.runs.append(_Run(cl.Kernel(built[key], "kv_compact"), where[i][0], where[i][1], stride,
                                      i, j - i, spec))
                i = j
        self.idx_buf = cl.Buffer(backend.ctx, cl.mem_flags.READ_ONLY,
                                 self.n_layers * self.n_kv_heads * self.slots * 4)
        self._uploaded: np.ndarray | None = None   # what idx_buf holds

    def scores(self, n: int) -> np.ndarray:
        return np.stack([self.be.read_value("decode", layer.scores)[:, :n] for layer in self.layers])

    def clear_scores(self) -> None:
        import pyopencl as cl
        for layer in self.layers:
            buf, off = self.be.locate("decode", layer.scores)
            cl.enqueue_fill_buffer(self.be.queue, buf, np.uint8(0), off, self.be.graphs["decode"].values[layer.scores].nbytes)

    def set_score_from(self, first_slot: int | None) -> None:
        ctl = np.array([0, NEVER] if first_slot is None else [1, first_slot], np.int32)
        self.be.write_value("decode", self.ctl_name, ctl)
        self.be.scoring = first_slot is not None

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot dst[i] of every layer's K and V becomes a copy of slot src[i], one device copy per
        run of consecutive slots (a copied block is one run)."""
        import pyopencl as cl
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        runs = np.split(np.arange(len(src)), breaks)
        g = self.be.graphs["decode"]
        for layer in self.layers:
            for name in (layer.k, layer.v):
                buf, off = self.be.locate("decode", name)
                row = g.values[name].nbytes // self.slots
                for r in runs:
                    if len(r):
                        cl.enqueue_copy(self.be.queue, buf, buf, byte_count=len(r) * row,
                                        src_offset=off + int(src[r[0]]) * row, dst_offset=off + int(dst[r[0]]) * row)
        self.be.queue.finish()

    def move_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot dst[j] of every layer's K and V takes the row of slot src[j] (a paged compaction):
        every source run is copied to a scratch buffer first, then the scratch to the destination
        runs, so overlapping runs (a sliding window moving down) are safe, which one device copy
        between overlapping regions of a buffer is not (CL_MEM_COPY_OVERLAP)."""
        import pyopencl as cl
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        if src.ndim != 1:
            self._move_per_head(src, dst)
            return
        if not len(src):
            return
        g = self.be.graphs["decode"]
        rows = max(g.values[n].nbytes // self.slots for layer in self.layers for n in (layer.k, layer.v))
        need = len(src) * rows
        if getattr(self, "_scratch_bytes", 0) < need:
            self._scratch = cl.Buffer(self.be.ctx, cl.mem_flags.READ_WRITE, need)
            self._scratch_bytes = need
        j = np.arange(len(src))
        src_runs = _runs(src, j)
        dst_runs = _runs(j, dst)
        for layer in self.layers:
            for name in (layer.k, layer.v):
                buf, off = self.be.locate("decode", name)
                row = g.values[name].nbytes // self.slots
                for s, d, n in src_runs:
                    cl.enqueue_copy(self.be.queue, self._scratch, buf, byte_count=n * row,
                                    src_offset=off + s * row, dst_offset=d * row)
                for s, d, n in dst_runs:
                    cl.enqueue_copy(self.be.queue, buf, self._scratch, byte_count=n * row,
                                    src_offset=s * row, dst_offset=off + d * row)
        self.be.queue.finish()

    def _move_per_head(self, src: np.ndarray, dst: np.ndarray) -> None:
        """move_slots with src [L, KVH, k] (SnapKV, H2O keep other slots in each head): each cache
        gathered on the host and written back, every source read before anything is written."""
        heads = np.arange(self.n_kv_heads)
        for li, layer in enumerate(self.layers):
            for name in (layer.k, layer.v):
                cache = self.be.read_value("decode", name)
                cache[dst[:, None], heads[None, :]] = cache[src[li].T, heads[None, :]]
                self.be.write_value("decode", name, cache)

    def _each_scores(self, change) -> None:
        """change(layer index, scores f32 [KVH, S]) on the host, written back (a paged pool's
        per-sequence score edits: a few KB a layer)."""
        for li, layer in enumerate(self.layers):
            sc = self.be.read_value("decode", layer.scores)
            change(li, sc)
            self.be.write_value("decode", layer.scores, sc)

    def move_scores(self, src: np.ndarray, dst: np.ndarray) -> None:
        """move_slots for the attention scores."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        heads = np.arange(self.n_kv_heads)

        def move(li: int, sc: np.ndarray) -> None:
            s = src if src.ndim == 1 else src[li]
            sc[:, dst] = sc[:, s] if s.ndim == 1 else sc[heads[:, None], s]
        self._each_scores(move)

    def clear_slot_scores(self, slots: np.ndarray) -> None:
        """Zero the scores of these slots in every layer (one sequence's, in a paged pool)."""
        slots = np.asarray(slots, np.int64)
        if len(slots):
            self._each_scores(lambda li, sc: sc.__setitem__((slice(None), slots), 0))

    def slot_scores(self, slots: np.ndarray) -> np.ndarray:
        """f32 [L, KVH, n]: the scores of these slots (one sequence's KV entries, in order)."""
        return np.stack([self.be.read_value("decode", layer.scores)[:, slots] for layer in self.layers])

    def compact(self, keep: np.ndarray) -> None:
        import pyopencl as cl
        k = keep.shape[-1]
        idx = np.ascontiguousarray(keep, dtype=np.int32)
        if self._uploaded is None or not np.array_equal(self._uploaded, idx):   # sliding: the same each step
            cl.enqueue_copy(self.be.queue, self.idx_buf, idx, is_blocking=True)
            self._uploaded = idx
        for r in self.runs:
            s = r.spec
            r.kernel.set_args(r.buf, np.uint64(r.offset), np.uint64(r.stride), self.idx_buf,
                              np.uint64(r.first_layer * self.n_kv_heads * k * 4), np.int32(k),
                              np.uint64(s["slot_stride"]), np.uint64(s["head_stride"]),
                              np.int32(s["rows"] if s["zero_tail"] else 0))
            cl.enqueue_nd_range_kernel(self.be.queue, r.kernel, (s["heads"] * s["local"], r.layers), (s["local"], 1))
        self.be.queue.finish()


def _runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(src, dst, length) of each run where both src and dst go up by one."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    return [(int(src[r[0]]), int(dst[r[0]]), len(r)) for r in np.split(np.arange(len(src)), breaks) if len(r)]
