"""plan_memory: arena layouts of real graphs pass the oracle and run a model unchanged."""
import math

import numpy as np
import pytest

from llmrs.compiler.galloc import PlanError, verify_storage_reuse
from llmrs.compiler.interpret import OPS, Interpreter, Step
from llmrs.compiler.ir import Graph, IRError, LazyTensor
from llmrs.compiler.passes.fold import fold
from llmrs.compiler.passes.fuse import fuse
from llmrs.compiler.passes.plan_memory import (inplace_inputs, live_intervals, plan_memory,
                                               shared_arena_bytes)
from llmrs.models.llama import build_graphs, load_model

from ..conftest import DATA

LAYOUT_KEYS = {"alignment", "arena_bytes", "arena", "kv_bytes", "kv", "naive_bytes", "lower_bound_bytes", "inplace"}


def _golden_graphs(name: str, T: int = 16) -> tuple[Graph, Graph]:
    return build_graphs(load_model(DATA / name), prefill_T=T, max_seq_len=32)


class ArenaRun:
    """Runs a planned graph with every arena value kept only as bytes at its planned offset,
    so a value clobbered while still live changes the outputs."""

    def __init__(self, g: Graph):
        self.g, self.layout = g, g.meta["layout"]
        self.arena = np.zeros(self.layout["arena_bytes"], np.uint8)   # [arena_bytes]
        self.it = Interpreter(g)
        self.kept: dict[str, tuple[tuple[int, ...], np.dtype]] = {}    # the rows each value holds

    def _store(self, name: str, arr: np.ndarray) -> None:
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        assert raw.size <= self.g.values[name].nbytes, f"{name} outgrew its slot"
        off = self.layout["arena"][name]
        self.arena[off:off + raw.size] = raw
        self.kept[name] = (arr.shape, arr.dtype)

    def _load(self, name: str) -> np.ndarray:
        shape, dtype = self.kept[name]
        off = self.layout["arena"][name]
        n = math.prod(shape) * dtype.itemsize
        return self.arena[off:off + n].view(dtype).reshape(shape).copy()

    def run(self, tokens: np.ndarray, state: dict[str, np.ndarray], n_past: int) -> dict[str, np.ndarray]:
        g = self.g
        self._store("tokens", tokens.astype(np.int32))
        step = Step(len(tokens), n_past, n_past)
        for op in g.ops:
            args = []
            for name in op.inputs:
                v = g.values[name]
                if name in self.layout["arena"]:
                    args.append(self._load(name))
                elif v.kind == "state" or v.alias:
                    args.append(state[v.alias or name])
                else:
                    args.append(self.it.raw(name))
            for name, val in zip(op.outputs, OPS[op.kind](self.it, op, step, *args)):
                if name in self.layout["arena"]:
                    self._store(name, val)
        return {o: self._load(o) for o in g.outputs}


def _prompt_then_decode(prefill: Graph, decode: Graph, runner) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    prompt = rng.integers(1, 350, size=11).astype(np.int32)
    state = Interpreter(prefill).new_state()
    out = [runner(prefill).run(prompt, state, 0)["logits"]]
    for i, tok in enumerate(rng.integers(1, 350, size=4).astype(np.int32)):
        out.append(runner(decode).run(np.array([tok]), state, len(prompt) + i)["logits"])
    return out


class _Plain:
    def __init__(self, g: Graph):
        self.it = Interpreter(g)

    def run(self, tokens, state, n_past):
        return self.it.run({"tokens": tokens}, state, n_past)


@pytest.mark.parametrize("name", ["golden-a", "golden-b"])
def test_golden_layouts_pass_the_oracle_and_sit_between_bounds(name):
    for g in _golden_graphs(name):
        p = plan_memory(g)
        lay = p.meta["layout"]
        assert set(lay) == LAYOUT_KEYS and lay["alignment"] == 64
        ivs = live_intervals(p)
        verify_storage_reuse(ivs, lay["arena"], lay["arena_bytes"], 64, lay["inplace"])
        arena_values = {n for n, v in g.values.items() if v.kind in ("act", "input") and v.alias is None}
        assert set(lay["arena"]) == arena_values
        assert lay["lower_bound_bytes"] <= lay["arena_bytes"] <= lay["naive_bytes"]
        assert lay["arena_bytes"] < lay["naive_bytes"] / 4
        # KV caches: declaration order, back to back, each 64-byte aligned
        states = g.state
        assert list(lay["kv"]) == states and lay["kv"][states[0]] == 0
        for a, b in zip(states, states[1:]):
            assert lay["kv"][b] == lay["kv"][a] + -(-g.values[a].nbytes // 64) * 64
        assert lay["kv_bytes"] == sum(-(-g.values[s].nbytes // 64) * 64 for s in states)


@pytest.mark.parametrize("name", ["golden-a", "golden-b"])
def test_model_run_from_the_planned_arena_gives_the_interpreters_logits(name):
    prefill, decode = _golden_graphs(name)
    want = _prompt_then_decode(prefill, decode, _Plain)
    got = _prompt_then_decode(plan_memory(prefill), plan_memory(decode), ArenaRun)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_fused_graphs_run_from_the_planned_arena_and_reuse_residuals_in_place():
    prefill, decode = (fuse(fold(g)) for g in _golden_graphs("golden-b"))
    want = _prompt_then_decode(prefill, decode, _Plain)
    planned = [plan_memory(g) for g in (prefill, decode)]
    got = _prompt_then_decode(*planned, ArenaRun)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    for p in planned:
        lay = p.meta["layout"]
        verify_storage_reuse(live_intervals(p), lay["arena"], lay["arena_bytes"], 64, lay["inplace"])
        made_by = {o: op for op in p.ops for o in op.outputs}
        epilogue_adds = [o for o in lay["inplace"] if made_by[o].attrs.get("epilogue") == "add"]
        assert len(epilogue_adds) == 2 * 2  # o_proj and down of each layer write over the residual


def test_arena_run_detects_a_layout_that_clobbers_live_values():
    prefill, decode = _golden_graphs("golden-a")
    bad = plan_memory(decode)
    bad.meta["layout"]["arena"] = {n: 0 for n in bad.meta["layout"]["arena"]}
    want = _prompt_then_decode(prefill, decode, _Plain)
    got = _prompt_then_decode(plan_memory(prefill), bad, ArenaRun)
    assert not np.allclose(got[-1], want[-1])
    with pytest.raises(PlanError, match="overlap in lifetime and storage"):
        verify_storage_reuse(live_intervals(bad), bad.meta["layout"]["arena"], bad.meta["layout"]["arena_bytes"])


def test_residual_adds_reuse_storage_and_matmuls_never_do():
    decode = _golden_graphs("golden-a")[1]
    p = plan_memory(decode)
    made_by = {o: op for op in p.ops for o in op.outputs}
    reuses = p.meta["layout"]["inplace"]
    assert reuses["l0.x_attn"] in ("x.embed", "l0.o_proj") and reuses["l1.x_out"] in ("l1.x_attn", "l1.down")
    for out, src in reuses.items():
        op = made_by[out]
        assert op.kind not in ("matmul", "embedding", "attention")
        assert src in [op.inputs[k] for k in inplace_inputs(op)]


def _square_matmul_graph() -> Graph:
    """embedding -> matmul with a square weight, whose x dies at the matmul: the same size as
    its output, yet the output must not take x's storage."""
    rng = np.random.default_rng(3)
    g = Graph("t", T=4)
    for name, arr in (("emb", rng.standard_normal((10, 32))), ("w", rng.standard_normal((32, 32)))):
        g.weights[name] = LazyTensor.of(arr.astype(np.float32), "f32")
        g.add_value(name, arr.shape, "f32", kind="param")
    g.inputs = [g.add_value("tokens", (4,), "i32", kind="input")]
    for name in ("x", "y", "z"):
        g.add_value(name, (4, 32), "f32")
    g.add_op("embedding", ["emb", "tokens"], ["x"])
    g.add_op("matmul", ["x", "w"], ["y"])
    g.add_op("silu", ["y"], ["z"])
    g.outputs = ["z"]
    return g.verify()


def test_matmul_input_is_not_overwritten_but_silu_input_is():
    lay = plan_memory(_square_matmul_graph()).meta["layout"]
    assert lay["inplace"] == {"z": "y"}
    assert lay["arena"]["y"] != lay["arena"]["x"] and lay["arena"]["z"] == lay["arena"]["y"]


def test_sliced_tensor_outlives_the_slice_for_backends_that_read_through_it():
    g = _square_matmul_graph()
    g.values["z"].shape = (1, 32)
    g.add_value("x_last", (1, 32), "f32")
    g.ops[1:] = []
    g.add_op("slice", ["x"], ["x_last"], rows="last")
    g.add_op("matmul", ["x_last", "w"], ["y"])
    g.values["y"].shape = (1, 32)
    g.add_op("silu", ["y"], ["z"])
    iv = {i.name: i for i in live_intervals(g.verify())}
    assert iv["x"].end == iv["x_last"].end == 2  # x read (through the slice) by the matmul at step 2
    lay = plan_memory(g).meta["layout"]
    assert lay["arena"]["y"] != lay["arena"]["x"]


def test_shared_arena_is_the_larger_phase_and_needs_a_plan():
    prefill, decode = (plan_memory(g) for g in _golden_graphs("golden-b", T=24))
    sizes = (prefill.meta["layout"]["arena_bytes"], decode.meta["layout"]["arena_bytes"])
    assert sizes[0] > sizes[1] and shared_arena_bytes([prefill, decode]) == sizes[0]
    with pytest.raises(IRError, match="graph decode has no memory layout; run the plan_memory pass first"):
        shared_arena_bytes([prefill, _golden_graphs("golden-b")[1]])


def test_llama_1b_arena_is_within_five_percent_of_the_lower_bound(llama_1b_graphs):
    for g in [*llama_1b_graphs, *(fuse(fold(g)) for g in llama_1b_graphs)]:
        lay = plan_memory(g).meta["layout"]
        verify_storage_reuse(live_intervals(g), lay["arena"], lay["arena_bytes"], 64, lay["inplace"])
        assert lay["arena_bytes"] <= 1.05 * lay["lower_bound_bytes"], g.name
        # layers x (k, v) x [S, KVH, hd] f32, then eviction scores: layers x [KVH, S] f32, and
        # the score control i32[2] in a 64-byte slot
        assert lay["kv_bytes"] == 16 * 2 * 2048 * 8 * 64 * 4 + 16 * 8 * 2048 * 4 + 64
