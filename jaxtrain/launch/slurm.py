"""Run a script under SLURM: srun inside an allocation, or an sbatch file written and submitted.

The SLURM half of scripts/run_distributed.py (--mode slurm, --mode create_slurm; its command line
is jaxtrain/launch/cli.py); every process is started by srun and finds its place in the job from
srun's variables (jaxtrain/cluster/detect.py).
The sbatch file asks for USR1 before the time limit and requeues itself; training saves a
checkpoint on the SIGTERM that follows, exits 75, and the requeued job resumes from it.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from jaxtrain.cluster.lifeline import die_with_parent
from jaxtrain.errors import EXIT_PREEMPTED, ArgumentError, UserError

DEFAULT_SBATCH = "slurm_scripts/run_slurm.sh"
DEFAULT_OUTPUT = "slurm_scripts/logs/%x-%j.out"


def _layout(args: argparse.Namespace) -> dict[str, str]:
    """sbatch/srun layout options (name -> value) from the launcher flags."""
    layout: dict[str, str] = {}
    if args.nodes is not None:
        if args.nodes < 1:
            raise ArgumentError(f"--nodes must be >= 1, got {args.nodes}")
        layout["nodes"] = str(args.nodes)
    if args.gpus_per_node < 0:
        raise ArgumentError(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}")
    if args.task_per_gpu:
        if args.gpus_per_node < 1:
            raise ArgumentError("--task-per-gpu needs --gpus-per-node G (G >= 1)")
        if args.ntasks_per_node not in (None, args.gpus_per_node):
            raise ArgumentError("--task-per-gpu sets --ntasks-per-node to --gpus-per-node; give one of them")
        # SLURM binds one GPU to each task, so each process sees only its own.
        layout["ntasks-per-node"] = str(args.gpus_per_node)
        layout["gpus-per-task"] = "1"
    else:
        if args.ntasks_per_node is not None:
            if args.ntasks_per_node < 1:
                raise ArgumentError(f"--ntasks-per-node must be >= 1, got {args.ntasks_per_node}")
            layout["ntasks-per-node"] = str(args.ntasks_per_node)
        if args.gpus_per_node:
            layout["gpus-per-node"] = str(args.gpus_per_node)
    if args.cpus_per_task is not None:
        layout["cpus-per-task"] = str(args.cpus_per_task)
    return layout


def _script_path(args: argparse.Namespace, workdir: Path) -> str:
    script = Path(args.script)
    if not (script if script.is_absolute() else workdir / script).is_file():
        raise ArgumentError(f"--script {args.script} not found under {workdir}; pass an existing script")
    return args.script


def _env_pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    pairs = []
    for item in args.env:
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ArgumentError(f"--env {item!r} is not KEY=VALUE")
        pairs.append((key, value))
    return pairs


def _relative_to(path: str, base: Path) -> str:
    """`path` relative to `base` when inside it, so the script keeps working if the tree moves."""
    p = Path(path)
    if p.is_absolute():
        try:
            return str(p.relative_to(base.resolve()))
        except ValueError:
            return path
    return path


def sbatch_script(args: argparse.Namespace, script_args: list[str], invocation: str) -> str:
    """The text of an sbatch file that runs the script through srun, with requeue near the limit."""
    if not re.fullmatch(r"(\d+-)?\d{1,3}(:\d{2}){0,2}", args.time):
        raise ArgumentError(f"--time {args.time!r} is not a SLURM time; write e.g. 04:00:00 or 1-00:00:00")
    workdir = Path(args.workdir)
    script = _script_path(args, workdir)
    python = _relative_to(args.python, workdir)
    lines = _preamble(args, invocation, script)
    # No supervisor of ours here (jaxtrain/launch/supervise.py): srun --kill-on-bad-exit=1 applies
    # the same rule itself, a task that fails ends every other. The shell below only passes USR1
    # on and requeues; its loop re-enters a `wait` that a trapped signal ended early, it does not
    # watch the tasks.
    command = shlex.join(["srun", "--kill-on-bad-exit=1", python, script, *script_args])
    if not args.signal_seconds:
        return "\n".join(lines + [command, ""])
    return "\n".join(lines + _requeued(args, command))


def _preamble(args: argparse.Namespace, invocation: str, script: str) -> list[str]:
    """The sbatch file's lines before the srun: its #SBATCH options, environment and checks."""
    sbatch = {"job-name": args.job_name, "nodes": "1", **_layout(args), "time": args.time}
    for key in ("partition", "account"):
        if getattr(args, key):
            sbatch[key] = getattr(args, key)
    sbatch.update({"chdir": args.workdir, "output": args.output, "open-mode": "append"})
    lines = [
        "#!/bin/bash",
        "# Train jaxtrain under SLURM, every process started by srun. Submit with:",
        f"#     sbatch {args.sbatch_script}",
        f"# Made by: {invocation}",
        *(f"#SBATCH --{k}={v}" for k, v in sbatch.items()),
    ]
    if args.signal_seconds:
        lines += [f"#SBATCH --signal=B:USR1@{args.signal_seconds}", "#SBATCH --requeue"]
    lines += ["set -euo pipefail", ""]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in _env_pairs(args)]
    return lines + [
        f'if [[ ! -f {shlex.quote(script)} ]]; then echo "error: {script} not found in $PWD" >&2; exit 2; fi',
        'echo "jaxtrain: job ${SLURM_JOB_ID} on ${SLURM_JOB_NODELIST}, $(date)"',
    ]


def _requeued(args: argparse.Namespace, command: str) -> list[str]:
    """The srun `command` in the background, USR1 passed on to it, and the job requeued after a save."""
    return [
        "",
        f"# SLURM sends USR1 {args.signal_seconds} s before the time limit. Pass it to every task: they",
        "# agree on a step, save a checkpoint there and exit 75; then the job requeues itself and the",
        "# next start resumes. This gives the save the whole warning time. SLURM pre-emption and",
        "# `scontrol requeue` send SIGTERM instead, which saves the same way but must finish within",
        "# KillWait seconds (scontrol show config | grep KillWait; default 30) before SIGKILL.",
        "asked=0",
        'trap \'asked=1; echo "jaxtrain: time limit near, asking the tasks to save"; '
        'scancel --signal=USR1 "${SLURM_JOB_ID}"\' USR1',
        f"{command} &",
        "srun_pid=$!",
        "# A trapped signal ends `wait` early; keep waiting until srun itself has finished.",
        "while true; do",
        '    rc=0; wait "$srun_pid" || rc=$?',
        '    kill -0 "$srun_pid" 2>/dev/null || break',
        "done",
        "# Requeue after a save (exit 75), or near the limit even if a task died on the way out.",
        f"if [[ $rc -eq {EXIT_PREEMPTED} || $asked -eq 1 ]]; then",
        '    echo "jaxtrain: pre-empted, requeueing job ${SLURM_JOB_ID}"',
        '    scontrol requeue "${SLURM_JOB_ID}" || true  # already requeued when SLURM pre-empted it',
        "fi",
        'exit "$rc"',
        "",
    ]


def write_sbatch(args: argparse.Namespace, script_args: list[str], path: Path, invocation: str) -> Path:
    """Write the sbatch file (and make its log directory, which SLURM will not create)."""
    text = sbatch_script(args, script_args, invocation)
    log_dir = (Path(args.workdir) / args.output).parent
    log_dir.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def run_srun(args: argparse.Namespace, script_args: list[str], environ: dict[str, str]) -> int:
    """Inside an allocation: run the script with srun, one task per node or per GPU."""
    if not shutil.which("srun"):
        raise UserError("srun not found although SLURM_JOB_ID is set; put SLURM's bin directory on PATH")
    layout = _layout(args)
    if args.task_per_gpu and "gpus-per-task" in layout and environ.get("SLURM_GPUS_ON_NODE"):
        layout["ntasks-per-node"] = environ["SLURM_GPUS_ON_NODE"]
    script = _script_path(args, Path.cwd())
    command = ["srun", "--kill-on-bad-exit=1", *(f"--{k}={v}" for k, v in layout.items())]
    command += [args.python, script, *script_args]
    print(f"jaxtrain launch: {shlex.join(command)}", file=sys.stderr, flush=True)
    # srun shares our process group, so it gets Ctrl-C itself and handles it its way (twice within
    # a second: passed on to the tasks). SIGTERM ends the step (the tasks get SIGTERM and save
    # first): we pass ours and SIGHUP on, and the kernel sends it to srun if we die, kill -9 too;
    # SLURM itself leaves the tasks of a killed srun running until the allocation ends.
    srun = subprocess.Popen(
        command, preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM)
    )

    def stop(_signum: int, _frame: object) -> None:
        srun.send_signal(signal.SIGTERM)

    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    before[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return srun.wait()
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _job_state(job_id: str) -> tuple[str, str]:
    """(state, exit code) of a job from scontrol, ('', '') once SLURM has forgotten it."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"\bExitCode=(\d+):(\d+)", out)
    return (state[1] if state else "", code[1] if code else "")


def follow(job_id: str, log: Path) -> int:
    """Print the job's log as it grows until the job ends; returns the job's exit code."""
    printed = 0
    while True:
        state, code = _job_state(job_id)
        if log.exists():
            data = log.read_bytes()
            sys.stdout.buffer.write(data[printed:])
            sys.stdout.flush()
            printed = len(data)
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
            print(f"jaxtrain launch: job {job_id} {state}", file=sys.stderr, flush=True)
            if state == "COMPLETED":
                return 0
            return int(code) if code and int(code) else 1
        if not state:
            return 0 if printed else 1
        time.sleep(1)


def submit(args: argparse.Namespace, script_args: list[str], invocation: str) -> int:
    """Outside an allocation: write an sbatch file, submit it, print the job id."""
    if not shutil.which("sbatch"):
        raise UserError(
            "sbatch not found: --mode slurm needs a SLURM cluster; on one machine use "
            "--mode manual --world-size N"
        )
    path = (
        Path(args.workdir) / "slurm_scripts" / "logs" / f"{args.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sh"
    )
    write_sbatch(args, script_args, path, invocation)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"sbatch refused {path}: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    log = Path(args.workdir) / args.output.replace("%x", args.job_name).replace("%j", job_id)
    print(f"submitted batch job {job_id} ({path}); log {log}", flush=True)
    return follow(job_id, log) if args.follow else 0
