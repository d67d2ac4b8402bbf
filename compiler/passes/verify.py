"""Check a graph: shapes, dtypes, one producer per value, no cycles."""
from __future__ import annotations

from ..ir import Graph


def verify(g: Graph) -> Graph:
    """Return g unchanged if it is well formed; otherwise raise IRError naming the op at fault."""
    return g.verify()
