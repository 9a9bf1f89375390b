"""jax.profiler traces of chosen steps: `--profile_steps A:B` traces steps A..B-1, training goes on.

Process 0 traces into <run_dir>/profile/, another chosen process (`--profile_processes 0,3` or
`all`) into <run_dir>/profile/process_<i>/, so two processes on one host never write the same
file. Each trace is an XSpace (`plugins/profile/<time>/<host>.xplane.pb`, for TensorBoard's
profile plugin or XProf) plus `perfetto_trace.json.gz` (ui.perfetto.dev). Every step runs under
a StepTraceAnnotation, so the profilers (and nsys on GPUs) group device work by step number.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from jaxtrain.config import Config, profile_processes, profile_range

log = logging.getLogger("jaxtrain")


def trace_dir(run_dir: Path, process_index: int) -> Path:
    """Where this process's trace goes."""
    profile = run_dir / "profile"
    return profile if process_index == 0 else profile / f"process_{process_index}"


class Profiler:
    """Starts the trace before step A, stops it once step B-1 is done; inert when not asked for."""

    def __init__(self, cfg: Config, run_dir: Path, process_index: int) -> None:
        chosen = profile_processes(cfg.profile_processes)
        wanted = chosen is None or process_index in chosen
        self.range = profile_range(cfg.profile_steps) if wanted else None
        self.dir = trace_dir(run_dir, process_index)
        self.tracing = False

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around the dispatch of the step that takes the state from `step` to `step + 1`."""
        if self.range and not self.tracing and self.range[0] <= step < self.range[1]:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.tracing = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield

    def after_step(self, step: int, outputs: Any) -> None:
        """Stop once `step` (steps done) reaches B, after the traced steps' device work ended."""
        if self.tracing and self.range and step >= self.range[1]:
            self.stop(outputs)

    def stop(self, outputs: Any = None) -> None:
        """End a trace in progress (also when the run ends or stops early)."""
        if not self.tracing:
            return
        jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.tracing = False
        assert self.range is not None  # a trace starts only inside the range
        log.info(f"profile of steps {self.range[0]}..{self.range[1] - 1} written to {self.dir}")
