"""Every tool's output file: never a device, a pipe or a file the command reads (by any name), and
written whole through a temporary file beside it or not at all."""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import llmrs.compiler.build as build
import llmrs.compiler.cli as compile_cli
from llmrs.compiler.outputs import output_file, write_output
from llmrs.measure import bench
from llmrs.runtime import inspect
from llmrs.runtime.cli import main as run_main

from ..conftest import DATA
from ..models.gguf_files import hf_to_gguf


def _one_line(capsys, rc: int, prog: str, message: str) -> None:
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith(f"{prog}: error:") and message in err, err


@pytest.fixture
def no_compiling(monkeypatch):
    """The refusals come before the model is read: loading it fails the test."""
    def never(*_):
        raise AssertionError("the model was loaded although the output must not be written")
    monkeypatch.setattr(build, "load_model", never)


@pytest.fixture
def specials(tmp_path) -> dict[str, Path]:
    """A named pipe, and a symlink to /dev/null (a character device every machine has; had the
    check failed, the rename would have replaced the link, not the device)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    null = tmp_path / "null.plan"
    null.symlink_to("/dev/null")
    return {"fifo": fifo, "null": null}


def test_compile_refuses_a_device_or_a_pipe_as_output(tmp_path, capsys, no_compiling, specials):
    model = str(DATA / "golden-a")
    rc = compile_cli.main([model, "-o", str(specials["null"]), "-q"])
    _one_line(capsys, rc, "llmrs-compile", f"-o {specials['null']} is a character device, not a file")
    rc = compile_cli.main([model, "-o", str(specials["fifo"]), "-q"])
    _one_line(capsys, rc, "llmrs-compile", f"-o {specials['fifo']} is a named pipe, not a file")
    assert specials["null"].is_symlink() and os.readlink(specials["null"]) == "/dev/null"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_compile_refuses_to_write_over_its_own_gguf(tmp_path, capsys, no_compiling):
    gguf = hf_to_gguf(DATA / "golden-a", tmp_path / "self.gguf")
    before = gguf.read_bytes()
    rc = compile_cli.main([str(gguf), "-o", str(gguf), "-q"])
    _one_line(capsys, rc, "llmrs-compile", f"-o {gguf} is an input of this command ({gguf})")
    assert gguf.read_bytes() == before


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json", "generation_config.json"])
def test_compile_refuses_to_write_over_a_file_of_the_model_folder(tmp_path, capsys, no_compiling, name):
    model = tmp_path / "model"
    shutil.copytree(DATA / "golden-a", model)
    before = (model / name).read_bytes()
    rc = compile_cli.main([str(model), "-o", str(model / name), "-q"])
    _one_line(capsys, rc, "llmrs-compile", "is an input of this command")
    assert (model / name).read_bytes() == before


def test_compile_refuses_an_input_reached_through_a_link(tmp_path, capsys, no_compiling):
    model = tmp_path / "model"
    shutil.copytree(DATA / "golden-a", model)
    (tmp_path / "soft.plan").symlink_to(model / "model.safetensors")
    os.link(model / "tokenizer.json", tmp_path / "hard.plan")
    for out, src in (("soft.plan", "model.safetensors"), ("hard.plan", "tokenizer.json")):
        rc = compile_cli.main([str(model), "-o", str(tmp_path / out), "-q"])
        _one_line(capsys, rc, "llmrs-compile", f"is an input of this command ({model / src})")


def test_a_new_plan_inside_the_model_folder_is_written(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(DATA / "golden-a", model)
    weights = (model / "model.safetensors").read_bytes()
    assert compile_cli.main([str(model), "-o", str(model / "a.plan.bin"), "--target", "cpu", "--max-seq-len", "16",
                             "--prefill-chunk", "4", "-q"]) == 0
    assert (model / "a.plan.bin").read_bytes()[:8] == b"LLMRSPLN"
    assert (model / "model.safetensors").read_bytes() == weights


def test_a_plan_written_through_a_symlink_lands_at_its_target(tmp_path, capsys):
    target = tmp_path / "plans" / "real.plan.bin"
    target.parent.mkdir()
    target.write_bytes(b"old plan")
    link = tmp_path / "link.plan.bin"
    link.symlink_to(target)
    assert compile_cli.main([str(DATA / "golden-a"), "-o", str(link), "--target", "cpu", "--max-seq-len", "16",
                             "--prefill-chunk", "4", "-q"]) == 0
    assert link.is_symlink() and target.read_bytes()[:8] == b"LLMRSPLN"


def test_dump_ir_refuses_a_file(tmp_path, capsys, no_compiling, specials):
    rc = compile_cli.main([str(DATA / "golden-a"), "-o", str(tmp_path / "p.bin"), "--dump-ir", str(specials["null"])])
    _one_line(capsys, rc, "llmrs-compile", f"--dump-ir {specials['null']} exists and is not a folder")


@pytest.mark.parametrize("flag", ["--dump-logits", "--profile"])
def test_run_refuses_to_write_over_its_plan_or_a_device(tmp_path, capsys, specials, flag):
    plan = tmp_path / "p.plan.bin"
    plan.write_bytes(b"not opened: the outputs are checked first")
    for out, message in ((plan, "is an input of this command"), (specials["null"], "is a character device"),
                         (specials["fifo"], "is a named pipe")):
        rc = run_main([str(plan), "--prompt", "hi", "--backend", "cpu", flag, str(out)])
        _one_line(capsys, rc, "llmrs-run", f"{flag} {out} {message}")
    assert plan.read_bytes() == b"not opened: the outputs are checked first"


def test_bench_and_inspect_refuse_a_device_and_their_plan(tmp_path, capsys, specials):
    plan = tmp_path / "p.plan.bin"
    plan.write_bytes(b"x" * 64)
    rc = bench.main([str(plan), "--json", str(specials["null"])])
    _one_line(capsys, rc, "llmrs-bench", f"--json {specials['null']} is a character device")
    rc = bench.main([str(plan), "--json", str(plan)])
    _one_line(capsys, rc, "llmrs-bench", f"--json {plan} is an input of this command")
    rc = inspect.main([str(plan), "--plot", str(plan)])
    _one_line(capsys, rc, "llmrs-inspect", f"--plot {plan} is an input of this command")
    assert plan.read_bytes() == b"x" * 64


def test_dump_logits_lands_at_the_exact_name(tmp_path, capsys):
    plan = tmp_path / "a.plan.bin"
    assert compile_cli.main([str(DATA / "golden-a"), "-o", str(plan), "--target", "cpu", "--max-seq-len", "16",
                             "--prefill-chunk", "4", "-q"]) == 0
    out = tmp_path / "logits"      # numpy's savez would have written logits.npz
    assert run_main([str(plan), "--prompt", "hi", "-n", "2", "--backend", "cpu", "--dump-logits", str(out)]) == 0
    with np.load(out) as z:
        assert z["logits"].shape == (2, 384) and np.isfinite(z["logits"]).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.plan.bin", "logits"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "result.json"
    out.write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with output_file(out, "--json") as f:
            f.write(b"half of the new")
            raise RuntimeError("interrupted")
    assert out.read_text() == "old" and sorted(tmp_path.iterdir()) == [out]
    write_output(out, "new", "--json")
    assert out.read_text() == "new" and sorted(tmp_path.iterdir()) == [out]


def test_an_output_that_became_a_device_meanwhile_is_not_replaced(tmp_path):
    out = tmp_path / "result.json"
    with pytest.raises(ValueError, match="is a character device"):
        with output_file(out, "--json") as f:
            f.write(b"{}")
            out.symlink_to("/dev/null")    # appears between the check and the rename
    assert os.readlink(out) == "/dev/null" and sorted(tmp_path.iterdir()) == [out]
