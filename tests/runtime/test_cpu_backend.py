"""The CPU back end end to end: whole-step LLVM functions on a thread team, on the golden models."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler import quant
from llmrs.compiler.codegen.llvm import build_module
from llmrs.compiler.passes.plan_memory import plan_memory
from llmrs.compiler.codegen.llvm_target import host_target
from llmrs.compiler.interpret import Interpreter
from llmrs.compiler.ir import Graph, LazyTensor
from llmrs.models.llama import build_graphs, load_model
from llmrs.runtime.backends.cpu import CpuBackend, CpuBackendError
from llmrs.runtime.backends.cpu_native import NativeCode

DATA = Path(__file__).resolve().parents[1] / "data"
CHUNK = 16


class GraphPlan:
    """What CpuBackend reads from a plan (graphs, weights, code sections), held in memory."""

    def __init__(self, graphs: dict[str, Graph], sections: dict[str, bytes] | None = None):
        self._graphs, self._sections = graphs, sections or {}

    def graphs(self) -> dict[str, Graph]:
        return self._graphs

    def weight(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(next(g.weights[name] for g in self._graphs.values()).load())

    def section(self, name: str) -> memoryview:
        return memoryview(self._sections[name])


def quantized(graphs: list[Graph], dtype: str) -> list[Graph]:
    """Every 2-D weight stored as dtype, as the quantize pass does for --weights dtype."""
    if dtype == "f32":
        return graphs
    out = []
    for g in graphs:
        g = g.copy()
        for name, v in g.values.items():
            if v.kind == "param" and len(v.shape) == 2:
                f = Interpreter(g).weight(name)
                raw = quant.quantize(f, dtype) if dtype in quant.BLOCK_BYTES else f.astype(np.float16)
                g.weights[name] = LazyTensor.of(raw, dtype)
                v.dtype = dtype
        out.append(g)
    return out


def backend(model: str, wdtype: str, threads: int = 2, kv_dtype: str = "f32") -> CpuBackend:
    # the real planner: reused and in-place slots catch a kernel writing past its rows
    p, d = (plan_memory(g) for g in quantized(list(build_graphs(load_model(DATA / model), CHUNK, 64,
                                                                 kv_dtype=kv_dtype)), wdtype))
    ir_text = str(build_module([p, d], host_target()))
    return CpuBackend(GraphPlan({"prefill": p, "decode": d}, {"llvm-ir": ir_text.encode()}), threads=threads)


def prefill(be: CpuBackend, tokens: np.ndarray) -> np.ndarray:
    rows = [be.run("prefill", tokens[s:s + CHUNK], s, s) for s in range(0, len(tokens), CHUNK)]
    return np.concatenate(rows)


@pytest.mark.parametrize("model", ["golden-a", "golden-b", "golden-c"])
def test_f32_plan_logits_match_transformers_golden_data(model):
    gold = np.load(DATA / f"{model}.npz")
    be = backend(model, "f32")
    prompt = gold["prompt_tokens"]
    logits = prefill(be, prompt)
    ref = gold["prefill_logits"]
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()
    n = len(prompt)
    dec = np.stack([be.run("decode", np.array([t]), n + i, n + i)[0] for i, t in enumerate(gold["generated"][:-1])])
    ref = gold["decode_logits"]
    assert np.abs(dec - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("wdtype,kv_dtype", [("q4_0", "f32"), ("q4_1", "f16"), ("q8_0", "f16"), ("f16", "f16"),
                                             ("f32", "f32")])
def test_greedy_tokens_match_interpreter_for_each_weight_format(wdtype, kv_dtype):
    p, d = (plan_memory(g) for g in quantized(list(build_graphs(load_model(DATA / "golden-a"), CHUNK, 64,
                                                                 kv_dtype=kv_dtype)), wdtype))
    be = CpuBackend(GraphPlan({"prefill": p, "decode": d}), threads=2, code=NativeCode(str(build_module([p, d], host_target()))))
    prompt = np.load(DATA / "golden-a.npz")["prompt_tokens"][:20]
    ip, idc = Interpreter(p), Interpreter(d)
    state = ip.new_state()
    ref_tokens, got_tokens = [], []
    ref_last = np.concatenate([ip.run({"tokens": prompt[s:s + CHUNK]}, state, s)["logits"]
                               for s in range(0, len(prompt), CHUNK)])[-1]
    got_last = prefill(be, prompt)[-1]
    for i in range(6):
        ref_tokens.append(int(np.argmax(ref_last)))
        got_tokens.append(int(np.argmax(got_last)))
        pos = len(prompt) + i
        ref_last = idc.run({"tokens": np.array([ref_tokens[-1]])}, state, pos)["logits"][0]
        got_last = be.run("decode", np.array([got_tokens[-1]]), pos, pos)[0]
    assert got_tokens == ref_tokens


def test_one_thread_and_three_threads_give_the_same_logits():
    prompt = np.load(DATA / "golden-a.npz")["prompt_tokens"][:10]
    one, three = backend("golden-a", "q4_0", threads=1), backend("golden-a", "q4_0", threads=3)
    np.testing.assert_array_equal(prefill(one, prompt), prefill(three, prompt))
    np.testing.assert_array_equal(one.run("decode", np.array([5]), 10, 10), three.run("decode", np.array([5]), 10, 10))


def test_bad_steps_are_one_line_errors():
    be = backend("golden-a", "f32", threads=1)
    with pytest.raises(CpuBackendError, match="1..16 tokens"):
        be.run("prefill", np.zeros(17, np.int32), 0, 0)
    with pytest.raises(CpuBackendError, match="out of range"):
        be.run("decode", np.array([10_000]), 0, 0)
    with pytest.raises(CpuBackendError, match="do not fit"):
        be.run("decode", np.array([1]), 64, 64)
    with pytest.raises(CpuBackendError, match="--threads 0"):
        CpuBackend(GraphPlan({}), threads=0)
    with pytest.raises(CpuBackendError, match="no CPU code"):
        CpuBackend(GraphPlan(be.graphs), threads=1)


def test_argmax_reads_the_arena_and_run_keeps_its_copy():
    """run_argmax takes each row's argmax off the arena, where the next step writes: run's rows
    must be copies, and the argmax numpy's of those rows."""
    prompt = np.load(DATA / "golden-a.npz")["prompt_tokens"][:12]
    be = backend("golden-a", "q4_0", threads=2)
    first = be.run("prefill", prompt, 0, 0)
    kept = first.copy()
    be.reset()
    chosen = be.run_argmax("prefill", prompt, 0, 0)
    be.run("decode", np.array([int(chosen[-1])]), 12, 12)      # writes over the arena's logits
    np.testing.assert_array_equal(first, kept)
    np.testing.assert_array_equal(chosen, np.argmax(kept, axis=-1).astype(np.int32))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_argmax_refuses_a_row_with_nan_or_inf(value):
    from llmrs.runtime.backends.base import NonFiniteLogits
    from llmrs.runtime.backends.cpu import _argmax_rows
    rows = np.random.default_rng(3).standard_normal((3, 50)).astype(np.float32)
    rows[1, 7] = -np.inf                                       # a token never chosen: fine
    np.testing.assert_array_equal(_argmax_rows(rows), np.argmax(rows, axis=-1))
    rows[2, 30] = value
    with pytest.raises(NonFiniteLogits):
        _argmax_rows(rows)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> list[Graph]:
    """The `tiny` preset (K = 256 and 768): q4_0 matmuls take the grouped path on x86 (AVX-512 VNNI
    or AVX2), whose decode tiles are 8 or 4 rows; 2 layers keep it quick."""
    from llmrs.models.tiny import make_model
    path = make_model(tmp_path_factory.mktemp("tiny") / "m", "tiny", num_hidden_layers=2)
    return [plan_memory(g) for g in quantized(list(build_graphs(load_model(path), CHUNK, 64, kv_dtype="f16")), "q4_0")]


def test_rows_shared_by_a_work_counter_give_interpreter_logits_on_one_and_two_threads(tiny_q4):
    """Matmul rows are handed out by a counter the barrier re-arms, so every step and every thread
    count must produce the interpreter's logits (a counter left spent would leave stale rows)."""
    p, d = tiny_q4
    code = NativeCode(str(build_module([p, d], host_target())))
    bes = [CpuBackend(GraphPlan({"prefill": p, "decode": d}), threads=n, code=code) for n in (1, 2)]
    prompt = np.random.default_rng(3).integers(0, 1024, 21)
    ip, idc = Interpreter(p), Interpreter(d)
    state = ip.new_state()
    ref = np.concatenate([ip.run({"tokens": prompt[s:s + CHUNK]}, state, s)["logits"]
                          for s in range(0, len(prompt), CHUNK)])
    got = [prefill(be, prompt) for be in bes]
    # the kernels' float sums differ from numpy's in the last bits, which can move one Q8_0
    # activation rounding by a step (logits ~1% apart by the second layer); a spent counter or a
    # row done twice is off by the logits' whole size
    tol = 5e-2 * np.abs(ref).max()
    for g in got:
        assert np.abs(g - ref).max() <= tol
    np.testing.assert_array_equal(got[0], got[1])
    for i, tok in enumerate([7, 300, 1023, 5]):
        pos = len(prompt) + i
        want = idc.run({"tokens": np.array([tok])}, state, pos)["logits"]
        outs = [be.run("decode", np.array([tok]), pos, pos) for be in bes]
        np.testing.assert_array_equal(outs[0], outs[1])
        assert np.abs(outs[0] - want).max() <= tol
    for be in bes:
        be.close()
