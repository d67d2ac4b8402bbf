"""KV-cache eviction: policies, the CacheManager that runs them, and the back ends' caches.

Positions. `start_pos` (the RoPE position of the next token) only grows; `n_past` (cache slots
in use) shrinks when the cache is evicted. Keys keep the rotation of the position they were
written at and are never re-rotated, so an evicted cache is exactly "the same model attending
over a subset of its past": the next query, rotated at start_pos, sees each surviving key at
its true relative distance.

Layout and per-head eviction. Each layer's K and V caches are [max_seq_len, n_kv_heads,
head_dim] (f32, f16, or q8_0 / q4_0 whose head rows are whole 34 / 18-byte blocks). SnapKV and H2O choose
different positions for different KV heads (and layers), but every KV head of every layer keeps
the SAME number of slots, the budget: one n_past still describes every head, so the attention
kernels need no per-head length and are unchanged. Compaction gathers, per layer and KV head,
the surviving rows to the front in ascending slot order (rows only move down, and after it all
survivors precede the slots written next, so the causal mask of a later prefill chunk stays
right). It moves the attention scores with them.

Scores. Every attention op of a plan also takes `cache.scores.<layer>` f32 [n_kv_heads,
max_seq_len] and the shared `cache.score_ctl` i32[2] (compiler/ir.py): when the control is on,
each query row at a cache slot >= score_ctl[1] adds its softmax weights, summed over the query
heads of each KV head, to the scores (SnapKV's vote, H2O's accumulated mass). The manager turns
it on only for the rows a policy wants; off, the reference back end skips the sum, the CPU
kernel skips the loop, and the OpenCL back end leaves the scoring launch out of the step.

Triggers (CacheManager): the policy's budget (sliding and h2o as soon as the cache holds more
than it; snapkv once after the prompt), a cache too full for the next step (any policy but
`none`, which stops generation instead), and memory pressure (MemAvailable under
memory_threshold_mb: down to eviction_target_ratio of the slots in use).

Batches. Each sequence of a paged batch is evicted on its own by the same policies and triggers
(perseq.py SeqEviction, through runtime/scheduler.py): compaction inside its own blocks. The
step graph's attention adds the scores at each entry's pool slot, for the rows whose KV index is
at or past their own score_from (the per-row form of score_ctl; compiler/ir.py "Step graphs");
in a step with no such row the OpenCL back end leaves the scoring launch out.

Options. KVOptions (options.py) names all of it, by the seed's names, for every interface:
Model.load's keywords, llmrs-run's and llmrs-serve's flags; cache_manager(KVOptions, backend)
makes the manager.
"""
from .manager import (CacheManager, EvictionEvent, LinuxSystemMonitor, MemoryStats, SystemMonitor,
                      summarize)
from .options import KVOptions, cache_manager
from .policy import (H2O, POLICIES, CacheView, EvictionPolicy, NoEviction, PolicyError, SlidingWindow,
                     SnapKV, StepInfo, make_policy, pool1d)
from .store import HostKV, KVStoreError, layer_states

__all__ = ["KVOptions", "cache_manager", "CacheManager", "EvictionEvent", "LinuxSystemMonitor", "MemoryStats",
           "SystemMonitor", "summarize",
           "H2O", "POLICIES", "CacheView", "EvictionPolicy", "NoEviction", "PolicyError", "SlidingWindow",
           "SnapKV", "StepInfo", "make_policy", "pool1d", "HostKV", "KVStoreError", "layer_states"]
