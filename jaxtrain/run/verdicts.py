"""The preflight at job start: the kernels a joined job resolved to (run/kernels.py), run at its own
shapes on every local device against the CPU-proven ones (run/preflight.py), before its first
compile; the verdicts agreed across processes, cached on disk, and turned into the kernels it runs.

    cleared = clear(job, settled, dtype, faults)   # build's, for a joined job (run/build.py)
    cleared.model                                  # settled, or with auto's fallbacks

`auto` that resolved to a kernel that fails falls back down its chain (kernels.fallen_back, model/
auto.py FALLBACK) to the first kernel proven: on CPU (XLA's attention, `ragged_dot`, the padded
exchange), or a GPU-only one (pallas_fp8's bf16 tiles) by its own checks run then on these devices,
with one warning line; a kernel chosen by name that fails is refused in one line (exit 2). Every
process takes the same decision from the same gathered verdicts, and a failure on some processes
only names their hosts (a bad GPU rather than a kernel bug).
Only passes are cached (cache_root()/preflight): a failure is checked again on the next run, as a
replaced GPU or driver may pass. The key holds the versions, the driver, the devices, the host, the
checks' names (their shapes and dtype) and the source of the kernels checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxtrain.config import Config, ConfigError, ModelConfig
from jaxtrain.disk.files import cache_root, write_text
from jaxtrain.faults import Faults
from jaxtrain.run import kernels
from jaxtrain.run import preflight as preflight_lib
from jaxtrain.run.job import Job
from jaxtrain.run.preflight import Check, Choices, Verdict

KINDS = ("attention", "grouped_matmul", "exchange", "matmul")  # a verdict vector's order: one bit a kind
# What auto checks: the GPU-only kernels.
GPU_ONLY = {"attention": ("cudnn",), "grouped_matmul": ("pallas", "pallas_fp8"), "exchange": ("ragged",),
            "matmul": ("cublaslt",)}  # fmt: skip
KEYS = {"attention": "model.attention_impl", "grouped_matmul": "model.moe.grouped_matmul",
        "exchange": "model.moe.exchange", "matmul": "model.matmul"}  # fmt: skip
# A check's kind, by its name's first word (run/preflight.py names them so).
KIND_OF = {"attention": "attention", "expert_mlps": "grouped_matmul", "ragged_matmul": "grouped_matmul",
           "grouped_matmul": "grouped_matmul", "exchange": "exchange", "fp8_matmul": "matmul"}  # fmt: skip
VERSIONED = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
CHECK_LENGTH = 512  # tokens of the attention check at most: a small problem (the job's if shorter)


@dataclass(frozen=True)
class Cleared:
    """What the preflight decided: the model's kernels, the lines to log, what it ran."""

    model: ModelConfig
    warnings: tuple[str, ...] = ()  # process 0: the agreed lines; others: their own failures
    summary: str = "preflight: off"
    checked: int = 0  # checks run here (0: none, or all cached)
    cached: bool = False
    seconds: float = 0.0

    def say(self, log: logging.Logger) -> None:
        """Into the run's log: what was checked, then each failure's line."""
        log.info(self.summary)
        for line in self.warnings:
            log.warning(line)


def choices(cfg: Config, settled: ModelConfig, dtype: Any, platform: str) -> Choices:
    """The kernels `cfg.preflight` checks (auto: the GPU-only ones; on: all) at the job's shapes."""
    m, t = settled, cfg.mesh.tensor
    moe = m.moe.n_experts > 0
    chosen = {
        "attention": m.attention_impl,
        "grouped_matmul": m.moe.grouped_matmul if moe else "",
        "exchange": m.moe.exchange if moe and cfg.mesh.expert > 1 else "",
        # FP8 projections: cuBLASLt's FP8 GEMM on GPUs (what XLA must emit), XLA's own dot on CPUs
        "matmul": ("xla" if platform == "cpu" else "cublaslt") if "fp8" in (m.matmul, m.head_matmul) else "",
    }
    kept = {k: v if v and (cfg.preflight == "on" or v in GPU_ONLY[k]) else "" for k, v in chosen.items()}
    n, kv = m.n_head, m.kv_heads  # per tensor shard: the heads one device attends over
    heads = (n // t if n % t == 0 else n, max(1, kv // t) if kv % t == 0 or kv < t else kv)
    return Choices(
        **kept,
        dtype=jnp.dtype(dtype).name,
        heads=(*heads, m.head_size, m.v_size),
        documents=m.doc_bos >= 0 or m.doc_eos >= 0,
        d_model=m.d_model,
        expert_dim=m.expert_dim // t,
        d_ff=m.ff_dim // t,
        length=min(CHECK_LENGTH, m.seq_len),
    )


def clear(job: Job, settled: ModelConfig, dtype: Any, faults: Faults | None) -> Cleared:
    """The preflight of a joined job (`cfg.preflight` not off): see the module's docstring."""
    t0 = time.perf_counter()
    picked = choices(job.cfg, settled, dtype, job.platform)
    checks = preflight_lib.checks(picked, job.local_devices[0].platform, _capability(job))
    if not checks:  # the same on every process (same config, same platform): no collective
        return Cleared(settled, summary="preflight: nothing GPU-only to check")
    key = _key(job, checks) if faults is None else None  # a planted fault is never cached
    cached = key is not None and _cached(key)
    verdicts = [] if cached else _run(checks, job.local_devices, faults)
    failed = {KIND_OF[v.name.split()[0]] for v in verdicts if not v.passed and not v.informational}
    if key is not None and not cached and not failed:
        with contextlib.suppress(OSError):  # a cache that cannot be written: the next run checks again
            write_text(_path(key), json.dumps({"key": key, "verdicts": [v.line() for v in verdicts]}) + "\n")
    where = _agree(job, failed)
    model, lines = _decide(job, settled, where, verdicts, _prover(job, dtype, faults))
    spent = time.perf_counter() - t0
    said = (
        "cached: passed before" if cached else f"{len(checks)} check(s) on {len(job.local_devices)} device(s)"
    )
    summary = f"preflight ({', '.join(c.name for c in checks)}): {said}, {spent:.1f} s"
    return Cleared(model, tuple(lines), summary, 0 if cached else len(checks), cached, spent)


def _run(checks: Sequence[Check], devices: Sequence[Any], faults: Faults | None) -> list[Verdict]:
    """Each check on each local device (preflight.on_each); a fault's check gets its kernel's
    outputs skewed."""
    planted = [_skewed(c) if faults and faults.preflight_differs(c.name) else c for c in checks]
    return preflight_lib.on_each(planted, devices)


def _skewed(check: Check) -> Check:
    """`check` with its kernel's outputs off by one: what a wrong kernel or a bad GPU gives."""

    def compute(devices: Sequence[Any]) -> preflight_lib.Compared:
        return {k: (got + 1, want) for k, (got, want) in check.compute(devices).items()}

    return dataclasses.replace(check, compute=compute)


def _agree(job: Job, failed: set[str]) -> dict[str, list[tuple[int, str]]]:
    """Each failed kind -> the (process, host) it failed on, the same on every process."""
    vectors = job.gather(sum(1 << i for i, k in enumerate(KINDS) if k in failed))
    if not any(vectors):
        return {}
    hosts = job.gather_text(socket.gethostname())
    return {
        k: [(p, hosts[p]) for p, bits in enumerate(vectors) if bits >> i & 1]
        for i, k in enumerate(KINDS)
        if any(bits >> i & 1 for bits in vectors)
    }


def _decide(
    job: Job,
    settled: ModelConfig,
    where: dict[str, list[tuple[int, str]]],
    verdicts: list[Verdict],
    prove: Callable[[ModelConfig, str], str] | None = None,
) -> tuple[ModelConfig, list[str]]:
    """Fallbacks for auto, a ConfigError for a kernel chosen by name (or one with no fallback). A
    fallback runs only where it is proven: on CPU (model/auto.py PROVEN), or by `prove` on these
    devices (its checks run and agreed on now: "" where they pass, else why not); one that is not
    is passed over for the next of its chain (pallas_fp8's bf16 tiles, then ragged_dot)."""
    mine = [v for v in verdicts if not v.passed and not v.informational]
    lines = [] if job.is_main else [f"preflight on this process: {v.line()}" for v in mine]
    model = settled
    for kind, failing in where.items():
        impl = _impl(settled, kind, job)
        what = f"preflight: {_what(kind, impl)} failed {_on(job, failing)}"
        reason = next((v.failed for v in mine if KIND_OF[v.name.split()[0]] == kind), "")
        what += f" ({reason.split('; ')[0]})" if reason else ""  # its first output: the rest in the log
        # The FP8 grouped matmul, asked for by name, falls back too: no GPU had run it when it
        # shipped, and its bf16 tiles or ragged_dot train the same model.
        soft = _requested(job.cfg.model, kind) == "auto" or impl == "pallas_fp8"
        fallback = kernels.fallen_back(model, kind) if soft else None
        passed_over = []
        while fallback is not None and not kernels.proven_on_cpu(fallback, kind):
            unproven = prove(fallback, kind) if prove is not None else "no check ran on these devices"
            if not unproven:
                break
            passed_over.append(f"{_what(kind, _impl(fallback, kind, job))} not proven here ({unproven}); ")
            fallback = kernels.fallen_back(fallback, kind)
        if fallback is None:
            raise ConfigError(f"{what}; {_fix(kind, impl)}, or --preflight off to run it anyway")
        model = fallback
        if job.is_main:
            lines.append(
                f"{what}; {''.join(passed_over)}running {_what(kind, _impl(model, kind, job))} instead"
            )
    return model, lines


def _prover(job: Job, dtype: Any, faults: Faults | None) -> Callable[[ModelConfig, str], str]:
    """`_decide`'s `prove`: the preflight's checks of a fallback's kernel of `kind` on this process's
    devices, agreed across processes: "" where they pass everywhere, else the first failure's line."""

    def prove(model: ModelConfig, kind: str) -> str:
        picked = choices(dataclasses.replace(job.cfg, preflight="on"), model, dtype, job.platform)
        others: dict[str, Any] = {k: "" for k in KINDS if k != kind}
        only = dataclasses.replace(picked, **others)
        checks = preflight_lib.checks(only, job.local_devices[0].platform, _capability(job))
        failed = [v for v in _run(checks, job.local_devices, faults) if not v.passed and not v.informational]
        anywhere = any(job.gather(int(bool(failed))))
        if not anywhere:
            return ""
        return failed[0].failed.split("; ")[0] if failed else "it failed on another process"

    return prove


def _on(job: Job, failing: list[tuple[int, str]]) -> str:
    if len(failing) == job.process_count:
        return "on every process" if job.process_count > 1 else f"on {job.device_kind}"
    named = ", ".join(f"process {p} (host {h})" for p, h in failing)
    return f"on {named} only, of {job.process_count} processes: a bad GPU there? (logs/process_<i>.log)"


def _impl(cfg: ModelConfig, kind: str, job: Job) -> str:
    if kind == "attention":
        return cfg.attention_impl
    if kind == "grouped_matmul":
        return cfg.moe.grouped_matmul
    if kind == "matmul":
        return "xla" if job.platform == "cpu" else "cublaslt"
    return cfg.moe.exchange


def _what(kind: str, impl: str) -> str:
    return {"attention": f"{impl} attention", "grouped_matmul": f"the {impl} grouped matmul",
            "exchange": f"the {impl} expert exchange",
            "matmul": f"the FP8 matmuls ({impl})"}[kind]  # fmt: skip


def _requested(cfg: ModelConfig, kind: str) -> str:
    """What the user's config asked for: auto, or a kernel by name (FP8 is asked for by name, never
    by auto)."""
    if kind == "attention":
        return cfg.attention_impl
    if kind == "matmul":
        return "fp8"
    return cfg.moe.grouped_matmul if kind == "grouped_matmul" else cfg.moe.exchange


def _fix(kind: str, impl: str) -> str:
    if kind == "matmul":
        return "use --model.matmul compute --model.head_matmul compute (bf16 projections)"
    return f"use --{KEYS[kind]} auto (it falls back to the kernel proven on CPU)"


def _capability(job: Job) -> str:
    return str(getattr(job.local_devices[0], "compute_capability", ""))


# ------------------------------------------------------------------------------------ cache


def _key(job: Job, checks: Sequence[Check]) -> dict[str, Any]:
    """What a cached pass holds for: versions, driver, devices, host, checks, the kernels' source."""
    device = job.local_devices[0]
    return {
        "versions": {p: _version(p) for p in VERSIONED},
        "platform_version": str(device.client.platform_version),  # GPUs: the CUDA driver, runtime
        "device": device.device_kind,
        "capability": _capability(job),
        "local_devices": len(job.local_devices),
        "host": socket.gethostname(),
        "checks": [c.name for c in checks],
        "source": _source_hash(),
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _source_hash() -> str:
    """The checks' and the checked kernels' modules, hashed: a kernel edited is checked again."""
    modules = {place.split(":")[0] for places in preflight_lib.KERNELS.values() for place in places}
    digest = hashlib.sha256()
    for name in sorted(modules | {preflight_lib.__name__, __name__}):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()


def _path(key: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_root() / "preflight" / f"{name}.json"


def _cached(key: dict[str, Any]) -> bool:
    """A pass cached under `key` (an unreadable entry is no entry)."""
    try:
        return json.loads(_path(key).read_text()).get("key") == key
    except (OSError, ValueError):
        return False
