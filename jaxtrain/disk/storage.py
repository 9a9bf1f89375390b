"""What the filesystem under a run dir can hold, and what it said when it refused a write.

Orbax writes through tensorstore, whose errors are ValueErrors carrying the OS error code in
their text (`[os_error_code='28']`); Python's own writes raise OSError. Both are read here.
"""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

from jaxtrain.disk.files import existing_ancestor

# The failures of storage, not of the program: each ends a save with its own exit code.
REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EIO: "I/O error",
}
_CODE = re.compile(r"os_error_code='(\d+)'")


def failure_reason(e: BaseException) -> str | None:
    """The storage failure behind `e` (or anything in its cause chain), or None if it is not one."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in REASONS:
            return REASONS[seen.errno]
        m = _CODE.search(str(seen))
        if m and int(m[1]) in REASONS:
            return REASONS[int(m[1])]
        seen = seen.__cause__ or seen.__context__
    return None


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would hold it, once created)."""
    return shutil.disk_usage(existing_ancestor(path)).free


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"
