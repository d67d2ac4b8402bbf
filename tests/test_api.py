"""The Python API (llmrs.compile, llmrs.load) as the README shows it: its example runs as written."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

import llmrs

from .conftest import DATA
from .runtime.chat_plans import CHAT_KEYS, manifest_extras

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE_MODEL = '"SmolLM2-135M-Instruct-Q4_1.gguf"'


def _readme_example() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path))
    code = _readme_example()
    assert EXAMPLE_MODEL in code
    # the real model comes with its chat template; the committed tiny one gets it here
    code = code.replace(EXAMPLE_MODEL, repr(str(DATA / "golden-a")))
    scope, out = {}, io.StringIO()
    with manifest_extras(**CHAT_KEYS), contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), scope)
    plan, model, reply, answer, ids = (scope[k] for k in ("plan", "model", "reply", "answer", "ids"))
    assert plan.parent == tmp_path / "plans" and plan.name.startswith("golden-a-") and plan.is_file()
    assert model.max_seq_len == 2048
    assert reply.finish_reason in ("stop", "length") and answer.finish_reason in ("stop", "length")
    # the second turn found the first one in the KV cache
    first_prompt = len(model.tokenize(model.render_chat(scope["messages"][:1]), add_special_tokens=False))
    assert answer.cached_tokens >= first_prompt and answer.prefilled_tokens < answer.prompt_tokens - first_prompt
    lines = out.getvalue().splitlines()
    assert f"{answer.prefilled_tokens} of {answer.prompt_tokens} prompt tokens prefilled" in lines[-2]
    assert lines[-1] == f"{ids} {model.detokenize(ids)} ({len(ids)}, 384)"


def test_compile_passes_options_as_flags_and_names_plans_by_them(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path))
    a = llmrs.compile(DATA / "golden-a", target=["cpu"], weights="f32", max_seq_len=64, no_fuse=["norm_prologue"])
    b = llmrs.compile(DATA / "golden-a", target=["cpu"], weights="f32", max_seq_len=40)
    assert a != b and a.parent == b.parent == tmp_path / "plans"
    ma, mb = llmrs.load(a, threads=1), llmrs.load(b, backend="reference")
    assert (ma.max_seq_len, mb.max_seq_len) == (64, 40)
    assert ma.plan.manifest["compile_options"]["disabled_rules"] == ["norm_prologue"]
    gd = np.load(DATA / "golden-a.npz")
    for model in (ma, mb):  # f32 weights: transformers' greedy tokens on either backend
        c = model.generate(gd["prompt_tokens"].tolist(), max_tokens=9)
        assert "".join(c) == c.text and c.tokens == gd["generated"].tolist()
    out = tmp_path / "mine.plan.bin"
    assert llmrs.compile(str(DATA / "golden-a"), out, target="cpu") == out and out.is_file()


@pytest.mark.parametrize("options, message", [
    (dict(weights="q9"), "argument --weights: invalid choice: 'q9'"),
    (dict(max_seq_len=0), "--max-seq-len and --prefill-chunk must be positive"),
    (dict(colour="blue"), "unrecognized arguments: --colour blue"),
])
def test_compile_errors_are_one_line(tmp_path, options, message):
    with pytest.raises(llmrs.CompileError) as e:
        llmrs.compile(DATA / "golden-a", tmp_path / "x.plan.bin", **options)
    assert message in str(e.value) and "\n" not in str(e.value) and not str(e.value).startswith("llmrs-compile")


def test_compile_of_a_missing_model_names_it(tmp_path):
    with pytest.raises(llmrs.CompileError, match=f"{tmp_path / 'nope'}: not a model folder"):
        llmrs.compile(tmp_path / "nope", tmp_path / "x.plan.bin")


def test_import_llmrs_stays_light():
    import subprocess
    import sys
    code = "import sys, llmrs; print(sorted(m for m in ('numpy', 'llmrs.runtime', 'llmrs.compiler') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", "import sys; sys.path[:] = [p for p in sys.path if p]; " + code],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
