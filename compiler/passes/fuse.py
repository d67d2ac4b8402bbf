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
    pattern: Pat | tuple[Pat, ...]                       # one pattern, or alternatives tried in order
    rewrite: Callable[[Graph, Match], list[Op] | None]  # None declines the match, leaving g as it was

    @property
    def patterns(self) -> tuple[Pat, ...]:
        return self.pattern if isinstance(self.pattern, tuple) else (self.pattern,)


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


def _first_match(g: Graph, rule: Rule) -> tuple[Pat, Match, list[Op]] | None:
    """The first op (in graph order) where one of the rule's patterns matches and the rewrite
    accepts: (that pattern, the match, the replacement ops)."""
    ix = _Index.of(g)
    for op in g.ops:
        for pattern in rule.patterns:
            m: Match = {}
            if _match_op(ix, pattern, op, m):
                new = rule.rewrite(g, m)
                if new is not None:
                    return pattern, m, new
    return None


def _apply(g: Graph, rule: Rule) -> int:
    """Rewrite every match of rule in g (in place); returns how many."""
    done = 0
    while True:
        found = _first_match(g, rule)
        if found is None:
            return done
        pattern, m, new = found
        dead = {id(m[p.name]) for p in _pats(pattern) if not p.keep}
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


@dataclass
class _Operands:
    """A matmul or fused_matmul taken apart into its roles (compiler/ir.py orders them: x, w,
    norm_w if prologue, the epilogue's, b if bias), so a rewrite changes one role and the bias
    keeps its place and its attr."""
    x: str
    w: str
    norm_w: str | None          # the RMS prologue's weight
    epilogue: list[str]         # the epilogue's inputs
    bias: str | None            # b[N], added before the epilogue
    attrs: dict[str, Any]       # every attr but bias

    @staticmethod
    def of(op: Op) -> "_Operands":
        if op.kind == "matmul":
            return _Operands(op.inputs[0], op.inputs[1], None, [], op.inputs[2] if len(op.inputs) == 3 else None, {})
        attrs = dict(op.attrs)
        rest = list(op.inputs[2:])
        norm_w = rest.pop(0) if attrs.get("prologue") == "rms_norm" else None
        bias = rest.pop() if attrs.pop("bias", False) else None
        return _Operands(op.inputs[0], op.inputs[1], norm_w, rest, bias, attrs)

    def op(self, outputs: list[str], **changes: Any) -> Op:
        """A fused_matmul of these operands writing outputs, with attrs changed."""
        attrs = {**self.attrs, **changes}
        if self.bias is not None:
            attrs["bias"] = True
        inputs = [self.x, self.w, *([self.norm_w] if self.norm_w else []), *self.epilogue,
                  *([self.bias] if self.bias else [])]
        return _fused(inputs, outputs, attrs.pop("prologue", None), attrs.pop("epilogue", None), **attrs)


def _stackable(g: Graph, names: list[str]) -> bool:
    vs = [g.values[n] for n in names]
    return all(v.kind in ("param", "const") and len(v.shape) == 2 and v.dtype == vs[0].dtype
               and v.shape[1] == vs[0].shape[1] for v in vs)


def _stacked_name(g: Graph, names: list[str], label: str, suffix: str) -> str:
    """<the names' common prefix>.<label>.<suffix>, numbered if taken."""
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    base = ".".join(parts[0][:common] + [label, suffix])
    name, k = base, 1
    while name in g.values:
        name, k = f"{base}.{k}", k + 1
    return name


def _stack(g: Graph, names: list[str], label: str) -> str:
    """A const [sum of rows, K] holding the weights' rows one after another, made on load.
    Quantized rows are whole blocks, so stacking block arrays equals quantizing the stack."""
    name = _stacked_name(g, names, label, "weight")
    srcs = [g.weights[n] for n in names]
    shape = (sum(s.shape[0] for s in srcs), srcs[0].shape[1])
    g.add_value(name, shape, srcs[0].dtype, kind="const")
    g.weights[name] = LazyTensor(shape, srcs[0].dtype,
                                 lambda: np.concatenate([s.load() for s in srcs], axis=0))
    return name


def _biases_ok(g: Graph, rests: list[list[str]]) -> bool:
    """Each matched matmul's extra inputs (its bias, or none) are weights a stack can hold."""
    return all(len(r) <= 1 and all(g.values[b].kind in ("param", "const") for b in r) for r in rests)


def _stack_biases(g: Graph, weights: list[str], rests: list[list[str]], label: str) -> str | None:
    """The matmuls' biases (f32[rows], zeros for one without) as one const f32[sum of rows],
    named after the weights; None where none of them has a bias."""
    if not any(rests):
        return None
    rows = [g.values[w].shape[0] for w in weights]
    srcs = [g.weights[r[0]] if r else None for r in rests]
    name = _stacked_name(g, weights, label, "bias")

    def make() -> np.ndarray:
        return np.concatenate([s.load() if s is not None else np.zeros(n, np.float32) for s, n in zip(srcs, rows)])
    g.add_value(name, (sum(rows),), "f32", kind="const")
    g.weights[name] = LazyTensor((sum(rows),), "f32", make)
    return name


def _split_step_rows(g: Graph, names: list[str]) -> tuple[list[str], list[str]]:
    """An op's trailing inputs as (its own, a step graph's i32 row indices: rope's positions,
    kv_store's slots; compiler/ir.py "Step graphs")."""
    own = [n for n in names if g.values[n].dtype != "i32"]
    return own, names[len(own):]


def _qkv_rope_kv(g: Graph, m: Match) -> list[Op] | None:
    rq, rk = m["rope_q"].attrs, m["rope_k"].attrs
    h, kvh, hd = rq["n_heads"], rk["n_heads"], rq["head_dim"]
    weights = [m["wq"], m["wk"], m["wv"]]
    rests = [m["bq"], m["bk"], m["bv"]]
    rows = [g.values[w].shape[0] for w in weights]
    q_freq, q_pos = _split_step_rows(g, m["q_freq"])
    k_freq, k_pos = _split_step_rows(g, m["k_freq"])
    # a step graph: both ropes at the same per-row positions, both stores at the same slots
    step = q_pos + m["k_slots"]
    if (rows != [h * hd, kvh * hd, kvh * hd] or rk["head_dim"] != hd or rk["theta"] != rq["theta"]
            or rk.get("scaling") != rq.get("scaling") or q_freq != k_freq
            or q_pos != k_pos or m["k_slots"] != m["v_slots"] or len(step) not in (0, 2)
            or not _stackable(g, weights) or not _biases_ok(g, rests)):
        return None
    qk_norm = {}
    if "norm_q" in m:   # Qwen3: per-head norms of q and k (G = head_dim), one eps for both
        eps = m["norm_q"].attrs["eps"]
        if (g.values[m["qn"]].shape != (hd,) or g.values[m["kn"]].shape != (hd,)
                or m["norm_k"].attrs["eps"] != eps):
            return None
        qk_norm = dict(qk_norm=True, qk_eps=eps)
    w = _stack(g, weights, "qkv_proj")
    freq = q_freq[0] if q_freq else inv_freq_const(g, hd, rq["theta"], rq.get("scaling"))
    outs = [m["rope_q"].outputs[0], m["store_k"].outputs[0], m["store_v"].outputs[0]]
    norms = [m["qn"], m["kn"]] if qk_norm else []
    bias = _stack_biases(g, weights, rests, "qkv_proj")
    return [_Operands(m["x"], w, None, [freq, m["k_cache"], m["v_cache"], *norms, *step], bias, {}).op(
        outs, epilogue="rope_kv_store", n_heads=h, n_kv_heads=kvh, head_dim=hd, theta=rq["theta"],
        scaling=rq.get("scaling"), **qk_norm, **({"step_rows": True} if step else {}))]


def _gate_up_silu(g: Graph, m: Match) -> list[Op] | None:
    weights, rests = [m["w_gate"], m["w_up"]], [m["b_gate"], m["b_up"]]
    if not _stackable(g, weights) or not _biases_ok(g, rests):
        return None
    w = _stack(g, weights, "gate_up_proj")
    bias = _stack_biases(g, weights, rests, "gate_up_proj")
    return [_Operands(m["x"], w, None, [], bias, {}).op(m["act"].outputs, epilogue="silu_mul")]


def _residual_epilogue(g: Graph, m: Match) -> list[Op] | None:
    mm = _Operands.of(m["mm"])
    mm.epilogue = [m["residual"]]
    return [mm.op(m["add"].outputs, epilogue="add")]


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
    mm, norm = _Operands.of(m["mm"]), m["norm"]
    if g.values[m["norm_w"]].shape != g.values[m["x"]].shape[1:]:
        return None   # a norm over groups of a row (per head) is no prologue of a whole row
    mm.x, mm.norm_w = m["x"], m["norm_w"]
    return [mm.op(m["mm"].outputs, prologue="rms_norm", eps=norm.attrs["eps"])]


def _norm_weight_fold(g: Graph, m: Match) -> list[Op] | None:
    """rms_norm's weight folded into the float matmul weight it feeds: dot(w, x / rms * nw) =
    dot(w * nw, x) / rms, so a decode kernel loads no norm weight (on the H200 those loads cost
    an f16 matvec ~4 us a launch). The norm input becomes a shared const of ones, which every
    back end multiplies by exactly as before; `norm_folded` lets a back end skip it. Quantized
    weights keep GGML's bytes, and a weight or norm read elsewhere (a tied lm_head) stays. A
    bias is added after the dot product, so it stays as it is."""
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
    operands = _Operands.of(mm)
    operands.w, operands.norm_w = folded, ones
    return [operands.op(mm.outputs, norm_folded=True)]


_MATMUL = ("matmul", "fused_matmul")


def _projection(name: str, w: str, bias: str) -> Pat:
    """x @ w (+ bias): a plain matmul, its bias (none or one) bound as a list to `bias`."""
    return Pat("matmul", name, rest=bias, src=(Val("x"), Val(w)))


def _qkv_pattern(qk_norm: bool) -> Pat:
    """attention(rope(x@wq), kv_store(rope(x@wk)), kv_store(x@wv)), each projection with or
    without a bias; with qk_norm (Qwen3) q and k pass a per-head rms_norm before RoPE. In a step
    graph the ropes' rests end in positions, the stores' in slots, and the attention's rest is
    its paged inputs."""
    q, k = _projection("mm_q", "wq", "bq"), _projection("mm_k", "wk", "bk")
    if qk_norm:
        q = Pat("rms_norm", "norm_q", src=(q, Val("qn")))
        k = Pat("rms_norm", "norm_k", src=(k, Val("kn")))
    return Pat("attention", "attn", keep=True, rest="scores", src=(
        Pat("rope", "rope_q", rest="q_freq", shared=True, src=(q,)),
        Pat("kv_store", "store_k", shared=True, rest="k_slots",
            src=(Pat("rope", "rope_k", rest="k_freq", src=(k,)), Val("k_cache"))),
        Pat("kv_store", "store_v", shared=True, rest="v_slots",
            src=(_projection("mm_v", "wv", "bv"), Val("v_cache")))))


RULES: list[Rule] = [
    # attention(rope([norm](x@wq [+bq])), kv_store(rope([norm](x@wk [+bk]))), kv_store(x@wv [+bv]))
    #   -> one matmul over [q;k;v] (biases stacked too), the per-head norms in its epilogue; in a
    #   step graph the per-row positions and slots go with it (attr step_rows)
    Rule("qkv_rope_kv", (_qkv_pattern(qk_norm=False), _qkv_pattern(qk_norm=True)), _qkv_rope_kv),
    # silu_mul(x@w_gate [+b], x@w_up [+b]) -> one matmul over [gate;up]
    Rule("gate_up_silu", Pat("silu_mul", "act", src=(_projection("mm_gate", "w_gate", "b_gate"),
                                                      _projection("mm_up", "w_up", "b_up"))),
         _gate_up_silu),
    # residual + x@w [+b] -> the matmul adds the residual as it writes
    Rule("residual_epilogue", Pat("add", "add", commutative=True, src=(
        Val("residual"),
        Pat(_MATMUL, "mm", attrs={"epilogue": None}, rest="extra", src=(Val("x"), Val("w"))))),
         _residual_epilogue),
    # prefill: norm and lm_head only on the last row (before norm_prologue folds the norm in)
    Rule("last_token_logits", Pat(_MATMUL, "head", attrs={"prologue": None, "epilogue": None}, rest="extra", src=(
        Pat("rms_norm", "norm", src=(Val("x"), Val("norm_w"))), Val("w"))),
         _last_token_logits),
    # rms_norm of whole rows read by one matmul -> normalised inside the matmul
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
