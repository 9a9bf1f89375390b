"""Where a launch starts: the checkpoint it resumes (its own, else --resume_from's), or a fresh
state with --init_from's params; and the one rule for what a --init_from / --resume_from path
names (a Hugging Face model dir, hf:DIR, or a checkpoint of ours).

    done = finished_step(cfg, job)           # a relaunch of a complete run: nothing to do
    found = find_start(run, ckpt)            # refused here if it is the wrong checkpoint
    state, step = start_state(run, found)    # restored into run.target's shardings
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from jaxtrain.config import Config
from jaxtrain.disk import bucket, rundir
from jaxtrain.disk.checkpoint import Checkpointer, open_checkpoint
from jaxtrain.errors import UserError
from jaxtrain.hf import hf_dir
from jaxtrain.hf.load import HFCheckpoint
from jaxtrain.run.build import Run
from jaxtrain.run.job import Job

log = logging.getLogger(__name__)


def finished_step(cfg: Config, job: Job) -> int | None:
    """The step of the run dir's newest checkpoint where it is readable and at or past total_steps:
    the run is complete and a relaunch (a second `make train`, a SLURM requeue) has nothing to
    train. None otherwise (with --overwrite too). Process 0 judges as find_start does, all follow;
    nothing is written or moved (a damaged one is left for find_start to move aside)."""
    directory = bucket.path(cfg.checkpoint_dir)
    if cfg.overwrite or not directory.is_dir():
        return None
    ckpt = Checkpointer(directory, 1, read_only=True)
    try:
        newest = max(ckpt.all_steps(), default=-1)
        done = -1
        if job.is_main and newest >= cfg.total_steps and ckpt.damage(newest, job.local_devices[0]) is None:
            done = newest
    finally:
        ckpt.close()
    done = job.broadcast(done)
    return done if done >= 0 else None


def complete_line(cfg: Config, step: int) -> str:
    """What a relaunch of a complete run says: where it ended, and how to train on."""
    more = "a larger --epochs" if cfg.epochs else f"--total_steps above {step}"
    run = cfg.run_url or cfg.resolved_run_dir
    return (
        f"run {run} is complete at step {step} (total_steps {cfg.total_steps}): "
        f"nothing to train; to train longer relaunch with {more}, to start afresh pass another "
        "--run_dir or --overwrite"
    )


def find_start(run: Run, ckpt: Checkpointer) -> tuple[Checkpointer, int] | None:
    """The checkpoint a launch resumes: this run's newest readable one (newer, damaged ones moved
    aside), else --resume_from's; None for a fresh start. Checked against the config here, so a
    wrong checkpoint is refused before anything is compiled."""
    cfg, job = run.cfg, run.job
    source, step = ckpt, _newest_readable(ckpt, job)
    if cfg.resume_from and step is None:
        source, step = open_checkpoint(cfg.resume_from, "--resume_from")
        damage = source.damage(step) if job.is_main else None
        if damage:  # the user asked for this one: no other is taken in its place
            raise UserError(f"checkpoint {source.directory}/{step} is unreadable ({damage}); pass another")
    if step is None:
        return None
    diff = rundir.incompatibilities(source.read_meta(step).get("config", {}), cfg)
    if diff:
        raise UserError(
            f"checkpoint {source.directory}/{step} was written by a different config "
            f"({'; '.join(diff[:3])}); resume with the same model/batch/seed/data, or start a new --run_dir"
        )
    return source, step


def start_state(run: Run, found: tuple[Checkpointer, int] | None) -> tuple[Any, int]:
    """The state a launch starts from and its step, laid out as `run.target`: `found`'s checkpoint
    (find_start), else a fresh state (with --init_from's params: step 0, fresh optimizer)."""
    if found is None:
        state = run.init_state()
        if run.cfg.init_from:
            init_source, init_step = open_params(run.cfg.init_from, "--init_from")
            params = init_source.restore_params(init_step, run.target.params, "--init_from")
            state = state.replace(params=params)  # type: ignore[attr-defined]  # added by flax.struct
            log.info(f"params from {run.cfg.init_from} (--init_from); optimizer and step start afresh")
        return state, 0
    source, step = found
    faults = run.host_faults
    if faults:
        faults.during_restore()
    state = source.restore(step, run.target)
    log.info(f"resumed from {source.directory}/{step}")
    return state, step


def check_init_from(run: Run) -> None:
    """--init_from's params have this model's shapes (before the run dir is made)."""
    source, step = open_params(run.cfg.init_from, "--init_from")
    source.check_params(step, run.abstract.params, "--init_from")


class ParamSource(Protocol):
    """What --init_from and --resume_from read: a checkpoint of ours or a Hugging Face model dir."""

    directory: Path

    def read_meta(self, step: int) -> dict[str, Any]: ...

    def check_params(self, step: int, target: Any, flag: str) -> None: ...

    def restore_params(self, step: int, target: Any, flag: str) -> Any: ...


def open_params(path: str, flag: str) -> tuple[ParamSource, int]:
    """Where `flag` takes params from: hf:DIR (a Hugging Face model dir, read as step 0), else a
    checkpoint of ours (a step dir, or a run's newest). The one place that tells them apart."""
    directory = hf_dir(path)
    if directory is not None:
        return HFCheckpoint(directory, flag), 0
    return open_checkpoint(path, flag)


def _newest_readable(ckpt: Checkpointer, job: Job) -> int | None:
    """The run's newest checkpoint that passes its checks (process 0 judges, all follow); newer,
    damaged ones are moved aside with a warning. None if there are none; UserError if none is
    readable (then nothing is moved)."""
    steps = sorted(ckpt.all_steps(), reverse=True)
    if not steps:
        return None
    damaged: list[tuple[int, str]] = []
    chosen = -1
    if job.is_main:
        for step in steps:
            why = ckpt.damage(step, job.local_devices[0])
            if why is None:
                chosen = step
                break
            damaged.append((step, why))
    chosen = job.broadcast(chosen)
    if chosen < 0:
        said = "; ".join(f"{s}: {why}" for s, why in damaged) if job.is_main else "see train.log"
        raise UserError(
            f"no checkpoint in {ckpt.directory} is readable ({said}); they are left as they are: "
            "pass --resume_from a good copy, or --overwrite to start afresh"
        )
    for step, why in damaged:
        aside = ckpt.move_aside(step)
        log.warning(f"checkpoint {ckpt.directory}/{step} is unreadable ({why}): moved aside to {aside}")
    job.barrier("checkpoints_moved_aside")
    ckpt.reload()
    return chosen
