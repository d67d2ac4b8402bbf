"""Write plan.bin: a fixed header, a JSON manifest, then 64-byte-aligned, checksummed sections.

    offset 0    header (64 B, little-endian; see HEADER)
    offset 64   manifest: UTF-8 JSON; the caller's keys plus
                  "sections": {name: {"offset", "size", "crc32"}}   offsets absolute in the file
                  "tensors":  {name: {"dtype", "shape", "offset", "nbytes"}}
                                                          offsets inside the "weights" section
    then        sections, each at a 64-byte-aligned offset; "weights" last, every tensor in it
                64-byte aligned. Every byte between regions is zero.

Checksums are zlib.crc32 (6 GB/s here against 1.8 GB/s for sha1: a 1B plan checks in well under
a second), written as 8 hex digits so that filling them in never changes the manifest's length.
The weights are streamed one LazyTensor at a time, checksummed as they go, into a temporary file
that is renamed over the target only once complete.
"""
from __future__ import annotations

import json
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from .outputs import replace_refusal
from .ir import Graph, LazyTensor, nbytes
from .serialize import graph_to_json

MAGIC = b"LLMRSPLN"
FORMAT_VERSION = 1
ALIGN = 64
WEIGHTS = "weights"                     # the section holding every tensor
RESERVED_KEYS = ("sections", "tensors")  # manifest keys write_plan owns

# magic, version, header bytes, file bytes, manifest offset, manifest bytes, manifest crc32,
# 16 reserved zero bytes, then the crc32 of the 60 bytes before it. Every format version keeps
# magic, version and header length first and the header's crc32 last, so a reader can tell a
# newer plan from a damaged one.
HEADER = struct.Struct("<8sIIQQQI16sI")
HEADER_CRC_AT = HEADER.size - 4
assert HEADER.size == ALIGN


class PlanWriteError(ValueError):
    """The caller's manifest, sections or weights cannot be written; the message names which."""


@dataclass(frozen=True)
class Header:
    version: int
    file_bytes: int
    manifest_offset: int
    manifest_bytes: int
    manifest_crc32: int

    def pack(self) -> bytes:
        body = HEADER.pack(MAGIC, self.version, HEADER.size, self.file_bytes, self.manifest_offset,
                           self.manifest_bytes, self.manifest_crc32, bytes(16), 0)[:HEADER_CRC_AT]
        return body + struct.pack("<I", zlib.crc32(body))


@dataclass(frozen=True)
class PlanInfo:
    path: Path
    file_bytes: int
    manifest_bytes: int
    weights_bytes: int
    n_tensors: int
    sections: dict[str, int]    # name -> bytes
    seconds: float


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def crc_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _section_bytes(name: str, data: bytes | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise PlanWriteError(f"section {name!r} is a {type(data).__name__}; pass bytes or str")


def _tensor_table(weights: dict[str, LazyTensor]) -> tuple[dict[str, dict[str, Any]], int]:
    table, end = {}, 0
    for name, lt in weights.items():
        size = nbytes(tuple(lt.shape), lt.dtype)
        off = align(end)
        table[name] = {"dtype": lt.dtype, "shape": [int(s) for s in lt.shape], "offset": off, "nbytes": size}
        end = off + size
    return table, end


def _layout(manifest: dict[str, Any], sizes: dict[str, int],
            tensors: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], bytes]:
    """The full manifest and its bytes; section offsets follow the manifest, whose length
    depends on those offsets' digits, so iterate until the first section start is stable."""
    start = align(HEADER.size + 1)
    while True:
        sections, off = {}, start
        for name, size in sizes.items():
            sections[name] = {"offset": off, "size": size, "crc32": crc_hex(0)}
            off = align(off + size)
        full = {**manifest, "sections": sections, "tensors": tensors}
        text = _dumps(full)
        if HEADER.size + len(text) <= start:
            return full, text
        start = align(HEADER.size + len(text))


def _dumps(manifest: dict[str, Any]) -> bytes:
    try:
        return json.dumps(manifest, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise PlanWriteError(f"manifest is not JSON-serializable: {e}") from None


def _pad_to(f, offset: int, crc: int | None = None) -> int | None:
    gap = offset - f.tell()
    if gap < 0:
        raise AssertionError(f"plan writer overran offset {offset} (at {f.tell()})")
    if gap:
        f.write(bytes(gap))
        if crc is not None:
            crc = zlib.crc32(bytes(gap), crc)
    return crc


def _write_weights(f, base: int, weights: dict[str, LazyTensor], tensors: dict[str, dict[str, Any]],
                   progress: Callable[[str, int, int], None] | None) -> int:
    _pad_to(f, base)  # padding before the section is not part of its checksum
    crc = 0
    for i, (name, lt) in enumerate(weights.items()):
        if progress is not None:
            progress(name, i, len(weights))
        entry = tensors[name]
        crc = _pad_to(f, base + entry["offset"], crc)
        arr = np.ascontiguousarray(lt.load())
        if arr.nbytes != entry["nbytes"]:
            raise PlanWriteError(f"tensor {name!r}: its data has {arr.nbytes} bytes, "
                                 f"{lt.dtype}{list(lt.shape)} needs {entry['nbytes']}")
        raw = arr.reshape(-1).view(np.uint8)
        f.write(raw)
        crc = zlib.crc32(raw, crc)
        del arr, raw  # one tensor in memory at a time
    return crc


def write_plan(path: str | os.PathLike, manifest: dict[str, Any], sections: dict[str, bytes | str],
               weights: dict[str, LazyTensor],
               progress: Callable[[str, int, int], None] | None = None,
               reads: Iterable[str | os.PathLike] = ()) -> PlanInfo:
    """Write a plan file atomically; progress(tensor_name, index, count) is called per tensor.
    An existing `path` is replaced only if it is a regular file and none of `reads` (the model's
    files): never a device, and never the model being compiled."""
    t0 = time.perf_counter()
    path = Path(path)
    reads = tuple(reads)
    why = replace_refusal(path, "plan", reads)
    if why:
        raise PlanWriteError(why)
    for key in RESERVED_KEYS:
        if key in manifest:
            raise PlanWriteError(f"manifest key {key!r} is filled in by write_plan; leave it out")
    if WEIGHTS in sections:
        raise PlanWriteError(f"section name {WEIGHTS!r} is reserved for the tensors; rename the section")
    blobs = {str(name): _section_bytes(name, data) for name, data in sections.items()}
    tensors, weights_bytes = _tensor_table(weights)
    sizes = {**{n: len(b) for n, b in blobs.items()}, WEIGHTS: weights_bytes}
    full, text = _layout(manifest, sizes, tensors)
    table = full["sections"]

    target = Path(os.path.realpath(path))   # a symlink stays, its target gets the plan
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(bytes(HEADER.size))
            f.write(text)  # checksums still zero: rewritten below at the same length
            for name, blob in blobs.items():
                _pad_to(f, table[name]["offset"])
                f.write(blob)
                table[name]["crc32"] = crc_hex(zlib.crc32(blob))
            table[WEIGHTS]["crc32"] = crc_hex(_write_weights(f, table[WEIGHTS]["offset"], weights, tensors,
                                                             progress))
            file_bytes = f.tell()
            final = _dumps(full)
            assert len(final) == len(text), "manifest length changed when checksums were filled in"
            f.seek(HEADER.size)
            f.write(final)
            f.seek(0)
            f.write(Header(FORMAT_VERSION, file_bytes, HEADER.size, len(final), zlib.crc32(final)).pack())
            f.flush()
            os.fsync(f.fileno())
        why = replace_refusal(path, "plan", reads)   # again: minutes may have passed
        if why:
            raise PlanWriteError(why)
        os.replace(tmp, target)
    except OSError as e:   # named for the plan asked for, not the temporary file beside it
        tmp.unlink(missing_ok=True)
        raise PlanWriteError(f"{path}: cannot write the plan ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return PlanInfo(path, file_bytes, len(final), weights_bytes, len(tensors), sizes,
                    time.perf_counter() - t0)


def graph_weights(graphs: dict[str, Graph]) -> dict[str, LazyTensor]:
    """The data of every param/const value of the graphs (weights a pass left unreferenced are
    dropped); a name shared by two graphs must mean the same tensor."""
    out: dict[str, LazyTensor] = {}
    for g in graphs.values():
        for name in g.by_kind("param") + g.by_kind("const"):
            if name not in g.weights:
                raise PlanWriteError(f"graph {g.name}: value {name!r} has no weight data; run the verify pass")
            lt = g.weights[name]
            have = out.get(name)
            if have is not None and (have.shape != lt.shape or have.dtype != lt.dtype):
                raise PlanWriteError(f"tensor {name!r} is {have.dtype}{list(have.shape)} in one graph and "
                                     f"{lt.dtype}{list(lt.shape)} in graph {g.name}")
            out.setdefault(name, lt)
    return out


def write_graph_plan(path: str | os.PathLike, graphs: dict[str, Graph], manifest: dict[str, Any] | None = None,
                     sections: dict[str, bytes | str] | None = None,
                     progress: Callable[[str, int, int], None] | None = None,
                     reads: Iterable[str | os.PathLike] = ()) -> PlanInfo:
    """write_plan for compiled graphs: serializes them into manifest["graphs"], stores their weights."""
    manifest = dict(manifest or {})
    if "graphs" in manifest:
        raise PlanWriteError("manifest key 'graphs' is filled in by write_graph_plan; pass the graphs instead")
    manifest["graphs"] = {phase: graph_to_json(g) for phase, g in graphs.items()}
    return write_plan(path, manifest, sections or {}, graph_weights(graphs), progress, reads)
