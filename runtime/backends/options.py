"""How to open a back end: BackendOptions, the typed options open_backend (runtime/backends/
__init__.py) takes. llmrs-run's flags, Model.load's keywords and the benchmarks translate into
these and nothing else. A bad value is a BackendOptionError: one line naming the option by its
Python name (`str()`), or by any other name a caller gives it (`worded`: a command line's flag).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable

BACKENDS = ("cpu", "opencl", "reference", "hybrid", "auto")
SIDES = ("cpu", "opencl")                 # hybrid_start
KV_MODES = ("auto", "copy", "map")        # hybrid_kv
MAX_THREADS = 1024   # more than any CPU runs at once; more only makes every barrier wait longer
# the back end an option is for (where it differs from its default); the others take every kind
_ONLY_FOR = {"hybrid_start": "hybrid", "switch_threshold": "hybrid", "switch_back_at": "hybrid",
             "hybrid_kv": "hybrid", "recalibrate": "auto"}


class BackendOptionError(ValueError):
    """A bad back-end option. `text` holds {0}, {1}... where the options' names go."""

    def __init__(self, text: str, *names: str):
        self.text, self.names = text, names
        super().__init__(self.worded(lambda name: name))

    def worded(self, name: Callable[[str], str]) -> str:
        """The message with each option named by name(python_name)."""
        return self.text.format(*map(name, self.names))


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BackendOptions:
    """How to open a back end; each field is llmrs-run's flag of the same name (--switch-threshold)."""
    threads: int | None = None            # CPU threads (None: the physical cores)
    device: int | str | None = None       # OpenCL device index or name substring (None: $LLMRS_OPENCL_DEVICE, else the first GPU)
    hybrid_start: str = "cpu"             # hybrid: the side that runs first
    switch_threshold: int | None = None   # hybrid: the other side from this position (None: prefill, then decode)
    switch_back_at: int | None = None     # hybrid: hybrid_start again from this position
    hybrid_kv: str = "auto"               # hybrid: how a switch hands the KV cache over (auto | copy | map)
    recalibrate: bool = False             # auto: measure again instead of using the cached figures

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> "BackendOptions":
        """Raises BackendOptionError naming the first bad option."""
        if self.threads is not None and not (_whole(self.threads) and 1 <= self.threads <= MAX_THREADS):
            raise BackendOptionError(f"{{0}} {self.threads!r}: need 1 to {MAX_THREADS} "
                                     f"(this machine has {os.cpu_count()} CPUs)", "threads")
        if self.device is not None and not ((_whole(self.device) and self.device >= 0) or isinstance(self.device, str)):
            raise BackendOptionError(f"{{0}} {self.device!r}: give a device index (0 or more) or a name", "device")
        if self.hybrid_start not in SIDES:
            raise BackendOptionError(f"{{0}} {self.hybrid_start!r}: choose cpu or opencl", "hybrid_start")
        if self.switch_threshold is not None and not (_whole(self.switch_threshold) and self.switch_threshold >= 0):
            raise BackendOptionError(f"{{0}} must be 0 or more, got {self.switch_threshold!r}", "switch_threshold")
        if self.switch_back_at is not None:
            if not (_whole(self.switch_back_at) and self.switch_back_at >= 1):
                raise BackendOptionError(f"{{0}} must be at least 1, got {self.switch_back_at!r}", "switch_back_at")
            if self.switch_threshold is not None and self.switch_back_at <= self.switch_threshold:
                raise BackendOptionError(f"{{0}} {self.switch_back_at} must come after {{1}} {self.switch_threshold}",
                                         "switch_back_at", "switch_threshold")
        if self.hybrid_kv not in KV_MODES:
            raise BackendOptionError(f"{{0}} {self.hybrid_kv!r}: choose one of {', '.join(KV_MODES)}", "hybrid_kv")
        if not isinstance(self.recalibrate, bool):
            raise BackendOptionError(f"{{0}} must be True or False, got {self.recalibrate!r}", "recalibrate")
        return self

    def check_for(self, kind: str) -> "BackendOptions":
        """The options a back end of `kind` does not take must keep their defaults."""
        if kind not in BACKENDS:
            raise BackendOptionError(f"{{0}} {kind!r}: choose one of {', '.join(BACKENDS)}", "backend")
        defaults = {f.name: f.default for f in fields(self)}
        for name, value in vars(self).items():
            wants = _ONLY_FOR.get(name, kind)
            if kind != wants and value != defaults[name]:
                raise BackendOptionError(f"{{0}} goes with {{1}} {wants}", name, "backend")
        return self


__all__ = ["BACKENDS", "KV_MODES", "MAX_THREADS", "SIDES", "BackendOptionError", "BackendOptions"]
