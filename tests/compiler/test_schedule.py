"""schedule: a valid launch order that keeps few bytes live and leaves the numbers alone."""
import numpy as np
import pytest

from llmrs.compiler.interpret import Interpreter
from llmrs.compiler.ir import Graph, IRError, LazyTensor
from llmrs.compiler.passes.fold import fold
from llmrs.compiler.passes.fuse import fuse
from llmrs.compiler.passes.schedule import dependencies, peak_live_bytes, schedule
from llmrs.models.llama import build_graphs, load_model

from ..conftest import DATA, run_steps


def _order(g: Graph) -> list[str]:
    return [op.name for op in g.ops]


def _random_topological(g: Graph, seed: int) -> Graph:
    """The same graph in another valid order: ready ops picked at random."""
    dag = dependencies(g)
    rng = np.random.default_rng(seed)
    by_name = {op.name: op for op in g.ops}
    waiting = {n: dag.in_degree(n) for n in dag.nodes}
    ready = sorted(n for n, d in waiting.items() if d == 0)
    out = g.copy()
    out.ops = []
    while ready:
        name = ready.pop(int(rng.integers(len(ready))))
        out.ops.append(by_name[name])
        for nxt in dag.successors(name):
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                ready.append(nxt)
    return out.verify()


@pytest.mark.parametrize("fused", [False, True])
def test_shuffled_then_scheduled_golden_graphs_give_the_same_logits(fused):
    prefill, decode = build_graphs(load_model(DATA / "golden-a"), prefill_T=16, max_seq_len=48)
    if fused:
        prefill, decode = fuse(fold(prefill)), fuse(fold(decode))
    rng = np.random.default_rng(5)
    prompt, steps = rng.integers(1, 380, size=13).astype(np.int32), rng.integers(1, 380, size=5).astype(np.int32)
    want_prefill, want_steps = run_steps(prefill, decode, prompt, steps)
    shuffled = [_random_topological(g, seed) for g, seed in ((prefill, 1), (decode, 2))]
    if not fused:  # a fused layer is a chain: it has one order only
        assert _order(shuffled[0]) != _order(prefill)
    scheduled = [schedule(g).verify() for g in shuffled]
    for s, sh in zip(scheduled, shuffled):
        assert sorted(_order(s)) == sorted(_order(sh))
        assert peak_live_bytes(s) <= peak_live_bytes(sh)
    got_prefill, got_steps = run_steps(*scheduled, prompt, steps)
    np.testing.assert_array_equal(got_prefill, want_prefill)
    np.testing.assert_array_equal(np.stack(got_steps), np.stack(want_steps))


def test_builder_order_is_kept_and_scheduling_is_idempotent(llama_1b_graphs):
    graphs = [*build_graphs(load_model(DATA / "golden-b"), prefill_T=8, max_seq_len=16), *llama_1b_graphs]
    for g in graphs:
        once = schedule(g)
        assert _order(once) == _order(g)
        assert _order(schedule(once)) == _order(once)


def _branches_graph(order: str) -> Graph:
    """x -> four wide matmuls y_k [4,256], each narrowed by s_k = y_k @ v_k.T [4,8], summed.
    order "wide_first" makes every y_k before any s_k (four wide tensors live at once)."""
    rng = np.random.default_rng(11)
    g = Graph("t", T=4)

    def param(name, shape):
        g.weights[name] = LazyTensor.of((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32), "f32")
        g.add_value(name, shape, "f32", kind="param")

    param("emb", (20, 8))
    g.inputs = [g.add_value("tokens", (4,), "i32", kind="input")]
    g.add_value("x", (4, 8), "f32")
    g.add_op("embedding", ["emb", "tokens"], ["x"])
    for k in range(4):
        param(f"w{k}", (256, 8))
        param(f"v{k}", (8, 256))
        g.add_value(f"y{k}", (4, 256), "f32")
        g.add_value(f"s{k}", (4, 8), "f32")
    wide = [("matmul", ["x", f"w{k}"], [f"y{k}"]) for k in range(4)]
    narrow = [("matmul", [f"y{k}", f"v{k}"], [f"s{k}"]) for k in range(4)]
    ops = wide + narrow if order == "wide_first" else [o for pair in zip(wide, narrow) for o in pair]
    for kind, ins, outs in ops:
        g.add_op(kind, ins, outs)
    acc = "s0"
    for k in range(1, 4):
        g.add_value(f"sum{k}", (4, 8), "f32")
        g.add_op("add", [acc, f"s{k}"], [f"sum{k}"])
        acc = f"sum{k}"
    g.outputs = [acc]
    return g.verify()


def test_wide_tensors_are_narrowed_before_the_next_is_made():
    bad, good = _branches_graph("wide_first"), _branches_graph("interleaved")
    wide, narrow = 4 * 256 * 4, 4 * 8 * 4
    assert peak_live_bytes(bad) == 4 * wide + narrow            # y0..y3 and s0
    assert peak_live_bytes(good) == wide + 4 * narrow           # x, y3, s0..s2: sums come last
    s = schedule(bad)
    assert peak_live_bytes(s) == wide + 3 * narrow              # x, y1, s0, s1: each sum as soon as it can
    tokens = np.array([3, 1, 4, 15], np.int32)
    want = Interpreter(bad).run({"tokens": tokens}, {}, 0)["sum3"]
    np.testing.assert_array_equal(Interpreter(s).run({"tokens": tokens}, {}, 0)["sum3"], want)


def test_ops_out_of_dependency_order_are_put_in_order():
    g = _branches_graph("interleaved")
    g.ops.append(g.ops.pop(0))  # the embedding last: invalid
    with pytest.raises(IRError, match="used before it is produced"):
        g.copy().verify()
    s = schedule(g).verify()
    assert s.ops[0].kind == "embedding"


def test_kv_cache_reader_stays_before_a_later_in_place_write():
    """attention reads the cache state itself, then kv_store writes it through an alias: no
    value flows between them, yet swapping them changes what attention sees."""
    g = Graph("t", T=2)
    g.weights["emb"] = LazyTensor.of(np.random.default_rng(2).standard_normal((9, 8)).astype(np.float32), "f32")
    g.add_value("emb", (9, 8), "f32", kind="param")
    g.inputs = [g.add_value("tokens", (2,), "i32", kind="input")]
    g.add_value("cache", (6, 1, 8), "f32", kind="state")
    g.add_value("x", (2, 8), "f32")
    g.add_value("o", (2, 8), "f32")
    g.add_value("cache_new", (6, 1, 8), "f32", alias="cache")
    g.add_op("embedding", ["emb", "tokens"], ["x"])
    att = g.add_op("attention", ["x", "cache", "cache"], ["o"], n_heads=1, n_kv_heads=1, head_dim=8, scale=0.3)
    store = g.add_op("kv_store", ["x", "cache"], ["cache_new"])
    g.outputs = ["o"]
    g.verify()
    assert dependencies(g).has_edge(att.name, store.name)
    assert _order(schedule(g)).index(att.name) < _order(schedule(g)).index(store.name)


def test_duplicate_op_names_are_refused_by_name():
    g = _branches_graph("interleaved")
    g.ops[2].name = g.ops[1].name
    with pytest.raises(IRError, match=r"schedule: graph t has two ops named 'matmul_1'; op names must be unique"):
        schedule(g)
