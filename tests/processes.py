"""Environments and process lookup for tests that start real processes.

    from processes import clean_env, processes_marked, env_of, rank_pid, reaped, wait_for_training
    from processes import run_train, start_train, ok, logged_losses, wait_for_step

(No jax here: conftest.py imports this module before it sets the environment jax reads.)

(pytest puts tests/ on sys.path, so the test files import this module by its bare name.)
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The tests' programs are tiny: compiling them is most of their CPU, running them little. LLVM's
# optimisation passes off (XLA's own HLO passes, sharding and collectives, unchanged): a cold
# tiny 20-step run 9.1 -> 6.7 s of CPU. Every process of a test gets the same flags, so runs a
# test compares bitwise are compiled alike.
FAST_COMPILE = "--xla_backend_optimization_level=0"

# What a launcher (SLURM, torchrun, mpirun, run_distributed.py, launch_multi_node.sh) reads or sets: a child
# must not inherit ours (the tests may themselves run inside a job).
LAUNCH_VARS = (
    "JAX_",
    "SLURM_",
    "MASTER_",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "CUDA_VISIBLE_DEVICES",
    "HOSTFILE",
    "TORCHELASTIC_",
    "OMPI_",
    "PMIX_",
    "PMI_",
    "MV2_",
    "JOB_COMPLETION",  # a Kubernetes Indexed Job's pod (JOB_COMPLETION_INDEX, JOB_COMPLETIONS)
    "JOBSET_",
)


def clean_env(devices: int = 1, *, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This environment without launcher variables (nor any starting with one of `drop`): CPU with
    `devices` devices per process, wandb offline, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS + drop)}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
        WANDB_MODE="offline",
    )
    env.update(extra)
    return env


def processes_marked(marker: str) -> list[int]:
    """Live processes (not zombies, not this one) whose environment holds `marker`: a test puts a
    unique marker in the environment of what it starts, and every descendant inherits it."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            # The state follows the command name, which is in parentheses and may hold spaces.
            if (
                marker.encode() in (d / "environ").read_bytes()
                and (d / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
            ):
                found.append(int(d.name))
        except OSError:
            continue  # exited meanwhile
    return found


def env_of(pid: int) -> dict[str, str]:
    """The environment process `pid` started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def rank_pid(marker: str, rank: int, script: str = "train.py") -> int:
    """The one marked process running `script` as rank `rank` (JAX_PROCESS_ID); fails unless exactly one."""
    pids = []
    for pid in processes_marked(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if env_of(pid).get("JAX_PROCESS_ID") == str(rank) and script.encode() in cmdline:
                pids.append(pid)
        except OSError:
            continue  # exited meanwhile
    assert len(pids) == 1, f"rank {rank} processes running {script}: {pids}"
    return pids[0]


def wait_for_training(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Return once run_dir/metrics.jsonl holds a step's record (not just the start record); fail if
    `proc` ends first or time runs out."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while not metrics.exists() or '"loss"' not in metrics.read_text():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.2)


@contextmanager
def reaped(proc: subprocess.Popen, marker: str) -> Iterator[subprocess.Popen]:
    """Yield `proc`; afterwards kill it and every process carrying `marker`, even when a test fails."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in processes_marked(marker):
            os.kill(pid, signal.SIGKILL)


# scripts/train.py runs of the tiny model (tests/test_faults.py's, tests/test_sharded_resume.py's):
# a step logged each, no evaluation.
TINY = ["--config", "configs/tiny.yaml", "--log_interval", "1", "--eval_interval", "0"]


def train_env(devices: int, marker: str = "", faults: str = "") -> dict[str, str]:
    """clean_env with a marker (a fresh one unless given) and `faults`: $JAXTRAIN_FAULTS
    (jaxtrain/faults.py), e.g. "stall_step=15,stall_process=1"."""
    return clean_env(devices, JAXTRAIN_TEST_MARKER=marker or uuid.uuid4().hex, JAXTRAIN_FAULTS=faults)


def train_cmd(run_dir: Path, procs: int, *extra: str) -> list[str]:
    """TINY into `run_dir`: scripts/train.py for one process, else the local launcher's `procs`."""
    args = [*TINY, "--run_dir", str(run_dir), *extra]
    if procs == 1:
        return [sys.executable, "scripts/train.py", *args]
    return [
        sys.executable,
        "scripts/run_distributed.py",
        "--mode",
        "manual",
        "--world-size",
        str(procs),
        "--",
        *args,
    ]


def run_train(
    run_dir: Path, procs: int, devices: int, *extra: str, faults: str = "", timeout: float = 300
) -> subprocess.CompletedProcess:
    """train_cmd run to its end, `devices` CPU devices a process."""
    cmd, env = train_cmd(run_dir, procs, *extra), train_env(devices, faults=faults)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`out`, failing with its output's tail unless it exited 0."""
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def start_train(
    run_dir: Path, procs: int, devices: int, marker: str, *extra: str, faults: str = ""
) -> subprocess.Popen:
    """train_cmd started (its own session, `marker` in its environment), not waited for."""
    return subprocess.Popen(
        train_cmd(run_dir, procs, *extra), cwd=ROOT, env=train_env(devices, marker, faults),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def logged_losses(run_dir: Path) -> dict[int, float]:
    """Each logged step's loss in run_dir/metrics.jsonl, by step."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Return once run_dir/metrics.jsonl logs `step` or later; fail if `proc` ends first or time
    runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and max(logged_losses(run_dir), default=0) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"step {step} never logged")
