"""Many generations at once: continuous batching through the plan's step graph.

A Batcher owns a Scheduler (runtime/scheduler.py: which rows of which sequences fill the next
step, the paged KV pool and its prefix cache) and a back end's `run_step`. Each step it asks the
scheduler for a StepPlan, copies the blocks copy-on-write needs, runs the step graph once for
all rows (every weight read once for every sequence in it), samples each sequence's token with
that request's own sampler, and hands the tokens back. Requests join and leave at step
boundaries.

On a back end whose steps run while the host goes on (OpenCL: `async_steps`), the host's work
overlaps the device's: while step N runs, the scheduler plans step N + 1 (the tokens N samples are
pending; their rows hold PENDING_TOKEN until then) and the back end prepares it (checks, packed
inputs, launch list); once N's tokens are in they fill N + 1's rows, N + 1 is launched, and N's tokens go to
their requests while N + 1 runs. A step() call so returns with the next step on the device.

Who steps: `step()` runs one step in the caller's thread (Model.generate_many and the Python API
drive it so); `start()` runs steps on a background thread while there is work (llmrs-serve). A
Request is consumed from any thread: iterate it for text pieces as they decode, close() it to
abort (its blocks are freed at once).

Eviction (KVOptions: sliding, snapkv, h2o, memory pressure) is per sequence, as the
single-sequence Engine does it on its cache (runtime/kv/perseq.py): each sequence keeps at most
max_seq_len entries, is compacted inside its own blocks between steps, and may generate past
max_seq_len and past its share of the pool. A policy with attention scores (SnapKV, H2O) has
the step graph add each row's weights at its entries' slots from the KV index its sequence's
policy asks (FlatBatch.score_from), and runs the batch without the prefix cache (a shared
block would collect every sharer's scores).

The pool is the plan's KV cache, the same memory Model's single-sequence Engine uses: Model
hands the cache to whichever of the two runs (runtime/model.py `_kv_for`), so a batch after a
conversation starts from an empty prefix cache, and a conversation after a batch from an empty
cache.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ..options import OptionError, option, whole
from .backends.base import Backend, NonFiniteLogits, StepRows
from .plan import Plan, StepShape
from .engine import EngineError, check_finite, nonfinite
from .kv import KVOptions
from .kv.manager import LinuxSystemMonitor
from .kv.options import _log, check_threshold
from .kv.perseq import SeqEviction
from .sampler import Sampler
from .text import Detokenizer, StopScan
from .scheduler import FinishReason, FlatBatch, Scheduler, SchedulerConfig, SeqState, Sequence, StepPlan

if TYPE_CHECKING:
    from .model import GenerationOptions


@dataclass(frozen=True)
class BatchOptions:
    """How many sequences run at once and how much of the KV pool they share; each field is a flag
    of its name (llmrs-run with several prompts, llmrs-serve, llmrs.load)."""
    max_num_seqs: int = option(0, "most sequences decoding at once (default 0: as many as the plan's step graph "
                                  "takes, llmrs-compile --max-num-seqs)", metavar="N")
    max_batched_tokens: int = option(0, "most token rows in one step (default 0: the step graph's rows, "
                                        "llmrs-compile --prefill-chunk, or on the CPU at most 128)", metavar="T")
    num_blocks: int = option(0, "KV blocks of the pool to use (default 0: the plan's whole cache, "
                                "llmrs-compile --max-seq-len / --block-size)", metavar="N")
    no_prefix_cache: bool = option(False, "do not share the KV of equal prompt prefixes across requests")

    def check(self) -> "BatchOptions":
        for name in ("max_num_seqs", "max_batched_tokens", "num_blocks"):
            value = getattr(self, name)
            if not whole(value) or value < 0:
                raise OptionError(f"{{0}} must be a whole number >= 0 (0: the plan's), got {value!r}", name)
        if not isinstance(self.no_prefix_cache, bool):
            raise OptionError(f"{{0}} must be True or False, got {self.no_prefix_cache!r}", "no_prefix_cache")
        return self


def step_shape(plan: Plan) -> StepShape:
    shape = plan.step_shape()
    if shape is None:
        raise EngineError(f"{plan.path}: the plan has no step graph, so it runs one sequence at a time; compile it "
                          "again with llmrs-compile --max-num-seqs N to run many at once")
    return shape


def scheduler_config(shape: StepShape, options: BatchOptions, rows: int | None = None) -> SchedulerConfig:
    """The scheduler's limits: the step graph's, or fewer where the options ask. rows: the back
    end's prefill_rows, the default token budget where it is below the graph's rows."""
    def pick(name: str, value: int, most: int, flag_of: str, default: int | None = None) -> int:
        if value > most:
            raise OptionError(f"{{0}} {value} is more than the plan's {flag_of} allows ({most}); recompile "
                              f"with a larger {flag_of}", name)
        return value or min(most, default or most)
    return SchedulerConfig(
        max_num_seqs=pick("max_num_seqs", options.max_num_seqs, shape.seqs, "--max-num-seqs"),
        max_batched_tokens=pick("max_batched_tokens", options.max_batched_tokens, shape.rows, "--prefill-chunk",
                                rows),
        block_size=shape.block_size,
        num_blocks=pick("num_blocks", options.num_blocks, shape.n_blocks, "--max-seq-len"),
        enable_prefix_cache=not options.no_prefix_cache)


FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "cancelled"}


class Request:
    """One generation of a batch. Iterate it for text pieces as they decode (blocks until the
    next piece or the end); text, tokens and finish_reason are current as it runs. finish_reason:
    "stop" (a stop token or stop string), "length" (max_tokens, or the sequence filled its share of
    the cache), "cancelled" (closed early)."""

    def __init__(self, batcher: "Batcher", rid: int, prompt: list[int], options: "GenerationOptions",
                 detok: "Detokenizer", stops: "StopScan"):
        self.batcher = batcher
        self.id = rid
        self.prompt = prompt
        self.options = options
        self.prompt_tokens = len(prompt)
        self.cached_tokens = 0              # prompt tokens the prefix cache supplied
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None       # why a failed step ended it (finish_reason "error")
        self.preemptions = 0                # times its KV was given up to make room, then recomputed
        self._admitted = False
        self.submitted = time.perf_counter()
        self.ttft_s: float | None = None    # submit to the first token
        self.sampler = Sampler(options.sampler_config())
        self.history = list(prompt)         # what the repetition penalty looks back over
        self._detok, self._stops = detok, stops
        self._pieces: deque[str] = deque()
        self._listeners: list[Any] = []     # callables run (on the stepping thread) after each change

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        b = self.batcher
        with b.cond:
            while not self._pieces and not self.done:
                if b.background:
                    b.cond.wait()
                else:               # nobody else steps: this consumer does
                    b.cond.release()
                    try:
                        b.step()
                    finally:
                        b.cond.acquire()
            if self._pieces:
                return self._pieces.popleft()
            raise StopIteration

    def take(self) -> tuple[list[str], bool]:
        """Pieces out so far (removed) and whether the request is done; never blocks."""
        with self.batcher.cond:
            pieces = list(self._pieces)
            self._pieces.clear()
            return pieces, self.done

    def listen(self, callback) -> None:
        """callback() after each change (called on the stepping thread; keep it short)."""
        with self.batcher.cond:
            self._listeners.append(callback)
        callback()

    def close(self) -> None:
        """Abort: the sequence leaves the batch and its blocks are freed now."""
        self.batcher.abort(self, "cancelled")

    # -- on the stepping thread, under batcher.cond ------------------------------------------------
    def _push(self, piece: str) -> None:
        if piece:
            self.text += piece
            self._pieces.append(piece)

    def _token(self, token: int) -> bool:
        """A sampled token; True if a stop string ended the reply here."""
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.submitted
        self.tokens.append(token)
        self.history.append(token)
        piece, hit = self._stops.push(self._detok.push(token))
        self._push(piece)
        return hit

    def _finish(self, reason: str) -> None:
        if self.done:
            return
        if reason != "cancelled":
            piece, hit = self._stops.finish(self._detok.flush())
            self._push(piece)
        self.finish_reason = reason

    def _notify(self) -> None:
        for cb in self._listeners:
            cb()


@dataclass
class _Launched:
    """A step on the back end: its plan, rows, how it samples, what collect_step takes."""
    plan: StepPlan
    flat: FlatBatch | None          # None: a plan with no rows (nothing was launched)
    on_device: bool                 # greedy rows: the device's argmax
    handle: Any                     # the back end's submit_step result
    live: list                      # the requests of its logit rows, at launch


@dataclass
class _Ahead:
    """A step planned while the last one runs: its tokens pending, its launch prepared."""
    plan: StepPlan
    flat: FlatBatch
    live: list
    on_device: bool
    prepared: Any                   # the back end's prepare_step result


class Batcher:
    """Continuous batching over one back end's step graph (see the module docstring)."""

    def __init__(self, plan: Plan, backend: Backend, tokenizer: Any, stop_ids: tuple[int, ...], max_seq_len: int,
                 options: BatchOptions = BatchOptions(), kv: KVOptions = KVOptions()):
        self.backend = backend
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.shape = step_shape(plan)
        self.kv_options = kv.check()
        self.config = scheduler_config(self.shape, options.check(), backend.prefill_rows)
        if kv.evicts and kv.policy().uses_scores and self.config.enable_prefix_cache:
            self.config = dataclasses.replace(self.config, enable_prefix_cache=False)
        self.max_seq_len = min(max_seq_len, self.config.capacity)
        self.evictions: list = []               # runtime/kv EvictionEvents of every sequence
        self.scheduler = self._scheduler()
        self.cond = threading.Condition(threading.RLock())
        self.requests: dict[int, Request] = {}
        self.background = False
        self.steps = 0
        self.rows_run = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step_lock = threading.Lock()      # one step at a time, whoever drives
        self._ahead: _Launched | None = None    # a step launched by the last step() call, on the device

    # -- requests -------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], options: "GenerationOptions", priority: int = 0) -> Request:
        if len(prompt) >= self.max_seq_len and not self.evicts:
            raise EngineError(f"the prompt has {len(prompt)} tokens but a sequence of this batch holds "
                              f"{self.max_seq_len}, so a prompt may have at most {self.max_seq_len - 1} (recompile "
                              "with a larger {0}, or use more of the pool: {1})", "max_seq_len", "num_blocks")
        room = self.max_seq_len - len(prompt)
        # under eviction a sequence holds at most max_seq_len entries however long it runs
        max_tokens = (options.max_tokens or self.max_seq_len) if self.evicts else min(options.max_tokens or room, room)
        with self.cond:
            rid = next(self._ids)
            req = Request(self, rid, list(prompt), options, Detokenizer(self.tokenizer), StopScan(options.stop))
            try:
                self.scheduler.add(Sequence(rid, list(prompt), max_tokens, priority=priority,
                                            stop_token_ids=frozenset() if options.ignore_eos else self.stop_ids))
            except ValueError as e:
                raise EngineError(str(e)) from None
            self.requests[rid] = req
            self.cond.notify_all()
        return req

    def abort(self, req: Request, reason: str) -> None:
        with self.cond:
            if req.done:
                return
            self.scheduler.abort(req.id)
            self._retire(req, reason)

    @property
    def busy(self) -> bool:
        with self.cond:
            return self.scheduler.has_unfinished() or self._ahead is not None

    # -- stepping -------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One step of every running sequence; False when there was nothing to run.

        On a back end whose steps run while the host goes on (async_steps), steps overlap the host:
        while the device runs step N, the scheduler plans step N + 1 with the tokens N samples
        still pending; once N's tokens are in they fill N + 1's rows, N + 1 is launched, and N's
        tokens reach their requests while N + 1 runs. So a call returns with the next step on the
        device, and a row of a sequence that N's token stops is computed and dropped."""
        with self._step_lock:
            cur, self._ahead = self._ahead, None
            if cur is None:
                with self.cond:
                    if not self.scheduler.has_unfinished():
                        return False
                    plan = self.scheduler.schedule()
                cur = self._launch(plan)
            nxt = self._plan_ahead() if cur.handle is not None else None
            sampled = self._collect(cur)
            with self.cond:
                finished = {s.seq_id: s for s in self.scheduler.finish(cur.plan, sampled)}
            if nxt is not None:
                self._ahead = self._launch(nxt.plan, nxt)
            self._deliver(cur, sampled, finished)
            with self.cond:
                dry = not self.scheduler.has_unfinished()
            if dry and self._ahead is not None:
                # the batch ran dry with a step of dropped rows on the device (its sequences
                # stopped): wait for it now, so that an idle batch holds nothing in flight
                self._finish_ahead()
            return True

    def _plan_ahead(self) -> _Ahead | None:
        """The next step planned while the device runs the current one (async back ends, without
        eviction, whose per-sequence state moves step by step): its rows with the pending tokens
        as PENDING_TOKEN, and the back end's work before its launch done."""
        if not self.backend.async_steps or self.scheduler.evictor is not None:
            return None
        with self.cond:
            if not self.scheduler.has_unfinished():
                return None
            plan = self.scheduler.schedule()
            if not plan.seqs:           # nothing to run until the pending tokens are in
                self.scheduler.commit(plan)
                self._count_preemptions(plan)
                return None
        flat = plan.flat(self.shape.blocks_per_seq)
        rows, live, on_device = self._rows(flat)
        return _Ahead(plan, flat, live, on_device, self.backend.prepare_step(rows, on_device))

    def _rows(self, flat: FlatBatch) -> tuple[StepRows, list, bool]:
        """The step graph's rows of a flat batch, its logit rows' requests, and whether the device
        samples them (every one greedy: its argmax, a token a row read back)."""
        # a step of prompt chunks that end no prompt samples nothing, but the graph's head
        # runs on at least one row: row 0's logits are computed and dropped
        picked = flat.logit_rows if len(flat.logit_rows) else np.zeros(1, np.int32)
        rows = StepRows(flat.tokens, flat.positions, flat.slots, flat.row_seq, flat.ctx_len,
                        flat.block_tables, picked, flat.generated, flat.score_from)
        with self.cond:
            live = [self.requests.get(rid) for rid in flat.logit_seq_ids]
            on_device = self.backend.device_argmax and len(live) > 0 and all(
                req is None or req.done or req.sampler.greedy for req in live)
        return rows, live, on_device

    def _launch(self, plan: StepPlan, ahead: _Ahead | None = None) -> _Launched:
        """Block copies, then the step on the back end (started: collect it with _collect); the
        scheduler commits it. A step planned ahead gets its pending tokens filled in first."""
        with self.cond:
            self._count_preemptions(plan)
        if plan.copies:
            self._copy_blocks(plan.copies)
        if not plan.seqs:
            with self.cond:
                self.scheduler.commit(plan)
            return _Launched(plan, None, False, None, [])
        try:
            if ahead is None:
                flat = plan.flat(self.shape.blocks_per_seq)
                rows, live, on_device = self._rows(flat)
                handle = self.backend.submit_step(rows, on_device)
            else:
                flat, live, on_device = ahead.flat, ahead.live, ahead.on_device
                self._fill_pending(plan, flat)
                handle = self.backend.launch_step(ahead.prepared, flat.tokens)
        except NonFiniteLogits:
            raise self._nonfinite(live) from None
        self.steps += 1
        self.rows_run += len(flat.tokens)
        with self.cond:
            self.scheduler.commit(plan)
        return _Launched(plan, flat, on_device, handle, live)

    @staticmethod
    def _fill_pending(plan: StepPlan, flat: FlatBatch) -> None:
        """A plan made ahead: its rows' tokens that were pending, now that finish() brought them
        (a sequence that finished meanwhile keeps PENDING_TOKEN; its row's result is dropped)."""
        row = 0
        for s in plan.seqs:
            n, seq = s.num_tokens, s.seq
            p0 = int(s.positions[0])
            if p0 + n > len(seq.prompt) and seq.state is SeqState.RUNNING and not seq.pending:
                tokens = seq.tokens(p0, p0 + n)
                s.token_ids[:] = tokens
                flat.tokens[row:row + n] = tokens
            row += n

    def _collect(self, cur: _Launched) -> dict[int, int]:
        """The launched step's result: the sampled token of each request with a logits row."""
        sampled: dict[int, int] = {}
        if cur.handle is None:
            return sampled
        try:
            out = self.backend.collect_step(cur.handle)
        except NonFiniteLogits:
            raise self._nonfinite(cur.live) from None
        with self.cond:
            for i, rid in enumerate(cur.flat.logit_seq_ids):
                req = self.requests.get(rid)
                if req is not None and not req.done:
                    sampled[rid] = int(out[i]) if cur.on_device else req.sampler.sample(
                        check_finite(out[i], len(req.tokens) + 1), req.history)
        return sampled

    @staticmethod
    def _nonfinite(live: list) -> Exception:
        first = next((r for r in live if r is not None), None)
        return nonfinite(len(first.tokens) + 1 if first else 1)

    def _count_preemptions(self, plan: StepPlan) -> None:
        for rid in plan.preempted:
            if rid in self.requests:
                self.requests[rid].preemptions += 1

    def _deliver(self, cur: _Launched, sampled: dict[int, int], finished: dict) -> None:
        """The step's tokens to their requests: text, stop strings, finish reasons."""
        with self.cond:
            for s in cur.plan.seqs:     # its first chunk starts after what the prefix cache held
                req = self.requests.get(s.seq_id)
                if req is not None and s.phase == "prefill" and not req._admitted:
                    req._admitted = True
                    req.cached_tokens = int(s.positions[0])
            for rid, token in sampled.items():
                req = self.requests.get(rid)
                if req is None:                         # closed while the step ran
                    continue
                if rid in finished and finished[rid].finish_reason is FinishReason.STOP:
                    self._retire(req, "stop")           # the stop token is not part of the reply
                    continue
                if req._token(token):                   # a stop string
                    self.scheduler.abort(rid)
                    self._retire(req, "stop")
                elif rid in finished:
                    self._retire(req, FINISH[finished[rid].finish_reason])
                else:
                    req._notify()
            self.cond.notify_all()

    def _drain(self) -> None:
        """Wait for a step still on the device and drop what it returns (closing, resetting)."""
        with self._step_lock:
            self._finish_ahead()

    def _finish_ahead(self) -> None:
        """The step on the device (under _step_lock): its tokens in and finished, none delivered."""
        cur, self._ahead = self._ahead, None
        if cur is not None:
            sampled = self._collect(cur)
            with self.cond:
                self.scheduler.finish(cur.plan, sampled)

    def run(self) -> None:
        """Step until every request is done."""
        while self.step():
            pass

    def start(self) -> None:
        """Step on a background thread while there is work (idle: it waits for a submit)."""
        with self.cond:
            if self._thread is not None:
                return
            self.background = True
            self._thread = threading.Thread(target=self._loop, name="llmrs-batcher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        with self.cond:
            self.background = self._stopping = False

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self._stopping and not self.scheduler.has_unfinished() and self._ahead is None:
                    self.cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:      # a step that fails ends every request in it, not the server
                with self.cond:
                    for req in list(self.requests.values()):
                        req.error = f"{type(e).__name__}: {e}"
                        self.scheduler.abort(req.id)
                        self._retire(req, "error")
                    # the failed step's plans were never finished: start the next request afresh
                    self._ahead = None
                    self.scheduler = self._scheduler()
                    self.cond.notify_all()

    def reset(self) -> None:
        """Forget the prefix cache (the KV rows it points at are about to be overwritten)."""
        with self.cond:
            if self.scheduler.has_unfinished():
                raise EngineError("the batch has unfinished requests; close them before its cache is reset")
        self._drain()
        with self.cond:
            self.scheduler = self._scheduler()

    def close(self) -> None:
        """Abort every request and stop the background thread."""
        with self.cond:
            for req in list(self.requests.values()):
                self.scheduler.abort(req.id)
                self._retire(req, "cancelled")
        self.stop()
        self._drain()

    # -- internals --------------------------------------------------------------------------------------
    @property
    def evicts(self) -> bool:
        return self.kv_options.evicts

    def _scheduler(self) -> Scheduler:
        sched = Scheduler(self.config)
        kv = self.kv_options
        if kv.evicts:
            monitor = LinuxSystemMonitor() if kv.memory_threshold_mb is not None else None
            if monitor is not None:
                check_threshold(kv.memory_threshold_mb, monitor.mem_stats().total)
            sched.evictor = SeqEviction(kv.policy(), self.max_seq_len, sched.kv, self.backend.kv_store(), monitor,
                                        kv.memory_threshold_mb, kv.eviction_target_ratio, self._event)
        return sched

    def _event(self, event) -> None:
        self.evictions.append(event)
        if self.kv_options.log_evictions:
            _log(event)

    def _retire(self, req: Request, reason: str) -> None:
        req._finish(reason)
        self.requests.pop(req.id, None)
        req._notify()
        self.cond.notify_all()

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.config.block_size
        src = np.concatenate([np.arange(s * bs, (s + 1) * bs) for s, _ in copies]).astype(np.int32)
        dst = np.concatenate([np.arange(d * bs, (d + 1) * bs) for _, d in copies]).astype(np.int32)
        self.backend.kv_store().copy_slots(src, dst)

    def stats(self) -> dict[str, Any]:
        kv = self.scheduler.kv.stats()
        return {"steps": self.steps, "rows": self.rows_run, "kv": kv}


__all__ = ["BatchOptions", "Batcher", "Request", "scheduler_config", "step_shape"]
