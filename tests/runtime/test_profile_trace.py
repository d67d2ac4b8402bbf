"""llmrs-run --profile: a valid Chrome trace, one slice per kernel per step under its phase."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llmrs.runtime import cli
from llmrs.runtime.plan import Plan
from llmrs.measure.profile import op_layer


PROMPT = "one two three four five six"   # 19 tokens: two 12-token prefill chunks
N_NEW = 4


@pytest.fixture
def plan(measure_plan) -> Path:
    return measure_plan


def _run(plan: Path, tmp: Path, backend: str, profile: bool) -> tuple[dict | None, dict]:
    trace, logits = tmp / f"{backend}{profile}.json", tmp / f"{backend}{profile}.npz"
    argv = [str(plan), "--prompt", PROMPT, "--raw", "-n", str(N_NEW), "--backend", backend, "--threads", "2",
            "--dump-logits", str(logits)]
    assert cli.main(argv + (["--profile", str(trace)] if profile else [])) == 0
    return (json.loads(trace.read_text()) if profile else None), dict(np.load(logits))


def _check_trace(trace: dict, expected: dict[str, list[str]], n_steps: int) -> None:
    """Steps are phase slices; each step's kernel slices lie inside it, one per entry of the
    phase's kernel table, in its order."""
    events = trace["traceEvents"]
    assert all(e["ph"] in ("X", "M") for e in events)
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == n_steps and [s["args"]["step"] for s in steps] == list(range(n_steps))
    assert steps[0]["name"] == "prefill" and steps[-1]["name"] == "decode"
    for s in steps:
        kernels = [e for e in events if e.get("cat") == "kernel" and e["args"]["step"] == s["args"]["step"]]
        assert [k["args"]["op"] for k in kernels] == expected[s["name"]]
        for k in kernels:
            assert k["args"]["phase"] == s["name"] and k["dur"] >= 0
            assert s["ts"] <= k["ts"] and k["ts"] + k["dur"] <= s["ts"] + s["dur"] + 1e-3
            if "layer" in k["args"]:
                assert k["name"].endswith(f" L{k['args']['layer']}")
        starts = [k["ts"] for k in kernels]
        assert starts == sorted(starts)


@pytest.fixture(scope="module")
def cpu_runs(measure_plan, tmp_path_factory) -> tuple[dict, dict, dict]:
    """(trace, logits with --profile, logits without) of one CPU run each."""
    tmp = tmp_path_factory.mktemp("cpu_runs")
    trace, logits = _run(measure_plan, tmp, "cpu", True)
    return trace, logits, _run(measure_plan, tmp, "cpu", False)[1]


def test_cpu_profile_has_a_slice_per_op_per_step_and_same_output(plan, cpu_runs):
    trace, logits, plain = cpu_runs
    graphs = Plan.open(plan).graphs()
    # the CPU step runs every op of the graph as a kernel (slices too), one barrier after each
    expected = {p: [op.name for op in g.ops] for p, g in graphs.items()}
    prompt_len = len(plain["tokens"]) - N_NEW
    n_chunks = -(-prompt_len // graphs["prefill"].T)
    assert n_chunks == 2
    _check_trace(trace, expected, n_chunks + N_NEW - 1)
    layers = {op_layer(op) for op in graphs["decode"].ops} - {None}
    assert layers == {0, 1}
    # the instrumented code computes the same thing
    np.testing.assert_array_equal(logits["tokens"], plain["tokens"])
    np.testing.assert_allclose(logits["logits"], plain["logits"], rtol=0, atol=1e-4 * np.abs(plain["logits"]).max())
    assert trace["otherData"]["backend"] == "cpu"


def test_opencl_profile_has_a_slice_per_launch_per_step(plan, tmp_path, opencl_device):
    argv_trace = tmp_path / "cl.json"
    assert cli.main([str(plan), "--prompt", PROMPT, "--raw", "-n", str(N_NEW), "--backend", "opencl",
                     "--profile", str(argv_trace)]) == 0
    trace = json.loads(argv_trace.read_text())
    p = Plan.open(plan)
    program = json.loads(bytes(p.section("opencl")).decode())
    # greedy: every step ends with the device argmax; no eviction, so no score launches
    expected = {ph: [e["op"] for e in table if not e.get("scores")] + [program["greedy"][ph]["op"]]
                for ph, table in program["graphs"].items()}
    n_chunks = 2
    _check_trace(trace, expected, n_chunks + N_NEW - 1)
    assert trace["otherData"]["backend"] == "opencl"


def test_profile_refuses_the_reference_backend_and_chat(plan, tmp_path, capsys):
    assert cli.main([str(plan), "--prompt", "hi", "--backend", "reference", "--profile", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmrs-run: error:") and "cpu or opencl" in err and "\n" not in err
    with pytest.raises(SystemExit) as e:
        cli.main([str(plan), "--chat", "--profile", str(tmp_path / "t.json")])
    assert e.value.code == 2


def test_plot_bench_breaks_a_trace_down_by_kernel(plan, cpu_runs, tmp_path):
    """tools/plot_bench.py's profile figure: per phase, each kernel title's time per step, the
    kernels per step adding up to the graph's ops, and the ms to the trace's slices."""
    pytest.importorskip("matplotlib", reason="pip install 'llmrs[plot]'")
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_bench", Path(__file__).parents[2] / "tools" / "plot_bench.py")
    plot_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_bench)
    trace = cpu_runs[0]
    graphs = Plan.open(plan).graphs()
    out = tmp_path / "profile.png"
    data = plot_bench.plot_trace(trace, out)
    assert out.read_bytes()[:4] == b"\x89PNG"
    steps = {"prefill": 2, "decode": N_NEW - 1}
    for phase, rows in data.items():
        assert sum(n for _, _, n in rows) == len(graphs[phase].ops)
        want = sum(e["dur"] for e in trace["traceEvents"] if e.get("cat") == "kernel" and e["args"]["phase"] == phase)
        assert sum(ms for _, ms, _ in rows) == pytest.approx(want / 1e3 / steps[phase])
    assert plot_bench.trace_table(trace).count("\n") == 1 + sum(len(r) for r in data.values())
