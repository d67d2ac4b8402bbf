"""llmrs-compile end to end: plans of the golden models interpreted against transformers' logits."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.engine import Engine
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..conftest import DATA, rel_err


def _compile(tmp_path, name, *flags, out_name=None):
    out = tmp_path / (out_name or f"{name}.plan.bin")
    rc = compile_main([str(DATA / name), "-o", str(out), "--target", "cpu", "--max-seq-len", "64",
                       "--prefill-chunk", "16", "-q", *flags])
    assert rc == 0
    return Plan.open(out)


def _generate(plan, prompt, n):
    m = plan.manifest
    engine = Engine(ReferenceBackend(plan.graphs()), m["prefill_chunk"], m["max_seq_len"])
    return engine.generate(list(prompt), n, Sampler(SamplerConfig()), keep_logits=True)


def test_f32_plan_matches_transformers(tmp_path, golden):
    path, gd = golden
    gen = _generate(_compile(tmp_path, path.name, "--weights", "f32", "--kv-type", "f32"), gd["prompt_tokens"], 9)
    ref = np.concatenate([gd["prefill_logits"][-1:], gd["decode_logits"]])
    assert rel_err(np.stack(gen.logits), ref) <= 1e-4
    assert gen.tokens == list(gd["generated"])


def test_q8_0_plan_keeps_the_greedy_tokens_of_f32(tmp_path, golden):
    """Stated tolerance: q8_0 weights + Q8_0 activations + f16 KV stay within 5% of the logit range."""
    path, gd = golden
    gen = _generate(_compile(tmp_path, path.name, "--weights", "q8_0", "--kv-type", "f16"), gd["prompt_tokens"], 9)
    ref = np.concatenate([gd["prefill_logits"][-1:], gd["decode_logits"]])
    assert rel_err(np.stack(gen.logits), ref) <= 5e-2
    assert gen.tokens == list(gd["generated"])


def test_q4_0_plan_computes_the_q4_0_model(tmp_path):
    """q4_0 changes a random tiny model's logits a lot (4-bit weights, no redundancy to absorb it),
    so the plan is checked against the interpreter on the same q4_0 weights, and the error against
    the float model is bounded loosely."""
    gd = np.load(DATA / "golden-b.npz")
    plan = _compile(tmp_path, "golden-b", "--weights", "q4_0", "--kv-type", "f32")
    assert {plan.tensors[n].dtype for n in plan.tensors if len(plan.tensors[n].shape) == 2} == {"q4_0"}
    gen = _generate(plan, gd["prompt_tokens"], 3)
    ref = gd["prefill_logits"][-1]
    assert 0.01 < rel_err(gen.logits[0], ref) <= 2.0
    assert np.corrcoef(gen.logits[0], ref)[0, 1] > 0.5


def test_compile_summary_reports_kernels_arena_and_kv(tmp_path, capsys):
    _compile(tmp_path, "golden-a", "--weights", "q8_0")
    out = capsys.readouterr().out
    assert "decode step 12 (5 per layer x 2 layers + 2)" in out
    assert "lower bound" in out and "KV cache      16.00 KiB" in out and "naive sum" in out


def test_no_fuse_rule_changes_the_kernel_count_not_the_logits(tmp_path):
    a = _compile(tmp_path, "golden-a", "--weights", "f32", "--kv-type", "f32")
    b = _compile(tmp_path, "golden-a", "--weights", "f32", "--kv-type", "f32", "--no-fuse", "norm_prologue",
                 out_name="b.plan.bin")
    assert b.graphs()["decode"].kernel_count() == a.graphs()["decode"].kernel_count() + 5  # two norms per layer, one final
    prompt = [5, 9, 17, 33, 2]
    assert rel_err(np.stack(_generate(b, prompt, 3).logits), np.stack(_generate(a, prompt, 3).logits)) <= 1e-5


def _one_line_error(capsys, argv, message):
    assert compile_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("llmrs-compile: error:") and message in err, err


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    out = str(tmp_path / "x.plan.bin")
    _one_line_error(capsys, [str(tmp_path), "-o", out], "no config.json")
    bad = tmp_path / "bad"
    shutil.copytree(DATA / "golden-a", bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    _one_line_error(capsys, [str(bad), "-o", out], "architecture GPT2LMHeadModel is not supported")
    (bad / "config.json").write_text(json.dumps({**raw, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    _one_line_error(capsys, [str(bad), "-o", out], "rope_scaling type 'dynamic' is not supported")
    (bad / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    _one_line_error(capsys, [str(bad), "-o", out], "tensor 'model.layers.2.input_layernorm.weight' is missing")
    (bad / "config.json").write_text(json.dumps({**raw, "intermediate_size": 200}))
    _one_line_error(capsys, [str(bad), "-o", out], "has shape [192, 64], config.json implies [200, 64]")
    _one_line_error(capsys, [str(DATA / "golden-a"), "-o", out, "--no-fuse", "everything"], "everything")
    _one_line_error(capsys, [str(DATA / "golden-a"), "-o", out, "--target", "tpu"], "--target 'tpu'")
    _one_line_error(capsys, [str(DATA / "golden-a"), "-o", out, "--kv-type", "q4_0"],   # head_dim 16
                    "--kv-type q4_0 stores each head's row in 32-value blocks, but head_dim is 16; use --kv-type f16")
    assert not (tmp_path / "x.plan.bin").exists()


def test_an_output_that_cannot_be_written_is_refused_before_compiling(tmp_path, capsys, monkeypatch):
    import llmrs.compiler.build as build

    def never(*_):
        raise AssertionError("the model was loaded although the output cannot be written")

    monkeypatch.setattr(build, "load_model", never)
    model = str(DATA / "golden-a")
    missing = tmp_path / "missing" / "dir"
    _one_line_error(capsys, [model, "-o", str(missing / "plan.bin")],
                    f"-o {missing / 'plan.bin'}: folder {missing} does not exist; create it (mkdir -p {missing})")
    _one_line_error(capsys, [model, "-o", str(tmp_path)], f"-o {tmp_path} is a folder")
    (tmp_path / "file").write_text("x")
    _one_line_error(capsys, [model, "-o", str(tmp_path / "file" / "plan.bin")], f"{tmp_path / 'file'} is not a folder")
    # permission bits do not stop root; sysfs refuses new files to everyone
    read_only = Path("/sys") if os.geteuid() == 0 else tmp_path / "ro"
    if read_only != Path("/sys"):
        read_only.mkdir()
        read_only.chmod(0o500)
    _one_line_error(capsys, [model, "-o", str(read_only / "plan.bin")],
                    f"-o {read_only / 'plan.bin'}: cannot write in folder {read_only} (")
    assert not list(read_only.glob(".plan.bin.*"))


def test_bad_flag_value_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        compile_main([str(DATA / "golden-a"), "-o", "x.bin", "--weights", "q3_k"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "invalid choice: 'q3_k'" in err


def test_decode_weight_bytes_count_a_tied_table_once(llama_1b_graphs):
    """The benchmarks' bytes per token: every matmul weight whole, an untied embedding one row."""
    from llmrs.compiler.summary import decode_weight_bytes

    _, decode = llama_1b_graphs
    total, params = decode_weight_bytes(decode)
    norms = (2 * 16 + 1) * 2048          # every parameter that is not a matmul weight
    assert params == 1_235_814_400 - norms   # the tied table counts once, as the lm_head
    assert total == 2 * (params + norms)     # bf16; the embedding adds no row of its own


def test_a_kv_cache_larger_than_memory_is_refused_before_compiling(tmp_path, capsys, monkeypatch):
    """It used to compile, and the run died with a bare "[Errno 12] Cannot allocate memory"."""
    import llmrs.compiler.build as build

    monkeypatch.setattr(build, "physical_memory", lambda: 8 << 30)
    monkeypatch.setattr(build, "compile_phases", lambda *a: (_ for _ in ()).throw(AssertionError("compiled")))
    out = tmp_path / "p.bin"
    # golden-a: 2 layers x (K + V of 2 heads x 16 f16 + 2 f32 eviction scores) = 272 bytes a token
    _one_line_error(capsys, [str(DATA / "golden-a"), "-o", str(out), "--max-seq-len", str(10**9)],
                    f"--max-seq-len {10**9}: the KV cache would take 253.32 GiB, more than this machine's 8.00 GiB "
                    f"of memory; at most {(8 << 30) // 272} tokens fit")
    _one_line_error(capsys, [str(DATA / "golden-a"), "-o", str(out), "--max-seq-len", str(1 << 31)],
                    "--max-seq-len must be a whole number from 1 to 2147483647 (positions are 32-bit), got 2147483648")
    assert not out.exists()
