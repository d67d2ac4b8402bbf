"""The OpenCL back end end to end on PoCL: golden tiny models compiled to plan.bin, run on the
device, logits and greedy tokens against the interpreter running the same compiled graphs."""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")

from llmrs.compiler.codegen.opencl import generate  # noqa: E402
from llmrs.compiler.interpret import Interpreter  # noqa: E402
from llmrs.compiler.pipeline import PREFILL_SHORT, CompileOptions, compile_graphs, compile_phases  # noqa: E402
from llmrs.compiler.plan import write_graph_plan  # noqa: E402
from llmrs.compiler import quant  # noqa: E402
from llmrs.compiler.ir import Graph, LazyTensor  # noqa: E402
from llmrs.runtime.backends.opencl import (OpenCLBackend, OpenCLError, build_program, device_options,  # noqa: E402
                                           from_split_blocks, pick_device, split_region, to_split_blocks)
from llmrs.runtime.backends.opencl_launch import DirectLaunches, icd_loader  # noqa: E402
from llmrs.runtime.plan import Plan  # noqa: E402

from ..conftest import DATA  # noqa: E402

# skipped, naming Debian's PoCL, where no OpenCL device can build kernels (pip's PoCL on a Zen 5)
pytestmark = pytest.mark.usefixtures("opencl_device")
PROMPT = np.array([3, 17, 250, 9, 42, 7, 101, 64, 5], np.int32)


def _plan(tmp_path: Path, model: str, weights: str, kv: str) -> Plan:
    p, d = compile_graphs(DATA / model, CompileOptions(weights=weights, kv_type=kv, prefill_chunk=8, max_seq_len=32))
    graphs = {"prefill": p, "decode": d}
    path = tmp_path / f"{model}-{weights}.bin"
    write_graph_plan(path, graphs, sections={"opencl": json.dumps(generate(graphs))})
    return Plan.open(path)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def test_short_prompts_run_the_short_prefill_graph_and_match_the_interpreter(tmp_path):
    """A plan of 160-token chunks carries OpenCL's 128-token prefill graph: a step of up to 128
    tokens runs it, a longer one the prefill graph, and both give the interpreter's logits."""
    graphs = compile_phases(DATA / "golden-a", CompileOptions(weights="f32", kv_type="f32", prefill_chunk=160,
                                                              max_seq_len=192, target="opencl", max_num_seqs=0,
                                                              max_draft_tokens=0))
    assert graphs[PREFILL_SHORT].T == 128
    path = tmp_path / "short.bin"
    write_graph_plan(path, graphs, sections={"opencl": json.dumps(generate(graphs))})
    be = OpenCLBackend(Plan.open(path))
    ran = []
    write = be._write_inputs
    be._write_inputs = lambda phase, *a, **k: ran.append(phase) or write(phase, *a, **k)
    pre = Interpreter(graphs["prefill"])
    state = pre.new_state()
    rng = np.random.default_rng(11)
    n = 0
    for size in (140, 20, 1):
        chunk = rng.integers(1, 300, size, dtype=np.int32)
        got = be.run("prefill", chunk, n, n)
        want = pre.run({"tokens": chunk}, state, n)[graphs["prefill"].outputs[0]]
        assert _rel(got, want) <= 1e-4
        n += size
    assert ran == ["prefill", PREFILL_SHORT, PREFILL_SHORT]
    assert int(be.run_argmax("prefill", chunk, n - 1, n - 1)[-1]) == int(np.argmax(want[-1]))


@pytest.mark.parametrize("model,weights,kv,tol", [
    ("golden-a", "f32", "f32", 1e-4),
    ("golden-b", "q4_0", "f16", 1e-4),
    ("golden-c", "f32", "f32", 1e-4),     # head_dim 100, MQA
    ("golden-a", "q4_1", "f32", 1e-4),
    ("golden-b", "q4_1", "f16", 1e-4),
])
def test_golden_model_matches_interpreter_with_same_greedy_tokens(tmp_path, model, weights, kv, tol):
    if kv == "f16" and "-DUSE_NV_MMA" in device_options(pick_device()):
        # NVIDIA's tensor-core prefill attention rounds Q and P to f16: on these random models
        # that alone (each rounding, applied to the interpreter) moves the logits by 1.5-2.5e-2
        tol = 5e-2
    plan = _plan(tmp_path, model, weights, kv)
    be = OpenCLBackend(plan)
    graphs = plan.graphs()
    pre, dec = Interpreter(graphs["prefill"]), Interpreter(graphs["decode"])
    state = pre.new_state()
    # a 9-token prompt is two prefill chunks (8 + 1): the second runs with n_past = 8
    n = 0
    for chunk in (PROMPT[:8], PROMPT[8:]):
        got = be.run("prefill", chunk, n, n)
        want = pre.run({"tokens": chunk}, state, n)[graphs["prefill"].outputs[0]]
        assert got.shape == want.shape
        assert _rel(got, want) <= tol
        n += len(chunk)
    tokens_cl, tokens_ref = [], []
    tok_cl, tok_ref = int(np.argmax(got[-1])), int(np.argmax(want[-1]))
    for _ in range(6):
        tokens_cl.append(tok_cl)
        tokens_ref.append(tok_ref)
        got = be.run("decode", np.array([tok_cl], np.int32), n, n)
        want = dec.run({"tokens": np.array([tok_ref], np.int32)}, state, n)[graphs["decode"].outputs[0]]
        assert _rel(got, want) <= tol
        tok_cl, tok_ref = int(np.argmax(got[-1])), int(np.argmax(want[-1]))
        n += 1
    assert tokens_cl == tokens_ref


def test_reset_empties_the_kv_cache_so_a_rerun_repeats_its_logits(tmp_path):
    be = OpenCLBackend(_plan(tmp_path, "golden-a", "q8_0", "f32"))
    first = be.run("prefill", PROMPT[:5], 0, 0)
    be.run("decode", np.array([1], np.int32), 5, 5)
    be.reset()
    again = be.run("prefill", PROMPT[:5], 0, 0)
    np.testing.assert_array_equal(first, again)


def test_step_past_the_kv_cache_is_refused_in_one_line(tmp_path):
    be = OpenCLBackend(_plan(tmp_path, "golden-a", "q8_0", "f32"))
    with pytest.raises(ValueError, match="KV cache .* holds 32 tokens"):
        be.run("decode", np.array([1], np.int32), 32, 32)


def test_unknown_device_name_is_one_line_listing_the_devices():
    with pytest.raises(OpenCLError) as e:
        pick_device("no-such-device-xyz")
    assert "no OpenCL device matches 'no-such-device-xyz'" in str(e.value) and "\n" not in str(e.value)


def test_regions_split_at_tensor_boundaries_and_keep_overlaps_together():
    chunks = split_region([(0, 40), (64, 100), (100, 180), (150, 200), (256, 300)], 128, "t")
    assert chunks == [(0, 100), (100, 200), (256, 300)]
    with pytest.raises(OpenCLError, match="must sit in one buffer"):
        split_region([(0, 100), (50, 300)], 128, "t")


def test_weights_split_over_several_buffers_give_the_same_logits(tmp_path, monkeypatch):
    plan = _plan(tmp_path, "golden-a", "f32", "f32")
    whole = OpenCLBackend(plan).run("prefill", PROMPT[:6], 0, 0)
    monkeypatch.setenv("LLMRS_OPENCL_MAX_ALLOC", str(128 * 1024))   # golden-a's biggest tensor is 96 KiB
    split = OpenCLBackend(plan)
    assert len(split.weights.chunks) > 1
    np.testing.assert_array_equal(split.run("prefill", PROMPT[:6], 0, 0), whole)


def test_greedy_argmax_on_the_device_gives_the_tokens_of_the_logits(tmp_path):
    plan = _plan(tmp_path, "golden-b", "q4_0", "f16")
    be = OpenCLBackend(plan)
    logits = be.run("prefill", PROMPT[:8], 0, 0)
    be.reset()
    tokens = be.run("prefill", PROMPT[:8], 0, 0, want="argmax")
    assert tokens.dtype == np.int32 and tokens.tolist() == np.argmax(logits, axis=-1).tolist()
    tok = tokens[-1:]
    for n in range(8, 12):
        want = int(np.argmax(be.run("decode", tok, n, n)[-1]))   # rewrites slot n: same values
        got = be.run("decode", tok, n, n, want="argmax")
        assert got.tolist() == [want]
        tok = got


def test_greedy_argmax_over_many_groups_picks_the_first_of_equal_maxima():
    rng = np.random.default_rng(13)
    rows, vocab = 3, 40000                     # 9 groups per row
    g = Graph("decode", rows, meta={})
    g.add_value("a", (rows, vocab), "f32", kind="input")
    g.add_value("one", (rows, vocab), "f32", kind="param")
    g.weights["one"] = LazyTensor.of(np.ones((rows, vocab), np.float32), "f32")
    g.add_value("y", (rows, vocab), "f32")
    g.add_op("mul", ["a", "one"], ["y"])
    g.outputs = ["y"]
    a = rng.standard_normal((rows, vocab)).astype(np.float32)
    a[0, 39999] = 50.0
    a[1, 5000] = a[1, 33000] = a[1, 20] = 60.0   # ties across groups: index 20 wins
    a[2, 12345] = 70.0
    be = OpenCLBackend.from_graphs({"decode": g}, generate({"decode": g}))
    be.write_value("decode", "a", a)
    for n_tokens in (3, 2):
        be.enqueue("decode", np.zeros(n_tokens, np.int32), 0, 0)
        b = be.greedy["decode"]
        cl.enqueue_nd_range_kernel(be.queue, b.kernel, b.global_size(n_tokens), (b.local, 1))
        out = np.empty(n_tokens, np.int32)
        cl.enqueue_copy(be.queue, out, be.result_buf, is_blocking=True)
        assert out.tolist() == [39999, 20, 12345][:n_tokens]


def test_quantized_weights_round_trip_through_the_split_device_layout():
    rng = np.random.default_rng(14)
    for dtype in ("q4_0", "q4_1", "q8_0"):
        raw = quant.quantize(rng.standard_normal((6, 64)).astype(np.float32), dtype)
        split = to_split_blocks(raw, dtype)
        assert split.nbytes == raw.nbytes
        np.testing.assert_array_equal(from_split_blocks(split, dtype).reshape(raw.shape), raw)


@pytest.mark.parametrize("weights", ["f16"])
def test_q8_0_kv_cache_runs_end_to_end_with_the_interpreters_greedy_tokens(tmp_path, weights):
    d = tmp_path / "m"
    import subprocess
    import sys
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "tools" / "make_tiny_model.py"), str(d),
                    "--preset", "tiny", "--head-dim", "64"], check=True, capture_output=True)
    p, dg = compile_graphs(d, CompileOptions(weights=weights, kv_type="q8_0", prefill_chunk=8, max_seq_len=32))
    graphs = {"prefill": p, "decode": dg}
    be = OpenCLBackend.from_graphs(graphs, generate(graphs))
    pre, dec = Interpreter(p), Interpreter(dg)
    state = pre.new_state()
    got = be.run("prefill", PROMPT[:8], 0, 0)
    want = pre.run({"tokens": PROMPT[:8]}, state, 0)[p.outputs[0]]
    # on NVIDIA's tensor cores f16-weight prefill rounds activations to f16; the q8_0 cache
    # re-rounds what that moves (7e-3 seen on the H200)
    tensor_cores = "-DUSE_NV_MMA" in device_options(pick_device())
    assert _rel(got, want) <= (1e-2 if tensor_cores else 2e-3)
    tok_cl = tok_ref = int(np.argmax(want[-1]))
    n, toks_cl, toks_ref = 8, [], []
    for _ in range(5):
        tok_cl = int(be.run("decode", np.array([tok_cl], np.int32), n, n, want="argmax")[0])
        tok_ref = int(np.argmax(dec.run({"tokens": np.array([tok_ref], np.int32)}, state, n)[dg.outputs[0]][-1]))
        toks_cl.append(tok_cl)
        toks_ref.append(tok_ref)
        n += 1
    assert toks_cl == toks_ref


@pytest.mark.parametrize("launch", ["command_buffers", "no_events", "no_events_python_loop", "pyopencl"])
def test_greedy_steps_enqueued_at_once_give_the_tokens_of_step_by_step_greedy(tmp_path, monkeypatch, launch):
    monkeypatch.setenv("LLMRS_OPENCL_NO_COMMAND_BUFFER", "0" if launch == "command_buffers" else "1")
    be = OpenCLBackend(_plan(tmp_path, "golden-b", "q4_0", "f16"))
    if launch == "command_buffers" and not be.use_command_buffers:
        pytest.skip(f"{be.device_name} has no cl_khr_command_buffer")
    if launch == "no_events":
        assert be.direct is not None and be.direct.native    # one native loop a launch list
    if launch == "no_events_python_loop":
        be.direct = DirectLaunches(be.queue, native=False)
    if launch == "pyopencl":
        be.direct = None
    first = int(be.run("prefill", PROMPT[:8], 0, 0, want="argmax")[-1])
    want, tok = [], np.array([first], np.int32)
    for n in range(8, 20):
        tok = be.run_argmax("decode", tok, n, n)
        want.append(int(tok[0]))
    for _ in range(2):   # the second call replays what the first recorded
        got = be.run_greedy_steps(first, 8, 8, 12)
        assert got.dtype == np.int32 and got.tolist() == want
    # a 13-step batch continues the 12-step one as a plain step after it does
    assert be.run_argmax("decode", got[-1:], 20, 20).tolist() == [int(be.run_greedy_steps(first, 8, 8, 13)[-1])]


@pytest.mark.parametrize("native", [True, False])
def test_a_launch_the_driver_refuses_is_a_one_line_error_naming_its_kernel(tmp_path, native):
    """Both launch loops stop at the refused launch and name it (a group larger than the device
    takes: CL_INVALID_WORK_GROUP_SIZE), after enqueuing the launches before it."""
    be = OpenCLBackend(_plan(tmp_path, "golden-b", "q4_0", "f16"))
    direct = DirectLaunches(be.queue, native=native)
    assert direct.native == native
    launches = be._step_launches("decode", 1)
    k, g, _ = launches[1]
    too_big = be.device.max_work_group_size * 2
    bad = [launches[0], (k, (too_big, g[1]), (too_big, 1))]
    be.enqueue("decode", np.array([3], np.int32), 0, 0, kernels=False)   # the step's scalars and token
    with pytest.raises(OpenCLError, match=f"launching kernel {k.function_name} failed \\(CL_INVALID_WORK_GROUP_SIZE\\)"):
        direct.enqueue(direct.prepare(bad), repeat=2)
    be.queue.finish()
    direct.enqueue(direct.prepare(launches[:0]))     # an empty list enqueues nothing


def test_greedy_steps_past_the_kv_cache_are_refused_in_one_line(tmp_path):
    be = OpenCLBackend(_plan(tmp_path, "golden-b", "q4_0", "f16"))
    with pytest.raises(ValueError, match="holds 32 tokens; 30 \\+ 3 steps do not fit"):
        be.run_greedy_steps(1, 30, 30, 3)


def test_a_command_buffer_the_driver_refuses_to_replay_falls_back_to_plain_launches(tmp_path, monkeypatch):
    """PoCL answers CL_INVALID_OPERATION when a recording is re-enqueued while still pending."""
    import llmrs.runtime.backends.opencl as ocl

    monkeypatch.setenv("LLMRS_OPENCL_NO_COMMAND_BUFFER", "1")
    plain = OpenCLBackend(_plan(tmp_path, "golden-b", "q4_0", "f16"))
    first = int(plain.run("prefill", PROMPT[:8], 0, 0, want="argmax")[-1])
    want = plain.run_greedy_steps(first, 8, 8, 6).tolist()

    monkeypatch.setenv("LLMRS_OPENCL_NO_COMMAND_BUFFER", "0")
    be = OpenCLBackend(_plan(tmp_path, "golden-b", "q4_0", "f16"))
    if not be.use_command_buffers:
        pytest.skip(f"{be.device_name} has no cl_khr_command_buffer")

    def refuse(self):
        raise ocl.OpenCLError("clEnqueueCommandBufferKHR failed (-59)")

    monkeypatch.setattr(ocl.CommandBuffer, "enqueue", refuse)
    with pytest.warns(UserWarning, match="-59"):
        assert int(be.run("prefill", PROMPT[:8], 0, 0, want="argmax")[-1]) == first
    assert be.run_greedy_steps(first, 8, 8, 6).tolist() == want
    assert not be.use_command_buffers and "kernel by kernel" in be.build_notes[-1]


def test_a_launch_the_driver_refuses_is_one_line_naming_the_device_and_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRS_OPENCL_NO_COMMAND_BUFFER", "1")
    be = OpenCLBackend(_plan(tmp_path, "golden-b", "q4_0", "f16"))
    b = be.launches["decode"][0]
    too_big = be.device.max_work_group_size * 2   # a group size no device takes
    with pytest.raises(OpenCLError) as err:
        be._enqueue_launches(("bad",), [(b.kernel, (too_big, 1), (too_big, 1))])
    msg = str(err.value)
    assert "\n" not in msg and be.device_name in msg and b.kernel.function_name in msg
    assert "CL_INVALID_WORK_GROUP_SIZE" in msg


def _file_defining(fn) -> Path:
    """The shared library a ctypes function's code lies in (dladdr)."""
    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
    info = DlInfo()
    assert ctypes.CDLL(None).dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info))
    return Path(info.fname.decode()).resolve()


def test_launches_without_events_call_the_opencl_library_pyopencl_loaded():
    """A machine with only pip's PoCL has no system libOpenCL: the ctypes launches must find the
    ICD loader bundled in pyopencl's wheel, the one pyopencl's objects come from."""
    where = _file_defining(icd_loader().clEnqueueNDRangeKernel)
    assert where.name.startswith("libOpenCL")
    pkg = Path(cl.__file__).resolve().parent
    bundled = {p.resolve() for p in [*pkg.glob(".libs/libOpenCL*"), *pkg.parent.glob("pyopencl.libs/libOpenCL*")]}
    if bundled:   # a wheel (else pyopencl was built against the system's loader)
        assert where in bundled
    mapped = {line.split()[-1] for line in open("/proc/self/maps") if "libOpenCL" in line}
    assert str(where) in {str(Path(m).resolve()) for m in mapped}


def test_a_build_with_compiler_remarks_warns_nobody_unless_asked(opencl_device, tmp_path, monkeypatch, recwarn):
    """pyopencl warns "Non-empty compiler output encountered" (with its source line) on any build
    log; NVIDIA's driver writes one for our kernels. PYOPENCL_COMPILER_OUTPUT=1 shows it again."""
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PYOPENCL_COMPILER_OUTPUT", raising=False)
    ctx = cl.Context([opencl_device])
    source = '#warning "a remark"\n__kernel void k(__global int *x) { x[0] = 1; }\n'
    prg = build_program(ctx, opencl_device, source, [], "remark")   # from source
    if not prg.get_build_info(opencl_device, cl.program_build_info.LOG).strip():
        pytest.skip(f"{opencl_device.name.strip()} writes no build log for #warning")
    build_program(ctx, opencl_device, source, [], "remark")         # from the binary cache
    assert not [w for w in recwarn if issubclass(w.category, cl.CompilerWarning)]
    monkeypatch.setenv("PYOPENCL_COMPILER_OUTPUT", "1")
    with pytest.warns(cl.CompilerWarning, match="a remark"):
        build_program(ctx, opencl_device, source + "\n", [], "remark")


def test_wgmma_comments_become_instructions_and_the_target_sm_90a():
    # matmul.cl writes each wgmma as a comment of its inline asm (sm_90's assembler has none);
    # patch_wgmma_ptx makes them the instructions, with the registers the compiler bound, in order
    from llmrs.runtime.backends.opencl import patch_wgmma_ptx
    acc = [f"%f{i}" for i in range(100, 116)]
    ptx = "\n".join([".version 9.0", ".target sm_90, texmode_independent", ".address_size 64",
                     "\t// LLMRS_WGMMA_FENCE " + ",".join(acc),
                     "\t// LLMRS_WGMMA_M64N32K16 " + ",".join(acc) + ",%rd7,%rd8,%r3",
                     "\t// LLMRS_WGMMA_COMMIT", "\t// LLMRS_WGMMA_WAIT1 " + ",".join(acc),
                     "\t// LLMRS_WGMMA_WAIT0 " + ",".join(acc), "\tret;"])
    out = patch_wgmma_ptx(ptx).splitlines()
    assert out[1] == ".target sm_90a, texmode_independent" and "LLMRS" not in "\n".join(out)
    assert out[3:5] == ["\twgmma.fence.sync.aligned;",
                        "\t{ .reg .pred p; setp.ne.b32 p, %r3, 0; wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
                        + ", ".join(acc) + "}, %rd7, %rd8, p, 1, 1, 0, 0; }"]
    assert out[5:8] == ["\twgmma.commit_group.sync.aligned;", "\twgmma.wait_group.sync.aligned 1;",
                        "\twgmma.wait_group.sync.aligned 0;"]
    assert patch_wgmma_ptx(".target sm_90a\n") == ".target sm_90a\n"   # already retargeted: kept
