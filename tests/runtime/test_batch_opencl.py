"""Many prompts at once on the OpenCL back end (PoCL here): a batch that preempts gives each
prompt the greedy tokens the CPU back end's batch gives it, and the tokens it gets run alone.
tests/runtime/test_batch.py checks the batch itself on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

import llmrs
from llmrs.compiler.cli import main as compile_main

from ..conftest import DATA

pytestmark = pytest.mark.usefixtures("opencl_device")


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """golden-b for both back ends: 16-row steps for up to 4 sequences, 8-token blocks, a pool
    of 8 blocks (64 entries) for 5 sequences of up to 49 tokens."""
    out = tmp_path_factory.mktemp("batch-opencl") / "golden-b.plan.bin"
    assert compile_main([str(DATA / "golden-b"), "-o", str(out), "--max-seq-len", "64", "--prefill-chunk", "16",
                         "--max-num-seqs", "4", "--block-size", "8", "--weights", "f32", "--kv-type", "f32",
                         "--target", "opencl,cpu", "-q"]) == 0
    return out


def test_a_batch_that_preempts_gives_the_cpus_tokens_and_each_prompts_tokens_alone(plan):
    """The batch that gave NaN logits at its 21st step on PoCL: a decode row, then a 15-row
    prompt chunk reaching the last warp row of attention_paged_tiles' 16-row group."""
    rng = np.random.default_rng(0)
    ps = [rng.integers(3, 300, n).tolist() for n in (5, 19, 11, 3, 17)]
    with llmrs.load(plan, backend="cpu") as model:
        want = [r.tokens for r in model.generate_many(ps, max_tokens=30)]
    with llmrs.load(plan, backend="opencl") as model:
        reqs = model.generate_many(ps, max_tokens=30)
        assert sum(r.preemptions for r in reqs) >= 3
        assert [r.tokens for r in reqs] == want
        for p, r in zip(ps, reqs):
            model.reset()
            c = model.generate(p, max_tokens=30)
            list(c)
            assert c.tokens == r.tokens
