"""A step graph: the prefill graph rewired so that each of its T rows can belong to another
sequence (compiler/ir.py "Step graphs"; ../shared/DESIGN.md "Many sequences, one graph").

Prefill chunks of several prompts, single decode tokens of running sequences and (later)
speculative verify rows then share one step: the matmuls see T rows whatever their origin, so
each weight is read once a step, and only RoPE, the KV store and attention look at which
sequence a row belongs to. The rewrite works on any family's prefill graph (it touches only those
three op kinds and the head), so a new family gets many-sequence serving for free.

The KV caches stay the same state values as in the prefill and decode graphs (same names, shapes
and layout), read as a pool of `S / block_size` blocks: a sequence alone with the identity block
table [0, 1, 2, ...] sees exactly the contiguous cache the other graphs use.
"""
from __future__ import annotations

from ..compiler.ir import Graph, IRError, Op

STEP_INPUTS = ("positions", "slots", "row_seq", "ctx_len")


def step_graph(prefill: Graph, max_seqs: int, block_size: int, name: str = "step", logit_rows: int = 0) -> Graph:
    """The step graph of `prefill` (an unfused, built graph) for up to `max_seqs` sequences a step,
    returning the logits of up to max(max_seqs, logit_rows) chosen rows (`logit_rows`): one a
    sequence, or every row of a speculative verify step (runtime/speculative)."""
    g = prefill.copy()
    g.name = name
    T = g.T
    slots = g.kv_slots
    if slots is None:
        raise IRError(f"graph {prefill.name} has no KV cache to page")
    if not 1 <= max_seqs <= T:
        raise IRError(f"a step of {T} rows serves 1..{T} sequences, not {max_seqs}")
    if block_size < 1 or slots % block_size:
        raise IRError(f"block size {block_size} must divide the KV cache's {slots} slots")
    for n in STEP_INPUTS:
        g.inputs.append(g.add_value(n, (T,), "i32", kind="input"))
    g.inputs.append(g.add_value("block_tables", (max_seqs, slots // block_size), "i32", kind="input"))
    picked = min(max(max_seqs, logit_rows), T)
    g.inputs.append(g.add_value("logit_rows", (picked,), "i32", kind="input"))
    g.inputs.append(g.add_value("score_from", (T,), "i32", kind="input"))
    ops = []
    for op in g.ops:
        if op.kind == "rope":
            op.inputs.append("positions")
        elif op.kind == "kv_store":
            op.inputs.append("slots")
        elif op.kind == "attention":
            # the same scores states as the other graphs (one KV layout for the plan), at
            # physical slots; each row's score_from replaces the graph-wide score_ctl
            op.inputs[3:] = ["row_seq", "ctx_len", "block_tables", op.inputs[3], "score_from"]
            op.attrs["block_size"] = block_size
        ops.append(op)
    g.ops = ops
    _gather_head(g, picked)
    return g.verify()


def _gather_head(g: Graph, rows: int) -> None:
    """Only the rows in logit_rows go through the final norm and the head (a prefill chunk needs
    the logits of its last row, a decode row its own)."""
    (logits,) = g.outputs
    prod = g.producers()
    head = prod[logits]
    norm = prod[head.inputs[0]]
    if head.kind != "matmul" or norm.kind != "rms_norm":
        raise IRError(f"graph {g.name}: the head is {norm.kind} -> {head.kind}, not rms_norm -> matmul")
    x = norm.inputs[0]
    picked = g.add_value(f"{x}.rows", (rows, g.values[x].shape[1]), "f32")
    for v in norm.outputs + head.outputs:
        g.values[v].shape = (rows, *g.values[v].shape[1:])
    at = g.ops.index(norm)
    g.ops.insert(at, Op("gather", [x, "logit_rows"], [picked], {}, name="gather_head"))
    norm.inputs[0] = picked
