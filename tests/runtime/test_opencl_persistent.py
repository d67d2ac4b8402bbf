"""The persistent decode kernel (runtime/backends/opencl_persistent.py) on PoCL: a decode step run
as one launch gives the bits and greedy tokens of the launch-by-launch step (itself checked
against the interpreter here too), on every family's golden model; a step that gives up at a
grid barrier is rerun launch by launch; what cannot run persistently is refused in a note."""
from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from llmrs.compiler.codegen.opencl import generate
from llmrs.compiler.codegen.opencl_tuning import OpenCLTuning
from llmrs.compiler.pipeline import CompileOptions, compile_graphs

from ..conftest import DATA, rel_err, run_steps

cl = pytest.importorskip("pyopencl")
from llmrs.runtime.backends.opencl import OpenCLBackend  # noqa: E402
from llmrs.runtime.backends.opencl_persistent import Variant, variant_source  # noqa: E402

pytestmark = pytest.mark.usefixtures("opencl_device")
PROMPT = np.array([3, 17, 250, 9, 42, 7, 101, 64], np.int32)
FEED = np.array([5, 88, 13, 200, 1, 77], np.int32)
# every decode kernel with barriers in 128-thread groups: PoCL has no named barriers, so only
# barrier-free kernels (the embedding's 64) may run narrower than the persistent group
UNIFORM = replace(OpenCLTuning(), mv_wg=128, mv_wg_quant=128, att_dec_wg=128, red_wg=128)


@pytest.fixture(scope="module")
def qwen3_hd64(tmp_path_factory):
    """A Qwen3 of head_dim 64, GQA: its q8_0 / q4_0 caches store whole 32-value blocks (the
    blocked KV epilogue), with the per-head norms split over groups (QK_SPLIT's tickets)."""
    from llmrs.models.tiny import make_model
    return make_model(tmp_path_factory.mktemp("q3") / "m", "tiny", 3, "f32", family="qwen3", head_dim=64,
                      num_attention_heads=4, num_key_value_heads=2)


def _graphs(model, weights: str, kv: str):
    p, d = compile_graphs(DATA / model if isinstance(model, str) else model,
                          CompileOptions(weights=weights, kv_type=kv, prefill_chunk=8, max_seq_len=32))
    return {"prefill": p, "decode": d}


def _backend(graphs, tuning: OpenCLTuning, monkeypatch, mode: str, groups: int | None = None) -> OpenCLBackend:
    monkeypatch.setenv("LLMRS_OPENCL_PERSISTENT", mode)
    if groups:
        monkeypatch.setenv("LLMRS_OPENCL_PERSISTENT_GROUPS", str(groups))
    else:
        monkeypatch.delenv("LLMRS_OPENCL_PERSISTENT_GROUPS", raising=False)
    return OpenCLBackend.from_graphs(graphs, generate(graphs, tuning))


def _nvidia(be: OpenCLBackend) -> bool:
    return "-DUSE_NV_PTX" in be.build_options


@pytest.fixture(scope="module")
def fallback_weights(opencl_device) -> str:
    """The fallback tests' weights: the first sweep case's q4_0, whose persistent program PoCL has
    then built already; f16 on NVIDIA, which refuses quantized matvecs."""
    return "f16" if "NVIDIA" in opencl_device.platform.vendor.upper() else "q4_0"


def _decode(be: OpenCLBackend) -> tuple[np.ndarray, list[int]]:
    """Logits of FEED's decode steps after PROMPT, then 6 greedy steps enqueued at once."""
    be.reset()
    first = be.run("prefill", PROMPT, 0, 0)
    logits = np.stack([be.run("decode", FEED[i:i + 1], 8 + i, 8 + i)[0] for i in range(len(FEED))])
    be.reset()
    be.run("prefill", PROMPT, 0, 0)
    return logits, be.run_greedy_steps(int(np.argmax(first[-1])), 8, 8, 6).tolist()


@pytest.mark.parametrize("model,weights,kv", [
    ("golden-b", "q4_0", "f16"),     # the first case is the default set's (tests/conftest.py SWEEPS)
    ("golden-a", "f32", "f32"),
    ("golden-c", "f32", "f32"),      # head_dim 100, MQA
    ("golden-b", "q4_1", "f32"),
    ("qwen3-a", "q8_0", "f16"),      # per-head q/k norms in the QKV epilogue
    ("qwen3_hd64", "q4_0", "q8_0"),
    ("qwen3_hd64", "f16", "q4_0"),
    ("qwen2-a", "f16", "f32"),       # q/k/v biases
])
@pytest.mark.parametrize("groups", [2, 1])
def test_a_persistent_decode_step_has_the_bits_and_greedy_tokens_of_the_launches(model, weights, kv, groups,
                                                                                monkeypatch, request):
    graphs = _graphs(request.getfixturevalue(model) if model == "qwen3_hd64" else model, weights, kv)
    launches = _backend(graphs, UNIFORM, monkeypatch, "0")
    want, want_greedy = _decode(launches)
    be = _backend(graphs, UNIFORM, monkeypatch, "1", groups)
    got, got_greedy = _decode(be)
    if _nvidia(be) and weights in ("q4_0", "q4_1", "q8_0"):   # refused there (round 20): the launches ran
        assert any("quantized matvecs" in n for n in be.build_notes)
        np.testing.assert_array_equal(got, want)
        return
    assert be.build_notes == [] and be.persistent
    pk = be._persistent[("decode", 1, "logits", False)]
    assert pk is not None and pk.groups == groups and pk.n_launches == len(launches._step_launches("decode", 1))
    np.testing.assert_array_equal(got, want)
    assert got_greedy == want_greedy
    if weights == "f32":   # and both are the interpreter's, as the launches are
        _, steps = run_steps(graphs["prefill"], graphs["decode"], PROMPT, FEED)
        assert rel_err(got, np.stack(steps)) < 1e-4


def test_a_step_that_gives_up_at_a_grid_barrier_is_rerun_launch_by_launch(monkeypatch, fallback_weights):
    graphs = _graphs("golden-b", fallback_weights, "f16")
    want, want_greedy = _decode(_backend(graphs, UNIFORM, monkeypatch, "0"))
    be = _backend(graphs, UNIFORM, monkeypatch, "1", 2)
    be.reset()
    be.run("prefill", PROMPT, 0, 0)
    got = [be.run("decode", FEED[:1], 8, 8)[0]]          # a persistent step
    pk = be._persistent[("decode", 1, "logits", False)]
    pk.reset_sync(abort=True)                            # as a group that waited too long leaves it
    with pytest.warns(UserWarning, match="timed out at a grid barrier"):
        got += [be.run("decode", FEED[i:i + 1], 8 + i, 8 + i)[0] for i in range(1, len(FEED))]
    np.testing.assert_array_equal(np.stack(got), want)
    assert not be.persistent and any("kernel by kernel" in n for n in be.build_notes)
    assert _decode(be)[1] == want_greedy                 # greedy steps now launch kernel by kernel


def test_greedy_steps_that_give_up_are_rerun_from_their_first_step(monkeypatch, fallback_weights):
    graphs = _graphs("golden-b", fallback_weights, "f16")
    want = _decode(_backend(graphs, UNIFORM, monkeypatch, "0"))[1]
    be = _backend(graphs, UNIFORM, monkeypatch, "1", 2)
    assert _decode(be)[1] == want
    be._persistent[("greedy", False)].reset_sync(abort=True)
    with pytest.warns(UserWarning, match="timed out"):
        assert _decode(be)[1] == want


def test_a_spin_too_short_for_the_other_groups_still_gives_the_launches_tokens(monkeypatch, fallback_weights):
    """One read of the arrival counter a wait: a group that arrives first gives up at once (on a
    CPU the other group is rarely there yet); whether or not any step did, nothing hangs and the
    tokens are the launches'."""
    graphs = _graphs("golden-b", fallback_weights, "f16")
    want = _decode(_backend(graphs, UNIFORM, monkeypatch, "0"))
    monkeypatch.setenv("LLMRS_OPENCL_PERSISTENT_SPIN", "1")
    be = _backend(graphs, UNIFORM, monkeypatch, "1", 2)
    with warnings.catch_warnings(record=True):   # a step may or may not give up
        got = _decode(be)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]


def test_kernels_with_barriers_narrower_than_the_group_are_refused_without_named_barriers(monkeypatch):
    """The default tuning's 512-thread quantized matvec beside 128-thread attention: PoCL cannot
    give each 128-thread virtual group its own barrier, so the step launches kernel by kernel."""
    graphs = _graphs("golden-b", "q4_0", "f16")
    be = _backend(graphs, OpenCLTuning(), monkeypatch, "1")
    want = _decode(_backend(graphs, OpenCLTuning(), monkeypatch, "0"))
    got = _decode(be)
    if _nvidia(be):   # NVIDIA: quantized matvecs are refused there (round 20)
        assert be._persistent[("decode", 1, "logits", False)] is None
        assert any("quantized matvecs" in n for n in be.build_notes)
    else:
        assert be._persistent[("decode", 1, "logits", False)] is None
        assert any("named barriers" in n for n in be.build_notes)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]


def test_the_persistent_kernel_is_off_unless_asked_on_a_device_without_named_barriers(monkeypatch):
    graphs = _graphs("golden-a", "f32", "f32")
    monkeypatch.delenv("LLMRS_OPENCL_PERSISTENT", raising=False)
    be = OpenCLBackend.from_graphs(graphs, generate(graphs, UNIFORM))
    _decode(be)
    assert not be.persistent and be._persistent == {}


SOURCE = """inline float helper(float v) { return v * 2.0f; }
typedef __global float* gptr;
#define TWICE(x) helper(x)
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void body(__global const int* step, gptr out, int n) {
    __local float buf[WG], other[2][WG];
    __local int last;
    int g = get_group_id(0);
    buf[get_local_id(0)] = TWICE((float)g);
    last = n;
    out[g] = buf[0] + other[1][0] + last;
}
__kernel void unused(__global float* x) { x[get_group_id(0)] = 0.0f; }
"""


def test_a_variant_becomes_a_renamed_function_of_its_virtual_group_with_its_locals_in_the_pool():
    text, fn = variant_source(Variant(SOURCE, ("-DWG=64",), "body", 64), "v3", 128, named_barriers=True)
    assert fn == "pk_v3"
    assert "#define WG 64" in text and "#undef WG" in text and "#undef TWICE" in text
    assert "#define helper v3_helper" in text and "#define gptr v3_gptr" in text and "#define unused v3_unused" in text
    head = text[text.index("PK_NOINLINE void pk_v3("):]
    assert head.startswith("PK_NOINLINE void pk_v3(__local uchar* pk_pool, int pk_g0, int pk_g1, int pk_n0, int pk_n1, "
                           "__global const int* step, gptr out, int n)")
    body = head[:head.index("\n}\n")]
    assert "__local float *buf = (__local float*)pk_cur; pk_cur += PK_A16(sizeof(float) * (WG));" in body
    assert "__local float (*other)[WG] = (__local float (*)[WG])pk_cur;" in body
    assert "#define last (*pk_s_last)" in body and "__local float buf[" not in body
    # the virtual ids only inside the function; the narrow group's ids and barrier everywhere
    assert text.index("#define get_group_id(d) ((d) ? pk_g1 : pk_g0)") < text.index("void pk_v3(")
    assert text.index("#undef get_group_id") < text.index("__kernel void unused")
    assert "#define get_local_id(d) ((d) ? 0 : (get_local_id(0) & 63))" in text
    assert "#define barrier(f) pk_named_barrier(64)" in text
    wide, _ = variant_source(Variant(SOURCE, ("-DWG=128",), "body", 128), "v4", 128, named_barriers=True)
    assert "pk_named_barrier" not in wide and "#define get_local_id" not in wide
