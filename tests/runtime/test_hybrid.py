"""--backend hybrid: the same plan on the CPU and on OpenCL (PoCL here), the KV cache handed over
at switches before, inside and after the prompt, in both directions, mapped or copied; the greedy
tokens must be those of either back end alone, and a copy moves exactly the live slots."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.models.tiny import make_model
from llmrs.runtime.backends.hybrid import HybridBackend, Schedule, live_kv_bytes
from llmrs.runtime.backends.opencl_launch import OpenCLError
from llmrs.runtime.cli import main as run_main
from llmrs.runtime.engine import Engine
from llmrs.runtime.kv import CacheManager, make_policy
from llmrs.runtime.kv.store import NEVER
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..conftest import DATA

pytestmark = pytest.mark.usefixtures("opencl_device")

N_NEW = 10
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 300, 19)]   # ids every test vocab has


KV_TYPES = {"golden-a": "f16", "tiny-q8_0": "q8_0", "tiny-q4_0": "q4_0"}     # the others: f32
ROW_BYTES = {"f32": lambda hd: 4 * hd, "f16": lambda hd: 2 * hd, "q8_0": lambda hd: hd // 32 * 34,
             "q4_0": lambda hd: hd // 32 * 18}


def _compile(src, out, kv="f32", slots=64, chunk=8):
    # f32 weights: the back ends then differ only in summation order, which greedy tokens survive
    assert compile_main([str(src), "-o", str(out), "--weights", "f32", "--kv-type", kv, "--max-seq-len",
                         str(slots), "--prefill-chunk", str(chunk), "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    """name -> plan file, each compiled on first use, once for the module."""
    made = {}

    def get(name):
        if name not in made:
            tmp = tmp_path_factory.mktemp(name)
            if name == "odd":
                src = make_model(tmp / "odd", "tiny", seed=3, hidden_size=144, intermediate_size=256,
                                 num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=48,
                                 vocab_size=512)
            elif name in ("tiny-q8_0", "tiny-q4_0"):    # head_dim 32: a cache row is one block per head
                src = make_model(tmp / "tiny", "tiny", seed=4, num_hidden_layers=2, intermediate_size=256,
                                 vocab_size=512)
            else:
                src = DATA / name
            made[name] = _compile(src, tmp / "plan.bin", KV_TYPES.get(name, "f32"))
        return made[name]
    return get


@pytest.fixture(scope="module", params=["golden-a", "golden-b", "golden-c", "odd", "tiny-q8_0", "tiny-q4_0"])
def loaded(request, plan_files):
    """(plan, {kv mode: HybridBackend}) for each golden model (golden-a with an f16 cache), one of odd
    shape (head_dim 48, GQA 9:3) and one with a q8_0 cache, one with a q4_0 cache."""
    plan = Plan.open(plan_files(request.param))
    sides = {mode: HybridBackend.load(plan, Schedule("cpu", NEVER), mode, threads=2) for mode in ("copy", "map")}
    yield plan, sides
    for h in sides.values():
        h.close()


def _generate(plan, backend, schedule, policy=None, prompt=PROMPT, n=N_NEW):
    backend.schedule = schedule
    backend.failed = None
    backend.reset()
    backend.clear_report()
    m = plan.manifest
    cache = None
    if policy is not None:
        cache = CacheManager(make_policy(*policy), backend.kv_store())
    engine = Engine(backend, int(m["prefill_chunk"]), int(m["max_seq_len"]), (), cache=cache)
    return engine.generate(prompt, n, Sampler(SamplerConfig())).tokens


P = len(PROMPT)
SCHEDULES = {
    "cpu prefill, opencl decode": Schedule("cpu"),
    "opencl prefill, cpu decode": Schedule("opencl"),
    "before the prompt": Schedule("opencl", 0),
    "inside the prompt, a chunk cut": Schedule("cpu", 5, P + 3),
    "inside the prompt, from opencl": Schedule("opencl", 11),
    "after the prompt and back": Schedule("cpu", P + 2, P + 6),
    "decode on cpu, back to opencl": Schedule("opencl", None, P + 4),
}


def test_hybrid_tokens_equal_either_back_end_alone(loaded):
    plan, sides = loaded
    h = sides["copy"]
    want = _generate(plan, h, Schedule("cpu", NEVER))
    assert _generate(plan, h, Schedule("opencl", NEVER)) == want
    assert not h.switches
    for mode, backend in sides.items():
        for what, schedule in SCHEDULES.items():
            assert _generate(plan, backend, schedule) == want, (mode, what)
            assert backend.switches, (mode, what)
            for e in backend.switches:
                assert e.live_slots == e.position       # no eviction: slot i holds position i
                assert e.kv_bytes == (0 if mode == "map" else live_kv_bytes(h.graph, e.live_slots))


def test_a_copy_moves_the_live_slots_only(loaded):
    """bytes == sum over layers of live slots x a slot's row (all KV heads) for K and V, from the
    model's config; and the device then holds exactly the CPU's rows."""
    plan, sides = loaded
    h = sides["copy"]
    cfg = plan.manifest["model"]
    kvh = cfg["num_key_value_heads"]
    hd = cfg["head_dim"]
    layers = cfg["num_hidden_layers"]
    _generate(plan, h, Schedule("cpu", P + 3))
    (e,) = h.switches
    assert (e.src, e.dst, e.position, e.live_slots) == ("cpu", "opencl", P + 3, P + 3)
    row = ROW_BYTES[plan.manifest["compile_options"]["kv_type"]](hd)
    assert e.kv_bytes == layers * 2 * (P + 3) * kvh * row < layers * 2 * h.slots * kvh * row
    for s in h.kv_states:
        live = (P + 3) * s.row_bytes
        buf, off = h.opencl.kv.locate(s.offset, live, s.name)
        dev = np.empty(live, np.uint8)
        import pyopencl as cl
        cl.enqueue_copy(h.opencl.queue, dev, buf, src_offset=off, is_blocking=True)
        assert dev.any()
        # the device went on writing after the switch; the rows before it are the CPU's
        np.testing.assert_array_equal(dev, h.cpu.kv[s.offset:s.offset + live])


@pytest.mark.parametrize("policy", [("sliding", 12, 2), ("h2o", 12, 2), ("snapkv", 12, 2, 4)])
def test_eviction_runs_across_switches(loaded, policy):
    plan, sides = loaded
    h = sides["copy"]
    want = _generate(plan, h, Schedule("cpu", NEVER), policy, n=14)
    assert _generate(plan, h, Schedule("opencl", NEVER), policy, n=14) == want
    for mode, backend in sides.items():
        for schedule in (Schedule("cpu"), Schedule("cpu", 11, P + 5), Schedule("opencl", P + 3, P + 8)):
            assert _generate(plan, backend, schedule, policy, n=14) == want, (mode, schedule)
            for e in backend.switches:
                if e.position > policy[1] + policy[2]:     # evicted by then: fewer than the positions
                    assert e.live_slots < e.position
                    assert mode == "map" or e.kv_bytes < live_kv_bytes(h.graph, e.position)
                assert e.kv_bytes == (0 if mode == "map" else live_kv_bytes(h.graph, e.live_slots))


def _fail_at(monkeypatch, backend, after_calls):
    calls = {"n": 0}
    for name in ("run", "run_argmax"):
        real = getattr(backend.opencl, name)

        def failing(*a, _real=real, **k):
            calls["n"] += 1
            if calls["n"] > after_calls:
                raise OpenCLError("pthread: launching kernel matmul failed (CL_OUT_OF_RESOURCES)")
            return _real(*a, **k)
        monkeypatch.setattr(backend.opencl, name, failing)


@pytest.mark.parametrize("readback", [True, False])
def test_a_device_failure_goes_on_on_the_cpu(loaded, monkeypatch, readback):
    plan, sides = loaded
    h = sides["copy"]
    want = _generate(plan, h, Schedule("cpu", NEVER))
    notices = []
    monkeypatch.setattr(h, "notice", notices.append)
    _fail_at(monkeypatch, h, 3)
    if not readback:        # the device is gone: the CPU refills the cache from the tokens fed
        copy = h._copy

        def lost(dst, n_past):
            if dst == "cpu":
                raise OpenCLError("device lost")
            return copy(dst, n_past)
        monkeypatch.setattr(h, "_copy", lost)
    # prefill on the CPU, decode on the failing device
    got = _generate(plan, h, Schedule("cpu"))
    assert got == want
    assert len(notices) == 1 and "OpenCL device failed" in notices[0]
    last = h.switches[-1]
    assert (last.src, last.dst, last.reason) == ("opencl", "cpu", "device failure")
    assert last.mode == ("copy" if readback else "refill")
    assert all(side == "cpu" for (_, side) in h.phases if _ == "decode" and h.phases[(_, side)].tokens > 3)
    monkeypatch.undo()
    h.failed = None


def test_a_device_that_fails_to_take_the_cache_leaves_it_on_the_cpu(loaded, monkeypatch):
    plan, sides = loaded
    h = sides["copy"]
    want = _generate(plan, h, Schedule("cpu", NEVER))
    notices = []
    monkeypatch.setattr(h, "notice", notices.append)
    copy = h._copy

    def refused(dst, n_past):
        if dst == "opencl" and n_past:
            raise OpenCLError("clEnqueueWriteBuffer failed (CL_OUT_OF_RESOURCES)")
        return copy(dst, n_past)
    monkeypatch.setattr(h, "_copy", refused)
    assert _generate(plan, h, Schedule("cpu", 7, P + 4)) == want
    assert len(notices) == 1 and "at position 7" in notices[0]
    assert not h.switches and {side for _, side in h.phases} == {"cpu"}
    monkeypatch.undo()
    h.failed = None


def test_llmrs_run_hybrid_stats_and_flags(plan_files, tmp_path, capsys):
    plan = plan_files("golden-b")
    args = [str(plan), "--raw", "--prompt", "The quick brown fox jumps over the lazy dog", "-n", "6"]
    assert run_main(args + ["--dump-logits", str(tmp_path / "cpu.npz")]) == 0
    capsys.readouterr()
    assert run_main(args + ["--backend", "hybrid", "--hybrid-kv", "copy", "--switch-threshold", "5",
                            "--switch-back-at", "36", "--stats", "--dump-logits", str(tmp_path / "h.npz")]) == 0
    err = capsys.readouterr().err
    np.testing.assert_array_equal(np.load(tmp_path / "h.npz")["tokens"], np.load(tmp_path / "cpu.npz")["tokens"])
    g = Plan.open(plan).graphs()["decode"]
    assert f"switch            cpu -> opencl at position 5 (prefill), 5 live slots: " \
           f"{live_kv_bytes(g, 5) / 1024:.1f} KiB K/V copied in" in err
    assert "switch            opencl -> cpu at position 36 (decode), 36 live slots:" in err
    assert "prefill on opencl" in err and "decode on cpu" in err and "tok/s" in err
    for bad, says in [(["--switch-threshold", "4"], "--switch-threshold goes with --backend hybrid"),
                      (["--backend", "hybrid", "--switch-threshold", "9", "--switch-back-at", "9"],
                       "--switch-back-at 9 must come after --switch-threshold 9"),
                      (["--backend", "hybrid", "--switch-threshold", "-1"], "must be 0 or more"),
                      (["--backend", "hybrid", "--recalibrate"], "--recalibrate goes with --backend auto")]:
        assert run_main(args + bad) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_backend_auto_measures_once_and_says_what_it_chose(plan_files, tmp_path, monkeypatch, capsys):
    plan = plan_files("golden-a")
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path / "cache"))
    args = [str(plan), "--raw", "--prompt", "Hello there", "-n", "5", "--dump-logits"]
    assert run_main(args + [str(tmp_path / "cpu.npz")]) == 0
    assert run_main(args + [str(tmp_path / "auto.npz"), "--backend", "auto"]) == 0
    first = capsys.readouterr().err
    assert "measuring prefill and decode" in first and "measured now, cached in" in first
    line = next(l for l in first.splitlines() if "--backend auto: prefill on" in l)
    assert " tok/s; " in line and ", decode on " in line
    assert (tmp_path / "cache" / "calibration.json").is_file()
    assert run_main(args + [str(tmp_path / "auto2.npz"), "--backend", "auto"]) == 0
    second = capsys.readouterr().err
    assert "measuring" not in second and f"cached in {tmp_path / 'cache' / 'calibration.json'}" in second
    for f in ("auto.npz", "auto2.npz"):
        np.testing.assert_array_equal(np.load(tmp_path / f)["tokens"], np.load(tmp_path / "cpu.npz")["tokens"])


def test_the_python_api_passes_hybrid_options(plan_files):
    import llmrs
    plan = plan_files("golden-b")
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 300, 12)]
    want = llmrs.load(plan, backend="cpu", threads=2).generate(ids, max_tokens=8)
    list(want)   # run it
    want_tokens = want.tokens
    with llmrs.load(plan, backend="hybrid", threads=2, switch_threshold=4, switch_back_at=15,
                    hybrid_kv="copy", hybrid_start="opencl") as model:
        got = model.generate(ids, max_tokens=8)
        list(got)
        assert got.tokens == want_tokens
        assert [(e.src, e.position) for e in model.backend.switches] == [("opencl", 4), ("cpu", 15)]
    # CPU prefill, OpenCL decode, over two turns: the second prompt starts with the cached first
    # turn, so its prefill takes the cache back from the device before its new tokens
    turns = {}
    for backend in ("cpu", "hybrid"):
        with llmrs.load(plan, backend=backend, threads=2, hybrid_kv="copy" if backend == "hybrid" else "auto") as model:
            first = model.generate(ids, max_tokens=5)
            list(first)
            second = model.generate(ids + first.tokens + ids[:4], max_tokens=5)
            list(second)
            assert second.cached_tokens == len(ids) + 4       # the cache held the first turn (its last token unfed)
            turns[backend] = first.tokens + second.tokens
            if backend == "hybrid":
                assert [(e.src, e.dst, e.position, e.live_slots) for e in model.backend.switches] == [
                    ("cpu", "opencl", len(ids), len(ids)), ("opencl", "cpu", len(ids) + 4, len(ids) + 4),
                    ("cpu", "opencl", len(ids) + 9, len(ids) + 9)]
    assert turns["hybrid"] == turns["cpu"]
    with pytest.raises(ValueError, match="^switch_back_at goes with backend hybrid$"):
        llmrs.load(plan, backend="cpu", switch_back_at=3)


def test_the_real_model_switches_and_keeps_its_tokens(smollm2_plan):
    """SmolLM2-135M (Q4_1, 30 layers, GQA 9:3): 16 greedy tokens of tests/runtime/test_real_model.py's
    question (whose tokens CPU and OpenCL agree on), the cache copied to the device after the prompt
    and back to the CPU six tokens later, against the CPU alone. (PoCL's prefill of this model is
    slow, so the switches inside a prompt are the small models' tests.)"""
    from llmrs.runtime.model import Model
    question = [{"role": "user", "content": "What is the largest ocean on Earth?"}]
    with Model.load(smollm2_plan, backend="hybrid", threads=2, hybrid_kv="copy", switch_threshold=40) as model:
        ids = model.tokenize(model.render_chat(question), add_special_tokens=False)
        p = len(ids)
        runs = {}
        for name, schedule in [("cpu alone", Schedule("cpu", NEVER)),
                               ("cpu to opencl after the prompt, and back", Schedule("cpu", p + 3, p + 9))]:
            model.backend.schedule = schedule
            model.engine.reset()         # (model.reset() rewinds: the cache would stay on its side)
            model.backend.clear_report()
            got = model.generate(ids, max_tokens=16)
            list(got)
            runs[name] = got.tokens
        assert model.detokenize(runs["cpu alone"]).startswith("The largest ocean on Earth is the Pacific Ocean")
        assert runs["cpu to opencl after the prompt, and back"] == runs["cpu alone"]
        switches = model.backend.switches
        assert [(e.src, e.dst, e.position) for e in switches] == [("cpu", "opencl", p + 3), ("opencl", "cpu", p + 9)]
        for e in switches:
            assert e.kv_bytes == 30 * 2 * e.live_slots * 3 * 64 * 4      # layers x K,V x slots x KV heads x head_dim x f32


def test_shared_memory_is_detected_from_the_device(plan_files):
    import pyopencl as cl
    from llmrs.runtime.backends.hybrid import shares_host_memory

    class Dev:
        def __init__(self, kind, unified):
            self.type, self.host_unified_memory = kind, unified
    assert shares_host_memory(Dev(cl.device_type.GPU, 1))          # a phone's GPU
    assert not shares_host_memory(Dev(cl.device_type.GPU, 0))      # a discrete GPU
    assert shares_host_memory(Dev(cl.device_type.CPU, 0))          # PoCL
    h = HybridBackend.load(Plan.open(plan_files("golden-b")), Schedule("cpu"), "auto", threads=1)
    try:
        assert h.kv_mode == ("map" if shares_host_memory(h.opencl.device) else "copy")
    finally:
        h.close()
