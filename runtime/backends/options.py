"""How to open a back end: BackendOptions, the typed options open_backend (runtime/backends/
__init__.py) takes. llmrs-run's flags, Model.load's keywords and the benchmarks translate into
these and nothing else. A bad value is a BackendOptionError (an llmrs.options.OptionError): one
line naming the option by its Python name (`str()`), or by a command line's flag (`worded`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from ...options import OptionError, option, whole

BACKENDS = ("cpu", "opencl", "reference", "hybrid", "auto")
SIDES = ("cpu", "opencl")                 # hybrid_start
KV_MODES = ("auto", "copy", "map")        # hybrid_kv
MAX_THREADS = 1024   # more than any CPU runs at once; more only makes every barrier wait longer
# the back end an option is for (where it differs from its default); the others take every kind
_ONLY_FOR = {"hybrid_start": "hybrid", "switch_threshold": "hybrid", "switch_back_at": "hybrid",
             "hybrid_kv": "hybrid", "recalibrate": "auto"}
KIND_OPTIONS = tuple(_ONLY_FOR)     # the options only one kind takes: a group of their own on a command line


class BackendOptionError(OptionError):
    """A bad back-end option. `text` holds {0}, {1}... where the options' names go."""


@dataclass(frozen=True)
class BackendOptions:
    """How to open a back end; each field is llmrs-run's flag of the same name (--switch-threshold)."""
    threads: int | None = option(None, "CPU threads (default: physical cores)", type=int)
    device: int | str | None = option(None, "OpenCL device index or name (or LLMRS_OPENCL_DEVICE)", type=str)
    hybrid_start: str = option("cpu", "the back end that runs first (default cpu)", choices=SIDES)
    switch_threshold: int | None = option(
        None, "switch to the other back end at position N (inside a prompt: its prefill is cut there); "
              "default: at the prompt's end, prefill on --hybrid-start, decode on the other", metavar="N", type=int)
    switch_back_at: int | None = option(None, "switch back to --hybrid-start at position N (default: never)",
                                        metavar="N", type=int)
    hybrid_kv: str = option("auto", "how a switch hands the KV cache over: map (shared memory, nothing copied), "
                                    "copy (the live slots only), auto (map where the device shares host memory; "
                                    "default)", choices=KV_MODES)
    recalibrate: bool = option(False, "--backend auto: measure again instead of using the cached figures")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> "BackendOptions":
        """Raises BackendOptionError naming the first bad option."""
        if self.threads is not None and not (whole(self.threads) and 1 <= self.threads <= MAX_THREADS):
            raise BackendOptionError(f"{{0}} {self.threads!r}: need 1 to {MAX_THREADS} "
                                     f"(this machine has {os.cpu_count()} CPUs)", "threads")
        if self.device is not None and not ((whole(self.device) and self.device >= 0) or isinstance(self.device, str)):
            raise BackendOptionError(f"{{0}} {self.device!r}: give a device index (0 or more) or a name", "device")
        if self.hybrid_start not in SIDES:
            raise BackendOptionError(f"{{0}} {self.hybrid_start!r}: choose cpu or opencl", "hybrid_start")
        if self.switch_threshold is not None and not (whole(self.switch_threshold) and self.switch_threshold >= 0):
            raise BackendOptionError(f"{{0}} must be 0 or more, got {self.switch_threshold!r}", "switch_threshold")
        if self.switch_back_at is not None:
            if not (whole(self.switch_back_at) and self.switch_back_at >= 1):
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


__all__ = ["BACKENDS", "KIND_OPTIONS", "KV_MODES", "MAX_THREADS", "SIDES", "BackendOptionError", "BackendOptions"]
