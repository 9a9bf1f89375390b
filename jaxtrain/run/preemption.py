"""Stop requests: SIGTERM or SIGUSR1 (pre-emption) or Ctrl-C (SIGINT) on any process makes every
process save and exit.

The signal handler only sets a flag. The loop asks `agreed()` at the same steps on every
process; when any process holds the flag, all of them see it at the same step, save a
checkpoint there, and end with `error()`: Preempted, exit 75 (SLURM requeues, the next launch
resumes), or after Ctrl-C Interrupted, ended by SIGINT as a shell expects (130), so a shell loop
around the command stops too. A second Ctrl-C ends the process at once, without that checkpoint.
Under torchrun or mpirun the process also ends when its launcher dies (jaxtrain/cluster/lifeline.py).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from jaxtrain.cluster.lifeline import watch_launcher
from jaxtrain.errors import Interrupted, Preempted

log = logging.getLogger("jaxtrain")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Holds whether this process received a stop signal, and which one all processes agreed on."""

    def __init__(self, is_main: bool, gather: Callable[[int], list[int]]) -> None:
        self.talk = is_main  # process 0 says what a Ctrl-C does
        self.gather = gather  # Job.gather: every process's value (a collective)
        self.signal_name: str | None = None  # this process's own
        self.agreed_signal: int | None = None  # set by agreed(): the one every process acts on
        # A process started with Ctrl-C ignored (a background job of a script) keeps ignoring it.
        mine = [s for s in SIGNALS if s != signal.SIGINT or signal.getsignal(s) is not signal.SIG_IGN]
        self.previous = {s: signal.signal(s, self._handle) for s in mine}
        watch_launcher()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        talk = self.talk
        if signum == signal.SIGINT and self.signal_name is not None:
            os.write(2, b"stop signal again (Ctrl-C): stopping now, without the checkpoint; a relaunch "
                     b"resumes from the last one saved\n")  # fmt: skip
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        if self.signal_name is None and signum == signal.SIGINT and talk:
            os.write(2, b"Ctrl-C: saving a checkpoint at the next step, then stopping (Ctrl-C again: "
                     b"stop at once without it)\n")  # fmt: skip
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every process if any process was signalled (a collective when multi-process)."""
        local = signal.Signals[self.signal_name].value if self.signal_name else 0
        got = [s for s in self.gather(local) if s]
        if got:
            # Pre-emption wins over Ctrl-C: the cluster wants the job requeued.
            self.agreed_signal = min(got, key=lambda s: s == signal.SIGINT)
        return bool(got)

    def error(self, saved: Path | str) -> Preempted:
        """What ends the run once the checkpoint `saved` is written after an agreed stop."""
        if self.agreed_signal == signal.SIGINT:
            return Interrupted(f"interrupted (Ctrl-C): checkpoint {saved} saved; relaunch to resume")
        return Preempted(f"pre-empted: checkpoint {saved} saved; relaunch to resume")

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
