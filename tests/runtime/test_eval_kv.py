"""tools/eval_kv.py --quick on a random tiny model: the JSON's rows, a full-cache perplexity equal to
the interpreter's, and a budget the text never exceeds scoring exactly as the full cache."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.models.tiny import make_model
from llmrs.runtime.model import Model

TOOL = Path(__file__).resolve().parents[2] / "tools" / "eval_kv.py"
BUDGETS = (8, 16, 128)     # 128 (+ 8 headroom) holds all 72 teacher-forced tokens: nothing evicted


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("eval_kv", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eval_kv"] = mod          # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["eval_kv"]


@pytest.fixture(scope="module")
def result(tool, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_kv")
    model = make_model(root / "m", "tiny", seed=11)
    plan = root / "m.plan.bin"
    assert compile_main([str(model), "-o", str(plan), "--weights", "f32", "--kv-type", "f32", "--target", "cpu",
                         "--max-seq-len", "256", "--prefill-chunk", "16", "-q"]) == 0
    out = root / "kv.json"
    assert tool.main([str(plan), "--quick", "--budgets", ",".join(map(str, BUDGETS)), "-o", str(out)]) == 0
    return plan, json.loads(out.read_text())


def test_the_quick_run_writes_one_row_per_policy_and_budget(result, tool):
    _, res = result
    assert {"machine", "date", "text", "settings", "rows", "compile_command"} <= set(res)
    rows = res["rows"]
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", None)] + [
        (p, b) for b in BUDGETS for p in tool.POLICIES]
    for r in rows:
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and abs(math.log(r["ppl"]) - r["nll"]) < 1e-9
        assert 0 <= r["top1_agreement"] <= 1 and 0 <= r["greedy_agreement"] <= 1 and 0 <= r["passkey"] <= 1
        assert 0 <= r["passkey_fit"] <= 1
        assert len(r["passkey_answers"]) == res["settings"]["passkey_trials"]
        assert (r["evictions"] > 0) == (r["budget"] in (8, 16))
    full = rows[0]
    assert full["top1_agreement"] == full["greedy_agreement"] == 1.0
    for r in rows:
        if r["budget"] == 128:   # never evicted while teacher-forced: the full cache's numbers
            assert r["top1_agreement"] == r["greedy_agreement"] == 1.0
            assert r["ppl"] == pytest.approx(full["ppl"], rel=1e-6)
    # a random model: an 8-slot cache changes some argmax somewhere
    assert min(r["top1_agreement"] for r in rows if r["budget"] == 8) < 1.0


def test_the_full_cache_perplexity_is_the_interpreters(result, tool):
    plan, res = result
    st = res["settings"]
    ref = Model.load(plan, "reference")
    ids = tool.held_out(ref, Path(res["text"]), st["tokens"])
    logits = ref.logits(ids).astype(np.float64)              # row i predicts token i + 1
    rows = logits[st["score_from"] - 1:-1]
    lse = rows.max(axis=1) + np.log(np.exp(rows - rows.max(axis=1, keepdims=True)).sum(axis=1))
    nll = lse - rows[np.arange(len(rows)), ids[st["score_from"]:]]
    assert res["rows"][0]["ppl"] == pytest.approx(float(np.exp(nll.mean())), rel=1e-5)


def test_bad_arguments_are_one_line_errors(tool, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main([str(tmp_path / "p.bin"), "-o", str(tmp_path / "o.json"), "--budgets", "8,x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budgets '8,x': give numbers separated by commas" in err


@pytest.fixture(scope="module")
def plot_tool():
    spec = importlib.util.spec_from_file_location("plot_kv", TOOL.with_name("plot_kv.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plot_kv_writes_a_png_and_the_table(result, plot_tool, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _, res = result
    (tmp_path / "kv.json").write_text(json.dumps(res))
    assert plot_tool.main([str(tmp_path / "kv.json"), "-o", str(tmp_path / "kv.png"), "--table"]) == 0
    assert (tmp_path / "kv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + len(BUDGETS) + 1 and table[-1].startswith("| full | ")
    assert f"{res['rows'][0]['ppl']:.2f} / 1.00 / 1.00 / " in table[-1]


def test_plot_kv_without_matplotlib_says_so_in_one_line(result, plot_tool, tmp_path, capsys, monkeypatch):
    _, res = result
    (tmp_path / "kv.json").write_text(json.dumps(res))
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib now fails
    assert plot_tool.main([str(tmp_path / "kv.json"), "-o", str(tmp_path / "kv.png")]) == 2
    err = capsys.readouterr().err
    assert err == "plot_kv.py: error: matplotlib is not installed (pip install matplotlib)\n"
