"""Storage that fills or breaks: a real tmpfs that fills during a save (root), a newest checkpoint
truncated after kill -9. Each ends as the README says, and the relaunch loses nothing.

    pytest tests/test_storage.py      # about 70 s on 2 cores (the tmpfs case needs root)
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import clean_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", "--eval_interval", "0", "--log_interval", "1"]

pytestmark = pytest.mark.slow


def _train(run_dir: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/train.py", *TINY, "--run_dir", str(run_dir), *extra],
        cwd=ROOT, env=clean_env(2), capture_output=True, text=True, timeout=timeout,
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
    killed = _train(run_dir, "--checkpoint_interval", "5", "--debug.kill_during_save", "15")
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
