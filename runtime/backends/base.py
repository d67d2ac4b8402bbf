"""The back-end contract: what the engine, the model, the CLIs and the KV manager may ask of any
back end (cpu, opencl, reference, hybrid). Every back end implements all of it; callers never
probe for a method, and no back end reads another's private state.

A back end holds one plan's graphs ("prefill", "decode", and "step" where the plan has one) bound
to its memory and keeps the KV cache between steps. Positions belong to the caller
(runtime/engine.py): `n_past` is the cache slots in use, `start_pos` the RoPE position of the
step's first token. In a step (run_step) every row says its own position, KV slot and sequence.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..kv.store import NEVER   # score_from of a row that adds no scores
from ..plan import StepShape

if TYPE_CHECKING:
    from ...compiler.ir import Graph
    from ..kv.manager import KVStore


@dataclass(frozen=True)
class StepRows:
    """One step of the plan's "step" graph (compiler/ir.py "Step graphs"): n rows, each a token
    of some sequence, all int32. The scheduler (runtime/scheduler.py) fills it."""
    tokens: np.ndarray          # [n]
    positions: np.ndarray       # [n] RoPE position of each row
    slots: np.ndarray           # [n] the KV-cache row each writes
    row_seq: np.ndarray         # [n] its sequence's row of block_tables
    ctx_len: np.ndarray         # [n] KV entries each attends (its own included)
    block_tables: np.ndarray    # [b, M] physical blocks of each sequence (b <= the graph's B)
    logit_rows: np.ndarray      # [r] rows whose logits come back (r <= the graph's logit rows)
    # [n] 1 where the row's token was sampled, 0 where it is the prompt's (None: all prompt). A
    # kind of the row alone: OpenCL runs the two kinds through different matmul kernels (its
    # row split), so a row's bits never depend on the step's other rows
    generated: np.ndarray | None = None
    # [n] row t adds eviction scores when its own KV index ctx_len[t] - 1 >= score_from[t]
    # (int32 max: never; None: no row scores)
    score_from: np.ndarray | None = None


class StepRowsError(ValueError):
    """Step rows the plan's step graph cannot run (an index outside the cache, the table or the
    step); one line naming the field. Raised before anything runs."""


def _ints(name: str, value: object, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != ndim or (arr.size and arr.dtype.kind not in "iub"):
        raise StepRowsError(f"step rows: {name} must be a {ndim}-d array of integers, got "
                            f"{arr.dtype}{list(arr.shape)}")
    return arr


def _within(name: str, arr: np.ndarray, lo: int, hi: int, what: str) -> None:
    # min and max first: a step is checked every few milliseconds, and is nearly always good; a
    # decode step's few values as Python ints (numpy's two reductions cost several times more)
    if not arr.size:
        return
    if arr.size <= 64:
        values = arr.ravel().tolist()
        least, most = min(values), max(values)
    else:
        least, most = int(arr.min()), int(arr.max())
    if least < lo or most > hi:
        at = np.unravel_index(np.flatnonzero((arr < lo) | (arr > hi))[0], arr.shape)
        raise StepRowsError(f"step rows: {name}[{', '.join(map(str, at))}] = {arr[at]} is outside {lo}..{hi} "
                            f"({what})")


def check_step_tokens(tokens: object, n: int, vocab: int) -> np.ndarray:
    """A step's n token ids given after its other rows were checked (a step prepared while the
    last one ran, its sampled tokens filled in at launch): as check_step_rows checks them."""
    arr = _ints("tokens", tokens, 1)
    if len(arr) != n:
        raise StepRowsError(f"step rows: tokens has {len(arr)} entries for {n} tokens")
    _within("tokens", arr, 0, vocab - 1, "the vocabulary")
    return arr


def check_step_rows(rows: StepRows, shape: StepShape) -> StepRows:
    """rows as int32 arrays, after checking every index against the step graph's shape, so no
    kernel is handed one that reads or writes outside its buffers; StepRowsError otherwise. Every
    back end's one check (the CPU's, the reference's, OpenCL's).

    block_tables may be narrower than the graph's (a scheduler's tables as long as its longest
    sequence): they come back padded to its width. Only the entries a row reads are checked
    (blocks 0 .. (ctx_len - 1) // block_size of its sequence); every other entry comes back 0, so
    no kernel, not even a prefetch, can follow one out of the cache."""
    per_row = {n: _ints(n, getattr(rows, n), 1) for n in ("tokens", "positions", "slots", "row_seq", "ctx_len")}
    tables, picked = _ints("block_tables", rows.block_tables, 2), _ints("logit_rows", rows.logit_rows, 1)
    n = len(per_row["tokens"])
    if not 1 <= n <= shape.rows:
        raise StepRowsError(f"step rows: a step takes 1..{shape.rows} rows, got {n}")
    for name, arr in per_row.items():
        if len(arr) != n:
            raise StepRowsError(f"step rows: {name} has {len(arr)} entries for {n} tokens")
    b, m = tables.shape
    if not 1 <= b <= shape.seqs or not 1 <= m <= shape.blocks_per_seq:
        raise StepRowsError(f"step rows: block_tables is {list(tables.shape)}; give [1..{shape.seqs}, "
                            f"1..{shape.blocks_per_seq}] (a row of block ids per sequence)")
    if not 1 <= len(picked) <= min(shape.logits, n):
        raise StepRowsError(f"step rows: logit_rows has {len(picked)} entries; give 1..{min(shape.logits, n)} "
                            "(the step graph's logit rows, and no more than the step's rows)")
    _within("tokens", per_row["tokens"], 0, shape.vocab - 1, "the vocabulary")
    _within("positions", per_row["positions"], 0, 2**31 - 1, "RoPE positions")
    _within("slots", per_row["slots"], 0, shape.slots - 1, "the KV cache's slots")
    _within("row_seq", per_row["row_seq"], 0, b - 1, "rows of block_tables")
    _within("ctx_len", per_row["ctx_len"], 1, m * shape.block_size, "KV entries a row attends")
    _within("logit_rows", picked, 0, n - 1, "the step's rows")
    if n > 1:   # two writers of one row race on a device
        ordered = np.sort(per_row["slots"])
        if (ordered[1:] == ordered[:-1]).any():
            raise StepRowsError("step rows: two rows write the same KV slot; give each row its own slot")
    # the entries rows read: per sequence, blocks up to its longest row's last
    last = np.full(b, -1, np.int64)
    np.maximum.at(last, per_row["row_seq"], (per_row["ctx_len"].astype(np.int64) - 1) // shape.block_size)
    read = np.arange(m)[None, :] <= last[:, None]
    outside = read & ((tables < 0) | (tables > shape.n_blocks - 1))
    if outside.any():
        s, j = (int(x) for x in np.argwhere(outside)[0])
        raise StepRowsError(f"step rows: block_tables[{s}, {j}] = {int(tables[s, j])} is outside "
                            f"0..{shape.n_blocks - 1} (the cache's blocks)")
    padded = np.zeros((b, shape.blocks_per_seq), np.int32)
    padded[:, :m] = np.where(read, tables, 0)
    generated = None
    if rows.generated is not None:
        generated = _ints("generated", rows.generated, 1)
        if len(generated) != n:
            raise StepRowsError(f"step rows: generated has {len(generated)} entries for {n} tokens")
        _within("generated", generated, 0, 1, "1: a sampled token, 0: the prompt's")
        generated = np.ascontiguousarray(generated, np.int32)
    as32 = {k: np.ascontiguousarray(v, np.int32) for k, v in per_row.items()}
    return StepRows(**as32, block_tables=padded, logit_rows=np.ascontiguousarray(picked, np.int32),
                    generated=generated, score_from=step_score_from(rows.score_from, n))


def step_score_from(score_from: object, n: int) -> np.ndarray:
    """A step's score_from as the step graph takes it: int32 [n], NEVER for every row where None;
    StepRowsError if it is not n int32 values."""
    if score_from is None:
        return np.full(n, NEVER, np.int32)
    arr = _ints("score_from", score_from, 1)
    if len(arr) != n:
        raise StepRowsError(f"step rows: score_from has {len(arr)} entries for {n} tokens")
    _within("score_from", arr, -2**31, NEVER, "int32 KV indices")
    return np.ascontiguousarray(arr, np.int32)


class NonFiniteLogits(ValueError):
    """A greedy step whose chosen logit is NaN or inf (a back end's run_argmax / run_step_argmax
    that checks it); the engine names the step."""


class Backend(ABC):
    name: str                    # what --stats prints ("cpu", "opencl", "reference", "hybrid (...)")
    device_name: str             # the OpenCL device's name; "" where everything runs on the host
    graphs: dict[str, Graph]     # the plan's graphs by phase
    device_argmax: bool          # run_argmax reads back a token per row, not the logits: greedy callers prefer it
    # run("verify", tokens, n_past, start_pos) runs the plan's verify graph: each row summed as a
    # decode step sums it, logits for every row (OpenCL, whose step graph's kernels sum otherwise);
    # without it a speculative verify step goes through run_step
    verify_graph: bool = False
    # the most prompt tokens one prefill step feeds here (None: the prefill graph's T). Kernels
    # size their work by the step's tokens, so a graph of T rows runs a smaller step at a smaller
    # step's cost: a plan's prefill graph is as large as the GPU wants, and a back end that runs
    # smaller steps faster feeds those (the CPU: cpu.py PREFILL_ROWS)
    prefill_rows: int | None = None
    # submit_step returns while the device runs the step, so a caller's host work between it and
    # collect_step overlaps the step (runtime/batch.py plans the next step there)
    async_steps: bool = False

    @abstractmethod
    def run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        """One step of `phase` ("prefill" | "decode") on `tokens` (int32 [n]); f32 [rows, vocab]."""

    @abstractmethod
    def run_argmax(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        """The same step; int32 [rows], each row's argmax (the first of equal maxima, as numpy)."""

    @abstractmethod
    def run_step(self, rows: StepRows) -> np.ndarray:
        """One step of the plan's "step" graph: f32 [len(rows.logit_rows), vocab], the logits of
        the chosen rows. A row's logits are the same whatever else is in the step. Bad rows raise
        StepRowsError; a plan without a step graph, or a back end that cannot run one, a
        one-line error saying what to use instead."""

    def run_step_argmax(self, rows: StepRows) -> np.ndarray:
        """The same step; int32 [len(rows.logit_rows)], each chosen row's argmax (the first of
        equal maxima, as numpy): a batch whose samplers are all greedy reads back a token a row
        where the back end takes it on the device (device_argmax)."""
        return np.argmax(self.run_step(rows), axis=-1).astype(np.int32)

    def submit_step(self, rows: StepRows, argmax: bool) -> Any:
        """run_step (argmax: run_step_argmax) in two halves: this one starts the step and returns
        what collect_step(...) takes for its result. One step at a time: collect it before the
        next submit. Here both halves in one: the step runs now."""
        return self.run_step_argmax(rows) if argmax else self.run_step(rows)

    def collect_step(self, submitted: Any) -> np.ndarray:
        """The result of the step submit_step started, once it has run."""
        return submitted

    def prepare_step(self, rows: StepRows, argmax: bool) -> Any:
        """submit_step's host work before the launch, done ahead (a step planned while the last
        one runs): launch_step(prepared, tokens) then starts it. Here nothing is done ahead."""
        return rows, argmax

    def launch_step(self, prepared: Any, tokens: np.ndarray | None = None) -> Any:
        """Start a prepared step (what collect_step takes); `tokens`: its rows' token ids now, for
        the ones it was prepared with."""
        rows, argmax = prepared
        return self.submit_step(rows if tokens is None else dataclasses.replace(rows, tokens=tokens), argmax)

    @abstractmethod
    def reset(self) -> None:
        """Forget the KV cache (zeroed; eviction scores off)."""

    @abstractmethod
    def kv_store(self) -> KVStore:
        """The KV caches as eviction sees them (runtime/kv/manager.py's KVStore)."""

    @abstractmethod
    def report_lines(self) -> list[str]:
        """Lines --stats adds after the engine's (hybrid: its switches); none for most back ends."""

    @abstractmethod
    def close(self) -> None:
        """Release threads and device resources; calling it again does nothing."""


__all__ = ["NEVER", "Backend", "StepRows", "StepRowsError", "check_step_rows", "check_step_tokens",
           "step_score_from"]
