"""Pre-emption: SIGTERM or SIGUSR1 on any process makes every process save and exit.

The signal handler only sets a flag. The loop asks `agreed()` at the same steps on every
process; when any process holds the flag, all of them see it at the same step, save a
checkpoint there, and exit with EXIT_PREEMPTED (SLURM requeues, the next launch resumes).
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import jax
import numpy as np

log = logging.getLogger("jaxtrain")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Holds whether this process received a stop signal."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every process if any process was signalled (a collective when multi-process)."""
        local = self.signal_name is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(local))))

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
