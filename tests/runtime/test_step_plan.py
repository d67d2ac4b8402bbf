"""Plan.open and a step graph: plans with and without one (older plans, max_num_seqs 0) open, what
a step takes is read from it (Plan.step_shape), and a step graph the runtime could not fill, or
one laying out the KV cache unlike the other graphs, is refused in one line."""
from __future__ import annotations

import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.plan import Plan, PlanError, StepShape

from ..conftest import DATA
from .test_plan_reader import make_plan, with_manifest


@pytest.fixture(scope="module")
def step_plan(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("step-plan") / "golden-a.plan.bin"
    assert compile_main([str(DATA / "golden-a"), "-o", str(out), "--target", "cpu", "--max-seq-len", "48",
                         "--prefill-chunk", "12", "--block-size", "8", "--max-num-seqs", "5", "-q"]) == 0
    return out.read_bytes()


def test_a_plan_from_before_step_graphs_opens_without_one(tmp_path):
    plan = Plan.open(make_plan(tmp_path / "old.plan.bin"))
    assert sorted(plan.graphs()) == ["decode", "prefill"] and plan.step_shape() is None


def test_the_step_shape_comes_from_the_step_graph(step_plan, tmp_path):
    path = tmp_path / "p.bin"
    path.write_bytes(step_plan)
    plan = Plan.open(path)
    # logits: a verify step's 8 drafts and the token before them, past the 5 sequences' rows
    assert plan.step_shape() == StepShape(rows=12, seqs=5, block_size=8, blocks_per_seq=6, n_blocks=6, vocab=384,
                                          logits=9)
    assert plan.step_shape().slots == 48 == plan.manifest["max_seq_len"]


def _swap_kv_offsets(m: dict) -> None:
    kv = m["graphs"]["step"]["meta"]["layout"]["kv"]
    kv["cache.k.0"], kv["cache.v.0"] = kv["cache.v.0"], kv["cache.k.0"]


def _drop_input(m: dict) -> None:
    m["graphs"]["step"]["inputs"].remove("logit_rows")


def _two_block_sizes(m: dict) -> None:
    att = [op for op in m["graphs"]["step"]["ops"] if op["kind"] == "attention"]
    att[0]["attrs"]["block_size"] = 4
    tables = next(v for v in m["graphs"]["step"]["values"] if v[0] == "block_tables")
    tables[1] = [tables[1][0], 12]     # the first attention's table [B, 48 / 4] then fits it alone


@pytest.mark.parametrize("change,says", [
    (_swap_kv_offsets, "graph 'step' lays out the KV cache unlike graph 'decode'; recompile the plan"),
    (_drop_input, "graph 'step' is not a step graph: its inputs are tokens, positions, slots, row_seq, ctx_len, "
                  "block_tables, score_from, not tokens, positions, slots, row_seq, ctx_len, block_tables, logit_rows, "
                  "score_from; recompile the plan"),
])
def test_a_step_graph_the_runtime_cannot_use_is_refused_in_one_line(step_plan, tmp_path, change, says):
    path = tmp_path / "bad.plan.bin"
    path.write_bytes(with_manifest(step_plan, change))
    with pytest.raises(PlanError) as err:
        Plan.open(path)
    assert str(err.value) == f"{path}: {says}"


def test_attention_ops_with_different_block_sizes_are_refused(step_plan, tmp_path):
    """One table cannot fit two block sizes: the second attention op's shape rule says so."""
    path = tmp_path / "bad.plan.bin"
    path.write_bytes(with_manifest(step_plan, _two_block_sizes))
    with pytest.raises(PlanError) as err:
        Plan.open(path)
    # the second layer's attention: embedding, then 5 fused kernels a layer (attention the 2nd)
    assert str(err.value) == (f"{path}: graph 'step' is malformed: op attention_7 (attention): block_tables "
                              "'block_tables' must be an i32[B, 6] graph input; recompile the plan")
