"""The tiny plan the measuring tools' tests share (llmrs-bench, --profile, the arena picture)."""
from __future__ import annotations

from pathlib import Path

from llmrs.compiler.cli import main as compile_main

from ..conftest import DATA


def tiny_plan(tmp: Path, *flags: str) -> Path:
    """golden-a with CPU and OpenCL code: 12-token prefill chunks, 48 cache slots; prefill and decode
    only (tests/runtime/test_step_check.py measures a step graph's kernels)."""
    out = tmp / f"golden-a{''.join(flags).replace('-', '_')}.plan.bin"
    if not out.exists():
        assert compile_main([str(DATA / "golden-a"), "-o", str(out), "--max-seq-len", "48", "--prefill-chunk", "12",
                             "--weights", "q4_0", "--kv-type", "f16", "--max-num-seqs", "0", "-q", *flags]) == 0
    return out
