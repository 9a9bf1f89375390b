"""A function run in a thread while the caller goes on: the step compiles while the state restores."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class Background:
    """`fn()` run in a daemon thread (a run that fails meanwhile exits without waiting for it);
    result() gives (its value, its seconds, the seconds waited for it) or raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, args=(fn,), name="compile", daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            self.value = fn()
        except BaseException as e:  # re-raised in the waiting thread
            self.error = e
        self.seconds = time.perf_counter() - t0

    @contextlib.contextmanager
    def joined_on_error(self) -> Iterator[None]:
        """The interpreter aborts (SIGABRT) if it exits while XLA compiles: a failure waits first."""
        try:
            yield
        except BaseException:
            self.thread.join()
            raise

    def result(self) -> tuple[Any, float, float]:
        t0 = time.perf_counter()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value, self.seconds, time.perf_counter() - t0
