"""OpenCL beside llvmlite in one process: a PoCL that cannot build here, or that aborts a process
holding llvmlite's LLVM, is refused with the fix, never a crash (runtime/backends/opencl_probe.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from llmrs.runtime.backends import opencl_probe


def _fake_pocl(name: str = "pthread-test") -> SimpleNamespace:
    platform = SimpleNamespace(name="Portable Computing Language", version="OpenCL 3.0 PoCL test")
    return SimpleNamespace(platform=platform, name=name, driver_version="0")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(opencl_probe, "_verdicts", {})
    return tmp_path


def _child_result(rc: int, stdout: str = "", stderr: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], rc, stdout, stderr)


def test_a_probe_that_aborts_refuses_the_device_and_the_verdict_is_cached(fresh_cache, monkeypatch):
    calls = []

    def aborting_child(platform, device):
        calls.append((platform, device))
        return _child_result(-6, stderr="still have references to IRs - can't release LLVM context !\n")

    monkeypatch.setattr(opencl_probe, "_run_child", aborting_child)
    why = opencl_probe.why_unusable(_fake_pocl())
    assert why == "a process using it dies with signal 6 (still have references to IRs - can't release LLVM context !)"
    monkeypatch.setattr(opencl_probe, "_verdicts", {})     # a new process reads the file
    assert opencl_probe.why_unusable(_fake_pocl()) == why
    assert calls == [("Portable Computing Language", "pthread-test")]
    assert (fresh_cache / "opencl" / "probe.json").exists()


def test_a_probe_that_builds_and_exits_cleanly_clears_the_device(fresh_cache, monkeypatch):
    monkeypatch.setattr(opencl_probe, "_run_child", lambda p, d: _child_result(0, stdout="probe ok\n"))
    assert opencl_probe.why_unusable(_fake_pocl()) == ""
    monkeypatch.setattr(opencl_probe, "_run_child", lambda p, d: _child_result(3, stderr="build failed: x\n"))
    assert opencl_probe.why_unusable(_fake_pocl("pthread-other")) == "its compiler cannot build kernels for this CPU"


def test_devices_other_than_pocl_are_not_probed(fresh_cache, monkeypatch):
    monkeypatch.setattr(opencl_probe, "_run_child", lambda p, d: pytest.fail("probed a GPU driver"))
    gpu = SimpleNamespace(platform=SimpleNamespace(name="NVIDIA CUDA", version="OpenCL 3.0 CUDA"),
                          name="NVIDIA H200", driver_version="580")
    assert opencl_probe.why_unusable(gpu) == ""


def test_a_cpu_and_opencl_process_under_pips_pocl_alone_exits_cleanly(measure_plan, tmp_path):
    """hybrid holds the CPU back end's llvmlite JIT and OpenCL in one process. With only pip's PoCL
    visible it either runs (rc 0, text out) or refuses in one line naming the fix (rc 2), on every
    CPU: never rc 134 (abort) or a signal."""
    pytest.importorskip("pyopencl")
    run = shutil.which("llmrs-run")
    assert run, "llmrs-run is not on PATH (pip install -e .)"
    empty = tmp_path / "icd"
    empty.mkdir()
    env = dict(os.environ, OCL_ICD_VENDORS=str(empty), LLMRS_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("LLMRS_OPENCL_DEVICE", None)
    done = subprocess.run([run, str(measure_plan), "--backend", "hybrid", "--prompt", "Hi", "-n", "4"],
                          capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode in (0, 2), (done.returncode, done.stderr[-2000:])
    if done.returncode == 0:
        assert done.stdout.strip(), "ran but printed no text"
    else:
        errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
        assert len(errors) == 1 and "apt-get install pocl-opencl-icd" in errors[0], done.stderr
        assert "Traceback" not in done.stderr


def test_the_child_probe_runs_on_a_working_pocl(fresh_cache, opencl_device):
    """The real child, on the device the OpenCL tests use where that is PoCL (Debian's in CI)."""
    if not opencl_probe.is_pocl(opencl_device):
        pytest.skip("the OpenCL device here is not PoCL: nothing to probe")
    done = opencl_probe._run_child(opencl_device.platform.name, opencl_device.name)
    assert done.returncode == 0 and "probe ok" in done.stdout, done.stderr[-2000:]


def test_a_build_that_loses_its_kernels_is_a_one_line_error_naming_the_fix(fresh_cache, monkeypatch, opencl_device):
    """pip's PoCL 3.0 on a Zen 4 builds a program without its kernels now and then; build_program
    says so and how to fix it, instead of an INVALID_KERNEL_NAME at the first launch."""
    import pyopencl as cl

    from llmrs.runtime.backends import opencl_program
    from llmrs.runtime.backends.opencl_device import OpenCLError

    class NoKernels:
        def get_info(self, what):
            return 0

    monkeypatch.setattr(opencl_program, "_build", lambda prg, **kw: NoKernels())
    ctx = cl.Context([opencl_device])
    with pytest.raises(OpenCLError, match=r"gave a program without its kernels; .*pocl-opencl-icd"):
        opencl_program.build_program(ctx, opencl_device, "__kernel void k(__global int* x) { x[0] = 1; }",
                                     ["-w"], "a test program")
