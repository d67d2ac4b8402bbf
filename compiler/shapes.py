"""Shape and dtype rules of every op kind: what verify() checks each op's outputs against."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .errors import IRError

if TYPE_CHECKING:   # ir.py calls these rules from verify(): a run-time import would be a cycle
    from .ir import Graph, Op

Shape = tuple[int, ...]
Rule = Callable[["Graph", "Op", list], list]

FLOAT = ("f32", "f16", "bf16")
WEIGHT = ("f32", "f16", "bf16", "q4_0", "q4_1", "q8_0")


def _need(cond: bool, op: Op, msg: str) -> None:
    if not cond:
        raise IRError(f"op {op.name} ({op.kind}): {msg}")


def _act(op: Op, v, rank: int = 2) -> None:
    _need(v.dtype in FLOAT and len(v.shape) == rank, op,
          f"{v.name!r} must be a float tensor of rank {rank}, got {v.dtype}{list(v.shape)}")


def _matmul_core(op: Op, x, w) -> tuple[int, int]:
    _act(op, x)
    _need(w.dtype in WEIGHT and len(w.shape) == 2, op, f"weight {w.name!r} must be a 2-D weight")
    _need(x.shape[1] == w.shape[1], op,
          f"{x.name!r} has {x.shape[1]} columns but weight {w.name!r} is {list(w.shape)} (rows = outputs)")
    return x.shape[0], w.shape[0]


def _embedding(g, op, ins):
    table, tokens = ins
    _need(tokens.dtype == "i32" and len(tokens.shape) == 1, op, "tokens must be i32[T]")
    _need(len(table.shape) == 2, op, "table must be [vocab, dim]")
    return [((tokens.shape[0], table.shape[1]), "f32")]


def _rms_norm(g, op, ins):
    x, w = ins
    _act(op, x)
    _need(len(w.shape) == 1 and w.shape[0] >= 1 and x.shape[1] % w.shape[0] == 0, op,
          f"norm weight {w.name!r} must be [G] with G dividing {x.shape[1]}, got {list(w.shape)}")
    return [(x.shape, "f32")]


def _bias(op: Op, b, n: int) -> None:
    _need(b.shape == (n,) and b.dtype == "f32", op, f"bias {b.name!r} must be f32[{n}], got {b.dtype}{list(b.shape)}")


def _matmul(g, op, ins):
    _need(len(ins) in (2, 3), op, "inputs are x, w and optionally a bias")
    t, n = _matmul_core(op, ins[0], ins[1])
    if len(ins) == 3:
        _bias(op, ins[2], n)
    return [((t, n), "f32")]


def _row_index(op: Op, v, t: int, what: str) -> None:
    _need(v.dtype == "i32" and v.shape == (t,) and v.kind == "input", op,
          f"{what} {v.name!r} must be an i32[{t}] graph input, got {v.kind} {v.dtype}{list(v.shape)}")


def _rope(g, op, ins):
    x, ins = ins[0], list(ins[1:])
    _act(op, x)
    hd, h = op.attrs["head_dim"], op.attrs["n_heads"]
    _need(x.shape[1] == h * hd and hd % 2 == 0, op, f"{x.name!r} must be [T, {h}*{hd}] with even head_dim")
    if ins and ins[-1].dtype == "i32":      # a step graph's per-row positions
        _row_index(op, ins.pop(), x.shape[0], "positions")
    if ins:
        _need(len(ins) == 1 and ins[0].shape == (hd // 2,), op, f"inv_freq must be [{hd // 2}]")
    return [(x.shape, "f32")]


def _kv_store(g, op, ins):
    _need(len(ins) in (2, 3), op, "inputs are src, cache and, in a step graph, slots")
    src, cache = ins[:2]
    if len(ins) == 3:
        _row_index(op, ins[2], src.shape[0], "slots")
    _act(op, src)
    _need(cache.kind == "state" and len(cache.shape) == 3, op, f"{cache.name!r} must be a state [S,KVH,hd]")
    _need(src.shape[1] == cache.shape[1] * cache.shape[2], op,
          f"{src.name!r} has {src.shape[1]} columns, cache rows hold {cache.shape[1]}x{cache.shape[2]}")
    out = g.values[op.outputs[0]]
    _need(out.alias == cache.name, op, f"output {out.name!r} must alias {cache.name!r}")
    return [(cache.shape, cache.dtype)]


def _cache_of(g: Graph, name: str):
    v = g.values[name]
    return g.values[v.alias] if v.alias else v


def _attention(g, op, ins):
    a = op.attrs
    paged = "block_size" in a
    _need(len(ins) in (6, 8) if paged else len(ins) in (3, 5), op,
          "inputs are q, k, v, row_seq, ctx_len, block_tables and optionally scores, score_from" if paged
          else "inputs are q, k, v and optionally scores, score_ctl")
    q, k, v = ins[:3]
    _act(op, q)
    _need(q.shape[1] == a["n_heads"] * a["head_dim"], op, f"q must be [T, {a['n_heads']}*{a['head_dim']}]")
    _need(a["n_heads"] % a["n_kv_heads"] == 0, op, "n_heads must be a multiple of n_kv_heads")
    for c in (k, v):
        _need(_cache_of(g, c.name).kind == "state" and c.shape[1:] == (a["n_kv_heads"], a["head_dim"]), op,
              f"{c.name!r} must be a KV cache [S, {a['n_kv_heads']}, {a['head_dim']}]")
    if paged:
        bs, tables = a["block_size"], ins[5]
        _row_index(op, ins[3], q.shape[0], "row_seq")
        _row_index(op, ins[4], q.shape[0], "ctx_len")
        _need(bs >= 1 and k.shape[0] % bs == 0, op, f"block_size {bs} must divide the cache's {k.shape[0]} rows")
        _need(tables.dtype == "i32" and tables.kind == "input" and len(tables.shape) == 2
              and tables.shape[1] * bs == k.shape[0], op,
              f"block_tables {tables.name!r} must be an i32[B, {k.shape[0] // max(bs, 1)}] graph input")
        if len(ins) == 6:
            return [(q.shape, "f32")]
        _row_index(op, ins[7], q.shape[0], "score_from")
        return [(q.shape, "f32"), _scores(g, op, ins[6], (a["n_kv_heads"], k.shape[0]))]
    if len(ins) == 3:
        return [(q.shape, "f32")]
    scores, ctl = ins[3:]
    _need(ctl.kind == "state" and ctl.shape == (2,) and ctl.dtype == "i32", op,
          f"score_ctl {ctl.name!r} must be a state i32[2]")
    return [(q.shape, "f32"), _scores(g, op, scores, (a["n_kv_heads"], k.shape[0]))]


def _scores(g, op, scores, want: tuple[int, int]):
    """The eviction scores an attention op adds to: a state f32 [KVH, S] its second output aliases."""
    _need(scores.kind == "state" and scores.shape == want and scores.dtype == "f32", op,
          f"scores {scores.name!r} must be a state f32{list(want)}")
    _need(len(op.outputs) == 2 and g.values[op.outputs[1]].alias == scores.name, op,
          f"second output must alias {scores.name!r}")
    return (scores.shape, "f32")


def _same(g, op, ins):
    for v in ins:
        _act(op, v)
    _need(all(v.shape == ins[0].shape for v in ins), op,
          "operands differ in shape: " + ", ".join(f"{v.name}{list(v.shape)}" for v in ins))
    return [(ins[0].shape, "f32")]


def _argmax(g, op, ins):
    _act(op, ins[0])
    return [((ins[0].shape[0],), "i32")]


def _slice(g, op, ins):
    _act(op, ins[0])
    _need(op.attrs.get("rows") == "last", op, "only rows='last' is supported")
    return [((1, ins[0].shape[1]), ins[0].dtype)]


def _gather(g, op, ins):
    x, rows = ins
    _act(op, x)
    _need(rows.dtype == "i32" and len(rows.shape) == 1 and rows.kind == "input", op,
          f"rows {rows.name!r} must be an i32[R] graph input")
    return [((rows.shape[0], x.shape[1]), "f32")]


def _fused_matmul(g, op, ins):
    a = op.attrs
    x, w, extra = ins[0], ins[1], list(ins[2:])
    t, n = _matmul_core(op, x, w)
    if a.get("prologue") == "rms_norm":
        norm_w = extra.pop(0)
        _need(norm_w.shape == (x.shape[1],), op, f"norm weight {norm_w.name!r} must be [{x.shape[1]}]")
    else:
        _need(a.get("prologue") is None, op, f"unknown prologue {a.get('prologue')!r}")
    if a.get("bias"):
        _need(bool(extra), op, "attr bias needs the bias as the last input")
        _bias(op, extra.pop(), n)
    epi = a.get("epilogue")
    _need(not a.get("qk_norm") or epi == "rope_kv_store", op, "attr qk_norm needs the rope_kv_store epilogue")
    if epi is None:
        out = [((t, n), "f32")]
    elif epi == "add":
        _need(len(extra) == 1 and extra[0].shape == (t, n), op, f"residual must be [{t},{n}]")
        extra = []
        out = [((t, n), "f32")]
    elif epi == "silu_mul":
        _need(n % 2 == 0, op, "silu_mul needs the gate and up weights stacked (even rows)")
        out = [((t, n // 2), "f32")]
    elif epi == "rope_kv_store":
        h, kvh, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
        _need(n == (h + 2 * kvh) * hd, op, f"weight must stack q,k,v: {(h + 2 * kvh) * hd} rows")
        if a.get("step_rows"):   # a step graph's positions and slots, the epilogue's last inputs
            _need(len(extra) >= 2, op, "attr step_rows needs positions and slots after the epilogue's inputs")
            _row_index(op, extra[-2], t, "positions")
            _row_index(op, extra[-1], t, "slots")
            extra = extra[:-2]
        want = 5 if a.get("qk_norm") else 3
        _need(len(extra) == want and extra[0].shape == (hd // 2,), op,
              "extra inputs: inv_freq, k_cache, v_cache" + (", q_norm_w, k_norm_w" if want == 5 else ""))
        kc, vc = extra[1], extra[2]
        for c, o in ((kc, op.outputs[1]), (vc, op.outputs[2])):
            _need(c.kind == "state" and c.shape[1:] == (kvh, hd), op, f"{c.name!r} must be [S,{kvh},{hd}]")
            _need(g.values[o].alias == c.name, op, f"output {o!r} must alias {c.name!r}")
        for nw in extra[3:]:
            _need(nw.shape == (hd,) and nw.dtype in FLOAT, op,
                  f"per-head norm weight {nw.name!r} must be a float [{hd}], got {nw.dtype}{list(nw.shape)}")
        extra = []
        out = [((t, h * hd), "f32"), (kc.shape, kc.dtype), (vc.shape, vc.dtype)]
    else:
        raise IRError(f"op {op.name} (fused_matmul): unknown epilogue {epi!r}")
    if epi in (None, "silu_mul"):
        _need(not extra, op, f"{len(extra)} unexpected extra inputs")
    return out


RULES: dict[str, Rule] = {
    "embedding": _embedding, "rms_norm": _rms_norm, "matmul": _matmul, "rope": _rope,
    "kv_store": _kv_store, "attention": _attention, "add": _same, "mul": _same, "silu": _same,
    "silu_mul": _same, "softmax": _same, "argmax": _argmax, "slice": _slice, "gather": _gather,
    "fused_matmul": _fused_matmul,
}


def infer_shapes(g: Graph, op: Op) -> list[tuple[Shape, str]]:
    ins = [g.values[i] for i in op.inputs]
    try:
        return RULES[op.kind](g, op, ins)
    except (KeyError, IndexError, ValueError) as e:
        if isinstance(e, IRError):
            raise
        raise IRError(f"op {op.name} ({op.kind}): malformed ({type(e).__name__}: {e})") from None
