"""Eviction policies: which cache slots each KV head keeps when the cache must shrink.

A policy sees the cache as a CacheView (slots in use, each slot's RoPE position per layer and
KV head, and, for the policies that ask, the attention scores the kernels accumulated) and
returns, per layer and KV head, the same number of old slots to keep, ascending. It never
moves data; the CacheManager does that on the back end's buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...options import OptionError

POLICIES = ("none", "sliding", "snapkv", "h2o")
POOLINGS = ("max", "avg")


class PolicyError(OptionError):
    """A policy setting that cannot work; one line, naming the option ({0}: KVOptions' field)."""


@dataclass(frozen=True)
class StepInfo:
    """The coming step, as a policy's scoring rule needs it."""
    phase: str          # prefill | decode
    n_past: int         # slots in use before it
    n_tokens: int       # tokens it writes
    prompt_left: int    # prompt tokens after this step (0 in decode)
    first_chunk: bool   # the first prefill step of a prompt
    slots: int          # the cache's slots
    watch_memory: bool = False   # memory pressure may evict at any step


@dataclass
class CacheView:
    """What a policy may look at: n slots in use of `slots`."""
    n: int
    positions: np.ndarray            # int64 [L, KVH, n]: RoPE position of each slot
    scores: np.ndarray | None        # f32 [L, KVH, n]: accumulated attention weights, or None


class EvictionPolicy:
    """Base: keep the protected prefix (attention sinks) and let subclasses choose the rest.

    budget(slots)     slots kept by an eviction the policy asks for (prefix + window, at most
                      slots - 1 so the next token fits)
    over_budget(...)  whether the policy itself wants an eviction after a step
    score_from(step)  the first cache slot whose query rows add to the attention scores in the
                      coming step, or None for none (policies without scores never score)
    clears_scores_before(step)  whether the scores are zeroed before it (a new observation window)
    select(view, k)   int [L, KVH, k]: the old slots to keep, ascending
    """
    name = "base"
    uses_scores = False
    clears_scores_after_eviction = False

    def __init__(self, window: int, protected_prefix: int = 0):
        if window < 1:
            raise PolicyError(f"{{0}} must be at least 1, got {window}", "eviction_window")
        if protected_prefix < 0:
            raise PolicyError(f"{{0}} must be 0 or more, got {protected_prefix}", "protected_prefix")
        self.window = window
        self.protected_prefix = protected_prefix

    def budget(self, slots: int) -> int:
        if self.protected_prefix >= slots - 1:
            raise PolicyError(f"{{0}} {self.protected_prefix} leaves no room in a KV cache of {slots} slots; "
                              "use a smaller prefix or recompile with a larger {1}", "protected_prefix", "max_seq_len")
        return min(self.protected_prefix + self.window, slots - 1)

    def min_keep(self) -> int:
        """Fewest slots an eviction may leave: the prefix and the newest token."""
        return self.protected_prefix + 1

    def over_budget(self, n: int, slots: int, after_prefill: bool) -> bool:
        return n > self.budget(slots)

    def score_from(self, step: StepInfo) -> int | None:
        return None

    def clears_scores_before(self, step: StepInfo) -> bool:
        return False

    def select(self, view: CacheView, keep: int) -> np.ndarray:
        raise NotImplementedError

    # -- helpers for subclasses ------------------------------------------------------------------
    def _prefix(self, keep: int) -> int:
        return min(self.protected_prefix, keep)

    @staticmethod
    def _shape(view: CacheView) -> tuple[int, int]:
        return view.positions.shape[0], view.positions.shape[1]


class NoEviction(EvictionPolicy):
    """Never evicts: a full cache stops generation."""
    name = "none"

    def __init__(self, window: int = 1, protected_prefix: int = 0):
        super().__init__(max(window, 1), protected_prefix)

    def over_budget(self, n: int, slots: int, after_prefill: bool) -> bool:
        return False

    def select(self, view: CacheView, keep: int) -> np.ndarray:
        raise PolicyError("{0} none never evicts; choose sliding, snapkv or h2o", "eviction_policy")


class SlidingWindow(EvictionPolicy):
    """StreamingLLM: the first --protected-prefix tokens (attention sinks) and the most recent
    --eviction-window, evicting as soon as the cache holds more than both."""
    name = "sliding"

    def select(self, view: CacheView, keep: int) -> np.ndarray:
        p = self._prefix(keep)
        slots = np.concatenate([np.arange(p), np.arange(view.n - (keep - p), view.n)])
        layers, heads = self._shape(view)
        return np.broadcast_to(slots, (layers, heads, keep)).astype(np.int64)


def pool1d(x: np.ndarray, kernel: int, mode: str) -> np.ndarray:
    """1-D pooling over the last axis, stride 1, padding kernel // 2 on both sides (same length
    for an odd kernel), as torch's max_pool1d (pads -inf) and avg_pool1d (pads 0, divides by the
    kernel: count_include_pad) do, which is how SnapKV smooths its scores."""
    pad, n = kernel // 2, x.shape[-1]
    fill = -np.inf if mode == "max" else 0.0
    padded = np.pad(x.astype(np.float64), [(0, 0)] * (x.ndim - 1) + [(pad, pad)], constant_values=fill)
    # one whole-array operation per kernel tap: a reduction over a strided window view took 21 ms
    # for SmolLM2's 30 x 3 heads x 512 slots, this takes 1
    acc = padded[..., :n].copy()
    op = np.maximum if mode == "max" else np.add
    for j in range(1, kernel):
        op(acc, padded[..., j:j + n], out=acc)
    return acc if mode == "max" else acc / kernel


def _top(values: np.ndarray, lo: int, hi: int, count: int) -> np.ndarray:
    """Per row of values [..., n]: the `count` indices in [lo, hi) with the largest values
    (ties: the earlier slot), ascending."""
    if count <= 0:
        return np.zeros((*values.shape[:-1], 0), np.int64)
    v = np.nan_to_num(values[..., lo:hi], nan=-np.inf)   # a NaN score never wins (nor breaks the count)
    # a partition, not a sort (a stable argsort of SmolLM2's 90 heads x 512 slots took ~10 ms):
    # everything above the count-th largest value, then the earliest of the slots equal to it
    kth = np.partition(v, v.shape[-1] - count, axis=-1)[..., v.shape[-1] - count, None]
    above = v > kth
    ties = v == kth
    need = count - above.sum(axis=-1, keepdims=True)
    mask = above | (ties & (np.cumsum(ties, axis=-1) <= need))
    return (np.nonzero(mask)[-1].reshape(*v.shape[:-1], count) + lo).astype(np.int64)


class SnapKV(EvictionPolicy):
    """SnapKV (Li et al. 2024): the last --snapkv-window queries before an eviction vote for the
    positions they attend to (softmax weights summed over those queries and over the query heads
    of each KV head: the kernels' scores), smoothed by 1-D pooling; each KV head keeps its own
    top positions up to the budget, plus the observation window itself and the protected prefix.

    It compresses the prompt once after prefill (when the prompt is over the budget) and again
    whenever the cache is full. Only the rows that vote are scored: a prompt's last
    --snapkv-window rows, and the rows in the cache's last --snapkv-window slots (the queries just
    before it is full; a prompt longer than the cache is evicted there too). The scores are
    cleared at a prompt's start, after every eviction and when that last window begins. Under
    --memory-threshold-mb, which may evict at any step, every decode row is scored, so such an
    eviction sees the queries since the scores were last cleared."""
    name = "snapkv"
    uses_scores = True
    clears_scores_after_eviction = True

    def __init__(self, window: int, protected_prefix: int = 0, obs_window: int = 32, kernel: int = 7,
                 pooling: str = "avg"):
        super().__init__(window, protected_prefix)
        if obs_window < 1:
            raise PolicyError(f"{{0}} must be at least 1, got {obs_window}", "snapkv_window")
        if kernel < 1 or kernel % 2 == 0:
            raise PolicyError(f"{{0}} must be an odd number >= 1, got {kernel}", "snapkv_kernel")
        if pooling not in POOLINGS:
            raise PolicyError(f"{{0}} {pooling!r}: choose one of {', '.join(POOLINGS)}", "snapkv_pooling")
        self.obs_window, self.kernel, self.pooling = obs_window, kernel, pooling

    def over_budget(self, n: int, slots: int, after_prefill: bool) -> bool:
        return after_prefill and n > self.budget(slots)

    def score_from(self, step: StepInfo) -> int | None:
        if step.phase == "decode":
            return 0 if step.watch_memory else max(0, step.slots - self.obs_window)
        prompt_end = step.n_past + step.n_tokens + step.prompt_left   # slot after the prompt
        return max(0, min(prompt_end, step.slots) - self.obs_window)

    def clears_scores_before(self, step: StepInfo) -> bool:
        if step.phase == "prefill":
            return step.first_chunk
        return step.n_past == step.slots - self.obs_window

    def select(self, view: CacheView, keep: int) -> np.ndarray:
        if view.scores is None:
            raise PolicyError("snapkv needs attention scores and the back end gave none")
        p = self._prefix(keep)
        w = min(self.obs_window, keep - p)              # the observation window is kept whole
        layers, heads = self._shape(view)
        cand_end = view.n - w
        pooled = pool1d(view.scores[..., :cand_end], self.kernel, self.pooling)
        top = _top(pooled, p, cand_end, keep - p - w)
        fixed = lambda idx: np.broadcast_to(idx, (layers, heads, len(idx)))  # noqa: E731
        return np.concatenate([fixed(np.arange(p)), top, fixed(np.arange(cand_end, view.n))], axis=-1)


class H2O(EvictionPolicy):
    """Heavy-Hitter Oracle (Zhang et al. 2023): every query's softmax weights accumulate per
    cached position and KV head (prompt and decode alike); over budget, each KV head keeps the
    protected prefix, the most recent --h2o-recent slots and the positions with the most
    accumulated weight, evicting as soon as the cache holds more than the budget."""
    name = "h2o"
    uses_scores = True

    def __init__(self, window: int, protected_prefix: int = 0, recent: int | None = None):
        super().__init__(window, protected_prefix)
        self.recent = window // 2 if recent is None else recent
        if not 0 <= self.recent <= window:
            raise PolicyError(f"{{0}} must be 0..{{1}} ({window}), got {self.recent}", "h2o_recent", "eviction_window")

    def score_from(self, step: StepInfo) -> int | None:
        return 0

    def select(self, view: CacheView, keep: int) -> np.ndarray:
        if view.scores is None:
            raise PolicyError("h2o needs attention scores and the back end gave none")
        p = self._prefix(keep)
        r = min(self.recent, keep - p)
        layers, heads = self._shape(view)
        cand_end = view.n - r
        heavy = _top(view.scores, p, cand_end, keep - p - r)
        fixed = lambda idx: np.broadcast_to(idx, (layers, heads, len(idx)))  # noqa: E731
        return np.concatenate([fixed(np.arange(p)), heavy, fixed(np.arange(cand_end, view.n))], axis=-1)


def make_policy(name: str, window: int, protected_prefix: int = 0, snapkv_window: int = 32,
                snapkv_kernel: int = 7, snapkv_pooling: str = "avg", h2o_recent: int | None = None) -> EvictionPolicy:
    if name == "none":
        return NoEviction(window, protected_prefix)
    if name == "sliding":
        return SlidingWindow(window, protected_prefix)
    if name == "snapkv":
        return SnapKV(window, protected_prefix, snapkv_window, snapkv_kernel, snapkv_pooling)
    if name == "h2o":
        return H2O(window, protected_prefix, h2o_recent)
    raise PolicyError(f"{{0}} {name!r}: choose one of {', '.join(POLICIES)}", "eviction_policy")
