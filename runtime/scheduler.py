"""Continuous batching: which tokens of which sequences fill the next step of the step graph.

The serving engine runs one step graph of up to T token rows, each row with its own sequence,
RoPE position and KV slot (DESIGN.md, "Many sequences, one graph"). Every step the Scheduler
picks the rows under a per-step token budget (max_batched_tokens: the graph's T) and a cap on
running sequences (max_num_seqs): one token for each running sequence that is decoding, and
chunks of prompts (chunked prefill) in what is left. It owns the BlockManager
(runtime/kv/paged.py), so the StepPlan it returns carries each row's KV slot, each sequence's
block table and the block copies to do before the step; update() takes the sampled tokens back.

Decodes first, in the budget. Before anything is placed, one row per decoding sequence (the
top-ranked ones, if there are more than T) is held back from the budget: a prompt chunk only
takes what the decodes leave, because the step's latency is what every running sequence waits
for between tokens. In the plan, decode rows come first, then prompt chunks.

Blocks and seats by rank. Sequences are ranked by (priority DESC, arrival ASC), a fixed total
order, and one pass in that order gives each its rows and blocks. A chunk shrinks to the blocks
there are; only when not one token fits does the sequence preempt, lowest-ranked first, a running
sequence with no rows in this step: a running sequence any ranked below it, a waiting sequence
(for blocks or for a seat) only one of lower priority, so that equal-priority requests are
first come, first served without undoing work already running. A running sequence that gets no
block keeps its KV and simply has no row this step.

Why every sequence finishes. Preemption only flows down the ranking, so it cannot cycle: the
top-ranked unfinished sequence is never preempted. If it runs, it is placed first and may take
every block (add() refuses a request that could not fit the pool alone), so it gets rows each
step unless the held-back decodes took the whole budget, and they finish. If it waits, the
running sequences still get rows (the top running one may preempt all below it) and finish,
while no waiting sequence ranked below it is admitted ahead of it (head-of-line), so it gets in.
The tests assert that every step with work left schedules rows, and run random traffic on pools
that hold the biggest request and little more.

Preemption is by recompute (vLLM's default): the victim's blocks are freed and it waits again
with its prompt and the outputs so far as the tokens to compute, its outputs kept. The prefix
cache usually makes the recompute cheap: its full blocks were hashed as they were committed and
stay findable until the pool needs them. (Swapping KV out to host memory needs a copy engine in
the back ends; SWAPPED is a state the Sequence knows, but no preemption mode uses it yet.)

Positions. A sequence's tokens are its prompt then its outputs; num_computed of them have KV.
Row r of a sequence's chunk is token num_computed + r at RoPE position num_computed + r, and it
attends over the sequence's KV entries 0..kv_start + r (ctx_len = kv_start + r + 1). Without
eviction kv_start == num_computed; the two are kept apart so compaction can shrink the KV
without renumbering positions.

Eviction (an `evictor`, runtime/kv/perseq.py SeqEviction): each sequence is evicted on its own,
by its KV entry count, as the single-sequence Engine evicts its cache. Before a sequence's rows
are placed its prompt chunk is capped so it cannot overflow the sequence's slots and room is
made ("full"); after the step (its rows committed) the policy's budget and memory pressure may
compact it. Compaction frees blocks at once, and its row moves are done by then, before the
plan's block copies and the step itself. A request may then ask for more tokens than its slots
or the pool: it holds at most `slots` entries at any time.
"""
from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from ..options import OptionError, option, whole
from .kv.paged import BlockManager
from .kv.store import NEVER
from .kv.policy import StepInfo

PREEMPTION_MODES = ("recompute",)
PENDING_TOKEN = 0      # a row's token id while the step that samples it runs (Batcher fills it before its step)


class SchedulerError(RuntimeError):
    """The scheduler used out of order (a stale plan, a missing sample): a bug in the caller."""


class SeqState(enum.Enum):
    WAITING = "waiting"      # queued: no KV, or preempted and to be recomputed
    RUNNING = "running"      # holds KV blocks, gets rows
    SWAPPED = "swapped"      # KV moved out of the pool (no preemption mode does this yet)
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"            # a stop token was sampled (it is the last output)
    LENGTH = "length"        # max_tokens outputs
    ABORT = "abort"          # aborted (a client went away)


_NEXT = {SeqState.WAITING: {SeqState.RUNNING, SeqState.FINISHED},
         SeqState.RUNNING: {SeqState.WAITING, SeqState.SWAPPED, SeqState.FINISHED},
         SeqState.SWAPPED: {SeqState.RUNNING, SeqState.WAITING, SeqState.FINISHED},
         SeqState.FINISHED: set()}


@dataclass(eq=False)
class Sequence:
    """One request: its prompt, what it has generated, where it stands."""
    seq_id: Hashable
    prompt: list[int]
    max_tokens: int
    priority: int = 0                                   # higher first
    stop_token_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    state: SeqState = SeqState.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0      # tokens (prompt then output) whose KV is in the cache
    arrival: int = -1          # set by Scheduler.add: ties in priority go to the earlier one
    num_preemptions: int = 0
    pending: int = 0           # outputs a committed step samples that finish() has not brought yet

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def remaining(self) -> int:
        """Tokens to feed before the next sample (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def rank(self) -> tuple[int, int]:
        return (-self.priority, self.arrival)

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """Tokens start..end-1 of prompt + output, without building the whole list; a pending
        output reads PENDING_TOKEN until finish() brings it."""
        end = self.num_tokens if end is None else end
        p, known = len(self.prompt), len(self.prompt) + len(self.output)
        if end > known:
            return self.tokens(start, known) + [PENDING_TOKEN] * (end - max(start, known))
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p:end - p]
        return self.prompt[start:] + self.output[:end - p]

    def set_state(self, new: SeqState) -> None:
        if new not in _NEXT[self.state]:
            raise SchedulerError(f"sequence {self.seq_id!r}: no transition {self.state.value} -> {new.value}")
        self.state = new


@dataclass(frozen=True)
class SchedulerConfig:
    """How many sequences and tokens a step takes, and the KV pool; each field is a flag of its name."""
    max_num_seqs: int = option(64, "most sequences running at once (default 64)", metavar="N")
    max_batched_tokens: int = option(512, "most token rows in one step: the step graph's T (default 512)",
                                     metavar="T")
    block_size: int = option(16, "KV rows per block of the paged cache (default 16)", metavar="N")
    num_blocks: int = option(1024, "KV blocks in the pool (default 1024)", metavar="N")
    enable_prefix_cache: bool = option(True, "share the KV of equal prompt prefixes across requests")
    preemption: str = option("recompute", "what a preempted sequence loses: recompute (its KV, rebuilt later)",
                             choices=PREEMPTION_MODES)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_batched_tokens", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not whole(value) or value < 1:
                raise OptionError(f"{{0}} must be a whole number of at least 1, got {value!r}", name)
        if self.preemption not in PREEMPTION_MODES:
            raise OptionError(f"{{0}} {self.preemption!r} is not supported; use recompute", "preemption")

    @property
    def capacity(self) -> int:
        """KV entries the pool holds."""
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's rows in a step."""
    seq: Sequence
    phase: str                 # decode | prefill
    token_ids: np.ndarray      # int32 [n]
    positions: np.ndarray      # int32 [n]: RoPE positions
    slots: np.ndarray          # int32 [n]: pool rows its K/V are stored at
    kv_start: int              # KV index of the first row: row r attends over entries 0..kv_start + r
    block_table: np.ndarray    # int32 [blocks]
    needs_logits: bool         # its last row is sampled (the chunk ends the prompt, or a decode)
    score_from: int | None = None   # KV index from which its rows add eviction scores (None: no row)

    @property
    def seq_id(self) -> Hashable:
        return self.seq.seq_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class FlatBatch:
    """A StepPlan as the step graph takes it: T rows, B block-table rows."""
    tokens: np.ndarray         # int32 [T]
    positions: np.ndarray      # int32 [T]
    slots: np.ndarray          # int32 [T]: kv_store's destination rows
    row_seq: np.ndarray        # int32 [T]: the row's index into block_tables
    block_tables: np.ndarray   # int32 [B, max_blocks], padded with block 0
    ctx_len: np.ndarray        # int32 [T]: KV entries row t attends, its own included
    logit_rows: np.ndarray     # int32 [R]: rows whose logits are sampled
    logit_seq_ids: list        # [R]: the sequence of each
    score_from: np.ndarray     # int32 [T]: row t adds eviction scores if its KV index >= this (NEVER: no)
    generated: np.ndarray      # int32 [T]: 1 where the row's token was sampled, 0 the prompt's (StepRows)


@dataclass(frozen=True)
class StepPlan:
    """The next step: rows per sequence, block copies to do first, who was preempted to make room."""
    step: int
    seqs: list[ScheduledSeq]
    copies: list[tuple[int, int]]     # (src_block, dst_block), in this order, before the step
    preempted: list[Hashable]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def flat(self, max_blocks: int | None = None) -> FlatBatch:
        """The rows concatenated in plan order; max_blocks (default: the longest table) is the
        block-table width the graph was compiled for."""
        width = max((len(s.block_table) for s in self.seqs), default=0)
        max_blocks = width if max_blocks is None else max_blocks
        if width > max_blocks:
            raise SchedulerError(f"a block table of {width} blocks does not fit max_blocks {max_blocks}")
        tables = np.zeros((len(self.seqs), max_blocks), dtype=np.int32)
        for b, s in enumerate(self.seqs):
            tables[b, :len(s.block_table)] = s.block_table
        cat = lambda arrays: np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)  # noqa: E731
        # per sequence Python ints, spread over its rows by one np.repeat a field: a step of many
        # one-row decodes would otherwise pay a few small arrays a sequence, every step
        lengths = [s.num_tokens for s in self.seqs]
        per_seq = lambda values: np.repeat(np.array(values, dtype=np.int64), lengths)  # noqa: E731
        ends = np.cumsum(lengths)
        logits = [(int(e) - 1, s.seq_id) for s, e in zip(self.seqs, ends) if s.needs_logits]
        positions = cat([s.positions for s in self.seqs])
        # row r of a sequence attends over its entries 0..kv_start + r
        row_in_seq = np.arange(len(positions)) - per_seq([int(e) - n for e, n in zip(ends, lengths)])
        return FlatBatch(
            tokens=cat([s.token_ids for s in self.seqs]),
            positions=positions,
            slots=cat([s.slots for s in self.seqs]),
            row_seq=per_seq(range(len(self.seqs))).astype(np.int32),
            block_tables=tables,
            ctx_len=(per_seq([s.kv_start + 1 for s in self.seqs]) + row_in_seq).astype(np.int32),
            logit_rows=np.array([r for r, _ in logits], dtype=np.int32),
            logit_seq_ids=[sid for _, sid in logits],
            score_from=per_seq([NEVER if s.score_from is None else s.score_from for s in self.seqs]).astype(np.int32),
            # a recomputed (preempted) sequence's sampled tokens stay generated rows, so they
            # are summed as when they were first decoded
            generated=(positions >= per_seq([len(s.seq.prompt) for s in self.seqs])).astype(np.int32))


class Scheduler:
    """Waiting and running sequences, the KV pool, and the step loop:
    plan = schedule(); run plan on the model; finished = update(plan, {seq_id: token}).
    update() is commit(plan) (the step is launched with its rows' tokens) then finish(plan,
    sampled) (its tokens are in); a caller whose steps run while it goes on may schedule() the
    next step between the two (runtime/batch.py)."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_cache)
        self.evictor = None     # runtime/kv/perseq.SeqEviction over self.kv, set by the batch that evicts
        self._seqs: dict[Hashable, Sequence] = {}       # every unfinished sequence
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._arrivals = 0
        self._step = 0
        self._in_flight: StepPlan | None = None        # scheduled, not yet committed
        self._committed: deque[StepPlan] = deque()     # committed, their sampled tokens to come

    # ---- requests -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request; a one-line ValueError if it is malformed or can never fit the pool."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"request {seq.seq_id!r} is already queued or running; give each request its own id")
        if not seq.prompt or not all(whole(t) and t >= 0 for t in seq.prompt):
            raise ValueError(f"request {seq.seq_id!r}: the prompt must be a non-empty list of token ids")
        if not whole(seq.max_tokens) or seq.max_tokens < 1:
            raise ValueError(f"request {seq.seq_id!r}: max_tokens must be at least 1, got {seq.max_tokens!r}")
        if not whole(seq.priority):
            raise ValueError(f"request {seq.seq_id!r}: priority must be a whole number, got {seq.priority!r}")
        if seq.state is not SeqState.WAITING or seq.output or seq.num_computed:
            raise ValueError(f"request {seq.seq_id!r} has already run; add a new Sequence")
        need, cap = len(seq.prompt) + seq.max_tokens, self.config.capacity
        if self.evictor is not None:        # it never holds more than its slots
            need = min(need, self.evictor.slots)
        if need > cap:
            raise ValueError(f"request {seq.seq_id!r}: prompt {len(seq.prompt)} + max_tokens {seq.max_tokens} = "
                             f"{need} tokens, more than the KV pool's {cap} ({self.config.num_blocks} blocks of "
                             f"{self.config.block_size}); raise --num-blocks or --block-size, or ask for fewer tokens")
        seq.prompt = [int(t) for t in seq.prompt]
        seq.stop_token_ids = frozenset(int(t) for t in seq.stop_token_ids)
        seq.arrival = self._arrivals
        self._arrivals += 1
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)

    def abort(self, seq_id: Hashable) -> bool:
        """Finish seq_id now and free its blocks (a client went away); False if it is not live.
        Safe between schedule() and update() / finish(): they skip it; the step that is running
        may still write its rows, into blocks whose next holder's step runs after it."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        return True

    def get(self, seq_id: Hashable) -> Sequence | None:
        return self._seqs.get(seq_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Choose the next step's rows (decodes, then prompt chunks), preempting where it must.
        Allowed once the last plan is committed, before its finish(): a sequence whose sampled
        token is still pending gets its decode row with PENDING_TOKEN (the caller fills it in
        before running the step), unless that token ends it by length."""
        if self._in_flight is not None:
            raise SchedulerError(f"schedule() again before update() of step {self._in_flight.step}")
        step = _Step(self.config.max_batched_tokens)
        ranked = sorted(self._running + self._waiting, key=lambda s: s.rank)
        decoding = [s.seq_id for s in ranked if s.state is SeqState.RUNNING and s.remaining == 1
                    and len(s.output) + s.pending < s.max_tokens]
        step.granted = set(decoding[:step.budget])
        admitting = True
        for seq in ranked:
            if seq.seq_id in step.preempted:
                continue
            if seq.state is SeqState.WAITING:
                if seq.pending:             # preempted while its token is on its way: after finish()
                    continue
                if admitting and step.free_budget:
                    admitting = self._admit(step, seq)
            elif seq.remaining == 1:
                if seq.seq_id in step.granted:
                    step.granted.discard(seq.seq_id)
                    self._add_rows(step, seq, "decode", self._reserve(step, seq, self._room(seq, 1)))
            elif step.free_budget:
                n = self._room(seq, min(seq.remaining, step.free_budget))
                self._add_rows(step, seq, "prefill", self._reserve(step, seq, n))
        self._step += 1
        plan = StepPlan(self._step, step.decodes + step.prefills, step.copies, list(step.preempted))
        self._in_flight = plan
        return plan

    def update(self, plan: StepPlan, sampled: dict[Hashable, int]) -> list[Sequence]:
        """The step ran: record what it computed, append the sampled tokens (one per row group with
        logits), finish sequences on a stop token or max_tokens. Returns those finished now.
        commit() then finish(): a caller that runs steps back to back calls the two itself."""
        self.commit(plan)
        return self.finish(plan, sampled)

    def commit(self, plan: StepPlan) -> None:
        """The step is on its way with every row's token id: record the KV entries it writes (the
        prefix cache hashes the blocks they fill); each sequence it samples for has a pending token
        until finish(plan). The next schedule() may come before that finish()."""
        if plan is not self._in_flight:
            raise SchedulerError(f"commit() / update() takes the plan of the last schedule() (step {self._step}), "
                                 f"got step {plan.step}")
        self._in_flight = None
        if plan.seqs:                  # a plan of no rows has nothing to finish
            self._committed.append(plan)
        memory_low = self.evictor is not None and self.evictor.memory_low()
        for rows in plan.seqs:
            seq = rows.seq
            if seq.state is not SeqState.RUNNING:          # aborted while the step was planned
                continue
            self.kv.commit(seq.seq_id, rows.token_ids.tolist())
            seq.num_computed += rows.num_tokens
            if self.evictor is not None:
                self.evictor.record(seq.seq_id, rows.kv_start, int(rows.positions[0]), rows.num_tokens)
                self.evictor.after_step(seq.seq_id, self.kv.num_slots(seq.seq_id),
                                        rows.phase == "prefill" and rows.needs_logits, memory_low)
            if rows.needs_logits:
                seq.pending += 1

    def finish(self, plan: StepPlan, sampled: dict[Hashable, int]) -> list[Sequence]:
        """The committed step ran: its sampled tokens (one per sequence with a logits row) join
        their outputs; a stop token or max_tokens finishes a sequence. Returns those finished now.
        Plans finish in the order they were committed."""
        if not plan.seqs:
            return []
        if not self._committed or plan is not self._committed[0]:
            raise SchedulerError(f"finish() takes the oldest committed plan, got step {plan.step}")
        self._committed.popleft()
        wanted = {s.seq_id for s in plan.seqs if s.needs_logits}
        extra = set(sampled) - wanted
        if extra:
            raise SchedulerError(f"sampled tokens for sequences with no logits row: {sorted(map(repr, extra))}")
        finished = []
        for rows in plan.seqs:
            if not rows.needs_logits:
                continue
            seq = rows.seq
            seq.pending = max(0, seq.pending - 1)
            # aborted while the step ran; one preempted since the commit still takes its token
            if seq.state is SeqState.FINISHED or seq.seq_id not in self._seqs:
                continue
            if seq.seq_id not in sampled:
                raise SchedulerError(f"no sampled token for sequence {seq.seq_id!r}, whose last row has logits")
            token = int(sampled[seq.seq_id])
            seq.output.append(token)
            if token in seq.stop_token_ids:
                self._finish(seq, FinishReason.STOP)
            elif len(seq.output) >= seq.max_tokens:
                self._finish(seq, FinishReason.LENGTH)
            else:
                continue
            finished.append(seq)
        return finished

    # ---- internals ------------------------------------------------------------------------------
    def _admit(self, step: _Step, seq: Sequence) -> bool:
        """Start a waiting sequence with its first chunk; False (stop admitting) if it cannot."""
        if len(self._running) >= self.config.max_num_seqs:
            victim = self._victim(step, seq)
            if victim is None:
                return False
            self._preempt(step, victim)
        seq.num_computed = self.kv.allocate(seq.seq_id, seq.tokens())
        if self.evictor is not None:
            self.evictor.start(seq.seq_id, seq.num_computed)
        n = self._reserve(step, seq, self._room(seq, min(seq.remaining, step.free_budget)))
        if n == 0:
            self.kv.free(seq.seq_id)
            if self.evictor is not None:
                self.evictor.forget(seq.seq_id)
            seq.num_computed = 0
            return False
        seq.set_state(SeqState.RUNNING)
        self._waiting.remove(seq)
        self._running.append(seq)
        self._add_rows(step, seq, "prefill", n)
        return True

    def _room(self, seq: Sequence, n: int) -> int:
        """Under eviction: n capped so the chunk cannot overflow the sequence's slots, and room made
        for it (the sequence compacted now, before any block of this step is placed)."""
        if self.evictor is None:
            return n
        n_past = self.kv.num_slots(seq.seq_id)
        n = self.evictor.chunk(seq.seq_id, n_past, seq.remaining, n)
        self.evictor.make_room(seq.seq_id, n_past, n)
        return n

    def _reserve(self, step: _Step, seq: Sequence, n: int) -> int:
        """How many of n tokens seq gets blocks for: as many as fit now; if not one fits, preempt
        the running sequences below it, lowest first, until one does (0: none would)."""
        while True:
            fit = self.kv.max_append(seq.seq_id, n)
            if fit:
                return fit
            victim = self._victim(step, seq)
            if victim is None:
                return 0
            self._preempt(step, victim)

    def _victim(self, step: _Step, seq: Sequence) -> Sequence | None:
        """The lowest-ranked running sequence with no rows in this step that seq may preempt: any
        ranked below a running seq; only one of lower priority for a waiting seq (one of equal
        priority that arrived later waits its turn rather than undo work already running)."""
        if seq.state is SeqState.RUNNING:
            below = lambda s: s.rank > seq.rank  # noqa: E731
        else:
            below = lambda s: s.priority < seq.priority  # noqa: E731
        can = [s for s in self._running if s is not seq and s.seq_id not in step.scheduled and below(s)]
        return max(can, key=lambda s: s.rank, default=None)

    def _preempt(self, step: _Step, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        if self.evictor is not None:
            self.evictor.forget(seq.seq_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.set_state(SeqState.WAITING)
        self._running.remove(seq)
        self._waiting.append(seq)
        step.preempted[seq.seq_id] = None
        step.granted.discard(seq.seq_id)

    def _add_rows(self, step: _Step, seq: Sequence, phase: str, n: int) -> None:
        if n == 0:
            return
        kv_start = self.kv.num_slots(seq.seq_id)
        slots, copies = self.kv.append_slots(seq.seq_id, n)
        start = seq.num_computed
        score_from = None
        if self.evictor is not None:
            first_chunk = phase == "prefill" and start == 0
            score_from = self.evictor.before_step(seq.seq_id, StepInfo(
                phase, kv_start, n, seq.remaining - n if phase == "prefill" else 0, first_chunk,
                self.evictor.slots), slots)
        (step.decodes if phase == "decode" else step.prefills).append(ScheduledSeq(
            seq, phase, np.array(seq.tokens(start, start + n), dtype=np.int32),
            np.arange(start, start + n, dtype=np.int32), slots, kv_start,
            np.array(self.kv.table(seq.seq_id).blocks, dtype=np.int32), start + n == seq.num_tokens, score_from))
        step.copies += copies
        step.scheduled.add(seq.seq_id)
        step.budget -= n

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)
        if self.evictor is not None:
            self.evictor.forget(seq.seq_id)
        (self._running if seq.state is SeqState.RUNNING else self._waiting).remove(seq)
        seq.finish_reason = reason
        seq.set_state(SeqState.FINISHED)
        del self._seqs[seq.seq_id]


@dataclass
class _Step:
    """A plan being built."""
    budget: int                                           # token rows left
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    scheduled: set = field(default_factory=set)
    preempted: dict = field(default_factory=dict)         # an ordered set of seq ids
    granted: set = field(default_factory=set)             # decodes whose row the budget holds back

    @property
    def free_budget(self) -> int:
        """Rows a prompt chunk may take: what the decodes still to come leave."""
        return self.budget - len(self.granted)
