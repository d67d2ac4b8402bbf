"""Backend.run_step on every back end (runtime/backends/base.py): cpu and reference give the
interpreter's logits, hybrid runs it on the side holding the cache, OpenCL names the back end
that runs step graphs; bad rows are one-line errors naming the field, refused before anything
runs; a plan without a step graph says to recompile."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.backends import BackendOptions, open_backend
from llmrs.runtime.backends.base import StepRows, StepRowsError, check_step_rows
from llmrs.runtime.backends.cpu import CpuBackend, CpuBackendError
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.plan import Plan

from ..conftest import DATA, rel_err
from .step_driver import Blocks


def _compile(out, *flags: str) -> Plan:
    assert compile_main([str(DATA / "golden-a"), "-o", str(out), "--weights", "f32", "--kv-type", "f32",
                         "--max-seq-len", "32", "--prefill-chunk", "8", "-q", *flags]) == 0
    return Plan.open(out)


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    """golden-a for both targets: a 32-slot cache in 8 blocks of 4, up to 3 sequences a step."""
    return _compile(tmp_path_factory.mktemp("step-be") / "golden-a.plan.bin", "--target", "cpu,opencl",
                    "--block-size", "4", "--max-num-seqs", "3")


def _steps(plan: Plan) -> list[StepRows]:
    """Two sequences' prompts (5 and 3 tokens) in one step, then one decode row each."""
    rng = np.random.default_rng(3)
    blocks = Blocks(plan.step_shape(), rng)
    a, b = rng.integers(3, 384, 5), rng.integers(3, 384, 3)
    first = blocks.rows([(0, int(t)) for t in a] + [(1, int(t)) for t in b], [4, 7])
    return [first, blocks.rows([(1, 9), (0, 11)], [0, 1])]


def test_cpu_and_reference_run_steps_as_the_interpreter(plan):
    ref = ReferenceBackend(plan.graphs())
    cpu = CpuBackend(plan, threads=2)
    try:
        for rows in _steps(plan):
            got, want = cpu.run_step(rows), ref.run_step(rows)
            assert got.shape == want.shape == (2, 384) and got.dtype == np.float32
            assert rel_err(got, want) <= 1e-4
    finally:
        cpu.close()


def test_hybrid_runs_a_step_on_the_side_that_holds_the_cache(plan, opencl_device):
    """A step on the CPU, the whole pool handed to OpenCL, the next step there."""
    steps = _steps(plan)
    ref = ReferenceBackend(plan.graphs())
    want = [ref.run_step(rows) for rows in steps]
    on_cpu = open_backend(plan, "hybrid", BackendOptions(threads=2, hybrid_kv="copy"))
    try:
        assert on_cpu.active == "cpu"
        assert rel_err(on_cpu.run_step(steps[0]), want[0]) <= 1e-4
        on_cpu.use("opencl", n_past=plan.step_shape().slots)
        assert rel_err(on_cpu.run_step(steps[1]), want[1]) <= 1e-4
    finally:
        on_cpu.close()


def test_opencl_runs_steps_as_the_interpreter(plan, opencl_device):
    ref = ReferenceBackend(plan.graphs())
    be = open_backend(plan, "opencl")
    try:
        for rows in _steps(plan):
            assert rel_err(be.run_step(rows), ref.run_step(rows)) <= 1e-4
    finally:
        be.close()


def _scoring_steps(plan: Plan) -> list[StepRows]:
    """_steps with eviction scores: in the first step sequence 0's rows from KV index 2 and none
    of sequence 1's, in the second sequence 1's decode row and not sequence 0's, which is marked
    a prompt row so OpenCL's row split puts it first (score_from must move with its row)."""
    never = np.iinfo(np.int32).max
    first, second = _steps(plan)
    return [StepRows(**{**first.__dict__, "score_from": np.array([2] * 5 + [never] * 3, np.int32)}),
            StepRows(**{**second.__dict__, "score_from": np.array([0, never], np.int32),
                        "generated": np.array([1, 0], np.int32)})]


@pytest.mark.parametrize("kind", ["cpu", "opencl"])
def test_steps_add_the_scoring_rows_eviction_scores_as_the_interpreter(plan, kind, request):
    """The scores of every layer at every pool slot after the two steps, against the reference
    back end's (the interpreter); slots no scoring row attends stay 0."""
    if kind == "opencl":
        request.getfixturevalue("opencl_device")
    ref = ReferenceBackend(plan.graphs())
    be = open_backend(plan, kind, BackendOptions(threads=2) if kind == "cpu" else BackendOptions())
    slots = np.arange(plan.step_shape().slots)
    try:
        for rows in _scoring_steps(plan):
            assert rel_err(be.run_step(rows), ref.run_step(rows)) <= 1e-4
        got, want = be.kv_store().slot_scores(slots), ref.kv_store().slot_scores(slots)
        first, second = _steps(plan)
        written, unscored = np.concatenate([first.slots, second.slots]), second.slots[1]
        assert (np.delete(want, written, axis=-1) == 0).all() and (want[..., unscored] == 0).all()
        assert (want[..., written[written != unscored]] > 0).all()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    finally:
        be.close()


def test_the_cpu_runs_the_step_graph_only_through_run_step(plan):
    cpu = CpuBackend(plan, threads=1)
    try:
        with pytest.raises(CpuBackendError, match=r"^graph 'step' runs through run_step \(each row needs its "
                                                  r"position, KV slot and block table\)$"):
            cpu.run("step", np.array([3], np.int32), 0, 0)
    finally:
        cpu.close()


def _bad(rows: StepRows, **change) -> StepRows:
    return StepRows(**{**rows.__dict__, **change})


BAD = [
    ({"tokens": [1, 2, 400]}, "tokens[2] = 400 is outside 0..383 (the vocabulary)"),
    ({"positions": [0, -1, 2]}, "positions[1] = -1 is outside 0..2147483647 (RoPE positions)"),
    ({"slots": [0, 1, 32]}, "slots[2] = 32 is outside 0..31 (the KV cache's slots)"),
    ({"slots": [5, 6, 5]}, "two rows write the same KV slot; give each row its own slot"),
    ({"row_seq": [0, 2, 0]}, "row_seq[1] = 2 is outside 0..1 (rows of block_tables)"),
    ({"ctx_len": [1, 0, 3]}, "ctx_len[1] = 0 is outside 1..32 (KV entries a row attends)"),
    ({"ctx_len": [1, 2, 33]}, "ctx_len[2] = 33 is outside 1..32 (KV entries a row attends)"),
    ({"block_tables": np.full((2, 8), 8)}, "block_tables[0, 0] = 8 is outside 0..7 (the cache's blocks)"),
    ({"block_tables": np.zeros((4, 8), np.int32)}, "block_tables is [4, 8]; give [1..3, 1..8] (a row of block ids per sequence)"),
    ({"block_tables": np.zeros((2, 9), np.int32)}, "block_tables is [2, 9]; give [1..3, 1..8]"),
    ({"logit_rows": [0, 3]}, "logit_rows[1] = 3 is outside 0..2 (the step's rows)"),
    ({"logit_rows": [0] * 4}, "logit_rows has 4 entries; give 1..3"),   # no more than the step's rows
    ({"ctx_len": [1, 2]}, "ctx_len has 2 entries for 3 tokens"),
    ({"tokens": np.zeros(9, np.int32)}, "a step takes 1..8 rows, got 9"),
    ({"positions": [0.5, 1, 2]}, "positions must be a 1-d array of integers, got float64[3]"),
    ({"score_from": [0, 1]}, "score_from has 2 entries for 3 tokens"),
]


@pytest.mark.parametrize("kind", ["cpu", "reference"])
def test_narrow_tables_and_entries_no_row_reads_are_taken_as_the_full_table(plan, kind):
    """One contract for every back end (base.py check_step_rows): a table narrower than the
    graph's is padded, and an entry no row reads may hold anything (it is zeroed before a kernel
    sees it): the logits and the cache are those of the full, clean table."""
    rows = StepRows(np.array([3, 4, 5]), np.array([0, 1, 0]), np.array([0, 1, 4]), np.array([0, 0, 1]),
                    np.array([1, 2, 1]), np.array([[0] + [7] * 7, [1] + [7] * 7]), np.array([1, 2]))
    messy = StepRows(**{**rows.__dict__, "block_tables": np.array([[0, -5, 1 << 20], [1, 99, -1]])})
    got = []
    for r in (rows, messy):
        be = open_backend(plan, kind, BackendOptions(threads=2) if kind == "cpu" else BackendOptions())
        try:
            got.append(be.run_step(r))
        finally:
            be.close()
    np.testing.assert_array_equal(got[0], got[1])
    checked = check_step_rows(messy, plan.step_shape())
    np.testing.assert_array_equal(checked.block_tables, [[0] + [0] * 7, [1] + [0] * 7])


@pytest.mark.parametrize("kind", ["cpu", "reference"])
@pytest.mark.parametrize("change,says", BAD, ids=[s.split(" ")[0] + str(i) for i, (_, s) in enumerate(BAD)])
def test_bad_rows_are_one_line_errors_naming_the_field_and_nothing_runs(plan, kind, change, says):
    good = StepRows(np.array([3, 4, 5]), np.array([0, 1, 0]), np.array([0, 1, 4]), np.array([0, 0, 1]),
                    np.array([1, 2, 1]), np.array([[0] + [7] * 7, [1] + [7] * 7]), np.array([1, 2]))
    be = open_backend(plan, kind, BackendOptions(threads=2) if kind == "cpu" else BackendOptions())
    cache = (lambda: be.kv.copy()) if kind == "cpu" else (lambda: {k: v.copy() for k, v in be.state.items()})
    try:
        be.run_step(good)
        before = cache()
        with pytest.raises(StepRowsError) as err:
            be.run_step(_bad(good, **change))
        assert str(err.value).startswith(f"step rows: {says}") and "\n" not in str(err.value)
        after = cache()
        if kind == "cpu":
            np.testing.assert_array_equal(after, before)
        else:
            assert all(np.array_equal(after[k], v) for k, v in before.items())
    finally:
        be.close()


def test_a_plan_without_a_step_graph_asks_to_be_recompiled(tmp_path):
    plan = _compile(tmp_path / "no-step.plan.bin", "--target", "cpu", "--max-num-seqs", "0")
    assert plan.step_shape() is None and "step" not in plan.graphs()
    rows = _steps(_compile(tmp_path / "step.plan.bin", "--target", "cpu", "--block-size", "4"))[0]
    cpu = CpuBackend(plan, threads=1)
    try:
        with pytest.raises(CpuBackendError, match=r"no step graph \(compiled with max_num_seqs 0, or by an older "
                                                  r"llmrs\); recompile it to run many sequences$"):
            cpu.run_step(rows)
    finally:
        cpu.close()
    with pytest.raises(ValueError, match="^the plan has no step graph"):
        ReferenceBackend(plan.graphs()).run_step(rows)
