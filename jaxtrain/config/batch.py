"""The global batch against the devices: its split over processes and over batch shards, with
the numbers in every refusal. Pure arithmetic on the config; run/job.py applies it to a job's
devices, xla_env.py to the CPU devices it may choose, the loaders to their processes."""

from __future__ import annotations

from jaxtrain.config.schema import Config, ConfigError, global_rows


def check_batch_split(rows: int, n_processes: int) -> None:
    """Each process loads an equal share of the global batch."""
    if rows % n_processes:
        raise ConfigError(
            f"global batch_size {rows} is not divisible by {n_processes} processes; "
            f"use a multiple of {n_processes}"
        )


def batch_plan(cfg: Config, shards: int, n_devices: int) -> tuple[int, int]:
    """(global batch in sequences, microbatches) when the batch is split over `shards` batch shards
    (mesh.data x mesh.fsdp) of `n_devices` devices; the error gives the numbers."""
    axes = "mesh.data x mesh.expert x mesh.fsdp" if cfg.mesh.expert != 1 else "mesh.data x mesh.fsdp"
    where = "devices" if shards == n_devices else f"batch shards ({axes})"
    batch, accum = cfg.batch_size, cfg.gradient_accumulation_steps
    if cfg.total_batch_size:
        rows = global_rows(cfg)
        per_micro = cfg.device_batch_size * shards
        if rows % per_micro:
            raise ConfigError(
                f"total_batch_size {cfg.total_batch_size} tokens = {rows} sequences is not divisible by "
                f"device_batch_size {cfg.device_batch_size} x {shards} {where} = {per_micro}; "
                + (
                    "change total_batch_size or device_batch_size"
                    if cfg.device_batch_size > 1
                    else f"use a total_batch_size of a multiple of {per_micro} sequences, or split "
                    "the batch fewer ways (a larger mesh.tensor or mesh.context)"
                )
            )
        batch, accum = rows, rows // per_micro
    micro = batch // accum
    if micro % shards:
        raise ConfigError(
            f"microbatch {micro} (batch_size {batch} / gradient_accumulation_steps {accum}) is not "
            f"divisible by {shards} {where}; use a batch_size that is a multiple of {accum * shards}"
        )
    groups, rows = cfg.model.moe.overlap_groups, micro // shards
    if cfg.model.moe.n_experts and rows % groups:
        raise ConfigError(
            f"model.moe.overlap_groups {groups} does not divide a device's {rows} sequences a microbatch; "
            f"use a device batch that is a multiple of {groups}, or model.moe.overlap_groups 1"
        )
    return batch, accum
