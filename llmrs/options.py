"""The vocabulary every interface shares: typed options and the error a bad one raises.

An options class is a frozen dataclass whose fields are declared with `option()`: a default, plus
what a command line needs to offer it as a flag (help, metavar, choices, type). The Python API
takes the fields by name; each command line declares one flag per field from the same
declaration (llmrs/cliutil.py), so a flag and its Python name cannot drift apart.

A bad value is an OptionError whose message leaves {0}, {1}... where the options' names go:
str() fills in the Python names (`top_p must be in (0, 1], got 2`), `worded(flag)` a command
line's flags (`--top-p must be in (0, 1], got 2`).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Sequence


class OptionError(ValueError):
    """A bad option. `text` holds {0}, {1}... where the options' names go (no names: the text
    is taken as it is, braces and all)."""

    def __init__(self, text: str, *names: str):
        self.text, self.names = text, names
        super().__init__(self.worded(lambda name: name))

    def worded(self, name: Callable[[str], str]) -> str:
        """The message with each option named by name(python_name)."""
        return self.text.format(*map(name, self.names)) if self.names else self.text


class OptionTypeError(OptionError, TypeError):
    """An option of the wrong type (`temperature='hot'`); a TypeError for Python callers."""


def option(default: Any = None, help: str = "", *, metavar: str | None = None,
           choices: Sequence[str] | None = None, type: Callable[[str], Any] | None = None,
           repeat: bool = False, aliases: Sequence[str] = ()) -> Any:
    """A dataclass field of an options class, with what its command-line flag shows. `type`
    parses the flag's text (default: the type of `default`; a bool default makes a switch);
    `repeat`: a tuple field whose flag is given once per item (`--no-fuse A --no-fuse B`);
    `aliases`: other spellings of the flag (the seeds' names)."""
    meta = {"help": help, "metavar": metavar, "choices": tuple(choices) if choices else None, "type": type,
            "repeat": repeat, "aliases": tuple(aliases)}
    return dataclasses.field(default=default, metadata=meta)


def option_names(options_class: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(options_class))


def whole(value: Any) -> bool:
    """An int that is not a bool (True is 1 to Python, never a count to a user)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


__all__ = ["OptionError", "OptionTypeError", "option", "option_names", "real", "whole"]
