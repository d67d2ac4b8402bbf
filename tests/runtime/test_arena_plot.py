"""llmrs-inspect --plot: the arena picture draws every arena tensor at its planned offset and size."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmrs.runtime import inspect
from llmrs.runtime.plan import Plan


PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def plan(measure_plan) -> Path:
    return measure_plan


def test_arena_picture_draws_the_plans_offsets_sizes_and_lifetimes(plan, tmp_path):
    pytest.importorskip("matplotlib", reason="pip install 'llmrs[plot]'")
    from llmrs.measure.plotting import plot_arena

    graphs = Plan.open(plan).graphs()
    out = tmp_path / "arena.png"
    drawn = plot_arena(graphs, out)
    assert out.read_bytes()[:8] == PNG and set(drawn) == {"prefill", "decode"}
    for phase, rects in drawn.items():
        g, lay = graphs[phase], graphs[phase].meta["layout"]
        # every tensor of the layout, once, at its offset and with its size
        assert sorted(r.name for r in rects) == sorted(lay["arena"])
        for r in rects:
            assert r.offset == lay["arena"][r.name] and r.nbytes == g.values[r.name].nbytes
            assert r.offset + r.nbytes <= lay["arena_bytes"]
        # lifetimes from the ops themselves: a tensor spans the op that makes it and every reader
        by = {r.name: r for r in rects}
        for i, op in enumerate(g.ops):
            for name in op.outputs:
                if name in by:
                    assert by[name].first_op == i
            for name in op.inputs:
                if name in by:
                    assert by[name].first_op <= i < by[name].end_op
        # no two drawn tensors share bytes while both live, but for the plan's in-place pairs
        pairs = {frozenset(p) for p in lay["inplace"].items()}
        for a in rects:
            for b in rects:
                if a.name < b.name and frozenset((a.name, b.name)) not in pairs:
                    in_time = a.first_op < b.end_op and b.first_op < a.end_op
                    in_space = a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes
                    assert not (in_time and in_space), (a, b)
        # the most bytes live at one op, an in-place output counted inside the tensor it takes
        # over where both meet, is the lower bound the picture marks
        live = [sum(r.nbytes for r in rects if r.first_op <= i < r.end_op)
                - sum(by[o].nbytes for o, src in lay["inplace"].items() if by[o].first_op == i == by[src].end_op - 1)
                for i in range(len(g.ops))]
        assert max(live) == lay["lower_bound_bytes"] <= lay["arena_bytes"]


def test_inspect_plot_cli_and_missing_matplotlib(plan, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason="pip install 'llmrs[plot]'")
    out = tmp_path / "a.png"
    assert inspect.main([str(plan), "--no-layout", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    assert "arena picture" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib now raises ImportError
    assert inspect.main([str(plan), "--plot", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "llmrs-inspect: error: pictures need matplotlib: pip install 'llmrs[plot]' (matplotlib)"
