"""scripts/run_distributed.py: real local multi-process training on CPU (gloo), supervision, bad flags.

pytest tests/test_launch.py       # about 1.5 minutes on 2 cores
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
from processes import clean_env, env_of, processes_marked, reaped, wait_for_training

from jaxtrain.launch.cli import build_parser
from jaxtrain.launch.local import free_port, plan_manual

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = [sys.executable, "scripts/run_distributed.py"]
TINY = ["--config", "configs/tiny.yaml", "--total_steps", "10", "--eval_interval", "0"]


def launch(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    return subprocess.run(
        LAUNCHER + args, cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout
    )


def losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    assert len({r["step"] for r in train}) == len(train), "a step logged twice: more than one writer"
    return {r["step"]: r["loss"] for r in train}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("p1") / "run"
    done = launch(["--mode", "manual", "--world-size", "1", "--", *TINY, "--run_dir", str(run_dir)])
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one(one_process, tmp_path):
    run_dir = tmp_path / "run"
    done = launch(["--mode", "manual", "--world-size", "2", "--", *TINY, "--run_dir", str(run_dir)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(run_dir) == pytest.approx(one_process, abs=1e-4)
    # rank 1 speaks through its prefix only (warnings), never the metric lines
    rank1 = [x for x in done.stderr.splitlines() if x.startswith("[rank 1] ")]
    assert not any("| loss" in x for x in rank1)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_processes_match_one_and_only_process_0_reports(one_process, tmp_path):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    done = launch(
        ["--mode", "manual", "--world-size", "4", "--log-dir", str(logs), "--"]
        + [
            *TINY,
            "--run_dir",
            str(run_dir),
            "--progress_bar",
            "true",
            "--use_wandb",
            "--wandb_mode",
            "offline",
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(run_dir) == pytest.approx(one_process, abs=1e-4)
    terminal = done.stdout + done.stderr
    assert "10/10" in terminal and "| loss" in terminal  # progress bar and metric lines from rank 0
    assert sorted(p.name for p in logs.iterdir()) == ["rank_1.log", "rank_2.log", "rank_3.log"]
    for log in logs.iterdir():
        text = log.read_text()
        assert "it/s" not in text and "| loss" not in text and "distributed:" not in text, log
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["kill -9 a worker", "Ctrl-C the launcher"])
def test_a_failure_stops_every_process(how, tmp_path):
    marker = f"JAXTRAIN_TEST_MARK={uuid.uuid4().hex}"
    key, value = marker.split("=")
    run_dir = tmp_path / "run"
    args = ["--mode", "manual", "--world-size", "2", "--log-dir", str(tmp_path / "logs"), "--"]
    args += [*TINY, "--total_steps", "100000", "--log_interval", "1", "--run_dir", str(run_dir)]
    launcher = subprocess.Popen(
        LAUNCHER + args,
        cwd=REPO,
        env=clean_env(**{key: value}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    with reaped(launcher, marker):
        wait_for_training(run_dir, launcher)
        workers = [p for p in processes_marked(marker) if env_of(p).get("JAX_PROCESS_ID") == "1"]
        assert len(workers) == 1
        t0 = time.monotonic()
        if how == "kill -9 a worker":
            os.kill(workers[0], signal.SIGKILL)
        else:
            launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    if how == "kill -9 a worker":
        assert launcher.returncode == 128 + signal.SIGKILL, err.decode()[-3000:]
        assert f"error: rank 1 (pid {workers[0]}) was killed by SIGKILL" in err.decode()
    else:
        # Its stderr on failure: once in CI (the machine loaded) the launcher ended 1, not 130.
        assert launcher.returncode == 128 + signal.SIGINT, err.decode()[-3000:]
        # Every rank saved the same step first, as on SIGTERM.
        saving = r"^\S+ WARNING stop signal \(SIGTERM\): saving step (\d+)$"
        said = [
            re.findall(saving, text, re.M)
            for text in (out.decode(), (tmp_path / "logs/rank_1.log").read_text())
        ]
        assert len(said[0]) == 1 and said[0] == said[1], (said, err.decode()[-3000:])
        assert (run_dir / "checkpoints" / said[0][0] / "checksums.json").is_file()
    time.sleep(0.5)
    assert processes_marked(marker) == [], "processes left behind"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_preemption_of_one_rank_stops_all_at_one_step_and_exits_75(tmp_path):
    """SIGUSR1 to one rank: every rank saves the same step and exits 75, and so does the launcher."""
    marker = f"JAXTRAIN_TEST_MARK={uuid.uuid4().hex}"
    key, value = marker.split("=")
    run_dir = tmp_path / "run"
    args = ["--mode", "manual", "--world-size", "2", "--", *TINY, "--total_steps", "100000"]
    args += ["--checkpoint_interval", "100000", "--preemption_check_interval", "2", "--log_interval", "1"]
    launcher = subprocess.Popen(
        LAUNCHER + [*args, "--run_dir", str(run_dir)],
        cwd=REPO, env=clean_env(**{key: value}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with reaped(launcher, marker):
        wait_for_training(run_dir, launcher)
        rank1 = [p for p in processes_marked(marker) if env_of(p).get("JAX_PROCESS_ID") == "1"]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGUSR1)
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 75, err[-3000:]
    said = {
        "0": re.findall(r"^\S+ WARNING stop signal \(on another process\): saving step (\d+)$", out, re.M),
        "1": re.findall(r"^\[rank 1\] \S+ WARNING stop signal \(SIGUSR1\): saving step (\d+)$", err, re.M),
    }
    assert len(said["0"]) == len(said["1"]) == 1 and said["0"] == said["1"], (said, err[-3000:])
    step = int(said["0"][0])
    assert step % 2 == 0 and (run_dir / "checkpoints" / str(step)).is_dir()
    assert f"pre-empted: checkpoint {run_dir}/checkpoints/{step} saved; relaunch to resume" in err  # rank 0
    both = r"^jaxtrain launch: rank \d \(pid \d+\) exited with code 75 .*; rank \d exited with code 75$"
    assert re.search(both, err, re.M), err[-3000:]  # no rank aborted when the coordinator left
    assert max(losses(run_dir)) == step  # logged up to the saved step


@pytest.mark.parametrize(
    "argv, visible, ranks, gpu_sets",
    [
        (["--world-size", "2"], "4,5,6,7", (0, 1), ("4,5", "6,7")),
        (["--world-size", "4"], "0,1,2,3", (0, 1, 2, 3), ("0", "1", "2", "3")),
        (
            ["--world-size", "8", "--node-rank", "1", "--nproc-per-node", "4"],
            "0,1,2,3",
            (4, 5, 6, 7),
            ("0", "1", "2", "3"),
        ),
        (["--world-size", "2", "--rank", "1"], "0,1", (1,), None),  # one process keeps every GPU
        (["--world-size", "2"], "", (0, 1), None),  # CPU
    ],
)
def test_local_gpus_are_split_between_local_processes(argv, visible, ranks, gpu_sets):
    args = build_parser().parse_args(["--mode", "manual", "--coordinator", "h:1", *argv])
    plan = plan_manual(args, {"CUDA_VISIBLE_DEVICES": visible})
    assert (plan.ranks, plan.gpu_sets) == (ranks, gpu_sets)


STAND_IN = """
from jaxtrain.config import DistConfig
from jaxtrain.cluster.join import initialize
spec = initialize(DistConfig(init_timeout=60))
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
total = multihost_utils.process_allgather(jnp.array([jax.process_index() + 1])).sum()
print(f"stand-in process {jax.process_index()}/{jax.process_count()} sum={int(total)}", flush=True)
"""


@pytest.mark.multiprocess
def test_node_ranks_split_one_job_between_two_launchers(tmp_path):
    """Two "hosts" of 2 processes each: --node-rank K --nproc-per-node 2 --world-size 4."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    coordinator = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            LAUNCHER
            + ["--mode", "manual", "--world-size", "4", "--node-rank", str(k), "--nproc-per-node", "2"]
            + ["--coordinator", coordinator, "--script", str(script)],
            cwd=REPO,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k in (0, 1)
    ]
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "stand-in process 0/4 sum=10" in outs[0][0]
    assert "stand-in process 2/4 sum=10" in outs[1][0]  # first local rank talks to the terminal
    assert "[rank 3] stand-in process 3/4 sum=10" in outs[1][1]


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--mode", "manual"], {}, "--mode manual needs --world-size N"),
        (["--mode", "manual", "--world-size", "0"], {}, "--world-size must be >= 1, got 0"),
        (
            ["--mode", "manual", "--world-size", "2", "--rank", "2", "--coordinator", "h:1"],
            {},
            "out of range",
        ),
        (["--mode", "manual", "--world-size", "2", "--rank", "1"], {}, "give --coordinator HOST:PORT"),
        (["--mode", "manual", "--world-size", "2", "--coordinator", "h"], {}, "'h' is not HOST:PORT"),
        (["--mode", "manual", "--world-size", "2", "--coordinator", "h:0"], {}, "'h:0' is not HOST:PORT"),
        (
            ["--mode", "manual", "--world-size", "2", "--node-rank", "1", "--nproc-per-node", "2"],
            {},
            "beyond",
        ),
        (["--mode", "manual", "--world-size", "2", "--script", "nope.py"], {}, "--script nope.py not found"),
        (["--mode", "manual", "--world-size", "x"], {}, "invalid int value: 'x'"),
        (["--mode", "bogus"], {}, "invalid choice: 'bogus'"),
        (["--mode", "manual", "--world-size", "2", "--port", "70000"], {}, "--port must be in 1..65535"),
        (
            ["--mode", "manual", "--world-size", "1", "--python", "/nonexistent/python"],
            {},
            "cannot start rank 0",
        ),
        (
            ["--mode", "manual", "--world-size", "2"],
            {"JAX_PLATFORMS": "", "CUDA_VISIBLE_DEVICES": "0,1,2"},
            "3 GPUs",
        ),
        (["--mode", "slurm"], {"PATH": "/nonexistent"}, "sbatch not found"),
        (["--mode", "create_slurm", "--time", "forever"], {}, "--time 'forever' is not a SLURM time"),
        (["--mode", "create_slurm", "--task-per-gpu"], {}, "--task-per-gpu needs --gpus-per-node"),
        (["--mode", "create_slurm", "--env", "NOVALUE"], {}, "--env 'NOVALUE' is not KEY=VALUE"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(args, env, message, tmp_path):
    args = [*args, "--sbatch-script", str(tmp_path / "job.sh")] if "create_slurm" in args else args
    done = launch(args, clean_env(**env), timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert message in done.stderr


def test_create_slurm_writes_a_runnable_sbatch_file(tmp_path):
    path = tmp_path / "job.sh"
    done = launch(
        [
            "--mode",
            "create_slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--task-per-gpu",
            "--cpus-per-task",
            "4",
        ]
        + ["--partition", "gpu", "--account", "lm", "--time", "04:00:00", "--env", "NCCL_DEBUG=WARN"]
        + ["--output", str(tmp_path / "logs/%x-%j.out"), "--sbatch-script", str(path), "--"]
        + ["--config", "configs/tiny.yaml", "--run_dir", "runs/a b"],
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    text = path.read_text()
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lm",
        "#SBATCH --time=04:00:00",
        f"#SBATCH --chdir={REPO}",
        f"#SBATCH --output={tmp_path}/logs/%x-%j.out",
        "#SBATCH --signal=B:USR1@90",
        "#SBATCH --requeue",
        "export NCCL_DEBUG=WARN",
        "srun --kill-on-bad-exit=1 .venv/bin/python scripts/train.py --config configs/tiny.yaml "
        "--run_dir 'runs/a b' &",
    ]:
        assert line in text.splitlines(), line
    assert (tmp_path / "logs").is_dir()  # SLURM does not create the log directory itself
    assert os.access(path, os.X_OK)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_committed_example_is_what_create_slurm_makes(tmp_path):
    example = REPO / "slurm_scripts/run_slurm.sh"
    invocation = next(x for x in example.read_text().splitlines() if x.startswith("# Made by: "))
    argv = invocation.removeprefix("# Made by: python scripts/run_distributed.py ").split()
    i = argv.index("--sbatch-script")
    argv[i + 1] = str(tmp_path / "again.sh")
    assert launch(argv, timeout=60).returncode == 0
    again = (
        (tmp_path / "again.sh").read_text().replace(str(tmp_path / "again.sh"), "slurm_scripts/run_slurm.sh")
    )
    assert again == example.read_text()


def test_quick_start_menu_prints_commands_that_name_real_files():
    listed = subprocess.run(
        ["bash", "scripts/quick_start_examples.sh", "--list"], cwd=REPO, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    commands = [x.strip() for x in listed.stdout.splitlines() if x.startswith("    ")]
    assert len(commands) == 11
    for path in {
        w
        for c in commands
        for w in c.replace("'", " ").replace(";", " ").split()
        if w.startswith(("scripts/", "configs/"))
    }:
        assert (REPO / path).exists() or path.endswith("my_job.sh"), path
    menu = subprocess.run(
        ["bash", "scripts/quick_start_examples.sh"],
        cwd=REPO,
        input="1\nn\nq\n",
        capture_output=True,
        text=True,
    )
    assert menu.returncode == 0 and "scripts/train.py --config configs/tiny.yaml" in menu.stdout


# Stand-ins for ranks under jaxtrain.launch.supervise itself (no jax): argv[1] a shared folder.
_STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
_EXIT_AFTER = "import sys, time; time.sleep(0.5); sys.exit(int(sys.argv[1]))"


def _supervised(commands: list[str], grace: float, *args: str) -> tuple[int, float]:
    from jaxtrain.launch.supervise import Spec, supervise

    specs = [Spec(f"rank {r}", [sys.executable, "-c", c, *args]) for r, c in enumerate(commands)]
    t0 = time.monotonic()
    return supervise(specs, grace), time.monotonic() - t0


def test_after_a_crash_the_others_are_stopped_without_waiting_out_the_grace():
    """A rank that ignores SIGTERM (as one blocked on a dead peer does): killed 2 s after the
    crash, not after the 30 s grace, which only a pre-emption (exit 75) waits out."""
    code, seconds = _supervised([_STUBBORN, _EXIT_AFTER], 30, "3")
    assert code == 3 and seconds < 10, (code, seconds)
    code, seconds = _supervised([_STUBBORN, _EXIT_AFTER], 4, "75")
    assert code == 75 and seconds >= 4, (code, seconds)


def test_a_rank_killed_by_a_signal_is_named_before_the_peer_that_failed_after_it(tmp_path, capfd):
    """Rank 0 exits 1 (as a peer's collective fails); rank 1, SIGKILLed at that moment, reports
    after it. The verdict names rank 1 and returns its status; it is the launcher's last line."""
    failed = repr(str(tmp_path / "failed"))
    first = f"import pathlib, sys; pathlib.Path({failed}).touch(); sys.exit(1)"
    then = (
        "import os, pathlib, signal, time; print('rank 1 up', flush=True)\n"
        f"while not pathlib.Path({failed}).exists(): time.sleep(0.01)\n"
        "time.sleep(0.05); os.kill(os.getpid(), signal.SIGKILL)"
    )
    code, _ = _supervised([first, then], 10)
    err = capfd.readouterr().err
    assert code == 128 + signal.SIGKILL, err
    assert "[rank 1] rank 1 up" in err
    assert err.strip().splitlines()[-1].startswith("error: rank 1 (pid "), err
    assert "was killed by SIGKILL; rank 0 exited with code 1" in err, err
