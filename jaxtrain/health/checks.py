"""Health checks one by one: what each process measures, and how process 0 judges all of them.

Measurements (versions, devices, coordinator reachability, collectives, all-reduce timing) run
on every process; the judges are plain functions of plain data, so every verdict is tested
without starting a process. The Report becomes the table for people and the JSON for scripts.
Bandwidth uses the nccl-tests definitions for all-reduce, so figures compare with
`all_reduce_perf`: S bytes per device in t seconds give algbw = S / t, busbw = algbw * 2(n-1)/n.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import socket
import statistics
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.cluster import detect
from jaxtrain.disk.files import write_text
from jaxtrain.health import busbw
from jaxtrain.observe.memory import limit_bytes
from jaxtrain.parallel.mesh import DATA_AXIS

_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain")
_PLUGIN = re.compile(r"jax-(cuda\d+|rocm\d*)-(plugin|pjrt)|libtpu(-nightly)?")
MIN_BYTES = 1024
_CHECK_ROW = 8  # float32 values per device in the exact-value checks


@dataclass
class Check:
    """One step's verdict; `bad` maps each process at fault (-1: not yet known) to what is wrong."""

    name: str
    ok: bool
    detail: str
    bad: dict[int, str] = field(default_factory=dict)


def who(process_id: int, hosts: Mapping[int, str]) -> str:
    """'process 3 on node7', the way every message names a process."""
    name = f"process {process_id}" if process_id >= 0 else "a process with no id yet"
    return f"{name} on {hosts.get(process_id, 'an unknown host')}"


def software_versions(names: tuple[str, ...] = _PACKAGES) -> dict[str, str]:
    """Versions of python and of the packages `names` (default: every package a run depends on),
    'missing' where absent, and the accelerator plugin's."""
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    # The accelerator plugin decides which devices JAX sees; its name depends on vendor and CUDA.
    plugins = sorted(
        f"{name} {d.version}"
        for d in importlib.metadata.distributions()
        if _PLUGIN.fullmatch(name := d.metadata["Name"].lower().replace("_", "-"))
    )
    versions["plugin"] = ", ".join(plugins) or "none"
    return versions


def local_record(spec: detect.LaunchSpec) -> dict[str, Any]:
    """This process's launch, software and device facts, as plain JSON values."""
    devices = jax.local_devices()
    memory = [limit_bytes(d) for d in devices]
    limits = [m for m in memory if m is not None]
    return {
        "process_id": spec.process_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "launch": {"source": spec.source, **spec.details},
        "versions": software_versions(),
        "jax_platforms": os.environ.get("JAX_PLATFORMS", ""),
        "platform": devices[0].platform,
        "platform_version": devices[0].client.platform_version,
        "device_count": len(devices),
        "device_kind": devices[0].device_kind,
        "device_ids": [d.id for d in devices],
        "memory_bytes": min(limits) if len(limits) == len(memory) else None,
    }


def check_network(spec: detect.LaunchSpec, timeout: float) -> Check:
    """Process 0: the coordinator address is one of this host's; others: it accepts TCP in time."""
    if spec.num_processes == 1:
        return Check("network", True, "single process: no coordinator")
    address = spec.coordinator_address
    assert address is not None  # detect() sets it whenever num_processes > 1
    host, _ = detect.split_address(address)
    me = socket.gethostname()
    try:
        socket.getaddrinfo(me, None)
    except OSError:
        # Gloo, JAX's CPU collectives, binds to the address its host name resolves to.
        if os.environ.get("JAX_PLATFORMS") == "cpu" or software_versions()["plugin"] == "none":
            reason = f"this host's name {me} does not resolve (CPU collectives need it): add it to /etc/hosts"
            return Check("network", False, reason, {spec.process_id: reason})
    if spec.process_id == 0:
        try:
            with socket.create_server((host, 0)):
                return Check("network", True, f"coordinator address {address} belongs to this host")
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else str(e)
            reason = (
                f"cannot listen on {host} ({why}); process 0 starts the coordinator, so it must run "
                f"on the host that {address} names"
            )
            return Check("network", False, reason, {0: reason})
    start = time.monotonic()
    if not detect.wait_for_coordinator(address, timeout, poll_s=0.25, attempt_s=2.0):
        reason = f"cannot reach coordinator {address} within {timeout:g} s (nothing listens, or a firewall)"
        return Check("network", False, reason, {spec.process_id: reason})
    return Check("network", True, f"coordinator {address} reached in {time.monotonic() - start:.1f} s")


def _per_device(mesh: Mesh, fn: Callable) -> Callable:
    """Jit `fn` over one row per device; each device keeps its own result."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS)))


def _rows(mesh: Mesh, width: int, value: Callable[[int], float]) -> jax.Array:
    """A (devices, width) float32 global array whose row i, on device i, is value(i)."""
    n = mesh.devices.size

    def row(idx: tuple[slice, ...] | None) -> np.ndarray:
        assert idx is not None  # a sharded (not fully replicated) array: every shard has an index
        # One device holds the whole array: its index is slice(None), no start (an H200 alone met it)
        return np.full((1, width), value(idx[0].start or 0), np.float32)

    return jax.make_array_from_callback((n, width), NamedSharding(mesh, P(DATA_AXIS)), row)


def check_collectives(mesh: Mesh) -> list[str]:
    """All-reduce and all-gather known values; one line per wrong result on this process's devices."""
    n = mesh.devices.size
    x = _rows(mesh, _CHECK_ROW, lambda i: i + 1.0)
    # Small integers are exact in float32: any difference is a fault, not rounding.
    want_sum = n * (n + 1) / 2
    want_all = np.arange(1, n + 1, dtype=np.float32)
    summed = _per_device(mesh, lambda a: jax.lax.psum(a, DATA_AXIS))(x)
    gathered = _per_device(mesh, lambda a: jax.lax.all_gather(a, DATA_AXIS, tiled=True))(x)
    errors = []
    for shard in summed.addressable_shards:
        got = np.asarray(shard.data)
        if not (got == want_sum).all():
            errors.append(f"all-reduce on {shard.device} gave {got[0, 0]:g}, expected {want_sum:g}")
    for shard in gathered.addressable_shards:
        got = np.asarray(shard.data)
        if not (got == want_all[:, None]).all():
            errors.append(f"all-gather on {shard.device} gave {got[:, 0].tolist()}, expected 1..{n}")
    return errors


def sweep_sizes(max_bytes: int) -> list[int]:
    """Message sizes per device: 1 KiB doubling up to max_bytes, like nccl-tests `-b 1K -f 2`."""
    sizes = [MIN_BYTES]
    while sizes[-1] * 2 <= max_bytes:
        sizes.append(sizes[-1] * 2)
    return sizes


def time_all_reduce(mesh: Mesh, nbytes: int, iters: int) -> list[float]:
    """Seconds this process waits for each of `iters` all-reduces of `nbytes` bytes per device."""
    return busbw.time_collective(mesh, "all-reduce", nbytes, iters)


def outliers(values: Mapping[int, Hashable], expected: Hashable | None = None) -> tuple[Any, list[int]]:
    """The reference value (expected, else a strict majority) and the processes that differ.

    With no expected value and a tie for the most common one, nobody can tell which side is
    wrong, so every process is named and the reference is None.
    """
    if expected is None:
        ranked = Counter(values.values()).most_common(2)
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
            return None, sorted(values)
        expected = ranked[0][0] if ranked else None
    return expected, sorted(p for p, v in values.items() if v != expected)


def _mark(bad: dict[int, str], process_id: int, reason: str) -> None:
    bad[process_id] = f"{bad[process_id]}; {reason}" if process_id in bad else reason


def _differ(bad: dict[int, str], values: Mapping[int, Hashable], label: str, expected: Any = None) -> None:
    """Mark every process whose value differs from the expected or majority one."""
    ref, odd = outliers(values, expected)
    for p in odd:
        _mark(
            bad, p, f"{label} {values[p]}" + (f", expected {ref}" if ref is not None else ", others differ")
        )


def judge_software(records: Mapping[int, dict]) -> Check:
    """Every version, compared across processes: the minority (or both sides of a tie) is named."""
    bad: dict[int, str] = {}
    for name in sorted({k for r in records.values() for k in r["versions"]}):
        _differ(bad, {p: r["versions"].get(name, "missing") for p, r in records.items()}, name)
    if bad:
        return Check("software", False, "versions differ between processes", bad)
    versions = records[min(records)]["versions"]
    summary = ", ".join(f"{k} {v}" for k, v in versions.items())
    return Check("software", True, f"{summary}; same on all {len(records)} processes")


def judge_devices(records: Mapping[int, dict], per_process: int = 0, per_host: int = 0) -> Check:
    """Count, platform, kind and memory per process; a 0 expected count means the majority decides."""
    bad: dict[int, str] = {}
    counts = {p: r["device_count"] for p, r in records.items()}
    _differ(bad, counts, "device count", per_process or None)
    for key in ("platform", "device_kind", "memory_bytes"):
        _differ(bad, {p: r[key] for p, r in records.items()}, key.replace("_", " "))
    for p, r in records.items():
        # A GPU wheel with CPU devices means JAX fell back silently (driver, CUDA_VISIBLE_DEVICES).
        if r["platform"] == "cpu" and r["versions"]["plugin"] != "none" and not r["jax_platforms"]:
            _mark(bad, p, f"{r['versions']['plugin']} is installed but JAX found no accelerator")
    if per_host:
        host_counts: Counter[str] = Counter()
        for r in records.values():
            host_counts[r["host"]] += r["device_count"]
        for p, r in records.items():
            if host_counts[r["host"]] != per_host:
                _mark(bad, p, f"its host has {host_counts[r['host']]} devices, expected {per_host}")
    if bad:
        return Check("devices", False, "devices differ from the expected or the majority", bad)
    first = records[min(records)]
    memory = f"{first['memory_bytes'] / 2**30:.1f} GiB" if first["memory_bytes"] else "memory not reported"
    return Check(
        "devices",
        True,
        f"{sum(counts.values())} devices on {len(records)} processes ({counts[min(counts)]} each): "
        f"{first['device_kind']} ({first['platform']}), {memory}",
    )


def judge_collectives(errors: Mapping[int, list[str]], n_devices: int) -> Check:
    """Processes whose devices got a wrong all-reduce or all-gather result."""
    bad = {p: "; ".join(e) for p, e in errors.items() if e}
    if bad:
        return Check("collectives", False, "wrong values after all-reduce / all-gather", bad)
    return Check("collectives", True, f"all-reduce and all-gather exact on {n_devices} devices")


def bus_factor(n_devices: int) -> float:
    """nccl-tests all-reduce bus factor 2(n-1)/n: busbw = algbw * bus_factor."""
    return 2 * (n_devices - 1) / n_devices


def bandwidth_rows(times: Mapping[int, list[float]], sizes: list[int], n_devices: int) -> list[dict]:
    """One row per message size; an all-reduce ends when its slowest process does, so that one counts."""
    rows = []
    for i, nbytes in enumerate(sizes):
        per_process = {p: t[i] for p, t in times.items()}
        slowest = max(per_process, key=per_process.__getitem__)
        algbw = nbytes / per_process[slowest] / 1e9
        rows.append(
            {
                "bytes": nbytes,
                "time_us": round(per_process[slowest] * 1e6, 1),
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * bus_factor(n_devices),
                "slowest_process": slowest,
                "time_us_per_process": [round(per_process[p] * 1e6, 1) for p in sorted(per_process)],
            }
        )
    return rows


def ring_pairs(n: int) -> list[list[tuple[int, int]]]:
    """Neighbours (i, i+1) around a ring of n hosts, in rounds where no host is twice."""
    if n < 3:
        return [[(0, 1)]] if n == 2 else []
    edges = [(i, (i + 1) % n) for i in range(n)]
    last = n - n % 2  # with an odd count the closing edge (n-1, 0) needs a round of its own
    return [edges[0:last:2], edges[1:last:2]] + ([[edges[-1]]] if n % 2 else [])


def pair_rows(times: Mapping[int, list[list]], hosts: list[str], nbytes: int, devices: Counter) -> list[dict]:
    """One row per pair of hosts [a, b, seconds] (indices into `hosts`); the slowest report counts."""
    worst: dict[tuple[int, int], float] = {}
    for entries in times.values():
        for a, b, seconds in entries:
            worst[a, b] = max(worst.get((a, b), 0.0), seconds)
    rows = []
    for (a, b), seconds in sorted(worst.items()):
        busbw = nbytes / seconds / 1e9 * bus_factor(devices[hosts[a]] + devices[hosts[b]])
        time_us = round(seconds * 1e6, 1)
        rows.append({"hosts": [hosts[a], hosts[b]], "bytes": nbytes, "time_us": time_us, "busbw_GBps": busbw})
    return rows


def slow_hosts(pairs: list[dict], factor: float) -> dict[str, str]:
    """Hosts whose best pair is under `factor` x the median host's best pair.

    A slow host drags down both pairs it is in, while each of its neighbours keeps one good
    pair, so only the slow host's best is low. Needs three or more hosts to compare.
    """
    best: dict[str, float] = {}
    for row in pairs:
        for host in row["hosts"]:
            best[host] = max(best.get(host, 0.0), row["busbw_GBps"])
    if len(best) < 3 or not factor:
        return {}
    median = statistics.median(best.values())
    why = "host's best neighbour pair reaches {:.3g} GB/s busbw, under {:g} x the median {:.3g}"
    return {host: why.format(b, factor, median) for host, b in best.items() if b < factor * median}


def judge_bandwidth(
    rows: list[dict], pairs: list[dict], hosts: list[str], min_busbw_gbps: float, slow_factor: float
) -> Check:
    """busbw at the largest size; fails below --min_busbw_gbps or when a slow host stands out."""
    top = rows[-1]
    detail = f"busbw {top['busbw_GBps']:.3g} GB/s at {top['bytes']} bytes"
    if pairs:
        low, high = min(r["busbw_GBps"] for r in pairs), max(r["busbw_GBps"] for r in pairs)
        detail += f"; host pairs {low:.3g}..{high:.3g} GB/s"
    below = bool(min_busbw_gbps) and top["busbw_GBps"] < min_busbw_gbps
    if below:
        detail += f"; below --min_busbw_gbps {min_busbw_gbps:g}"
    slow = slow_hosts(pairs, slow_factor)
    bad = {p: slow[host] for p, host in enumerate(hosts) if host in slow}
    return Check("bandwidth", not (below or slow), detail, bad)


def judge_storage(results: Mapping[int, dict], folder: str) -> Check:
    """Processes that could not write, or see other files than the majority: not one shared directory."""
    bad: dict[int, str] = {}
    for p, r in results.items():
        if r["error"]:
            _mark(bad, p, r["error"])
    everyone = list(range(len(results)))
    seen = {p: tuple(r["seen"]) for p, r in results.items() if not r["error"]}
    # When everyone sees the same complete set there is nothing to vote on.
    _, odd = outliers(seen, tuple(everyone) if all(list(s) == everyone for s in seen.values()) else None)
    for p in odd:
        missing = [q for q in everyone if q not in seen[p]]
        _mark(bad, p, f"cannot see the files of processes {missing}: {folder} is not shared with them")
    if bad:
        return Check("storage", False, f"{folder} is not one directory shared by every process", bad)
    return Check("storage", True, f"{folder} is shared by all {len(results)} processes")


@dataclass
class Report:
    """Everything process 0 knows; becomes the table for people and the JSON for scripts."""

    hosts: dict[int, str] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    processes: list[dict] = field(default_factory=list)
    bandwidth: list[dict] = field(default_factory=list)
    pairs: list[dict] = field(default_factory=list)
    collectives: list[dict] = field(default_factory=list)  # busbw.rows: each kind at the largest size

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def set_processes(self, records: Mapping[int, dict]) -> None:
        self.processes = [records[p] for p in sorted(records)]
        self.hosts.update({p: r["host"] for p, r in records.items()})

    def process_hosts(self) -> list[str]:
        """Host name of each process, by process id (empty until the records are in)."""
        return [r["host"] for r in self.processes]

    @property
    def healthy(self) -> bool:
        return all(c.ok for c in self.checks)

    def bad_processes(self) -> list[dict]:
        return [
            {"process_id": p, "host": self.hosts.get(p, "unknown"), "check": c.name, "reason": reason}
            for c in self.checks
            for p, reason in sorted(c.bad.items())
        ]

    def bad_hosts(self) -> list[str]:
        """Host names to drain or exclude (e.g. sbatch --exclude)."""
        return sorted({b["host"] for b in self.bad_processes()})

    def to_json(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "checks": [
                {"name": c.name, "ok": c.ok, "detail": c.detail}
                | {"bad_processes": [b for b in self.bad_processes() if b["check"] == c.name]}
                for c in self.checks
            ],
            "bad_hosts": self.bad_hosts(),
            "bad_processes": self.bad_processes(),
            "environment": self.environment,
            "bandwidth": self.bandwidth,
            "pairs": self.pairs,
            "collectives": self.collectives,
            "processes": self.processes,
        }

    def host_lines(self) -> list[str]:
        """One verdict line per host: healthy, or the checks that failed there and why."""
        bad: dict[str, list[str]] = {}
        for b in self.bad_processes():
            bad.setdefault(b["host"], []).append(f"{b['check']} (process {b['process_id']}: {b['reason']})")
        hosts = list(dict.fromkeys([*self.process_hosts(), *bad]))
        return [f"host {h}: " + ("UNHEALTHY: " + "; ".join(bad[h]) if h in bad else "healthy") for h in hosts]

    def write_json(self, path: str) -> None:
        """Write atomically, so a reader never sees half a report."""
        write_text(Path(path), json.dumps(self.to_json(), indent=2) + "\n")

    def table(self) -> str:
        env = self.environment
        lines = [
            f"jaxtrain health check: {env.get('num_processes', '?')} process(es), launch source "
            f"{env.get('source', '?')}, coordinator {env.get('coordinator_address') or '-'}",
            f"  {'check':<12} {'result':<6} detail",
        ]
        for c in self.checks:
            detail, bad = c.detail, sorted(c.bad.items())
            if len(bad) == 1 and bad[0][1] == detail:  # a process that judged itself: say who, once
                detail, bad = f"{who(bad[0][0], self.hosts)}: {detail}", []
            lines.append(f"  {c.name:<12} {'ok' if c.ok else 'FAIL':<6} {detail}")
            lines += [f"  {'':<19} {who(p, self.hosts)}: {reason}" for p, reason in bad]
        if self.bandwidth:
            devices = sum(r["device_count"] for r in self.processes)
            lines += [
                "",
                f"all-reduce over {devices} devices (nccl-tests: algbw = bytes / time, "
                "busbw = algbw * 2(n-1)/n; time is the slowest process's median)",
                f"  {'bytes':>10} {'time_us':>10} {'algbw_GB/s':>11} {'busbw_GB/s':>11} {'slowest':>8}",
            ]
            lines += [
                f"  {r['bytes']:>10} {r['time_us']:>10.1f} {r['algbw_GBps']:>11.4g} "
                f"{r['busbw_GBps']:>11.4g} {r['slowest_process']:>8}"
                for r in self.bandwidth
            ]
        if self.pairs:
            lines += [
                "",
                f"neighbouring hosts, all-reduce of {self.pairs[0]['bytes']} bytes over both hosts' devices",
                f"  {'hosts':<30} {'time_us':>10} {'busbw_GB/s':>11}",
            ]
            lines += [
                f"  {' - '.join(r['hosts']):<30} {r['time_us']:>10.1f} {r['busbw_GBps']:>11.4g}"
                for r in self.pairs
            ]
        lines += busbw.table_lines(self.collectives) + [""] + self.host_lines()
        if self.healthy:
            lines.append("verdict: HEALTHY")
        else:
            failed = ", ".join(c.name for c in self.checks if not c.ok)
            lines.append(
                f"verdict: UNHEALTHY ({failed}); bad hosts: {', '.join(self.bad_hosts()) or 'none named'}"
            )
        return "\n".join(lines)
