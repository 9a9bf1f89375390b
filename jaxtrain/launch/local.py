"""Start a training script as several processes: locally, one rank of a multi-host job, or SLURM.

The logic behind scripts/run_distributed.py: its command line, and --mode manual, whose processes
are started and supervised here (--mode slurm and create_slurm: jaxtrain/slurm.py). The children
find their place in the job through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
(see jaxtrain/cluster/detect.py) or, under SLURM, through srun's own variables.
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from jaxtrain.cluster.detect import split_address
from jaxtrain.errors import EXIT_PREEMPTED, ArgumentError, UserError
from jaxtrain.launch import slurm

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SCRIPT = "scripts/train.py"
_SETTLE_S = 1.0  # after a first failure, how long the others get to report theirs


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input
        raise ArgumentError(f"{message}; see {self.prog} --help")


def build_parser() -> argparse.ArgumentParser:
    """The run_distributed.py command line; everything after `--` goes to the script."""
    p = _Parser(prog="scripts/run_distributed.py", description=__doc__)
    p.add_argument("--mode", choices=("manual", "slurm", "create_slurm"), required=True)
    p.add_argument("--script", default=DEFAULT_SCRIPT, help="script to run (default scripts/train.py)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the script")
    m = p.add_argument_group("manual")
    m.add_argument("--world-size", type=int, help="total processes in the job")
    m.add_argument("--rank", type=int, help="run only this rank (multi-host, one process here)")
    m.add_argument("--node-rank", type=int, help="run ranks node_rank*P .. node_rank*P+P-1 here")
    m.add_argument("--nproc-per-node", type=int, help="P: processes on this machine")
    m.add_argument("--coordinator", help="HOST:PORT of rank 0 (default 127.0.0.1:<free port>)")
    m.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 when every rank is local")
    m.add_argument("--log-dir", help="write rank>0 output to DIR/rank_<r>.log instead of the terminal")
    m.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    s = p.add_argument_group("slurm, create_slurm")
    s.add_argument("--nodes", type=int, help="nodes (default 1, or the allocation's)")
    s.add_argument("--ntasks-per-node", type=int, help="processes per node (default 1: all its GPUs)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU job)")
    s.add_argument("--task-per-gpu", action="store_true", help="one process per GPU instead of per node")
    s.add_argument("--cpus-per-task", type=int, help="CPUs for each process")
    s.add_argument("--time", default="01:00:00", help="time limit, HH:MM:SS")
    s.add_argument("--partition", help="SLURM partition")
    s.add_argument("--account", help="SLURM account")
    s.add_argument("--job-name", default="jaxtrain")
    s.add_argument("--output", default=slurm.DEFAULT_OUTPUT, help="job log (%%x name, %%j job id)")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="export in the job")
    s.add_argument("--signal-seconds", type=int, default=90, help="requeue this long before the limit")
    s.add_argument("--workdir", default=str(REPO), help="directory the job runs in")
    s.add_argument("--sbatch-script", default=slurm.DEFAULT_SBATCH, help="file create_slurm writes")
    s.add_argument("--follow", action="store_true", help="after sbatch, print the job log until it ends")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split launcher flags from the script's arguments at the first `--`."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return build_parser().parse_args(argv[:cut]), argv[cut + 1 :]


# ---------------------------------------------------------------- manual: local processes


@dataclass(frozen=True)
class LocalPlan:
    world_size: int
    ranks: tuple[int, ...]
    coordinator: str
    gpu_sets: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES per local process, None: leave as is


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def local_gpus(environ: dict[str, str]) -> list[str]:
    """GPU ids this machine offers: CUDA_VISIBLE_DEVICES, else nvidia-smi; [] on CPU."""
    if environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return []
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True
    )
    return out.stdout.split() if out.returncode == 0 else []


def plan_manual(args: argparse.Namespace, environ: dict[str, str]) -> LocalPlan:
    """Which ranks run here, the coordinator, and each process's GPUs; UserError if inconsistent."""
    n = args.world_size
    if n is None:
        raise ArgumentError("--mode manual needs --world-size N (total processes in the job)")
    if n < 1:
        raise ArgumentError(f"--world-size must be >= 1, got {n}")
    if args.rank is not None and args.node_rank is not None:
        raise ArgumentError("give --rank R (one process) or --node-rank K (P processes), not both")
    if args.rank is not None:
        if not 0 <= args.rank < n:
            raise ArgumentError(f"--rank {args.rank} is out of range for --world-size {n}; use 0..{n - 1}")
        ranks = (args.rank,)
    else:
        per_node = args.nproc_per_node or (n if args.node_rank is None else 1)
        node = args.node_rank or 0
        if per_node < 1 or node < 0:
            raise ArgumentError("--nproc-per-node must be >= 1 and --node-rank >= 0")
        if (node + 1) * per_node > n:
            raise ArgumentError(
                f"--node-rank {node} x --nproc-per-node {per_node} needs ranks up to "
                f"{(node + 1) * per_node - 1}, beyond --world-size {n}"
            )
        ranks = tuple(range(node * per_node, (node + 1) * per_node))
    everything_here = len(ranks) == n
    if args.coordinator and args.port:
        raise ArgumentError("give --coordinator HOST:PORT or --port PORT, not both")
    if args.port is not None and not 0 < args.port < 65536:
        raise ArgumentError(f"--port must be in 1..65535, got {args.port}")
    if args.coordinator:
        split_address(args.coordinator)
        coordinator = args.coordinator
    elif everything_here:
        coordinator = f"127.0.0.1:{args.port or free_port()}"
    else:
        raise ArgumentError(
            f"this machine runs ranks {ranks[0]}..{ranks[-1]} of {n}: give --coordinator HOST:PORT "
            "(rank 0's address, reachable from every host)"
        )
    gpus = local_gpus(environ)
    gpu_sets = None
    if gpus and len(ranks) > 1:
        if len(gpus) % len(ranks):
            raise ArgumentError(
                f"{len(gpus)} GPUs ({','.join(gpus)}) cannot be split evenly between {len(ranks)} local "
                "processes; use a process count that divides the GPU count"
            )
        k = len(gpus) // len(ranks)
        gpu_sets = tuple(",".join(gpus[i * k : (i + 1) * k]) for i in range(len(ranks)))
    return LocalPlan(n, ranks, coordinator, gpu_sets)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    """A child's return code as a shell exit status: 128+N for death by signal N."""
    return 128 - code if code < 0 else code


def _pump(stream: IO[bytes], prefix: bytes, sink: IO[bytes]) -> None:
    """Copy a child's output to `sink`, each line tagged with its rank."""
    for line in iter(stream.readline, b""):
        sink.write(prefix + line)
        sink.flush()


def _reap(rank: int, p: subprocess.Popen, ended: queue.Queue[int]) -> None:
    """Wait for one child; `ended` receives the ranks in the order their processes ended."""
    p.wait()
    ended.put(rank)


class _Stop(Exception):
    """The launcher itself was asked to stop (Ctrl-C, SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signum)


def _stop_all(procs: dict[int, subprocess.Popen], grace: float) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after `grace` seconds.

    JAX processes ignore SIGTERM (its preemption notifier takes it), so the SIGKILL is what
    usually ends them; a second Ctrl-C skips the rest of the grace period.
    """
    hurry = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *_: hurry.set())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)  # the group: also the child's own helpers
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if hurry.wait(0.1):
                break
    for p in procs.values():
        p.wait()


def _first_failure(
    plan: LocalPlan, procs: dict[int, subprocess.Popen], ended: list[int], log_dir: str | None
) -> int:
    """Report the first rank that failed (and the others that did), stop the rest; its exit status.

    The first to end is the cause: peers of a killed, crashed or pre-empted process fail right
    after it, often by signal (JAX aborts a process whose coordinator went away).
    """
    failed = [r for r in ended if procs[r].returncode != 0]
    rank, code = failed[0], procs[failed[0]].returncode
    what = f"rank {rank} (pid {procs[rank].pid}) {_describe_exit(code)}"
    if code == EXIT_PREEMPTED:
        what = f"jaxtrain launch: {what} (pre-empted: checkpoint saved, relaunch to resume)"
    else:
        what = f"error: {what}"
    if log_dir and rank != plan.ranks[0]:
        what += f" (log {Path(log_dir) / f'rank_{rank}.log'})"
    what += "".join(f"; rank {r} {_describe_exit(procs[r].returncode)}" for r in failed[1:])
    running = sum(p.poll() is None for p in procs.values())
    if running:
        what += f"; stopping the other {running} process(es)"
    print(what, file=sys.stderr, flush=True)
    return exit_status(code)


def run_local(plan: LocalPlan, command: list[str], log_dir: str | None, grace: float) -> int:
    """Start one child per local rank and supervise them; returns the launcher's exit code.

    0 when every rank finished; else the first failing rank's own exit status (75 pre-empted,
    128+N for death by signal N); 128+N when the launcher itself got signal N.
    """
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    procs: dict[int, subprocess.Popen] = {}
    pumps: list[threading.Thread] = []
    files: list[IO[bytes]] = []
    ended: queue.Queue[int] = queue.Queue()
    handlers = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for i, rank in enumerate(plan.ranks):
            env = dict(os.environ)
            env.update(
                JAX_COORDINATOR_ADDRESS=plan.coordinator,
                JAX_NUM_PROCESSES=str(plan.world_size),
                JAX_PROCESS_ID=str(rank),
                PYTHONUNBUFFERED="1",
            )
            if plan.gpu_sets:
                env["CUDA_VISIBLE_DEVICES"] = plan.gpu_sets[i]
            # The first local process talks to the terminal (its stdout and stderr are ours), the
            # others to a log file each, or prefixed to our stderr.
            out: IO[bytes] | int | None = None
            err: int | None = None
            if i > 0:
                err = subprocess.STDOUT
                if log_dir:
                    out = open(Path(log_dir) / f"rank_{rank}.log", "wb")  # noqa: SIM115 (closed below)
                    files.append(out)
                else:
                    out = subprocess.PIPE
            # Own session: Ctrl-C reaches only the launcher, which stops the children in order.
            try:
                p = subprocess.Popen(
                    command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
                )
            except OSError as e:
                _stop_all(procs, grace)
                raise UserError(f"cannot start rank {rank}: {shlex.join(command)}: {e.strerror}") from None
            procs[rank] = p
            threading.Thread(target=_reap, args=(rank, p, ended), daemon=True).start()
            if out is subprocess.PIPE:
                t = threading.Thread(
                    target=_pump, args=(p.stdout, f"[rank {rank}] ".encode(), sys.stderr.buffer)
                )
                t.start()
                pumps.append(t)
        print(
            f"jaxtrain launch: ranks {plan.ranks[0]}..{plan.ranks[-1]} of {plan.world_size}, coordinator "
            f"{plan.coordinator}" + (f", rank logs in {log_dir}" if log_dir and len(plan.ranks) > 1 else ""),
            file=sys.stderr,
            flush=True,
        )
        order: list[int] = []
        while len(order) < len(procs):
            try:
                order.append(ended.get(timeout=0.5))
            except queue.Empty:
                continue
            if procs[order[-1]].returncode != 0:
                deadline = time.monotonic() + _SETTLE_S  # let the others report theirs
                while len(order) < len(procs) and (left := deadline - time.monotonic()) > 0:
                    try:
                        order.append(ended.get(timeout=left))
                    except queue.Empty:
                        break
                code = _first_failure(plan, procs, order, log_dir)
                _stop_all(procs, grace)
                return code
        return 0
    except _Stop as stop:
        print(f"jaxtrain launch: got {signal.Signals(stop.signum).name}, stopping all ranks", file=sys.stderr)
        _stop_all(procs, grace)
        return 128 + stop.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=5)
        for f in files:
            f.close()


def main(argv: list[str]) -> int:
    """run_distributed.py: parse, plan, launch; returns the exit code."""
    args, script_args = parse_args(argv)
    invocation = shlex.join(["python", "scripts/run_distributed.py", *argv])
    if args.mode == "create_slurm":
        path = slurm.write_sbatch(args, script_args, Path(args.sbatch_script), invocation)
        print(f"wrote {path}; submit it with: sbatch {path}")
        return 0
    if args.mode == "slurm":
        if "SLURM_JOB_ID" in os.environ:
            return slurm.run_srun(args, script_args, dict(os.environ))
        return slurm.submit(args, script_args, invocation)
    plan = plan_manual(args, dict(os.environ))
    if not Path(args.script).is_file():
        raise ArgumentError(f"--script {args.script} not found; pass an existing script")
    return run_local(plan, [args.python, args.script, *script_args], args.log_dir, args.grace)
