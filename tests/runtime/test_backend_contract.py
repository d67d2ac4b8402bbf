"""The back-end contract (runtime/backends/base.py), run against every back end open_backend opens
here: cpu, reference, opencl (PoCL), hybrid copying and mapping its cache across switches inside
the prompt and the decode, and auto. Every method, on one small plan (golden-a, f32 weights and
cache), checked against the interpreter run on the same graphs; then the options' one-line errors
and the rule that nothing probes a back end."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.compiler.interpret import Interpreter
from llmrs.runtime.backends import Backend, BackendOptionError, BackendOptions, open_backend
from llmrs.runtime.kv.store import NEVER, layer_states
from llmrs.runtime.plan import Plan

from ..conftest import DATA, rel_err

SLOTS, CHUNK = 32, 8
TOL = 1e-4                  # f32 everywhere: the back ends differ from numpy only in summation order
rng = np.random.default_rng(11)
PROMPT = rng.integers(3, 384, 19).astype(np.int32)      # golden-a's vocab is 384
DECODE = rng.integers(3, 384, 4).astype(np.int32)
KEEP = 11                   # slots a compaction keeps of the prompt's 19

KINDS = {
    "cpu": ("cpu", BackendOptions(threads=2)),
    "reference": ("reference", BackendOptions()),
    "opencl": ("opencl", BackendOptions()),
    # positions 0-4 on the CPU, 5-20 on the device (a prefill chunk cut at 5), the CPU again from 21
    "hybrid copy": ("hybrid", BackendOptions(threads=2, hybrid_kv="copy", switch_threshold=5, switch_back_at=21)),
    "hybrid map": ("hybrid", BackendOptions(threads=2, hybrid_kv="map", hybrid_start="opencl", switch_threshold=11)),
    "auto": ("auto", BackendOptions(threads=2)),
}
CLASSES = {"cpu": "CpuBackend", "reference": "ReferenceBackend", "opencl": "OpenCLBackend",
           "hybrid copy": "HybridBackend", "hybrid map": "HybridBackend", "auto": "HybridBackend"}


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    out = tmp_path_factory.mktemp("contract") / "golden-a.plan.bin"
    assert compile_main([str(DATA / "golden-a"), "-o", str(out), "--target", "cpu,opencl", "--weights", "f32",
                         "--kv-type", "f32", "--max-seq-len", str(SLOTS), "--prefill-chunk", str(CHUNK), "-q"]) == 0
    return Plan.open(out)


@pytest.fixture(scope="module", params=list(KINDS))
def opened(request, plan, tmp_path_factory):
    """(label, back end) for each kind; closed twice at the end (the second close does nothing)."""
    kind, options = KINDS[request.param]
    if kind != "cpu" and kind != "reference":
        request.getfixturevalue("opencl_device")     # skips naming Debian's PoCL where none builds kernels
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMRS_CACHE_DIR", str(tmp_path_factory.mktemp("calibration")))   # auto measures here
        be = open_backend(plan, kind, options)
    yield request.param, be
    be.close()
    be.close()


class Oracle:
    """The interpreter on the plan's own graphs, both phases sharing one state, as a back end would."""

    def __init__(self, plan: Plan):
        graphs = plan.graphs()
        self.it = {phase: Interpreter(g) for phase, g in graphs.items()}
        self.state = self.it["decode"].new_state()
        self.layers, self.ctl = layer_states(graphs["decode"])
        self.score_from(None)

    def run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        it = self.it[phase]
        return it.run({"tokens": tokens}, self.state, n_past=n_past, start_pos=start_pos)[it.graph.outputs[0]]

    def score_from(self, first: int | None) -> None:
        self.state[self.ctl][:] = (0, NEVER) if first is None else (1, first)

    def scores(self, n: int) -> np.ndarray:
        return np.stack([self.state[layer.scores][:, :n] for layer in self.layers])

    def compact(self, keep: np.ndarray) -> None:
        """Slot j of KV head h becomes old slot keep[layer, h, j] in K, V and the scores (numpy)."""
        k = keep.shape[-1]
        for li, layer in enumerate(self.layers):
            for name in (layer.k, layer.v):
                old = self.state[name].copy()          # [S, KVH, hd]
                for h in range(old.shape[1]):
                    self.state[name][:k, h] = old[keep[li, h], h]
            old = self.state[layer.scores].copy()      # [KVH, S]
            for h in range(old.shape[0]):
                self.state[layer.scores][h, :k] = old[h, keep[li, h]]
            self.state[layer.scores][:, k:] = 0


def _feed(step, prompt: np.ndarray, decode: np.ndarray) -> list[np.ndarray]:
    """step(phase, tokens, n_past, start_pos) over the prompt in chunks, then one decode token at a time."""
    outs = [step("prefill", prompt[s:s + CHUNK], s, s) for s in range(0, len(prompt), CHUNK)]
    n = len(prompt)
    return outs + [step("decode", decode[i:i + 1], n + i, n + i) for i in range(len(decode))]


@pytest.fixture(scope="module")
def want(plan) -> list[np.ndarray]:
    """The interpreter's last logits row of every step of PROMPT then DECODE."""
    return [out[-1] for out in _feed(Oracle(plan).run, PROMPT, DECODE)]


def test_open_backend_gives_a_backend_of_the_kind_asked_for(opened):
    label, be = opened
    assert isinstance(be, Backend) and type(be).__name__ == CLASSES[label]
    assert isinstance(be.name, str) and be.name.split()[0] == {"auto": "hybrid", "hybrid copy": "hybrid",
                                                               "hybrid map": "hybrid"}.get(label, label)
    assert isinstance(be.device_name, str) and bool(be.device_name) == (label not in ("cpu", "reference"))
    # OpenCL's verify graph is no CPU code: the CPU and hybrid (which starts on it) leave it out
    verify = {"verify"} if label in ("reference", "opencl") else set()
    assert set(be.graphs) == {"prefill", "decode", "step"} | verify and be.graphs["decode"].T == 1
    assert be.device_argmax is (label != "reference")


def test_run_gives_the_interpreters_logits(opened, want):
    _, be = opened
    be.reset()
    got = _feed(be.run, PROMPT, DECODE)
    assert all(out.dtype == np.float32 and out.ndim == 2 and out.shape[1] == 384 for out in got)
    for step, (out, ref) in enumerate(zip(got, want)):
        assert rel_err(out[-1], ref) <= TOL, f"step {step}"


def test_run_argmax_is_the_interpreters_greedy_choice(opened, want):
    _, be = opened
    # each logit lies within TOL * max|logit| of the interpreter's (test_run_...): a wider gap
    # between the two best cannot flip
    top2 = np.sort(np.stack(want), axis=-1)[:, -2:]
    assert np.all(top2[:, 1] - top2[:, 0] > 2 * TOL * np.abs(np.stack(want)).max())
    be.reset()
    rows = [len(out) for out in _feed(be.run, PROMPT, DECODE)]
    be.reset()
    got = _feed(be.run_argmax, PROMPT, DECODE)
    assert [len(out) for out in got] == rows and all(out.dtype == np.int32 and out.ndim == 1 for out in got)
    assert [int(out[-1]) for out in got] == [int(np.argmax(ref)) for ref in want]


def test_reset_forgets_the_cache(opened, plan):
    _, be = opened
    other = rng.integers(3, 384, 13).astype(np.int32)
    be.reset()
    _feed(be.run, other, DECODE)
    be.reset()
    oracle = Oracle(plan)
    got, ref = _feed(be.run, PROMPT[:9], DECODE[:2]), _feed(oracle.run, PROMPT[:9], DECODE[:2])
    assert max(rel_err(g[-1], r[-1]) for g, r in zip(got, ref)) <= TOL


def test_kv_store_scores_compacts_and_clears_as_the_interpreter(opened, plan):
    _, be = opened
    oracle = Oracle(plan)
    be.reset()
    store = be.kv_store()
    assert (store.n_layers, store.n_kv_heads, store.slots) == (2, 2, SLOTS)
    n = len(PROMPT)
    store.set_score_from(4)          # rows at slots 4.. add their attention to the scores
    oracle.score_from(4)
    _feed(be.run, PROMPT, DECODE[:0])
    _feed(oracle.run, PROMPT, DECODE[:0])
    assert store.scores(n).shape == (2, 2, n) and rel_err(store.scores(n), oracle.scores(n)) <= TOL
    # each layer and KV head keeps its own slots (SnapKV / H2O do)
    keep = np.sort(np.stack([[rng.choice(n, KEEP, replace=False) for _ in range(2)] for _ in range(2)]), axis=-1)
    store.compact(keep)
    oracle.compact(keep)
    assert rel_err(store.scores(KEEP), oracle.scores(KEEP)) <= TOL
    store.set_score_from(None)
    oracle.score_from(None)
    got = be.run("decode", DECODE[:1], KEEP, n)      # the RoPE position goes on from the prompt's end
    ref = oracle.run("decode", DECODE[:1], KEEP, n)
    assert rel_err(got[-1], ref[-1]) <= TOL
    assert rel_err(store.scores(KEEP), oracle.scores(KEEP)) <= TOL    # scoring off: unchanged
    store.clear_scores()
    assert not np.any(store.scores(SLOTS))


def test_report_lines_are_lines(opened):
    label, be = opened
    be.reset()
    _feed(be.run, PROMPT[:6], DECODE[:1])
    lines = be.report_lines()
    assert all(isinstance(line, str) and "\n" not in line for line in lines)
    # hybrid: its switches and each phase's side; the others add nothing
    assert bool(lines) == label.startswith(("hybrid", "auto"))
    if label == "hybrid copy":
        assert "switch            cpu -> opencl at position 5 (prefill), 5 live slots" in "\n".join(lines)


# -- options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("values, says", [
    ({"threads": 0}, "threads 0: need 1 to 1024"),
    ({"threads": True}, "threads True: need 1 to 1024"),
    ({"device": -1}, "device -1: give a device index (0 or more) or a name"),
    ({"device": 1.5}, "device 1.5: give a device index (0 or more) or a name"),
    ({"hybrid_start": "gpu"}, "hybrid_start 'gpu': choose cpu or opencl"),
    ({"switch_threshold": -1}, "switch_threshold must be 0 or more, got -1"),
    ({"switch_back_at": 0}, "switch_back_at must be at least 1, got 0"),
    ({"switch_threshold": 9, "switch_back_at": 9}, "switch_back_at 9 must come after switch_threshold 9"),
    ({"hybrid_kv": "share"}, "hybrid_kv 'share': choose one of auto, copy, map"),
    ({"recalibrate": "yes"}, "recalibrate must be True or False, got 'yes'"),
])
def test_bad_options_are_one_line_errors_naming_the_field(values, says):
    with pytest.raises(ValueError) as err:
        BackendOptions(**values)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


@pytest.mark.parametrize("kind, values, says", [
    ("cpu", {"switch_threshold": 3}, "switch_threshold goes with backend hybrid"),
    ("auto", {"hybrid_kv": "copy"}, "hybrid_kv goes with backend hybrid"),
    ("hybrid", {"recalibrate": True}, "recalibrate goes with backend auto"),
    ("gpu", {}, "backend 'gpu': choose one of cpu, opencl, reference, hybrid, auto"),
])
def test_an_option_another_kind_takes_is_refused_before_anything_opens(kind, values, says):
    with pytest.raises(ValueError, match=f"^{re.escape(says)}$"):
        open_backend(None, kind, BackendOptions(**values))     # no plan: nothing is opened


def test_a_command_line_names_the_flags_instead():
    with pytest.raises(BackendOptionError) as err:
        BackendOptions(switch_threshold=9, switch_back_at=4)
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    assert err.value.worded(flag) == "--switch-back-at 4 must come after --switch-threshold 9"


# -- the rule ---------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
BACKEND_NAMES = re.compile(r"\b(backend|be|cpu|opencl|hybrid|side)\b")


def test_nothing_probes_a_back_end_with_hasattr_or_getattr():
    found = []
    for path in sorted([*(ROOT / "runtime").rglob("*.py"), *(ROOT / "llmrs").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("hasattr", "getattr") and node.args \
                    and BACKEND_NAMES.search(ast.unparse(node.args[0])):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_hybrid_back_end_uses_only_what_its_sides_publish():
    """Its sides' contract methods and their documented sharing methods, never their internals."""
    from llmrs.runtime.backends.cpu import CpuBackend
    from llmrs.runtime.backends.opencl import OpenCLBackend
    published = {"cpu": {*Backend.__abstractmethods__, *Backend.__annotations__, "kv_region"},
                 "opencl": {*Backend.__abstractmethods__, *Backend.__annotations__, "shares_kv", "map_kv",
                            "unmap_kv", "copy_kv"}}
    assert published["cpu"] <= set(dir(CpuBackend)) | set(Backend.__annotations__)
    assert published["opencl"] <= set(dir(OpenCLBackend)) | set(Backend.__annotations__)
    tree = ast.parse((ROOT / "runtime" / "backends" / "hybrid.py").read_text())
    used = {(node.value.attr, node.attr) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr in published
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}
    assert used and {(side, attr) for side, attr in used if attr not in published[side]} == set()
