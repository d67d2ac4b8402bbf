"""Eviction policies and the CacheManager on hand-made caches and scores (runtime/kv)."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.options import OptionError
from llmrs.runtime.kv import (H2O, CacheManager, CacheView, MemoryStats, PolicyError, SlidingWindow, SnapKV,
                              StepInfo, make_policy, pool1d)
from llmrs.runtime.kv.policy import _top
from llmrs.runtime.kv.store import NEVER, HostKV

L, KVH, S = 2, 3, 32


def _view(n: int, scores: np.ndarray | None = None, seed: int = 0) -> CacheView:
    """n slots whose positions have gaps (an earlier eviction), different per layer and head."""
    rng = np.random.default_rng(seed)
    gaps = rng.integers(1, 4, (L, KVH, n))
    return CacheView(n, np.cumsum(gaps, axis=-1) - 1, scores)


def test_sliding_keeps_the_protected_prefix_and_the_most_recent_window():
    pol = SlidingWindow(window=6, protected_prefix=3)
    assert pol.budget(S) == 9
    view = _view(20)
    keep = pol.select(view, pol.budget(S))
    assert keep.shape == (L, KVH, 9)
    assert (keep == [0, 1, 2, 14, 15, 16, 17, 18, 19]).all()
    kept_pos = np.take_along_axis(view.positions, keep, axis=-1)
    np.testing.assert_array_equal(kept_pos[..., :3], view.positions[..., :3])     # the sinks
    np.testing.assert_array_equal(kept_pos[..., 3:], view.positions[..., -6:])    # the newest


def test_budget_is_capped_so_the_next_token_fits():
    assert SlidingWindow(window=100, protected_prefix=4).budget(S) == S - 1
    with pytest.raises(PolicyError, match="^protected_prefix 31 leaves no room in a KV cache of 32 slots") as e:
        SlidingWindow(window=4, protected_prefix=31).budget(S)
    assert _flags(e.value).endswith("use a smaller prefix or recompile with a larger --max-seq-len")


def _pool_loop(x: np.ndarray, k: int, mode: str) -> np.ndarray:
    """torch's max_pool1d / avg_pool1d(count_include_pad) at stride 1, padding k // 2, by hand."""
    x = x.astype(np.float64)
    out = np.empty(x.shape, np.float64)
    for i in range(x.shape[-1]):
        lo, hi = i - k // 2, i + k // 2 + 1
        win = [x[..., j] if 0 <= j < x.shape[-1] else np.full(x.shape[:-1], -np.inf if mode == "max" else 0.0)
               for j in range(lo, hi)]
        out[..., i] = np.max(win, axis=0) if mode == "max" else np.sum(win, axis=0) / k
    return out


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_pooling_matches_torch_semantics(mode, k):
    x = np.random.default_rng(k).random((L, KVH, 19)).astype(np.float32) + 0.1
    np.testing.assert_allclose(pool1d(x, k, mode), _pool_loop(x, k, mode), rtol=1e-12)


def _spiky_scores(n: int) -> np.ndarray:
    """Small random scores with, per KV head, one large spike at a head-specific slot."""
    sc = np.random.default_rng(1).random((L, KVH, n)).astype(np.float32) * 0.01 + 0.001
    for layer in range(L):
        for h in range(KVH):
            sc[layer, h, 4 + 3 * h + layer] = 5.0
    return sc


def test_snapkv_keeps_the_positions_with_the_highest_pooled_scores_per_head():
    n, prefix, obs = 24, 2, 4
    scores = _spiky_scores(n)
    pol = SnapKV(window=10, protected_prefix=prefix, obs_window=obs, kernel=3, pooling="max")
    view = _view(n, scores)
    keep = pol.select(view, 9)                    # 2 sinks + 3 voted + the 4-slot window
    for layer in range(L):
        for h in range(KVH):
            spike = 4 + 3 * h + layer
            # max pooling spreads the spike to its neighbours: those three win, per head
            assert list(keep[layer, h]) == [0, 1, spike - 1, spike, spike + 1, 20, 21, 22, 23]
    # the same choice from the pooled scores by hand: the top 3 candidates of [2, 20)
    pooled = _pool_loop(scores[..., :n - obs], 3, "max")
    for layer in range(L):
        for h in range(KVH):
            cand = np.arange(prefix, n - obs)
            best = cand[np.argsort(-pooled[layer, h, prefix:], kind="stable")[:3]]
            assert set(keep[layer, h, prefix:prefix + 3]) == set(best)


def test_snapkv_avg_pooling_prefers_a_broad_bump_over_a_lone_peak():
    n = 20
    sc = np.full((1, 1, n), 0.01, np.float32)
    sc[0, 0, 5] = 1.0                           # lone peak: avg over 3 = 0.34
    sc[0, 0, 11:14] = 0.6                       # bump: its middle averages 0.6
    view = CacheView(n, np.arange(n)[None, None], sc)
    raw_top = SnapKV(window=8, obs_window=2, kernel=1, pooling="avg").select(view, 3)
    smooth_top = SnapKV(window=8, obs_window=2, kernel=3, pooling="avg").select(view, 3)
    assert list(raw_top[0, 0]) == [5, 18, 19]   # kernel 1: the raw maximum
    assert list(smooth_top[0, 0]) == [12, 18, 19]


def test_h2o_evicts_the_lowest_accumulated_mass_outside_the_recent_window():
    n, prefix, recent, keep_n = 26, 1, 5, 12
    mass = np.random.default_rng(3).random((L, KVH, n)).astype(np.float32)
    pol = H2O(window=11, protected_prefix=prefix, recent=recent)
    keep = pol.select(_view(n, mass), keep_n)
    heavy = keep_n - prefix - recent
    for layer in range(L):
        for h in range(KVH):
            kept = keep[layer, h]
            assert kept[0] == 0 and list(kept[-recent:]) == list(range(n - recent, n))
            middle = np.arange(prefix, n - recent)
            evicted = np.setdiff1d(middle, kept)
            assert len(kept) - prefix - recent == heavy and len(evicted) == len(middle) - heavy
            # every heavy hitter kept outweighs every slot evicted outside the recent window
            assert mass[layer, h, kept[prefix:-recent]].min() > mass[layer, h, evicted].max()
    assert not np.array_equal(keep[0, 0], keep[0, 1])   # heads choose for themselves


@pytest.mark.parametrize("name", ["sliding", "snapkv", "h2o"])
def test_the_protected_prefix_is_never_evicted(name):
    n, prefix = 30, 4
    scores = np.ones((L, KVH, n), np.float32)
    scores[..., :prefix] = 0.0                  # the sinks look worthless to a scoring policy
    pol = make_policy(name, window=10, protected_prefix=prefix, snapkv_window=3)
    for keep_n in (pol.min_keep(), pol.budget(S), 8):
        keep = pol.select(_view(n, scores), keep_n)
        assert (keep[..., :prefix] == np.arange(prefix)).all(), keep_n
        assert keep.shape[-1] == keep_n and (np.diff(keep, axis=-1) > 0).all()


def _flags(error: OptionError) -> str:
    """The error as a command line words it."""
    return error.worded(lambda name: "--" + name.replace("_", "-"))


@pytest.mark.parametrize("make, message", [
    (lambda: make_policy("sliding", 0), "{eviction_window} must be at least 1, got 0"),
    (lambda: make_policy("fifo", 8), "{eviction_policy} 'fifo': choose one of none, sliding, snapkv, h2o"),
    (lambda: make_policy("snapkv", 8, snapkv_kernel=4), "{snapkv_kernel} must be an odd number >= 1, got 4"),
    (lambda: make_policy("snapkv", 8, snapkv_pooling="min"), "{snapkv_pooling} 'min': choose one of max, avg"),
    (lambda: make_policy("h2o", 8, h2o_recent=9), "{h2o_recent} must be 0..{eviction_window} (8), got 9"),
])
def test_bad_policy_settings_are_one_line_errors_naming_the_option_or_flag(make, message):
    with pytest.raises(PolicyError) as e:
        make()
    names = ("eviction_window", "eviction_policy", "snapkv_kernel", "snapkv_pooling", "h2o_recent")
    assert str(e.value) == message.format(**{n: n for n in names})
    assert _flags(e.value) == message.format(**{n: "--" + n.replace("_", "-") for n in names})


# -- the manager over host arrays ------------------------------------------------------------

class _Store(HostKV):
    """HostKV over hand-made arrays for L layers (no graph): K/V rows of `row` bytes."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        from llmrs.runtime.kv.store import LayerStates
        self.layers = [LayerStates(f"k{i}", f"v{i}", f"s{i}") for i in range(L)]
        self.ctl_name = "ctl"
        self.arrays = arrays
        self.n_layers, self.slots, self.n_kv_heads = L, S, KVH


def _store(row_bytes: int, seed: int = 0) -> _Store:
    rng = np.random.default_rng(seed)
    arrays = {"ctl": np.zeros(2, np.int32)}
    for i in range(L):
        arrays[f"k{i}"] = rng.integers(0, 256, (S, KVH, row_bytes), dtype=np.uint8)
        arrays[f"v{i}"] = rng.integers(0, 256, (S, KVH, row_bytes), dtype=np.uint8)
        arrays[f"s{i}"] = rng.random((KVH, S)).astype(np.float32) + 0.5
    return _Store(arrays)


class _Monitor:
    def __init__(self, available_mb: float):
        self.available_mb = available_mb

    def mem_stats(self) -> MemoryStats:
        b = int(self.available_mb * 2**20)
        return MemoryStats(8 << 30, b, b)


def _fill(m: CacheManager, n: int, start: int = 0) -> None:
    m.record_step(0, start, n)


# f16 and f32 rows of hd = 16, and q8_0 rows of hd = 64: two whole 34-byte blocks
@pytest.mark.parametrize("row_bytes", [32, 64, 68])
def test_compaction_moves_whole_head_rows_and_their_scores(row_bytes):
    store = _store(row_bytes)
    before = {k: v.copy() for k, v in store.arrays.items()}
    m = CacheManager(make_policy("h2o", window=9, protected_prefix=2, h2o_recent=3), store)
    _fill(m, 25, start=100)
    n = m.after_step(25)
    assert n == 11 and [(e.trigger, e.before, e.after) for e in m.events] == [("budget", 25, 11)]
    keep = np.stack([np.stack([np.sort(np.concatenate([
        [0, 1], 2 + np.argsort(-before[f"s{i}"][h, 2:22], kind="stable")[:6], [22, 23, 24]])) for h in range(KVH)])
        for i in range(L)])
    for i in range(L):
        for h in range(KVH):
            for c in ("k", "v"):
                np.testing.assert_array_equal(store.arrays[f"{c}{i}"][:11, h], before[f"{c}{i}"][keep[i, h], h])
            np.testing.assert_array_equal(store.arrays[f"s{i}"][h, :11], before[f"s{i}"][h, keep[i, h]])
            assert not store.arrays[f"s{i}"][h, 11:].any()          # later steps add to zeros
    np.testing.assert_array_equal(m.positions[:, :, :11], 100 + keep)  # RoPE positions travel along


def test_memory_pressure_evicts_down_to_the_target_ratio_and_logs_it():
    store = _store(32)
    monitor = _Monitor(available_mb=900)
    logged = []
    m = CacheManager(make_policy("sliding", window=20, protected_prefix=1), store, monitor, threshold_mb=1000,
                     target_ratio=0.25, on_event=logged.append)
    _fill(m, 16)
    assert m.after_step(16) == 4                  # under the threshold: 16 * 0.25 slots stay
    assert [(e.policy, e.trigger, e.before, e.after) for e in logged] == [("sliding", "memory", 16, 4)]
    assert "evicted KV cache (sliding, memory): 16 -> 4 slots" in logged[0].line()
    assert list(m.positions[0, 0, :4]) == [0, 13, 14, 15]
    monitor.available_mb = 1200                   # pressure gone: nothing more
    m.record_step(4, 16, 1)
    assert m.after_step(5) == 5 and len(logged) == 1
    monitor.available_mb = 10                     # never below the prefix and the newest token
    for n in (5, 3, 2):
        n = m.after_step(n)
    assert n == 2 and logged[-1].after == 2


def test_the_manager_refuses_settings_that_cannot_work():
    store = _store(32)
    with pytest.raises(OptionError, match="^eviction_target_ratio must be between 0 and 1, got 1.5$"):
        CacheManager(make_policy("sliding", 8), store, target_ratio=1.5)
    with pytest.raises(OptionError, match="^memory_threshold_mb needs an eviction_policy that evicts") as e:
        CacheManager(make_policy("none", 8), store, _Monitor(1), threshold_mb=100)
    assert _flags(e.value).startswith("--memory-threshold-mb needs an --eviction-policy that evicts")


def test_scores_are_on_only_for_the_rows_a_policy_votes_with():
    store = _store(32)
    ctl = store.arrays["ctl"]
    m = CacheManager(make_policy("snapkv", window=8, snapkv_window=4), store)
    assert list(ctl) == [0, NEVER]
    # a 10-token prompt in chunks of 8 and 2: only its last 4 rows vote (slots 6..9)
    m.before_step(StepInfo("prefill", 0, 8, 2, True, S))
    assert list(ctl) == [1, 6] and not store.arrays["s0"].any()     # cleared at the prompt's start
    store.arrays["s0"][...] = 1.0
    m.before_step(StepInfo("prefill", 8, 2, 0, False, S))
    assert list(ctl) == [1, 6] and store.arrays["s0"].all()
    m.before_step(StepInfo("decode", 27, 1, 0, False, S))           # decode rows outside the window
    assert list(ctl) == [0, NEVER] and store.arrays["s0"].all()
    m.before_step(StepInfo("decode", S - 4, 1, 0, False, S))         # the last window before full
    assert list(ctl) == [1, S - 4] and not store.arrays["s0"].any()
    # under a memory threshold every decode row votes: an eviction may come at any step
    watched = CacheManager(make_policy("snapkv", window=8, snapkv_window=4), store, _Monitor(10), threshold_mb=1)
    watched.before_step(StepInfo("decode", 20, 1, 0, False, S))
    assert list(ctl) == [1, 0]
    # sliding never scores; h2o scores every row
    for name, want in (("sliding", [0, NEVER]), ("h2o", [1, 0])):
        store = _store(32)
        m = CacheManager(make_policy(name, 8), store)
        m.before_step(StepInfo("prefill", 0, 8, 0, True, S))
        assert list(store.arrays["ctl"]) == want


@pytest.mark.parametrize("n, lo, count", [(40, 0, 1), (40, 3, 20), (40, 3, 37), (7, 2, 5), (300, 4, 150)])
def test_top_slots_are_a_stable_sorts_with_ties_going_to_the_earlier_slot(n, lo, count):
    rng = np.random.default_rng(n + count)
    values = rng.integers(0, 4, (L, KVH, n)).astype(np.float32)   # few distinct values: many ties
    values[0, 0, lo + 1] = np.nan                                   # a broken score is never kept
    got = _top(values, lo, n, count)
    ranked = np.nan_to_num(values[..., lo:], nan=-np.inf)
    want = np.sort(np.argsort(-ranked, axis=-1, kind="stable")[..., :count] + lo, axis=-1)
    np.testing.assert_array_equal(got, want)
    assert lo + 1 not in got[0, 0] or count > n - lo - 1
