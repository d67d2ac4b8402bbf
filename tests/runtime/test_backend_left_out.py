"""A shape one back end cannot serve: the compiler leaves that back end out with a one-line notice
and compiles the others; the runtime names the reason when asked to run there.

head_dim 34 is outside what OpenCL's attention kernels take (they read K/V rows as float4, so
head_dim must be a multiple of 4), while the CPU kernels end any row in narrower vectors."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.compiler.interpret import Interpreter
from llmrs.models.tiny import make_model
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.cli import main as run_main
from llmrs.runtime.inspect import main as inspect_main
from llmrs.runtime.plan import Plan

from ..conftest import rel_err

PROMPT = np.array([5, 77, 130, 9, 250, 31], np.int32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hd34") / "model", "tiny", num_hidden_layers=1, vocab_size=320,
                      hidden_size=64, intermediate_size=96, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=34)


def _compile(model, out, capfd, *flags) -> tuple[int, list[str]]:
    capfd.readouterr()
    rc = compile_main([str(model), "-o", str(out), "--weights", "f32", "--kv-type", "f32", "--prefill-chunk", "4",
                       "--max-seq-len", "16", "-q", *flags])
    return rc, capfd.readouterr().err.splitlines()


def test_compile_leaves_opencl_out_with_one_notice_and_the_cpu_plan_matches_the_interpreter(model, tmp_path, capfd):
    rc, err = _compile(model, tmp_path / "plan.bin", capfd)
    assert rc == 0
    assert len(err) == 1
    assert err[0].startswith("llmrs-compile: notice: no OpenCL code: op attention_")
    assert "head_dim 34" in err[0] and err[0].endswith("; the plan runs on cpu")
    plan = Plan.open(tmp_path / "plan.bin")
    opts = plan.manifest["compile_options"]
    assert opts["targets"] == ["cpu"] and "head_dim 34" in opts["left_out"]["opencl"]
    assert "opencl" not in plan.sections
    assert inspect_main([str(tmp_path / "plan.bin")]) == 0
    assert f"  no OpenCL code: {opts['left_out']['opencl']}; the plan runs on cpu\n" in capfd.readouterr().out

    graphs = plan.graphs()
    pre, dec = Interpreter(graphs["prefill"]), Interpreter(graphs["decode"])
    state = pre.new_state()
    be = CpuBackend(plan, threads=2)
    for s in (0, 4):
        chunk = PROMPT[s:s + 4]
        assert rel_err(be.run("prefill", chunk, s, s), pre.run({"tokens": chunk}, state, s)["logits"]) <= 1e-4
    for i, tok in enumerate((3, 200, 41)):
        pos = len(PROMPT) + i
        want = dec.run({"tokens": np.array([tok])}, state, pos)["logits"]
        assert rel_err(be.run("decode", np.array([tok]), pos, pos), want) <= 1e-4


def test_running_the_left_out_backend_is_a_one_line_error_naming_the_reason(model, tmp_path, capfd):
    assert _compile(model, tmp_path / "plan.bin", capfd)[0] == 0
    rc = run_main([str(tmp_path / "plan.bin"), "--prompt", "Hi", "-n", "2", "--backend", "opencl"])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1
    assert err[0].startswith(f"llmrs-run: error: {tmp_path / 'plan.bin'}: no OpenCL code: op attention_")
    assert "head_dim 34" in err[0] and err[0].endswith("; the plan runs on cpu")
    assert run_main([str(tmp_path / "plan.bin"), "--prompt", "Hi", "-n", "2", "--backend", "cpu"]) == 0


def test_asking_only_for_the_backend_that_cannot_serve_is_an_error(model, tmp_path, capfd):
    rc, err = _compile(model, tmp_path / "plan.bin", capfd, "--target", "opencl")
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("llmrs-compile: error: op attention_") and "head_dim 34" in err[0]
    assert not (tmp_path / "plan.bin").exists()
