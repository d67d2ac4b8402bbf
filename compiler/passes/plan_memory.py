"""Plan one static activation arena (Galloc) and the KV-cache region for a scheduled graph."""
from __future__ import annotations

from typing import Iterable

from ..galloc import (Interval, align_up, arena_bytes, inplace_groups, lower_bound, naive_bytes,
                      plan_greedy_by_size, verify_storage_reuse)
from ..ir import Graph, IRError, Op

ALIGNMENT = 64  # bytes; a cache line, and enough for any vector load the kernels issue


def in_arena(g: Graph, name: str) -> bool:
    """Activations and graph inputs live in the arena; a value aliasing a state lives in the
    KV region; weights and constants live in the read-only weights region."""
    v = g.values[name]
    return v.kind in ("act", "input") and v.alias is None


def live_intervals(g: Graph) -> list[Interval]:
    """Lifetime of every arena value over g.ops' order: graph inputs from step 0, each other
    value from the op that makes it to its last reader, graph outputs to the last step."""
    last = max(len(g.ops) - 1, 0)
    start: dict[str, int] = {n: 0 for n in g.inputs if in_arena(g, n)}
    end: dict[str, int] = dict(start)
    for step, op in enumerate(g.ops):
        for name in op.outputs:
            if in_arena(g, name):
                start[name] = end[name] = step
        for name in op.inputs:
            if in_arena(g, name):
                if name not in start:
                    raise IRError(f"plan_memory: op {op.name} ({op.kind}) reads {name!r} before any op "
                                  "makes it; run the verify pass first")
                end[name] = step
    for name in g.outputs:
        if name in end:
            end[name] = last
    # a backend may fold a slice into its reader's indexing, reading the sliced tensor
    # directly, so that tensor must outlive the slice's result (reverse order: slice chains)
    for op in reversed(g.ops):
        if op.kind == "slice" and in_arena(g, op.inputs[0]) and op.outputs[0] in end:
            end[op.inputs[0]] = max(end[op.inputs[0]], end[op.outputs[0]])
    return [Interval(n, g.values[n].nbytes, start[n], end[n]) for n in start]


def inplace_inputs(op: Op) -> tuple[int, ...]:
    """Input positions whose storage the op's first output may take.

    Only ops that read each element of that input once, before writing the output element at
    the same index: add, mul, silu, silu_mul and rope are elementwise (rope pairs x[i] with
    x[i + hd/2], and a kernel reads both before writing either); rms_norm reads its row's sum
    of squares first, then x[i] to write y[i]; a fused matmul's "add" epilogue reads
    residual[t, n] just before writing y[t, n]. Never a matmul's x: every output element reads
    a whole row of x, so writing y[t, 0] would clobber x[t, 0] for the rest of the row."""
    if op.kind in ("add", "mul", "silu_mul"):
        return (0, 1)
    if op.kind in ("silu", "rms_norm", "rope"):
        return (0,)
    if op.kind == "fused_matmul" and op.attrs.get("epilogue") == "add":
        return (3 if op.attrs.get("prologue") == "rms_norm" else 2,)
    return ()


def inplace_candidates(g: Graph, intervals: Iterable[Interval]) -> dict[str, str]:
    """{out: in} where an op could write its output over an input that dies at that op."""
    iv = {i.name: i for i in intervals}
    sliced = {op.inputs[0] for op in g.ops if op.kind == "slice"}  # read later through a view
    outputs = set(g.outputs)
    cands: dict[str, str] = {}
    for step, op in enumerate(g.ops):
        out = op.outputs[0] if op.outputs else None
        if out not in iv:
            continue
        ok = [op.inputs[p] for p in inplace_inputs(op) if p < len(op.inputs)]
        ok = [n for n in ok if n in iv and iv[n].end == step and n not in outputs and n not in sliced
              and g.values[n].dtype == g.values[out].dtype and iv[out].size <= iv[n].size]
        if ok:
            cands[out] = max(ok, key=lambda n: iv[n].size)
    return cands


def kv_layout(g: Graph, alignment: int = ALIGNMENT) -> tuple[dict[str, int], int]:
    """State values one after another in declaration order, each aligned: ({name: offset}, bytes)."""
    offsets, cursor = {}, 0
    for name in g.state:
        offsets[name] = cursor
        cursor += align_up(g.values[name].nbytes, alignment)
    return offsets, cursor


def plan_memory(g: Graph, alignment: int = ALIGNMENT) -> Graph:
    """Set g.meta["layout"]: arena offsets by greedy-by-size best fit with in-place reuse,
    checked by the storage-reuse oracle; KV offsets; naive and lower-bound sizes to compare.
    The lower bound counts an in-place pair once, as the plan stores it."""
    out = g.copy()
    ivs = live_intervals(g)
    cands = inplace_candidates(g, ivs)
    offsets = plan_greedy_by_size(ivs, alignment, cands)
    grouped = inplace_groups(ivs, cands)
    size = arena_bytes(ivs, offsets, alignment)
    verify_storage_reuse(ivs, offsets, size, alignment, grouped.reuses)
    kv, kv_bytes = kv_layout(g, alignment)
    out.meta["layout"] = {
        "alignment": alignment,
        "arena_bytes": size,
        "arena": offsets,
        "kv_bytes": kv_bytes,
        "kv": kv,
        "naive_bytes": naive_bytes(ivs, alignment),
        "lower_bound_bytes": lower_bound(grouped.groups),
        "inplace": dict(grouped.reuses),
    }
    return out


def shared_arena_bytes(graphs: Iterable[Graph]) -> int:
    """One arena serves every phase (they never run at once): the largest phase's size."""
    sizes = []
    for g in graphs:
        if "layout" not in g.meta:
            raise IRError(f"graph {g.name} has no memory layout; run the plan_memory pass first")
        sizes.append(g.meta["layout"]["arena_bytes"])
    return max(sizes, default=0)
