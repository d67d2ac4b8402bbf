"""The prompts `llmrs-bench --speculative` times, by type (issue 28's targets): three that quote
their input, which prompt lookup can draft from, and open-ended chat, where it rarely can. Each is
one user turn through the plan's chat template (as given, for a plan without one)."""
from __future__ import annotations

CODE = """Rewrite this Python code so that the variable `total` is called `acc`. Change nothing else.

```python
def sum_of_squares(numbers):
    total = 0
    for n in numbers:
        total += n * n
    return total


def mean(numbers):
    total = 0
    for n in numbers:
        total += n
    return total / len(numbers)
```"""

QUOTE = """Summarise this passage in three sentences, quoting its key sentences word for word.

The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions. It extends from the
Arctic Ocean in the north to the Southern Ocean in the south, and is bounded by the continents of
Asia and Australia in the west and the Americas in the east. At about 165 million square
kilometres, it covers about 32 percent of Earth's total surface area, which is larger than its
entire land area combined."""

LIST = """Continue this list with five more items in exactly the same format.

1. Apple - a red fruit that grows on trees in cool climates.
2. Banana - a yellow fruit that grows in bunches in warm climates.
3. Cherry - a small red fruit that grows on trees in cool climates.
4. Date - a brown fruit that grows on palms in warm climates."""

CHAT = "Write a short story about a robot who learns to paint."

PROMPTS = {"code": CODE, "quote": QUOTE, "list": LIST, "chat": CHAT}
QUOTING = ("code", "quote", "list")

__all__ = ["CHAT", "CODE", "LIST", "PROMPTS", "QUOTE", "QUOTING"]
