"""Orbax checkpoints: asynchronous saves of the train state plus a JSON record of the run.

Every process calls save/restore (orbax needs all of them); replicated arrays are written
once, by the primary replica on process 0. A step directory only becomes visible once it
is complete (orbax writes to a temporary name and renames), so a killed save is never
restored.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jaxtrain.errors import UserError

log = logging.getLogger(__name__)


class Checkpointer:
    """A CheckpointManager over `directory` holding items `state` and `meta`."""

    def __init__(self, directory: Path, keep: int, read_only: bool = False) -> None:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices."""
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def read_meta(self, step: int) -> dict[str, Any]:
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # missing, truncated or garbled files: one user problem
            raise unreadable(self.directory / str(step), e) from None
        return dict(out["meta"])

    def restore(self, step: int, target: Any = None) -> Any:
        """Restore `state` into the shapes and shardings of `target` (abstract arrays), or as saved."""
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        except Exception as e:  # missing, truncated or mismatched files: one user problem
            raise unreadable(self.directory / str(step), e) from None
        return out["state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def unreadable(step_dir: Path, e: BaseException) -> UserError:
    """The one-line error for a step dir that cannot be restored; the details go to the log."""
    log.warning(f"restoring {step_dir} failed: {type(e).__name__}: {e}")
    return UserError(
        f"checkpoint {step_dir} is unreadable ({type(e).__name__}): it is incomplete or corrupt; "
        "delete that step dir to resume from the one before, or pass --resume_from another checkpoint"
    )


def locate(path: str) -> tuple[Path, int | None]:
    """Split a --resume_from path into (checkpoints dir, step or None for the latest)."""
    p = Path(path)
    if not p.exists():
        raise UserError(
            f"--resume_from {path} does not exist; give a run's checkpoints/ dir or one step dir in it"
        )
    if not p.is_dir():
        raise UserError(
            f"--resume_from {path} is a file; give a run's checkpoints/ dir or one step dir in it"
        )
    if p.name.isdigit() and (p / "state").exists():
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    return p, None
