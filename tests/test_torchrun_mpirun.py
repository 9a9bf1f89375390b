"""scripts/train.py started as the PyTorch guides and MPI users start it: real torchrun, real
`python -m torch.distributed.launch`, real Open MPI mpirun, each against our own launcher.

Every run trains the same global batch (2 processes x 1 CPU device) on the same small token file,
so each one's losses must equal those of scripts/run_distributed.py --mode manual exactly.

    pytest tests/test_torchrun_mpirun.py     # about 2 minutes on 2 cores; installs openmpi-bin (root)
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from processes import clean_env

REPO = Path(__file__).resolve().parent.parent
TRAIN = "scripts/train.py"
WINDOWS, SEQ, BATCH = 40, 32, 16  # 40 windows / batch 16 = 2.5 steps per epoch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def free_port_pair() -> int:
    """A port P with P and P+1 free (torchrun's agent takes P, JAX's coordinator P+1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise AssertionError("no two free neighbouring ports")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, 256, WINDOWS * SEQ + 1, dtype=np.uint16).tofile(path)
    return path


def args(tokens: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config", "configs/tiny.yaml", "--train_data_path", str(tokens), "--eval_interval", "0",
        "--log_interval", "1", "--run_dir", str(run_dir), *extra,
    ]  # fmt: skip


def run(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=REPO, env=env or clean_env(1), capture_output=True, text=True, timeout=timeout
    )


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert len({r["step"] for r in train}) == len(train), "a step logged twice: more than one writer"
    return {r["step"]: r["loss"] for r in train}


def once(run_dir: Path, text: str) -> None:
    """`text` is said exactly once in the run's log."""
    assert (run_dir / "train.log").read_text().count(text) == 1, text


@pytest.fixture(scope="module")
def ours(tokens, tmp_path_factory) -> dict[int, float]:
    """The reference: our launcher, 2 processes, 5 steps."""
    run_dir = tmp_path_factory.mktemp("ours") / "run"
    launcher = [sys.executable, "scripts/run_distributed.py", "--mode", "manual", "--world-size", "2", "--"]
    done = run(launcher + args(tokens, run_dir, "--total_steps", "5"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(losses(run_dir)) == 5
    return losses(run_dir)


def torchrun() -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun"))]


def test_torchrun_single_node_with_the_guides_flags_matches_our_launcher(tokens, ours, tmp_path):
    run_dir, port = tmp_path / "run", free_port_pair()
    guide = ["--distributed", "--world_size", "2", "--backend", "gloo", "--num_workers", "0"]
    guide += ["--skip_invalid_loss", "--find_unused_parameters"]
    done = run(
        [*torchrun(), "--nproc_per_node=2", f"--master_port={port}", TRAIN]
        + args(tokens, run_dir, "--total_steps", "5", *guide)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(run_dir) == ours
    # JAX's coordinator sits next to the agent's store, not on it
    assert (
        f"distributed: source=torchrun_env process 0/2 local_devices=0 coordinator=127.0.0.1:{port + 1}"
        in (done.stdout)
    )
    for flag in ("--distributed", "--world_size 2", "--backend gloo", "--skip_invalid_loss"):
        once(run_dir, f"{flag}: accepted")
    once(run_dir, "--find_unused_parameters: no effect")
    assert "data_threads: 0" in (run_dir / "config.yaml").read_text()


def test_torch_distributed_launch_two_nodes_with_epochs_matches_our_launcher(tokens, ours, tmp_path):
    """Two launch agents as two nodes (--nnodes --node_rank --master_addr --master_port), the
    script given --local-rank=0 by each; --epochs 2 of 40 windows / batch 16 is 5 steps."""
    run_dir, port = tmp_path / "run", free_port_pair()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.launch",
                "--nproc_per_node=1",
                "--nnodes=2",
                f"--node_rank={k}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                TRAIN,
            ]
            + args(tokens, run_dir, "--epochs", "2", "--debug"),
            cwd=REPO,
            env=clean_env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for p, (_, err) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert losses(run_dir) == ours
    once(run_dir, "--local_rank 0: accepted")
    once(
        run_dir,
        f"--epochs 2: {WINDOWS} windows of {SEQ + 1} tokens per epoch / batch {BATCH} = total_steps 5",
    )
    once(run_dir, "step 0: epoch 0.00 of 2")
    assert "Finished XLA compilation of" in outs[0][1]  # --debug: JAX logs each compilation


def test_torchrun_says_which_port_to_pick_when_the_coordinators_is_taken(tokens, tmp_path):
    port = free_port_pair()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port + 1))
        taken.listen()
        done = run(
            [*torchrun(), "--nproc_per_node=2", f"--master_port={port}", TRAIN]
            + args(tokens, tmp_path / "run", "--total_steps", "1", "--dist.init_timeout", "30"),
            timeout=120,
        )
    assert done.returncode != 0
    assert f"JAX's coordinator takes MASTER_PORT+1 (torchrun's agent holds {port})" in done.stderr


@pytest.fixture(scope="module")
def mpirun() -> list[str]:
    if not shutil.which("mpirun"):
        assert os.geteuid() == 0 and shutil.which("apt-get"), "needs Open MPI's mpirun, or root and apt-get"
        for cmd in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "openmpi-bin"],
        ):
            done = subprocess.run(
                cmd, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr[-2000:]
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    assert "Open MPI" in version, version
    # root needs --allow-run-as-root; 2 cores may hold fewer slots than processes
    return ["mpirun", "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]


def test_mpirun_matches_our_launcher_and_only_process_0_writes(tokens, ours, mpirun, tmp_path):
    run_dir = tmp_path / "run"
    env = clean_env(1)
    forward = [x for k in ("JAX_PLATFORMS", "XLA_FLAGS", "WANDB_MODE") for x in ("-x", k)]
    done = run(
        [*mpirun, "-np", "2", *forward, sys.executable, TRAIN] + args(tokens, run_dir, "--total_steps", "5"),
        env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(run_dir) == ours
    assert done.stdout.count("distributed: source=openmpi process 0/2") == 1
