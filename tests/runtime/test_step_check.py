"""llmrs-check on a plan with a step graph: every kernel of it (RoPE at positions, KV store at
slots, paged attention, the gather and the head on the logit rows) alone on the CPU against the
interpreter, with step inputs as the runtime gives them; OpenCL, whose code has no step graph
yet, skips those and runs the rest."""
from __future__ import annotations

from llmrs.compiler.cli import main as compile_main
from llmrs.measure import kernels as kernel_checks
from llmrs.runtime.plan import Plan

from ..conftest import DATA


def test_every_step_kernel_passes_on_the_cpu_and_opencl_skips_them(tmp_path):
    out = tmp_path / "golden-b.plan.bin"
    assert compile_main([str(DATA / "golden-b"), "-o", str(out), "--max-seq-len", "48", "--prefill-chunk", "12",
                         "--weights", "q4_0", "--kv-type", "f16", "--block-size", "4", "--max-num-seqs", "3",
                         "-q"]) == 0
    plan = Plan.open(out)
    kernels = kernel_checks.plan_kernels(plan.graphs())
    step = [k for k in kernels if k.phase == "step"]
    assert {"rope", "kv_store", "attention", "gather", "fused_matmul"} <= {k.op.kind for k in step}
    results = kernel_checks.check_kernels(kernels, kernel_checks.open_runners(plan, kernel_checks.BACKENDS))
    cpu = [r for r in results if r.backend == "cpu"]
    assert len(cpu) == len(kernels)
    for r in cpu:
        assert r.status == "PASS", (r.kernel.phase, r.kernel.label, r.note)
        assert 0 <= r.error <= r.kernel.tolerance
    for r in results:
        if r.backend == "opencl" and r.kernel.phase == "step":
            assert r.status == "SKIP" and r.note, r.kernel.label
