"""llmrs-check: every kernel of a plan alone on each back end against the interpreter."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.measure import check
from llmrs.measure import kernels as kernel_checks
from llmrs.runtime.plan import Plan

from ..conftest import DATA, unavailable


def _compile(tmp: Path, model: str, *flags: str) -> Path:
    """Without a step graph: tests/runtime/test_step_check.py checks one."""
    out = tmp / f"{model}{''.join(flags).replace('-', '_')}.bin"
    assert compile_main([str(DATA / model), "-o", str(out), "--max-seq-len", "48", "--prefill-chunk", "12",
                         "--max-num-seqs", "0", "-q", *flags]) == 0
    return out


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """golden-a and golden-b with both targets and the same formats, so the two share their OpenCL
    builds (each ~2 s on PoCL with a cold cache); a CPU-only plan with other formats."""
    tmp = tmp_path_factory.mktemp("check")
    return {
        "a": _compile(tmp, "golden-a", "--target", "cpu,opencl", "--weights", "q4_0", "--kv-type", "f16"),
        "b": _compile(tmp, "golden-b", "--target", "cpu,opencl", "--weights", "q4_0", "--kv-type", "f16"),
        "cpu-only": _compile(tmp, "golden-a", "--target", "cpu", "--weights", "q8_0", "--kv-type", "f32"),
        "q4_1": _compile(tmp, "golden-b", "--target", "cpu", "--weights", "q4_1", "--kv-type", "f16"),
    }


def _runners(plan: Plan) -> dict:
    runners = kernel_checks.open_runners(plan, kernel_checks.BACKENDS)
    if isinstance(runners["opencl"], kernel_checks.Unavailable):
        unavailable(f"no usable OpenCL device: {runners['opencl']}")
    return runners


@pytest.mark.parametrize("model", ["a", "b"])
def test_every_kernel_of_golden_plans_matches_interpreter_on_cpu_and_opencl(plans, model):
    plan = Plan.open(plans[model])
    kernels = kernel_checks.plan_kernels(plan.graphs())
    results = kernel_checks.check_kernels(kernels, _runners(plan))
    assert len(results) == 2 * len(kernels)
    for r in results:
        assert r.status == "PASS", (r.kernel.label, r.backend, r.note)
        assert 0 <= r.error <= r.kernel.tolerance
    # the check runs real work: fused matmuls do not come out bit-exact on both back ends
    assert any(r.error > 0 for r in results if r.kernel.op.kind == "fused_matmul")


def test_every_kernel_of_a_q4_1_opencl_plan_matches_interpreter(tmp_path):
    """Q4_1 weights (Q8_1 activations) on the OpenCL column; a plan without CPU code skips that one."""
    plan = Plan.open(_compile(tmp_path, "golden-b", "--target", "opencl", "--weights", "q4_1", "--kv-type", "f16"))
    kernels = kernel_checks.plan_kernels(plan.graphs())
    assert {k.graph.values[k.op.inputs[0]].dtype for k in kernels if k.op.kind == "embedding"} == {"q4_1"}
    matmuls = [k for k in kernels if k.op.kind == "fused_matmul"]
    assert {k.graph.values[k.op.inputs[1]].dtype for k in matmuls} == {"q4_1"}
    assert {k.phase for k in matmuls} == {"prefill", "decode"}
    results = kernel_checks.check_kernels(kernels, _runners(plan))
    for r in results:
        if r.backend == "cpu":
            assert r.status == "SKIP" and "no CPU code" in r.note
        else:
            assert r.status == "PASS", (r.kernel.label, r.note)
            assert 0 <= r.error <= r.kernel.tolerance
    assert all(r.kernel.tolerance == kernel_checks.TOL_QUANT for r in results if r.kernel in matmuls)


def test_f16_prefill_matmuls_pass_on_the_tensor_core_body(tmp_path, monkeypatch):
    """f16 weights: the tensor-core body (emulated off NVIDIA) multiplies x rounded to f16, so
    prefill matmuls get TOL_F16_MMA (a 1e-4 check failed them at ~3e-4 on SmolLM2's shapes);
    decode's matvecs keep f32 x and TOL_FLOAT."""
    monkeypatch.setenv("LLMRS_OPENCL_EMULATE_MMA", "1")
    plan = Plan.open(_compile(tmp_path, "golden-b", "--target", "opencl", "--weights", "f16", "--kv-type", "f16"))
    kernels = kernel_checks.plan_kernels(plan.graphs())
    matmuls = [k for k in kernels if k.op.kind == "fused_matmul"]
    assert {k.graph.values[k.op.inputs[1]].dtype for k in matmuls} == {"f16"}
    for k in matmuls:
        writes_f16 = k.op.attrs.get("epilogue") == "rope_kv_store"   # the f16 KV cache
        want = kernel_checks.TOL_F16_MMA if k.phase == "prefill" else kernel_checks.TOL_F16_OUT if writes_f16 else kernel_checks.TOL_FLOAT
        assert k.tolerance == max(want, kernel_checks.TOL_F16_OUT if writes_f16 else 0.0), k.label
    results = kernel_checks.check_kernels(kernels, _runners(plan))
    for r in results:
        if r.backend == "opencl":
            assert r.status == "PASS", (r.kernel.label, r.note)
    # x in f16 shows: a prefill matmul's error is over the f32 bound, within the f16 one
    assert any(r.error > kernel_checks.TOL_FLOAT for r in results
               if r.backend == "opencl" and r.kernel in matmuls and r.kernel.phase == "prefill")


def test_every_kernel_of_a_q4_1_plan_passes_on_the_cpu_column(plans, capsys):
    """golden-b in q4_1 (embedding and head too): K = 96 and 160 end in partial groups of blocks."""
    plan = Plan.open(plans["q4_1"])
    kernels = kernel_checks.plan_kernels(plan.graphs())
    q4_1 = [k for k in kernels if k.op.kind in ("matmul", "fused_matmul", "embedding")]
    assert q4_1 and all(k.graph.values[k.op.inputs[1 if k.op.kind != "embedding" else 0]].dtype == "q4_1"
                        for k in q4_1)
    results = kernel_checks.check_kernels(kernels, kernel_checks.open_runners(plan, ["cpu"]))
    for r in results:
        assert r.status == "PASS", (r.kernel.label, r.note)
    assert all(r.kernel.tolerance == kernel_checks.TOL_QUANT for r in results if r.kernel.op.kind in ("matmul", "fused_matmul"))
    assert any(r.error > 0 for r in results if "q4_1" in r.kernel.label)
    assert check.main([str(plans["q4_1"]), "--backend", "cpu", "-q"]) == 0
    assert "q4_1[" in capsys.readouterr().out


def test_kernels_are_deduplicated_across_layers_and_cover_every_op(plans):
    graphs = Plan.open(plans["a"]).graphs()
    kernels = kernel_checks.plan_kernels(graphs)
    for phase, g in graphs.items():
        assert sum(k.ops for k in kernels if k.phase == phase) == len(g.ops)
    # golden-a has 2 layers: each per-layer kernel stands for 2 ops and is checked once
    per_layer = [k for k in kernels if k.op.kind == "attention" or k.op.attrs.get("epilogue") == "rope_kv_store"]
    assert [k.ops for k in per_layer] == [2, 2, 2, 2]
    tol = {k.label: k.tolerance for k in kernels}
    # reads f16, writes f32 (and its eviction scores, f32[KVH, S], as its control i32[2] says);
    # prefill's may run on NVIDIA's tensor cores, with Q and P rounded to f16
    assert tol["attention f32[12,64] f16[48,2,16] f16[48,2,16] f32[2,48] i32[2]"] == kernel_checks.TOL_F16_ATT
    assert tol["attention f32[1,64] f16[48,2,16] f16[48,2,16] f32[2,48] i32[2]"] == kernel_checks.TOL_FLOAT
    assert tol["fused_matmul(add) f32[1,64] q4_0[64,64] f32[1,64]"] == kernel_checks.TOL_QUANT
    assert tol["slice f32[12,64]"] == kernel_checks.TOL_FLOAT


def test_cases_use_history_partial_steps_and_nonzero_inputs(plans):
    kernels = kernel_checks.plan_kernels(Plan.open(plans["a"]).graphs())
    att = next(k for k in kernels if k.op.kind == "attention" and k.phase == "prefill")
    case = kernel_checks.make_case(att, np.random.default_rng(0))
    assert case.step.n_past > 0 and case.step.n_tokens == att.graph.T - 1
    assert case.step.start_pos != case.step.n_past
    for name, arr in case.arrays.items():
        assert np.all(kernel_checks.to_float(arr, kernel_checks._storage_dtype(att.graph, name)) != 0), name


def test_error_is_max_abs_diff_over_max_ref_and_tolerance_decides(plans, monkeypatch, capsys):
    """A back end whose attention output is off by 0.5x or 3x the tolerance: the table reports
    that error and PASS / FAIL, names the kernel, and the exit status follows."""
    real_run = kernel_checks.CpuRunner.run
    for factor, want_rc in ((0.5, 0), (3.0, 1)):

        def nudged(self, kernel, case, factor=factor):
            out = real_run(self, kernel, case)
            if kernel.op.kind == "attention" and kernel.phase == "decode":
                name = kernel.op.outputs[0]
                ref = kernel_checks.reference(kernel, case)[name]
                out[name] = out[name].copy()
                out[name].flat[3] += factor * kernel.tolerance * np.abs(ref).max()
            return out

        monkeypatch.setattr(kernel_checks.CpuRunner, "run", nudged)
        assert check.main([str(plans["a"]), "--backend", "cpu", "-q"]) == want_rc
        rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("attention f32[1,64]")]
        assert len(rows) == 1
        err, tol = map(float, rows[0].split()[-3:-1])
        assert tol == kernel_checks.TOL_FLOAT
        assert err == pytest.approx(factor * tol, rel=0.05)
        assert rows[0].endswith("PASS" if want_rc == 0 else "FAIL")
        assert "decode" in rows[0] and "attention_2" in rows[0]


def test_broken_opencl_kernel_fails_with_exit_1_and_names_it(plans, monkeypatch, capsys):
    _runners(Plan.open(plans["b"]))
    real_run = kernel_checks.OpenCLRunner.run

    def broken(self, kernel, case):
        out = real_run(self, kernel, case)
        if kernel.op.attrs.get("epilogue") == "silu_mul" and kernel.phase == "prefill":
            out[kernel.op.outputs[0]] = out[kernel.op.outputs[0]] * 1.01   # 1% off everywhere
        return out

    monkeypatch.setattr(kernel_checks.OpenCLRunner, "run", broken)
    assert check.main([str(plans["b"]), "-q"]) == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.rstrip().endswith("FAIL")]
    assert len(failed) == 1
    assert failed[0].startswith("fused_matmul(rms_norm+silu_mul) f32[12,96] q4_0[320,96]")
    assert "prefill" in failed[0] and "opencl" in failed[0] and "fused_matmul_4" in failed[0]
    assert float(failed[0].split()[-3]) == pytest.approx(0.01, rel=1e-3)
    assert "1 failed" in out


def test_kernel_that_writes_nothing_or_raises_fails_without_hiding_the_others(plans, monkeypatch, capsys):
    real_run = kernel_checks.CpuRunner.run

    def bad(self, kernel, case):
        if kernel.op.kind == "embedding":
            raise RuntimeError("simulated launch failure")
        out = real_run(self, kernel, case)
        if kernel.op.kind == "slice":
            out[kernel.op.outputs[0]] = np.full_like(out[kernel.op.outputs[0]], np.nan)
        return out

    monkeypatch.setattr(kernel_checks.CpuRunner, "run", bad)
    assert check.main([str(plans["a"]), "--backend", "cpu", "-q"]) == 1
    lines = capsys.readouterr().out.splitlines()
    fails = [line for line in lines if "FAIL" in line]
    assert len(fails) == 3   # the embedding of both phases, the prefill's last-row slice
    assert all("RuntimeError: simulated launch failure" in line for line in fails if line.startswith("embedding"))
    assert any(line.startswith("slice") and " inf " in line for line in fails)
    assert sum(line.rstrip().endswith("PASS") for line in lines) == len(lines) - 3 - 3  # header, footnote, summary


def test_backend_missing_from_plan_is_skipped_not_failed(plans, capsys):
    assert check.main([str(plans["cpu-only"]), "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    skipped = [line for line in lines if "SKIP" in line]
    assert skipped and all(" opencl " in line and "without --target opencl" in line for line in skipped)
    assert sum(line.rstrip().endswith("PASS") for line in lines) == len(skipped)


@pytest.mark.parametrize("make,message", [
    (lambda p, t: t.write_bytes(p.read_bytes()[:4000]), "truncated"),
    (lambda p, t: t.write_bytes(b"not a plan at all"), "not an llmrs plan"),
    (lambda p, t: None, "cannot read the plan"),
])
def test_bad_plan_is_exit_2_with_one_line(plans, tmp_path, capsys, make, message):
    bad = tmp_path / "bad.bin"
    make(plans["a"], bad)
    assert check.main([str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err and str(bad) in captured.err


def test_bad_arguments_are_exit_2_and_help_states_tolerances(plans, capsys):
    assert check.main([str(plans["a"]), "--backend", "gpu"]) == 2
    assert "--backend 'gpu'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        check.main([str(plans["a"]), "--no-such-flag"])
    assert e.value.code == 2
    help_text = subprocess.run(["llmrs-check", "--help"], capture_output=True, text=True, check=True).stdout
    for tol in (kernel_checks.TOL_FLOAT, kernel_checks.TOL_QUANT, kernel_checks.TOL_F16_OUT, kernel_checks.TOL_Q8_OUT, kernel_checks.TOL_F16_ATT,
                kernel_checks.TOL_F16_MMA):
        assert f"{tol:.0e}" in help_text
