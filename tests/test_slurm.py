"""The SLURM launch path on a real one-node cluster on localhost (scripts/dev/local_slurm.sh).

pytest -m slurm tests/test_slurm.py      # root; about 80 s (installs SLURM with apt the first time)
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import clean_env, processes_marked

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = [sys.executable, "scripts/run_distributed.py"]
TINY = ["--config", "configs/tiny.yaml", "--total_steps", "10", "--eval_interval", "0"]
STAND_IN = """
from jaxtrain.config import DistConfig
from jaxtrain.cluster.join import initialize
spec = initialize(DistConfig(init_timeout=60))
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
total = multihost_utils.process_allgather(jnp.array([jax.process_index() + 1])).sum()
print(f"stand-in process {jax.process_index()}/{jax.process_count()} source={spec.source} sum={int(total)}")
"""

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start slurmctld, slurmd and munged"),
    pytest.mark.skipif(
        not shutil.which("sbatch") and not shutil.which("apt-get"),
        reason="needs SLURM installed, or apt-get to install it",
    ),
]


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    """The local cluster, up for these tests; stopped after them unless it was up before, so no
    daemon outlives the run (a munged left holding its socket's lock stops the next one starting)."""
    was_up = (
        shutil.which("scontrol")
        and " is UP"
        in subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30).stdout
    )
    done = subprocess.run(
        ["bash", "scripts/dev/local_slurm.sh"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    yield
    if not was_up:
        subprocess.run(
            ["bash", "scripts/dev/local_slurm.sh", "stop"], cwd=REPO, capture_output=True, timeout=60
        )


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def job_state(job_id: str) -> tuple[str, str, int]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    state, code, restarts = (
        re.search(p, out) for p in (r"JobState=(\S+)", r"ExitCode=(\S+)", r"Restarts=(\d+)")
    )
    return state[1], code[1], int(restarts[1])


def wait_job(job_id: str, timeout: float = 240) -> tuple[str, str, int]:
    deadline = time.monotonic() + timeout
    while (found := job_state(job_id))[0] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED"):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            pytest.fail(f"job {job_id} still {found[0]} after {timeout} s")
        time.sleep(1)
    return found


def test_mode_slurm_inside_salloc_runs_two_tasks(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        ["salloc", "--ntasks=2", "--ntasks-per-node=2", *LAUNCHER, "--mode", "slurm", "--"]
        + [*TINY, "--run_dir", str(run_dir)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "jaxtrain launch: srun --kill-on-bad-exit=1" in done.stderr
    assert "distributed: source=slurm process 0/2" in done.stdout
    assert len(losses(run_dir)) == 2 and losses(run_dir)[-1] < losses(run_dir)[0]


def test_create_slurm_script_runs_under_sbatch(tmp_path):
    run_dir, job = tmp_path / "run", tmp_path / "job.sh"
    log = tmp_path / "logs" / "%x-%j.out"
    made = subprocess.run(
        [*LAUNCHER, "--mode", "create_slurm", "--ntasks-per-node", "2", "--time", "00:10:00"]
        + ["--job-name", "jaxtrain-test", "--output", str(log), "--sbatch-script", str(job), "--"]
        + [*TINY, "--run_dir", str(run_dir)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(job)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True
    )  # submitted from elsewhere on purpose: the file must not depend on the current directory
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    state, code, _ = wait_job(job_id)
    out = (tmp_path / "logs" / f"jaxtrain-test-{job_id}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), out[-3000:]
    assert "distributed: source=slurm process 0/2" in out
    assert len(losses(run_dir)) == 2


def test_mode_slurm_outside_an_allocation_submits_and_follows(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    done = subprocess.run(
        [*LAUNCHER, "--mode", "slurm", "--ntasks-per-node", "2", "--script", str(script), "--follow"]
        + ["--job-name", "jaxtrain-follow", "--output", str(tmp_path / "%x-%j.out")],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^submitted batch job \d+ ", done.stdout, re.M)
    assert "stand-in process 0/2 source=slurm sum=3" in done.stdout  # followed from the job's log
    assert "jaxtrain launch: job" in done.stderr and "COMPLETED" in done.stderr


@pytest.mark.parametrize("how", ["srun", "run_distributed --mode slurm"])
def test_health_check_in_an_allocation(how, tmp_path):
    """scripts/test_distributed.py as 2 SLURM tasks: srun by hand, or through the launcher."""
    out = tmp_path / "health.json"
    check = ["--max_bytes", "8K", "--iters", "3", "--json", str(out), "--checkpoint_dir", str(tmp_path / "c")]
    if how == "srun":
        command = ["srun", "--ntasks", "2", sys.executable, "scripts/test_distributed.py", *check]
    else:
        command = [*LAUNCHER, "--mode", "slurm", "--script", "scripts/test_distributed.py", "--", *check]
    done = subprocess.run(
        ["salloc", "--ntasks=2", "--ntasks-per-node=2", *command],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["healthy"] and report["bad_hosts"] == [], report["bad_processes"]
    assert report["environment"]["source"] == "slurm"
    assert [r["process_id"] for r in report["processes"]] == [0, 1]
    assert "verdict: HEALTHY" in done.stdout
    assert not (tmp_path / "c").exists()  # the storage probe cleaned up after itself


def _wait_for(what: str, check, job_id: str, timeout: float = 120) -> float:
    """Poll `check()` until true; the time it became true. Fails naming `what` and the job state."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s; job {job_id} {job_state(job_id)}"
        time.sleep(0.2)
    return time.monotonic()


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(x)["step"] for x in text.splitlines() if '"loss"' in x]


def _saved(log: Path) -> list[int]:
    """The steps the job log says pre-emption checkpoints were saved at, in order (every rank says it)."""
    found = re.findall(r"pre-empted: checkpoint \S+/(\d+) saved", log.read_text() if log.exists() else "")
    return [int(s) for s in dict.fromkeys(found)]


def test_preempted_job_saves_requeues_resumes_and_completes(tmp_path):
    """Both ways SLURM stops a --requeue job, in one job: the time-limit path (USR1 to the batch
    script, whose trap passes USR1 to the tasks and requeues once they have saved) and SLURM's own
    pre-emption (scontrol requeue: SIGTERM to the tasks). Either way the tasks agree on a step,
    save it and exit 75, and the requeued job resumes from that checkpoint and finishes."""
    run_dir, job, log = tmp_path / "run", tmp_path / "job.sh", tmp_path / "job.out"
    total = 100
    train_args = [*TINY, "--total_steps", str(total), "--checkpoint_interval", "100000"]
    made = subprocess.run(
        [*LAUNCHER, "--mode", "create_slurm", "--ntasks-per-node", "2", "--time", "00:10:00"]
        + ["--job-name", "jaxtrain-preempt", "--output", str(log), "--sbatch-script", str(job), "--"]
        + [*train_args, "--log_interval", "1", "--run_dir", str(run_dir)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    job_id = subprocess.run(
        ["sbatch", "--parsable", str(job)], env=clean_env(), capture_output=True, text=True, check=True
    ).stdout.strip()
    ckpts, timings, saved = run_dir / "checkpoints", [], []
    try:
        t0 = time.monotonic()
        for stop in (["scancel", "--signal=USR1", "--batch", job_id], ["scontrol", "requeue", job_id]):
            resumed = saved[-1] if saved else 0
            # a few steps into this run (the first, or the one that resumed)
            _wait_for("training", lambda r=resumed: len(_steps(run_dir)) >= r + 3, job_id)
            signalled = time.monotonic()
            subprocess.run(stop, check=True)
            n = len(saved)
            saved_at = _wait_for("checkpoint saved", lambda n=n: len(_saved(log)) > n, job_id, timeout=60)
            saved = _saved(log)
            requeued = _wait_for("requeue", lambda n=n: job_state(job_id)[2] > n, job_id, timeout=60)
            back = f"resumed from {ckpts}/{saved[-1]}"
            started = _wait_for("resume", lambda b=back: b in log.read_text(), job_id, timeout=180)
            timings.append((signalled - t0, saved_at - signalled, requeued - signalled, started - signalled))
        state, code, restarts = wait_job(job_id)
        done = time.monotonic()
    finally:
        subprocess.run(["scancel", job_id])
    out = log.read_text()
    assert (state, code, restarts) == ("COMPLETED", "0:0", 2), out[-3000:]
    assert out.count("jaxtrain: time limit near, asking the tasks to save") == 1
    assert out.count(f"jaxtrain: pre-empted, requeueing job {job_id}") >= 1
    assert len(saved) == 2 and 0 < saved[0] < saved[1] < total, saved
    for s in saved:
        assert f"pre-empted: checkpoint {ckpts}/{s} saved; relaunch to resume" in out
    assert out.index(f"resumed from {ckpts}/{saved[0]}") < out.index(f"checkpoints/{saved[1]} saved")
    assert _steps(run_dir) == list(range(1, total + 1))  # every step exactly once across 3 runs
    for (at, save, requeue, resume), how in zip(timings, ("USR1 + trap", "scontrol requeue"), strict=True):
        print(f"{how}: signal at {at:.1f} s; checkpoint saved +{save:.1f} s, requeued +{requeue:.1f} s, "
              f"resumed +{resume:.1f} s")  # fmt: skip
    print(f"completed {done - t0:.1f} s after submission")


def test_kill_9_of_the_launcher_inside_salloc_ends_the_step(tmp_path):
    """srun gets SIGTERM when our launcher dies and ends the step; SLURM alone would leave its tasks
    running until the allocation ends."""
    script, said, marker = tmp_path / "sleeper.py", tmp_path / "said.txt", uuid.uuid4().hex
    script.write_text("import time\nprint('task up', flush=True)\ntime.sleep(300)\n")

    def running(kind: str) -> list[int]:
        found = []
        for pid in processes_marked(marker):
            with contextlib.suppress(OSError):
                # [1:2]: a process exiting (a zombie) has an empty cmdline (CI failed on argv[1])
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:2]
                if (kind == "task" and argv == [str(script).encode()]) or kind.encode() in b"".join(argv):
                    found.append(pid)
        return found

    with open(said, "w") as out:
        salloc = subprocess.Popen(
            ["salloc", "--ntasks=2", "--ntasks-per-node=2", *LAUNCHER, "--mode", "slurm"]
            + ["--script", str(script)],
            cwd=REPO, env=clean_env(JAXTRAIN_TEST_MARK=marker), stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(running("task")) < 2:
            assert salloc.poll() is None and time.monotonic() < deadline, said.read_text()[-3000:]
            time.sleep(0.2)
        (launcher,) = running("run_distributed.py")
        t0 = time.monotonic()
        os.kill(launcher, signal.SIGKILL)
        while running("task") and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert running("task") == [], f"tasks left {time.monotonic() - t0:.0f} s after the kill"
        print(f"kill -9 of run_distributed.py --mode slurm: tasks gone {time.monotonic() - t0:.1f} s later")
    finally:
        os.killpg(salloc.pid, signal.SIGKILL)
        salloc.wait()
