"""A plan's step graph on aarch64: the plan carries object code for aarch64 (NEON + dotprod) and the
host; the same steps (three sequences, prompts in chunks beside decode rows, KV blocks scattered)
run by this Python and by Debian's arm64 Python under qemu give the same logits. Needs
tests/qemu/setup.sh (and its arm64 Python)."""
from __future__ import annotations

import subprocess

import numpy as np

from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.plan import Plan

from ..conftest import DATA, rel_err
from ..qemu.test_aarch64_e2e import ARM_TARGET, ARM_TRIPLE, pythons  # noqa: F401 (a fixture)
from .step_driver import Blocks

FIELDS = ("tokens", "positions", "slots", "row_seq", "ctx_len", "block_tables", "logit_rows")

RUN_STEPS = """
import sys
import numpy as np
from llmrs.runtime.backends.base import StepRows
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.backends.cpu_native import host_triple
from llmrs.runtime.plan import Plan
plan_path, rows_path, out_path = sys.argv[1:4]
d = np.load(rows_path)
fields = ("tokens", "positions", "slots", "row_seq", "ctx_len", "block_tables", "logit_rows")
be = CpuBackend(Plan.open(plan_path), threads=2)
logits = [be.run_step(StepRows(*(d[f"{i}.{f}"] for f in fields))) for i in range(int(d["n"]))]
np.savez(out_path, triple=host_triple(), **{f"logits{i}": x for i, x in enumerate(logits)})
"""


def test_aarch64_runs_the_step_graph_as_x86_64(pythons, tmp_path):  # noqa: F811
    plan_path = tmp_path / "golden-c.plan.bin"
    assert compile_main([str(DATA / "golden-c"), "-o", str(plan_path), "--weights", "f32", "--kv-type", "f32",
                         "--target", "cpu", "--triple", ARM_TARGET, "--triple", "host", "--max-seq-len", "64",
                         "--prefill-chunk", "16", "--block-size", "4", "--max-num-seqs", "3", "-q"]) == 0
    rng = np.random.default_rng(41)
    blocks = Blocks(Plan.open(plan_path).step_shape(), rng)
    tok = lambda: int(rng.integers(3, 320))      # noqa: E731
    steps = [blocks.rows([(0, tok()) for _ in range(9)] + [(1, tok()) for _ in range(3)], [8, 11]),
             blocks.rows([(1, tok()), (2, tok()), (2, tok()), (0, tok())], [0, 2, 3]),
             blocks.rows([(2, tok()), (0, tok()), (1, tok())], [0, 1, 2])]
    rows = tmp_path / "rows.npz"
    np.savez(rows, n=len(steps), **{f"{i}.{f}": getattr(s, f) for i, s in enumerate(steps) for f in FIELDS})
    procs = {}
    for arch, (cmd, env) in pythons.items():
        procs[arch] = subprocess.Popen([*cmd, "-c", RUN_STEPS, str(plan_path), str(rows), str(tmp_path / arch)],
                                       env=env, cwd=env["HOME"], stderr=subprocess.PIPE, text=True)
    for arch, proc in procs.items():
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode == 0, f"{arch} run failed (exit {proc.returncode}):\n{err[-3000:]}"
        assert "JIT-compiling" not in err
    native, arm = (dict(np.load(tmp_path / f"{arch}.npz")) for arch in ("x86_64", "aarch64"))
    assert str(arm["triple"]) == ARM_TRIPLE and str(native["triple"]).startswith("x86_64")
    for i, step in enumerate(steps):
        assert arm[f"logits{i}"].shape == (len(step.logit_rows), 320)
        assert rel_err(arm[f"logits{i}"], native[f"logits{i}"]) <= 1e-4, f"step {i}"
