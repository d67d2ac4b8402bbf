"""How many tokens to draft next: a fixed K, or K that follows the drafts' fate.

Drafting costs a drafter's time and a verify step wider than one row; it pays only when the
target keeps the drafts. So K grows by one while every draft is kept and drops to one more than
the number kept when one is refused; two proposals in a row with nothing kept pause drafting
(plain decode steps) for a spell that doubles each time it recurs, up to 32 steps, and is reset
by the first proposal that keeps something. Open-ended text, where drafts rarely match, thus
costs a probe now and then instead of a wider step every token.
"""
from __future__ import annotations

MAX_PAUSE = 32


class AdaptiveK:
    def __init__(self, k_max: int, fixed: int | None = None, start: int = 4):
        self.k_max = k_max
        self.fixed = fixed
        self.k = min(fixed if fixed is not None else start, k_max)
        self._misses = 0        # proposals in a row that kept nothing
        self._pause = 0         # plain steps left before the next proposal
        self._spell = 1         # the next pause's length

    def next(self) -> int:
        """Tokens to draft for the coming step (0: decode plainly)."""
        if self.fixed is not None:
            return self.k
        if self._pause:
            self._pause -= 1
            return 0
        return self.k

    def update(self, drafted: int, kept: int) -> None:
        if self.fixed is not None or drafted == 0:
            return
        if kept == drafted:
            self.k = min(self.k_max, self.k + 1)
        else:
            self.k = max(1, kept + 1)
        if kept:
            self._misses, self._spell = 0, 1
            return
        self._misses += 1
        if self._misses >= 2:
            self._pause, self._spell, self._misses = self._spell, min(MAX_PAUSE, self._spell * 2), 0


__all__ = ["AdaptiveK", "MAX_PAUSE"]
