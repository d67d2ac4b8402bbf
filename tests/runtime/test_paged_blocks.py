"""Paged KV bookkeeping (runtime/kv/paged.py) against a fake KV pool that stores each row's token.

The oracle: a back end that does exactly what the manager says (copies, then writes of each
step's tokens at the slots it was given, then compaction moves) must hold, for every live
sequence, its own token history at its KV indices 0..n-1, whatever was shared, copied, evicted,
forked, truncated or compacted in between.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrs.runtime.kv.paged import (BlockError, BlockManager, BlockPool, BlockTable, block_hash, kv_block_bytes,
                                    num_blocks_for_budget)


class FakeKV:
    """A pool of rows [heads, num_blocks * bs]; a row holds the token written there (-1: never)."""

    def __init__(self, m: BlockManager, heads: int = 1):
        self.m = m
        self.rows = np.full((heads, m.pool.num_blocks * m.block_size), -1, dtype=np.int64)

    def copy(self, copies):
        bs = self.m.block_size
        for src, dst in copies:
            self.rows[:, dst * bs:(dst + 1) * bs] = self.rows[:, src * bs:(src + 1) * bs]

    def step(self, seq_id, tokens):
        """What a step does for one sequence: slots, copies, the writes, the commit."""
        slots, copies = self.m.append_slots(seq_id, len(tokens))
        self.copy(copies)
        self.rows[:, slots] = tokens
        self.m.commit(seq_id, tokens)

    def compact(self, seq_id, keep):
        c = self.m.compact(seq_id, keep)
        self.copy(c.copies)
        if not c.dst_slots.size:
            return c
        src = np.broadcast_to(c.src_slots.reshape(-1, c.dst_slots.size), (self.rows.shape[0], c.dst_slots.size))
        gathered = np.take_along_axis(self.rows, src.astype(np.int64), axis=1)
        self.rows[:, c.dst_slots] = gathered
        return c

    def content(self, seq_id) -> np.ndarray:
        """[heads, n]: the tokens at the sequence's KV indices."""
        return self.rows[:, self.m.table(seq_id).slots(0, self.m.num_slots(seq_id))]


def _tokens(rng, n, vocab=50):
    return [int(t) for t in rng.integers(1, vocab, n)]


def test_block_table_maps_each_kv_index_into_its_block():
    rng = np.random.default_rng(1)
    blocks = [int(b) for b in rng.permutation(40)[:7]]
    table = BlockTable(16, blocks)
    for pos in rng.integers(0, 7 * 16, 30):
        assert table.slot(int(pos)) == blocks[pos // 16] * 16 + pos % 16
    slots = table.slots(13, 40)
    assert slots.dtype == np.int32
    assert slots.tolist() == [blocks[p // 16] * 16 + p % 16 for p in range(13, 53)]
    assert table.as_array(10).tolist() == blocks + [0, 0, 0]
    assert table.as_array(9, pad=-1).tolist() == blocks + [-1, -1]
    with pytest.raises(BlockError):
        table.slot(7 * 16)
    with pytest.raises(BlockError):
        table.slots(100, 20)
    with pytest.raises(BlockError):
        table.as_array(6)


def test_pool_refuses_a_double_free_a_share_of_a_free_block_and_an_empty_allocation():
    pool = BlockPool(3, 4)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and pool.num_available == 0
    with pytest.raises(BlockError, match="exhausted"):
        pool.allocate()
    pool.decref(got[1])
    with pytest.raises(BlockError, match="freed twice"):
        pool.decref(got[1])
    with pytest.raises(BlockError, match="free"):
        pool.incref(got[1])
    assert pool.allocate() == got[1]      # the free list is a stack: the block just freed comes back
    pool.check()


def test_allocation_takes_free_blocks_before_cached_ones_and_evicts_the_least_recent_first():
    pool = BlockPool(4, 2)
    blocks = [pool.allocate() for _ in range(4)]
    for i, b in enumerate(blocks[:3]):
        pool.register(b, bytes([i]) * 16)
    for b in (blocks[1], blocks[0], blocks[3], blocks[2]):  # 3 is unhashed: truly free
        pool.decref(b)
    assert (pool.num_free, pool.num_evictable) == (1, 3)
    assert pool.allocate() == blocks[3]
    assert pool.allocate() == blocks[1] and pool.lookup(bytes([1]) * 16) is None   # LRU, hash dropped
    pool.incref(blocks[0])               # a hit revives a cached block; freeing it again makes it recent
    pool.decref(blocks[0])
    assert pool.allocate() == blocks[2]
    assert pool.lookup(bytes([0]) * 16) == blocks[0]
    pool.check()


def test_block_hash_names_the_whole_prefix_not_only_the_block():
    a, b = [5, 6, 7, 8], [1, 2, 3, 4]
    assert block_hash(None, a) == block_hash(None, list(a)) == block_hash(None, np.array(a))
    assert block_hash(None, a) != block_hash(None, [5, 6, 7, 9])
    assert block_hash(block_hash(None, b), a) != block_hash(None, a)
    assert len(block_hash(None, a)) == 16


def test_second_sequence_with_a_400_token_prefix_reuses_its_25_full_blocks():
    rng = np.random.default_rng(2)
    m = BlockManager(80, 16)
    kv = FakeKV(m)
    prefix = _tokens(rng, 400)
    first = prefix + _tokens(rng, 30)
    assert m.allocate("a", first) == 0
    kv.step("a", first)
    second = prefix + _tokens(rng, 50)
    assert second[400] != first[400]
    assert m.cached_prefix(second) == 400             # 25 blocks of 16: the whole prefix (>= 384)
    cached = m.allocate("b", second)
    assert cached == 400
    assert m.table("b").blocks == m.table("a").blocks[:25]
    kv.step("b", second[cached:])
    assert kv.content("b")[0].tolist() == second and kv.content("a")[0].tolist() == first
    st_ = m.stats()
    assert (st_.query_tokens, st_.hit_tokens) == (len(first) + len(second), 400)
    assert st_.hit_rate == pytest.approx(400 / (len(first) + len(second)))
    m.check()


def test_cached_blocks_outlive_their_sequence_until_the_pool_needs_them():
    rng = np.random.default_rng(3)
    m = BlockManager(6, 4)
    kv = FakeKV(m)
    prompt = _tokens(rng, 17)                       # 4 full blocks + 1 token
    m.allocate("a", prompt)
    kv.step("a", prompt)
    m.free("a")
    assert m.stats().cached == 4 and m.stats().free == 2
    assert m.allocate("b", prompt) == 16            # revived from the evictable list
    kv.step("b", prompt[16:])
    assert kv.content("b")[0].tolist() == prompt
    m.free("b")
    m.allocate("c", _tokens(rng, 24, vocab=3) + [99])   # unrelated: needs 7 blocks' worth of allocation
    kv.step("c", _tokens(rng, 6 * 4, vocab=3))
    assert m.cached_prefix(prompt) < 16             # evicted tail first: some head blocks may remain
    m.free("c")
    m.check()
    assert m.stats().free + m.stats().cached == 6


@pytest.mark.parametrize("other_holder", [True, False])
def test_a_fully_cached_prompt_recomputes_its_last_token_through_copy_on_write(other_holder):
    """The last block is shared; writing the recomputed last row copies it if another sequence
    holds it (and the commit switches back to the shared block), or rewrites it in place if the
    hit revived it from the evictable list."""
    rng = np.random.default_rng(4)
    m = BlockManager(8, 4)
    kv = FakeKV(m)
    prompt = _tokens(rng, 12)
    m.allocate("a", prompt)
    kv.step("a", prompt)
    a_blocks = list(m.table("a").blocks)
    if not other_holder:
        m.free("a")
    assert m.allocate("b", prompt) == 11
    assert m.table("b").blocks == a_blocks
    slots, copies = m.append_slots("b", 1)
    if other_holder:
        assert len(copies) == 1 and copies[0][0] == a_blocks[2]
        assert slots.tolist() == [copies[0][1] * 4 + 3]
    else:
        assert copies == [] and slots.tolist() == [a_blocks[2] * 4 + 3]
    kv.copy(copies)
    kv.rows[:, slots] = prompt[11]
    m.commit("b", prompt[11:])
    assert m.table("b").blocks == a_blocks         # back on the cached block: one copy of the prefix
    assert kv.content("b")[0].tolist() == prompt
    assert m.cached_prefix(prompt) == 11           # still findable
    m.check()
    for s in ("a", "b") if other_holder else ("b",):
        m.free(s)
    assert m.stats().used == 0
    m.check()


def test_two_sequences_computing_the_same_prompt_side_by_side_end_on_one_set_of_blocks():
    rng = np.random.default_rng(5)
    m = BlockManager(10, 4)
    kv = FakeKV(m)
    prompt = _tokens(rng, 10)
    for s in ("a", "b"):
        assert m.allocate(s, prompt) == 0           # both admitted before either committed
    slots = {s: m.append_slots(s, 10)[0] for s in ("a", "b")}
    for s in ("a", "b"):
        kv.rows[:, slots[s]] = prompt
        m.commit(s, prompt)
    assert m.table("a").blocks[:2] == m.table("b").blocks[:2]
    assert m.table("a").blocks[2] != m.table("b").blocks[2]      # the partial block stays private
    assert m.stats().used == 4
    assert kv.content("b")[0].tolist() == prompt
    m.check()


def test_fork_shares_every_block_and_copies_the_partial_one_on_first_write():
    rng = np.random.default_rng(6)
    m = BlockManager(8, 4)
    kv = FakeKV(m)
    prompt = _tokens(rng, 6)
    m.allocate("p", prompt)
    kv.step("p", prompt)
    m.fork("p", "c")
    assert m.table("c").blocks == m.table("p").blocks and m.stats().used == 2
    _, copies = m.append_slots("c", 1)
    assert copies == [(m.table("p").blocks[1], m.table("c").blocks[1])]
    kv.copy(copies)
    kv.rows[:, m.table("c").slot(6)] = 41
    m.commit("c", [41])
    kv.step("p", [42])                               # now the sole holder: written in place
    assert kv.content("p")[0].tolist() == prompt + [42]
    assert kv.content("c")[0].tolist() == prompt + [41]
    m.check()


def test_truncate_rolls_back_exactly_and_a_rewrite_leaves_the_cached_prefix_intact():
    rng = np.random.default_rng(7)
    m = BlockManager(8, 4)
    kv = FakeKV(m)
    prompt = _tokens(rng, 5)
    m.allocate("a", prompt)
    kv.step("a", prompt)
    draft = _tokens(rng, 7)
    kv.step("a", draft)                             # 12 entries: 3 full blocks, all hashed
    used = m.stats().used
    m.truncate("a", 6)                              # reject all but one draft token
    assert m.num_slots("a") == 6 and m.stats().used == used - 1
    assert kv.content("a")[0].tolist() == prompt + draft[:1]
    kv.step("a", [77, 78])                          # rewrites block 1, which the cache still names
    assert kv.content("a")[0].tolist() == prompt + draft[:1] + [77, 78]
    full = prompt + draft
    m.allocate("b", full + [1])
    assert m.cached_prefix(full) <= 4
    kv.step("b", full[m.num_slots("b"):] + [1])
    assert kv.content("b")[0].tolist() == full + [1]
    with pytest.raises(BlockError):
        m.truncate("a", 9)
    m.check()


def test_compact_moves_kept_entries_down_frees_the_tail_and_copies_a_shared_block_first():
    rng = np.random.default_rng(8)
    m = BlockManager(12, 4)
    kv = FakeKV(m)
    prompt = _tokens(rng, 14)
    m.allocate("a", prompt)
    kv.step("a", prompt)
    m.allocate("b", prompt[:9])                     # shares a's first two blocks
    kv.step("b", prompt[8:9])
    keep = np.array([0, 1, 2, 3, 5, 9, 12, 13])     # block 0 untouched, block 1 shared and rewritten
    shared = m.table("a").blocks[1]
    c = kv.compact("a", keep)
    assert c.copies == [(shared, m.table("a").blocks[1])]
    assert c.freed_blocks == 2 and len(m.table("a")) == 2
    assert c.moves == [(int(c.src_slots[i]), int(c.dst_slots[i])) for i in range(4, 8)]
    assert kv.content("a")[0].tolist() == [prompt[i] for i in keep]
    assert kv.content("b")[0].tolist() == prompt[:9]
    assert m.table("a").blocks[0] == m.table("b").blocks[0]   # the untouched prefix stays shared
    kv.step("a", [60, 61, 62])                      # goes on after the compacted entries
    assert kv.content("a")[0].tolist() == [prompt[i] for i in keep] + [60, 61, 62]
    with pytest.raises(BlockError):
        m.compact("a", np.array([3, 2]))
    m.check()


def test_compact_per_kv_head_keeps_different_entries_in_each_head():
    rng = np.random.default_rng(9)
    m = BlockManager(10, 4)
    kv = FakeKV(m, heads=3)
    prompt = _tokens(rng, 19)
    m.allocate("a", prompt)
    kv.step("a", prompt)
    keep = np.stack([np.sort(rng.choice(19, 7, replace=False)) for _ in range(3)])
    c = kv.compact("a", keep)
    assert c.src_slots.shape == (3, 7) and c.dst_slots.shape == (7,)
    assert kv.content("a").tolist() == [[prompt[i] for i in row] for row in keep]
    assert len(m.table("a")) == 2 and m.stats().used == 2
    m.check()


def test_kv_block_bytes_follow_each_dtype_layout():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64
    row = {"f32": 64 * 4, "f16": 64 * 2, "q8_0": 2 * 34, "q4_0": 2 * 18}
    for dtype, head_row in row.items():
        assert kv_block_bytes(30, 16, 3, 64, dtype) == 30 * 2 * 16 * 3 * head_row
    per_block = kv_block_bytes(30, 16, 3, 64, "q8_0")
    assert num_blocks_for_budget(per_block * 37 + 5, 30, 16, 3, 64, "q8_0") == 37
    with pytest.raises(ValueError, match="head_dim is 48; use f16"):
        kv_block_bytes(2, 16, 2, 48, "q4_0")
    with pytest.raises(ValueError, match="--block-size"):
        num_blocks_for_budget(100, 30, 16, 3, 64, "f16")
    with pytest.raises(ValueError, match="kv_dtype 'bf16'"):
        kv_block_bytes(2, 16, 2, 64, "bf16")


# ---- random lives of many sequences, checked against the fake pool after every operation ----------

OPS = ["new", "new", "step", "step", "step", "fork", "truncate", "compact", "free"]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_ops=st.integers(5, 80), num_blocks=st.integers(4, 16),
       bs=st.sampled_from([1, 2, 4]), cache=st.booleans())
def test_random_sharing_never_corrupts_a_sequence_or_leaks_a_block(seed, n_ops, num_blocks, bs, cache):
    rng = np.random.default_rng(seed)
    m = BlockManager(num_blocks, bs, enable_prefix_cache=cache)
    kv = FakeKV(m, heads=2)
    stems = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9]]     # shared prefixes make hits likely
    expected: dict[int, list[list[int]]] = {}                  # per head, what each sequence must read
    next_id = 0
    for _ in range(n_ops):
        op = OPS[rng.integers(len(OPS))]
        live = sorted(expected)
        if op == "new" or not live:
            prompt = stems[rng.integers(2)][:rng.integers(3, 9)] + _tokens(rng, int(rng.integers(0, 4)), vocab=4)
            if not m.can_allocate(len(prompt)):
                continue
            cached = m.allocate(next_id, prompt)
            assert cached < len(prompt)
            n = m.max_append(next_id, len(prompt) - cached)
            kv.step(next_id, prompt[cached:cached + n])
            expected[next_id] = [prompt[:cached + n]] * 2
            next_id += 1
        else:
            s = live[rng.integers(len(live))]
            if op == "step":
                toks = _tokens(rng, m.max_append(s, int(rng.integers(1, 6))), vocab=4)
                kv.step(s, toks)
                expected[s] = [e + toks for e in expected[s]]
            elif op == "fork" and m.pool.num_available:
                m.fork(s, next_id)
                expected[next_id] = [list(e) for e in expected[s]]
                next_id += 1
            elif op == "truncate":
                n = int(rng.integers(0, m.num_slots(s) + 1))
                m.truncate(s, n)
                expected[s] = [e[:n] for e in expected[s]]
            elif op == "compact" and m.num_slots(s):
                n = m.num_slots(s)
                k = int(rng.integers(0, n + 1))
                keep = np.stack([np.sort(rng.choice(n, k, replace=False)) for _ in range(2)])
                if rng.integers(2):
                    keep[1] = keep[0]
                shared = sum(m.pool.refcount[b] > 1 for b in m.table(s).blocks)
                if shared > m.pool.num_available:
                    continue
                kv.compact(s, keep)
                expected[s] = [[e[i] for i in row] for e, row in zip(expected[s], keep)]
            elif op == "free":
                m.free(s)
                del expected[s]
        m.check()
        for s, e in expected.items():
            assert kv.content(s).tolist() == e, f"sequence {s}"
    for s in list(expected):
        m.free(s)
    m.check()
    assert m.stats().free + m.stats().cached == num_blocks and m.stats().used == 0
