"""Bus bandwidth of the collectives a training step runs (all-reduce, all-gather, reduce-scatter,
all-to-all), as nccl-tests defines it, next to what the planner assumes for the target
(observe/links.py's nccl-tests figures, through the forecast's own `Achievable.legs`: not a copy).

nccl-tests (PERFORMANCE.md): S bytes, a device's whole buffer (the larger of its input and output),
moved in t seconds give algbw = S / t and busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for
all-gather, reduce-scatter and all-to-all: the bytes each device's link carries, comparable across n.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.observe import links
from jaxtrain.parallel.mesh import DATA_AXIS
from jaxtrain.plan import forecast
from jaxtrain.plan.targets import TARGETS, GpuTarget

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_BODY: dict[str, Callable[[jax.Array], jax.Array]] = {
    "all-reduce": lambda a: jax.lax.psum(a, DATA_AXIS),
    "all-gather": lambda a: jax.lax.all_gather(a, DATA_AXIS, axis=1, tiled=True),
    "reduce-scatter": lambda a: jax.lax.psum_scatter(a, DATA_AXIS, scatter_dimension=1, tiled=True),
    "all-to-all": lambda a: jax.lax.all_to_all(a, DATA_AXIS, 1, 1, tiled=True),
}


def bus_factor(kind: str, n_devices: int) -> float:
    """nccl-tests' busbw / algbw for `kind` over n devices."""
    return (2.0 if kind == "all-reduce" else 1.0) * (n_devices - 1) / n_devices


def time_collective(mesh: Mesh, kind: str, nbytes: int, iters: int) -> list[float]:
    """Seconds this process waits for each of `iters` runs of `kind` whose largest buffer per device
    is `nbytes` (all-gather: its output; reduce-scatter: its input)."""
    n, values = mesh.devices.size, max(1, nbytes // 4)
    if kind != "all-reduce":  # the gathered, scattered or exchanged axis splits evenly
        values = max(n, values - values % n)
    width = values // n if kind == "all-gather" else values
    x = jax.make_array_from_callback(
        (n, max(width, 1)), NamedSharding(mesh, P(DATA_AXIS)),
        lambda idx: np.ones((1, max(width, 1)), np.float32),
    )  # fmt: skip
    run = jax.jit(jax.shard_map(_BODY[kind], mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS)))
    run(x).block_until_ready()  # compile and warm up outside the timed runs
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return times


def target_of(device_kind: str, name: str = "") -> GpuTarget | None:
    """The planner's target: `name` (--target), else the one whose device kind is these devices'."""
    if name:
        return TARGETS[name]
    return next((t for t in TARGETS.values() if t.device_kind == device_kind), None)


def planner_busbw(target: GpuTarget, kind: str, across_hosts: bool) -> float:
    """The bus bandwidth (bytes/s) the planner's forecast gives `kind` on `target`: over NVLink, or
    each GPU's share of the network across hosts; its fixed latency left out."""
    moved = 1e9
    leg, latency = (
        ("network", links.NETWORK_LATENCY_S) if across_hosts else ("nvlink", links.NVLINK_LATENCY_S)
    )
    seconds = forecast.Achievable(target, 0.0).legs(
        [kind, "", 0.0 if across_hosts else moved, moved if across_hosts else 0.0]
    )[leg]
    return moved / (seconds - latency)


def rows(
    times: Mapping[int, Mapping[str, float]], nbytes: int, n_devices: int, target: GpuTarget | None,
    across_hosts: bool,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per collective: the slowest process's median time counts (all wait for it)."""
    out = []
    for kind in KINDS:
        slowest = max(times, key=lambda p: times[p][kind])
        algbw = nbytes / times[slowest][kind] / 1e9
        busbw = algbw * bus_factor(kind, n_devices)
        planned = planner_busbw(target, kind, across_hosts) / 1e9 if target else None
        out.append({
            "collective": kind, "bytes": nbytes, "time_us": round(times[slowest][kind] * 1e6, 1),
            "algbw_GBps": algbw, "busbw_GBps": busbw, "planner_busbw_GBps": planned,
            "of_planner": busbw / planned if planned else None, "slowest_process": slowest,
        })  # fmt: skip
    return out


def summary(table: list[dict[str, Any]], target: GpuTarget | None) -> str:
    """'all-reduce 412 GB/s (0.90x h100's planned 460), ...' for the check's detail."""
    if not table:
        return ""
    parts = []
    for r in table:
        vs = (
            f" ({r['of_planner']:.2f}x {target.name}'s planned {r['planner_busbw_GBps']:.3g})"
            if target
            else ""
        )
        parts.append(f"{r['collective']} {r['busbw_GBps']:.3g} GB/s{vs}")
    where = "" if target else "; no planner target for these devices (--target)"
    return "each collective: " + ", ".join(parts) + where


def table_lines(table: list[dict[str, Any]]) -> list[str]:
    """The health check's table of `rows`: each collective beside the planner's figure."""
    if not table:
        return []
    lines = [
        "",
        f"collectives at {table[0]['bytes']} bytes per device (busbw as nccl-tests; the planner's figure "
        "for the target, plan/forecast.py)",
        f"  {'collective':<15} {'time_us':>10} {'busbw_GB/s':>11} {'planner_GB/s':>13} {'ratio':>6}",
    ]
    for r in table:
        planned = f"{'-':>13} {'-':>6}"
        if r["of_planner"]:
            planned = f"{r['planner_busbw_GBps']:>13.4g} {r['of_planner']:>6.2g}"
        lines.append(f"  {r['collective']:<15} {r['time_us']:>10.1f} {r['busbw_GBps']:>11.4g} {planned}")
    return lines
