"""One live job per run dir (jaxtrain/disk/runlock.py): a second start is refused; a dead holder's lock
is taken over at once on its own host. (From a second host: tests/test_multihost.py.)

    pytest tests/test_runlock.py      # about 40 s on 2 cores
"""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from processes import clean_env, reaped, wait_for_training

from jaxtrain.disk import runlock

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", "--eval_interval", "0", "--log_interval", "1"]

pytestmark = pytest.mark.slow


def _train(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "scripts/train.py", *TINY, "--run_dir", str(run_dir), *extra]


def test_a_second_start_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    env = clean_env(2, JAXTRAIN_TEST_MARKER=marker)
    first = subprocess.Popen(
        _train(run_dir, "--total_steps", "100000", "--checkpoint_interval", "5"),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with reaped(first, marker):
        wait_for_training(run_dir, first)
        t0 = time.monotonic()
        second = subprocess.run(_train(run_dir), cwd=ROOT, env=env, capture_output=True, text=True)
        refused_s = time.monotonic() - t0
        assert second.returncode == 2, second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        assert "Traceback" not in second.stderr
        who = f"is in use by another job (host {socket.gethostname()} pid {first.pid} since "
        assert last.startswith("error: run dir ") and who in last, last
        assert "wait for it to end or stop it, or use another --run_dir" in last
        os.kill(first.pid, signal.SIGKILL)  # its lock stays behind
        first.wait(timeout=30)
    assert (run_dir / "job.lock").exists()
    saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    t0 = time.monotonic()
    again = subprocess.run(
        _train(run_dir, "--total_steps", str(saved + 3), "--checkpoint_interval", "5"),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    relaunch_s = time.monotonic() - t0
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"took over the lock of {run_dir} left by a job that is gone" in again.stderr
    assert f"resumed from {run_dir}/checkpoints/{saved}" in again.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records if "loss" in r]
    assert logged == list(range(1, saved + 4)), logged  # every step once
    assert not (run_dir / "job.lock").exists()  # released at the end
    print(f"refused in {refused_s:.1f} s; relaunched after kill -9, took over, done in {relaunch_s:.1f} s")


HOLD = """
import sys, time
from pathlib import Path
from jaxtrain.disk.runlock import RunLock
RunLock(Path(sys.argv[1]), 60).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holding(run_dir: Path) -> subprocess.Popen:
    """A process that holds run_dir's lock (and its heartbeat thread) until killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def _wait_until(life: str, pid: int, pid_start: str | None) -> None:
    deadline = time.monotonic() + 10
    while runlock._life(pid, pid_start) != life:
        assert time.monotonic() < deadline, f"pid {pid} never became {life}"
        time.sleep(0.02)


def test_a_zombie_holder_is_taken_over_at_once(tmp_path):
    holder = _holding(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)  # and not reaped: a zombie, as when its parent is busy
    _wait_until("gone", holder.pid, runlock._start_time(holder.pid))
    assert Path(f"/proc/{holder.pid}").exists()
    lock, t0 = runlock.RunLock(tmp_path, 60), time.monotonic()
    lock.acquire()
    assert time.monotonic() - t0 < 2
    lock.release()
    holder.wait()


def test_a_holder_still_exiting_is_waited_for_then_taken_over(tmp_path):
    """The holder is stopped inside its exit (ptrace's exit event) until the test lets it finish."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    seize, cont, detach, trace_exit = 0x4206, 7, 17, 0x40  # PTRACE_SEIZE, _CONT, _DETACH, _O_TRACEEXIT
    holder = _holding(tmp_path)
    start = runlock._start_time(holder.pid)
    assert libc.ptrace(seize, holder.pid, None, trace_exit) == 0, os.strerror(ctypes.get_errno())
    os.kill(holder.pid, signal.SIGTERM)
    os.waitpid(holder.pid, 0)  # stopped on the signal's delivery: let it go on, to die of it...
    assert libc.ptrace(cont, holder.pid, None, signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
    # ...and stop again inside its exit, until detached
    _wait_until("exiting", holder.pid, start)
    took: list[float] = []
    t0 = time.monotonic()
    taker = threading.Thread(
        target=lambda: (runlock.RunLock(tmp_path, 30).acquire(), took.append(time.monotonic()))
    )
    taker.start()
    time.sleep(1.5)
    assert taker.is_alive() and not took, "an exiting holder was refused or taken over without waiting"
    assert libc.ptrace(detach, holder.pid, None, None) == 0, os.strerror(ctypes.get_errno())
    taker.join(timeout=10)
    assert took and 1.5 <= took[0] - t0 < 5, took
    holder.wait()
