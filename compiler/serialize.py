"""Graphs to and from JSON-ready dicts (structure only; weight data travels in the plan's sections).

Values, op attrs and meta are plain JSON except tuples, which are tagged `{"$tuple": [...]}` so
that a round trip gives back exactly the graph that went in. numpy scalars become Python ones.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .ir import DTYPES, VALUE_KINDS, Graph, IRError, LazyTensor, Op, Value

_TUPLE = "$tuple"


def _encode(x: Any, where: str) -> Any:
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, tuple):
        return {_TUPLE: [_encode(e, f"{where}[{i}]") for i, e in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(e, f"{where}[{i}]") for i, e in enumerate(x)]
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str) or k.startswith("$"):
                raise IRError(f"{where}: key {k!r} cannot be serialized (keys are strings not starting with '$')")
            out[k] = _encode(v, f"{where}[{k!r}]")
        return out
    raise IRError(f"{where}: a {type(x).__name__} cannot be serialized; store plain JSON data "
                  "(numbers, strings, lists, tuples, dicts)")


def _decode(x: Any) -> Any:
    if isinstance(x, list):
        return [_decode(e) for e in x]
    if isinstance(x, dict):
        if set(x) == {_TUPLE} and isinstance(x[_TUPLE], list):
            return tuple(_decode(e) for e in x[_TUPLE])
        return {k: _decode(v) for k, v in x.items()}
    return x


def graph_to_json(g: Graph) -> dict[str, Any]:
    """The graph's structure as JSON-ready data: values, ops, inputs, outputs, meta (no weights)."""
    where = f"graph {g.name}"
    return {
        "name": g.name,
        "T": int(g.T),
        # [name, shape, dtype, kind, alias]: compact, a 1B graph has ~600 values
        "values": [[v.name, [int(s) for s in v.shape], v.dtype, v.kind, v.alias] for v in g.values.values()],
        "ops": [{"kind": op.kind, "name": op.name, "inputs": list(op.inputs), "outputs": list(op.outputs),
                 "attrs": _encode(op.attrs, f"{where} op {op.name} attrs")} for op in g.ops],
        "inputs": list(g.inputs),
        "outputs": list(g.outputs),
        "meta": _encode(g.meta, f"{where} meta"),
    }


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise IRError(f"{where}: {msg}")


def _strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _value(row: Any, where: str) -> Value:
    _need(isinstance(row, list) and len(row) == 5, where, "a value must be [name, shape, dtype, kind, alias]")
    name, shape, dtype, kind, alias = row
    _need(isinstance(name, str), where, f"value name {name!r} is not a string")
    _need(isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape), where,
          f"value {name!r}: shape {shape!r} is not a list of non-negative integers")
    _need(dtype in DTYPES, where, f"value {name!r}: unknown dtype {dtype!r}")
    _need(kind in VALUE_KINDS, where, f"value {name!r}: unknown kind {kind!r}")
    _need(alias is None or isinstance(alias, str), where, f"value {name!r}: alias {alias!r} is not a name")
    return Value(name, tuple(shape), dtype, kind, alias)


def _op(d: Any, where: str) -> Op:
    _need(isinstance(d, dict), where, "an op must be an object")
    kind, name, attrs = d.get("kind"), d.get("name"), d.get("attrs", {})
    _need(isinstance(kind, str) and isinstance(name, str), where, f"op {name!r} has no kind or name")
    _need(_strs(d.get("inputs")) and _strs(d.get("outputs")), where, f"op {name}: inputs/outputs must be name lists")
    _need(isinstance(attrs, dict), where, f"op {name}: attrs must be an object")
    return Op(kind, list(d["inputs"]), list(d["outputs"]), _decode(attrs), name=name)


def graph_from_json(d: dict[str, Any], weights: dict[str, LazyTensor]) -> Graph:
    """Rebuild a graph from graph_to_json's data; param/const values take their data from weights.

    Raises IRError naming the graph and the malformed part (the data may come from a damaged file).
    """
    _need(isinstance(d, dict), "graph", "serialized graph is not an object")
    where = f"graph {d.get('name')!r}"
    _need(isinstance(d.get("name"), str), where, "no name")
    _need(type(d.get("T")) is int and d["T"] >= 1, where, f"T must be a positive integer, got {d.get('T')!r}")
    _need(isinstance(d.get("values"), list) and isinstance(d.get("ops"), list), where, "no value or op list")
    _need(_strs(d.get("inputs")) and _strs(d.get("outputs")), where, "inputs/outputs must be name lists")
    _need(isinstance(d.get("meta", {}), dict), where, "meta must be an object")
    values: dict[str, Value] = {}
    for row in d["values"]:
        v = _value(row, where)
        _need(v.name not in values, where, f"value {v.name!r} defined twice")
        values[v.name] = v
    data: dict[str, LazyTensor] = {}
    for v in values.values():
        if v.kind not in ("param", "const"):
            continue
        _need(v.name in weights, where, f"{v.kind} {v.name!r} has no weight data")
        lt = weights[v.name]
        _need(tuple(lt.shape) == v.shape and lt.dtype == v.dtype, where,
              f"{v.kind} {v.name!r} is {v.dtype}{list(v.shape)} but its data is {lt.dtype}{list(lt.shape)}")
        data[v.name] = lt
    return Graph(d["name"], d["T"], values=values, ops=[_op(o, where) for o in d["ops"]],
                 inputs=list(d["inputs"]), outputs=list(d["outputs"]), weights=data,
                 meta=_decode(d.get("meta", {})))
