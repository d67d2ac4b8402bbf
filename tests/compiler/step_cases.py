"""One-op cases of a step graph's kernels (compiler/ir.py "Step graphs") with random non-zero data:
RoPE at per-row positions, the KV store at per-row slots, attention through block tables, the
gather of the logit rows. Shared by the host JIT tests and the aarch64-under-qemu ones."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmrs.compiler import quant
from llmrs.compiler.interpret import OPS, Interpreter, Step
from llmrs.compiler.ir import Graph, LazyTensor, storage_shape
from llmrs.compiler.rope import rope_inv_freq

from .kernel_cases import Case


@dataclass
class StepCase(Case):
    """A Case whose i32 inputs are a step's row indices, passed whole; activations pass as the
    step's rows, but a gather's source whole (it picks among the step's rows, of which the
    kernel runs on n_tokens = the rows picked)."""

    def expected(self) -> dict[str, np.ndarray]:
        it = Interpreter(self.graph)
        arrays = {k: v.copy() for k, v in self.arrays.items()}
        n = self.step.n_tokens
        args = []
        for name in self.op.inputs:
            v = self.graph.values[name]
            if v.kind in ("param", "const"):
                args.append(it.raw(name))
            elif v.kind == "state" or v.dtype == "i32" or self.op.kind == "gather":
                args.append(arrays[name])
            else:
                args.append(arrays[name][:n])
        outs = OPS[self.op.kind](it, self.op, self.step, *args)
        return {name: val if self.graph.values[name].alias else np.asarray(val)
                for name, val in zip(self.op.outputs, outs)}

    def actual(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = self.step.n_tokens
        return {name: arrays[v.alias] if (v := self.graph.values[name]).alias else arrays[name][:n]
                for name in self.op.outputs}


def _floats(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) + 0.1).astype(np.float32)


def _index(g: Graph, arrays: dict, name: str, values) -> None:
    arr = np.asarray(values, np.int32)
    g.add_value(name, arr.shape, "i32", "input")
    arrays[name] = arr


def _cache(g: Graph, arrays: dict, name: str, shape: tuple[int, int, int], dtype: str, rng) -> None:
    """A cache full of random rows (every slot: a paged cache has no unwritten prefix)."""
    g.add_value(name, shape, dtype, "state")
    vals = rng.standard_normal(shape).astype(np.float32)
    arrays[name] = quant.quantize(vals, dtype) if dtype in quant.BLOCK_BYTES else \
        vals.astype(storage_shape(shape, dtype)[1])


def rope_case(T: int, n: int, hd: int = 32, heads: int = 2, folded: bool = True, seed: int = 20) -> StepCase:
    rng = np.random.default_rng(seed)
    g = Graph("step", T)
    arrays = {"x": _floats(rng, (T, heads * hd))}
    g.add_value("x", (T, heads * hd), "f32", "input")
    inputs = ["x"]
    if folded:
        inv = rope_inv_freq(hd, 500000.0, None)
        g.add_value("inv_freq", (hd // 2,), "f32", "const")
        g.weights["inv_freq"] = LazyTensor.of(inv, "f32")
        arrays["inv_freq"] = inv
        inputs.append("inv_freq")
    # out of order and far apart, as rows of several sequences are
    _index(g, arrays, "positions", rng.permutation(np.arange(0, 40 * T, 40))[:T] + rng.integers(0, 40, T))
    g.add_value("y", (T, heads * hd), "f32")
    arrays["y"] = np.zeros((T, heads * hd), np.float32)
    op = g.add_op("rope", inputs + ["positions"], ["y"], n_heads=heads, head_dim=hd, theta=500000.0, scaling=None)
    return StepCase(f"rope-positions-hd{hd}-{'folded' if folded else 'attrs'}", g, op, arrays, Step(n, 0, 0))


def kv_store_case(T: int, n: int, dtype: str, hd: int = 32, kvh: int = 2, S: int = 24, slots=None,
                  seed: int = 21) -> StepCase:
    rng = np.random.default_rng(seed)
    g = Graph("step", T)
    arrays = {"src": _floats(rng, (T, kvh * hd))}
    g.add_value("src", (T, kvh * hd), "f32", "input")
    _cache(g, arrays, "kc", (S, kvh, hd), dtype, rng)
    _index(g, arrays, "slots", rng.permutation(S)[:T] if slots is None else slots)
    g.add_value("kc2", (S, kvh, hd), dtype, alias="kc")
    op = g.add_op("kv_store", ["src", "kc", "slots"], ["kc2"])
    return StepCase(f"kv_store-slots-{dtype}-hd{hd}", g, op, arrays, Step(n, 0, 0))


@dataclass
class Paged:
    """A pool of n_blocks blocks of bs slots; each sequence's table a shuffled pick of them."""
    bs: int
    n_blocks: int
    tables: np.ndarray      # [B, M]

    @staticmethod
    def shuffled(bs: int, n_blocks: int, n_seqs: int, rng) -> "Paged":
        free = rng.permutation(n_blocks)
        per = n_blocks // n_seqs
        tables = np.zeros((n_seqs, n_blocks), np.int32)
        for s in range(n_seqs):
            tables[s, :per] = free[s * per:(s + 1) * per]
        return Paged(bs, n_blocks, tables)


def paged_attention_case(T: int, rows: list[tuple[int, int]], kv_dtype: str, h: int = 4, kvh: int = 2,
                         hd: int = 32, bs: int = 16, n_blocks: int = 12, n_seqs: int = 3, pool: Paged | None = None,
                         seed: int = 22, score_from: list[int] | None = None) -> StepCase:
    """rows: (sequence, entries it attends) per row of the step; with score_from (one a row), the
    op adds eviction scores to a scores state of random non-zero values."""
    rng = np.random.default_rng(seed)
    pool = pool or Paged.shuffled(bs, n_blocks, n_seqs, rng)
    S = pool.n_blocks * pool.bs
    g = Graph("step", T)
    arrays = {"q": _floats(rng, (T, h * hd))}
    g.add_value("q", (T, h * hd), "f32", "input")
    _cache(g, arrays, "kc", (S, kvh, hd), kv_dtype, rng)
    _cache(g, arrays, "vc", (S, kvh, hd), kv_dtype, rng)
    pad = [(0, 1)] * (T - len(rows))
    _index(g, arrays, "row_seq", [s for s, _ in rows + pad])
    _index(g, arrays, "ctx_len", [c for _, c in rows + pad])
    _index(g, arrays, "block_tables", pool.tables)
    g.add_value("o", (T, h * hd), "f32")
    arrays["o"] = np.zeros((T, h * hd), np.float32)
    inputs, outputs = ["q", "kc", "vc", "row_seq", "ctx_len", "block_tables"], ["o"]
    if score_from is not None:
        g.add_value("sc", (kvh, S), "f32", "state")
        arrays["sc"] = rng.uniform(0.5, 2.0, (kvh, S)).astype(np.float32)
        _index(g, arrays, "score_from", list(score_from) + [np.iinfo(np.int32).max] * (T - len(rows)))
        g.add_value("sc2", (kvh, S), "f32", alias="sc")
        inputs, outputs = inputs + ["sc", "score_from"], outputs + ["sc2"]
    op = g.add_op("attention", inputs, outputs, n_heads=h,
                  n_kv_heads=kvh, head_dim=hd, scale=1.0 / np.sqrt(hd), block_size=pool.bs)
    scored = "" if score_from is None else "-scores"
    return StepCase(f"paged-attention{scored}-{kv_dtype}-h{h}.{kvh}x{hd}-bs{pool.bs}", g, op, arrays,
                    Step(len(rows), 0, 0))


def gather_case(T: int, n: int, picked: list[int], d: int = 100, seed: int = 23) -> StepCase:
    """The first n rows of x are the step's; y takes len(picked) of them (the kernel runs on
    n_tokens = len(picked) rows, as a step function passes it)."""
    rng = np.random.default_rng(seed)
    g = Graph("step", T)
    arrays = {"x": _floats(rng, (T, d))}
    g.add_value("x", (T, d), "f32", "input")
    _index(g, arrays, "rows", picked)
    g.add_value("y", (len(picked), d), "f32")
    arrays["y"] = np.zeros((len(picked), d), np.float32)
    op = g.add_op("gather", ["x", "rows"], ["y"])
    return StepCase(f"gather-{len(picked)}-of-{n}", g, op, arrays, Step(len(picked), 0, 0))
