"""Prefill, then decode one token at a time, on any backend; stats measured as it goes."""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from ..options import OptionError
from .backends.base import Backend, NonFiniteLogits, StepRows
from .kv import CacheManager, StepInfo, summarize
from .sampler import Sampler

if TYPE_CHECKING:
    from .speculative import SpecStats, Speculator


class EngineError(OptionError):
    """A request the engine cannot serve: one line naming the limit and the option to change
    ({0}.. slots: a Python name in str(), a flag where a command line words it)."""


def prompt_too_long(n_tokens: int, room: int, more: bool = False) -> EngineError:
    return EngineError(f"the prompt has {n_tokens} tokens but the KV cache holds {room}{' more' if more else ''} "
                       "(recompile with a larger {0}, or evict: {1} sliding, snapkv or h2o)",
                       "max_seq_len", "eviction_policy")


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0            # request start to the first generated token
    decode_tokens: int = 0         # tokens produced by decode steps (the first comes from prefill)
    decode_s: float = 0.0
    load_s: float = 0.0
    evictions: list = field(default_factory=list)   # runtime/kv EvictionEvents of the request
    eviction_policy: str | None = None
    speculative: SpecStats | None = None            # drafted / accepted, with speculative decoding

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @staticmethod
    def peak_rss_bytes() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def report(self) -> str:
        evictions = [f"evictions         {summarize(self.evictions)} [{self.eviction_policy}]"] \
            if self.eviction_policy else []
        return "\n".join([
            f"prompt tokens     {self.prompt_tokens}",
            f"load              {self.load_s * 1e3:.0f} ms",
            f"prefill           {self.prefill_s * 1e3:.1f} ms ({self.prefill_tok_s:.1f} tok/s)",
            f"time to 1st token {self.ttft_s * 1e3:.1f} ms",
            f"decode            {self.decode_tokens} tokens in {self.decode_s * 1e3:.1f} ms "
            f"({self.decode_tok_s:.2f} tok/s)",
            f"peak memory       {self.peak_rss_bytes() / 2**20:.0f} MiB (resident)",
            *evictions,
            *([self.speculative.line()] if self.speculative is not None else []),
        ])


@dataclass
class Generation:
    tokens: list[int]                               # generated ids (stop token excluded)
    logits: list[np.ndarray] = field(default_factory=list)  # row i: what token i was drawn from
    stop_reason: str = "length"                     # length | stop token | cache full
    stats: Stats = field(default_factory=Stats)
    notice: str | None = None                       # one line for the user (why it stopped early)


def check_finite(logits: np.ndarray, step: int) -> np.ndarray:
    """Refuse a row with NaN or inf: sampling it would silently give a token (argmax of NaN is 0).
    One sum over the row (f64: a sum of finite f32 values cannot overflow) is the whole cost."""
    with np.errstate(invalid="ignore"):     # inf - inf: the NaN is the answer, not a warning
        total = np.sum(logits, dtype=np.float64)
    if not np.isfinite(total):
        raise nonfinite(step)
    return logits


def nonfinite(step: int) -> EngineError:
    return EngineError(f"step {step}{' (prefill)' if step == 0 else ''}: the logits are NaN/inf — the model "
                       "file is corrupt or badly converted (llmrs-check PLAN compares every kernel)")


def cache_full_notice(max_seq_len: int) -> str:
    return (f"the KV cache is full ({max_seq_len} slots); go on with "
            f"--eviction-policy sliding|snapkv|h2o, or recompile with a larger --max-seq-len")


class Engine:
    """Owns the positions: n_past (cache slots used; shrinks when `cache`, a runtime/kv
    CacheManager, evicts) and start_pos (RoPE position, only grows)."""

    def __init__(self, backend: Backend, prefill_T: int, max_seq_len: int, stop_ids: tuple[int, ...] = (),
                 cache: CacheManager | None = None):
        """prefill_T: the prefill graph's tokens a step; the prompt is fed in steps of that, or of
        the back end's prefill_rows where that is fewer."""
        self.backend = backend
        self.prefill_T = min(prefill_T, backend.prefill_rows or prefill_T)
        self.max_seq_len = max_seq_len
        self.stop_ids = set(stop_ids)
        self.cache = cache
        self.n_past = 0
        self.start_pos = 0
        self.speculator: Speculator | None = None    # set by the Model: drafts verified in one step
        self.use_step_graph(None)

    @property
    def evicts(self) -> bool:
        return self.cache is not None and self.cache.evicts

    def reset(self) -> None:
        self.backend.reset()
        self.n_past = self.start_pos = 0
        if self.cache is not None:
            self.cache.reset()

    def rewind(self, n_past: int) -> None:
        """Keep the first n_past cached tokens and drop the rest: the next step writes over the
        slots after them (a backend keeps no other state). Only while every token fed is still
        cached (slot i holds position i), as after any run without eviction."""
        if self.evicts:     # its policy's scores and positions would describe dropped slots
            raise EngineError("cannot rewind a KV cache under an eviction policy (reset it instead)")
        if self.n_past != self.start_pos or not 0 <= n_past <= self.n_past:
            raise EngineError(f"cannot rewind the KV cache to {n_past} tokens: it holds {self.n_past} "
                              f"of the {self.start_pos} fed (reset it instead)")
        self.n_past = self.start_pos = n_past

    def _step(self, phase: str, tokens: np.ndarray, argmax: bool = False, prompt_left: int = 0,
              first_chunk: bool = False) -> np.ndarray:
        n = len(tokens)
        if self.cache is not None:
            self.n_past = self.cache.make_room(self.n_past, n)
            self.cache.before_step(StepInfo(phase, self.n_past, n, prompt_left, first_chunk, self.max_seq_len))
        run = self.backend.run_argmax if argmax else self.backend.run
        out = run(phase, tokens, self.n_past, self.start_pos)
        if self.cache is not None:
            self.cache.record_step(self.n_past, self.start_pos, n)
        self.n_past += n
        self.start_pos += n
        return out[-1]

    def prefill(self, tokens: list[int], argmax: bool = False) -> np.ndarray:
        """Feed the prompt in chunks of prefill_T; logits of its last position
        (or, with argmax, the greedy token chosen on the device). With eviction a prompt may be
        longer than the cache: chunks then fit what the policy's budget leaves free."""
        if not tokens:
            raise EngineError("the prompt is empty")
        chunk = self.prefill_T
        if self.n_past + len(tokens) > self.max_seq_len:
            if not self.evicts:
                raise prompt_too_long(len(tokens), self.max_seq_len - self.n_past, more=True)
            chunk = min(chunk, self.max_seq_len - self.cache.budget)
        ids = np.asarray(tokens, dtype=np.int32)
        for s in range(0, len(ids), chunk):
            part = ids[s:s + chunk]
            left = len(ids) - s - len(part)
            out = self._step("prefill", part, argmax, left, s == 0)
            if self.cache is not None:
                self.n_past = self.cache.after_step(self.n_past, after_prefill=left == 0)
        return out

    def decode_one_token(self, token: int, argmax: bool = False) -> np.ndarray:
        out = self._step("decode", np.array([token], dtype=np.int32), argmax)
        if self.cache is not None:
            self.n_past = self.cache.after_step(self.n_past)
        return out

    # -- speculative decoding (runtime/speculative) ---------------------------------------------------
    def verify_room(self, rows: int) -> int:
        """The most rows (1..rows) a verify step may feed now: the step graph's logit rows, and only
        rows that decoding one token at a time would run with nothing evicted or scored between."""
        shape = self._step_shape
        if shape is None or self.speculator is None:
            return 1
        rows = min(rows, shape.logits, shape.rows, self.max_seq_len - self.n_past)
        if self.backend.verify_graph:
            rows = min(rows, self.backend.graphs["verify"].T)
        if self.cache is not None:
            rows = self.cache.plain_rows(self.n_past, rows)
        return max(rows, 1)

    def verify(self, tokens: Sequence[int], argmax: bool = False) -> np.ndarray:
        """Feed tokens (the last emitted one, then the drafts) in one step of the step graph at the
        next slots and positions: f32 [len(tokens), vocab], row i the logits after tokens[i] (with
        argmax: int32 [len(tokens)], each row's greedy token, from the back end's argmax).
        Nothing is committed: advance() keeps rows one at a time, and the rest are written over."""
        n = len(tokens)
        room = self.verify_room(n)
        if not 1 <= n <= room:
            raise EngineError(f"a verify step of {n} tokens does not fit here (at most {room})")
        if self.cache is not None:
            self.cache.before_step(StepInfo("decode", self.n_past, n, 0, False, self.max_seq_len))
        if self.backend.verify_graph:     # decode's kernels, row by row (OpenCL)
            run = self.backend.run_argmax if argmax else self.backend.run
            return run("verify", np.asarray(tokens, np.int32), self.n_past, self.start_pos)
        at = np.arange(n, dtype=np.int32)
        rows = StepRows(tokens=np.asarray(tokens, np.int32), positions=self.start_pos + at, slots=self.n_past + at,
                        row_seq=np.zeros(n, np.int32), ctx_len=self.n_past + 1 + at,
                        block_tables=self._identity_table, logit_rows=at)
        return self.backend.run_step_argmax(rows) if argmax else self.backend.run_step(rows)

    def advance(self) -> None:
        """Commit the next row of the last verify step, as a decode step of its token would have."""
        if self.cache is not None:
            self.cache.record_step(self.n_past, self.start_pos, 1)
        self.n_past += 1
        self.start_pos += 1
        if self.cache is not None:
            self.n_past = self.cache.after_step(self.n_past)

    def _speculate(self, token: int, draft, sampler: Sampler, history: list[int], stats: SpecStats,
                   step: int, on_device: bool) -> list[tuple[int, np.ndarray | None]]:
        """One verify step of `token` and the drafts: the tokens it yields (the kept drafts, then
        the replacement of the first refused or a bonus token), each with its logits row (None
        where on_device: greedy, each row's token from the back end's argmax, no logits read)."""
        spec = self.speculator
        rows = self.verify([token, *draft.tokens], argmax=on_device)
        if on_device:       # greedy keeps a draft exactly when it is its row's argmax
            n = 0
            while n < len(draft.tokens) and draft.tokens[n] == rows[n]:
                n += 1
            kept, rows = [*draft.tokens[:n], int(rows[n])], [None] * (n + 1)
        else:
            verdict = spec.judge(sampler, rows, draft.tokens, draft.q, history, step)
            kept = [*verdict.accepted, verdict.token]
        spec.update(len(draft.tokens), len(kept) - 1)
        stats.drafted += len(draft.tokens)
        stats.accepted += len(kept) - 1
        stats.steps += 1
        return [(t, rows[i]) for i, t in enumerate(kept)]

    def use_step_graph(self, shape) -> None:
        """The plan's step graph shape (runtime/plan.py StepShape), read by verify steps: a
        sequence alone with the identity block table sees the contiguous cache."""
        self._step_shape = shape
        self._identity_table = None if shape is None else np.arange(shape.blocks_per_seq, dtype=np.int32)[None]

    def generate(self, prompt: list[int], max_new_tokens: int, sampler: Sampler,
                 on_token: Callable[[int], None] | None = None, keep_logits: bool = False) -> Generation:
        gen = Generation(tokens=[])
        for token in self.stream(prompt, max_new_tokens, sampler, gen, keep_logits):
            if on_token:
                on_token(token)
        return gen

    def stream(self, prompt: list[int], max_new_tokens: int, sampler: Sampler, gen: Generation,
               keep_logits: bool = False, context: Sequence[int] = (), ignore_eos: bool = False) -> Iterator[int]:
        """generate, as a generator: yields each token as it is chosen and keeps `gen` (tokens,
        stop reason, stats) current, so a caller may stop between tokens by closing it. `context`:
        the tokens already cached before `prompt` (the repetition penalty looks back over them).
        ignore_eos: a stop token is emitted like any other."""
        if max_new_tokens < 1:
            raise EngineError(f"{{0}} must be at least 1, got {max_new_tokens}", "max_tokens")
        st = gen.stats
        st.prompt_tokens = len(prompt)
        if self.cache is not None:
            st.eviction_policy = self.cache.policy.name
            seen = len(self.cache.events)
        spec = self.speculator
        stop_ids = () if ignore_eos else self.stop_ids
        if spec is not None:
            st.speculative = spec.start(sampler.cfg)
        on_device = sampler.greedy and not keep_logits and self.backend.device_argmax
        t0 = time.perf_counter()
        try:
            logits = self.prefill(prompt, on_device)
        except NonFiniteLogits:     # a back end's argmax found it: named as the host's check names it
            raise nonfinite(0) from None
        st.prefill_s = time.perf_counter() - t0
        history = [*context, *prompt]
        t_dec = None
        # chosen tokens not yet emitted, each with the logits it was drawn from; `verified`: they
        # come from a verify step, whose row for the token before each is committed as it is emitted
        queue: list[tuple[int, np.ndarray | None]] = []
        verified = False
        try:
            while True:
                if not queue:
                    # a device argmax returns no logits to look at; every row sampled here is checked
                    token = int(logits) if on_device else sampler.sample(check_finite(logits, len(gen.tokens)), history)
                    queue, verified = [(token, None if on_device else logits)], False
                token, row = queue.pop(0)
                if verified:
                    self.advance()
                if keep_logits:
                    gen.logits.append(np.asarray(row, np.float32).copy())
                if not gen.tokens:
                    st.ttft_s = time.perf_counter() - t0
                if token in stop_ids:
                    gen.stop_reason = "stop token"
                    gen.logits = gen.logits[:len(gen.tokens)]
                    break
                gen.tokens.append(token)
                history.append(token)
                yield token
                if len(gen.tokens) >= max_new_tokens:
                    break
                if queue:
                    continue
                if self.n_past >= self.max_seq_len and not self.evicts:
                    gen.stop_reason = "cache full"
                    gen.notice = cache_full_notice(self.max_seq_len)
                    break
                t_dec = t_dec or time.perf_counter()
                k = 0 if spec is None else min(spec.next_k(), max_new_tokens - len(gen.tokens) - 1,
                                               self.verify_room(spec.k_max + 1) - 1)
                draft = spec.drafter.propose(history, k) if k > 0 else None
                if draft is not None and draft.tokens:
                    queue = self._speculate(token, draft, sampler, history, st.speculative, len(gen.tokens),
                                            on_device)
                    verified = True
                    st.decode_tokens += len(queue)
                else:
                    if spec is not None:
                        st.speculative.plain += 1
                    logits = self.decode_one_token(token, on_device)
                    st.decode_tokens += 1
                st.decode_s = time.perf_counter() - t_dec  # per step: a closed stream keeps its stats
        except NonFiniteLogits:     # a decode or verify step's argmax: the step being chosen
            raise nonfinite(len(gen.tokens)) from None
        finally:   # a stream closed early keeps its stats too
            if self.cache is not None:
                st.evictions = self.cache.events[seen:]
        return gen
