"""Open plan.bin: validate every byte that will be used, then map the weights without reading them.

Open checks the header (magic, version, its checksum, the file's length), the manifest (checksum,
JSON), every section and tensor offset against the file, that the bytes between regions are zero,
the checksums of all sections but the weights, and the graphs. The weights section (most of the
file) is checksummed on the first open of a given file only: the result is remembered under
LLMRS_CACHE_DIR (default ~/.cache/llmrs), keyed by the file's real path, size, mtime and inode,
so later opens just map it (a rewrite within the file system's mtime granularity, same size
and inode, would go unnoticed: use verify="always" for files edited in place). verify="always"
checks the weights anyway, verify="never" skips them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..compiler import quant
from ..compiler.ir import DTYPES, QK, Graph, IRError, LazyTensor, storage_shape
from ..compiler.plan import ALIGN, FORMAT_VERSION, HEADER, MAGIC, WEIGHTS, Header
from ..compiler.serialize import graph_from_json

VERIFY_MODES = ("auto", "always", "never")
_CHUNK = 8 << 20  # bytes per read while checksumming
_MAX_HEADER = 4096  # any format version's header; more means a damaged length field
TOKENIZER = "tokenizer.json"   # the section holding the Hugging Face tokenizer


class PlanError(ValueError):
    """A plan that cannot be used; str() is one line naming the file and what is wrong."""


@dataclass(frozen=True)
class Section:
    offset: int     # absolute, in the file
    size: int
    crc32: int


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    offset: int     # inside the weights section
    nbytes: int


def cache_dir() -> Path:
    return Path(os.environ.get("LLMRS_CACHE_DIR") or Path.home() / ".cache" / "llmrs")


def _crc_range(f: BinaryIO, offset: int, size: int) -> int | None:
    """crc32 of file bytes [offset, offset+size), read in chunks; None if the file is short."""
    buf = memoryview(bytearray(min(_CHUNK, max(size, 1))))
    f.seek(offset)
    crc, left = 0, size
    while left:
        n = f.readinto(buf[:min(left, len(buf))])
        if not n:
            return None
        crc = zlib.crc32(buf[:n], crc)
        left -= n
    return crc


def _is_int(x: Any) -> bool:
    return type(x) is int


def _tensor_bytes(shape: tuple[int, ...], dtype: str) -> int | None:
    """Storage bytes, in Python ints (no overflow on absurd shapes); None if the shape is invalid."""
    if dtype in quant.BLOCK_BYTES and (not shape or shape[-1] % QK):
        return None
    sshape, np_dtype = storage_shape(shape, dtype)
    return math.prod(sshape) * np_dtype.itemsize


class Plan:
    """A validated plan file; weights are np.memmap views into it."""

    def __init__(self, path: Path, header: Header, manifest: dict[str, Any], sections: dict[str, Section],
                 tensors: dict[str, TensorEntry], mm: np.memmap, verification: str):
        self.path = path
        self.header = header
        self.manifest = manifest
        self.sections = sections
        self.tensors = tensors
        self.verification = verification    # weights section: "checked" | "cached" | "skipped"
        self._mm = mm                       # uint8[file_bytes], read-only
        self._graphs: dict[str, Graph] = {}

    # -- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, verify: str = "auto") -> "Plan":
        path = Path(path)
        if verify not in VERIFY_MODES:
            raise PlanError(f"{path}: verify={verify!r}; use one of {', '.join(VERIFY_MODES)}")
        try:
            with open(path, "rb") as f:
                return cls._open(path, f, verify)
        except OSError as e:
            raise PlanError(f"{path}: cannot read the plan: {e.strerror or e}") from None

    @classmethod
    def _open(cls, path: Path, f: BinaryIO, verify: str) -> "Plan":
        def fail(msg: str) -> PlanError:
            return PlanError(f"{path}: {msg}".replace("\n", " "))

        st = os.fstat(f.fileno())
        size = st.st_size
        header = _read_header(f, size, fail)
        if size < header.file_bytes:
            raise fail(f"truncated: {size} of {header.file_bytes} bytes; recompile or copy the plan again")
        if size > header.file_bytes:
            raise fail(f"{size - header.file_bytes} unexpected bytes after the {header.file_bytes}-byte plan; "
                       "the file is damaged, recompile it")
        manifest = _read_manifest(f, header, fail)
        sections = _sections(manifest, header, fail)
        tensors = _tensors(manifest, sections[WEIGHTS], fail)
        mm = np.memmap(f, dtype=np.uint8, mode="r", shape=(size,))
        _check_gaps(mm, header, sections, fail)
        for name, sec in sections.items():
            if name != WEIGHTS:
                _check_section(f, name, sec, fail)
        key = {"path": os.path.realpath(path), "size": size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
               "manifest_crc32": header.manifest_crc32, "weights_crc32": sections[WEIGHTS].crc32}
        verification = "skipped"
        if verify == "always" or (verify == "auto" and not _cache_hit(key)):
            _check_section(f, WEIGHTS, sections[WEIGHTS], fail)
            _cache_store(key)
            verification = "checked"
        elif verify == "auto":
            verification = "cached"
        plan = cls(path, header, manifest, sections, tensors, mm, verification)
        plan._graphs = plan._build_graphs(fail)
        return plan

    def _build_graphs(self, fail) -> dict[str, Graph]:
        raw = self.manifest.get("graphs", {})
        if not isinstance(raw, dict):
            raise fail("manifest 'graphs' is not an object; recompile the plan")
        weights = {name: LazyTensor(t.shape, t.dtype, functools.partial(self.weight, name))
                   for name, t in self.tensors.items()}
        graphs = {}
        for phase, d in raw.items():
            try:
                graphs[phase] = graph_from_json(d, weights).verify()
            except (IRError, ValueError, KeyError, TypeError, IndexError, AttributeError,
                    ZeroDivisionError, OverflowError, RecursionError) as e:
                # the manifest passed its checksum, so this is a plan from a broken compiler
                raise fail(f"graph {phase!r} is malformed: {e}; recompile the plan") from None
        return graphs

    # -- access -------------------------------------------------------------------------------
    def graphs(self) -> dict[str, Graph]:
        """The plan's graphs by phase; their weights are LazyTensors over the mapped file."""
        return {phase: g.copy() for phase, g in self._graphs.items()}

    def weights_region(self) -> np.memmap:
        """The whole weights section: uint8[size], read-only; tensor offsets are relative to it."""
        sec = self.sections[WEIGHTS]
        return self._mm[sec.offset:sec.offset + sec.size]

    def weight(self, name: str) -> np.ndarray:
        """One tensor's bytes as its storage array (bf16 as uint16, q4_0/q8_0 as uint8 blocks)."""
        t = self.tensors.get(name)
        if t is None:
            raise PlanError(f"{self.path}: no tensor {name!r} in the plan")
        sshape, np_dtype = storage_shape(t.shape, t.dtype)
        base = self.sections[WEIGHTS].offset + t.offset
        return self._mm[base:base + t.nbytes].view(np_dtype).reshape(sshape)

    def missing_code(self, backend: str) -> str | None:
        """None if the plan carries code for backend ("cpu" | "opencl"), else one line saying
        why not: the compiler's reason where it left that back end out (a shape its kernels
        cannot serve), or that it was never asked for."""
        if backend == "cpu":
            has = any(s == "llvm-ir" or s.startswith("llvm.") for s in self.sections)
        else:
            has = backend in self.sections
        if has:
            return None
        label = {"cpu": "CPU", "opencl": "OpenCL"}.get(backend, backend)
        opts = self.manifest.get("compile_options") or {}
        why = (opts.get("left_out") or {}).get(backend)
        if why:
            runs_on = ", ".join(opts.get("targets") or ()) or "no back end"
            return f"no {label} code: {why}; the plan runs on {runs_on}"
        return f"no {label} code (compiled without --target {backend}); recompile with it"

    def tokenizer(self) -> Any:
        """The plan's tokenizer (a `tokenizers.Tokenizer`); a PlanError if it has none or its
        section cannot be read as one (a plan from a compiler that did not check it)."""
        from tokenizers import Tokenizer

        raw = self.section(TOKENIZER)
        try:
            return Tokenizer.from_str(bytes(raw).decode("utf-8"))
        except Exception as e:   # tokenizers raises its own exception types
            detail = " ".join(str(e).split())[:120]
            raise PlanError(f"{self.path}: its tokenizer cannot be read ({detail}); compile the plan again") from None

    def section(self, name: str) -> memoryview:
        """A section's bytes, read-only (e.g. "opencl" source, "llvm.<triple>" objects)."""
        sec = self.sections.get(name)
        if sec is None and name == TOKENIZER:
            raise PlanError(f"{self.path}: the plan holds no tokenizer (its model had no tokenizer.json), so text "
                            "cannot become tokens; compile it again from a folder with the model's tokenizer.json")
        if sec is None:
            raise PlanError(f"{self.path}: no section {name!r} in the plan (it has "
                            f"{', '.join(sorted(self.sections))}); recompile with that backend enabled")
        return memoryview(self._mm[sec.offset:sec.offset + sec.size])


# -- validation steps, each raising fail(...) -------------------------------------------------

def _read_header(f: BinaryIO, size: int, fail) -> Header:
    """Every format version starts with magic, version, header length, and ends its header with
    the header's crc32; so a newer plan is told apart from a damaged one."""
    raw = f.read(HEADER.size)
    if len(raw) < len(MAGIC) and (not raw or MAGIC.startswith(raw)):
        raise fail(f"truncated: {size} bytes, too short for a plan header" if raw else "empty file, not a plan")
    if raw[:len(MAGIC)] != MAGIC:
        raise fail(f"not an llmrs plan (starts with {raw[:8]!r}, expected {MAGIC!r})")
    if len(raw) < HEADER.size:
        raise fail(f"truncated: {size} bytes, too short for the {HEADER.size}-byte plan header")
    version, header_bytes = struct.unpack_from("<II", raw, len(MAGIC))
    if not HEADER.size <= header_bytes <= _MAX_HEADER:
        raise fail("header is corrupted (bad header length); recompile the plan")
    if header_bytes > size:
        raise fail(f"truncated: {size} bytes, too short for the {header_bytes}-byte plan header")
    raw += f.read(header_bytes - HEADER.size)
    if zlib.crc32(raw[:-4]) != struct.unpack_from("<I", raw, header_bytes - 4)[0]:
        raise fail("header is corrupted (checksum mismatch); recompile the plan")
    if version > FORMAT_VERSION:
        raise fail(f"plan format v{version} is newer than this llmrs (v{FORMAT_VERSION}); recompile or upgrade")
    if version < 1 or header_bytes != HEADER.size:
        raise fail(f"header is corrupted (format v{version}, {header_bytes}-byte header); recompile the plan")
    _, _, _, file_bytes, m_off, m_size, m_crc, _, _ = HEADER.unpack(raw)
    if not HEADER.size <= m_off <= file_bytes or m_size > file_bytes - m_off:
        raise fail(f"manifest at {m_off} (+{m_size} bytes) lies outside the {file_bytes}-byte plan; recompile it")
    return Header(version, file_bytes, m_off, m_size, m_crc)


def _read_manifest(f: BinaryIO, header: Header, fail) -> dict[str, Any]:
    f.seek(header.manifest_offset)
    raw = f.read(header.manifest_bytes)
    if len(raw) != header.manifest_bytes:
        raise fail("truncated inside the manifest; recompile or copy the plan again")
    if zlib.crc32(raw) != header.manifest_crc32:
        raise fail("manifest is corrupted (checksum mismatch); recompile the plan")
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise fail("manifest is not valid UTF-8 JSON; recompile the plan") from None
    if not isinstance(manifest, dict):
        raise fail("manifest is not a JSON object; recompile the plan")
    return manifest


def _sections(manifest: dict[str, Any], header: Header, fail) -> dict[str, Section]:
    raw = manifest.get("sections")
    if not isinstance(raw, dict) or WEIGHTS not in raw:
        raise fail(f"manifest has no section table with a {WEIGHTS!r} section; recompile the plan")
    out = {}
    for name, d in raw.items():
        d = d if isinstance(d, dict) else {}
        off, size, crc = d.get("offset"), d.get("size"), d.get("crc32")
        if not (_is_int(off) and _is_int(size) and isinstance(crc, str) and len(crc) == 8):
            raise fail(f"section {name!r} has a malformed entry in the manifest; recompile the plan")
        try:
            crc_value = int(crc, 16)
        except ValueError:
            raise fail(f"section {name!r} has a malformed checksum in the manifest; recompile the plan") from None
        if off % ALIGN or off < HEADER.size or size < 0 or off + size > header.file_bytes:
            raise fail(f"section {name!r} at {off} (+{size} bytes) lies outside the {header.file_bytes}-byte "
                       "plan or is misaligned; recompile the plan")
        out[name] = Section(off, size, crc_value)
    regions = sorted([(0, HEADER.size, "header"), (header.manifest_offset, header.manifest_bytes, "manifest")]
                     + [(s.offset, s.size, f"section {n!r}") for n, s in out.items()])
    for (a_off, a_size, a), (b_off, _, b) in zip(regions, regions[1:]):
        if a_off + a_size > b_off:
            raise fail(f"{a} overlaps {b}; recompile the plan")
    return out


def _tensors(manifest: dict[str, Any], weights: Section, fail) -> dict[str, TensorEntry]:
    raw = manifest.get("tensors")
    if not isinstance(raw, dict):
        raise fail("manifest has no tensor table; recompile the plan")
    out = {}
    for name, d in raw.items():
        d = d if isinstance(d, dict) else {}
        dtype, shape, off, size = d.get("dtype"), d.get("shape"), d.get("offset"), d.get("nbytes")
        if not (dtype in DTYPES and isinstance(shape, list) and len(shape) <= 8
                and all(_is_int(s) and s >= 0 for s in shape) and _is_int(off) and _is_int(size)):
            raise fail(f"tensor {name!r} has a malformed entry in the manifest; recompile the plan")
        want = _tensor_bytes(tuple(shape), dtype)
        if want != size or off < 0 or off % ALIGN or off + size > weights.size:
            raise fail(f"tensor {name!r} ({dtype}{shape}, {size} bytes at {off}) does not fit the "
                       f"{weights.size}-byte weights section; recompile the plan")
        out[name] = TensorEntry(dtype, tuple(shape), off, size)
    spans = sorted((t.offset, t.nbytes, n) for n, t in out.items())
    for (a_off, a_size, a), (b_off, _, b) in zip(spans, spans[1:]):
        if a_off + a_size > b_off:
            raise fail(f"tensor {a!r} overlaps tensor {b!r}; recompile the plan")
    return out


def _check_gaps(mm: np.memmap, header: Header, sections: dict[str, Section], fail) -> None:
    """Bytes outside the header, manifest and sections are padding and must be zero, so that a
    damaged byte anywhere in the file is caught."""
    regions = sorted([(0, HEADER.size), (header.manifest_offset, header.manifest_bytes)]
                     + [(s.offset, s.size) for s in sections.values()])
    pos = 0
    for off, size in regions + [(header.file_bytes, 0)]:
        if off > pos and np.any(mm[pos:off]):
            raise fail(f"padding at bytes {pos}..{off} is not zero (the file is damaged); recompile the plan")
        pos = max(pos, off + size)


def _check_section(f: BinaryIO, name: str, sec: Section, fail) -> None:
    got = _crc_range(f, sec.offset, sec.size)
    if got is None:
        raise fail(f"truncated inside section {name!r}; recompile or copy the plan again")
    if got != sec.crc32:
        raise fail(f"section {name!r} is corrupted (checksum {got:08x}, manifest says {sec.crc32:08x}); "
                   "recompile or copy the plan again")


# -- the verified-weights cache -----------------------------------------------------------------

def _cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "verified" / f"{digest}.json"


def _cache_hit(key: dict[str, Any]) -> bool:
    try:
        return json.loads(_cache_file(key).read_text()) == key
    except (OSError, ValueError):
        return False


def _cache_store(key: dict[str, Any]) -> None:
    """Best effort: an unwritable cache only means the next open checks the weights again."""
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(key, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass

