"""A job ends with its launcher, Ctrl-C saves, and the same command relaunched right away resumes:
real runs of scripts/train.py and scripts/run_distributed.py on CPU. (Across two hosts:
tests/test_multihost.py.)

    pytest tests/test_launcher_death.py      # about 2 minutes on 2 cores
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from processes import clean_env, processes_marked, reaped, wait_for_training

from jaxtrain.launch.local import free_port

REPO = Path(__file__).resolve().parent.parent
STEPS = 150  # ~5 s in one process, long enough for a start in between in two
CFG = ["--config", "configs/tiny.yaml", "--total_steps", str(STEPS), "--eval_interval", "0"]
CFG += ["--log_interval", "1", "--checkpoint_interval", "20"]
TRAIN = [sys.executable, "scripts/train.py"]
LAUNCH = [sys.executable, "scripts/run_distributed.py", "--mode", "manual", "--world-size", "2", "--"]

pytestmark = pytest.mark.slow
TAKE_LOCK = """
import sys
from pathlib import Path
from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.disk.runlock import RunLock
exit_on_user_error(RunLock(Path(sys.argv[1]), 60).acquire)()
"""


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert len({r["step"] for r in train}) == len(train), "a step logged twice"
    return {r["step"]: r["loss"] for r in train}


def _as_from_a_terminal() -> None:
    """Ctrl-C's default, as a terminal's shell gives it: a suite started in the background (`&` in
    a script) hands its children SIGINT ignored, and a process started so keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(command: list[str], marker: str) -> subprocess.Popen:
    """`command` in its own process group (so a test can kill that group), output to pipes."""
    return subprocess.Popen(
        command, cwd=REPO, env=clean_env(JAXTRAIN_TEST_MARK=marker), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_terminal,
    )  # fmt: skip


def wait_for_checkpoint(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    done, deadline = run_dir / "checkpoints" / str(step) / "checksums.json", time.monotonic() + timeout
    while not done.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"checkpoint {step} never written"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> dict[int, float]:
    """The losses of the run nothing interrupts (one process)."""
    run_dir = tmp_path_factory.mktemp("unbroken") / "run"
    done = subprocess.run(
        [*TRAIN, *CFG, "--run_dir", str(run_dir)], cwd=REPO, env=clean_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    return losses(run_dir)


def test_ctrl_c_saves_that_step_and_the_relaunch_continues_the_unbroken_run(unbroken, tmp_path):
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    command = [*TRAIN, *CFG, "--checkpoint_interval", "1000", "--run_dir", str(run_dir)]
    first = start(command, marker)
    with reaped(first, marker):
        wait_for_training(run_dir, first)
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=60)
    assert first.returncode == -signal.SIGINT, err[-3000:]  # ended by SIGINT, as a shell expects
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "Ctrl-C: saving a checkpoint at the next step" in err
    stopped = re.findall(r"stop signal \(SIGINT\): saving step (\d+)$", out, re.M)
    assert len(stopped) == 1, out[-3000:]
    step = int(stopped[0])
    assert 0 < step < STEPS and max(losses(run_dir)) == step  # stopped mid-interval, not at the end
    assert err.strip().splitlines()[-1] == (
        f"interrupted (Ctrl-C): checkpoint {run_dir}/checkpoints/{step} saved; relaunch to resume"
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [str(step)]
    again = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/{step}" in again.stdout
    assert losses(run_dir) == unbroken  # the same one process: bit for bit


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["launcher pid", "launcher process group"])
def test_kill_9_of_the_launcher_ends_its_workers_and_the_same_command_resumes(target, unbroken, tmp_path):
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    command = [*LAUNCH, *CFG, "--run_dir", str(run_dir)]
    launcher = start(command, marker)
    with reaped(launcher, marker):
        wait_for_checkpoint(run_dir, 20, launcher)
        # The live job's lock is refused at once, as a relaunch's process 0 takes it (a whole start
        # would outlast this short run on a busy machine; tests/test_runlock.py starts one).
        t0 = time.monotonic()
        refused = subprocess.run(
            [sys.executable, "-c", TAKE_LOCK, str(run_dir)], capture_output=True, text=True
        )
        assert refused.returncode == 2 and "is in use by another job" in refused.stderr, refused.stderr
        assert time.monotonic() - t0 < 5
        workers = processes_marked(marker)
        assert len(workers) >= 3, workers  # the launcher and its two ranks
        killed_at = max(losses(run_dir))
        assert killed_at < STEPS, "the run ended before the kill"
        t0 = time.monotonic()
        if target == "launcher pid":
            os.kill(launcher.pid, signal.SIGKILL)
        else:
            os.killpg(launcher.pid, signal.SIGKILL)
        # The same command at once, while the killed ranks may still be on their way out.
        again = start(command, uuid.uuid4().hex)
        while processes_marked(marker) and time.monotonic() - t0 < 15:
            time.sleep(0.05)
        outlived_s = time.monotonic() - t0
        assert processes_marked(marker) == [], f"workers left {outlived_s:.0f} s after the kill"
        out, err = again.communicate(timeout=180)
    assert again.returncode == 0, err[-3000:]
    resumed = re.findall(rf"resumed from {run_dir}/checkpoints/(\d+)$", out, re.M)
    assert len(resumed) == 1 and 20 <= int(resumed[0]) <= killed_at, (resumed, killed_at)
    # every step once, the unbroken run's: to float tolerance, as two processes sum the gradient
    # in another order than the unbroken run's one process does
    assert losses(run_dir) == pytest.approx(unbroken, abs=1e-4)
    print(f"kill -9 of the {target} at step {killed_at}: workers gone {outlived_s:.2f} s later")


@pytest.mark.multiprocess
def test_kill_9_of_torchrun_ends_its_workers(tmp_path):
    """torchrun leaves its workers running when it is killed; ours notice and stop."""
    import torch.distributed.run  # noqa: F401  (a dev dependency: missing, this names it)

    run_dir, marker, said = tmp_path / "run", uuid.uuid4().hex, tmp_path / "said.txt"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
    ]
    with open(said, "w") as out:  # a file: the workers would hold a pipe open after torchrun is gone
        launcher = subprocess.Popen(
            [*torchrun, "scripts/train.py", *CFG, "--total_steps", "100000", "--run_dir", str(run_dir)],
            cwd=REPO, env=clean_env(JAXTRAIN_TEST_MARK=marker), stdout=out, stderr=out,
        )  # fmt: skip
    with reaped(launcher, marker):
        wait_for_training(run_dir, launcher)
        t0 = time.monotonic()
        launcher.kill()
        while processes_marked(marker) and time.monotonic() - t0 < 15:
            time.sleep(0.05)
        outlived_s = time.monotonic() - t0
        assert processes_marked(marker) == [], f"workers left {outlived_s:.0f} s after the kill"
    # At least one worker sees torchrun gone first; the other may die of its peer's exit (a gloo
    # collective reset) before it looks: either way none is left (asserted above).
    assert said.read_text().count(f"jaxtrain: torchrun (pid {launcher.pid}) is gone; stopping") >= 1
    print(f"kill -9 of torchrun: workers gone {outlived_s:.2f} s later")


@pytest.mark.multiprocess
def test_kill_9_of_the_launcher_ends_a_health_check_too(tmp_path):
    marker, said = uuid.uuid4().hex, tmp_path / "said.txt"
    check = ["--script", "scripts/test_distributed.py", "--", "--max_bytes", "64M", "--iters", "1000"]
    with open(said, "w") as out:
        launcher = subprocess.Popen(
            [*LAUNCH[:-1], *check, "--step_timeout", "600", "--checkpoint_dir", str(tmp_path / "ckpt")],
            cwd=REPO, env=clean_env(JAXTRAIN_TEST_MARK=marker), stdout=out, stderr=out,
        )  # fmt: skip
    with reaped(launcher, marker):
        deadline = time.monotonic() + 120
        while "Rank 1 is connected" not in said.read_text():  # both joined, checks under way
            assert launcher.poll() is None and time.monotonic() < deadline, said.read_text()[-3000:]
            time.sleep(0.2)
        t0 = time.monotonic()
        launcher.kill()
        while processes_marked(marker) and time.monotonic() - t0 < 15:
            time.sleep(0.05)
        assert processes_marked(marker) == [], said.read_text()[-3000:]
    print(f"kill -9 of the launcher of a health check: its ranks gone {time.monotonic() - t0:.2f} s later")
