"""The aarch64 runtime end to end: one plan carrying object code for aarch64 (NEON + dotprod) and for
this host, generated greedily by the same script twice, natively (x86-64) and by Debian's arm64
Python under qemu-aarch64 loading the aarch64 object. Both must give the same tokens; for f32
weights they must also give transformers' tokens and logits (golden data). Needs
tests/qemu/setup.sh, which runs tests/qemu/setup_python.sh (the arm64 sysroot and wheels)."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main

from ..conftest import DATA, QEMU_SETUP, rel_err, system_tool, unavailable

REPO = Path(__file__).resolve().parents[2]
AARCH64_ROOT = Path(os.environ.get("LLMRS_AARCH64_ROOT") or REPO / ".cache" / "aarch64")
SYSROOT, SITE, DONE = AARCH64_ROOT / "sysroot", AARCH64_ROOT / "site", AARCH64_ROOT / ".done"
# a generic ARMv8.2 core named explicitly: LLVM's host detection under qemu says `generic` with no features
ARM_TRIPLE = "aarch64-unknown-linux-gnu"
ARM_TARGET = f"{ARM_TRIPLE}:generic:+neon,+fp-armv8,+dotprod"
CHUNK, SEQ, THREADS, N_NEW = 16, 64, 2, 9  # 30/40-token golden prompts: 2-3 prefill chunks, 8 decode steps

# Run by both interpreters: argv = plan prompt.npy out.npz threads n_new. Greedy, stop tokens
# ignored, so each run gives exactly n_new tokens, the logits each was chosen from, and the triple
# whose object code the runtime loaded.
GENERATE = """
import sys
import numpy as np
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.backends.cpu_native import host_triple
from llmrs.runtime.engine import Engine
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig
plan_path, prompt_path, out_path, threads, n_new = sys.argv[1:6]
plan = Plan.open(plan_path)
m = plan.manifest
engine = Engine(CpuBackend(plan, threads=int(threads)), int(m["prefill_chunk"]), int(m["max_seq_len"]))
gen = engine.generate(np.load(prompt_path).tolist(), int(n_new), Sampler(SamplerConfig()), keep_logits=True)
np.savez(out_path, tokens=np.array(gen.tokens, np.int32), logits=np.stack(gen.logits), triple=host_triple())
"""


def _llmrs_tree(dest: Path) -> Path:
    """The source tree laid out as the installed `llmrs` namespace (pyproject's package-dir), with
    symlinks, so the arm64 Python imports exactly the code under test."""
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = dest / "llmrs"
    root.mkdir(parents=True)
    for f in (REPO / package_dir["llmrs"]).iterdir():
        if f.suffix == ".py":
            (root / f.name).symlink_to(f)
    for name, folder in package_dir.items():
        if name != "llmrs":
            (root / name.split(".", 1)[1]).symlink_to(REPO / folder, target_is_directory=True)
    return dest


def _env(tmp: Path, pythonpath: str) -> dict[str, str]:
    # run in tmp: `python -c` puts the working directory first on sys.path, and the repo root's
    # llmrs/ folder there would shadow the laid-out namespace
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp), "PYTHONPATH": pythonpath,
            "LLMRS_CACHE_DIR": str(tmp / "llmrs-cache"), "PYTHONNOUSERSITE": "1"}


def _generate_both(pythons: dict[str, tuple[list[str], dict[str, str]]], plan: Path,
                   prompt: Path) -> dict[str, dict[str, np.ndarray]]:
    """GENERATE run by each interpreter, side by side (qemu is the slow one)."""
    procs = {}
    for arch, (cmd, env) in pythons.items():
        args = [*cmd, "-c", GENERATE, str(plan), str(prompt), str(plan.with_suffix(f".{arch}.npz")),
                str(THREADS), str(N_NEW)]
        procs[arch] = subprocess.Popen(args, env=env, cwd=env["HOME"], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    errs = {arch: proc.communicate(timeout=120)[1] for arch, proc in procs.items()}
    for arch, proc in procs.items():
        assert proc.returncode == 0, f"{arch} run failed (exit {proc.returncode}):\n{errs[arch][-3000:]}"
        assert "JIT-compiling" not in errs[arch], f"{arch} run did not load the plan's object code: {errs[arch]}"
    return {arch: dict(np.load(plan.with_suffix(f".{arch}.npz"))) for arch in procs}


@pytest.fixture(scope="module")
def pythons(tmp_path_factory) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Command line and environment of each interpreter: this one, and the arm64 one under qemu.
    Both import the same source tree. Without qemu or the arm64 sysroot the tests skip, saying
    what to run; under CI (CI=true), which installs both, they fail, so CI cannot pass without
    running them."""
    qemu = system_tool("qemu-aarch64", QEMU_SETUP)
    # .done reads "python3.X wheel names", written when the sysroot and wheels are complete
    arm_python = SYSROOT / "usr" / "bin" / (DONE.read_text().split() or ["?"])[0] if DONE.is_file() else None
    if not (arm_python and arm_python.is_file()):
        unavailable(f"no arm64 Python in {AARCH64_ROOT}: run sh tests/qemu/setup_python.sh (after "
                    "tests/qemu/setup.sh; or set LLMRS_AARCH64_ROOT)")
    tmp = tmp_path_factory.mktemp("pythons")
    pkg = str(_llmrs_tree(tmp / "pkg"))
    return {"x86_64": ([sys.executable], _env(tmp, pkg)),
            "aarch64": ([qemu, "-cpu", "max", "-L", str(SYSROOT), str(arm_python)],
                        _env(tmp, f"{pkg}{os.pathsep}{SITE}"))}


# The two builds sum f32 in different orders (8 lanes on x86-64, 4 on NEON), so their logits differ
# in the last bits. Rounding to f16 or to Q8_0 can turn that into a whole f16 / Q8_0 step; with both
# (q4_0 weights and an f16 cache) golden-b's logits move by ~1e-2 and a near-tie (gap 7e-3) flips,
# so each case takes at most one of them. (model, weights, KV cache, logits tolerance)
CASES = [("golden-a", "f32", "f32", 1e-4),    # also checked against transformers' golden data
         ("golden-a", "q4_0", "f32", 1e-4),   # q4_0 x Q8_0 integer dots: sdot vs AVX2/VNNI
         ("golden-b", "q4_0", "f32", 1e-4),   # Llama 3 rope scaling, untied lm_head, 3 blocks a row
         ("golden-b", "q4_1", "f32", 1e-4),   # q4_1 x Q8_1: sdot per block vs VNNI in groups
         ("golden-b", "f32", "f16", 1e-3),    # the f16 cache that ships by default
         ("golden-c", "f32", "f32", 1e-4)]    # head_dim 100, MQA: vector tails; and transformers


@pytest.mark.parametrize("model,weights,kv,tol", CASES, ids=["-".join(c[:3]) for c in CASES])
def test_aarch64_runtime_under_qemu_generates_the_same_tokens_as_x86_64(model, weights, kv, tol, pythons,
                                                                        tmp_path):
    gold = np.load(DATA / f"{model}.npz")
    plan = tmp_path / f"{model}-{weights}.plan.bin"
    rc = compile_main([str(DATA / model), "-o", str(plan), "--weights", weights, "--kv-type", kv,
                       "--target", "cpu", "--triple", ARM_TARGET, "--triple", "host",
                       "--max-seq-len", str(SEQ), "--prefill-chunk", str(CHUNK), "-q"])
    assert rc == 0
    prompt = tmp_path / "prompt.npy"
    np.save(prompt, gold["prompt_tokens"].astype(np.int32))

    runs = _generate_both(pythons, plan, prompt)
    native, arm = runs["x86_64"], runs["aarch64"]

    assert str(arm["triple"]) == ARM_TRIPLE and str(native["triple"]).startswith("x86_64")
    assert arm["tokens"].tolist() == native["tokens"].tolist()
    assert rel_err(arm["logits"], native["logits"]) <= tol
    if weights == "f32" and kv == "f32":  # both also match transformers: row 0 is the prompt's last position
        want = np.concatenate([gold["prefill_logits"][-1:], gold["decode_logits"]])
        assert arm["tokens"].tolist() == gold["generated"].tolist()
        assert rel_err(arm["logits"], want) <= 1e-4


def test_aarch64_runtime_under_qemu_answers_as_x86_64_on_the_real_model(smollm2_gguf, pythons, tmp_path):
    """SmolLM2-135M-Instruct with its own Q4_1 / Q8_0 weights, through its chat template. Logits are
    held to 5e-2 as in tests/runtime/test_real_model.py (a flipped Q8_1 code carried over 30 layers)."""
    from llmrs.runtime.chat import from_manifest
    from llmrs.runtime.plan import Plan
    from tokenizers import Tokenizer

    plan = tmp_path / "smollm2.plan.bin"
    assert compile_main([str(smollm2_gguf), "-o", str(plan), "--kv-type", "f32", "--target", "cpu",
                         "--triple", ARM_TARGET, "--triple", "host", "--max-seq-len", str(SEQ),
                         "--prefill-chunk", str(CHUNK), "-q"]) == 0
    p = Plan.open(plan)
    text = from_manifest(p.manifest).render([{"role": "user", "content": "What is the largest ocean on Earth?"}])
    tok = Tokenizer.from_str(bytes(p.section("tokenizer.json")).decode())
    prompt = tmp_path / "prompt.npy"
    np.save(prompt, np.array(tok.encode(text, add_special_tokens=False).ids, np.int32))

    runs = _generate_both(pythons, plan, prompt)
    native, arm = runs["x86_64"], runs["aarch64"]
    assert str(arm["triple"]) == ARM_TRIPLE
    assert arm["tokens"].tolist() == native["tokens"].tolist()
    assert "Pacific" in tok.decode(arm["tokens"].tolist())
    assert rel_err(arm["logits"], native["logits"]) <= 5e-2
