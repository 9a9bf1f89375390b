"""One live job per run dir (jaxtrain/runlock.py): a second start is refused; a dead holder's lock
is taken over at once on its own host. (From a second host: tests/test_multihost.py.)

    pytest tests/test_runlock.py      # about 40 s on 2 cores
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from processes import clean_env, reaped, wait_for_training

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
