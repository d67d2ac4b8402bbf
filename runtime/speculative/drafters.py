"""Drafters: where the tokens a verify step checks come from. Two, behind one interface:

- PromptLookup: no second model. The longest suffix of the text so far (up to --lookup-ngram
  tokens) that occurred before, and the tokens that followed its latest earlier occurrence. Text
  that quotes its input (code rewritten with one change, a summary with quotations, a list
  continued) drafts long runs that the target accepts.
- DraftModel: a second, smaller plan with the same tokenizer, run ahead k tokens on its own
  back end (the CPU beside a GPU target, say), its KV cache rewound to what the target kept.

propose(history, k) returns up to k tokens and, for sampling, the drafter's distribution for each
(None: a deterministic draft, q = one-hot), which rejection.py needs to keep the output exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from ..engine import Engine, check_finite
from ..sampler import Sampler, SamplerConfig


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    q: list[np.ndarray] | None = None       # the drafter's distribution for each token; None: one-hot


class Drafter(Protocol):
    name: str

    def start(self, sampling: SamplerConfig) -> None: ...       # a generation begins with these options

    def propose(self, history: Sequence[int], k: int) -> Draft: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class PromptLookup:
    """n-gram lookup over the prompt and the text so far (the prompt-lookup decoding of Saxena
    2023, llama.cpp's llama-lookup): match the last n tokens, n from `ngram` down to 2 (1 where
    ngram is 1), against every earlier position and draft what followed the latest match. A lone
    token's match is a poor guess in open text (SmolLM2, a chat prompt: 8 % of such drafts kept
    against 38 % of 2- and 3-token matches), and a refused draft costs a wider step."""
    name = "lookup"

    def __init__(self, ngram: int = 3):
        if ngram < 1:
            raise ValueError(f"lookup_ngram must be at least 1, got {ngram}")
        self.ngram = ngram
        self._sizes = range(ngram, min(2, ngram) - 1, -1)
        # every n-gram of the text indexed so far that a token follows -> its latest start. Kept
        # across proposals, so each new token costs a few dict stores: a scan of the whole text
        # took ~35 us a proposal at 300 tokens, 1 % of a SmolLM2 decode step on every step tried
        self._seen: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}

    def start(self, sampling: SamplerConfig) -> None:
        pass

    def _index(self, history: Sequence[int]) -> list[int]:
        h = history if isinstance(history, list) else [int(t) for t in history]
        m = len(self._seen)
        if len(h) < m or h[:m] != self._seen:      # another text, or this one rolled back
            self._last.clear()
            m = 0
        for j in range(max(m - 1, 0), len(h) - 1):  # n-grams ending at j, now followed by h[j + 1]
            for n in self._sizes:
                if j + 1 >= n:
                    self._last[tuple(h[j + 1 - n:j + 1])] = j + 1 - n
        self._seen = h[:]
        return h

    def propose(self, history: Sequence[int], k: int) -> Draft:
        h = self._index(history)
        for n in self._sizes:
            if n < len(h):
                at = self._last.get(tuple(h[len(h) - n:]))
                if at is not None:
                    return Draft([int(t) for t in h[at + n:at + n + k]])
        return Draft()

    def reset(self) -> None:
        self._seen, self._last = [], {}

    def close(self) -> None:
        pass


class DraftModel:
    """A draft plan's engine kept in step with the target: before each proposal its cache is
    rewound to the longest prefix it shares with the history, and what is missing is fed; then it
    samples k tokens with the target's sampling options (greedy stays greedy)."""
    name = "draft"

    def __init__(self, engine: Engine, close_backend: bool = True):
        if engine.evicts:
            raise ValueError("a draft model runs without eviction")
        self.engine = engine
        self.sampler = Sampler(SamplerConfig())
        self._fed: list[int] = []           # tokens in the draft's cache, slot i holding token i
        self._start = 0                     # history[_start:] is what the cache sees
        self._close_backend = close_backend

    def start(self, sampling: SamplerConfig) -> None:
        """Draw with the target's options, from a stream of its own: the target's acceptance
        draws must not depend on the draft's."""
        seed = None if sampling.seed is None else [sampling.seed, 0x5EC]
        self.sampler = Sampler(sampling)
        self.sampler.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        self.engine.reset()
        self._fed, self._start = [], 0

    def close(self) -> None:
        if self._close_backend:
            self.engine.backend.close()

    def _catch_up(self, history: list[int], k: int) -> np.ndarray:
        """Logits after all of `history`, feeding only what the cache lacks. A history the cache
        cannot hold with k more tokens is seen from a later start, half a cache back (a draft only
        needs to be plausible; the target checks it), which moves again once that is full too."""
        room = self.engine.max_seq_len - k
        if self._start >= len(history) or len(history) - self._start > room:
            self._start = max(0, len(history) - max(1, room // 2))
        history = history[self._start:]
        keep = 0
        n = min(len(self._fed), len(history) - 1)     # the last token is always fed: its logits are needed
        while keep < n and self._fed[keep] == history[keep]:
            keep += 1
        self.engine.rewind(keep)
        self._fed = history[:keep]
        todo = history[keep:]
        logits = self.engine.prefill(todo) if len(todo) > 1 else self.engine.decode_one_token(todo[0])
        self._fed += todo
        return logits

    def propose(self, history: Sequence[int], k: int) -> Draft:
        if k < 1:
            return Draft()
        logits = self._catch_up(list(history), k)
        tokens: list[int] = []
        q: list[np.ndarray] = []
        seen = list(history)
        for i in range(k):
            row = check_finite(np.asarray(logits, np.float32), i + 1)
            if self.sampler.cfg.temperature == 0:
                t = self.sampler.sample(row, seen)
            else:
                p = self.sampler.probs(row, seen)
                t = int(self.sampler.rng.choice(p.size, p=p))
                q.append(p)
            tokens.append(t)
            seen.append(t)
            if i + 1 < k:
                logits = self.engine.decode_one_token(t)
                self._fed.append(t)
        return Draft(tokens, q if self.sampler.cfg.temperature != 0 else None)


__all__ = ["Draft", "Drafter", "DraftModel", "PromptLookup"]
