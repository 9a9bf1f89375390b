"""The hang watchdog: work that takes far longer than it may ends the process, loudly.

One dead or stalled rank otherwise holds every other rank inside a collective until the
allocation runs out, and a hung collective cannot be interrupted from Python. Three kinds of limit:
  steps     training calls `beat(step)` after every step: a step may take `factor` x the typical
            step time (never under MIN_LIMIT_S) and at most `timeout_s`
  deadline  `with deadline(what, seconds):` bounds one piece of work; `phase(what)` is a deadline
            of `timeout_s` for training's slow work that is not a step (compile, eval, checkpoint)
  beside    `watch_beside(in_flight)`: work running in the background beside training (an
            asynchronous checkpoint write) must end within `timeout_s` of its start, even while
            training goes on (a write hung on dead storage is caught then, not at the next wait)
When a limit passes, the watchdog reports (by default every thread's Python stack and the last
completed step, on stderr and in the process log; or the caller's `on_expiry`), then exits with
`exit_code` at once, so the launcher or SLURM tears the job down. Users: training
(jaxtrain/run/loop.py, EXIT_HUNG), the health check (jaxtrain/health/runner.py) and joining the job
(jaxtrain/cluster/join.py).
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import NoReturn

from jaxtrain.errors import EXIT_HUNG

# Never judge a step faster than this, whatever the typical step time (log and eval jitter, and
# a machine shared with other work: at 5 s a healthy 30 ms step of a tiny run was once ended in CI).
MIN_LIMIT_S = 15.0
# A report may itself hang (on a dead coordinator, on a dead mount for the log): exit after this.
REPORT_GRACE_S = 10.0
# Beats do not wake the watcher (that would be every step), so a step limit that shrinks once
# steps are timed is noticed within this.
POLL_S = 0.5


def exit_now(code: int) -> NoReturn:
    """Flush and end the process without exit handlers: jax's shutdown would wait minutes for
    peers that are stuck with this one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """Call `beat(step)` after every completed step, or bound work with `deadline()` / `phase()`."""

    def __init__(
        self,
        factor: float = 0.0,
        timeout_s: float = 0.0,
        log_path: Path | None = None,
        *,
        on_expiry: Callable[[str, float], None] | None = None,
        exit_code: int = EXIT_HUNG,
    ) -> None:
        self.factor = factor  # 0: steps get only timeout_s
        self.timeout_s = timeout_s  # limit for any step or phase; 0: none
        self.log_path = log_path  # the process's own log: its stacks are kept there
        self.on_expiry = on_expiry or self._dump_stacks  # called with (what, limit in seconds)
        self.exit_code = exit_code
        self.step = -1
        self.what = "start-up"
        self.durations: deque[float] = deque(maxlen=50)
        self.last = time.monotonic()
        self.deadline_s: float | None = None  # the limit inside deadline() or phase()
        # Each returns (what, time.monotonic() it started) of background work in flight, or None.
        self.beside: list[Callable[[], tuple[str, float] | None]] = []
        self.expired_since = 0.0  # when the work that passed its limit started
        self.changed = threading.Condition()  # guards the fields above; wakes the watcher
        self.stopped = False
        self.thread: threading.Thread | None = None
        if timeout_s > 0:
            self._start()

    def limit(self) -> float:
        """Seconds the current step or deadline may take; 0: no limit."""
        if self.deadline_s is not None:
            return self.deadline_s
        if len(self.durations) < 3 or not self.factor:
            return self.timeout_s
        typical = statistics.median(self.durations)
        return min(self.timeout_s, max(MIN_LIMIT_S, self.factor * typical))

    def beat(self, step: int) -> None:
        now = time.monotonic()
        with self.changed:
            if self.step >= 0 and self.deadline_s is None:
                self.durations.append(now - self.last)
            self.step, self.what, self.last = step, f"step {step + 1}", now

    @contextmanager
    def deadline(self, what: str, seconds: float) -> Iterator[None]:
        """`what` must end within `seconds` (0: no limit); it is not timed as a step. Not nested."""
        with self.changed:
            self.deadline_s, self.what, self.last = seconds, what, time.monotonic()
            if seconds > 0:
                self._start()
            self.changed.notify()
        try:
            yield
        finally:
            with self.changed:
                self.deadline_s, self.last = None, time.monotonic()
                self.what = f"step {self.step + 1}"
                self.changed.notify()

    def phase(self, what: str) -> AbstractContextManager[None]:
        """Slow work that is not a step (compile, eval, checkpoint): only the absolute limit."""
        return self.deadline(what, self.timeout_s)

    def watch_beside(self, in_flight: Callable[[], tuple[str, float] | None]) -> None:
        """Bound background work too: `in_flight()` (called from the watchdog's thread, so it must
        only read) names the work in flight and when it started, or returns None."""
        with self.changed:
            self.beside.append(in_flight)

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify()

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, name="jaxtrain-watchdog", daemon=True)
            self.thread.start()

    def _expired(self) -> tuple[str, float, float] | None:
        """(what, limit, started) of the work, in the foreground or beside it, over its limit."""
        now, limit = time.monotonic(), self.limit()
        if limit and now - self.last >= limit:
            return self.what, limit, self.last
        for in_flight in self.beside if self.timeout_s > 0 else ():
            found = in_flight()
            if found is not None and now - found[1] >= self.timeout_s:
                return found[0], self.timeout_s, found[1]
        return None

    def _watch(self) -> None:
        with self.changed:
            while not self.stopped:
                expired = self._expired()
                if expired is not None:
                    break
                limit, waited = self.limit(), time.monotonic() - self.last
                self.changed.wait(min(POLL_S, limit - waited) if limit else (POLL_S if self.beside else None))
            else:
                return
            what, limit, self.expired_since = expired
        report = threading.Thread(target=self.on_expiry, args=(what, limit), daemon=True)
        report.start()
        report.join(REPORT_GRACE_S)
        exit_now(self.exit_code)  # a hung collective cannot be interrupted; leave now

    def _dump_stacks(self, what: str, limit: float) -> None:
        msg = (
            f"watchdog: {what} has taken {time.monotonic() - self.expired_since:.0f} s, over the "
            f"{limit:.0f} s "
            f"limit; last completed step {max(self.step, 0)}; this process (pid {os.getpid()}) is stuck "
            "or waiting for a stuck one. Python stacks of all threads follow; exiting."
        )
        print(msg, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.log_path is not None and self.log_path.parent.is_dir():
            with open(self.log_path, "a") as f:
                print(msg, file=f, flush=True)
                faulthandler.dump_traceback(file=f, all_threads=True)
