"""Eviction per sequence in a batch (runtime/kv/perseq.py through the scheduler and the step
graph): each sequence's greedy tokens equal the same prompt run alone through the single-sequence
Engine under the same policy, across the end of the cache, with sequences joining mid-run; block
accounting stays exact; a block shared through the prefix cache is copied, not changed."""
from __future__ import annotations

import numpy as np
import pytest

import llmrs
from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.cli import main as run_main
from llmrs.runtime.kv.store import HostKV

from ..conftest import DATA

SLIDING = dict(eviction_policy="sliding", eviction_window=10, protected_prefix=3)   # budget 13 of 64 slots


def _plan(tmp_path_factory, target: str):
    out = tmp_path_factory.mktemp(f"evict-{target}") / "golden-b.plan.bin"
    assert compile_main([str(DATA / "golden-b"), "-o", str(out), "--max-seq-len", "64", "--prefill-chunk", "16",
                         "--max-num-seqs", "4", "--block-size", "8", "--weights", "f32", "--kv-type", "f32",
                         "--target", target, "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """golden-b: 16-row steps for up to 4 sequences, 8-token blocks, 64 cache slots (8 blocks)."""
    return _plan(tmp_path_factory, "cpu")


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, n).tolist() for n in lengths]


def alone(model, prompt: list[int], n: int) -> list[int]:
    model.reset()
    c = model.generate(prompt, max_tokens=n)
    list(c)
    return c.tokens


def run_joining(model, ps: list[list[int]], n: int, join_after: int) -> list:
    """The first prompts start together; the last joins after join_after steps."""
    reqs = [model.add_request(p, max_tokens=n) for p in ps[:-1]]
    for _ in range(join_after):
        model.step()
    reqs.append(model.add_request(ps[-1], max_tokens=n))
    while model.step():
        model.batch.scheduler.kv.check()
    return reqs


def test_sliding_per_sequence_gives_each_prompt_its_tokens_alone_past_the_cache_end(plan):
    """3 prompts of 4..12 tokens (one joins after 5 steps), 90 tokens each: far past the 64-slot
    cache and the 8-block pool, which 3 unevicted sequences of 100 tokens could never share."""
    ps = prompts([9, 4, 12], seed=1)
    with llmrs.load(plan, **SLIDING) as model:
        want = [alone(model, p, 90) for p in ps]
        reqs = run_joining(model, ps, 90, join_after=5)
        assert [r.tokens for r in reqs] == want
        kv = model.batch.scheduler.kv
        kv.check()
        assert kv.stats().used == 0 and sum(r.preemptions for r in reqs) == 0
        # each decode past the budget of 13 entries evicts one (the first token comes from the prefill;
        # a stop token, not in tokens, came from one more decode)
        fed = [len(p) + len(r.tokens) - (r.finish_reason != "stop") for p, r in zip(ps, reqs)]
        assert len(model.batch.evictions) == sum(max(0, n - 13) for n in fed)
        assert max(fed) > 64
        assert {e.after for e in model.batch.evictions} == {13}


def test_a_prompt_longer_than_the_cache_is_evicted_in_chunks_as_alone(plan):
    """70 prompt tokens through a 64-slot cache: alone in the batch it is chunked and evicted as
    the Engine's prefill does it."""
    p = prompts([70], seed=2)[0]
    with llmrs.load(plan, **SLIDING) as model:
        want = alone(model, p, 20)
        req = model.generate_many([p], max_tokens=20)[0]
        assert req.tokens == want and len(want) > 0
        assert {e.trigger for e in model.batch.evictions} == {"budget"}


def test_evicting_sequences_preempted_for_blocks_account_every_block(plan):
    """4 sequences whose windows need more blocks than the pool has: preemption and recompute
    under eviction leave no block leaked or shared without a holder."""
    ps = prompts([14, 6, 11, 3], seed=3)
    with llmrs.load(plan, eviction_policy="sliding", eviction_window=20, protected_prefix=4) as model:
        reqs = model.generate_many(ps, max_tokens=40)
        assert all(len(r.tokens) == 40 or r.finish_reason == "stop" for r in reqs)
        assert sum(r.preemptions for r in reqs) > 0
        kv = model.batch.scheduler.kv
        kv.check()
        stats = kv.stats()
        assert stats.used == 0 and stats.free + stats.cached == 8


def test_a_sharer_that_evicts_copies_the_shared_prefix_block(plan):
    """Two prompts after the same 8-token system prompt (a full block, cached by a first request):
    the one that goes past its budget copies that block (its sinks stay, the rest moves down)
    instead of changing it under the other, so the cached block still holds the prefix."""
    system = prompts([8], seed=4)[0]
    first, a, b = system + [5, 6], system + [7, 8, 9, 1, 2], system + [10, 11]
    with llmrs.load(plan, **SLIDING) as model:
        want_a, want_b = alone(model, a, 12), alone(model, b, 3)
        model.generate_many([first], max_tokens=1)
        store: HostKV = model.backend.kv_store()
        kv = model.batch.scheduler.kv
        (block,) = kv.pool._by_hash.values()
        rows = [store.cache(layer, which)[block * 8:(block + 1) * 8].copy()
                for layer in range(store.n_layers) for which in ("k", "v")]
        ra = model.add_request(a, max_tokens=12)    # 13 prompt tokens: evicts after its first decode
        rb = model.add_request(b, max_tokens=3)     # 10 + 3 entries: never over the budget of 13
        while model.step():
            kv.check()
        assert ra.cached_tokens == 8 and rb.cached_tokens == 8
        assert ra.tokens == want_a and rb.tokens == want_b
        assert len(model.batch.evictions) == 12 + 13 - 13 - 1
        assert all(np.array_equal(store.cache(layer, which)[block * 8:(block + 1) * 8], rows[2 * layer + i])
                   for layer in range(store.n_layers) for i, which in enumerate(("k", "v")))
        assert kv.pool.lookup(kv.pool.hash_of[block]) == block
        assert model.generate_many([system + [12]], max_tokens=1)[0].cached_tokens == 8


def test_host_move_slots_gathers_before_writing_whole_rows_and_per_head(plan):
    with llmrs.load(plan) as model:
        store: HostKV = model.backend.kv_store()
        rng = np.random.default_rng(5)
        for layer in store.layers:
            for name in (layer.k, layer.v):
                store.arrays[name][...] = rng.standard_normal(store.arrays[name].shape)
        k0 = store.cache(1, "v").copy()
        src, dst = np.array([3, 4, 5, 9]), np.array([1, 2, 3, 4])     # 3 is read and overwritten
        store.move_slots(src, dst)
        assert np.array_equal(store.cache(1, "v")[dst], k0[src])
        per_head = np.stack([np.stack([src, np.array([2, 5, 7, 8])][:store.n_kv_heads])] * store.n_layers)
        if store.n_kv_heads == 1:
            per_head = per_head[:, :1]
        k1 = store.cache(0, "k").copy()
        store.move_slots(per_head, dst)
        for h in range(store.n_kv_heads):
            assert np.array_equal(store.cache(0, "k")[dst, h], k1[per_head[0, h], h])


@pytest.mark.usefixtures("opencl_device")
def test_sliding_per_sequence_on_opencl_gives_each_prompt_its_tokens_alone(tmp_path_factory):
    plan = _plan(tmp_path_factory, "opencl")
    ps = prompts([9, 4, 12], seed=1)
    with llmrs.load(plan, backend="opencl", **SLIDING) as model:
        want = [alone(model, p, 80) for p in ps]
        reqs = run_joining(model, ps, 80, join_after=5)
        assert [r.tokens for r in reqs] == want
        assert max(len(t) for t in want) + 12 > 64 and model.batch.evictions
        model.batch.scheduler.kv.check()


@pytest.mark.parametrize("policy", ["sliding", "h2o"])
def test_llmrs_run_with_several_prompts_evicts_each_as_one_prompt_alone(plan, capsys, policy):
    """Each of two prompts run together evicts as when run alone: by the window (sliding), or by
    the scores the batch's step graph writes per sequence (h2o)."""
    flags = ["--eviction-policy", policy, "--eviction-window", "10", "--protected-prefix", "3", "-n", "70"]
    texts = ["Once upon a time", "The cat sat"]
    alone_out = []
    for t in texts:
        assert run_main([str(plan), "-p", t, *flags]) == 0
        alone_out.append(capsys.readouterr().out.rstrip("\n"))
    assert run_main([str(plan), "-p", texts[0], "-p", texts[1], *flags, "--stats"]) == 0
    cap = capsys.readouterr()
    got = dict(line.split(" ", 1) for line in cap.out.split("\n[") if line)
    assert {k.strip("[]"): v.rstrip("\n") for k, v in got.items()} == {"1": alone_out[0], "2": alone_out[1]}
    assert "evictions" in cap.err and "budget" in cap.err and policy in cap.err


# budget 13 of 64 slots each. SnapKV evicts a prompt over the budget after its prefill (its last 4
# queries vote) and a sequence whose cache fills; H2O after every decode past the budget (each KV
# head keeps its own heaviest entries). The joining prompts and their tokens fit the pool together
# (SnapKV's two at most 13 + 18 entries each), so no sequence is preempted and recomputed.
SCORED = {"snapkv": dict(eviction_policy="snapkv", eviction_window=10, protected_prefix=3, snapkv_window=4),
          "h2o": dict(eviction_policy="h2o", eviction_window=10, protected_prefix=3)}
JOINING = {"snapkv": ([20, 14], 18), "h2o": ([9, 4, 12], 80)}


def check_scored_batch(model, policy: str) -> None:
    """The joining prompts (the last after 2 steps) give the tokens each gets alone, through
    evictions by the step graph's scores; then one prompt alone in the batch past the cache end."""
    lengths, n = JOINING[policy]
    ps = prompts(lengths, seed=7)
    want = [alone(model, p, n) for p in ps]
    reqs = run_joining(model, ps, n, join_after=2)
    assert [r.tokens for r in reqs] == want
    assert sum(r.preemptions for r in reqs) == 0 and not model.batch.config.enable_prefix_cache
    assert {e.policy for e in model.batch.evictions} == {policy} and {e.after for e in model.batch.evictions} == {13}
    model.batch.scheduler.kv.check()
    assert model.batch.scheduler.kv.stats().used == 0
    long = prompts([6], seed=11)[0]
    want = alone(model, long, 80)
    model.batch.evictions.clear()
    assert model.generate_many([long], max_tokens=80)[0].tokens == want and len(want) + 6 > 64
    assert "full" in {e.trigger for e in model.batch.evictions} or policy == "h2o"


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_score_policies_per_sequence_give_each_prompt_its_tokens_alone_past_the_cache_end(plan, policy):
    with llmrs.load(plan, **SCORED[policy]) as model:
        check_scored_batch(model, policy)


@pytest.mark.usefixtures("opencl_device")
@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_score_policies_per_sequence_on_opencl_give_each_prompt_its_tokens_alone(tmp_path_factory, policy):
    with llmrs.load(_plan(tmp_path_factory, "opencl"), backend="opencl", **SCORED[policy]) as model:
        check_scored_batch(model, policy)



@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_per_head_compaction_of_a_paged_sequence_equals_the_contiguous_cache_s(plan, policy):
    """The same KV rows and scores, once in a sequence's scattered blocks and once at the front of
    a contiguous cache: evicting per KV head (SeqEviction on the pool, CacheManager on the cache)
    leaves the same rows and scores in the same order."""
    from llmrs.runtime.kv import CacheManager, make_policy
    from llmrs.runtime.kv.paged import BlockManager
    from llmrs.runtime.kv.perseq import SeqEviction

    rng = np.random.default_rng(6)
    with llmrs.load(plan, backend="reference") as paged, llmrs.load(plan, backend="reference") as flat:
        pool, cache = paged.backend.kv_store(), flat.backend.kv_store()
        blocks = BlockManager(8, 8, enable_prefix_cache=False)
        blocks.allocate("other", [1] * 5)
        blocks.append_slots("other", 5)
        n = 30
        blocks.allocate("seq", [1] * n)
        slots, _ = blocks.append_slots("seq", n)
        blocks.commit("seq", [1] * n)
        for layer in range(pool.n_layers):
            for name in (pool.layers[layer].k, pool.layers[layer].v, pool.layers[layer].scores):
                data = rng.standard_normal(cache.arrays[name].shape).astype(cache.arrays[name].dtype)
                cache.arrays[name][...] = data
                if name == pool.layers[layer].scores:
                    pool.arrays[name][:, slots] = data[:, :n]
                else:
                    pool.arrays[name][slots] = data[:n]
        pol = make_policy(policy, 12, 2, snapkv_window=4)
        ev = SeqEviction(pol, 64, blocks, pool)
        ev.start("seq", n)
        ev._evict("seq", n, 14, "budget")
        mgr = CacheManager(make_policy(policy, 12, 2, snapkv_window=4), cache)
        mgr.record_step(0, 0, n)
        mgr._evict(n, 14, "budget")
        blocks.check()
        kept = blocks.table("seq").slots(0, 14)
        assert len(blocks.table("seq")) == 2 and blocks.num_slots("seq") == 14
        for layer in range(pool.n_layers):
            for which in ("k", "v"):
                assert np.array_equal(pool.cache(layer, which)[kept], cache.cache(layer, which)[:14])
        if not pol.clears_scores_after_eviction:
            assert np.array_equal(pool.slot_scores(kept), cache.scores(14))
        assert np.array_equal(ev.view("seq", 14).positions, mgr.positions[:, :, :14])
        assert len({tuple(p) for p in mgr.positions[:, :, :14].reshape(-1, 14)}) > 1   # heads kept their own
