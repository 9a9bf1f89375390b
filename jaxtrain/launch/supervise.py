"""The one rule of every jaxtrain launcher: the first process to fail is the cause, the others are
stopped, and the launcher exits with its exit status.

Peers of a killed, crashed or pre-empted process fail right after it, often by signal (JAX aborts
a process whose coordinator went away), so the first to end is the one to name. Two launchers
supervise through here:
  - --mode manual of scripts/run_distributed.py (jaxtrain/launch/local.py): one process per local
    rank, each in its own session, stopped by SIGTERM then SIGKILL to its process group;
  - scripts/launch_multi_node.sh, through `python -m jaxtrain.launch.supervise --rsh RSH -- HOST
    COMMAND ...`: one remote shell per host, asked to stop by a `stop` line on its stdin (the host
    stops its processes in order) and killed by closing it (the host kills them at once; the
    script sets JAXTRAIN_STOP_ON_EOF=1 there).
The launcher's own death, even by SIGKILL, ends its processes too: a local one gets SIGKILL from
the kernel (jaxtrain/cluster/lifeline.py), a host sees its stdin close.
Under SLURM, srun --kill-on-bad-exit applies the same rule itself (jaxtrain/launch/slurm.py).
Never imports jax.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from jaxtrain.cluster.lifeline import die_with_parent
from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.errors import EXIT_PREEMPTED, ArgumentError, UserError
from jaxtrain.parser import Parser

_SETTLE_S = 1.0  # after a first failure, how long the others get to report theirs
_KILLED_DRAIN_S = 0.5  # how long the killed ones' output pumps get, together, before the verdict
# After a crash (a first failure that is not a pre-emption), what the others get of the grace: a
# checkpoint needs every process, so theirs cannot complete; they need only flush their logs.
# (They waited out the whole grace, 10 s, blocked on the dead peer.)
_CRASH_GRACE_S = 2.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Spec:
    """One process to start, and how the launcher's lines name it."""

    tag: str  # "rank 1", "node 1": its output lines are prefixed `[tag] `
    command: list[str]
    host: str | None = None  # set for a remote shell (named by its host, not its pid)
    env: dict[str, str] | None = None  # None: ours


@dataclass
class _Child:
    spec: Spec
    proc: subprocess.Popen
    log: Path | None  # where its output goes, when not to our terminal or stderr


def exit_status(code: int) -> int:
    """A child's return code as a shell exit status: 128+N for death by signal N."""
    return 128 - code if code < 0 else code


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _name(c: _Child, culprit: bool = False) -> str:
    """`node 1 (HOST)`; `rank 1`, with its pid when it is the one that failed first."""
    if c.spec.host is not None:
        return f"{c.spec.tag} ({c.spec.host})"
    return f"{c.spec.tag} (pid {c.proc.pid})" if culprit else c.spec.tag


def _pump(stream: IO[bytes], prefix: bytes, sink: IO[bytes]) -> None:
    """Copy a child's output to `sink`, each line tagged with its name."""
    for line in iter(stream.readline, b""):
        sink.write(prefix + line)
        sink.flush()


def _reap(child: _Child, ended: queue.Queue[_Child]) -> None:
    """Wait for one child; `ended` receives the children in the order their processes ended."""
    child.proc.wait()
    ended.put(child)


class _Stop(Exception):
    """The launcher itself was asked to stop (Ctrl-C, SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signum)


@contextmanager
def _ignoring(*signums: int) -> Iterator[None]:
    """Ignore `signums` meanwhile; a child started meanwhile keeps ignoring them (SIG_IGN survives exec)."""
    before = {s: signal.signal(s, signal.SIG_IGN) for s in signums}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _popen(spec: Spec, stdout: IO[bytes] | int | None, stderr: int | None) -> subprocess.Popen:
    if spec.host is None:
        # Own session: Ctrl-C reaches only the launcher, which stops the children in order. And the
        # kernel kills the child when the launcher dies, whatever kills it (a kill -9 of our process
        # group misses the child's own).
        return subprocess.Popen(
            spec.command, env=spec.env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            start_new_session=True, preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )  # fmt: skip
    # A remote shell stays in our session, as a shell script's background job would, so ssh can
    # still ask for a password on the terminal; and like one it ignores Ctrl-C, which only the
    # launcher handles: it writes `stop` to every remote shell, and each host stops its processes.
    # Its stdin closes when we die, however we die: then each host kills its processes at once.
    with _ignoring(signal.SIGINT, signal.SIGQUIT):
        return subprocess.Popen(
            spec.command, env=spec.env, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr
        )


def _stop_all(children: list[_Child], grace: float) -> None:
    """Ask every child to stop, then kill what is left after `grace` seconds.

    Asking is SIGTERM to a local child's process group (also its own helpers), or a `stop` line to
    a remote shell; a training process then saves a checkpoint at a step all processes agree on and
    exits 75. Killing is SIGKILL to the group, or closing the remote shell's stdin (its host kills
    its processes) and SIGKILL to the shell. A second Ctrl-C kills at once, skipping that save.
    """
    hurry = threading.Event()
    for s in _STOP_SIGNALS:
        signal.signal(s, lambda *_: hurry.set())
    running = [c for c in children if c.proc.poll() is None]
    for c in running:
        if c.spec.host is not None:
            assert c.proc.stdin is not None  # a remote shell is started with stdin=PIPE
            with contextlib.suppress(OSError):  # its host has ended meanwhile
                c.proc.stdin.write(b"stop\n")
                c.proc.stdin.flush()
        else:
            try:
                os.killpg(c.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    while any(c.proc.poll() is None for c in running) and time.monotonic() < deadline:
        if hurry.wait(0.1):
            print(
                "jaxtrain launch: stop signal again: killing every process now, without the "
                "checkpoint they were saving (a relaunch resumes from the last one saved)",
                file=sys.stderr,
                flush=True,
            )
            break
    late = [c for c in running if c.proc.poll() is None]
    if any(c.spec.host is not None for c in late) and not hurry.is_set():  # a host did not stop: say so
        print(
            f"jaxtrain launch: nodes still running after {grace:g} s; killing their remote shells",
            file=sys.stderr,
            flush=True,
        )
    for c in late:
        try:
            if c.spec.host is not None:
                assert c.proc.stdin is not None
                with contextlib.suppress(OSError):
                    c.proc.stdin.close()  # its host kills its processes
                os.kill(c.proc.pid, signal.SIGKILL)  # it shares our process group
            else:
                os.killpg(c.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for c in children:
        c.proc.wait()
        if c.proc.stdin is not None:
            with contextlib.suppress(OSError):
                c.proc.stdin.close()


def _first_failure(children: list[_Child], ended: list[_Child]) -> int:
    """Report the first child that failed (and the others that did); its exit status. A child
    killed by a signal (or a node whose process was: exit status 128+N) counts before one that
    exited with an error: its peers fail after it, on the collectives it left (a killed worker's
    host, reporting through its own launcher, could otherwise be beaten by its peer's exit 1)."""
    failed = [c for c in ended if c.proc.returncode != 0]
    failed.sort(key=lambda c: not (c.proc.returncode < 0 or c.proc.returncode > 128))  # stable
    first, code = failed[0], failed[0].proc.returncode
    what = f"{_name(first, culprit=True)} {_describe_exit(code)}"
    if code == EXIT_PREEMPTED:
        what = f"jaxtrain launch: {what} (pre-empted: checkpoint saved, relaunch to resume)"
    else:
        what = f"error: {what}"
    if first.log:
        what += f" (log {first.log})"
    what += "".join(f"; {_name(c)} {_describe_exit(c.proc.returncode)}" for c in failed[1:])
    running = sum(c.proc.poll() is None for c in children)
    if running:
        what += f"; stopping the other {running} process(es)"
    print(what, file=sys.stderr, flush=True)
    return exit_status(code)


def _output(
    spec: Spec, first: bool, log_dir: Path | None, files: list[IO[bytes]]
) -> tuple[IO[bytes] | int | None, int | None, Path | None]:
    """Where a child's output goes, (stdout, stderr, log file): the first's is ours; the others'
    go to their log file in `log_dir` (opened here, added to `files`), else to a pipe."""
    if first:
        return None, None, None
    if not log_dir:
        return subprocess.PIPE, subprocess.STDOUT, None
    log = log_dir / f"{spec.tag.replace(' ', '_')}.log"
    out = open(log, "wb")  # closed by supervise, once the child has ended
    files.append(out)
    return out, subprocess.STDOUT, log


def _start(
    spec: Spec,
    out: IO[bytes] | int | None,
    err: int | None,
    log: Path | None,
    children: list[_Child],
    grace: float,
) -> _Child:
    """One child started; if it cannot start, those started before it are stopped."""
    try:
        return _Child(spec, _popen(spec, out, err), log)
    except OSError as e:
        _stop_all(children, grace)
        raise UserError(f"cannot start {spec.tag}: {shlex.join(spec.command)}: {e.strerror}") from None


def _watch(
    children: list[_Child], pumps: dict[int, threading.Thread], ended: queue.Queue[_Child], grace: float
) -> int:
    """0 once every child has finished; at the first failure, `_after_failure`'s exit code."""
    order: list[_Child] = []
    while len(order) < len(children):
        try:
            order.append(ended.get(timeout=0.5))
        except queue.Empty:
            continue
        if order[-1].proc.returncode != 0:
            return _after_failure(children, order, pumps, ended, grace)
    return 0


def _after_failure(
    children: list[_Child],
    order: list[_Child],
    pumps: dict[int, threading.Thread],
    ended: queue.Queue[_Child],
    grace: float,
) -> int:
    """The first failure's exit status, once the others have had _SETTLE_S to report theirs and
    are stopped."""
    deadline = time.monotonic() + _SETTLE_S  # let the others report theirs
    while len(order) < len(children) and (left := deadline - time.monotonic()) > 0:
        try:
            order.append(ended.get(timeout=left))
        except queue.Empty:
            break
    # Their last lines before our verdict, which ends the output. A killed one's pipe stays open
    # while its orphans live, so the killed share one short wait: enough for the lines already in
    # their pipes (a loaded CI machine printed a killed rank's line after the verdict), never a
    # wait behind another host's report.
    killed_until = time.monotonic() + _KILLED_DRAIN_S
    for c in order:
        if c.proc.pid in pumps:
            wait = 0.5 if c.proc.returncode >= 0 else max(0.0, killed_until - time.monotonic())
            pumps[c.proc.pid].join(timeout=wait)
    code = _first_failure(children, order)
    _stop_all(children, grace if code == EXIT_PREEMPTED else min(grace, _CRASH_GRACE_S))
    return code


def supervise(specs: list[Spec], grace: float, log_dir: Path | None = None, banner: str | None = None) -> int:
    """Start every spec, print `banner`, and watch them; returns the launcher's exit code.

    The first process talks to our terminal (its stdout and stderr are ours); the others' lines go
    to our stderr prefixed `[tag] `, or to log_dir/<tag>.log (`rank 3`: rank_3.log). Returns 0
    when every process finished; else, once the rest are stopped, the first failure's own exit
    status (75 pre-empted, 128+N for death by signal N); 128+N when the launcher itself got
    signal N.
    """
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    children: list[_Child] = []
    pumps: dict[int, threading.Thread] = {}  # child pid -> the thread copying its output
    files: list[IO[bytes]] = []
    ended: queue.Queue[_Child] = queue.Queue()
    handlers = {s: signal.signal(s, _raise_stop) for s in _STOP_SIGNALS}
    try:
        for i, spec in enumerate(specs):
            out, err, log = _output(spec, i == 0, log_dir, files)
            child = _start(spec, out, err, log, children, grace)
            children.append(child)
            threading.Thread(target=_reap, args=(child, ended), daemon=True).start()
            if out is subprocess.PIPE:
                t = threading.Thread(
                    target=_pump, args=(child.proc.stdout, f"[{spec.tag}] ".encode(), sys.stderr.buffer)
                )
                t.start()
                pumps[child.proc.pid] = t
        if banner:
            print(banner, file=sys.stderr, flush=True)
        return _watch(children, pumps, ended, grace)
    except _Stop as stop:
        noun = specs[0].tag.split()[0]  # rank, node
        print(
            f"jaxtrain launch: got {signal.Signals(stop.signum).name}, stopping all {noun}s (training "
            f"saves a checkpoint first; {signal.Signals(stop.signum).name} again to stop at once)",
            file=sys.stderr,
        )
        _stop_all(children, grace)
        return 128 + stop.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        for t in pumps.values():
            t.join(timeout=5)
        for f in files:
            f.close()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m jaxtrain.launch.supervise",
        description="Run COMMAND on each HOST through a remote shell, one per node, under the rule "
        "above; scripts/launch_multi_node.sh is the way to call it. Each COMMAND must stop its "
        "processes in order when a `stop` line arrives on its stdin, and kill them when it closes.",
    )
    p.add_argument("--rsh", default="ssh", help="remote shell, called as RSH HOST COMMAND (split on spaces)")
    # The hosts' own launchers give their ranks 10 s between SIGTERM and SIGKILL; this is more.
    p.add_argument("--grace", type=float, default=25.0, help="seconds the hosts get to stop (25)")
    p.add_argument("nodes", nargs="+", metavar="HOST COMMAND", help="node i is the i-th pair")
    return p


def main(argv: list[str]) -> int:
    """Supervise one remote shell per host; returns the exit code (see supervise)."""
    args = build_parser().parse_args(argv)
    if len(args.nodes) % 2:
        raise ArgumentError(f"expected HOST COMMAND pairs, got {len(args.nodes)} words")
    pairs = list(zip(args.nodes[::2], args.nodes[1::2], strict=True))
    rsh = args.rsh.split()
    specs = [Spec(f"node {i}", [*rsh, host, command], host=host) for i, (host, command) in enumerate(pairs)]
    code = supervise(specs, args.grace)
    if code == 0:
        print(f"jaxtrain launch: all {len(specs)} node(s) finished", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main)(sys.argv[1:]))
