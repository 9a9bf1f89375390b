"""Pre-emption: SIGTERM or SIGUSR1 on any process makes every process save and exit.

The signal handler only sets a flag. The loop asks `agreed()` at the same steps on every
process; when any process holds the flag, all of them see it at the same step, save a
checkpoint there, and exit with EXIT_PREEMPTED (SLURM requeues, the next launch resumes).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType

log = logging.getLogger("jaxtrain")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Holds whether this process received a stop signal."""

    def __init__(self, any_process: Callable[[bool], bool]) -> None:
        self.any_process = any_process  # Job.any: whether a flag holds on any process (a collective)
        self.signal_name: str | None = None
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every process if any process was signalled (a collective when multi-process)."""
        return self.any_process(self.signal_name is not None)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
