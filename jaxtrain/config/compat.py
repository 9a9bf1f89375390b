"""The users' guides' flags (torchrun/DDP recipes) that have no effect of their own in JAX: what
each does here, said once in the log when it is set."""

from __future__ import annotations

from jaxtrain.config.schema import CompatConfig, Config, get, global_rows

_COMPAT_NOTES = {
    "compat.distributed": "--distributed: accepted; jaxtrain detects distribution from its launcher",
    "compat.local_rank": "--local_rank {}: accepted, checked against the launcher's local rank",
    "compat.backend": "--backend {}: accepted; JAX picks NCCL between GPUs and gloo between CPU processes",
    "compat.skip_invalid_loss": "--skip_invalid_loss: accepted, jaxtrain always skips non-finite steps "
    "(params unchanged) and stops after max_bad_steps in a row",
    "compat.find_unused_parameters": "--find_unused_parameters: no effect, every parameter gets a "
    "gradient in JAX",
}


def compat_notes(cfg: Config, n_windows: int, n_processes: int, n_devices: int) -> list[str]:
    """What the guides' flags that were set do here: one log line each."""
    defaults = CompatConfig()
    notes = [
        note.format(get(cfg, path))
        for path, note in _COMPAT_NOTES.items()
        if get(cfg, path) != getattr(defaults, path.split(".")[1])
    ]
    if cfg.compat.world_size and n_processes > 1:
        notes.append(f"--world_size {cfg.compat.world_size}: accepted, equals the process count")
    elif cfg.compat.world_size:
        notes.append(
            f"--world_size {cfg.compat.world_size}: in JAX one process drives every local device, so this "
            f"one process trains on {n_devices} devices (no process per device is started)"
        )
    if cfg.compat.single_gpu:
        notes.append(f"--single_gpu: one process on device {cfg.dist.local_device_ids}")
    if cfg.compat.continue_on_error:
        notes.append(
            f"--continue_on_error: max_bad_steps = total_steps {cfg.total_steps}: non-finite "
            "steps are skipped (params unchanged) and never stop the run"
        )
    if cfg.epochs:
        notes.append(
            f"--epochs {cfg.epochs:g}: {n_windows:,} windows of {cfg.model.seq_len + 1} tokens "
            f"per epoch / batch {global_rows(cfg)} = total_steps {cfg.total_steps}"
        )
    return notes
