"""Device memory: what each logged step holds and peaks at, and out-of-memory as one line.

GPUs report `memory_stats()` (bytes_in_use, peak_bytes_in_use, bytes_limit); CPUs report
nothing, so their records carry no memory fields. An allocation XLA cannot make, at compile or
run time, raises RESOURCE_EXHAUSTED with a long dump; `out_of_memory` turns it into one line
naming the peak, the device's limit and the settings that lower the peak.
"""

from __future__ import annotations

import re
from typing import Any

import jax

from jaxtrain.config import Config
from jaxtrain.errors import UserError

_GB = 1e9
_GIB = 2**30
_ALLOC = re.compile(r"allocate\s+([\d.]+)\s*([KMGT]i?B|bytes|B)?", re.IGNORECASE)
_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "b": 1, "bytes": 1}  # fmt: skip


class OutOfMemory(UserError):
    """The step does not fit the device with these settings."""


def _stats(device: jax.Device) -> dict[str, Any]:
    """The device's memory_stats(), {} where it keeps none (CPUs)."""
    return (device.memory_stats() if hasattr(device, "memory_stats") else None) or {}


def limit_bytes(device: jax.Device) -> int | None:
    """The memory XLA may use on `device`, where the device says (GPUs); None on CPUs."""
    return _stats(device).get("bytes_limit")


def compiled_bytes(compiled: Any) -> dict[str, int]:
    """Per-device bytes of a compiled step: arguments (state + batch), temporaries, and the total
    it needs at once (arguments + temporaries + outputs not aliased to arguments)."""
    m = compiled.memory_analysis()
    if m is None:  # a backend that does not say
        return {"argument_bytes": 0, "temp_bytes": 0, "total_bytes": 0}
    args, temp = int(m.argument_size_in_bytes), int(m.temp_size_in_bytes)
    out = int(m.output_size_in_bytes) - int(m.alias_size_in_bytes)
    return {"argument_bytes": args, "temp_bytes": temp, "total_bytes": args + temp + out}


# What "fits" keeps free of what XLA may use, for what the compiled step's figure leaves out:
# XLA's autotuning at compile time (it allocates each candidate GEMM's and fusion's operands,
# output and workspace beside the live state: xla/service/gpu/autotuning/, RedzoneAllocator),
# cuBLAS's and cuDNN's handles and plans (cuBLAS recommends a 32 MiB workspace a stream on Hopper,
# 4 MiB before it: cuBLAS docs, cublasSetWorkspace), and the allocator's fragmentation. The
# workspaces of the step's own cuBLAS and cuDNN calls (cuDNN flash attention's included) are in
# its temporaries already: XLA gives them as a u8/s8 result of each call. 5%: the slop XLA's own
# GPU scheduler keeps under the memory limit it schedules to (xla_gpu_memory_limit_slop_factor,
# default 95, xla/debug_options_flags.cc). Outside XLA's share (jax preallocates 75% of the
# device: compiled.mem_fraction), the CUDA context and NCCL's buffers have the other 25%.
RESERVE = 0.05


def reserve_bytes(limit: int) -> int:
    """The bytes of `limit` that "fits" keeps free (RESERVE)."""
    return int(limit * RESERVE)


def fits(total_bytes: int, limit: int) -> bool:
    """The one memory rule, for a GPU at hand (its allocator's limit) and a planned one alike: the
    compiled step's total bytes per device within what XLA may use of the device, less the reserve
    for autotuning, library handles and fragmentation (RESERVE)."""
    return total_bytes <= limit - reserve_bytes(limit)


def check_compiled(
    total_bytes: int, device: jax.Device, cfg: Config, local_devices: int, exchange: str = ""
) -> None:
    """Refuse, before the first step, a compiled step the device cannot hold (GPUs report their
    limit; CPUs do not, and are not judged)."""
    limit = limit_bytes(device)
    if not limit or fits(total_bytes, limit):
        return
    raise OutOfMemory(
        f"the compiled step needs {total_bytes / _GIB:.1f} GiB per device, over the "
        f"{(limit - reserve_bytes(limit)) / _GIB:.1f} GiB of the {limit / _GIB:.1f} GiB XLA may use on this "
        f"{device.device_kind} that leave {100 * RESERVE:g}% for autotuning and workspaces; lower it with "
        f"{fixes(cfg, local_devices, exchange)} "
        "(scripts/plan.py with the same flags and --search compiles the settings that fit)"
    )


def usage(device: jax.Device) -> dict[str, float]:
    """mem_in_use_gb and mem_peak_gb of a device that reports them (GPUs), else {}."""
    stats = _stats(device)
    if "bytes_in_use" not in stats:
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
    error: BaseException,
    where: str,
    cfg: Config,
    peak_bytes: int,
    device: jax.Device,
    local_devices: int,
    exchange: str = "",
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
    fix = fixes(cfg, local_devices, exchange)
    return OutOfMemory(f"out of device memory {where}: {needs}, {has}; lower the peak with {fix}")


def fixes(cfg: Config, local_devices: int, exchange: str = "") -> str:
    """Settings that lower the peak per device, most effective first, with this run's numbers;
    `exchange`: the expert exchange the job settled on its GPUs (run/kernels.py)."""
    shards = cfg.mesh.data * cfg.mesh.expert * cfg.mesh.fsdp
    micro = cfg.batch_size // cfg.gradient_accumulation_steps // shards  # rows per device per microbatch
    out = []
    if exchange == "padded" and cfg.mesh.expert > 1 and cfg.model.moe.exchange == "auto":
        # auto took the padded exchange for its speed (observe/links.py); its buffers hold
        # mesh.expert x the routed rows, the ragged one's the routed rows.
        out.append(
            f"--model.moe.exchange ragged (auto's padded exchange gives each of the {cfg.mesh.expert} "
            "peers a buffer of the routed rows; slower, less memory)"
        )
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
