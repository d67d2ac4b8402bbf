"""The compiler's error for a malformed graph, apart from ir.py so that the shape rules
(shapes.py), which ir.py's verify() calls, can raise it without importing ir.py back."""
from __future__ import annotations


class IRError(ValueError):
    """A malformed graph; the message names the op or value at fault."""
