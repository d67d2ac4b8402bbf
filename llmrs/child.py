"""Child Python processes that import llmrs as this process does."""
from __future__ import annotations

import sys


def python_argv(code: str, *args: str) -> list[str]:
    """argv running `code` in a fresh interpreter. `python -c` (and `-m`) put the current
    directory first on sys.path, and a checkout's llmrs/ folder holds the top package alone
    (its subpackages live in compiler/, runtime/, ... and are mapped there at install), so
    started from a checkout with llmrs installed normally (not editable), the child would import
    that folder and miss llmrs.compiler. The child drops that entry first."""
    return [sys.executable, "-c", "import sys; sys.path[:] = [p for p in sys.path if p]; " + code, *args]
