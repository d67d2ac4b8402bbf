"""The one CLI helper: what every command line shares, and the table that maps its flags to the
library's typed options (llmrs/options.py). Besides the console scripts, this is the only module
that imports argparse.

A flag is its option's Python name with dashes (`eviction_window` -> `--eviction-window`), declared
from the option's own field (default, help, metavar, choices, type), read back into the options
class by the same name, and an OptionError is worded with the same flags: a flag and its Python
name cannot drift apart. A command line whose flag differs (llmrs-run's `-n` for max_tokens) says
so in the `flags` it gives error_line.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, Collection, Mapping, TypeVar

from .options import OptionError

T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments get one line on stderr and exit code 2, not a usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class Progress:
    """One line on stderr, redrawn at most 10 times a second; off when stderr is no terminal."""

    def __init__(self, label: str, total: int, enabled: bool | None = None, width: int = 28):
        self.label, self.total, self.width = label, max(total, 1), width
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, done: int, note: str = "") -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self._last < 0.1 and done < self.total):
            return
        self._last = now
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.label:<10} [{bar}] {done}/{self.total} {now - self.t0:5.1f} s {note[:40]:<40}")
        sys.stderr.flush()

    def close(self) -> float:
        elapsed = time.perf_counter() - self.t0
        if self.enabled:
            self.update(self.total)
            sys.stderr.write("\n")
        return elapsed


def flag_of(name: str) -> str:
    """eviction_window -> --eviction-window"""
    return "--" + name.replace("_", "-")


def add_option_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, options_class: type,
                     names: Collection[str] | None = None, title: str | None = None) -> Any:
    """One flag per field of `options_class` (those in `names`, if given), in a group `title` if
    given. Returns where the flags went (the group, or parser)."""
    where = parser.add_argument_group(title) if title else parser
    for f in dataclasses.fields(options_class):
        if (names is not None and f.name not in names) or "help" not in f.metadata:
            continue   # a field not declared with option() (a callback) has no flag
        meta, default = f.metadata, f.default
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta.get("help")}
        if isinstance(default, bool):
            kwargs["action"] = "store_false" if default else "store_true"
        elif meta.get("repeat"):
            kwargs.update(action="append", default=None, type=meta.get("type") or str)
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        else:
            kwargs["type"] = meta.get("type") or type(default)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        where.add_argument(flag_of(f.name), *meta.get("aliases", ()), **kwargs)
    return where


def options_from(args: argparse.Namespace, options_class: type[T], **overrides: Any) -> T:
    """`options_class` from the parsed flags of its fields (a field without a flag keeps its default)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(options_class) if hasattr(args, f.name)}
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()
              if v is not None or not _repeats(options_class, name)}   # a repeatable flag never given: the default
    return options_class(**{**values, **overrides})


def _repeats(options_class: type, name: str) -> bool:
    return any(f.name == name and f.metadata.get("repeat") for f in dataclasses.fields(options_class))


def error_line(error: BaseException, flags: Mapping[str, str] | None = None) -> str:
    """The error's message for a command line: an OptionError names its options by their flags
    (`flags` where a flag is not the Python name with dashes)."""
    if isinstance(error, OptionError):
        return error.worded(lambda name: (flags or {}).get(name) or flag_of(name))
    return str(error)


__all__ = ["OneLineParser", "Progress", "add_option_flags", "error_line", "flag_of",
           "options_from"]
