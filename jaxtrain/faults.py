"""Faults for tests only, switched on by the `debug` config section: a stalled process, a kill
during a checkpoint save, a restore hung on storage, non-finite gradients, a device out of memory.

With every `debug.*` key at its default, `Faults.of` returns None and nothing here is traced or
called: the loop pays one `is None` test per step, the compiled step nothing.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import jax.numpy as jnp

from jaxtrain.config import DebugConfig


class Faults:
    """The host-side faults of one process."""

    def __init__(self, debug: DebugConfig, process_index: int) -> None:
        self.debug, self.process_index = debug, process_index

    @classmethod
    def of(cls, debug: DebugConfig, process_index: int) -> Faults | None:
        return None if debug == DebugConfig() else cls(debug, process_index)

    def before_step(self, step: int) -> None:
        """Hang this process before `debug.stall_step`, as a dead NFS mount or a stuck GPU would."""
        d = self.debug
        if step == d.stall_step and self.process_index == d.stall_process:
            time.sleep(d.stall_seconds)

    def after_save_started(self, step: int) -> None:
        """Die (SIGKILL, no clean-up) while the checkpoint of `debug.kill_during_save` is written."""
        if step == self.debug.kill_during_save:
            os.kill(os.getpid(), signal.SIGKILL)

    def during_restore(self) -> None:
        """Hang inside the checkpoint restore (`debug.stall_restore`), as a read from dead storage would."""
        if self.debug.stall_restore:
            time.sleep(self.debug.stall_seconds)

    def out_of_memory(self, where: str) -> None:
        """Fail at `debug.oom` (compile | step) with the error XLA raises when a device is full."""
        if where == self.debug.oom:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 86973087744 bytes."
            )


def poison_gradients(
    debug: DebugConfig, scale: jax.Array, step: jax.Array, first_device: jax.Array
) -> jax.Array:
    """The loss scale, NaN on the first device at steps debug.nan_step .. + nan_count - 1 (1-based)."""
    first, last = debug.nan_step, debug.nan_step + debug.nan_count - 1
    poisoned = first_device & (step + 1 >= first) & (step + 1 <= last)
    return jnp.where(poisoned, jnp.nan, scale)
