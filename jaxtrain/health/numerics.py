"""Numbers every GPU of an allocation must get right: the preflight's kernel checks (run/preflight.py)
on each local GPU, a fixed-seed matmul whose checksum every device must agree on (silent data
corruption: the odd one out is named), and the experts' exchange checked exact across hosts (a
plain all-to-all of known values, and the ragged exchange against its padded reference).

Measured on every process (`measure_*`), judged by process 0 from plain data (`judge_*`, `vote`), as
the rest of the health check (checks.py, runner.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.health.checks import Check, who
from jaxtrain.model import auto
from jaxtrain.parallel.mesh import DATA_AXIS
from jaxtrain.run import preflight as pf

# The health check's kernel problem: the widths of Qwen3-30B-A3B's experts (the Pallas kernels' tiles
# take them), Llama 3 8B's heads, documents masked; bfloat16, as training runs them.
KERNEL_HEADS = (32, 8, 128, 128)  # query heads, key/value heads, head and value size
KERNEL_WIDTHS = (2048, 768)  # d_model, each expert's hidden size
KERNEL_FF = 8192  # the FP8 projection's width (d_model to 4 x d_model: an MLP's)
FP8_CAPABILITY = 8.9  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on; before them no FP8 GEMM
CHECKSUM_SIZE = {"gpu": 4096, "cpu": 256}  # the matmul's side: 137 GFLOP a GPU, a CPU's moment
CHECKSUM_TOLERANCE = 1e-5  # relative: one kind of device, one program, same inputs: equal, or nearly


def kernel_choices(platform: str, capability: str, mode: str) -> pf.Choices:
    """The kernels to check on each device: auto, the GPU-only ones auto runs there (model/auto.py's
    rules, at the kernel problem's widths; none on CPUs); on, every one (a CPU's: those proven on it)."""
    gpu = platform == "gpu"
    if not gpu and mode != "on":
        return pf.Choices()
    fp8 = not gpu or float(capability or 0) >= FP8_CAPABILITY
    heads, d, ff, d_ff = KERNEL_HEADS, KERNEL_WIDTHS[0], KERNEL_WIDTHS[1], KERNEL_FF
    if not gpu:  # a CPU checks the path, small
        heads, d, ff, d_ff = (4, 2, 32, 32), 128, 64, 96
    rules = {
        "attention": auto.attention(platform, "bfloat16", heads[2], capability),
        "grouped_matmul": auto.grouped_matmul(platform, capability, d, ff, "bfloat16"),
    }
    return pf.Choices(
        **(rules if gpu else {k: auto.PROVEN[k] for k in rules}),  # a CPU's: the path, at the least compile
        dtype="bfloat16",
        heads=heads,
        documents=True,
        d_model=d,
        expert_dim=ff,
        length=512 if gpu else 64,
        matmul=("cublaslt" if gpu else "xla") if fp8 else "",  # FP8 projections: model/fp8.py
        d_ff=d_ff,
    )


def measure_kernels(devices: Sequence[Any], mode: str) -> list[str]:
    """The preflight's checks on each of `devices` alone (pf.on_each); one line per failure."""
    capability = str(getattr(devices[0], "compute_capability", ""))
    found = pf.checks(kernel_choices(devices[0].platform, capability, mode), devices[0].platform, capability)
    if not found:
        return []
    failed = [v for v in pf.on_each(found, devices) if not v.passed and not v.informational]
    return [f"{v.name}: {v.failed}" for v in failed]


def judge_kernels(failures: Mapping[int, list[str]], n_devices: int, checked: bool, platform: str) -> Check:
    """Processes whose GPUs failed a kernel check."""
    bad = {p: "; ".join(f) for p, f in failures.items() if f}
    if bad:
        return Check("kernels", False, "a kernel differs from its reference on some GPUs", bad)
    if not checked:
        return Check("kernels", True, "nothing GPU-only to check on these devices (--kernels on: all)")
    each = f"each of {n_devices} devices" if platform != "cpu" else "each process's first CPU device"
    return Check("kernels", True, f"the preflight's kernel checks pass on {each}")


def matmul_checksums(devices: Sequence[Any]) -> dict[str, list[float]]:
    """A fixed-seed matmul on each of `devices` (one program over them all: one compile, run on every
    device at once), in float32 at full precision and in bfloat16 (the tensor cores' path): each
    result's sum, by device id. Every healthy device of one kind computes the same."""
    n = CHECKSUM_SIZE["cpu" if devices[0].platform == "cpu" else "gpu"]
    rng = np.random.default_rng(20261128)
    mesh = Mesh(np.array(devices), (DATA_AXIS,))
    a, b = (jax.device_put(rng.standard_normal((n, n), np.float32) / math.sqrt(n), NamedSharding(mesh, P()))
            for _ in "ab")  # fmt: skip
    each = jax.jit(jax.shard_map(_sums, mesh=mesh, in_specs=(P(), P()), out_specs=P(DATA_AXIS)))
    return {str(s.device.id): np.asarray(s.data).reshape(-1).tolist() for s in each(a, b).addressable_shards}


def _sums(a: jax.Array, b: jax.Array) -> jax.Array:
    full = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    half = jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return jnp.stack([jnp.sum(jnp.tanh(full) * a), jnp.sum(jnp.tanh(half) * b)])[None]


def vote(
    values: Mapping[Hashable, float], tolerance: float = CHECKSUM_TOLERANCE
) -> tuple[float | None, list]:
    """The value a strict majority agree on (within `tolerance`, relative) and those off it; with
    no majority nobody can tell who is wrong: (None, every one). NaN is never agreed on."""
    keys = list(values)
    close = {
        k: [j for j in keys if abs(values[j] - values[k]) <= tolerance * max(abs(values[k]), 1e-30)]
        for k in keys
    }
    best = max(keys, key=lambda k: len(close[k]), default=None)
    if best is None or 2 * len(close[best]) <= len(keys) or not math.isfinite(values[best]):
        return None, sorted(keys, key=str)
    return values[best], sorted((k for k in keys if k not in close[best]), key=str)


def judge_checksums(per_process: Mapping[int, Mapping[str, list[float]]], hosts: Mapping[int, str]) -> Check:
    """Every device's checksums voted on; the odd ones named by device, process and host."""
    flat = {(p, d): tuple(v) for p, ds in per_process.items() for d, v in ds.items()}
    bad: dict[int, str] = {}
    for i, label in enumerate(("float32", "bfloat16")):
        reference, odd = vote({k: v[i] for k, v in flat.items()})
        for p, d in odd:
            why = f"device {d}'s {label} matmul checksum {flat[p, d][i]!r}"
            why += f", the others' {reference!r}" if reference is not None else ": no majority agrees"
            bad[p] = f"{bad[p]}; {why}" if p in bad else why
    if bad:
        named = ", ".join(who(p, hosts) for p in sorted(bad))
        return Check("checksum", False, f"matmul results differ (silent data corruption?) on {named}", bad)
    return Check("checksum", True, f"a fixed-seed matmul gives the same result on all {len(flat)} devices")


def measure_exchange(devices: Sequence[Any], mode: str) -> list[str] | None:
    """All-to-all of known values over every device, then the experts' ragged exchange against its
    padded reference, a GPU-only kernel checked as the kernels are (`mode`: --kernels; a CPU's is the
    padded one against itself, with on): one line per wrong result here. None where processes hold
    unlike device counts (the devices step names them): no job's mesh spans such devices, and jax
    cannot place one array over them."""
    if len(set(Counter(d.process_index for d in devices).values())) > 1:
        return None
    errors = _all_to_all_errors(Mesh(np.array(devices), (DATA_AXIS,)))
    impl = "padded" if devices[0].platform == "cpu" else "ragged"
    if mode == "off" or (impl == "padded" and mode != "on"):
        return errors
    p, slices = len(devices), 3
    rows, d = (max(128, 8 * p * slices), 64) if impl == "padded" else (max(512, 8 * p * slices), 256)
    verdict = pf.run_check(pf.exchange_check(impl, slices, d=d, rows=rows), devices)
    if not verdict.passed:
        errors.append(f"{verdict.name}: {verdict.failed}")
    return errors


def _all_to_all_errors(mesh: Mesh) -> list[str]:
    """Device i sends j the value i * n + j: each device must receive exactly i * n + (itself)."""
    n = mesh.devices.size
    x = jax.make_array_from_callback(
        (n, n), NamedSharding(mesh, P(DATA_AXIS)),
        lambda idx: (_start(idx) * n + np.arange(n, dtype=np.float32))[None],
    )  # fmt: skip
    swap = jax.shard_map(
        lambda a: jax.lax.all_to_all(a, DATA_AXIS, 1, 1, tiled=True), mesh=mesh, in_specs=P(DATA_AXIS),
        out_specs=P(DATA_AXIS),
    )  # fmt: skip
    out = jax.jit(swap)(x)
    errors = []
    for shard in out.addressable_shards:
        j = _start(shard.index)
        want = np.arange(n, dtype=np.float32) * n + j
        got = np.asarray(shard.data).reshape(-1)
        if not np.array_equal(got, want):
            errors.append(f"all-to-all on {shard.device} gave {got.tolist()}, expected {want.tolist()}")
    return errors


def _start(index: tuple[slice, ...] | None) -> int:
    assert index is not None  # a sharded array: every shard has an index
    return int(index[0].start or 0)


def judge_exchange(errors: Mapping[int, list[str] | None], n_devices: int) -> Check:
    if any(e is None for e in errors.values()):
        return Check("exchange", True, "not run: processes hold unlike device counts (see devices)")
    bad = {p: "; ".join(e) for p, e in errors.items() if e}
    if bad:
        return Check("exchange", False, "wrong rows after all-to-all or the experts' exchange", bad)
    return Check(
        "exchange", True, f"all-to-all (and the experts' exchange, as --kernels) exact on {n_devices} devices"
    )
