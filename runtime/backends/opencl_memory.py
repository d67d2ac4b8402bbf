"""Device memory of a plan on one OpenCL device, in three planned regions (the plan's layout):

    weights  read-only, uploaded once; quantized tensors converted to the split layout of
             templates/opencl/common.cl (quants, then scales; same size, so every offset stays
             the plan's)
    kv       the KV caches, persistent across steps; optionally made over host memory
             (CL_MEM_USE_HOST_PTR) that another back end shares
    arena    every activation and input, prefill and decode sharing it; CL_MEM_ALLOC_HOST_PTR,
             so the host maps it without copies

A region larger than CL_DEVICE_MAX_MEM_ALLOC_SIZE is split over several buffers at tensor
boundaries (kernel arguments are buffer + byte offset, never sub-buffers); no tensor straddles two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from ...compiler.ir import Graph
from .opencl_device import OpenCLError, _cl

ALIGN = 64
# per 32-value block: (header bytes, quant bytes); the header is the f16 scale d, and for
# q4_1 d then the f16 minimum m, kept together so a kernel reads both in one 4-byte load
_SPLIT_BYTES = {"q4_0": (2, 16), "q4_1": (4, 16), "q8_0": (2, 32)}


def to_split_blocks(raw: np.ndarray, dtype: str) -> np.ndarray:
    """GGML blocks (uint8, any shape) -> the device's split layout: every block's quants, then
    every block's header (f16 scale; q4_1: scale and minimum); the same number of bytes."""
    hb, qb = _SPLIT_BYTES[dtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, hb + qb)
    return np.concatenate([blocks[:, hb:].reshape(-1), blocks[:, :hb].reshape(-1)])


def from_split_blocks(data: np.ndarray, dtype: str) -> np.ndarray:
    """The inverse of to_split_blocks: uint8 [nbytes] of GGML blocks."""
    hb, qb = _SPLIT_BYTES[dtype]
    n = data.size // (hb + qb)
    out = np.empty((n, hb + qb), np.uint8)
    out[:, hb:] = data[:n * qb].reshape(n, qb)
    out[:, :hb] = data[n * qb:].reshape(n, hb)
    return out.reshape(-1)


@dataclass
class Region:
    """A planned region held in one or more device buffers: chunks[i] = (start, end, buffer)."""
    name: str
    chunks: list[tuple[int, int, Any]]

    def locate(self, offset: int, nbytes: int, what: str) -> tuple[Any, int]:
        for start, end, buf in self.chunks:
            if start <= offset and offset + nbytes <= end:
                return buf, offset - start
        raise OpenCLError(f"{what} at {self.name} offset {offset} (+{nbytes} B) lies in no buffer of the region")

    def map(self, queue: Any) -> list[tuple[int, np.ndarray]]:
        """(start, uint8 host view) of every buffer, mapped for reading and writing, once the
        queue is idle; give them back with unmap()."""
        cl = _cl()
        queue.finish()
        return [(s, cl.enqueue_map_buffer(queue, buf, cl.map_flags.READ | cl.map_flags.WRITE, 0, (e - s,),
                                          np.uint8, is_blocking=True)[0]) for s, e, buf in self.chunks]

    def copy(self, queue: Any, host: np.ndarray, spans: Iterable[tuple[int, int]], to_device: bool,
             zeros: Iterable[tuple[int, int]] = ()) -> None:
        """(offset, nbytes) spans copied between host[offset:offset + nbytes] and the region, and
        `zeros` spans of the region zero-filled; returns when all are done."""
        cl = _cl()
        for off, nbytes in spans:
            buf, boff = self.locate(off, nbytes, "copy")
            view = host[off:off + nbytes]
            if to_device:
                cl.enqueue_copy(queue, buf, view, dst_offset=boff, is_blocking=False)
            else:
                cl.enqueue_copy(queue, view, buf, src_offset=boff, is_blocking=False)
        for off, nbytes in zeros:
            buf, boff = self.locate(off, nbytes, "zero fill")
            cl.enqueue_fill_buffer(queue, buf, np.uint8(0), boff, nbytes)
        queue.finish()

    def unmap(self, queue: Any, maps: list[tuple[int, np.ndarray]]) -> None:
        """Give back host views from map() (the device owns the memory again)."""
        for _, ary in maps:
            ary.base.release(queue)
        queue.finish()


def split_region(intervals: Iterable[tuple[int, int]], max_bytes: int, what: str) -> list[tuple[int, int]]:
    """Chunks [start, end) covering the intervals, each <= max_bytes, no interval cut in two.
    Overlapping intervals (reused arena storage) form one cluster that cannot be cut."""
    clusters: list[list[int]] = []
    for s, e in sorted(intervals):
        if clusters and s < clusters[-1][1]:
            clusters[-1][1] = max(clusters[-1][1], e)
        else:
            clusters.append([s, e])
    chunks: list[tuple[int, int]] = []
    for s, e in clusters:
        if e - s > max_bytes:
            raise OpenCLError(f"{what}: {e - s} bytes at offset {s} must sit in one buffer but the device "
                              f"allows {max_bytes} per allocation; use a smaller prefill chunk or weights dtype")
        if chunks and e - chunks[-1][0] <= max_bytes:
            chunks[-1] = (chunks[-1][0], e)
        else:
            chunks.append((s, e))
    return chunks


def naive_layout(graphs: dict[str, Graph]) -> dict[str, dict[str, Any]]:
    """A layout in plan_memory's format with no reuse at all: for graphs that were not planned."""
    kv: dict[str, int] = {}
    kv_bytes = 0
    for g in graphs.values():
        for name in g.state:
            if name not in kv:
                kv[name] = kv_bytes
                kv_bytes += -(-g.values[name].nbytes // ALIGN) * ALIGN
    out = {}
    for phase, g in graphs.items():
        arena, off = {}, 0
        for v in g.values.values():
            if v.kind in ("input", "act") and v.alias is None:
                arena[v.name] = off
                off += -(-v.nbytes // ALIGN) * ALIGN
        out[phase] = {"alignment": ALIGN, "arena_bytes": off, "arena": arena, "kv_bytes": kv_bytes, "kv": kv}
    return out


def pack_weights(graphs: dict[str, Graph]) -> tuple[np.ndarray, dict[str, tuple[int, int]]]:
    """A weights region for graphs held in memory (tests, llmrs-check): every param and const
    packed at ALIGN boundaries; with each tensor's (offset, nbytes)."""
    tensors: dict[str, tuple[int, int]] = {}
    blobs: dict[str, np.ndarray] = {}
    off = 0
    for g in graphs.values():
        for name in g.by_kind("param") + g.by_kind("const"):
            if name not in tensors:
                blobs[name] = np.ascontiguousarray(g.weights[name].load()).view(np.uint8).reshape(-1)
                tensors[name] = (off, blobs[name].nbytes)
                off += -(-blobs[name].nbytes // ALIGN) * ALIGN
    region = np.zeros(max(off, ALIGN), np.uint8)
    for name, (o, n) in tensors.items():
        region[o:o + n] = blobs[name]
    return region, tensors


class DeviceMemory:
    """The three regions of a plan's graphs on one device, allocated at once, and where each
    value of a graph lives in them (locate)."""

    def __init__(self, ctx: Any, graphs: dict[str, Graph], layouts: dict[str, dict[str, Any]], region: np.ndarray,
                 tensors: dict[str, tuple[int, int]], max_alloc: int, kv_host: np.ndarray | None = None,
                 alloc: Callable[..., Any] | None = None):
        """region: the plan's weights section (GGML bytes), tensors: name -> (offset, nbytes) in
        it; kv_host: host memory (uint8, at least the plan's KV bytes) to make the KV buffers over;
        alloc(size, hostbuf=None): where the buffers come from when not OpenCL's own (memory
        CUDA shares: opencl_cuda.py)."""
        cl = _cl()
        mf = cl.mem_flags
        if alloc is None:
            def alloc(size: int, hostbuf: np.ndarray | None = None, flags: int = mf.READ_WRITE) -> Any:
                if hostbuf is not None:
                    return cl.Buffer(ctx, flags | mf.COPY_HOST_PTR, hostbuf=hostbuf)
                return cl.Buffer(ctx, flags, size)
        self.graphs, self.layouts, self.tensors = graphs, layouts, tensors
        used = {n for g in graphs.values() for n in g.by_kind("param") + g.by_kind("const")}
        for n in used:
            if n not in tensors:
                raise OpenCLError(f"tensor {n!r} is used by the graphs but missing from the plan's weights")
        w_chunks = split_region([(tensors[n][0], tensors[n][0] + tensors[n][1]) for n in used],
                                max_alloc, "weights") or [(0, ALIGN)]
        self.quantized = {n: v.dtype for g in graphs.values() for n, v in g.values.items()
                          if n in used and v.dtype in _SPLIT_BYTES}   # name -> dtype, stored split on the device
        self.weights = Region("weights", [
            (s, e, alloc(e - s, hostbuf=self._device_bytes(region, s, e), flags=mf.READ_ONLY))
            for s, e in w_chunks])
        kv = next(iter(layouts.values()))["kv"]
        kv_sizes = {n: g.values[n].nbytes for g in graphs.values() for n in g.state}
        kv_chunks = split_region([(kv[n], kv[n] + kv_sizes[n]) for n in kv_sizes], max_alloc, "KV cache")
        if kv_host is None:
            self.kv = Region("kv", [(s, e, alloc(e - s)) for s, e in kv_chunks])
        else:
            self.kv = Region("kv", [(s, e, cl.Buffer(ctx, mf.READ_WRITE | mf.USE_HOST_PTR, hostbuf=kv_host[s:e]))
                                    for s, e in kv_chunks])
        self.kv_on_host = kv_host is not None
        self.kv_offsets = kv
        spans = []
        for phase, g in graphs.items():
            for n, o in layouts[phase]["arena"].items():
                if n in g.values:
                    spans.append((o, o + g.values[n].nbytes))
        a_chunks = split_region(spans, max_alloc, "activation arena")
        self.arena = Region("arena", [(s, e, alloc(e - s, flags=mf.READ_WRITE | mf.ALLOC_HOST_PTR))
                                      for s, e in a_chunks])

    def _device_bytes(self, region: np.ndarray, start: int, end: int) -> np.ndarray:
        """Bytes [start, end) of the weights region as the kernels read them."""
        chunk = np.asarray(region[start:end])
        inside = [n for n in self.quantized if start <= self.tensors[n][0] < end]
        if not inside:
            return chunk
        chunk = np.array(chunk)     # a private copy: the plan's memmap stays GGML bytes
        for n in inside:
            o, nbytes = self.tensors[n][0] - start, self.tensors[n][1]
            chunk[o:o + nbytes] = to_split_blocks(chunk[o:o + nbytes], self.quantized[n])
        return chunk

    def locate(self, phase: str, name: str) -> tuple[Any, int]:
        """(buffer, byte offset) holding value `name` of graph `phase`."""
        v = self.graphs[phase].values[name]
        if v.kind in ("param", "const"):
            off, n = self.tensors[name]
            return self.weights.locate(off, n, f"tensor {name!r}")
        if v.kind == "state" or v.alias:
            state = v.alias or name
            return self.kv.locate(self.kv_offsets[state], v.nbytes, f"cache {state!r}")
        arena = self.layouts[phase]["arena"]
        if name not in arena:
            raise OpenCLError(f"graph {phase}: value {name!r} has no arena offset in the memory plan")
        return self.arena.locate(arena[name], v.nbytes, f"value {name!r}")


__all__ = ["ALIGN", "DeviceMemory", "Region", "from_split_blocks", "naive_layout", "pack_weights", "split_region",
           "to_split_blocks"]
