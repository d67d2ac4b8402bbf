"""Fold compile-time constants: RoPE's inverse frequencies (Llama 3 scaling applied) become one
shared const input of every rope op instead of being recomputed from attributes."""
from __future__ import annotations

import numpy as np

from ..rope import rope_inv_freq
from ..ir import Graph, LazyTensor

INV_FREQ = "rope.inv_freq"


def inv_freq_const(g: Graph, head_dim: int, theta: float, scaling: dict | None) -> str:
    """Name of the const inv_freq[head_dim/2] (f32) for these RoPE parameters, added to g on
    first use; models with one RoPE setting (all Llamas) share the single `rope.inv_freq`."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)            # [head_dim/2] f32
    have = [n for n, v in g.values.items() if v.kind == "const" and n.startswith(INV_FREQ)]
    for name in have:
        if np.array_equal(g.weights[name].load(), inv_freq):
            return name
    name = f"{INV_FREQ}.{len(have)}" if have else INV_FREQ
    g.add_value(name, inv_freq.shape, "f32", kind="const")
    g.weights[name] = LazyTensor.of(inv_freq, "f32")
    return name


def fold(g: Graph) -> Graph:
    """Every rope op without an inv_freq input gets the shared const one."""
    g = g.copy()
    for op in g.ops:
        # a step graph's rope reads its positions (i32) last: inv_freq goes before them
        if op.kind == "rope" and (len(op.inputs) == 1 or g.values[op.inputs[1]].dtype == "i32"):
            a = op.attrs
            op.inputs.insert(1, inv_freq_const(g, a["head_dim"], a["theta"], a.get("scaling")))
    return g
