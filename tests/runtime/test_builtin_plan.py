"""The built-in model's cached plan: reused while whole, compiled again (with a notice) when it is
damaged, since its user never compiled it and "recompile the plan" would not say how."""
import shutil

import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs import builtin
from llmrs.runtime.plan import Plan

from ..conftest import DATA


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """(the tiny built-in plan's cache path holding a good plan, a good copy, the compile calls)."""
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMRS_SMOLLM2_GGUF", str(tmp_path / "absent.gguf"))   # the random tiny model stands in
    good = tmp_path / "good.plan.bin"
    assert compile_main([str(DATA / "golden-a"), "-o", str(good), "--target", "cpu", "--max-seq-len", "16",
                         "--prefill-chunk", "4", "-q"]) == 0
    path = tmp_path / "cache" / f"builtin-tiny-{builtin._code_key()}.plan.bin"
    path.parent.mkdir()
    shutil.copy(good, path)
    calls = []

    def fake_compile(model, plan, quiet=False):
        calls.append(plan)
        shutil.copy(good, plan)

    monkeypatch.setattr(builtin, "_compile", fake_compile)
    monkeypatch.setattr("llmrs.models.tiny.make_model", lambda *a, **k: None)
    return path, good, calls


def test_a_whole_cached_plan_is_reused(cached, capsys):
    path, _, calls = cached
    assert builtin.default_plan() == path and calls == []
    assert "damaged" not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["manifest", "weights", "truncated"])
def test_a_damaged_cached_plan_is_compiled_again_with_a_notice(cached, capsys, where):
    path, good, calls = cached
    raw = bytearray(path.read_bytes())
    if where == "truncated":
        raw = raw[:len(raw) // 2]
    else:
        at = 100 if where == "manifest" else Plan.open(good).sections["weights"].offset + 10
        raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))
    assert builtin.default_plan() == path and calls == [path]
    err = capsys.readouterr().err
    assert f"notice: the cached built-in plan is damaged ({path}: " in err and "compiling it again" in err
    assert path.read_bytes() == good.read_bytes()
    Plan.open(path, verify="always")


def test_the_cache_key_follows_the_kernel_templates(tmp_path, monkeypatch):
    """A plan carries its OpenCL C: a cached plan from before a template change is not reused."""
    from importlib import resources
    from llmrs import __version__
    key = builtin._code_key()
    assert key.startswith(__version__ + "-") and len(key) == len(__version__) + 9
    copy = tmp_path / "templates"
    shutil.copytree(resources.files("llmrs.templates"), copy)
    assert builtin._code_key() == key
    monkeypatch.setattr(resources, "files", lambda pkg: copy)
    assert builtin._code_key() == key    # the same bytes, the same key
    (copy / "opencl" / "common.cl").write_text((copy / "opencl" / "common.cl").read_text() + "\n// changed\n")
    assert builtin._code_key() != key
