"""Output files that never replace what they should not: a device node, a pipe, a socket, or a
file the command reads (its model, a weight shard, its tokenizer), by any name (symlinks, hard
links); checked before any work, and written to a temporary file beside the target that is renamed
over it only once whole. Every writer uses these: the plan writer, --dump-ir, --dump-logits,
--profile, llmrs-bench --json, plots."""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterable, Iterator


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def replace_refusal(path: Path, flag: str, reads: Iterable[str | os.PathLike] = ()) -> str | None:
    """Why an existing `path` must not be replaced by a new file, or None: a device, pipe or
    socket (renaming over /dev/null would turn it into a file), or a file this command reads
    (the model being compiled, the plan being run), by any name: hard links and symlinks count."""
    try:
        st = os.stat(path)      # follows a symlink: what would be lost is its target
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return f"{flag} {path} is a folder; give the name of a file to write in it"
    if not stat.S_ISREG(st.st_mode):
        return f"{flag} {path} is {_kind(st.st_mode)}, not a file; give the name of a file to write"
    for src in reads:
        try:
            other = os.stat(src)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return (f"{flag} {path} is an input of this command ({src}); writing there would destroy it: "
                    "give another file name")
    return None


def check_output_file(path: Path, flag: str, reads: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse an output file that cannot or must not be written before any work is done, in one
    line naming the flag: a folder, a device / pipe / socket, a file the command reads (`reads`),
    a missing or unwritable folder (a failed write would name a temporary file the user never
    asked for). The folder is probed by creating a file in it: permission bits do not stop root,
    and a read-only mount or a pseudo-filesystem does."""
    why = replace_refusal(Path(path), flag, reads)
    if why:
        raise ValueError(why)
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path   # a link's target is written
    folder = target.parent
    if not folder.exists():
        raise ValueError(f"{flag} {path}: folder {folder} does not exist; create it (mkdir -p {folder}) "
                         "or choose another")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=folder)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in folder {folder} ({e.strerror}); "
                         "choose a writable folder") from None
    os.close(fd)
    os.unlink(probe)


def check_output_dir(path: Path, flag: str) -> None:
    """A folder to write files into: an existing folder or a new name, never a file or device."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a folder; give a folder (it is created if new)")


@contextlib.contextmanager
def output_file(path: str | os.PathLike, flag: str, reads: Iterable[str | os.PathLike] = (),
                mode: str = "wb") -> Iterator[IO]:
    """A file object whose bytes land at `path` only once the block completes: written to a
    temporary file beside the target (a symlink's target: the link stays) and renamed over it,
    so a failure or an interrupt leaves what was there. The refusals of check_output_file are
    made again just before the rename, so a device that appeared meanwhile is not replaced."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        why = replace_refusal(path, flag, reads)
        if why:
            raise ValueError(why)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_output(path: str | os.PathLike, data: str | bytes, flag: str,
                 reads: Iterable[str | os.PathLike] = ()) -> None:
    """output_file for a whole str (UTF-8) or bytes."""
    with output_file(path, flag, reads) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
