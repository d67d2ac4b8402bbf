"""OpenCL eviction scores (attention_scores.cl) and KV compaction (kv_compact.cl) on PoCL,
against the interpreter and numpy, on random non-zero data."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.compiler import quant

from .kernel_cases import scored_attention_case

cl = pytest.importorskip("pyopencl")
pytestmark = pytest.mark.usefixtures("opencl_device")   # skips, naming Debian's PoCL, where no device runs kernels
from llmrs.compiler.codegen.opencl import generate  # noqa: E402
from llmrs.runtime.backends.opencl import OpenCLBackend  # noqa: E402


def _run(case, scoring: bool) -> tuple[dict[str, np.ndarray], list[str]]:
    """The op's outputs after one step, and the device's build options."""
    g = case.graph
    g.outputs = list(case.op.outputs)
    be = OpenCLBackend.from_graphs({g.name: g}, generate({g.name: g}))
    be.scoring = scoring
    for name, arr in case.arrays.items():
        be.write_value(g.name, name, arr)
    st = case.step
    be.enqueue(g.name, np.zeros(st.n_tokens, np.int32), st.n_past, st.start_pos)
    be.queue.finish()
    return {n: be.read_value(g.name, n) for n in case.op.outputs}, be.build_options


@pytest.mark.parametrize("kv_dtype,hd", [("f32", 32), ("f16", 32), ("q8_0", 64), ("f16", 16), ("q4_0", 64)])
@pytest.mark.parametrize("T,n_tokens,first", [(1, 1, 0), (7, 7, 0), (7, 5, 8), (7, 4, None)])
def test_attention_scores_kernel_matches_interpreter(kv_dtype, hd, T, n_tokens, first):
    case = scored_attention_case(T, n_tokens, kv_dtype, first, hd=hd)
    want = case.expected()
    got, build_options = _run(case, scoring=True)
    scale = np.abs(want["sc_out"]).max()
    assert np.max(np.abs(got["sc_out"] - want["sc_out"])) / scale <= 1e-5
    o = want["o"]
    # prefill over an f16 cache on NVIDIA's tensor cores takes Q and P rounded to f16 (attention.cl
    # ATT_MMA_BODY; llmrs-check's TOL_F16_ATT): ~4e-4 on the H200; every other body holds 1e-4
    mma = "-DUSE_NV_MMA" in build_options and kv_dtype == "f16" and T > 1
    assert np.max(np.abs(got["o"][:n_tokens] - o)) / np.abs(o).max() <= (2e-3 if mma else 1e-4)
    if first is None:
        np.testing.assert_array_equal(got["sc_out"], case.arrays["sc"])


def test_without_scoring_the_step_leaves_the_scores_alone():
    """The back end drops the scoring launch from a step unless scoring is on: scores stay
    as they were even with the control saying on."""
    case = scored_attention_case(7, 7, "f16", 0)
    got, _ = _run(case, scoring=False)
    np.testing.assert_array_equal(got["sc_out"], case.arrays["sc"])


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_kv_compact_gathers_rows_per_head_in_place(tmp_path, kv_dtype):
    """One compaction launch per kind of state over both layers of a plan: per KV head, slot j
    becomes old slot keep[layer, head, j], byte for byte, over several 64-row passes of a group
    (rows read before any is overwritten); scores past the survivors are zeroed. (q8_0 rows:
    head_dim 64 in tests/runtime/test_kv_eviction.py.)"""
    from llmrs.compiler.cli import main as compile_main
    from llmrs.runtime.plan import Plan

    from ..conftest import DATA
    plan_path = tmp_path / "a.plan.bin"
    assert compile_main([str(DATA / "golden-a"), "-o", str(plan_path), "--target", "opencl", "--weights", "f32",
                         "--kv-type", kv_dtype, "--max-seq-len", "256", "--prefill-chunk", "8", "-q"]) == 0
    be = OpenCLBackend(Plan.open(plan_path))
    store = be.kv_store()
    rng = np.random.default_rng(2)
    g = be.graphs["decode"]
    before = {}
    for name in g.state:
        v = g.values[name]
        if v.dtype == "i32":
            continue
        vals = rng.standard_normal(v.shape).astype(np.float32) + 0.1
        data = quant.quantize(vals, v.dtype) if v.dtype == "q8_0" else vals.astype(np.float16 if v.dtype == "f16" else np.float32)
        be.write_value("decode", name, data)
        before[name] = data
    n, k = 250, 150
    keep = np.sort(np.stack([np.stack([rng.choice(n, k, replace=False) for _ in range(store.n_kv_heads)])
                             for _ in range(store.n_layers)]), axis=-1)
    store.compact(keep)
    for i, layer in enumerate(store.layers):
        for h in range(store.n_kv_heads):
            for name in (layer.k, layer.v):
                np.testing.assert_array_equal(be.read_value("decode", name)[:k, h], before[name][keep[i, h], h])
            sc = be.read_value("decode", layer.scores)
            np.testing.assert_array_equal(sc[h, :k], before[layer.scores][h, keep[i, h]])
            assert not sc[h, k:].any()
