"""Faults for tests only: a stalled process, a kill during a checkpoint save, a restore hung on
storage, non-finite gradients, a device out of memory, a kernel that differs in the preflight.

They are switched on by one environment variable, never by the user's config (so they are not in
`--help`, `config.yaml` or error suggestions):

    JAXTRAIN_FAULTS="stall_step=15,stall_process=1" python scripts/train.py ...

With the variable unset, `Faults.of` returns None and nothing here is traced or called: the loop
pays one `is None` test per step, the compiled step nothing.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxtrain.errors import UserError

ENV = "JAXTRAIN_FAULTS"


@dataclass(frozen=True)
class FaultPlan:
    """What to break; all off by default."""

    nan_step: int = 0  # poison the first device's gradient from this step (1-based) on...
    nan_count: int = 1  # ...for this many steps
    stall_step: int = -1  # sleep before this step...
    stall_process: int = 0  # ...on this process...
    stall_seconds: float = 3600.0  # ...this long
    kill_during_save: int = -1  # SIGKILL this process while the checkpoint of this step is written...
    kill_process: int = -1  # ...on this process (-1: every one); the others lose a peer mid-save
    stall_restore: bool = False  # sleep stall_seconds inside a checkpoint restore, as a dead NFS mount does
    oom: str = ""  # compile | step: fail there as a device out of memory does
    preflight_differs: str = (
        ""  # a preflight check (its name's first word) whose kernel gives other numbers...
    )
    preflight_process: int = -1  # ...on this process (-1: every one), as a bad GPU or a kernel bug would


NO_FAULTS = FaultPlan()


def planned(environ: Mapping[str, str] = os.environ) -> FaultPlan:
    """The plan $JAXTRAIN_FAULTS spells as comma-separated key=value pairs (none when unset)."""
    text = environ.get(ENV, "").strip()
    if not text:
        return NO_FAULTS
    types = {f.name: f.type for f in dataclasses.fields(FaultPlan)}
    values: dict[str, object] = {}
    for item in text.split(","):
        key, _, value = item.strip().partition("=")
        if key not in types:
            raise UserError(f"{ENV}: unknown fault '{key}'; one of {', '.join(types)}")
        kind = types[key]
        values[key] = value.lower() in ("1", "true") if kind == "bool" else value
        if kind in ("int", "float"):
            values[key] = (int if kind == "int" else float)(value)
    return FaultPlan(**values)  # type: ignore[arg-type]


class Faults:
    """The host-side faults of one process."""

    def __init__(self, plan: FaultPlan, process_index: int) -> None:
        self.plan, self.process_index = plan, process_index

    @classmethod
    def of(cls, plan: FaultPlan, process_index: int) -> Faults | None:
        return None if plan == NO_FAULTS else cls(plan, process_index)

    def before_step(self, step: int) -> None:
        """Hang this process before `stall_step`, as a dead NFS mount or a stuck GPU would."""
        p = self.plan
        if step == p.stall_step and self.process_index == p.stall_process:
            time.sleep(p.stall_seconds)

    def after_save_started(self, step: int) -> None:
        """Die (SIGKILL, no clean-up) while the checkpoint of `kill_during_save` is written."""
        if step == self.plan.kill_during_save and self.plan.kill_process in (-1, self.process_index):
            os.kill(os.getpid(), signal.SIGKILL)

    def during_restore(self) -> None:
        """Hang inside the checkpoint restore (`stall_restore`), as a read from dead storage would."""
        if self.plan.stall_restore:
            time.sleep(self.plan.stall_seconds)

    def out_of_memory(self, where: str) -> None:
        """Fail at `oom` (compile | step) with the error XLA raises when a device is full."""
        if where == self.plan.oom:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 86973087744 bytes."
            )

    def preflight_differs(self, check: str) -> bool:
        """The preflight check named `check` gets its kernel's outputs skewed on this process."""
        p = self.plan
        hit = p.preflight_differs and check.split()[0] == p.preflight_differs
        return bool(hit) and p.preflight_process in (-1, self.process_index)


def poison_gradients(
    plan: FaultPlan, scale: jax.Array, step: jax.Array, first_device: jax.Array
) -> jax.Array:
    """The loss scale, NaN on the first device at steps nan_step .. + nan_count - 1 (1-based)."""
    first, last = plan.nan_step, plan.nan_step + plan.nan_count - 1
    poisoned = first_device & (step + 1 >= first) & (step + 1 <= last)
    return jnp.where(poisoned, jnp.nan, scale)
