"""Speculative decoding (seed 004, stage 11): a drafter proposes k tokens, the target checks them
all in one step of the plan's step graph, and keeps what rejection sampling accepts.

On a device decode reads every weight once per token; a verify step reads them once for up to
k + 1 tokens. The pieces, each small:

    drafters.py   PromptLookup (n-grams of the text so far) and DraftModel (a smaller plan)
    rejection.py  which drafts the target keeps: exact for greedy and for sampling
    adaptive.py   how many to draft next
    options.py    SpeculativeOptions, every interface's flags

runtime/engine.py runs the loop: Engine.verify feeds the last token and the drafts in one step
without committing them; Engine.advance commits one row at a time as each kept token is emitted,
so what the cache holds always matches what was emitted (rejected rows are simply written over).
A verify step spans only rows that decoding one at a time would run with no eviction and no
scoring between them (CacheManager.plain_rows), so the cache, positions and eviction scores after
it are those of plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampler import SamplerConfig
from .adaptive import AdaptiveK
from .drafters import Draft, Drafter, DraftModel, PromptLookup
from .options import DRAFTERS, TITLE, SpeculativeOptions
from .rejection import Verdict, judge


@dataclass
class SpecStats:
    drafter: str = ""
    drafted: int = 0        # tokens proposed
    accepted: int = 0       # of them kept
    steps: int = 0          # verify steps
    plain: int = 0          # decode steps with nothing drafted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verify step yields: the kept drafts and the one after them."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def line(self) -> str:
        return (f"speculative       {self.drafter}: {self.drafted} drafted, {self.accepted} accepted "
                f"({100 * self.acceptance:.1f} %), {self.tokens_per_step:.2f} tokens per verify step "
                f"({self.steps} verify, {self.plain} plain steps)")


@dataclass
class Speculator:
    """A drafter and its K, shared by every generation of a Model."""
    drafter: Drafter
    k_max: int
    fixed: int | None = None
    _k: AdaptiveK | None = field(default=None, init=False)   # made by start()

    def start(self, sampling: SamplerConfig) -> SpecStats:
        """A generation begins: K starts afresh, so a seeded sampling run draws the same drafts,
        verdicts and tokens each time."""
        self.drafter.start(sampling)
        self._k = AdaptiveK(self.k_max, self.fixed)
        return SpecStats(self.drafter.name)

    def next_k(self) -> int:
        return self._k.next()

    def update(self, drafted: int, kept: int) -> None:
        self._k.update(drafted, kept)

    judge = staticmethod(judge)

    def close(self) -> None:
        self.drafter.close()


__all__ = ["AdaptiveK", "DRAFTERS", "Draft", "Drafter", "DraftModel", "PromptLookup", "SpecStats", "Speculator",
           "SpeculativeOptions", "TITLE", "Verdict", "judge"]
