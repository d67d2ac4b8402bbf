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
from typing import Any, Collection, Mapping, TypeVar

from .compiler.cliutil import OneLineParser, Progress, check_output_file
from .options import OptionError

T = TypeVar("T")


def flag_of(name: str) -> str:
    """eviction_window -> --eviction-window"""
    return "--" + name.replace("_", "-")


def add_option_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, options_class: type,
                     names: Collection[str] | None = None, title: str | None = None) -> Any:
    """One flag per field of `options_class` (those in `names`, if given), in a group `title` if
    given. Returns where the flags went (the group, or parser)."""
    where = parser.add_argument_group(title) if title else parser
    for f in dataclasses.fields(options_class):
        if names is not None and f.name not in names:
            continue
        meta, default = f.metadata, f.default
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta.get("help")}
        if isinstance(default, bool):
            kwargs["action"] = "store_false" if default else "store_true"
        else:
            kwargs["type"] = meta.get("type") or type(default)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        where.add_argument(flag_of(f.name), **kwargs)
    return where


def options_from(args: argparse.Namespace, options_class: type[T], **overrides: Any) -> T:
    """`options_class` from the parsed flags of its fields (a field without a flag keeps its default)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(options_class) if hasattr(args, f.name)}
    return options_class(**{**values, **overrides})


def error_line(error: BaseException, flags: Mapping[str, str] | None = None) -> str:
    """The error's message for a command line: an OptionError names its options by their flags
    (`flags` where a flag is not the Python name with dashes)."""
    if isinstance(error, OptionError):
        return error.worded(lambda name: (flags or {}).get(name) or flag_of(name))
    return str(error)


__all__ = ["OneLineParser", "Progress", "add_option_flags", "check_output_file", "error_line", "flag_of",
           "options_from"]
