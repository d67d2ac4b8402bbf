"""Chained decode launches (runtime/backends/opencl_chain.py) on PoCL: a step whose matvec runs are
one launch each gives the bits and greedy tokens of the launch-by-launch step (itself the
interpreter's for f32 weights), on every family's golden model; a chain that gives up waiting is
rerun launch by launch; which launches chain."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from llmrs.compiler.codegen.opencl import generate
from llmrs.compiler.codegen.opencl_tuning import OpenCLTuning

from ..conftest import rel_err, run_steps
from .test_opencl_persistent import FEED, PROMPT, _decode, _graphs

cl = pytest.importorskip("pyopencl")
from llmrs.runtime.backends.opencl import OpenCLBackend  # noqa: E402
from llmrs.runtime.backends.opencl_chain import chain_runs  # noqa: E402

pytestmark = pytest.mark.usefixtures("opencl_device")


def _backend(graphs, monkeypatch, on: bool) -> OpenCLBackend:
    monkeypatch.setenv("LLMRS_OPENCL_CHAIN", "1" if on else "0")
    monkeypatch.delenv("LLMRS_OPENCL_PERSISTENT", raising=False)
    return OpenCLBackend.from_graphs(graphs, generate(graphs, OpenCLTuning()))


@pytest.fixture(scope="module")
def qwen3_gqa(tmp_path_factory):
    """A Qwen3 of head_dim 64 with GQA: per-head q/k norms in the QKV epilogue."""
    from llmrs.models.tiny import make_model
    return make_model(tmp_path_factory.mktemp("q3c") / "m", "tiny", 3, "f32", family="qwen3", head_dim=64,
                      num_attention_heads=4, num_key_value_heads=2)


SLOW = pytest.mark.slow   # the sweep's other families run under -m slow (the README's command stays short)


@pytest.mark.parametrize("model,weights,kv", [
    ("golden-b", "q4_0", "f16"),
    ("qwen3_gqa", "q8_0", "q8_0"),
    pytest.param("golden-a", "f32", "f32", marks=SLOW),
    pytest.param("golden-c", "f32", "f32", marks=SLOW),      # head_dim 100, MQA
    pytest.param("qwen2-a", "q4_1", "f32", marks=SLOW),      # q/k/v biases
])
def test_a_chained_decode_step_has_the_bits_and_greedy_tokens_of_the_launches(model, weights, kv, monkeypatch,
                                                                             request):
    graphs = _graphs(request.getfixturevalue(model) if model == "qwen3_gqa" else model, weights, kv)
    launches = _backend(graphs, monkeypatch, False)
    want, want_greedy = _decode(launches)
    be = _backend(graphs, monkeypatch, True)
    got, got_greedy = _decode(be)
    step = launches._step_launches("decode", 1)
    ch = be._chains[("decode", 1, "logits", False)]
    if ch is None:   # NVIDIA's driver may refuse a chain its matvecs' group size (round 22): it launches
        assert any("chained decode" in n for n in be.build_notes)
    else:
        assert be.build_notes == [] and be.chained
        # every layer's o_proj, gate_up, down and the next QKV (or the head) as one launch
        layers = graphs["decode"].meta.get("n_layers") or sum(1 for k, *_ in step if k.function_name.startswith("attention"))
        assert len(ch.kernels) == layers and len(ch.launches) == len(step) - 3 * layers
    np.testing.assert_array_equal(got, want)
    assert got_greedy == want_greedy
    if weights == "f32":   # and both are the interpreter's, as the launches are
        _, steps = run_steps(graphs["prefill"], graphs["decode"], PROMPT, FEED)
        assert rel_err(got, np.stack(steps)) < 1e-4


@pytest.mark.parametrize("groups", [1, 3])
def test_fewer_groups_than_tickets_take_ticket_after_ticket_with_the_same_bits(groups, monkeypatch):
    """LLMRS_OPENCL_CHAIN_GROUPS caps a chain's groups: each takes tickets until none is left
    (one group: every virtual group of every launch in ticket order, its waits all on its own
    earlier tickets)."""
    graphs = _graphs("golden-b", "q4_0", "f16")
    want, want_greedy = _decode(_backend(graphs, monkeypatch, False))
    monkeypatch.setenv("LLMRS_OPENCL_CHAIN_GROUPS", str(groups))
    be = _backend(graphs, monkeypatch, True)
    got, got_greedy = _decode(be)
    ch = be._chains[("decode", 1, "logits", False)]
    if ch is None:
        pytest.skip("this driver does not chain the plan's matvecs")
    assert all(g[0] == groups * l[0] for k, g, l in ch.launches if k in ch.kernels)
    np.testing.assert_array_equal(got, want)
    assert got_greedy == want_greedy


def test_a_chain_that_gives_up_waiting_is_rerun_launch_by_launch(monkeypatch):
    graphs = _graphs("golden-b", "q4_0", "f16")
    want, want_greedy = _decode(_backend(graphs, monkeypatch, False))
    be = _backend(graphs, monkeypatch, True)
    be.reset()
    be.run("prefill", PROMPT, 0, 0)
    got = [be.run("decode", FEED[:1], 8, 8)[0]]          # a chained step
    ch = be._chains[("decode", 1, "logits", False)]
    if ch is None:
        pytest.skip("this driver does not chain the plan's matvecs")
    ch.reset_sync(abort=True)                            # as a group that waited too long leaves it
    with pytest.warns(UserWarning, match="chained decode step timed out"):
        got += [be.run("decode", FEED[i:i + 1], 8 + i, 8 + i)[0] for i in range(1, len(FEED))]
    np.testing.assert_array_equal(np.stack(got), want)
    assert not be.chained and any("kernel by kernel" in n for n in be.build_notes)
    assert _decode(be)[1] == want_greedy                 # greedy steps now launch kernel by kernel


def test_greedy_steps_whose_chain_gives_up_are_rerun_from_their_first_step(monkeypatch):
    graphs = _graphs("golden-b", "q4_0", "f16")
    want = _decode(_backend(graphs, monkeypatch, False))[1]
    be = _backend(graphs, monkeypatch, True)
    assert _decode(be)[1] == want
    ch = be._chains[("greedy", False)]
    if ch is None:
        pytest.skip("this driver does not chain the plan's matvecs")
    ch.reset_sync(abort=True)
    with pytest.warns(UserWarning, match="timed out"):
        assert _decode(be)[1] == want


def test_a_spin_of_one_read_still_gives_the_launches_tokens(monkeypatch):
    """A group that finds the launch before it unfinished gives up at once: whether or not a step
    did, nothing hangs and the logits and tokens are the launches'."""
    graphs = _graphs("golden-a", "f32", "f32")
    want = _decode(_backend(graphs, monkeypatch, False))
    monkeypatch.setenv("LLMRS_OPENCL_PERSISTENT_SPIN", "1")
    be = _backend(graphs, monkeypatch, True)
    with warnings.catch_warnings(record=True):   # a step may or may not give up
        got = _decode(be)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]


def test_chaining_is_off_unless_asked(monkeypatch):
    graphs = _graphs("golden-a", "f32", "f32")
    monkeypatch.delenv("LLMRS_OPENCL_CHAIN", raising=False)
    be = OpenCLBackend.from_graphs(graphs, generate(graphs, OpenCLTuning()))
    _decode(be)
    assert not be.chained and be._chains == {}


def _launch(name: str, local: int):
    return (SimpleNamespace(function_name=name), (local * 4, 1), (local, 1))


def test_runs_of_two_or_more_chainable_launches_of_the_group_size_chain():
    seq = [_launch("embedding", 64), _launch("matvec", 512), _launch("attention_decode", 128),
           _launch("matvec", 512), _launch("matvec", 512), _launch("matvec", 512), _launch("matvec", 512),
           _launch("attention_decode", 128), _launch("matvec", 512), _launch("matvec", 256),
           _launch("matvec", 256), _launch("argmax", 256)]
    assert chain_runs(seq, 512) == [(3, 7)]          # a lone matvec stays a launch
    assert chain_runs(seq, 256) == [(9, 11)]         # other sizes are not joined
    assert chain_runs(seq[:5], 512) == [(3, 5)]      # a run at the end of the list
    assert chain_runs([], 512) == []
