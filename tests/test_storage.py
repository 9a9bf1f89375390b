"""Storage that fills or breaks: a real tmpfs that fills during a save (root), a newest checkpoint
truncated after kill -9. Each ends as docs/resume_and_faults.md says, and the relaunch loses nothing.

    pytest tests/test_storage.py      # about 70 s on 2 cores (the tmpfs case needs root)
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from processes import clean_env, processes_marked, reaped

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", "--eval_interval", "0", "--log_interval", "1"]

pytestmark = pytest.mark.slow


def _train(run_dir: Path, *extra: str, faults: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """`faults`: $JAXTRAIN_FAULTS (jaxtrain/faults.py)."""
    return subprocess.run(
        [sys.executable, "scripts/train.py", *TINY, "--run_dir", str(run_dir), *extra],
        cwd=ROOT, env=clean_env(2, JAXTRAIN_FAULTS=faults), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]  # all valid
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def _last_line(out: subprocess.CompletedProcess) -> str:
    return out.stderr.strip().splitlines()[-1]


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    fs = tmp_path / "fs"
    fs.mkdir()
    # One tiny checkpoint is 1.3 MiB: room for the one at step 10, not for the one at step 20.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2200k", "jaxtrain-test", str(fs)], check=True)
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=True)


def test_a_disk_that_fills_during_a_save_stops_the_run_then_it_resumes(small_tmpfs):
    run_dir = small_tmpfs / "run"
    t0 = time.monotonic()
    out = _train(run_dir)
    failed_s = time.monotonic() - t0
    assert out.returncode == 5, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = _last_line(out)
    assert last.startswith("error: ") and "no space left on the device" in last, last
    assert "will fail (exit 5) unless space is made" in out.stdout  # warned before training
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["10"], "a half-written step dir is left"
    assert (run_dir / "train.log").read_text().endswith("\n")  # no record cut short
    first = _losses(run_dir)
    assert [s for s, _ in first] == list(range(1, len(first) + 1))

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_tmpfs)], check=True)
    t0 = time.monotonic()
    again = _train(run_dir)
    resumed_s = time.monotonic() - t0
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpts}/10" in again.stdout
    losses = _losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, 21))  # every step logged once
    assert losses[:10] == first[:10]
    print(f"disk full: exit 5 after {failed_s:.1f} s; resumed and finished in {resumed_s:.1f} s")


def test_a_newest_checkpoint_truncated_after_kill_9_is_moved_aside(tmp_path):
    whole, run_dir = tmp_path / "whole", tmp_path / "run"
    assert _train(whole, "--checkpoint_interval", "5").returncode == 0
    # SIGKILL just after the save of step 15 starts: 10 is the newest complete checkpoint.
    killed = _train(run_dir, "--checkpoint_interval", "5", faults="kill_during_save=15")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "10" / "checksums.json").exists()
    # A node crash loses the tail of a file the page cache held: the checkpoint opens, reads wrong.
    biggest = max(
        (p for p in (ckpts / "10" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])
    damaged = {
        str(p.relative_to(ckpts / "10")): p.read_bytes() for p in (ckpts / "10").rglob("*") if p.is_file()
    }
    t0 = time.monotonic()
    out = _train(run_dir, "--checkpoint_interval", "5")
    relaunch_s = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"checkpoint {ckpts}/10 is unreadable (1 file(s) differ from their checksums" in out.stdout
    aside = next((run_dir / "damaged_checkpoints").iterdir())
    assert aside.name.startswith("10.") and f"moved aside to {aside}" in out.stdout
    kept = {str(p.relative_to(aside)): p.read_bytes() for p in aside.rglob("*") if p.is_file()}
    assert kept == damaged  # renamed, not deleted nor changed
    assert f"resumed from {ckpts}/5" in out.stdout
    assert _losses(run_dir) == _losses(whole)  # bitwise, every step once
    print(f"damaged newest checkpoint: moved aside, resumed from 5 and finished in {relaunch_s:.1f} s")


@pytest.fixture
def freezable_checkpoints(tmp_path):
    """run/checkpoints on an ext4 loop device of its own (root): `fsfreeze --freeze` makes every
    write to it hang in the kernel, as a dead NFS server does, while the rest of the run dir works."""
    if os.geteuid() != 0 or not shutil.which("fsfreeze") or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root, fsfreeze and mkfs.ext4")
    image, ckpts = tmp_path / "ckpt.img", tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    subprocess.run(["truncate", "-s", "32M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    if subprocess.run(["mount", "-o", "loop", str(image), str(ckpts)], capture_output=True).returncode:
        pytest.skip("cannot mount a loop device here")
    (ckpts / "lost+found").rmdir()
    try:
        yield ckpts
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(ckpts)], capture_output=True)
        subprocess.run(["umount", "-l", str(ckpts)], check=True)


def _wait_for(what, proc: subprocess.Popen, timeout: float, why: str) -> float:
    """Seconds until `what()` holds; fails if `proc` ends first or time runs out."""
    t0 = time.monotonic()
    while not what():
        assert proc.poll() is None, f"it ended with {proc.returncode}"
        assert time.monotonic() - t0 < timeout, why
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_save_or_restore_hung_on_storage_ends_the_run_with_the_watchdogs_code(freezable_checkpoints):
    ckpts = freezable_checkpoints
    run_dir, marker = ckpts.parent, uuid.uuid4().hex
    env = clean_env(2, JAXTRAIN_TEST_MARKER=marker)
    args = ["--total_steps", "100000", "--checkpoint_interval", "5", "--watchdog_timeout", "10"]
    errors = run_dir.parent / "stderr.txt"  # a file, not a pipe: nobody reads while it trains
    with open(errors, "w") as err_f:
        proc = subprocess.Popen(
            [sys.executable, "scripts/train.py", *TINY, "--run_dir", str(run_dir), *args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err_f,
        )  # fmt: skip
    log = run_dir / "train.log"
    with reaped(proc, marker):
        _wait_for(lambda: (ckpts / "5" / "checksums.json").exists(), proc, 120, "checkpoint 5 never saved")
        subprocess.run(["fsfreeze", "--freeze", str(ckpts)], check=True)  # storage stops answering
        hung = _wait_for(lambda: "watchdog: " in log.read_text(), proc, 60, "the watchdog never fired")
        said = re.search(r"watchdog: (checkpoint save at step \d+)\S* .*has taken", log.read_text())
        assert said, log.read_text()[-3000:]
        # Threads inside a frozen filesystem's writes cannot die (nor could SIGKILL end them) until
        # it answers again; a dead NFS server's hard mount lets a killed process go.
        subprocess.run(["fsfreeze", "--unfreeze", str(ckpts)], check=True)
        proc.wait(timeout=30)
    err = errors.read_text()
    assert proc.returncode == 3, err[-3000:]
    assert f"watchdog: {said[1]}" in err and "last completed step" in err
    time.sleep(0.5)
    assert processes_marked(marker) == [], "processes left behind"

    # The relaunch: the restore hangs (a debug fault: a sleep inside it, as reading dead storage).
    t0 = time.monotonic()
    again = _train(run_dir, "--watchdog_timeout", "8", faults="stall_restore=true", timeout=120)
    restore_s = time.monotonic() - t0
    assert again.returncode == 3, again.stderr[-3000:]
    assert re.search(r"watchdog: checkpoint restore has taken \d+ s, over the 8 s limit", again.stderr)
    assert "took over the lock" in again.stderr  # the first run's, left by its exit 3
    print(f"frozen storage: {said[0]!r} after {hung:.1f} s; hung restore: exit 3 in {restore_s:.1f} s")
