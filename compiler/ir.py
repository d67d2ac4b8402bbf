"""The op-graph IR: values, ops, graphs, and lazily materialised weights.

A `Graph` is one phase of the model (prefill of up to T tokens, or a 1-token decode step):
values plus ops in a valid order. Shapes are static and sized for the maximum; three run-time
scalars reach every op:

    n_tokens   tokens in this step (<= the graph's T); activations use rows [0, n_tokens)
    n_past     KV-cache slots already filled (physical; shrinks when the cache is evicted)
    start_pos  RoPE position of the step's first token (logical; only grows)

Without eviction start_pos == n_past. The seeds keep the two apart (`start_pos` vs
`current_pos`) because an evicted cache keeps its keys' absolute RoPE rotation.

Op kinds and their exact semantics (the interpreter in interpret.py is the executable form;
`x @ w.T` below means each output row n is the dot of x's row with weight row n, HF layout):

    embedding(table[V,D], tokens[T] i32)            -> y[T,D]      y[t] = table[tokens[t]]
    rms_norm(x[T,D], w[G]; eps)                     -> y[T,D]      x / sqrt(mean(x^2)+eps) * w over
                                                       each run of G values (G divides D): G == D
                                                       is the usual norm, G == head_dim normalises
                                                       each head (Qwen3's q_norm / k_norm)
    matmul(x[T,K], w[N,K] [, b[N] f32])             -> y[T,N]      x @ w.T (+ b on every row: the
                                                       q/k/v biases of Qwen2)
    rope(x[T,H*hd] [, inv_freq[hd/2]]; n_heads, head_dim, theta, scaling)
                                                    -> y[T,H*hd]   HF rotate_half form; position
                                                       of row t is start_pos + t; angle is
                                                       float32(pos) * inv_freq in float32
    kv_store(src[T,KVH*hd], cache[S,KVH,hd])        -> cache'      rows n_past.. of cache; cache'
                                                       aliases cache (Value.alias)
    attention(q[T,H*hd], k[S,KVH,hd], v[S,KVH,hd] [, scores[KVH,S] f32, score_ctl[2] i32];
              n_heads, n_kv_heads, head_dim, scale)
                                                    -> o[T,H*hd] [, scores']
                                                       causal GQA: row t sees slots [0, n_past + t].
                                                       With scores (read by runtime/kv's eviction
                                                       policies): when score_ctl[0] != 0, each row
                                                       t with n_past + t >= score_ctl[1] adds its
                                                       softmax weights, summed over the query heads
                                                       of each KV head, to scores[kvh, 0..n_past+t];
                                                       scores' aliases scores
    add(a, b), mul(a, b), silu(a), silu_mul(g, u) = silu(g) * u, softmax(x) over the last axis
    argmax(x[T,V])                                  -> y[T] i32
    slice(x[T,D]; rows="last")                      -> y[1,D]      row n_tokens - 1
    gather(x[T,D], rows[R] i32)                     -> y[R,D]      y[r] = x[rows[r]]; every entry
                                                       < n_tokens (the caller pads with 0)

Step graphs (many sequences in one step; models/step.py makes one from a prefill graph). Each of
the T rows is one token of some sequence; i32 graph inputs say which:

    positions[T]      RoPE position of row t             slots[T]   KV-cache row it writes
    row_seq[T]        its sequence's row of block_tables ctx_len[T] KV entries row t attends
    block_tables[B,M] physical block ids of each sequence's logical blocks (M * block_size = S)
    logit_rows[R]     the rows whose logits the step returns (R = B)
    score_from[T]     row t adds eviction scores when its own KV index ctx_len[t] - 1 >= this
                      (int32 max: never)

and three ops take them as their last inputs (n_past and start_pos are then unused):

    rope(x [, inv_freq], positions)                 row t rotated by positions[t]
    kv_store(src, cache, slots)                     row t stored at cache[slots[t]]
    attention(q, k, v, row_seq, ctx_len, block_tables [, scores[KVH,S] f32, score_from]; ...,
              block_size)                        -> o [, scores']
                                                    row t attends its sequence's logical entries
                                                       j < ctx_len[t], each at cache row
                                                       block_tables[row_seq[t], j // block_size]
                                                       * block_size + j % block_size. With scores
                                                       (the prefill graph's states): each row t
                                                       with ctx_len[t] - 1 >= score_from[t] adds
                                                       its softmax weights, summed over the query
                                                       heads of each KV head, to scores[kvh, that
                                                       cache row] of every entry it attends; rows
                                                       add in step order; scores' aliases scores

Fused kinds (made by passes, never by model builders):

    fused_matmul(x[T,K], w[N,K], *extra; prologue, epilogue, ...)
        prologue None | "rms_norm"      extra: norm_w[K]; attrs eps. x is normalised first.
                                        norm_folded: norm_w is ones, its real values already
                                        multiplied into w (fuse.py norm_weight_fold).
        epilogue None                   -> y[T,N]
                 "add"                  extra: residual[T,N]; -> residual + x @ w.T
                 "silu_mul"             w = [gate; up] stacked, N = 2F; -> silu(g) * u, [T,F]
                 "rope_kv_store"        w = [q; k; v] stacked; extra: inv_freq[hd/2],
                                        k_cache[S,KVH,hd], v_cache[S,KVH,hd]; attrs as rope plus
                                        n_kv_heads; -> q_roped[T,H*hd], k_cache', v_cache'.
                                        attr qk_norm (Qwen3): extra q_norm_w[hd], k_norm_w[hd]
                                        (f32|f16|bf16) after v_cache; attr qk_eps. Each q and k
                                        head is RMS-normed (rms_norm with G = hd) before RoPE.
                                        attr step_rows (a step graph): extra positions[T] i32,
                                        slots[T] i32 last of the epilogue's (after the norm
                                        weights); row t is rotated by positions[t] and its k, v
                                        stored at cache row slots[t], as rope and kv_store with
                                        those inputs do (n_past and start_pos unused).
        attr bias (Qwen2)               extra: b[N] f32, added to x @ w.T before the epilogue
                                        (stacked as w is: [q; k; v] biases, [gate; up] biases).
        Extra inputs come in the order: norm_w (if prologue), then the epilogue's, then b (if bias);
        rope_kv_store's own: inv_freq, k_cache, v_cache [, q_norm_w, k_norm_w] [, positions, slots].

Weights whose dtype is q4_0 or q8_0 are multiplied as GGML does: each activation row is
quantized to Q8_0 and block dot products are summed as integers, then scaled. q4_1 weights take
Q8_1 activations and add each block's minimum times the activation block's sum (quant.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import networkx as nx
import numpy as np

from .errors import IRError

DTYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q8_0", "i32")
VALUE_KINDS = ("input", "param", "const", "state", "act")
BASE_KINDS = ("embedding", "rms_norm", "matmul", "rope", "kv_store", "attention", "add", "mul",
              "silu", "silu_mul", "softmax", "argmax", "slice", "gather")
FUSED_KINDS = ("fused_matmul",)
SCALARS = ("n_tokens", "n_past", "start_pos")

QK = 32  # values per quantization block (GGML's QK4_0 == QK8_0 == 32)
_BLOCK_BYTES = {"q4_0": 18, "q8_0": 34, "q4_1": 20}
_ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Storage bytes of a tensor; quantized dtypes pack their last axis in 32-value blocks."""
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if dtype in _BLOCK_BYTES:
        if not shape or shape[-1] % QK:
            raise IRError(f"{dtype} tensor of shape {shape}: last axis must be a multiple of {QK}")
        return n // QK * _BLOCK_BYTES[dtype]
    return n * _ELEM_BYTES[dtype]


def storage_shape(shape: tuple[int, ...], dtype: str) -> tuple[tuple[int, ...], np.dtype]:
    """numpy shape and dtype that hold a tensor's bytes (bf16 as raw uint16, blocks as uint8)."""
    if dtype in _BLOCK_BYTES:
        return (*shape[:-1], shape[-1] // QK * _BLOCK_BYTES[dtype]), np.dtype(np.uint8)
    np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i32": np.int32}[dtype]
    return tuple(shape), np.dtype(np_dtype)


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = "act"           # input | param | const | state | act
    alias: str | None = None    # a state value this one writes in place (kv_store's output)

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


@dataclass
class Op:
    kind: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""


@dataclass
class LazyTensor:
    """Weight bytes made on demand, so a 1B model never sits in memory all at once."""
    shape: tuple[int, ...]
    dtype: str
    make: Callable[[], np.ndarray]
    source_format: str | None = None  # on-disk format llmrs has no kernels for (a GGUF's Q6_K ...):
                                      # make() decodes it to f32 and the quantize pass converts it

    def load(self) -> np.ndarray:
        arr = self.make()
        want_shape, want_dtype = storage_shape(self.shape, self.dtype)
        if arr.shape != want_shape or arr.dtype != want_dtype:
            raise IRError(f"lazy tensor made {arr.dtype}{list(arr.shape)}, "
                          f"expected {want_dtype}{list(want_shape)} for {self.dtype}{list(self.shape)}")
        return arr

    @staticmethod
    def of(arr: np.ndarray, dtype: str) -> "LazyTensor":
        shape = tuple(arr.shape)
        if dtype in _BLOCK_BYTES:
            shape = (*arr.shape[:-1], arr.shape[-1] // _BLOCK_BYTES[dtype] * QK)
        return LazyTensor(shape, dtype, lambda: arr)


@dataclass
class Graph:
    name: str                                   # "prefill" | "decode"
    T: int                                      # max tokens per step
    values: dict[str, Value] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    weights: dict[str, LazyTensor] = field(default_factory=dict)  # data of param/const values
    meta: dict[str, Any] = field(default_factory=dict)             # model config and the like

    # -- building -----------------------------------------------------------------------------
    def add_value(self, name: str, shape: Iterable[int], dtype: str, kind: str = "act",
                  alias: str | None = None) -> str:
        if name in self.values:
            raise IRError(f"value {name!r} defined twice")
        if dtype not in DTYPES:
            raise IRError(f"value {name!r}: unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
        self.values[name] = Value(name, tuple(int(s) for s in shape), dtype, kind, alias)
        return name

    def add_op(self, kind: str, inputs: list[str], outputs: list[str], **attrs: Any) -> Op:
        op = Op(kind, list(inputs), list(outputs), dict(attrs), name=f"{kind}_{len(self.ops)}")
        self.ops.append(op)
        return op

    def copy(self) -> "Graph":
        """A copy whose op list, value table and attrs can be changed without touching self."""
        return dataclasses.replace(
            self,
            values={k: dataclasses.replace(v) for k, v in self.values.items()},
            ops=[dataclasses.replace(op, inputs=list(op.inputs), outputs=list(op.outputs),
                                     attrs=dict(op.attrs)) for op in self.ops],
            inputs=list(self.inputs), outputs=list(self.outputs),
            weights=dict(self.weights), meta=dict(self.meta))

    # -- queries ------------------------------------------------------------------------------
    def by_kind(self, kind: str) -> list[str]:
        return [v.name for v in self.values.values() if v.kind == kind]

    @property
    def state(self) -> list[str]:
        return self.by_kind("state")

    @property
    def kv_slots(self) -> int | None:
        """Slots of the KV caches (the [S, KVH, hd] states), None in a graph without any."""
        return min((self.values[n].shape[0] for n in self.state if len(self.values[n].shape) == 3),
                   default=None)

    def producers(self) -> dict[str, Op]:
        return {out: op for op in self.ops for out in op.outputs}

    def consumers(self) -> dict[str, list[Op]]:
        users: dict[str, list[Op]] = {name: [] for name in self.values}
        for op in self.ops:
            for i in op.inputs:
                users.setdefault(i, []).append(op)
        return users

    def kernel_count(self) -> int:
        """Ops that launch work; a slice of the last row is folded into its consumer's indexing."""
        return sum(1 for op in self.ops if op.kind != "slice")

    def nx(self) -> nx.DiGraph:
        """Ops as nodes (by op.name), an edge for each value passed from one op to another."""
        g = nx.DiGraph()
        prod = {}
        for op in self.ops:
            g.add_node(op.name, op=op)
            for out in op.outputs:
                prod[out] = op.name
        for op in self.ops:
            for i in op.inputs:
                if i in prod:
                    g.add_edge(prod[i], op.name, value=i)
        return g

    # -- checking -----------------------------------------------------------------------------
    def verify(self) -> "Graph":
        from .shapes import infer_shapes  # late: shapes' rules are large and only verify needs them
        defined = {n for n, v in self.values.items() if v.kind in ("input", "param", "const", "state")}
        seen_outputs: set[str] = set()
        for name, v in self.values.items():
            if v.kind in ("param", "const") and name not in self.weights:
                raise IRError(f"{v.kind} {name!r} has no weight data")
            if v.alias is not None and self.values.get(v.alias, Value("", (), "f32")).kind != "state":
                raise IRError(f"value {name!r} aliases {v.alias!r}, which is not a state value")
        for op in self.ops:
            if op.kind not in BASE_KINDS + FUSED_KINDS:
                raise IRError(f"op {op.name}: unknown kind {op.kind!r}")
            for i in op.inputs:
                if i not in self.values:
                    raise IRError(f"op {op.name} ({op.kind}): input {i!r} is not a value of the graph")
                if i not in defined:
                    raise IRError(f"op {op.name} ({op.kind}): input {i!r} is used before it is produced"
                                  " (a cycle, or ops out of order)")
            for o in op.outputs:
                if o not in self.values:
                    raise IRError(f"op {op.name} ({op.kind}): output {o!r} is not a value of the graph")
                if o in seen_outputs or self.values[o].kind != "act":
                    raise IRError(f"op {op.name} ({op.kind}): value {o!r} has more than one producer")
                seen_outputs.add(o)
                defined.add(o)
            got = infer_shapes(self, op)
            for o, (shape, dtype) in zip(op.outputs, got):
                v = self.values[o]
                if v.shape != tuple(shape) or v.dtype != dtype:
                    raise IRError(f"op {op.name} ({op.kind}): output {o!r} is {v.dtype}{list(v.shape)}"
                                  f" but the inputs give {dtype}{list(shape)}")
        for o in self.outputs:
            if o not in defined:
                raise IRError(f"graph output {o!r} is never produced")
        return self

    # -- printing -----------------------------------------------------------------------------
    def __str__(self) -> str:
        def ty(name: str) -> str:
            v = self.values[name]
            return f"{v.dtype}[{','.join(map(str, v.shape))}]"

        lines = [f"graph {self.name} (T={self.T}, {len(self.ops)} ops, {self.kernel_count()} kernels)"]
        for kind in ("input", "state"):
            for n in self.by_kind(kind):
                lines.append(f"  {kind:<6} %{n}: {ty(n)}")
        n_params = len(self.by_kind("param")) + len(self.by_kind("const"))
        lines.append(f"  params {n_params} tensors")
        for op in self.ops:
            attrs = " ".join(f"{k}={_fmt_attr(v)}" for k, v in op.attrs.items())
            outs = ", ".join(f"%{o}: {ty(o)}" for o in op.outputs)
            ins = ", ".join(f"%{i}" for i in op.inputs)
            lines.append(f"  {outs} = {op.kind}({ins}){' ' + attrs if attrs else ''}")
        lines.append(f"  return {', '.join('%' + o for o in self.outputs)}")
        return "\n".join(lines)


def _fmt_attr(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_fmt_attr(x)}" for k, x in v.items()) + "}"
    return str(v)
