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


def _stepped(plan, prompts, max_tokens, overlap, stop_ids=(), close_at=None):
    """The batch stepped to the end: requests 0..2 at once, request 3 after 3 steps, request 2
    closed after close_at steps; (tokens, finish reasons, steps that left the next one on the device)."""
    with llmrs.load(plan, backend="opencl") as model:
        model.backend.async_steps = overlap
        batch = model._batcher()
        if stop_ids:
            batch.stop_ids = frozenset(stop_ids)
        reqs = [model.add_request(p, max_tokens=k) for p, k in zip(prompts[:3], max_tokens)]
        ahead = steps = 0
        while model.step():
            steps += 1
            ahead += batch._ahead is not None
            if steps == 3:
                reqs.append(model.add_request(prompts[3], max_tokens=max_tokens[3]))
            if steps == close_at:
                reqs[2].close()
        return [r.tokens for r in reqs], [r.finish_reason for r in reqs], ahead


def test_a_step_planned_while_the_last_runs_gives_the_tokens_of_steps_run_one_at_a_time(plan):
    """OpenCL runs a step while the host plans the next, its sampled tokens pending (Batcher.step,
    async_steps). With a stop token sampled mid-run, requests of different lengths, one joining
    late and one closed mid-run, every request gets the tokens and finish reason it gets when each
    step is planned after the last one's tokens are in; the rows a stop leaves in the next step
    are dropped."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 19, 11, 3)]
    lengths = (12, 20, 9, 15)
    free, _, none_ahead = _stepped(plan, prompts, lengths, overlap=False)
    assert none_ahead == 0
    stop = free[1][5]                    # request 1's sixth token ends it from now on
    want = _stepped(plan, prompts, lengths, overlap=False, stop_ids=[stop], close_at=6)
    got = _stepped(plan, prompts, lengths, overlap=True, stop_ids=[stop], close_at=6)
    assert got[:2] == want[:2]
    assert got[2] > 10                   # the steps did overlap
    assert "stop" in want[1] and "cancelled" in want[1] and "length" in want[1], want[1]
    assert [len(t) for t in want[0]] != [len(t) for t in free], "the stop token ended no request"


def test_a_batch_whose_last_request_stops_holds_no_step_on_the_device_after_it(plan):
    """The step planned ahead for a sequence that its last token stops is waited for when the
    batch runs dry, so the idle model is not busy and a single generation may follow."""
    prompt = np.random.default_rng(2).integers(3, 300, 7).tolist()
    with llmrs.load(plan, backend="opencl") as model:
        first = model.add_request(prompt, max_tokens=12)
        list(first)                                   # iterating steps the batch
        model.batch.stop_ids = frozenset({first.tokens[4]})
        second = model.add_request(prompt, max_tokens=12)
        list(second)
        assert second.finish_reason == "stop" and second.tokens == first.tokens[:first.tokens.index(first.tokens[4])]
        assert not model.batch.busy
        alone = model.generate(prompt, max_tokens=12)
        list(alone)
        assert alone.tokens == first.tokens


def test_sampled_requests_with_steps_planned_ahead_get_the_tokens_of_steps_one_at_a_time(plan):
    """Rows sampled on the host (temperature, a seed each) beside a greedy one: the logits come
    back, the host samples, and the tokens fill the step planned meanwhile."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, n).tolist() for n in (6, 13, 4)]

    def run(overlap: bool) -> list[list[int]]:
        with llmrs.load(plan, backend="opencl") as model:
            model.backend.async_steps = overlap
            reqs = [model.add_request(prompts[0], max_tokens=10, temperature=0.9, seed=1),
                    model.add_request(prompts[1], max_tokens=14, temperature=0.7, top_k=20, seed=2),
                    model.add_request(prompts[2], max_tokens=8)]
            ahead = 0
            while model.step():
                ahead += model.batch._ahead is not None
            assert ahead > 3 if overlap else ahead == 0
            return [r.tokens for r in reqs]

    assert run(True) == run(False)
