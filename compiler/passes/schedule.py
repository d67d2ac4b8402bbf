"""Choose the launch order: topological, and greedy in live activation bytes."""
from __future__ import annotations

import networkx as nx

from ..galloc import lower_bound
from ..ir import Graph, IRError, Op
from .plan_memory import in_arena, live_intervals


def dependencies(g: Graph) -> nx.DiGraph:
    """g.nx()'s value edges, plus program order among the ops touching each KV cache: a cache
    is written in place through an alias, so its readers and writers must keep their order."""
    names = [op.name for op in g.ops]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise IRError(f"schedule: graph {g.name} has two ops named {dup!r}; op names must be unique")
    dag = g.nx()
    touches: dict[str, list[str]] = {}
    for op in g.ops:
        for name in dict.fromkeys(op.inputs + op.outputs):
            v = g.values[name]
            cache = name if v.kind == "state" else v.alias
            if cache is not None:
                touches.setdefault(cache, []).append(op.name)
    for ops in touches.values():
        ops = list(dict.fromkeys(ops))
        dag.add_edges_from(zip(ops, ops[1:]))
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        raise IRError(f"schedule: graph {g.name} has a cycle through op {cycle[0][0]}; fix the pass that made it")
    return dag


def peak_live_bytes(g: Graph) -> int:
    """Most activation bytes live at any step of g's current order."""
    return lower_bound(live_intervals(g))


def _greedy_order(g: Graph, dag: nx.DiGraph) -> list[Op]:
    """List scheduling: of the ops whose inputs are ready, launch the one that grows the live
    set least (outputs made minus inputs it is the last reader of); ties keep program order."""
    index = {op.name: i for i, op in enumerate(g.ops)}
    by_name = {op.name: op for op in g.ops}
    readers: dict[str, int] = {}
    for op in g.ops:
        for name in set(op.inputs):
            readers[name] = readers.get(name, 0) + 1
    kept = set(g.outputs)

    def growth(op: Op) -> int:
        made = sum(g.values[o].nbytes for o in op.outputs if in_arena(g, o))
        freed = sum(g.values[i].nbytes for i in set(op.inputs)
                    if in_arena(g, i) and readers[i] == 1 and i not in kept)
        return made - freed

    waiting = {n: dag.in_degree(n) for n in dag.nodes}
    ready = {n for n, d in waiting.items() if d == 0}
    order: list[Op] = []
    while ready:
        name = min(ready, key=lambda n: (growth(by_name[n]), index[n]))
        ready.remove(name)
        op = by_name[name]
        order.append(op)
        for i in set(op.inputs):
            readers[i] -= 1
        for nxt in dag.successors(name):
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                ready.add(nxt)
    return order


def _is_topological(g: Graph, dag: nx.DiGraph) -> bool:
    pos = {op.name: i for i, op in enumerate(g.ops)}
    return all(pos[u] < pos[v] for u, v in dag.edges)


def schedule(g: Graph) -> Graph:
    """A valid launch order that keeps few activation bytes live. A valid input order is kept
    unless the greedy order lowers the peak of live bytes, so good orders stay put."""
    dag = dependencies(g)
    out, greedy = g.copy(), g.copy()
    greedy.ops = _greedy_order(greedy, dag)
    if not _is_topological(out, dag) or peak_live_bytes(greedy) < peak_live_bytes(out):
        return greedy
    return out
