"""Open plan.bin: validate every byte that will be used, then map the weights without reading them.

Open checks the header (magic, version, its checksum, the file's length), the manifest (checksum,
JSON), every section and tensor offset against the file, that the bytes between regions are zero,
the checksums of all sections, and the graphs. The weights section (most of the file) is
checksummed on every open, from its mapped bytes: with verify="auto" in a background thread
(zlib.crc32 lets go of the GIL), so the work overlaps the graphs' decoding and the back end's
code loading, and the first access to a weight (`weight()`, `weights_region()`) waits for it, so
no kernel ever reads bytes that were not checked. Nothing about the file (path, size, mtime,
inode) stands in for its content: a file rewritten in place with its mtime put back is refused.
verify="always" checks the weights during open, verify="never" skips them.
"""
from __future__ import annotations

import functools
import json
import math
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

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
                 tensors: dict[str, TensorEntry], mm: np.memmap, weights_check: "WeightsCheck | None"):
        self.path = path
        self.header = header
        self.manifest = manifest
        self.sections = sections
        self.tensors = tensors
        self._check = weights_check         # None: verify="never"
        self._mm = mm                       # uint8[file_bytes], read-only
        self._graphs: dict[str, Graph] = {}

    def check_weights(self) -> None:
        """Wait for the weights section's checksum (verify="auto" runs it in the background) and
        raise its PlanError if the weights are damaged; at once with verify="never"."""
        if self._check is not None:
            self._check.wait()

    @property
    def verification(self) -> str:
        """The weights section's checksum: "checked" (once it is done) or "skipped" (verify="never")."""
        self.check_weights()
        return "skipped" if self._check is None else "checked"

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
        weights = sections[WEIGHTS]
        check = None if verify == "never" else WeightsCheck(mm[weights.offset:weights.offset + weights.size],
                                                            weights.crc32, fail)
        if verify == "always":
            check.wait()
        plan = cls(path, header, manifest, sections, tensors, mm, check)
        plan._graphs = plan._build_graphs(fail)
        for phase, g in plan._graphs.items():
            _check_attrs(phase, g, fail)
            _check_layout(phase, g, fail)
        _check_run_keys(manifest, plan._graphs, fail)
        _check_step(plan._graphs, fail)
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
        self.check_weights()   # no kernel reads bytes that were not checked
        sec = self.sections[WEIGHTS]
        return self._mm[sec.offset:sec.offset + sec.size]

    def weight(self, name: str) -> np.ndarray:
        """One tensor's bytes as its storage array (bf16 as uint16, q4_0/q8_0 as uint8 blocks)."""
        t = self.tensors.get(name)
        if t is None:
            raise PlanError(f"{self.path}: no tensor {name!r} in the plan")
        self.check_weights()   # no kernel reads bytes that were not checked
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

    def step_shape(self) -> "StepShape | None":
        """What the plan's step graph takes (checked at open), or None for a plan without one
        (compiled with max_num_seqs 0, or by an llmrs before step graphs)."""
        g = self._graphs.get(STEP)
        return None if g is None else StepShape.of(g)

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


# -- what the runtime takes from the manifest besides the graphs (a plan that passed its checksums
# may still come from a broken or hostile writer: nothing here may reach a kernel unchecked) ------

_POSITIVE_ATTRS = ("eps", "theta", "scale")    # rms_norm, rope, attention: 0, a negative or NaN is garbage


def _check_attrs(phase: str, g: Graph, fail) -> None:
    """Float attributes of every op finite, those that must be positive positive."""
    for op in g.ops:
        for key, value in op.attrs.items():
            values = value.values() if isinstance(value, dict) else [value]
            for v in values:
                if isinstance(v, float) and not math.isfinite(v) or \
                        key in _POSITIVE_ATTRS and not (isinstance(v, (int, float)) and v > 0):
                    raise fail(f"graph {phase!r}: op {op.name} has {key}={v!r}; recompile the plan")


def _offsets(lay: dict[str, Any], key: str, phase: str, fail) -> dict[str, int]:
    table = lay.get(key)
    if not (isinstance(table, dict) and all(_is_int(o) and o >= 0 for o in table.values())):
        raise fail(f"graph {phase!r}: memory plan {key!r} is not a table of offsets; recompile the plan")
    return table


def _check_layout(phase: str, g: Graph, fail) -> None:
    """Every activation and cache inside the arena / KV region the back ends allocate from the
    layout's sizes, which are no larger than all of them side by side: a kernel writes at these
    offsets, so one outside would write outside the buffer."""
    lay = g.meta.get("layout")
    if lay is None:
        return
    if not isinstance(lay, dict):
        raise fail(f"graph {phase!r}: memory plan is not an object; recompile the plan")
    arena, kv = _offsets(lay, "arena", phase, fail), _offsets(lay, "kv", phase, fail)
    for region, table, kinds in (("arena", arena, ("act", "input")), ("kv", kv, ("state",))):
        size = lay.get(f"{region}_bytes")
        placed = [n for n, v in g.values.items() if v.kind in kinds and v.alias is None]
        side_by_side = sum(-(-g.values[n].nbytes // ALIGN) * ALIGN for n in placed) + ALIGN
        if not (_is_int(size) and 0 <= size <= side_by_side):
            raise fail(f"graph {phase!r}: memory plan {region}_bytes {size!r} is not a size the graph needs; "
                       "recompile the plan")
        for n in placed:
            off = table.get(n)
            if off is None or off + g.values[n].nbytes > size:
                raise fail(f"graph {phase!r}: value {n!r} lies outside the {size}-byte {region} "
                           f"(offset {off}); recompile the plan")


def _check_run_keys(m: dict[str, Any], graphs: dict[str, Graph], fail) -> None:
    """The keys llmrs-run reads next to the graphs, typed and agreeing with them; in a plan that
    llmrs-compile wrote (it has a compile command) or that names a chunk, all of them and both graphs."""
    prefill, decode = graphs.get("prefill"), graphs.get("decode")
    want = {"prefill_chunk": prefill.T if prefill else None, "max_seq_len": decode.kv_slots if decode else None}
    if any(k in m for k in ("compile_command", *want)):
        if prefill is None or decode is None:
            raise fail("the plan lacks its prefill or decode graph; recompile the plan")
        for key, value in want.items():
            if not (_is_int(m.get(key)) and m[key] == value):
                raise fail(f"manifest {key} {m.get(key)!r} does not match the graphs ({value}); recompile the plan")
    vocab = decode.values[decode.outputs[0]].shape[-1] if decode and decode.outputs else None
    model = m.get("model", {})
    if not isinstance(model, dict) or "vocab_size" in model and not (
            _is_int(model["vocab_size"]) and model["vocab_size"] == (vocab or model["vocab_size"]) > 0):
        raise fail(f"manifest model vocab_size does not match the graphs' {vocab} logits; recompile the plan")
    stops = m.get("stop_ids", [])
    if not (isinstance(stops, list) and all(_is_int(i) and 0 <= i < (vocab or i + 1) for i in stops)):
        raise fail(f"manifest stop_ids {str(stops)[:40]} are not token ids of the {vocab}-token vocabulary; "
                   "recompile the plan")
    for key in ("chat_template", "bos_token", "eos_token"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise fail(f"manifest {key} is not text; recompile the plan")


# -- the step graph (compiler/ir.py "Step graphs"; models/step.py makes it) -----------------------

STEP = "step"
VERIFY = "verify"       # OpenCL's speculative verify graph (compiler/pipeline.py)
PREFILL_SHORT = "prefill_short"     # OpenCL's prefill graph for short prompts (compiler/pipeline.py)
OPENCL_ONLY = (VERIFY, PREFILL_SHORT)


def cpu_graphs(graphs: dict[str, Graph]) -> dict[str, Graph]:
    """The graphs a plan's CPU code holds: all but OpenCL's verify graph (the CPU verifies drafts
    through the step graph, whose rows already sum as its decode step does) and short prefill
    graph (the CPU feeds the prefill graph few rows at a step anyway: Backend.prefill_rows)."""
    return {phase: g for phase, g in graphs.items() if phase not in OPENCL_ONLY}
STEP_INPUTS = ("tokens", "positions", "slots", "row_seq", "ctx_len", "block_tables", "logit_rows", "score_from")


@dataclass(frozen=True)
class StepShape:
    """What a step graph takes: up to `rows` tokens a step, from up to `seqs` sequences whose KV
    entries lie in the cache's `n_blocks` blocks of `block_size` slots (a sequence's block table
    `blocks_per_seq` long); logits come back for up to `logits` rows (at least `seqs`: one a
    sequence, more for a speculative verify step). Token ids index `vocab`."""
    rows: int
    seqs: int
    block_size: int
    blocks_per_seq: int
    n_blocks: int
    vocab: int
    logits: int = 0         # 0: seqs (a plan from before verify steps)

    def __post_init__(self) -> None:
        if not self.logits:
            object.__setattr__(self, "logits", self.seqs)

    @property
    def slots(self) -> int:
        return self.n_blocks * self.block_size

    @staticmethod
    def of(g: Graph) -> "StepShape":
        """The shape of step graph g; a ValueError naming what is wrong if g is not one."""
        if tuple(g.inputs) != STEP_INPUTS:
            raise ValueError(f"its inputs are {', '.join(g.inputs)}, not {', '.join(STEP_INPUTS)}")
        T, v = g.T, g.values
        tables, picked = v["block_tables"].shape, v["logit_rows"].shape
        for name in (*STEP_INPUTS[:5], "score_from"):
            if v[name].shape != (T,) or v[name].dtype != "i32":
                raise ValueError(f"input {name} is {v[name].dtype}{list(v[name].shape)}, not i32[{T}]")
        sizes = {op.attrs.get("block_size") for op in g.ops if op.kind == "attention"}
        slots = g.kv_slots
        if len(sizes) != 1 or not _is_int(bs := next(iter(sizes))) or bs < 1 or slots is None or slots % bs:
            raise ValueError(f"its attention ops' block sizes {sorted(map(str, sizes))} are not one divisor of "
                             f"the {slots}-slot KV cache")
        if len(tables) != 2 or tables[1] * bs != slots or len(picked) != 1 or not 1 <= tables[0] <= picked[0] <= T:
            raise ValueError(f"block_tables {list(tables)} and logit_rows {list(picked)} do not fit {T} rows "
                             f"and {slots // bs} blocks of {bs}")
        embed = next((op for op in g.ops if op.kind == "embedding"), None)
        if embed is None or g.values[g.outputs[0]].shape[0] != picked[0]:
            raise ValueError("it has no embedding or its logits are not one row per logit_rows entry")
        return StepShape(T, tables[0], bs, tables[1], slots // bs, v[embed.inputs[0]].shape[0], picked[0])


def _check_step(graphs: dict[str, Graph], fail) -> None:
    """A step graph is one the runtime can fill (its inputs as models/step.py makes them) and
    shares the decode graph's KV layout, as every graph of a plan does."""
    g = graphs.get(STEP)
    if g is None:
        return
    try:
        StepShape.of(g)
    except (ValueError, KeyError) as e:
        raise fail(f"graph {STEP!r} is not a step graph: {e}; recompile the plan") from None
    decode = graphs.get("decode")
    lay, want = g.meta.get("layout"), decode.meta.get("layout") if decode else None
    if lay is not None and want is not None and (lay["kv"] != want["kv"] or lay["kv_bytes"] != want["kv_bytes"]):
        raise fail(f"graph {STEP!r} lays out the KV cache unlike graph 'decode'; recompile the plan")


# -- the weights' checksum, in the background ---------------------------------------------------

class WeightsCheck:
    """crc32 of the mapped weights section against the manifest's, computed in a thread started
    here; wait() joins it and raises the PlanError of damaged weights (every time it is asked)."""

    def __init__(self, region: np.memmap, crc32: int, fail: Callable[[str], PlanError]):
        self._region, self._crc32, self._fail = region, crc32, fail
        self._error: PlanError | None = None
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="llmrs-weights-crc32", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        crc = 0
        for start in range(0, len(self._region), _CHUNK):
            crc = zlib.crc32(self._region[start:start + _CHUNK], crc)
        if crc != self._crc32:
            self._error = self._fail(f"section {WEIGHTS!r} is corrupted (checksum {crc:08x}, manifest says "
                                     f"{self._crc32:08x}); recompile or copy the plan again")

    def wait(self) -> None:
        thread = self._thread
        if thread is not None:
            if os.getpid() != self._pid:   # a forked child has the thread object, not the thread
                self._run()
            thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
