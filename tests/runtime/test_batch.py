"""Many prompts at once (runtime/batch.py over runtime/scheduler.py and the plan's step graph):
batched greedy tokens equal each prompt run alone, whatever joins mid-run, preemption, the prefix
cache, and the KV cache handed between the batch and a conversation."""
from __future__ import annotations

import numpy as np
import pytest

import llmrs
from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.engine import EngineError

from ..conftest import DATA


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """golden-b: 16-row steps for up to 4 sequences, 8-token blocks, 128 cache slots."""
    out = tmp_path_factory.mktemp("batch") / "golden-b.plan.bin"
    assert compile_main([str(DATA / "golden-b"), "-o", str(out), "--max-seq-len", "128", "--prefill-chunk", "16",
                         "--max-num-seqs", "4", "--block-size", "8", "--weights", "f32", "--kv-type", "f32",
                         "--target", "cpu", "-q"]) == 0
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, int(k)).tolist() for k in rng.integers(2, 40, n)]


def alone(model, prompt: list[int], n: int) -> list[int]:
    model.reset()
    c = model.generate(prompt, max_tokens=n)
    for _ in c:
        pass
    return c.tokens


def test_batched_greedy_tokens_equal_each_prompt_run_alone(plan):
    """7 prompts of 2..39 tokens through 4 sequence seats: later ones join as earlier ones finish,
    prompt chunks share steps with decodes."""
    ps = prompts(7)
    with llmrs.load(plan) as model:
        want = [alone(model, p, 12) for p in ps]
        reqs = model.generate_many(ps, max_tokens=12)
        assert [r.tokens for r in reqs] == want
        assert all(r.finish_reason in ("length", "stop") for r in reqs)
        assert model.batch.steps < sum(len(p) for p in ps) + 12 * len(ps)   # rows shared steps


def test_a_pool_too_small_for_everyone_preempts_and_still_gives_the_same_tokens(plan):
    ps = prompts(6, seed=1)
    with llmrs.load(plan, num_blocks=8) as model:       # 64 slots for 6 sequences of up to 55 tokens
        want = [alone(model, p, 16) for p in ps]
        reqs = model.generate_many(ps, max_tokens=16)
        assert [r.tokens for r in reqs] == want
        assert sum(r.preemptions for r in reqs) > 0


def test_a_shared_prefix_is_read_from_the_prefix_cache(plan):
    rng = np.random.default_rng(2)
    system = rng.integers(3, 300, 50).tolist()
    first, second = system + [5, 6, 7], system + [9, 10]
    with llmrs.load(plan) as model:
        want = alone(model, second, 6)
        a = model.generate_many([first], max_tokens=4)[0]
        b = model.generate_many([second], max_tokens=6)[0]
        assert a.cached_tokens == 0
        assert b.cached_tokens == 48                    # the 6 full blocks of the common 50 tokens
        assert b.tokens == want


def test_closing_a_request_frees_its_blocks_and_the_rest_go_on(plan):
    ps = prompts(3, seed=3)
    with llmrs.load(plan) as model:
        want = alone(model, ps[1], 10)
        reqs = [model.add_request(p, max_tokens=10) for p in ps]
        model.step()
        model.step()
        reqs[0].close()
        assert reqs[0].finish_reason == "cancelled"
        while model.step():
            pass
        assert reqs[1].tokens == want
        kv = model.batch.scheduler.kv.stats()
        assert kv.used == 0 and kv.free + kv.cached == model.batch.config.num_blocks


def test_a_conversation_after_a_batch_and_a_batch_after_it_both_start_clean(plan):
    ps = prompts(2, seed=4)
    with llmrs.load(plan) as model:
        want = alone(model, ps[0], 8)
        c = model.generate(ps[1], max_tokens=5)      # a conversation's cache, then a batch over it
        list(c)
        assert model.generate_many([ps[0]], max_tokens=8)[0].tokens == want
        c = model.generate(ps[0], max_tokens=8)      # and back: the batch's rows are not a conversation's
        list(c)
        assert c.cached_tokens == 0 and c.tokens == want


def test_requests_the_pool_can_never_hold_are_one_line_errors(plan):
    with llmrs.load(plan, num_blocks=4) as model:
        with pytest.raises(EngineError, match=r"^the prompt has 32 tokens but a sequence of this batch holds 32, "
                                              r"so a prompt may have at most 31 \(.*max_seq_len.*num_blocks\)$"):
            model.add_request(list(range(3, 35)), max_tokens=1)
        req = model.add_request(list(range(3, 30)), max_tokens=10)   # 27 + 10 > 32: ends when the pool is full
        list(req)
        assert req.finish_reason == "length" and len(req.tokens) == 5
    with pytest.raises(ValueError, match="max_num_seqs 5 is more than the plan's --max-num-seqs allows"):
        with llmrs.load(plan, max_num_seqs=5) as model:
            model.add_request([3, 4], max_tokens=1)


def test_seeded_sampling_in_a_batch_repeats(plan):
    ps = prompts(3, seed=5)
    with llmrs.load(plan) as model:
        runs = [[r.tokens for r in model.generate_many(ps, max_tokens=8, temperature=0.9, seed=11)]
                for _ in range(2)]
        assert runs[0] == runs[1]
        assert len({tuple(t) for t in runs[0]}) == 3


def test_ignore_eos_runs_past_stop_tokens_alone_and_in_a_batch(plan):
    """ignore_eos (throughput benchmarks) emits a stop token like any other and runs to max_tokens;
    without it the same token ends the reply, in a conversation and in a batch."""
    p = prompts(1, seed=5)[0]
    with llmrs.load(plan) as model:
        want = alone(model, p, 12)
        stop = want[3]
        cut = want.index(stop)
        model.engine.stop_ids = {stop}      # before the batch exists: it takes the engine's stop ids
        assert alone(model, p, 12) == want[:cut]
        model.reset()
        c = model.generate(p, max_tokens=12, ignore_eos=True)
        assert list(c) and c.tokens == want and c.generation.stop_reason == "length"
        stopped, full = model.generate_many([p, p], max_tokens=12, ignore_eos=False), \
            model.generate_many([p], max_tokens=12, ignore_eos=True)
        assert [r.tokens for r in stopped] == [want[:cut]] * 2 and {r.finish_reason for r in stopped} == {"stop"}
        assert full[0].tokens == want and full[0].finish_reason == "length"
        with pytest.raises(ValueError, match="ignore_eos needs max_tokens"):
            model.add_request(p, max_tokens=None, ignore_eos=True)


def test_a_step_that_fails_on_the_background_thread_ends_its_requests_and_the_next_one_runs(plan):
    """The server's stepping thread: a step that raises ends every request in it with the error,
    and a request after it runs from a fresh start (the failed step's plan is not left pending)."""
    import time
    with llmrs.load(plan, backend="cpu") as model:
        batch = model._batcher()
        real, calls = batch.backend.submit_step, []

        def failing(rows, argmax):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("the device went away")
            return real(rows, argmax)
        batch.backend.submit_step = failing
        batch.start()
        try:
            first = model.add_request(prompts(1)[0], max_tokens=6)
            end = time.monotonic() + 30
            while not first.done:
                assert time.monotonic() < end, "the failed request never ended"
                time.sleep(0.01)
            assert first.finish_reason == "error" and "the device went away" in first.error
            second = model.add_request(prompts(1, seed=1)[0], max_tokens=6)
            while not second.done:
                assert time.monotonic() < end, "the request after the failure never ended"
                time.sleep(0.01)
            assert second.finish_reason == "length" and second.tokens == alone(model, prompts(1, seed=1)[0], 6)
        finally:
            batch.stop()
