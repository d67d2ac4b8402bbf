"""Qwen3- and Qwen2-shaped models (built op by op in qwen_graphs.py, random weights) compiled end to
end (passes, CPU and OpenCL code, one plan file) and run on the CPU, OpenCL (PoCL here) and
reference back ends: the logits of the interpreter running the same compiled graphs, and its
greedy tokens. And llmrs-check on such a plan: every kernel, the new epilogues among them."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler.build import code_sections
from llmrs.compiler.interpret import Interpreter
from llmrs.compiler.pipeline import CompileOptions, run_passes
from llmrs.compiler.plan import write_graph_plan
from llmrs.measure import kernels as kernel_checks
from llmrs.runtime.backends import open_backend
from llmrs.runtime.plan import Plan

from ..conftest import rel_err, require_opencl
from .qwen_graphs import QWEN2, QWEN3, build_graphs

T, S = 8, 48                                     # prefill chunk, KV slots
PROMPT = np.array([5, 77, 12, 140, 3, 99, 31, 8, 64, 120, 17], np.int32)   # two chunks: 8 + 3
SHAPES = {"qwen3": QWEN3, "qwen2": QWEN2, "qwen3-bias-hd128": replace(QWEN3, bias=True, head_dim=128, heads=2,
                                                                     kv_heads=1, hidden=96)}


def _plan(tmp_path: Path, shape: str, weights: str, no_fuse: tuple[str, ...] = (),
          targets: tuple[str, ...] = ("cpu", "opencl")) -> Plan:
    opts = CompileOptions(weights=weights, kv_type="f32", prefill_chunk=T, max_seq_len=S, no_fuse=no_fuse)
    graphs = dict(zip(("prefill", "decode"), (run_passes(g, opts) for g in build_graphs(SHAPES[shape], T, S))))
    sections, left_out = code_sections(graphs, targets, ())
    assert not left_out
    path = tmp_path / f"{shape}-{weights}-{'-'.join(no_fuse) or 'fused'}.plan.bin"
    write_graph_plan(path, graphs, sections=sections)
    return Plan.open(path)


def _generate(step, prompt: np.ndarray, n_new: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill in chunks of T, then greedy decoding; step(phase, tokens, n_past) -> logits.
    (the last row of every chunk's and step's logits, the tokens drawn)"""
    rows, n = [], 0
    for s in range(0, len(prompt), T):
        chunk = prompt[s:s + T]
        rows.append(step("prefill", chunk, n)[-1])
        n += len(chunk)
    tokens = []
    for _ in range(n_new):
        tokens.append(int(np.argmax(rows[-1])))
        rows.append(step("decode", np.array(tokens[-1:], np.int32), n)[-1])
        n += 1
    return rows, tokens


def _interpreter(plan: Plan):
    graphs = plan.graphs()
    its = {phase: Interpreter(g) for phase, g in graphs.items()}
    state = its["decode"].new_state()
    return lambda phase, tokens, n: its[phase].run({"tokens": tokens}, state, n)[graphs[phase].outputs[0]]


def _backend(plan: Plan, kind: str):
    be = open_backend(plan, kind)
    return lambda phase, tokens, n: be.run(phase, tokens, n, n)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("backend", ["cpu", "opencl", "reference"])
def test_qwen_plan_gives_the_interpreters_logits_and_greedy_tokens(tmp_path, shape, backend):
    if backend == "opencl":
        require_opencl()
    plan = _plan(tmp_path, shape, "f32")
    decode = plan.graphs()["decode"]
    assert decode.kernel_count() == 2 + 5 * SHAPES[shape].layers     # Llama's five kernels a layer
    want_rows, want_tokens = _generate(_interpreter(plan), PROMPT, 6)
    got_rows, got_tokens = _generate(_backend(plan, backend), PROMPT, 6)
    assert got_tokens == want_tokens
    assert rel_err(np.stack(got_rows), np.stack(want_rows)) <= 1e-4


@pytest.mark.parametrize("shape", ["qwen3", "qwen2"])
@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_unfused_qwen_plan_runs_the_per_head_norms_and_biased_matmuls_as_ops(tmp_path, shape, backend):
    """--no-fuse qkv_rope_kv: rms_norm over each head and matmuls with a bias run as kernels of their own."""
    if backend == "opencl":
        require_opencl()
    plan = _plan(tmp_path, shape, "f32", no_fuse=("qkv_rope_kv",))
    ops = plan.graphs()["decode"].ops
    hd = SHAPES[shape].head_dim
    assert any(op.kind == "rms_norm" and plan.graphs()["decode"].values[op.inputs[1]].shape == (hd,) for op in ops) \
        == SHAPES[shape].qk_norm
    assert any(op.kind == "matmul" and len(op.inputs) == 3 for op in ops) == SHAPES[shape].bias
    want_rows, want_tokens = _generate(_interpreter(plan), PROMPT, 4)
    got_rows, got_tokens = _generate(_backend(plan, backend), PROMPT, 4)
    assert got_tokens == want_tokens
    assert rel_err(np.stack(got_rows), np.stack(want_rows)) <= 1e-4


@pytest.mark.parametrize("shape,weights", [("qwen3", "q4_0"), ("qwen2", "q8_0")])
def test_every_kernel_of_a_quantized_qwen_plan_passes_llmrs_check(tmp_path, shape, weights):
    require_opencl()
    plan = _plan(tmp_path, shape, weights)
    graphs = plan.graphs()
    kernels = kernel_checks.plan_kernels(graphs)
    qkv = [k for k in kernels if any(o.attrs.get("epilogue") == "rope_kv_store" for o in k.all_ops)]
    flag = "qk_norm" if shape == "qwen3" else "bias"
    assert {k.phase for k in qkv} == {"prefill", "decode"} and all(f"+{flag}" in k.label for k in qkv)
    # decode's QKV with per-head norms is checked with its attention (OpenCL may finish q and k there)
    assert [k.phase for k in qkv if k.before] == (["decode"] if shape == "qwen3" else [])
    for phase, g in graphs.items():
        assert sum(k.ops for k in kernels if k.phase == phase) == len(g.ops)
    results = kernel_checks.check_kernels(kernels, kernel_checks.open_runners(plan, kernel_checks.BACKENDS))
    assert len(results) == 2 * len(kernels)
    for r in results:
        assert r.status == "PASS", (r.kernel.label, r.backend, r.note)
        assert 0 <= r.error <= r.kernel.tolerance
    assert all(r.error > 0 for r in results if r.kernel in qkv)   # real work, not bit-exact copies
