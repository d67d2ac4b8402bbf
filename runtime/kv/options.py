"""KVOptions: how the KV cache is managed (eviction policy, its knobs, memory pressure), the
seed's names; Model.load's keywords, llmrs-run's and llmrs-serve's flags. cache_manager() makes
the CacheManager they ask for on a back end."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ...options import OptionError, OptionTypeError, option, real, whole
from .manager import CacheManager, EvictionEvent, LinuxSystemMonitor, check_pressure
from .policy import POLICIES, POOLINGS, EvictionPolicy, make_policy

if TYPE_CHECKING:
    from ..backends.base import Backend

TITLE = "KV-cache eviction (a full cache stops generation unless a policy evicts)"


@dataclass(frozen=True)
class KVOptions:
    """How the KV cache makes room; each field is llmrs-run's flag of the same name (--eviction-window)."""
    eviction_policy: str = option("none", "none (default), sliding (StreamingLLM), snapkv, h2o", choices=POLICIES)
    eviction_window: int = option(512, "slots kept after the protected prefix: the sliding window, or snapkv's / "
                                       "h2o's budget (default 512; at most the cache less the prefix and one slot)",
                                  metavar="N")
    protected_prefix: int = option(0, "first N tokens never evicted: attention sinks (default 0)", metavar="N")
    memory_threshold_mb: float | None = option(None, "evict when MemAvailable falls under MB (default: never)",
                                               metavar="MB", type=float)
    eviction_target_ratio: float = option(0.5, "under memory pressure keep R of the slots in use (default 0.5)",
                                          metavar="R")
    snapkv_window: int = option(32, "snapkv: queries that vote, kept themselves (default 32)", metavar="N")
    snapkv_kernel: int = option(7, "snapkv: odd 1-D pooling width over positions (default 7)", metavar="K")
    snapkv_pooling: str = option("avg", "snapkv: pooling (default avg)", choices=POOLINGS)
    h2o_recent: int | None = option(None, "h2o: recent slots always kept (default half the window; the rest are "
                                          "heavy hitters)", metavar="N", type=int)
    log_evictions: bool = option(False, "one line on stderr per eviction")

    @property
    def evicts(self) -> bool:
        return self.eviction_policy != "none"

    def check(self) -> "KVOptions":
        """Raises OptionError (OptionTypeError for a wrong type) naming the first bad option."""
        for name, ok, what in _TYPES:
            value = getattr(self, name)
            if not ok(value):
                raise OptionTypeError(f"{{0}} must be {what}, got {value!r}", name)
        self.policy()
        check_pressure(self.memory_threshold_mb, self.eviction_target_ratio, self.evicts)
        return self

    def policy(self) -> EvictionPolicy:
        return make_policy(self.eviction_policy, self.eviction_window, self.protected_prefix, self.snapkv_window,
                           self.snapkv_kernel, self.snapkv_pooling, self.h2o_recent)


# (option, test of its type, what it must be): a value of the wrong type fails here, by its name,
# not later as a comparison deep in a policy
_TYPES = (("eviction_policy", lambda v: isinstance(v, str), f"one of {', '.join(POLICIES)}"),
          ("eviction_window", whole, "a whole number >= 1"), ("protected_prefix", whole, "a whole number >= 0"),
          ("memory_threshold_mb", lambda v: v is None or real(v), "a number of MB or None"),
          ("eviction_target_ratio", real, "a number between 0 and 1"),
          ("snapkv_window", whole, "a whole number >= 1"), ("snapkv_kernel", whole, "an odd whole number >= 1"),
          ("snapkv_pooling", lambda v: isinstance(v, str), f"one of {', '.join(POOLINGS)}"),
          ("h2o_recent", lambda v: v is None or whole(v), "a whole number >= 0 or None"),
          ("log_evictions", lambda v: isinstance(v, bool), "True or False"))


def check_threshold(threshold_mb: float, total_bytes: int) -> None:
    """MemAvailable never reaches the machine's memory: a threshold at or above it would evict on
    every step, down to a cache too short to say anything."""
    total_mb = total_bytes >> 20
    if threshold_mb >= total_mb:
        raise OptionError(f"{{0}} {threshold_mb:.10g} is not under this machine's memory ({total_mb} MB): "
                          f"every step would evict; give less, e.g. {total_mb // 8}", "memory_threshold_mb")


def _log(event: EvictionEvent) -> None:
    print(event.line(), file=sys.stderr)


def cache_manager(options: KVOptions, backend: Backend,
                  on_event: Callable[[EvictionEvent], None] | None = None) -> CacheManager | None:
    """The manager `options` ask for on `backend`'s caches, or None when nothing evicts (no scores,
    no bookkeeping). on_event sees each eviction (default with log_evictions: a line on stderr)."""
    options.check()
    if not options.evicts:
        return None
    monitor = LinuxSystemMonitor() if options.memory_threshold_mb is not None else None
    if monitor is not None:
        check_threshold(options.memory_threshold_mb, monitor.mem_stats().total)
    log = on_event or (_log if options.log_evictions else None)
    return CacheManager(options.policy(), backend.kv_store(), monitor, options.memory_threshold_mb,
                        options.eviction_target_ratio, log)


__all__ = ["KVOptions", "TITLE", "cache_manager", "check_threshold"]
