"""One-op graphs with random non-zero data, and their expected outputs from the interpreter,
shared by the native (x86-64 JIT) and the aarch64-under-qemu kernel tests."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmrs.compiler import quant
from llmrs.compiler.interpret import OPS, Interpreter, Step
from llmrs.compiler.ir import Graph, LazyTensor, Op, storage_shape
from llmrs.compiler.rope import rope_inv_freq


@dataclass
class Case:
    name: str
    graph: Graph
    op: Op
    arrays: dict[str, np.ndarray]            # every input/output buffer, by value name
    step: Step
    rtol: float = 1e-5
    notes: dict = field(default_factory=dict)

    def buffers(self) -> list[str]:
        return self.op.inputs + self.op.outputs

    def expected(self) -> dict[str, np.ndarray]:
        """Interpreter outputs, state outputs as the updated cache bytes."""
        it = Interpreter(self.graph)
        arrays = {k: v.copy() for k, v in self.arrays.items()}
        args = []
        for name in self.op.inputs:
            v = self.graph.values[name]
            if v.kind in ("param", "const"):
                args.append(it.raw(name))
            elif v.kind == "state" or v.dtype == "i32":
                args.append(arrays[name] if v.kind == "state" else arrays[name][:self.step.n_tokens])
            else:  # the interpreter holds only the step's rows
                args.append(arrays[name][:self.step.n_tokens] if v.shape[0] == self.graph.T else arrays[name])
        outs = OPS[self.op.kind](it, self.op, self.step, *args)
        n = self.step.n_tokens
        res = {}
        for name, val in zip(self.op.outputs, outs):
            v = self.graph.values[name]
            res[name] = val if v.alias else np.asarray(val)[:n] if v.shape[0] == self.graph.T else val
        return res

    def actual(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = self.step.n_tokens
        res = {}
        for name in self.op.outputs:
            v = self.graph.values[name]
            res[name] = arrays[v.alias or name] if v.alias else arrays[name][:n] if v.shape[0] == self.graph.T else arrays[name]
        return res


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _weight(g: Graph, name: str, shape: tuple[int, ...], dtype: str, rng, kind: str = "param") -> np.ndarray:
    f = (rng.standard_normal(shape) * 0.5 + 0.05).astype(np.float32)
    if dtype in quant.BLOCK_BYTES:
        raw = quant.quantize(f, dtype)
    elif dtype == "bf16":
        raw = (f.view(np.uint32) >> 16).astype(np.uint16)
    else:
        raw = f.astype({"f32": np.float32, "f16": np.float16}[dtype])
    g.add_value(name, shape, dtype, kind)
    g.weights[name] = LazyTensor.of(raw, dtype)
    return raw


def _act(g: Graph, arrays: dict, name: str, shape, rng, kind: str = "act", fill: bool = True) -> None:
    g.add_value(name, shape, "f32", kind)
    arrays[name] = (rng.standard_normal(shape).astype(np.float32) + 0.1) if fill else np.zeros(shape, np.float32)


def _cache(g: Graph, arrays: dict, name: str, S: int, kvh: int, hd: int, dtype: str, rng, filled: int) -> None:
    g.add_value(name, (S, kvh, hd), dtype, "state")
    shape, np_dtype = storage_shape((S, kvh, hd), dtype)
    vals = rng.standard_normal((S, kvh, hd)).astype(np.float32)
    vals[filled:] = 0
    arrays[name] = quant.quantize(vals, dtype) if dtype in quant.BLOCK_BYTES else vals.astype(np_dtype)


def matmul_case(wdtype: str, T: int, n_tokens: int, prologue: bool, epilogue: str | None,
                cache_dtype: str = "f32", seed: int = 0, K: int = 96, N: int = 40,
                heads: tuple[int, int, int] = (4, 2, 32), bias: bool = False, qk_norm: bool = False,
                qk_norm_dtype: str = "bf16", step_rows: bool = False) -> Case:
    """heads = (n_heads, n_kv_heads, head_dim) of a rope_kv_store epilogue; bias: b[N] added before
    the epilogue (a plain matmul's third input, or attr bias); qk_norm: Qwen3's per-head q/k norms
    in the rope_kv_store epilogue, their weights in qk_norm_dtype; step_rows: a step graph's
    rope_kv_store, each row at its own position (far apart, out of order) and KV slot (a shuffled
    pick of the cache's S = max(16, T) rows)."""
    rng = _rng(seed)
    g = Graph("prefill" if T > 1 else "decode", T)
    arrays: dict[str, np.ndarray] = {}
    (h, kvh, hd), S, n_past = heads, max(16, T), 3
    if epilogue == "rope_kv_store":
        N = (h + 2 * kvh) * hd
    if epilogue == "silu_mul":
        N = 2 * 36
    _act(g, arrays, "x", (T, K), rng, kind="input")
    arrays["w"] = _weight(g, "w", (N, K), wdtype, rng)
    inputs = ["x", "w"]
    attrs: dict = {"prologue": "rms_norm" if prologue else None, "epilogue": epilogue}
    if prologue:
        arrays["norm_w"] = _weight(g, "norm_w", (K,), "f32", rng)
        inputs.append("norm_w")
        attrs["eps"] = 1e-5
    outputs = ["y"]
    if epilogue == "add":
        _act(g, arrays, "res", (T, N), rng)
        inputs.append("res")
    if epilogue == "rope_kv_store":
        inv = rope_inv_freq(hd, 10000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8})
        g.add_value("inv_freq", (hd // 2,), "f32", "const")
        g.weights["inv_freq"] = LazyTensor.of(inv, "f32")
        arrays["inv_freq"] = inv
        _cache(g, arrays, "kc", S, kvh, hd, cache_dtype, rng, n_past)
        _cache(g, arrays, "vc", S, kvh, hd, cache_dtype, rng, n_past)
        inputs += ["inv_freq", "kc", "vc"]
        attrs.update(n_heads=h, n_kv_heads=kvh, head_dim=hd, theta=10000.0, scaling=None)
        if qk_norm:
            arrays["qn"] = _weight(g, "qn", (hd,), qk_norm_dtype, rng)
            arrays["kn"] = _weight(g, "kn", (hd,), qk_norm_dtype, rng)
            inputs += ["qn", "kn"]
            attrs.update(qk_norm=True, qk_eps=1e-6)
        if step_rows:
            for name, vals in (("positions", rng.permutation(np.arange(0, 97 * T, 97)) + rng.integers(0, 97, T)),
                               ("slots", rng.permutation(S)[:T])):
                g.add_value(name, (T,), "i32", "input")
                arrays[name] = vals.astype(np.int32)
            inputs += ["positions", "slots"]
            attrs["step_rows"] = True
        g.add_value("y", (T, h * hd), "f32")
        g.add_value("kc2", (S, kvh, hd), cache_dtype, alias="kc")
        g.add_value("vc2", (S, kvh, hd), cache_dtype, alias="vc")
        outputs = ["y", "kc2", "vc2"]
    else:
        g.add_value("y", (T, N // 2 if epilogue == "silu_mul" else N), "f32")
    arrays["y"] = np.zeros(g.values["y"].shape, np.float32)
    kind = "fused_matmul" if (prologue or epilogue) else "matmul"
    if bias:
        arrays["b"] = _weight(g, "b", (N,), "f32", rng)
        inputs.append("b")
        attrs["bias"] = True
    op = g.add_op(kind, inputs, outputs, **(attrs if kind == "fused_matmul" else {}))
    name = f"{kind}-{wdtype}-T{T}-n{n_tokens}-{'rms' if prologue else 'x'}-{epilogue}-{cache_dtype}-K{K}"
    if epilogue == "rope_kv_store":
        name += f"-h{h}.{kvh}x{hd}" + ("-qknorm" if qk_norm else "") + ("-steprows" if step_rows else "")
    if bias:
        name += "-bias"
    return Case(name, g, op, arrays, Step(n_tokens, n_past, n_past + 2), rtol=1e-4)


def attention_case(T: int, n_tokens: int, kv_dtype: str, seed: int = 1, h: int = 4, kvh: int = 2,
                   hd: int = 32) -> Case:
    rng = _rng(seed)
    S, n_past = 24, 5
    g = Graph("prefill" if T > 1 else "decode", T)
    arrays: dict[str, np.ndarray] = {}
    _act(g, arrays, "q", (T, h * hd), rng, kind="input")
    _cache(g, arrays, "kc", S, kvh, hd, kv_dtype, rng, n_past + n_tokens)
    _cache(g, arrays, "vc", S, kvh, hd, kv_dtype, rng, n_past + n_tokens)
    _act(g, arrays, "o", (T, h * hd), rng, fill=False)
    op = g.add_op("attention", ["q", "kc", "vc"], ["o"], n_heads=h, n_kv_heads=kvh, head_dim=hd,
                  scale=1.0 / np.sqrt(hd))
    return Case(f"attention-T{T}-n{n_tokens}-{kv_dtype}-h{h}.{kvh}x{hd}", g, op, arrays,
                Step(n_tokens, n_past, n_past))


def embedding_case(dtype: str, seed: int = 2) -> Case:
    rng = _rng(seed)
    T, V, D = 6, 50, 64
    g = Graph("prefill", T)
    arrays = {"table": _weight(g, "table", (V, D), dtype, rng)}
    g.add_value("tokens", (T,), "i32", "input")
    arrays["tokens"] = rng.integers(0, V, T).astype(np.int32)
    _act(g, arrays, "y", (T, D), rng, fill=False)
    op = g.add_op("embedding", ["table", "tokens"], ["y"])
    return Case(f"embedding-{dtype}", g, op, arrays, Step(5, 0, 0), rtol=0)


def simple_case(kind: str, seed: int = 3, hd: int = 32) -> Case:
    """rms_norm (rms_norm:G: over runs of G values), add, mul, silu, silu_mul, argmax, slice, rope
    (with/without inv_freq), kv_store; rope and kv_store over two heads of hd."""
    rng = _rng(seed)
    T, D = 5, 64
    g = Graph("prefill", T)
    arrays: dict[str, np.ndarray] = {}
    attrs: dict = {}
    n = 4
    if kind.startswith("rms_norm"):   # rms_norm:G normalises each run of G values (per head)
        _act(g, arrays, "a", (T, D), rng)
        group = int(kind.split(":")[1]) if ":" in kind else D
        arrays["w"] = _weight(g, "w", (group,), "bf16", rng)
        inputs, attrs = ["a", "w"], {"eps": 1e-6}
    elif kind in ("add", "mul", "silu_mul"):
        _act(g, arrays, "a", (T, D), rng)
        _act(g, arrays, "b", (T, D), rng)
        inputs = ["a", "b"]
    elif kind in ("silu", "argmax", "slice"):
        _act(g, arrays, "a", (T, D), rng)
        inputs = ["a"]
    elif kind.startswith("rope"):
        _act(g, arrays, "a", (T, 2 * hd), rng)
        inputs = ["a"]
        attrs = dict(n_heads=2, head_dim=hd, theta=500000.0, scaling=None)
        if kind == "rope+inv_freq":
            inv = rope_inv_freq(hd, 500000.0, None)
            g.add_value("inv_freq", (hd // 2,), "f32", "const")
            g.weights["inv_freq"] = LazyTensor.of(inv, "f32")
            arrays["inv_freq"] = inv
            inputs.append("inv_freq")
    elif kind.startswith("kv_store"):
        dt = kind.split(":")[1]
        _act(g, arrays, "a", (T, 2 * hd), rng)
        _cache(g, arrays, "kc", 12, 2, hd, dt, rng, 2)
        g.add_value("kc2", (12, 2, hd), dt, alias="kc")
        op = g.add_op("kv_store", ["a", "kc"], ["kc2"])
        return Case(f"{kind}-hd{hd}", g, op, arrays, Step(n, 2, 2))
    else:
        raise ValueError(kind)
    out_shape = {"argmax": (T,), "slice": (1, D)}.get(kind, g.values["a"].shape)
    g.add_value("y", out_shape, "i32" if kind == "argmax" else "f32")
    arrays["y"] = np.zeros(out_shape, np.int32 if kind == "argmax" else np.float32)
    if kind == "slice":
        attrs = {"rows": "last"}
    op = g.add_op(kind.split("+")[0].split(":")[0], inputs, ["y"], **attrs)
    return Case(kind if hd == 32 else f"{kind}-hd{hd}", g, op, arrays, Step(n, 3, 7))


SIMPLE_KINDS = ("rms_norm", "rms_norm:16", "rms_norm:8", "add", "mul", "silu", "silu_mul", "argmax", "slice", "rope", "rope+inv_freq",
                "kv_store:f32", "kv_store:f16", "kv_store:q8_0", "kv_store:q4_0")


def scored_attention_case(T: int, n_tokens: int, kv_dtype: str, first: int | None, hd: int = 32,
                          seed: int = 4) -> Case:
    """Attention that also adds eviction scores (compiler/ir.py): rows at slots >= first, or
    none when first is None (the control off); the scores start from random non-zero values."""
    rng = _rng(seed)
    h, kvh, S, n_past = 4, 2, 24, 5
    g = Graph("prefill" if T > 1 else "decode", T)
    arrays: dict[str, np.ndarray] = {}
    _act(g, arrays, "q", (T, h * hd), rng, kind="input")
    _cache(g, arrays, "kc", S, kvh, hd, kv_dtype, rng, n_past + n_tokens)
    _cache(g, arrays, "vc", S, kvh, hd, kv_dtype, rng, n_past + n_tokens)
    g.add_value("sc", (kvh, S), "f32", "state")
    arrays["sc"] = rng.random((kvh, S)).astype(np.float32) + 0.5
    g.add_value("ctl", (2,), "i32", "state")
    arrays["ctl"] = np.array([0, 0] if first is None else [1, first], np.int32)
    _act(g, arrays, "o", (T, h * hd), rng, fill=False)
    g.add_value("sc_out", (kvh, S), "f32", alias="sc")
    op = g.add_op("attention", ["q", "kc", "vc", "sc", "ctl"], ["o", "sc_out"], n_heads=h, n_kv_heads=kvh,
                  head_dim=hd, scale=1.0 / np.sqrt(hd))
    return Case(f"scored-attention-T{T}-n{n_tokens}-{kv_dtype}-from{first}", g, op, arrays,
                Step(n_tokens, n_past, n_past + 3))
