"""llmrs-run's eviction flags (the seed's names) and the CacheManager they make."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .manager import CacheManager, LinuxSystemMonitor
from .policy import POLICIES, POOLINGS, make_policy

if TYPE_CHECKING:
    from ..backends.base import Backend


def add_eviction_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("KV-cache eviction (a full cache stops generation unless a policy evicts)")
    g.add_argument("--eviction-policy", choices=POLICIES, default="none",
                   help="none (default), sliding (StreamingLLM), snapkv, h2o")
    g.add_argument("--eviction-window", type=int, default=512, metavar="N",
                   help="slots kept after the protected prefix: the sliding window, or snapkv's / h2o's "
                        "budget (default 512; at most the cache less the prefix and one slot)")
    g.add_argument("--protected-prefix", type=int, default=0, metavar="N",
                   help="first N tokens never evicted: attention sinks (default 0)")
    g.add_argument("--memory-threshold-mb", type=float, default=None, metavar="MB",
                   help="evict when MemAvailable falls under MB (default: never)")
    g.add_argument("--eviction-target-ratio", type=float, default=0.5, metavar="R",
                   help="under memory pressure keep R of the slots in use (default 0.5)")
    g.add_argument("--snapkv-window", type=int, default=32, metavar="N",
                   help="snapkv: queries that vote, kept themselves (default 32)")
    g.add_argument("--snapkv-kernel", type=int, default=7, metavar="K",
                   help="snapkv: odd 1-D pooling width over positions (default 7)")
    g.add_argument("--snapkv-pooling", choices=POOLINGS, default="avg", help="snapkv: pooling (default avg)")
    g.add_argument("--h2o-recent", type=int, default=None, metavar="N",
                   help="h2o: recent slots always kept (default half the window; the rest are heavy hitters)")
    g.add_argument("--log-evictions", action="store_true", help="one line on stderr per eviction")


def check_threshold(threshold_mb: float, total_bytes: int) -> None:
    """MemAvailable never reaches the machine's memory: a threshold at or above it would evict on
    every step, down to a cache too short to say anything."""
    total_mb = total_bytes >> 20
    if threshold_mb >= total_mb:
        raise ValueError(f"--memory-threshold-mb {threshold_mb:.10g} is not under this machine's memory "
                         f"({total_mb} MB): every step would evict; give less, e.g. {total_mb // 8}")


def cache_manager(args: argparse.Namespace, backend: Backend) -> CacheManager | None:
    """The manager the flags ask for, or None when nothing evicts (no scores, no bookkeeping)."""
    if args.eviction_policy == "none":
        if args.memory_threshold_mb is not None:
            raise ValueError("--memory-threshold-mb needs an --eviction-policy that evicts (sliding, snapkv or h2o)")
        return None
    policy = make_policy(args.eviction_policy, args.eviction_window, args.protected_prefix, args.snapkv_window,
                         args.snapkv_kernel, args.snapkv_pooling, args.h2o_recent)
    log = (lambda e: print(e.line(), file=sys.stderr)) if args.log_evictions else None
    monitor = LinuxSystemMonitor() if args.memory_threshold_mb is not None else None
    if monitor is not None:
        check_threshold(args.memory_threshold_mb, monitor.mem_stats().total)
    return CacheManager(policy, backend.kv_store(), monitor, args.memory_threshold_mb, args.eviction_target_ratio, log)
