"""Files that appear whole or not at all, lines appended whole, and directories checked before
anything is written."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from jaxtrain.errors import UserError


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """A file that appears at `path` whole on success and never half-written (temp + rename), 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own per writer (not mkstemp, whose files are private to the user: 0600), so
    # processes sharing a filesystem never write into each other's temp file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class LineFile:
    """A file appended to a whole line at a time: one O_APPEND write() per line, and a write the
    filesystem cuts short (disk full) is undone, so a reader never sees half a record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.chmod(path, 0o644)

    def write_line(self, text: str) -> None:
        data = (text + "\n").encode("utf-8")
        end = os.fstat(self.fd).st_size
        if os.write(self.fd, data) < len(data):
            os.ftruncate(self.fd, end)
            raise OSError(errno.ENOSPC, "a line was cut short (no space left)", str(self.path))

    def close(self) -> None:
        os.close(self.fd)


def write_text(path: Path, text: str) -> None:
    """atomic_write of a text file."""
    with atomic_write(path) as f:
        f.write(text.encode("utf-8"))


def existing_ancestor(path: Path) -> Path:
    """`path` if it exists, else its nearest parent that does."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def require_writable(path: Path, what: str) -> None:
    """`path` is a directory this process can write, or can be created as one; `what` names it."""
    existing = existing_ancestor(path)
    if not existing.is_dir():
        raise UserError(f"{what} {path} cannot be made: {existing} is a file; pass another one")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path} cannot be written: {existing} is read-only; pass another one")


def cache_root() -> Path:
    """$XDG_CACHE_HOME/jaxtrain, else ~/.cache/jaxtrain: token scans, the default dataset, compiles."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxtrain"
