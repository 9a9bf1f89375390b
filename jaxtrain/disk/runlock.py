"""One live job per run dir: process 0 holds `<run_dir>/job.lock` for the whole run.

The lock is a file created with O_CREAT|O_EXCL (atomic on local disks and on NFSv3+/Lustre,
unlike flock, which may not reach other hosts) holding who took it: host, pid, the pid's start
time, SLURM job id, since when. The holder touches its mtime every `stale_s / 10` seconds. A
second start is refused (exit 2) unless the lock was left by a job that is gone:
  same host      the pid is dead, or now belongs to another process (start time differs): at once;
                 a holder that is exiting (a zombie, in exit, or with a SIGKILL pending: the usual
                 state right after a kill -9) is waited for, at most `stale_s`, then taken over
  same SLURM job a requeue of the job that held it (a higher SLURM_RESTART_COUNT; SLURM runs a
                 job once at a time): at once
  other host     the heartbeat is `stale_s` old: at once if the mtime is that old by this host's
                 clock; else this host watches the mtime for `stale_s` and takes the lock if it
                 never moves. The watch needs no clock agreement between hosts (only that mtimes
                 change when touched); the first rule trusts clocks to agree within `stale_s`
                 (default 60 s, vs NTP's milliseconds). A live holder that cannot touch the file
                 for `stale_s` (10 heartbeats) would lose it: that storage is hung, and the
                 watchdog ends such a job.
A takeover renames the stale file to a name of its own (atomic, so of two hosts taking over at
once only one moves it) and checks that it moved the lock it judged stale before creating its own.

In a bucket (--run_dir gs://... or s3://...) the lock is an object created only if there is none
(GCS ifGenerationMatch=0, S3 If-None-Match: *), its heartbeat a rewrite of it (its mtime is the
store's clock), and the same rules judge a holder. A bucket has no rename: a takeover deletes the
stale object (after reading it once more) and creates its own, conditionally; of two starters
taking over at once the one whose create fails re-reads and is refused by the other's fresh lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxtrain.disk import bucket
from jaxtrain.errors import UserError

log = logging.getLogger("jaxtrain")

LOCK_NAME = "job.lock"
POLL_S = 0.2


def _start_time(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (Linux), or None if no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


_PF_DYING = 0x4 | 0x400  # task flags (linux/sched.h): PF_EXITING (in exit), PF_SIGNALED (killed)
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _life(pid: int, pid_start: str | None) -> str:
    """Whether `pid` on this host, the process that took the lock, is "alive", "exiting" or "gone"."""
    if pid_start is None:  # no /proc here (not Linux): the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "alive"
        return "alive"
    proc = Path(f"/proc/{pid}")
    try:
        fields = (proc / "stat").read_text().rpartition(")")[2].split()
        status = dict(x.split(":", 1) for x in (proc / "status").read_text().splitlines() if ":" in x)
        threads = len(os.listdir(proc / "task"))
    except OSError:
        return "gone"
    if len(fields) < 20 or fields[19] != pid_start:
        return "gone"  # the pid now belongs to another process
    state, flags = fields[0], int(fields[6])
    if state in "ZX" and threads <= 1:
        return "gone"  # a zombie: only its exit status is left, everything else is released
    pending = int(status.get("SigPnd", "0"), 16) | int(status.get("ShdPnd", "0"), 16)
    if state in "ZX" or flags & _PF_DYING or pending & _SIGKILL_BIT:
        return "exiting"  # e.g. tearing down a large address space after a kill -9
    return "alive"


def _read(path: Path | str) -> tuple[dict[str, Any], float] | None:
    """(holder, mtime) of the lock at `path` (a file, or an object's URL), or None if there is none.
    A lock being written (empty or half JSON) reads as a holder with no fields, so it is judged by
    its mtime alone."""
    try:
        if isinstance(path, str):
            found = bucket.stat(path)
            data = bucket.read(path)
            if found is None or data is None:
                return None
            text, mtime = data.decode("utf-8", "replace"), found[1]
        else:
            text, mtime = path.read_text(), path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        holder = {}
    return (holder if isinstance(holder, dict) else {}), mtime


class RunLock:
    """Take with `acquire()`, which refuses (UserError) while another live job holds the run dir."""

    def __init__(self, run_dir: Path | str, stale_s: float) -> None:
        # A file, or for a bucket run dir the lock object's URL.
        self.path: Path | str = (
            bucket.join(str(run_dir), LOCK_NAME) if bucket.is_url(run_dir) else Path(run_dir) / LOCK_NAME
        )
        self.stale_s = stale_s
        self.me: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _start_time(os.getpid()),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "token": uuid.uuid4().hex,
        }
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Create the lock, taking over a stale one; then keep its heartbeat until release()."""
        if isinstance(self.path, Path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._create():
            found = _read(self.path)
            if found is None:
                continue  # released meanwhile
            holder, mtime = found
            if self._gone(holder, mtime):
                self._take_over(holder)
                continue
            now = _read(self.path)
            if now is not None and now[0] == holder:  # else it changed hands meanwhile: judge again
                raise UserError(self._refusal(*now))
        self.thread = threading.Thread(target=self._beat, name="jaxtrain-run-lock", daemon=True)
        self.thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still ours."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
        found = _read(self.path)
        if found is not None and found[0].get("token") == self.me["token"]:
            if isinstance(self.path, str):
                bucket.delete(self.path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()

    @contextlib.contextmanager
    def held(self, take: bool) -> Iterator[None]:
        """Hold the lock inside the block if `take` (process 0); released however the block ends."""
        if take:
            self.acquire()
        try:
            yield
        finally:
            if take:
                self.release()

    def _create(self) -> bool:
        if isinstance(self.path, str):
            return bucket.create(self.path, (json.dumps(self.me) + "\n").encode())
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.me) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def _gone(self, holder: dict[str, Any], mtime: float) -> bool:
        """Whether the job that wrote `holder` has ended (see the module docstring)."""
        if holder.get("host") == self.me["host"] and "pid" in holder:
            pid, pid_start = int(holder["pid"]), holder.get("pid_start")
            life, end = _life(pid, pid_start), time.monotonic() + self.stale_s
            if life == "exiting":
                log.info(f"waiting for pid {pid}, which held {self._run_dir()}, to finish exiting")
            while life == "exiting" and time.monotonic() < end:
                time.sleep(POLL_S / 2)
                life = _life(pid, pid_start)
            return life != "alive"  # still exiting after stale_s: stuck (dead NFS?), and no job
        if holder.get("slurm_job") and holder["slurm_job"] == self.me["slurm_job"]:
            return int(holder.get("slurm_restart", 0)) < self.me["slurm_restart"]  # an earlier run of it
        if time.time() - mtime > self.stale_s:
            return True
        # Another host, heartbeat recent by our clock: watch whether it still beats.
        end = time.monotonic() + self.stale_s
        while time.monotonic() < end:
            time.sleep(POLL_S)
            now = _read(self.path)
            if now != (holder, mtime):
                return False  # it beat, or the lock was released or changed hands
        return True

    def _take_over(self, holder: dict[str, Any]) -> None:
        if isinstance(self.path, str):
            now = _read(self.path)
            if now is None or now[0].get("token") != holder.get("token"):
                return  # released, or taken by another starter meanwhile: judge again
            bucket.delete(self.path)
            self._took_over(holder)
            return
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{self.me['token']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another starter moved it first; try again to create ours
        moved = _read(aside)
        if moved is not None and moved[0].get("token") != holder.get("token"):
            # Between our look and our rename another starter replaced the stale lock with its
            # own live one: give it back.
            os.rename(aside, self.path)
            return
        aside.unlink()
        self._took_over(holder)

    def _took_over(self, holder: dict[str, Any]) -> None:
        log.warning(
            f"took over the lock of {self._run_dir()} left by a job that is gone (host "
            f"{holder.get('host', '?')} pid {holder.get('pid', '?')} since {holder.get('since', '?')})"
        )

    def _refusal(self, holder: dict[str, Any], mtime: float) -> str:
        who = f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} since {holder.get('since', '?')}"
        return (
            f"run dir {self._run_dir()} is in use by another job ({who}, heartbeat "
            f"{max(time.time() - mtime, 0):.0f} s ago, lock {self.path}); wait for it to end or stop it, "
            "or use another --run_dir (a lock left by a dead job is taken over by itself)"
        )

    def _run_dir(self) -> str:
        return str(self.path).rpartition("/")[0]

    def _beat(self) -> None:
        while not self.stopped.wait(self.stale_s / 10):
            if isinstance(self.path, str):
                try:  # rewritten only while it is ours: a new mtime, the store's clock
                    found = _read(self.path)
                    if found is not None and found[0].get("token") == self.me["token"]:
                        bucket.write(self.path, (json.dumps(self.me) + "\n").encode())
                except Exception as e:  # a storage hiccup (retried inside); the watchdog handles a hang
                    log.warning(f"run lock heartbeat: {bucket.reason(e)}")
                continue
            with contextlib.suppress(OSError):  # a storage hiccup; the watchdog handles a hang
                os.utime(self.path)
