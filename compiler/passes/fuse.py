"""Fuse ops into fewer, larger kernels: rewrite rules as data, each switchable by name.

A rule is a pattern (a tree of `Pat` ops over `Val` leaves, matched from a root op upwards
through producers) and a rewrite that turns one match into replacement ops. The matched ops
leave the graph (except a root marked `keep`), the replacements take the place of the first
of them, and the op list is re-sorted so every value is produced before it is read.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ..ir import Graph, IRError, LazyTensor, Op
from .fold import inv_freq_const
from .quantize import decode_rows, encode_rows

Match = dict[str, Any]  # pattern name -> Op (a Pat), value name (a Val), list of value names (a rest)


@dataclass(frozen=True)
class Val:
    """Any value; a name bound twice in one pattern must bind the same value both times."""
    name: str


@dataclass(frozen=True)
class Pat:
    """An op of `kind` whose attrs include `attrs` and whose first inputs match `src` in order;
    inputs beyond src bind as a list to `rest` (without `rest` there may be none)."""
    kind: str | tuple[str, ...]
    name: str
    src: tuple[Pat | Val, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)
    rest: str | None = None
    commutative: bool = False   # a two-input op may match its src in either order
    shared: bool = False        # outputs may be read outside the match (the rewrite re-produces them)
    keep: bool = False          # the op stays in the graph (only its inputs are rewritten away)


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Pat
    rewrite: Callable[[Graph, Match], list[Op] | None]  # None declines the match, leaving g as it was


# -- matching -----------------------------------------------------------------------------------

@dataclass
class _Index:
    producer: dict[str, Op]
    uses: Counter

    @staticmethod
    def of(g: Graph) -> "_Index":
        uses = Counter(i for op in g.ops for i in op.inputs)
        uses.update(g.outputs)  # a graph output is always read after the graph
        return _Index(g.producers(), uses)


def _match_op(ix: _Index, pat: Pat, op: Op, m: Match) -> bool:
    kinds = (pat.kind,) if isinstance(pat.kind, str) else pat.kind
    if op.kind not in kinds or any(op.attrs.get(k) != v for k, v in pat.attrs.items()):
        return False
    n = len(pat.src)
    if len(op.inputs) < n or (len(op.inputs) > n and pat.rest is None):
        return False
    orders = [op.inputs[:n]]
    if pat.commutative and n == 2:
        orders.append(op.inputs[1::-1])
    for ins in orders:
        trial = dict(m)
        if all(_match_value(ix, p, v, trial) for p, v in zip(pat.src, ins)):
            trial[pat.name] = op
            if pat.rest is not None:
                trial[pat.rest] = op.inputs[n:]
            m.clear()
            m.update(trial)
            return True
    return False


def _match_value(ix: _Index, pat: Pat | Val, value: str, m: Match) -> bool:
    if isinstance(pat, Val):
        return m.setdefault(pat.name, value) == value
    op = ix.producer.get(value)
    if op is None or (not pat.shared and ix.uses[value] != 1):
        return False
    return _match_op(ix, pat, op, m)


def _pats(pat: Pat) -> Iterator[Pat]:
    yield pat
    for p in pat.src:
        if isinstance(p, Pat):
            yield from _pats(p)


def _toposort(ops: list[Op], rule: str) -> list[Op]:
    """Producers before readers, otherwise keeping the given order."""
    prod = {o: i for i, op in enumerate(ops) for o in op.outputs}
    deps = [{prod[v] for v in op.inputs if v in prod} for op in ops]
    readers: list[list[int]] = [[] for _ in ops]
    for i, d in enumerate(deps):
        for j in d:
            readers[j].append(i)
    waiting = [len(d) for d in deps]
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(ops[i])
        for r in readers[i]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(ops):
        raise IRError(f"fuse: rule {rule} made a cycle between ops; switch it off with --no-fuse {rule}")
    return order


def _apply(g: Graph, rule: Rule) -> int:
    """Rewrite every match of rule in g (in place); returns how many."""
    removed = [p.name for p in _pats(rule.pattern) if not p.keep]
    done = 0
    while True:
        ix = _Index.of(g)
        for op in g.ops:
            m: Match = {}
            if _match_op(ix, rule.pattern, op, m):
                new = rule.rewrite(g, m)
                if new is not None:
                    break
        else:
            return done
        dead = {id(m[name]) for name in removed}
        first = min(i for i, op in enumerate(g.ops) if id(op) in dead)
        kept = [op for op in g.ops[:first] if id(op) not in dead]
        g.ops = _toposort(kept + new + [op for op in g.ops[first:] if id(op) not in dead], rule.name)
        done += 1


def _remove_dead(g: Graph) -> None:
    """Drop ops whose results nobody reads (kv_store-like writes to state always count as read)
    and values no op produces or reads."""
    needed = set(g.outputs)
    live = []
    for op in reversed(g.ops):
        if any(o in needed or g.values[o].alias for o in op.outputs):
            live.append(op)
            needed.update(op.inputs)
    g.ops = live[::-1]
    touched = {v for op in g.ops for v in op.inputs + op.outputs} | set(g.outputs)
    for name, v in list(g.values.items()):
        if v.kind in ("act", "param", "const") and name not in touched:
            del g.values[name]
            g.weights.pop(name, None)


# -- rewrites -----------------------------------------------------------------------------------

def _fused(inputs: list[str], outputs: list[str], prologue: str | None, epilogue: str | None,
           **attrs: Any) -> Op:
    return Op("fused_matmul", inputs, outputs, dict(prologue=prologue, epilogue=epilogue, **attrs))


def _as_fused(mm: Op, inputs: list[str], outputs: list[str], **changes: Any) -> Op:
    """mm (a matmul or fused_matmul) as a fused_matmul with new operands and attrs changed."""
    attrs = {**mm.attrs, **changes}
    return _fused(inputs, outputs, attrs.pop("prologue", None), attrs.pop("epilogue", None), **attrs)


def _stackable(g: Graph, names: list[str]) -> bool:
    vs = [g.values[n] for n in names]
    return all(v.kind in ("param", "const") and len(v.shape) == 2 and v.dtype == vs[0].dtype
               and v.shape[1] == vs[0].shape[1] for v in vs)


def _stack(g: Graph, names: list[str], label: str) -> str:
    """A const [sum of rows, K] holding the weights' rows one after another, made on load.
    Quantized rows are whole blocks, so stacking block arrays equals quantizing the stack."""
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    base = ".".join(parts[0][:common] + [label, "weight"])
    name, k = base, 1
    while name in g.values:
        name, k = f"{base}.{k}", k + 1
    srcs = [g.weights[n] for n in names]
    shape = (sum(s.shape[0] for s in srcs), srcs[0].shape[1])
    g.add_value(name, shape, srcs[0].dtype, kind="const")
    g.weights[name] = LazyTensor(shape, srcs[0].dtype,
                                 lambda: np.concatenate([s.load() for s in srcs], axis=0))
    return name


def _qkv_rope_kv(g: Graph, m: Match) -> list[Op] | None:
    rq, rk = m["rope_q"].attrs, m["rope_k"].attrs
    h, kvh, hd = rq["n_heads"], rk["n_heads"], rq["head_dim"]
    rows = [g.values[m[w]].shape[0] for w in ("wq", "wk", "wv")]
    if (rows != [h * hd, kvh * hd, kvh * hd] or rk["head_dim"] != hd or rk["theta"] != rq["theta"]
            or rk.get("scaling") != rq.get("scaling") or m["q_freq"] != m["k_freq"]
            or not _stackable(g, [m["wq"], m["wk"], m["wv"]])):
        return None
    w = _stack(g, [m["wq"], m["wk"], m["wv"]], "qkv_proj")
    freq = m["q_freq"][0] if m["q_freq"] else inv_freq_const(g, hd, rq["theta"], rq.get("scaling"))
    outs = [m["rope_q"].outputs[0], m["store_k"].outputs[0], m["store_v"].outputs[0]]
    return [_fused([m["x"], w, freq, m["k_cache"], m["v_cache"]], outs, None, "rope_kv_store",
                   n_heads=h, n_kv_heads=kvh, head_dim=hd, theta=rq["theta"], scaling=rq.get("scaling"))]


def _gate_up_silu(g: Graph, m: Match) -> list[Op] | None:
    if not _stackable(g, [m["w_gate"], m["w_up"]]):
        return None
    w = _stack(g, [m["w_gate"], m["w_up"]], "gate_up_proj")
    return [_fused([m["x"], w], m["act"].outputs, None, "silu_mul")]


def _residual_epilogue(g: Graph, m: Match) -> list[Op] | None:
    mm = m["mm"]
    return [_as_fused(mm, [*mm.inputs, m["residual"]], m["add"].outputs, epilogue="add")]


def _last_token_logits(g: Graph, m: Match) -> list[Op] | None:
    head, norm, x = m["head"], m["norm"], m["x"]
    rows, d = g.values[x].shape
    gathered = getattr(g.producers().get(x), "kind", None) == "gather"   # a step graph picks its rows
    if rows == 1 or gathered or not set(head.outputs) & set(g.outputs):
        return None
    last = g.add_value(f"{x}.last", (1, d), g.values[x].dtype)       # [1, D]
    for v in norm.outputs + head.outputs:                              # [T, *] -> [1, *]
        g.values[v].shape = (1, *g.values[v].shape[1:])
    return [Op("slice", [x], [last], {"rows": "last"}),
            dataclasses.replace(norm, inputs=[last, *norm.inputs[1:]]),
            dataclasses.replace(head, inputs=list(head.inputs))]


def _norm_prologue(g: Graph, m: Match) -> list[Op] | None:
    mm, norm = m["mm"], m["norm"]
    return [_as_fused(mm, [m["x"], m["w"], m["norm_w"], *m["extra"]], mm.outputs,
                     prologue="rms_norm", eps=norm.attrs["eps"])]


def _norm_weight_fold(g: Graph, m: Match) -> list[Op] | None:
    """rms_norm's weight folded into the float matmul weight it feeds: dot(w, x / rms * nw) =
    dot(w * nw, x) / rms, so a decode kernel loads no norm weight (on the H200 those loads cost
    an f16 matvec ~4 us a launch). The norm input becomes a shared const of ones, which every
    back end multiplies by exactly as before; `norm_folded` lets a back end skip it. Quantized
    weights keep GGML's bytes, and a weight or norm read elsewhere (a tied lm_head) stays."""
    mm, w, nw = m["mm"], m["w"], m["norm_w"]
    wv, nv = g.values[w], g.values[nw]
    if (mm.attrs.get("norm_folded") or wv.dtype not in ("f32", "f16")
            or wv.kind not in ("param", "const") or nv.kind not in ("param", "const")
            or sum(op.inputs.count(w) + op.inputs.count(nw) for op in g.ops) != 2):
        return None
    folded = f"{w}.normed"
    if folded not in g.values:
        src_w, src_n = g.weights[w], g.weights[nw]

        def make(src_w=src_w, src_n=src_n, nd=nv.dtype, wd=wv.dtype) -> np.ndarray:
            n = decode_rows(src_n.load(), nd)
            return encode_rows(decode_rows(src_w.load(), wd) * n[None, :], wd)
        g.add_value(folded, wv.shape, wv.dtype, kind="const")
        g.weights[folded] = LazyTensor(wv.shape, wv.dtype, make)
    ones = f"norm.ones.{nv.shape[0]}"
    if ones not in g.values:
        g.add_value(ones, nv.shape, "f32", kind="const")
        g.weights[ones] = LazyTensor.of(np.ones(nv.shape, np.float32), "f32")
    return [_as_fused(mm, [m["x"], folded, ones, *m["extra"]], mm.outputs, norm_folded=True)]


_MATMUL = ("matmul", "fused_matmul")

RULES: list[Rule] = [
    # attention(rope(x@wq), kv_store(rope(x@wk)), kv_store(x@wv)) -> one matmul over [q;k;v]
    Rule("qkv_rope_kv", Pat("attention", "attn", keep=True, rest="scores", src=(
        Pat("rope", "rope_q", rest="q_freq", shared=True, src=(Pat("matmul", "mm_q", src=(Val("x"), Val("wq"))),)),
        Pat("kv_store", "store_k", shared=True, src=(
            Pat("rope", "rope_k", rest="k_freq", src=(Pat("matmul", "mm_k", src=(Val("x"), Val("wk"))),)),
            Val("k_cache"))),
        Pat("kv_store", "store_v", shared=True, src=(Pat("matmul", "mm_v", src=(Val("x"), Val("wv"))),
                                                     Val("v_cache"))))),
         _qkv_rope_kv),
    # silu_mul(x@w_gate, x@w_up) -> one matmul over [gate;up]
    Rule("gate_up_silu", Pat("silu_mul", "act", src=(Pat("matmul", "mm_gate", src=(Val("x"), Val("w_gate"))),
                                                      Pat("matmul", "mm_up", src=(Val("x"), Val("w_up"))))),
         _gate_up_silu),
    # residual + x@w -> the matmul adds the residual as it writes
    Rule("residual_epilogue", Pat("add", "add", commutative=True, src=(
        Val("residual"),
        Pat(_MATMUL, "mm", attrs={"epilogue": None}, rest="extra", src=(Val("x"), Val("w"))))),
         _residual_epilogue),
    # prefill: norm and lm_head only on the last row (before norm_prologue folds the norm in)
    Rule("last_token_logits", Pat(_MATMUL, "head", attrs={"prologue": None, "epilogue": None}, rest="extra", src=(
        Pat("rms_norm", "norm", src=(Val("x"), Val("norm_w"))), Val("w"))),
         _last_token_logits),
    # rms_norm read by one matmul -> normalised inside the matmul
    Rule("norm_prologue", Pat(_MATMUL, "mm", attrs={"prologue": None}, rest="extra", src=(
        Pat("rms_norm", "norm", src=(Val("x"), Val("norm_w"))), Val("w"))),
         _norm_prologue),
    # the norm's weight multiplied into the (float) matmul weight it feeds
    Rule("norm_weight_fold", Pat("fused_matmul", "mm", attrs={"prologue": "rms_norm"}, rest="extra",
                                 src=(Val("x"), Val("w"), Val("norm_w"))),
         _norm_weight_fold),
]
RULE_NAMES = tuple(r.name for r in RULES)


def check_rule_names(names: tuple[str, ...] | list[str]) -> None:
    unknown = [n for n in names if n not in RULE_NAMES]
    if unknown:
        raise ValueError(f"unknown fusion rule {unknown[0]!r}; the rules are {', '.join(RULE_NAMES)}")


def fuse(g: Graph, disabled: tuple[str, ...] | list[str] = ()) -> Graph:
    """Apply every rule not named in `disabled`, in RULES order, then drop dead ops and values."""
    check_rule_names(disabled)
    g = g.copy()
    for rule in RULES:
        if rule.name not in disabled:
            _apply(g, rule)
    _remove_dead(g)
    for i, op in enumerate(g.ops):
        op.name = f"{op.kind}_{i}"
    return g
