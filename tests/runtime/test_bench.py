"""llmrs-bench: the JSON's schema and sane values on a tiny plan, per back end; bad input."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler.interpret import Step
from llmrs.measure import bench
from llmrs.measure import kernels as kernel_checks
from llmrs.measure.bench_kernels import kernel_cost
from llmrs.runtime.plan import Plan

from .measure_plans import tiny_plan

FAST = ["--prefill", "4,10", "--decode", "5", "--repeats", "1", "--read-mib", "8", "--gemm", "64"]


@pytest.fixture
def plan(measure_plan) -> Path:
    return measure_plan


def _run(plan: Path, tmp: Path, *flags: str) -> dict:
    out = tmp / "bench.json"
    assert bench.main([str(plan), *FAST, "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def _check_result(r: dict, plan: Path, backend: str) -> None:
    p = Plan.open(plan)
    graphs = p.graphs()
    assert r["schema"] == bench.SCHEMA and r["backend"] == backend and r["repeats"] == 1
    c = r["ceilings"]
    assert c["read_gbs"] > 0 and c["gemm_gflops"] > 0
    assert [x["tokens"] for x in r["prefill"]] == [4, 10]
    for x in r["prefill"]:
        assert x["tok_s"] > 0 and x["ttft_ms"] > 0 and len(x["samples_tok_s"]) == 1
        # time to the first token holds the whole prefill: never less than tokens / tok/s
        assert x["ttft_ms"] >= 1e3 * x["tokens"] / x["tok_s"] * 0.99
    d = r["decode"]
    assert d["tokens"] == 5 and d["empty"]["context"] == 1 and d["deep"]["context"] == 10
    for key in ("empty", "deep"):
        assert d[key]["tok_s"] > 0
        assert d[key]["ms_per_token"] == pytest.approx(1e3 / d[key]["tok_s"], rel=1e-2, abs=1e-4)
    wbytes = r["model"]["weight_bytes_per_token"]
    assert wbytes > 0 and r["model"]["decode_kernels"] == graphs["decode"].kernel_count()
    bw = c["device_copy_gbps"] if backend == "opencl" else c["read_gbs"]
    assert r["decode_of_bandwidth"] == pytest.approx(wbytes * d["deep"]["tok_s"] / 1e9 / bw, rel=2e-2)
    params = r["model"]["matmul_params"]
    assert r["prefill_gops"] == pytest.approx(2 * params * r["prefill"][-1]["tok_s"] / 1e9, rel=2e-2)
    assert 2**20 < r["peak_memory_bytes"] < 2**34


def test_bench_cpu_json_schema_and_kernels(plan, tmp_path):
    r = _run(plan, tmp_path, "--backend", "cpu", "--threads", "1", "--kernels")
    _check_result(r, plan, "cpu")
    assert r["device"] is None and r["threads"] == 1 and "weights_read_gbs" not in r["ceilings"]  # < 16 MiB of weights
    kernels = kernel_checks.plan_kernels(Plan.open(plan).graphs())
    rows = r["kernels"]
    assert [(k["phase"], k["op"]) for k in rows] == [(k.phase, k.op.name) for k in kernels]
    for k in rows:
        assert k["us"] > 0 and k["bytes"] > 0 and k["flops"] > 0
        assert k["gbs"] == pytest.approx(k["bytes"] / k["us"] / 1e3, rel=2e-2, abs=0.01)
        assert k["of_gemm"] == pytest.approx(k["gflops"] / r["ceilings"]["gemm_gflops"], rel=2e-2, abs=1e-3)
        assert k["tokens"] == (1 if k["phase"] == "decode" else 12)


def test_bench_opencl_json_schema(plan, tmp_path, opencl_device):
    r = _run(plan, tmp_path, "--backend", "opencl", "--kernels")
    _check_result(r, plan, "opencl")
    assert r["device"] and r["ceilings"]["device_copy_gbps"] > 0 and r["ceilings"]["launch_us"] > 0
    assert len(r["kernels"]) == len(kernel_checks.plan_kernels(Plan.open(plan).graphs()))
    assert all(k["us"] > 0 and k["of_gemm"] is None for k in r["kernels"])


def test_kernel_cost_counts_matmul_and_attention_work(plan):
    """Against counts made here from the shapes: 2 N K per row for a matmul, 4 x (heads x
    head_dim) per visible (query, key) pair for attention, a cache's used slots only."""
    g = Plan.open(plan).graphs()["prefill"]
    mm = next(op for op in g.ops if op.kind == "fused_matmul" and op.attrs.get("epilogue") == "add")
    w = g.values[mm.inputs[1]]
    nbytes, flops = kernel_cost(g, mm, Step(12, 0, 0))
    assert flops == 2 * 12 * w.shape[0] * w.shape[1]
    acts = sum(g.values[n].nbytes for n in mm.inputs + mm.outputs if g.values[n].kind not in ("param", "const"))
    assert nbytes == w.nbytes + acts
    att = next(op for op in g.ops if op.kind == "attention")
    q, k = g.values[att.inputs[0]], g.values[att.inputs[1]]
    _, flops = kernel_cost(g, att, Step(3, 5, 5))
    assert flops == 4 * int(np.prod(q.shape[1:])) * (6 + 7 + 8)
    nbytes, _ = kernel_cost(g, att, Step(1, 7, 7))
    per_slot = k.nbytes // k.shape[0]
    assert nbytes == 2 * 8 * per_slot + (q.nbytes + g.values[att.outputs[0]].nbytes) // g.T


def _one_line_error(capsys, argv: list[str], *words: str) -> None:
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmrs-bench: error:") and "\n" not in err and "Traceback" not in err
    for w in words:
        assert w in err


def test_bad_input_is_one_line_exit_2(plan, tmp_path, capsys):
    _one_line_error(capsys, [str(tmp_path / "none.bin")], "no such file")
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _one_line_error(capsys, [str(foreign)])
    cpu_only = tiny_plan(tmp_path, "--target", "cpu")
    _one_line_error(capsys, [str(cpu_only), "--backend", "opencl", *FAST], "opencl")
    _one_line_error(capsys, [str(plan), "--prefill", "40", "--decode", "20"], "--max-seq-len 60")
    _one_line_error(capsys, [str(plan), "--prefill", "a,b"], "--prefill")
    _one_line_error(capsys, [str(plan), "--llama-bench", "x"], "--gguf")
    with pytest.raises(SystemExit) as e:
        bench.main([str(plan), "--backend", "vulkan"])
    assert e.value.code == 2


def test_llama_bench_records_are_read_and_failures_are_one_line(tmp_path):
    """--llama-bench: llama-bench's JSON (one record per test) read as it prints it; a binary
    that fails or prints something else is a BenchError naming it."""
    records = [{"n_prompt": 10, "n_gen": 0, "avg_ts": 123.456, "samples_ts": [120.0, 126.9], "model_size": 4096,
                "build_commit": "abc123"},
               {"n_prompt": 0, "n_gen": 5, "avg_ts": 45.678, "samples_ts": [45.0, 46.356], "model_size": 4096}]
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(records)}'\necho \"$@\" > {tmp_path / 'argv'}\n")
    fake.chmod(0o755)
    got = bench.run_llama_bench(str(fake), "m.gguf", 2, 3, 10, 5)
    assert (tmp_path / "argv").read_text().split() == ["-m", "m.gguf", "-p", "10", "-n", "5", "-t", "2", "-r", "3",
                                                      "-o", "json"]
    assert got["prefill_tok_s"] == 123.46 and got["decode_tok_s"] == 45.68 and got["model_bytes"] == 4096
    assert got["prefill_samples"] == [120.0, 126.9] and got["build_commit"] == "abc123"
    warm = bench.run_llama_bench(str(fake), "m.gguf", 2, 1, 10, 5, dropped=1)   # the first repetition left out
    assert " -r 2 " in f" {(tmp_path / 'argv').read_text()} " and "first 1 repetition(s) dropped" in warm["command"]
    assert warm["prefill_samples"] == [126.9] and warm["prefill_tok_s"] == 126.9 and warm["decode_tok_s"] == 46.36
    fake.write_text("#!/bin/sh\necho 'error: no model' >&2\nexit 1\n")
    with pytest.raises(bench.BenchError, match="failed on --gguf m.gguf: error: no model"):
        bench.run_llama_bench(str(fake), "m.gguf", 2, 3, 10, 5)
    fake.write_text("#!/bin/sh\necho '[]'\n")
    with pytest.raises(bench.BenchError, match="no prefill and decode records"):
        bench.run_llama_bench(str(fake), "m.gguf", 2, 3, 10, 5)
    with pytest.raises(bench.BenchError, match="cannot run it"):
        bench.run_llama_bench(str(tmp_path / "absent"), "m.gguf", 2, 3, 10, 5)
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(records[1:])}'\necho \"$@\" > {tmp_path / 'argv'}\n")
    deep = bench.run_llama_bench(str(fake), "m.gguf", 2, 1, 0, 5, dropped=1, depth=4096)   # decode alone, at depth
    assert (tmp_path / "argv").read_text().split()[-2:] == ["-d", "4096"]
    assert deep["prefill_tok_s"] is None and deep["prefill_samples"] is None and deep["decode_samples"] == [46.36]
    assert deep["depth"] == 4096


def test_llama_bench_runs_once_after_each_repeat_and_ratios_are_the_repeats_medians(plan, tmp_path):
    """Each llmrs repeat is followed by one llama-bench run (-r 2, its cold first repetition
    dropped); its figures are the runs' medians and each ratio the median of the per-repeat
    ratios, pairs that ran back to back."""
    count = tmp_path / "count"
    fake = tmp_path / "llama-bench"
    # the n-th run reports 100 * n tok/s for both tests
    fake.write_text(f"""#!{sys.executable}
import json, pathlib, sys
count = pathlib.Path({str(count)!r})
n = len(count.read_text()) + 1 if count.exists() else 1
count.write_text("x" * n)
pathlib.Path({str(tmp_path / 'argv')!r}).write_text(" ".join(sys.argv[1:]))
print(json.dumps([{{"n_prompt": 10, "n_gen": 0, "avg_ts": 50 * n + 1, "samples_ts": [1, 100 * n]}},
                  {{"n_prompt": 0, "n_gen": 5, "avg_ts": 50 * n + 1, "samples_ts": [2, 100 * n]}}]))
""")
    fake.chmod(0o755)
    r = _run(plan, tmp_path, "--repeats", "3", "--llama-bench", str(fake), "--gguf", "m.gguf")
    assert count.read_text().count("x") == 3 and " -r 2 " in f" {(tmp_path / 'argv').read_text()} "
    lc = r["llama_cpp"]
    assert lc["decode_samples"] == [100, 200, 300] and lc["decode_tok_s"] == 200
    ours = r["decode"]["empty"]["samples_tok_s"]
    want = float(np.median([o / t for o, t in zip(ours, [100, 200, 300])]))
    assert r["llama_cpp_ratios"]["decode_empty"] == pytest.approx(want, abs=2e-3)
    pre = next(p for p in r["prefill"] if p["tokens"] == 10)["samples_tok_s"]
    assert r["llama_cpp_ratios"]["prefill"] == pytest.approx(
        float(np.median([o / t for o, t in zip(pre, [100, 200, 300])])), abs=2e-3)


def test_depth_decodes_after_that_context_and_runs_llama_bench_at_it(plan, tmp_path):
    """--depth N: the deep decode after N tokens of context, and llama-bench once more per repeat
    for its decode alone at -d N (-p 0); the ratio at depth pairs the two, repeat by repeat."""
    log = tmp_path / "argv"
    fake = tmp_path / "llama-bench"
    # prefill and decode at 100 tok/s from empty, decode at 40 tok/s at a depth
    fake.write_text(f"""#!{sys.executable}
import json, pathlib, sys
argv = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(" ".join(argv) + "\\n")
deep = "-d" in argv
recs = [] if deep else [{{"n_prompt": 10, "n_gen": 0, "avg_ts": 100, "samples_ts": [1, 100]}}]
recs.append({{"n_prompt": 0, "n_gen": 5, "avg_ts": 40 if deep else 100, "samples_ts": [2, 40 if deep else 100]}})
print(json.dumps(recs))
""")
    fake.chmod(0o755)
    r = _run(plan, tmp_path, "--repeats", "2", "--depth", "12", "--llama-bench", str(fake), "--gguf", "m.gguf")
    assert r["decode"]["deep"]["context"] == 12 and [x["tokens"] for x in r["prefill"]] == [4, 10]
    calls = log.read_text().splitlines()
    assert len(calls) == 4 and sum(" -d 12" in c and " -p 0 " in c for c in calls) == 2
    lc = r["llama_cpp"]
    assert lc["decode_tok_s"] == 100 and lc["prefill_tok_s"] == 100
    assert lc["deep"]["depth"] == 12 and lc["deep"]["decode_samples"] == [40, 40] and "-d 12" in lc["deep"]["command"]
    ours = r["decode"]["deep"]["samples_tok_s"]
    assert r["llama_cpp_ratios"]["decode_at_depth"] == pytest.approx(float(np.median([o / 40 for o in ours])), abs=2e-3)
    text = bench.report(r)
    assert "after 12 tokens: llmrs / llama.cpp" in text


def test_depth_beyond_the_cache_is_one_line(plan, tmp_path, capsys):
    _one_line_error(capsys, [str(plan), *FAST, "--depth", "100000"], "--depth 100000", "--max-seq-len")
    _one_line_error(capsys, [str(plan), *FAST, "--depth", "0"], "--depth")


def test_bench_speculative_json_per_prompt_type(tmp_path):
    """--speculative: a row per prompt type, greedy tokens equal with and without speculation."""
    from llmrs.compiler.cli import main as compile_main
    from ..conftest import DATA
    plan = tmp_path / "b.plan"
    assert compile_main([str(DATA / "golden-b"), "-o", str(plan), "--target", "cpu", "--weights", "q8_0",
                         "--max-seq-len", "1024", "-q"]) == 0
    out = tmp_path / "spec.json"
    assert bench.main([str(plan), "--speculative", "lookup", "--decode", "12", "--repeats", "1", "--threads", "2",
                       "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["schema"] == bench.SCHEMA + "/speculative" and r["speculative"] == "lookup" and r["llama_cpp"] is None
    assert [x["prompt"] for x in r["rows"]] == ["code", "quote", "list", "chat"]
    for x in r["rows"]:
        assert x["same_tokens"] and x["plain_tok_s"] > 0 and x["speculative_tok_s"] > 0 and x["speedup"] > 0
        assert 0 <= x["accepted"] <= x["drafted"] and x["prompt_tokens"] > 0


def test_llama_lookup_and_speculative_output_is_read(tmp_path):
    """llama-lookup / llama-speculative print their decode speed and draft counts as log lines."""
    from llmrs.measure.bench_speculative import run_llama_spec
    fake = tmp_path / "llama-speculative"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" > {tmp_path / 'argv'}\n"
                    "echo '0.02.554.649 I decoded   65 tokens in    1.782 seconds, speed:   36.474 t/s' >&2\n"
                    "echo '0.02.554.720 I n_drafted    = 24' >&2\necho '0.02.554.815 I n_accept     = 6' >&2\n")
    fake.chmod(0o755)
    got = run_llama_spec(str(fake), "t.gguf", "d.gguf", "the prompt", 2, 64, 8, 1, ngl=99)
    assert got["tok_s"] == 36.47 and got["drafted"] == 24 and got["accepted"] == 6 and got["acceptance_rate"] == 0.25
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:4] == ["-m", "t.gguf", "-md", "d.gguf"] and "-ngl" in argv and "-ngld" in argv
    assert "PROMPT" in got["command"] and "the prompt" not in got["command"]
    fake.write_text("#!/bin/sh\necho 'error: no model' >&2\nexit 1\n")
    with pytest.raises(ValueError, match="failed: error: no model"):
        run_llama_spec(str(fake), "t.gguf", None, "p", 2, 64, 8, 1)
