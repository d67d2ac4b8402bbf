"""The prompts `llmrs-bench --speculative` times, by type (issue 28's targets): three that quote
their input, which prompt lookup can draft from, and open-ended chat, where it rarely can. Each is
one user turn through the plan's chat template (as given, for a plan without one)."""
from __future__ import annotations

# Code rewritten with one change. SmolLM2-135M rewrites Python it is asked to change into a terser
# function of its own (five such prompts tried: a rename, docstrings, type hints, a bug fix, a
# re-indent; 27-60 tokens, little of it quoted); markup it copies line for line with the change.
CODE = """Change the page title to "My Garden" in this HTML and return the whole page.

```html
<!DOCTYPE html>
<html>
<head>
  <title>My Blog</title>
  <link rel="stylesheet" href="style.css">
</head>
<body>
  <h1>Welcome to my blog</h1>
  <p>This is where I write about my garden.</p>
  <ul>
    <li><a href="/about">About</a></li>
    <li><a href="/posts">Posts</a></li>
  </ul>
</body>
</html>
```"""

# A passage long enough that the summary runs ~90 tokens (a three-sentence summary of its first
# three sentences ran 45, so a 128-token bench timed mostly its first steps)
QUOTE = """Summarise this passage in five sentences, quoting its key sentences word for word.

The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions. It extends from the
Arctic Ocean in the north to the Southern Ocean in the south, and is bounded by the continents of
Asia and Australia in the west and the Americas in the east. At about 165 million square
kilometres, it covers about 32 percent of Earth's total surface area, which is larger than its
entire land area combined. The Mariana Trench in the western Pacific is the deepest known point
in the ocean, reaching a depth of about 11 kilometres. The ocean's name comes from the Portuguese
explorer Ferdinand Magellan, who called it the peaceful sea because its waters were calm when he
crossed it in 1521."""

LIST = """Continue this list with five more items in exactly the same format.

1. Apple - a red fruit that grows on trees in cool climates.
2. Banana - a yellow fruit that grows in bunches in warm climates.
3. Cherry - a small red fruit that grows on trees in cool climates.
4. Date - a brown fruit that grows on palms in warm climates."""

CHAT = "Write a short story about a robot who learns to paint."

PROMPTS = {"code": CODE, "quote": QUOTE, "list": LIST, "chat": CHAT}
QUOTING = ("code", "quote", "list")

__all__ = ["CHAT", "CODE", "LIST", "PROMPTS", "QUOTE", "QUOTING"]
