"""Command-line helpers shared by the tools: one-line argument errors, output paths checked
before any work, a progress bar."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments get one line on stderr and exit code 2, not a usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def check_output_file(path: Path, flag: str) -> None:
    """Refuse an output file that cannot be written before any work is done, in one line naming
    the flag and the folder (a failed write would name a temporary file the user never asked
    for). The folder is probed by creating a file in it: permission bits do not stop root, and a
    read-only mount or a pseudo-filesystem does."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give the name of a file to write in it")
    folder = path.parent
    if not folder.exists():
        raise ValueError(f"{flag} {path}: folder {folder} does not exist; create it (mkdir -p {folder}) "
                         "or choose another")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in folder {folder} ({e.strerror}); "
                         "choose a writable folder") from None
    os.close(fd)
    os.unlink(probe)


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
