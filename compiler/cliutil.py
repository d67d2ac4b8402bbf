"""Command-line helpers shared by the tools: one-line argument errors, a progress bar."""
from __future__ import annotations

import argparse
import sys
import time


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
