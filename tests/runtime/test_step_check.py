"""llmrs-check and llmrs-bench --kernels on a plan with a step graph: every kernel of it (the fused
QKV roping at positions and storing at slots, paged attention, the gather and the head on the logit rows) alone
on the CPU and OpenCL against the interpreter, with step inputs as the runtime gives them."""
from __future__ import annotations

import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.measure import kernels as kernel_checks
from llmrs.measure.bench_kernels import time_kernels
from llmrs.runtime.plan import Plan

from ..conftest import DATA


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    out = tmp_path_factory.mktemp("step-check") / "golden-b.plan.bin"
    assert compile_main([str(DATA / "golden-b"), "-o", str(out), "--max-seq-len", "48", "--prefill-chunk", "12",
                         "--weights", "q4_0", "--kv-type", "f16", "--block-size", "4", "--max-num-seqs", "3",
                         "-q"]) == 0
    return Plan.open(out)


def test_every_step_kernel_passes_on_the_cpu(plan):
    kernels = [k for k in kernel_checks.plan_kernels(plan.graphs()) if k.phase != "verify"]   # OpenCL's alone
    step = [k for k in kernels if k.phase == "step"]
    assert {"attention", "gather", "fused_matmul"} <= {k.op.kind for k in step}
    assert any(k.op.attrs.get("step_rows") for k in step)     # RoPE and the KV store in the QKV's epilogue
    results = kernel_checks.check_kernels(kernels, kernel_checks.open_runners(plan, ["cpu"]))
    assert len(results) == len(kernels)
    for r in results:
        assert r.status == "PASS", (r.kernel.phase, r.kernel.label, r.note)
        assert 0 <= r.error <= r.kernel.tolerance


def test_every_step_kernel_passes_on_opencl(plan, opencl_device):
    """(A machine whose OpenCL cannot build kernels skips this, naming what to install.)"""
    kernels = [k for k in kernel_checks.plan_kernels(plan.graphs()) if k.phase in ("step", "verify")]
    assert {k.phase for k in kernels} == {"step", "verify"}
    results = kernel_checks.check_kernels(kernels, kernel_checks.open_runners(plan, ["opencl"]))
    # a step graph's layer matmuls are checked three times: prompt rows (tiled), generated rows
    # (the one-token matvec) and, for steps of 4 generated rows or more, its MV_SX twin; its head
    # twice, on the logit rows (a matvec and its twin)
    sx = " (4+ a step)"
    split = [r for r in results if r.backend not in ("opencl", "opencl (logit rows)", "opencl (logit rows)" + sx)]
    assert {r.backend for r in split} == {"opencl (prompt rows)", "opencl (generated rows)", "opencl (generated rows)" + sx}
    assert {r.kernel.op.kind for r in split} == {"fused_matmul"} and len(split) % 3 == 0
    heads = [r for r in results if r.backend.startswith("opencl (logit rows)")]
    assert {r.backend for r in heads} == {"opencl (logit rows)", "opencl (logit rows)" + sx}
    assert len({r.kernel.label for r in heads}) == 1 and len(heads) == 2
    assert heads[0].kernel.phase == "step" and heads[0].kernel.op.attrs.get("prologue") == "rms_norm"
    assert len(results) == len(kernels) + 2 * len(split) // 3 + 1
    for r in results:
        assert r.status == "PASS", (r.kernel.label, r.backend, r.note)
        assert 0 <= r.error <= r.kernel.tolerance


def test_kernel_timings_take_the_step_graph_on_the_cpu_and_opencl(plan, opencl_device):
    phases = {b: {k.phase for k in time_kernels(plan, b, {}, context=16, rounds=1)} for b in ("cpu", "opencl")}
    assert phases == {"cpu": {"prefill", "decode", "step"}, "opencl": {"prefill", "decode", "step", "verify"}}
