"""A hang watchdog: a step that takes far longer than usual ends the process, loudly.

One dead or stalled rank otherwise holds every other rank inside a collective until the
allocation runs out. When the limit passes, the watchdog writes every thread's Python
stack and the last completed step to stderr and the process log, then exits with
EXIT_HUNG so the launcher or SLURM tears the job down.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jaxtrain.errors import EXIT_HUNG

# Never judge a step faster than this, whatever the typical step time (log and eval jitter).
MIN_LIMIT_S = 5.0


class Watchdog:
    """Call `beat(step)` after every completed step; `phase()` covers slow non-step work."""

    def __init__(self, factor: float, timeout_s: float, log_path: Path | None = None) -> None:
        self.factor = factor
        self.timeout_s = timeout_s  # absolute limit for anything, 0 disables the watchdog
        self.log_path = log_path  # the process's own log: its stacks are kept there
        self.step = -1
        self.what = "start-up"
        self.durations: deque[float] = deque(maxlen=50)
        self.last = time.monotonic()
        self.in_phase = False
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="jaxtrain-watchdog", daemon=True).start()

    def limit(self) -> float:
        """Seconds the current step may take."""
        if self.in_phase or len(self.durations) < 3 or not self.factor:
            return self.timeout_s
        typical = statistics.median(self.durations)
        return min(self.timeout_s, max(MIN_LIMIT_S, self.factor * typical))

    def beat(self, step: int) -> None:
        now = time.monotonic()
        with self.lock:
            if self.step >= 0 and not self.in_phase:
                self.durations.append(now - self.last)
            self.step, self.what, self.last = step, f"step {step + 1}", now

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Slow work that is not a step (compile, eval, checkpoint): only the absolute limit."""
        with self.lock:
            self.in_phase, self.what, self.last = True, what, time.monotonic()
        try:
            yield
        finally:
            with self.lock:
                self.in_phase, self.last = False, time.monotonic()
                self.what = f"step {self.step + 1}"

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(0.5):
            with self.lock:
                waited, limit, what, step = time.monotonic() - self.last, self.limit(), self.what, self.step
            if waited > limit:
                self._fire(waited, limit, what, step)

    def _fire(self, waited: float, limit: float, what: str, step: int) -> None:
        msg = (
            f"watchdog: {what} has taken {waited:.0f} s, over the {limit:.0f} s limit; last completed step "
            f"{max(step, 0)}; this process (pid {os.getpid()}) is stuck or waiting for a stuck one. "
            "Python stacks of all threads follow; exiting."
        )
        print(msg, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.log_path is not None and self.log_path.parent.is_dir():
            with open(self.log_path, "a") as f:
                print(msg, file=f, flush=True)
                faulthandler.dump_traceback(file=f, all_threads=True)
        os._exit(EXIT_HUNG)  # a hung collective cannot be interrupted; leave now
