"""Device memory: what each logged step holds and peaks at, and out-of-memory as one line.

GPUs report `memory_stats()` (bytes_in_use, peak_bytes_in_use, bytes_limit); CPUs report
nothing, so their records carry no memory fields. An allocation XLA cannot make, at compile or
run time, raises RESOURCE_EXHAUSTED with a long dump; `out_of_memory` turns it into one line
naming the peak, the device's limit and the settings that lower the peak.
"""

from __future__ import annotations

import re

import jax
from jax.sharding import Mesh

from jaxtrain import mesh as mesh_lib
from jaxtrain.config import Config
from jaxtrain.errors import UserError

_GB = 1e9
_GIB = 2**30
_ALLOC = re.compile(r"allocate\s+([\d.]+)\s*([KMGT]i?B|bytes|B)?", re.IGNORECASE)
_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "b": 1, "bytes": 1}  # fmt: skip


class OutOfMemory(UserError):
    """The step does not fit the device with these settings."""


def limit_bytes(device: jax.Device) -> int | None:
    """The memory XLA may use on `device`, where the device says (GPUs); None on CPUs."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit")


def check_fits(state_bytes: int, device: jax.Device, mesh: Mesh, local_devices: int) -> None:
    """Before compiling: refuse a state that alone overflows the device (GPUs report their memory)."""
    limit = limit_bytes(device)
    # Activations, gradients and XLA's workspace need room too: the state may take half.
    if not limit or state_bytes <= limit // 2:
        return
    shape = mesh_lib.mesh_shape(mesh)
    fsdp = shape["fsdp"]
    while state_bytes * shape["fsdp"] // fsdp > limit // 2 and fsdp * shape["tensor"] < local_devices:
        fsdp *= 2
    raise UserError(
        f"the train state needs {state_bytes / 2**30:.1f} GiB per device on mesh {mesh_lib.describe(mesh)}, "
        f"over half of this {device.device_kind}'s {limit / 2**30:.1f} GiB; shard it: --mesh.fsdp {fsdp} "
        f"--mesh.data -1 (state ~{state_bytes * shape['fsdp'] / fsdp / 2**30:.1f} GiB per device)"
    )


def usage(device: jax.Device) -> dict[str, float]:
    """mem_in_use_gb and mem_peak_gb of a device that reports them (GPUs), else {}."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_in_use" not in stats:
        return {}
    return {
        "mem_in_use_gb": round(stats["bytes_in_use"] / _GB, 3),
        "mem_peak_gb": round(stats.get("peak_bytes_in_use", stats["bytes_in_use"]) / _GB, 3),
    }


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an XLA runtime error is a failed device allocation."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def requested_bytes(error: BaseException) -> int | None:
    """The allocation XLA's message says it could not make, when it says."""
    match = _ALLOC.search(str(error))
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "bytes").lower()])


def out_of_memory(
    error: BaseException, where: str, cfg: Config, peak_bytes: int, device: jax.Device, local_devices: int
) -> OutOfMemory:
    """One line for an out-of-memory `error` at `where`: the peak, the limit, what lowers the peak."""
    limit = limit_bytes(device)
    asked = requested_bytes(error)
    needs = (
        f"the compiled step peaks at {peak_bytes / _GIB:.1f} GiB per device"
        if peak_bytes
        else f"XLA asked for {asked / _GIB:.1f} GiB more"
        if asked
        else "its size was not reported"
    )
    has = (
        f"this {device.device_kind} has {limit / _GIB:.1f} GiB" if limit else "the device's limit is unknown"
    )
    fix = fixes(cfg, local_devices)
    return OutOfMemory(f"out of device memory {where}: {needs}, {has}; lower the peak with {fix}")


def fixes(cfg: Config, local_devices: int) -> str:
    """Settings that lower the peak per device, most effective first, with this run's numbers."""
    shards = cfg.mesh.data * cfg.mesh.fsdp
    micro = cfg.batch_size // cfg.gradient_accumulation_steps // shards  # rows per device per microbatch
    out = []
    if micro > 1:
        tokens = cfg.batch_size * cfg.model.seq_len
        out.append(
            f"--total_batch_size {tokens} --device_batch_size {micro // 2} (same global batch, "
            f"{2 * cfg.gradient_accumulation_steps} microbatches)"
        )
    if cfg.model.remat != "full":
        out.append("--model.remat full (recompute activations in the backward)")
    if cfg.mesh.fsdp * cfg.mesh.tensor < local_devices:
        out.append(f"--mesh.fsdp {2 * cfg.mesh.fsdp} (shard params, gradients and Adam moments)")
    return ", or ".join(out) if out else "a device with more memory, or more devices with --mesh.fsdp"
