"""Run any graph, base or fused, in numpy: the oracle every pass and kernel is checked against.

State (the KV caches) lives in a dict the caller keeps between calls, so a prefill followed by
decode steps behaves as the runtime does. Activations hold only the step's n_tokens rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .rope import apply_rope, rope_angles, rope_inv_freq
from . import quant
from .ir import Graph, IRError, Op, storage_shape


class KVCacheFull(IRError):
    pass


@dataclass
class Step:
    n_tokens: int
    n_past: int
    start_pos: int


def _to_float(arr: np.ndarray, dtype: str, ft) -> np.ndarray:
    if dtype == "bf16":
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(ft)
    return arr.astype(ft)


class Interpreter:
    """Executes a graph with float32 (default) or float64 arithmetic."""

    def __init__(self, graph: Graph, dtype=np.float32):
        self.graph = graph
        self.ft = np.dtype(dtype)
        self._weights: dict[str, np.ndarray] = {}

    # -- storage ------------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        if name not in self._weights:
            self._weights[name] = self.graph.weights[name].load()
        return self._weights[name]

    def weight(self, name: str) -> np.ndarray:
        """A float weight; quantized ones are dequantized (matmul uses them raw instead)."""
        v = self.graph.values[name]
        arr = self.raw(name)
        if v.dtype in quant.BLOCK_BYTES:
            return quant.dequantize(arr, v.dtype).astype(self.ft)
        return _to_float(arr, v.dtype, self.ft)

    def new_state(self) -> dict[str, np.ndarray]:
        state = {}
        for name in self.graph.state:
            v = self.graph.values[name]
            shape, np_dtype = storage_shape(v.shape, v.dtype)
            state[name] = np.zeros(shape, np_dtype if v.dtype != "f32" else self.ft)
        return state

    # -- running ------------------------------------------------------------------------------
    def run(self, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray], n_past: int,
            start_pos: int | None = None) -> dict[str, np.ndarray]:
        g = self.graph
        tokens = np.asarray(inputs["tokens"], dtype=np.int32).reshape(-1)
        if not 1 <= len(tokens) <= g.T:
            raise IRError(f"graph {g.name} takes 1..{g.T} tokens per step, got {len(tokens)}")
        step = Step(len(tokens), n_past, n_past if start_pos is None else start_pos)
        env: dict[str, np.ndarray] = {"tokens": tokens}
        for name in g.inputs[1:]:       # a step graph's per-row indices (ir.py "Step graphs")
            if name not in inputs:
                raise IRError(f"graph {g.name} needs input {name!r}")
            env[name] = np.asarray(inputs[name], dtype=np.int32)
        for name in g.state:
            env[name] = state[name]
        for op in g.ops:
            args = [env[i] if i in env else self._param(i) for i in op.inputs]
            outs = OPS[op.kind](self, op, step, *args)
            for name, val in zip(op.outputs, outs):
                env[name] = val
        return {o: env[o] for o in g.outputs}

    def _param(self, name: str) -> np.ndarray:
        v = self.graph.values[name]
        if v.kind not in ("param", "const"):
            raise IRError(f"value {name!r} is read before any op produced it")
        return self.raw(name)  # ops decide how to read raw weights (matmul keeps blocks)


# Each op: (interp, op, step, *inputs) -> list of outputs. Weights arrive raw (storage dtype).

def _f(it: Interpreter, op: Op, idx: int, arr: np.ndarray) -> np.ndarray:
    """Input idx of op as float: weights are decoded, activations passed through."""
    v = it.graph.values[op.inputs[idx]]
    if v.kind in ("param", "const"):
        return it.weight(v.name)
    return arr


def _embedding(it, op, st, table, tokens):
    v = it.graph.values[op.inputs[0]]
    if np.any(tokens < 0) or np.any(tokens >= v.shape[0]):
        raise IRError(f"op {op.name}: token id out of range 0..{v.shape[0] - 1}")
    rows = table[tokens]
    if v.dtype in quant.BLOCK_BYTES:
        return [quant.dequantize(rows, v.dtype).astype(it.ft)]
    return [_to_float(rows, v.dtype, it.ft)]


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMS norm over each run of len(w) values of a row (the whole row, or one head)."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // w.shape[0], w.shape[0])
    var = np.mean(g * g, axis=-1, keepdims=True)
    return ((g / np.sqrt(var + x.dtype.type(eps))) * w).reshape(x.shape)


def _rms_norm(it, op, st, x, w):
    return [_rms(x, _f(it, op, 1, w), op.attrs["eps"]).astype(it.ft)]


def _mm(it: Interpreter, op: Op, x: np.ndarray, w_idx: int) -> np.ndarray:
    v = it.graph.values[op.inputs[w_idx]]
    if v.dtype in quant.BLOCK_BYTES:
        return quant.matmul_quantized(x, it.raw(v.name), v.dtype).astype(it.ft)
    return x @ it.weight(v.name).T


def _matmul(it, op, st, x, w, b=None):
    y = _mm(it, op, x, 1)
    return [y if b is None else (y + b.astype(it.ft)).astype(it.ft)]


def _inv_freq(it: Interpreter, op: Op, given: np.ndarray | None) -> np.ndarray:
    if given is not None:
        return given.astype(np.float32)
    a = op.attrs
    return rope_inv_freq(a["head_dim"], a["theta"], a.get("scaling"))


def _rope_heads(it: Interpreter, st: Step, x: np.ndarray, heads: int, hd: int, inv_freq,
                positions: np.ndarray | None = None) -> np.ndarray:
    n = x.shape[0]
    pos = st.start_pos + np.arange(n) if positions is None else positions[:n]
    cos, sin = rope_angles(pos, inv_freq, it.ft.type)
    return apply_rope(x.reshape(n, heads, hd), cos, sin).reshape(n, heads * hd).astype(it.ft)


def _rope(it, op, st, x, *extra):
    a = op.attrs
    extra = list(extra)
    positions = extra.pop() if extra and it.graph.values[op.inputs[-1]].dtype == "i32" else None
    inv_freq = extra[0] if extra else None
    return [_rope_heads(it, st, x, a["n_heads"], a["head_dim"], _inv_freq(it, op, inv_freq), positions)]


def _store(it: Interpreter, op: Op, st: Step, src: np.ndarray, cache: np.ndarray, cache_name: str,
           slots: np.ndarray | None = None) -> np.ndarray:
    v = it.graph.values[cache_name]
    s, kvh, hd = v.shape
    if slots is None:
        end = st.n_past + st.n_tokens
        if end > s:
            raise KVCacheFull(f"op {op.name}: KV cache {cache_name!r} holds {s} tokens; "
                              f"{st.n_past} + {st.n_tokens} do not fit")
        rows_at = slice(st.n_past, end)
    else:
        rows_at = slots[:st.n_tokens]
        if rows_at.min() < 0 or rows_at.max() >= s:
            raise IRError(f"op {op.name}: a KV slot is outside 0..{s - 1}")
    rows = src.reshape(st.n_tokens, kvh, hd)
    if v.dtype in quant.BLOCK_BYTES:
        cache[rows_at] = quant.quantize(rows, v.dtype)
    else:
        cache[rows_at] = rows.astype(cache.dtype)
    return cache


def _kv_store(it, op, st, src, cache, slots=None):
    return [_store(it, op, st, src, cache, op.inputs[1], slots)]


def _read_cache(it: Interpreter, name: str, cache: np.ndarray, length: int) -> np.ndarray:
    v = it.graph.values[name]
    dtype = it.graph.values[v.alias].dtype if v.alias else v.dtype
    rows = cache[:length]
    if dtype in quant.BLOCK_BYTES:
        return quant.dequantize(rows, dtype).astype(it.ft)
    return _to_float(rows, dtype, it.ft)


def _paged_attention(it, op, st, q, k_cache, v_cache, row_seq, ctx_len, tables, kept_scores=None, score_from=None):
    a = op.attrs
    h, kvh, hd, bs = a["n_heads"], a["n_kv_heads"], a["head_dim"], a["block_size"]
    group = h // kvh
    k_all = _read_cache(it, op.inputs[1], k_cache, k_cache.shape[0])
    v_all = _read_cache(it, op.inputs[2], v_cache, v_cache.shape[0])
    out = np.zeros((st.n_tokens, h * hd), it.ft)
    for t in range(st.n_tokens):
        j = np.arange(ctx_len[t])
        rows = tables[row_seq[t], j // bs] * bs + j % bs
        k, v = k_all[rows], v_all[rows]                              # [L, KVH, hd]
        qh = q[t].reshape(kvh, group, hd)
        s = np.einsum("kgd,lkd->kgl", qh, k) * it.ft.type(a["scale"])
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[t] = np.einsum("kgl,lkd->kgd", p, v).reshape(-1)
        if kept_scores is not None and ctx_len[t] - 1 >= score_from[t]:
            # eviction scores at the entries' physical slots, rows in step order
            kept_scores[:, rows] += p.sum(axis=1).astype(kept_scores.dtype)
    if kept_scores is None:
        return [out]
    return [out, kept_scores]


def _attention(it, op, st, q, k_cache, v_cache, kept_scores=None, score_ctl=None, *paged):
    a = op.attrs
    if "block_size" in a:
        return _paged_attention(it, op, st, q, k_cache, v_cache, kept_scores, score_ctl, *paged)
    h, kvh, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    n, length = st.n_tokens, st.n_past + st.n_tokens
    k = _read_cache(it, op.inputs[1], k_cache, length)           # [L, KVH, hd]
    v = _read_cache(it, op.inputs[2], v_cache, length)
    group = h // kvh
    qh = q.reshape(n, kvh, group, hd)
    scores = np.einsum("tkgd,lkd->kgtl", qh, k) * it.ft.type(a["scale"])   # [KVH, G, n, L]
    visible = np.arange(length)[None, :] <= (st.n_past + np.arange(n))[:, None]
    scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("kgtl,lkd->tkgd", p, v)
    if kept_scores is None:
        return [out.reshape(n, h * hd).astype(it.ft)]
    if score_ctl[0]:
        # eviction scores: the rows at slots >= score_ctl[1] add their weights, summed over the
        # query heads of each KV head (masked slots hold exactly 0)
        rows = st.n_past + np.arange(n) >= score_ctl[1]
        kept_scores[:, :length] += p[:, :, rows, :].sum(axis=(1, 2)).astype(kept_scores.dtype)
    return [out.reshape(n, h * hd).astype(it.ft), kept_scores]


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _fused_matmul(it, op, st, x, w, *extra):
    a = op.attrs
    extra = list(extra)
    if a.get("prologue") == "rms_norm":
        x = _rms(x, _f(it, op, 2, extra.pop(0)), a["eps"]).astype(it.ft)
    y = _mm(it, op, x, 1)
    if a.get("bias"):
        y = (y + extra.pop().astype(it.ft)).astype(it.ft)
    epi = a.get("epilogue")
    if epi is None:
        return [y]
    if epi == "add":
        return [(extra[0] + y).astype(it.ft)]
    if epi == "silu_mul":
        f = y.shape[1] // 2
        return [(_silu(y[:, :f]) * y[:, f:]).astype(it.ft)]
    if epi == "rope_kv_store":
        h, kvh, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
        positions, slots = extra[-2:] if a.get("step_rows") else (None, None)
        inv_freq, k_cache, v_cache = extra[:3]
        inv_freq = inv_freq.astype(np.float32)
        q, k, v = y[:, :h * hd], y[:, h * hd:(h + kvh) * hd], y[:, (h + kvh) * hd:]
        n_extra = 1 if a.get("prologue") == "rms_norm" else 0
        if a.get("qk_norm"):   # Qwen3: each head RMS-normed before RoPE
            q = _rms(q, _f(it, op, 5 + n_extra, extra[3]), a["qk_eps"]).astype(it.ft)
            k = _rms(k, _f(it, op, 6 + n_extra, extra[4]), a["qk_eps"]).astype(it.ft)
        q = _rope_heads(it, st, q, h, hd, inv_freq, positions)
        k = _rope_heads(it, st, k, kvh, hd, inv_freq, positions)
        kc = _store(it, op, st, k, k_cache, op.inputs[3 + n_extra], slots)
        vc = _store(it, op, st, v, v_cache, op.inputs[4 + n_extra], slots)
        return [q, kc, vc]
    raise IRError(f"op {op.name}: unknown epilogue {epi!r}")


OPS: dict[str, Callable] = {
    "embedding": _embedding,
    "rms_norm": _rms_norm,
    "matmul": _matmul,
    "rope": _rope,
    "kv_store": _kv_store,
    "attention": _attention,
    "add": lambda it, op, st, a, b: [(a + b).astype(it.ft)],
    "mul": lambda it, op, st, a, b: [(a * b).astype(it.ft)],
    "silu": lambda it, op, st, a: [_silu(a).astype(it.ft)],
    "silu_mul": lambda it, op, st, g, u: [(_silu(g) * u).astype(it.ft)],
    "softmax": lambda it, op, st, a: [_softmax(a).astype(it.ft)],
    "argmax": lambda it, op, st, a: [np.argmax(a, axis=-1).astype(np.int32)],
    "slice": lambda it, op, st, a: [a[st.n_tokens - 1:st.n_tokens]],
    "gather": lambda it, op, st, a, rows: [a[rows]],
    "fused_matmul": _fused_matmul,
}
