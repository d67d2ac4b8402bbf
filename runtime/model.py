"""A loaded plan as one Python object: tokenize, stream text as it decodes, chat through the model's
own template, read logits. The Python API (`llmrs.load`), `llmrs-run --chat` and `llmrs-serve` are
all this class; each only translates its own inputs into these calls.

A Model keeps its KV cache between calls. A prompt that starts with the tokens already fed (the
same conversation, one turn longer) prefills only what is new; one that diverges rewinds the cache
to the common prefix. Under an eviction policy a conversation goes on past the cache: a prompt that
extends all that was fed prefills only its new suffix, at RoPE positions that keep growing, while
one that diverges resets the cache and is prefilled whole (the policy's slots and scores describe
everything fed, so there is no prefix to rewind to). Invariant: the engine has been fed
`self._tokens[:engine.start_pos]`.
One generation runs at a time: starting another in the same thread closes the one in progress; from
another thread it is refused (EngineError) while that one is unfinished. Each step holds the model's
lock, so a Completion may be stepped, or closed, from any thread.
"""
from __future__ import annotations

import os
import re
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .chat import ChatTemplate, ChatTemplateError, from_manifest
from ..options import OptionError, OptionTypeError, option_names, whole
from .backends import BACKENDS, Backend, BackendOptions, open_backend
from .batch import BatchOptions, Batcher, Request
from .text import Detokenizer, StopScan
from .engine import Engine, EngineError, Generation, Stats, prompt_too_long
from .kv import KVOptions, cache_manager
from .plan import Plan
from .sampler import Sampler, SamplerConfig
from .speculative import Speculator, SpeculativeOptions
from .speculative.build import make_speculator

_BACKEND_NAMES = option_names(BackendOptions)
_BATCH_NAMES = option_names(BatchOptions)
_SPEC_NAMES = option_names(SpeculativeOptions)
LOAD_OPTIONS = _BACKEND_NAMES + option_names(KVOptions) + _BATCH_NAMES + _SPEC_NAMES  # Model.load's keywords but backend


class TextRepairWarning(UserWarning):
    """Text that was not valid Unicode reached the tokenizer and was repaired."""


# a surrogate pair (a str built from UTF-16 halves), else a lone surrogate
_SURROGATES = re.compile("[\ud800-\udbff][\udc00-\udfff]|[\ud800-\udfff]")


def clean_text(text: str, what: str = "the text") -> str:
    """`text` as the tokenizer takes it: valid Unicode. A surrogate pair becomes the character it
    encodes; a lone surrogate (an undecodable byte read with errors="surrogateescape", or a bad
    \\u escape) becomes U+FFFD, with one TextRepairWarning naming what was replaced."""
    lone: list[str] = []

    def fix(m: re.Match) -> str:
        if len(m[0]) == 2:
            hi, lo = map(ord, m[0])
            return chr(0x10000 + ((hi - 0xD800) << 10) + lo - 0xDC00)
        code = ord(m[0])
        # surrogateescape maps byte 0xXY (>= 0x80) to U+DCXY
        lone.append(f"U+{code:04X}" + (f" from byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else ""))
        return "\ufffd"

    fixed = _SURROGATES.sub(fix, text)
    if lone:
        shown = ", ".join(lone[:3]) + (", ..." if len(lone) > 3 else "")
        warnings.warn(f"{what} is not valid Unicode: {len(lone)} lone surrogate{'s' if len(lone) > 1 else ''} "
                      f"({shown}) replaced by U+FFFD", TextRepairWarning, stacklevel=3)
    return fixed


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as taskset or a container sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads: Any, name: str = "threads") -> int | None:
    """A CPU thread count: a whole number >= 1 (None: the back end's default). More than the CPUs
    this process may use only makes every barrier wait for a thread that is not running: warned
    and capped."""
    if threads is None:
        return None
    if not whole(threads) or threads < 1:
        raise (ValueError if whole(threads) else TypeError)(
            f"{name} must be a whole number >= 1, got {threads!r}")
    cpus = usable_cpus()
    if threads > cpus:
        warnings.warn(f"{name} {threads} is more than the {cpus} CPUs this process may use: using {cpus}",
                      stacklevel=3)
        return cpus
    return int(threads)


@dataclass(frozen=True)
class GenerationOptions:
    """Everything one generation takes besides its prompt: the sampler's options and when to stop."""
    max_tokens: int | None = 256    # None: until a stop token, a stop string or a full KV cache
    temperature: float = 0.0        # 0 means greedy
    top_k: int = 0                  # 0 keeps every token
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64     # recent tokens the penalty looks at
    seed: int | None = None
    stop: tuple[str, ...] = ()      # text that ends the reply; it is not part of the reply
    ignore_eos: bool = False        # run to max_tokens past stop tokens (benchmarks: llama-batched-bench
                                    # and vLLM's ignore_eos time every stream's full length)

    def sampler_config(self) -> SamplerConfig:
        return SamplerConfig(**{name: getattr(self, name) for name in option_names(SamplerConfig)})

    def check(self) -> "GenerationOptions":
        """Raises OptionError (OptionTypeError for a wrong type) naming the first bad option."""
        if self.max_tokens is not None and not whole(self.max_tokens):
            raise OptionTypeError(f"{{0}} must be a whole number >= 1 or None, got {self.max_tokens!r}", "max_tokens")
        self.sampler_config().check()
        if self.max_tokens is not None and self.max_tokens < 1:
            raise OptionError(f"{{0}} must be a whole number of at least 1, got {self.max_tokens!r}", "max_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise OptionTypeError(f"{{0}} must be True or False, got {self.ignore_eos!r}", "ignore_eos")
        if self.ignore_eos and self.max_tokens is None:
            raise OptionError("{0} needs max_tokens: without stop tokens nothing else ends the reply", "ignore_eos")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise OptionError(f"{{0}} must be non-empty strings, got {list(self.stop)!r}", "stop")
        return self

    @classmethod
    def of(cls, stop: str | Sequence[str] | None = None, **values: Any) -> "GenerationOptions":
        """From keyword values; `stop` may be one string or several."""
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            raise OptionTypeError(f"{{0}} must be a string or a list of strings, got {stop!r}", "stop")
        stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        return cls(stop=stops, **values).check()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Completion:
    """One generation: iterate it for text pieces as they decode. Nothing runs until the first
    piece is asked for; close() stops it between two tokens. Once iteration ends:
    finish_reason is "stop" (a stop token or stop string), "length" (max_tokens or a full KV
    cache) or "cancelled" (closed early), and the counts below are final."""

    def __init__(self, model: "Model", prompt: list[int], options: GenerationOptions, keep_logits: bool = False):
        self.model = model
        self.keep_logits = keep_logits      # generation.logits: the row each token was drawn from
        self.options = options
        self.prompt: list[int] = prompt
        self.prompt_tokens = len(prompt)
        self.cached_tokens = 0          # prompt tokens already fed (kept, or evicted since), so not prefilled
        self.text = ""                  # what the pieces so far add up to
        self.finish_reason: str | None = None
        self.generation = Generation(tokens=[])
        self.thread: int | None = None      # the thread that started it
        self._closing = False
        self._steps = self._run()

    @property
    def tokens(self) -> list[int]:
        """Generated token ids (a stop token excluded)."""
        return self.generation.tokens

    @property
    def completion_tokens(self) -> int:
        return len(self.generation.tokens)

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def stats(self) -> Stats:
        return self.generation.stats

    def __iter__(self) -> "Completion":
        return self

    def __next__(self) -> str:
        while not (piece := self._step()):
            pass
        return piece

    def steps(self) -> Iterator[str]:
        """The same generation one token at a time: each item is the text that token lets out,
        often "" (held back), so a caller can look up between any two tokens. Any thread may take
        the next step (one at a time)."""
        return iter(self._step, None)   # _step's StopIteration ends it; it never returns None

    def close(self) -> None:
        """Stop after the step in progress (from any thread)."""
        self._closing = True    # seen before the next step: a lock is not fair, a stepping thread may keep it
        with self.model._lock:
            self._steps.close()
        self.finish_reason = self.finish_reason or "cancelled"  # also when it never started

    def _step(self) -> str:
        with self.model._lock:      # the engine runs one step at a time, whoever asks
            if self._closing:
                self._steps.close()
            return next(self._steps)

    def _run(self) -> Iterator[str]:
        model, opts = self.model, self.options
        self.thread = threading.get_ident()     # Model._claim refuses other threads while this runs
        self.cached_tokens = model._claim(self, self.prompt)
        engine, k = model.engine, self.cached_tokens
        max_new = opts.max_tokens or model.max_seq_len
        tokens = engine.stream(self.prompt[k:], max_new, Sampler(opts.sampler_config()), self.generation,
                               self.keep_logits, context=self.prompt[:k], ignore_eos=opts.ignore_eos)
        detok, stops = Detokenizer(model.tokenizer), StopScan(opts.stop)
        try:
            for token in tokens:
                model._tokens.append(token)
                piece, hit = stops.push(detok.push(token))
                if hit:
                    self.finish_reason = "stop"
                self.text += piece
                yield piece
                if hit:
                    return
            piece, hit = stops.finish(detok.flush())
            self.finish_reason = "stop" if hit or self.generation.stop_reason == "stop token" else "length"
            if piece:
                self.text += piece
                yield piece
        finally:
            tokens.close()
            self.finish_reason = self.finish_reason or "cancelled"
            model._release(self)


class Model:
    """A plan loaded on one backend, with its tokenizer, chat template and KV cache. Use llmrs.load().

    The cache's options (KVOptions) are the model's, not a call's: a policy's state (each slot's
    position, the attention scores SnapKV and H2O collect) describes everything fed since the last
    reset, which the next call of a conversation goes on from, so a window or a policy changed for
    one call would judge slots another chose. Sampling, max_tokens and stop are per call."""

    def __init__(self, plan: Plan, backend: Backend, kv: KVOptions = KVOptions(),
                 batch: BatchOptions = BatchOptions(), speculator: Speculator | None = None):
        m = plan.manifest
        self.plan = plan
        self.backend = backend
        self.tokenizer = plan.tokenizer()   # a PlanError naming the plan where it has none, or a broken one
        self.chat_template: ChatTemplate | None = from_manifest(m)
        self.max_seq_len = int(m["max_seq_len"])
        self.vocab_size = int(m["model"]["vocab_size"])
        self.kv = kv
        self.engine = Engine(backend, int(m["prefill_chunk"]), self.max_seq_len, tuple(m.get("stop_ids", ())),
                             cache=cache_manager(kv, backend))
        if speculator is not None:
            self.engine.speculator = speculator
            self.engine.use_step_graph(plan.step_shape())
        self.speculator = speculator
        self.load_s = 0.0
        self._tokens: list[int] = []        # what the cache was fed, then what the live generation adds
        self._active: Completion | None = None
        self._lock = threading.RLock()      # held for each engine step and each change of _active
        self._closed = False
        self.batch_options = batch.check()
        self._batch: Batcher | None = None
        self._kv_user = "single"            # who last wrote the KV cache: "single" (engine) or "batch"

    @classmethod
    def load(cls, plan: str | Path, backend: str = "cpu", threads: int | None = None,
             device: str | int | None = None, **options: Any) -> "Model":
        """Open and verify `plan`, bind it to `backend` ("cpu", "opencl", "reference", "hybrid" or
        "auto"). options are BackendOptions' fields (runtime/backends/options.py: hybrid_start,
        switch_threshold, switch_back_at, hybrid_kv, recalibrate) and KVOptions' (runtime/kv/options.py:
        eviction_policy, eviction_window, protected_prefix, memory_threshold_mb, ...), llmrs-run's
        flags by their Python names; an unknown one is a TypeError naming those it takes. With a
        policy that evicts, a prompt or a conversation may be longer than the cache."""
        if not isinstance(plan, (str, os.PathLike)):
            raise TypeError(f"plan must be a path to a plan file, got {plan!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if device is not None and not isinstance(device, str) and not whole(device):
            raise TypeError(f"device must be an OpenCL device index or name, got {device!r}")
        threads = check_threads(threads)
        unknown = sorted(set(options) - set(LOAD_OPTIONS))
        if unknown:
            raise TypeError(f"unknown option {', '.join(map(repr, unknown))} (Model.load takes: backend, "
                            f"{', '.join(LOAD_OPTIONS)})")
        backend_options = BackendOptions(threads=threads, device=device,
                                         **{k: v for k, v in options.items() if k in _BACKEND_NAMES})
        kv = KVOptions(**{k: v for k, v in options.items() if k in option_names(KVOptions)}).check()
        batch = BatchOptions(**{k: v for k, v in options.items() if k in _BATCH_NAMES}).check()
        spec = SpeculativeOptions(**{k: v for k, v in options.items() if k in _SPEC_NAMES}).check()
        return cls.open(plan, backend, backend_options, kv, batch, spec)

    @classmethod
    def open(cls, plan: str | Path, backend: str = "cpu", backend_options: BackendOptions = BackendOptions(),
             kv: KVOptions = KVOptions(), batch: BatchOptions = BatchOptions(),
             spec: SpeculativeOptions = SpeculativeOptions()) -> "Model":
        """load() from typed options (what the command lines build from their flags)."""
        t0 = time.perf_counter()
        opened = Plan.open(plan)
        kv.check()
        batch.check()
        speculator = make_speculator(spec, opened, backend, backend_options)
        try:
            be = open_backend(opened, backend, backend_options)
        except BaseException:
            if speculator is not None:
                speculator.close()
            raise
        return cls.bind(opened, be, kv, t0, batch, speculator)

    @classmethod
    def bind(cls, plan: Plan, backend: Backend, kv: KVOptions = KVOptions(), t0: float | None = None,
             batch: BatchOptions = BatchOptions(), speculator: Speculator | None = None) -> "Model":
        """A Model over a back end already opened on `plan` (llmrs-run --profile's timing one);
        the back end is closed if that fails. load_s counts from t0 (default: now)."""
        t0 = time.perf_counter() if t0 is None else t0
        try:
            model = cls(plan, backend, kv, batch, speculator)
        except BaseException:
            backend.close()
            if speculator is not None:
                speculator.close()
            raise
        model.load_s = time.perf_counter() - t0
        return model

    @property
    def batch(self) -> Batcher | None:
        """The batch add_request feeds (None before the first request): its steps, rows and KV pool."""
        return self._batch

    @property
    def can_batch(self) -> bool:
        """The plan has a step graph: add_request / generate_many run many prompts at once."""
        return self.plan.step_shape() is not None

    @property
    def evicts(self) -> bool:
        """The KV cache makes room by eviction: prompts and conversations may outgrow it."""
        return self.engine.evicts

    # -- text <-> tokens -----------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer adds on its own (a BOS).
        Text that is not valid Unicode (lone surrogates) is repaired with a TextRepairWarning."""
        self._check_open()
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return self.tokenizer.encode(clean_text(text), add_special_tokens=add_special_tokens).ids

    def detokenize(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (each in 0..vocab_size - 1)."""
        self._check_open()
        return self.tokenizer.decode(self._check_ids(tokens, "tokens"), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The conversation as the model's chat template writes it (transformers' apply_chat_template;
        chat_template_kwargs are its keyword arguments, e.g. {"enable_thinking": False} for Qwen3)."""
        self._check_open()
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.plan.path}: the plan has no chat template (a base model); "
                                    "give it plain text to continue instead")
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str) \
                    or not isinstance(msg.get("content"), str):
                raise ValueError(f"message {i} must have a string 'role' and a string 'content', got {msg!r}")
        return self.chat_template.render([dict(m) for m in messages], add_generation_prompt, chat_template_kwargs)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int | None = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 repetition_window: int = 64, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, keep_logits: bool = False,
                 ignore_eos: bool = False) -> Completion:
        """Continue `prompt` (text, tokenized with the tokenizer's own special tokens, or token ids;
        bytes are refused: decode them first). Returns a Completion: iterate it for text pieces as
        they decode. Options are checked now (TypeError, ValueError); the prompt is prefilled when
        the first piece is asked for. ignore_eos: generate max_tokens tokens, stop tokens included
        (throughput benchmarks). keep_logits: completion.generation.logits holds the f32[vocab]
        row each token was drawn from (greedy then picks on the host, not on the device). One
        generation at a time: a new one closes the unfinished one this thread started; while
        another thread's is unfinished, EngineError (it does not wait). The KV cache's options are
        the Model's (see the class), not a call's."""
        self._check_free()
        opts = GenerationOptions.of(stop, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, repetition_penalty=repetition_penalty,
                                    repetition_window=repetition_window, seed=seed, ignore_eos=ignore_eos)
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError("prompt must be str or token ids, got bytes: decode it first (prompt.decode())")
        if not isinstance(prompt, (str, Sequence, np.ndarray)):
            raise TypeError(f"prompt must be str or a list of token ids, got {type(prompt).__name__}")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_ids(prompt, "prompt")
        return Completion(self, self._check_prompt(ids), opts, keep_logits=bool(keep_logits))

    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None = 256,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
             repetition_window: int = 64, seed: int | None = None,
             stop: str | Sequence[str] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> Completion:
        """The assistant's next turn after `messages` ([{"role": ..., "content": ...}, ...]), through
        the model's chat template (chat_template_kwargs: its switches, e.g. {"enable_thinking": False}).
        Send the whole conversation each time: what is already in the KV cache is not prefilled again."""
        rendered = self.render_chat(messages, chat_template_kwargs=chat_template_kwargs)
        ids = self.tokenize(rendered, add_special_tokens=False)  # the template writes any BOS
        return self.generate(ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             repetition_penalty=repetition_penalty, repetition_window=repetition_window,
                             seed=seed, stop=stop)

    # -- many generations at once ---------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], *, priority: int = 0, max_tokens: int | None = 256,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    repetition_penalty: float = 1.0, repetition_window: int = 64, seed: int | None = None,
                    stop: str | Sequence[str] | None = None, ignore_eos: bool = False) -> Request:
        """Queue `prompt` (text or token ids) to run beside other requests, through the plan's step
        graph (continuous batching; equal prompt prefixes share their KV). Returns a Request:
        iterate it for text pieces (iterating steps the batch when nothing else does), or drive
        every request with step(). Higher `priority` runs first when the cache is short.
        ignore_eos: generate max_tokens tokens whatever is sampled (throughput benchmarks)."""
        opts = GenerationOptions.of(stop, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, repetition_penalty=repetition_penalty,
                                    repetition_window=repetition_window, seed=seed, ignore_eos=ignore_eos)
        if not whole(priority):
            raise TypeError(f"priority must be a whole number, got {priority!r}")
        ids = self._prompt_ids(prompt)
        with self._lock:
            batch = self._batcher()
            return batch.submit(ids, opts, priority)

    def step(self) -> bool:
        """One step of every queued request (add_request); False when none is left."""
        self._check_open()
        return self._batch.step() if self._batch is not None else False

    def generate_many(self, prompts: Sequence[str | Sequence[int]], *, max_tokens: int | None = 256,
                      temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                      repetition_penalty: float = 1.0, repetition_window: int = 64, seed: int | None = None,
                      stop: str | Sequence[str] | None = None, ignore_eos: bool = False) -> list[Request]:
        """Every prompt continued at once (add_request for each, then steps until all are done);
        each Request's text, tokens and finish_reason as generate's Completion has them. With a
        seed, request i samples with seed + i, so equal prompts may still differ."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts (text or token ids)")
        reqs = [self.add_request(p, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 repetition_penalty=repetition_penalty, repetition_window=repetition_window,
                                 seed=None if seed is None else seed + i, stop=stop, ignore_eos=ignore_eos)
                for i, p in enumerate(prompts)]
        try:
            for r in reqs:
                for _ in r:
                    pass
        except BaseException:
            for r in reqs:
                r.close()
            raise
        return reqs

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError("prompt must be str or token ids, got bytes: decode it first (prompt.decode())")
        if not isinstance(prompt, (str, Sequence, np.ndarray)):
            raise TypeError(f"prompt must be str or a list of token ids, got {type(prompt).__name__}")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_ids(prompt, "prompt")
        if not ids:
            raise EngineError("the prompt is empty")
        return ids

    def _batcher(self) -> Batcher:
        """The batch, with the KV cache handed to it (the caller holds _lock)."""
        self._check_open()
        if self._batch is None:
            self._batch = Batcher(self.plan, self.backend, self.tokenizer, tuple(self.engine.stop_ids),
                                  self.max_seq_len, self.batch_options, self.kv)
        if self._kv_user != "batch":
            if self._active is not None:
                self._check_free()
                self._active.close()
            self._tokens = []                        # the conversation's cache is about to be overwritten
            self.engine.n_past = self.engine.start_pos = 0
            if self.engine.cache is not None:
                self.engine.cache.reset()
            self._kv_user = "batch"
        return self._batch

    def _kv_for_single(self) -> None:
        """The KV cache back from the batch (the caller holds _lock): refused while requests run."""
        if self._kv_user == "single":
            return
        if self._batch is not None and self._batch.busy:
            raise EngineError("the model is busy: requests added with add_request are unfinished (step or close "
                              "them first)")
        if self._batch is not None:
            self._batch.reset()                      # its prefix cache would describe overwritten rows
            self.engine.reset()                      # and its eviction scores are no conversation's
        self._tokens = []
        self._kv_user = "single"

    def logits(self, tokens: Sequence[int], *, last: bool = False) -> np.ndarray:
        """f32[len(tokens), vocab]: row i scores the token after tokens[:i + 1], as transformers'
        model(ids).logits[0]. A prefill step keeps only its last row, so this runs one decode step
        per token; last=True gives just the final row, f32[vocab], from one (chunked) prefill."""
        ids = self._check_prompt(self._check_ids(tokens, "tokens"))
        with self._lock:
            if last:
                k = self._claim(None, ids)
                row = self.engine.prefill(ids[k:])
                return np.asarray(row, np.float32).copy()
            self._claim(None, ids, reuse=False)
            return np.stack([np.asarray(self.engine.decode_one_token(t), np.float32) for t in ids])

    def reset(self) -> None:
        """Forget the KV cache (the next prompt is prefilled whole)."""
        with self._lock:
            self._claim(None, [], reuse=False)

    def close(self) -> None:
        """Stop the generation in progress and free the back end; any later use is an EngineError."""
        with self._lock:
            if self._closed:
                return
            if self._active is not None:
                self._active.close()
            if self._batch is not None:
                self._batch.close()
            self._closed = True
            self.backend.close()
            if self.speculator is not None:
                self.speculator.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the KV cache between calls --------------------------------------------------------------
    def _check_ids(self, tokens: Any, name: str) -> list[int]:
        """Token ids as ints, each in the vocabulary."""
        if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, (Sequence, np.ndarray)):
            raise TypeError(f"{name} must be a sequence of token ids, got {type(tokens).__name__}")
        ids = list(tokens)
        for t in ids:
            if not whole(t):
                raise TypeError(f"{name} must be whole numbers (token ids), got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} is not in 0..{self.vocab_size - 1}")
        return [int(t) for t in ids]

    def _check_prompt(self, ids: list[int]) -> list[int]:
        """A prompt the cache can take: any length where the policy evicts, else at most the cache."""
        if not ids:
            raise EngineError("the prompt is empty")
        if len(ids) > self.max_seq_len and not self.evicts:
            raise prompt_too_long(len(ids), self.max_seq_len)
        return ids

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self.plan.path}: the model is closed; llmrs.load the plan again to use it")

    def _check_free(self, owner: Completion | None = None) -> None:
        """Refuse while a generation another thread started is unfinished (stepping it from a worker
        thread is fine: it is who starts a generation that counts)."""
        self._check_open()
        active = self._active
        if active is not None and active is not owner and active.thread != threading.get_ident():
            raise EngineError("the model is busy: a generation another thread started is unfinished (one at a "
                              "time per Model; finish or close() it first, or llmrs.load a second Model)")

    def _claim(self, owner: Completion | None, ids: list[int], reuse: bool = True) -> int:
        """Make the engine ready to be fed `ids`: stop the generation in progress, keep the longest
        cached prefix of ids (at least one token is left to prefill: its logits start the reply),
        drop the rest. Returns how many tokens of ids are already cached. The caller holds _lock."""
        self._check_free(owner)
        self._kv_for_single()
        if self._active is not None and self._active is not owner:
            self._active.close()
        self._active = owner
        engine = self.engine
        fed = self._tokens[:engine.start_pos]
        k = min(_common_prefix(fed, ids), len(ids) - 1) if reuse else 0
        if k < len(fed):
            if not engine.evicts:
                engine.rewind(k)
            else:   # a policy's slots and scores describe all that was fed: start over
                engine.reset()
                k = 0
        self._tokens = list(ids)
        return max(k, 0)

    def _release(self, owner: Completion) -> None:
        if self._active is owner:
            self._active = None


__all__ = ["BACKENDS", "BatchOptions", "Completion", "Request", "Detokenizer", "GenerationOptions", "Model", "StopScan", "TextRepairWarning",
           "check_threads", "clean_text"]
