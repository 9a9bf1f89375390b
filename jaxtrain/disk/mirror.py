"""A run dir in a bucket: its records kept in a local folder and copied up, buffered.

A bucket has no append and no rename, and train.log, metrics.jsonl, wandb's and the profiler's
files are appended to as they go. So with `--run_dir gs://b/run` (or s3://) each process writes
them into a local folder of its own (`Config.resolved_run_dir`), and a Mirror copies what changed
up to the bucket every `every_s` seconds and when the run ends, however it ends short of a kill:
process 0 everything but the other processes' files, process i its logs/process_<i>.log and
profile/process_<i>/. Each file goes up whole, as one object. At start every process fills its
folder from the bucket (the saved config, metrics.jsonl, data.json, wandb_id, its log), so a
relaunch continues them as on a disk.

What a crash loses: a kill -9 (or a host lost) loses the lines written since the last copy, at
most `every_s` seconds of them; checkpoints and the run lock go to the bucket directly
(jaxtrain/disk/checkpoint.py, runlock.py) and lose nothing committed.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from jaxtrain.disk import bucket
from jaxtrain.errors import UserError

log = logging.getLogger("jaxtrain")

EVERY_S = 10.0
# In the bucket directly, never mirrored: checkpoints (orbax), the lock (runlock), probes.
DIRECT = ("checkpoints/", "damaged_checkpoints/", "job.lock", ".jaxtrain-probe-")


def _mine(rel: str, process_index: int) -> bool:
    """Whether process `process_index` copies the file `rel` (a path in the run dir) up."""
    if rel.startswith(DIRECT):
        return False
    if rel.startswith("logs/process_"):
        return rel == f"logs/process_{process_index}.log"
    if rel.startswith("profile/process_"):
        return rel.startswith(f"profile/process_{process_index}/")
    return process_index == 0


class Mirror:
    """The local folder `local` of the run dir at the URL `url`, for process `process_index`."""

    def __init__(self, url: str, local: Path, process_index: int, every_s: float = EVERY_S) -> None:
        self.url, self.local, self.every_s = url.rstrip("/"), local, every_s
        self.process_index = process_index
        self.sent: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns) copied up
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def pull(self) -> None:
        """Fill the local folder afresh from the bucket (its old contents, if any, discarded)."""
        if self.local.exists():
            shutil.rmtree(self.local)
        self.local.mkdir(parents=True)
        for rel, _ in bucket.listing(self.url).items():
            others = rel.startswith(("logs/", "profile/")) and not _mine(rel, self.process_index)
            if rel.startswith(DIRECT) or others:
                continue
            data = bucket.read(f"{self.url}/{rel}")
            if data is None:
                continue  # removed meanwhile
            target = self.local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            if _mine(rel, self.process_index):
                st = target.stat()
                self.sent[rel] = (st.st_size, st.st_mtime_ns)

    def push(self) -> None:
        """Copy up every file of this process's that changed since it was last copied."""
        with self.lock:
            for p in sorted(self.local.rglob("*")):
                rel = p.relative_to(self.local).as_posix()
                if not p.is_file() or not _mine(rel, self.process_index) or p.name.startswith("."):
                    continue
                st = p.stat()
                if self.sent.get(rel) == (st.st_size, st.st_mtime_ns):
                    continue
                bucket.write(f"{self.url}/{rel}", p.read_bytes())
                self.sent[rel] = (st.st_size, st.st_mtime_ns)

    def remove(self, rel: str) -> None:
        """Remove `rel` (a file or a folder of the run dir) from the bucket (--overwrite)."""
        target = f"{self.url}/{rel}"
        bucket.rmtree(target)
        bucket.delete(target)
        self.sent = {k: v for k, v in self.sent.items() if k != rel and not k.startswith(rel + "/")}

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Copy up in the background inside the block, and once more as it ends."""
        self.thread = threading.Thread(target=self._loop, name="jaxtrain-run-dir-mirror", daemon=True)
        self.thread.start()
        try:
            yield
        finally:
            self.stopped.set()
            self.thread.join()
            try:
                self.push()
            except Exception as e:  # the error that ended the run says more than this one
                log.warning(f"copying the run dir's records to {self.url} failed: {bucket.reason(e)}")
            else:
                shutil.rmtree(self.local, ignore_errors=True)  # all of it is in the bucket

    def _loop(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.push()
            except Exception as e:  # tried again at the next round; checkpoints do not depend on it
                log.warning(f"copying the run dir's records to {self.url} failed: {bucket.reason(e)}")


def open_mirror(url: str, local: Path, process_index: int) -> Mirror:
    """The bucket checked (exists, these credentials read and write it), then the folder pulled."""
    bucket.check(url, "--run_dir", write=True)
    mirror = Mirror(url, local, process_index)
    try:
        mirror.pull()
    except OSError as e:
        raise UserError(f"--run_dir {url}: reading its records failed: {bucket.reason(e)}") from None
    return mirror
