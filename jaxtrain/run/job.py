"""Where this process sits in the job, resolved once per launch: the one holder of topology facts.

    launch = detect(cfg.dist)              # no jax: who started us, how many processes, our rank
    check_launch(cfg, launch)              # before joining, so every process fails alike
    job = Job.join(cfg, launch)            # join the others; mesh and batch resolved on the devices
    job = Job.of_devices(cfg, devices)     # a cluster that is not this one (the GPU planner)

`job.cfg` is the config resolved against the devices (`with_topology`: mesh sizes, global batch in
sequences, microbatches). Nothing else in the training core asks jax for devices, process ids or
the backend: the job says them, and it does the multi-process chores (barrier, broadcast, any).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from jaxtrain.cluster import detect, join
from jaxtrain.cluster.detect import LaunchSpec
from jaxtrain.config import MESH_AXES, Config, ConfigError, MeshConfig, global_rows, mesh_str
from jaxtrain.config.batch import batch_plan, check_batch_split


@dataclass(frozen=True)
class Job:
    cfg: Config  # resolved against `devices`
    launch: LaunchSpec | None  # None for a described cluster (nothing was launched)
    devices: tuple[Any, ...]  # every device of the job
    process_index: int
    process_count: int

    @classmethod
    def join(cls, cfg: Config, launch: LaunchSpec) -> Job:
        """Join the job's other processes (jax.distributed), then resolve the config on its devices."""
        join.initialize(cfg.dist, launch)
        import jax

        devices = tuple(jax.devices())
        _check_gpus_seen(devices)
        if cfg.compat.world_size and launch.num_processes == 1:
            devices = _world_of_one_process(cfg.compat.world_size, devices)
        return cls._resolved(cfg, launch, devices, jax.process_index(), jax.process_count())

    @classmethod
    def of_devices(cls, cfg: Config, devices: list[Any]) -> Job:
        """A job over `devices` that need not be this process's (e.g. a GPU cluster's topology
        description): process 0 of the processes the devices name. Joins nothing, touches nothing."""
        n_processes = len({d.process_index for d in devices})
        return cls._resolved(cfg, None, tuple(devices), 0, n_processes)

    @classmethod
    def _resolved(
        cls, cfg: Config, launch: LaunchSpec | None, devices: tuple[Any, ...], index: int, count: int
    ) -> Job:
        return cls(with_topology(cfg, len(devices), count, _platform(devices)), launch, devices, index, count)

    @property
    def is_main(self) -> bool:
        """Process 0: the one that talks to people and writes the run's shared files."""
        return self.process_index == 0

    @property
    def local_devices(self) -> tuple[Any, ...]:
        return tuple(d for d in self.devices if d.process_index == self.process_index)

    @property
    def platform(self) -> str:
        return _platform(self.devices)

    @property
    def device_kind(self) -> str:
        return str(self.devices[0].device_kind)

    def describe(self) -> str:
        return f"{self.process_count} process(es) x {len(self.local_devices)} {self.device_kind} device(s)"

    def barrier(self, name: str) -> None:
        """Every process waits here for the others (nothing to wait for alone)."""
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(name)

    def broadcast(self, value: int) -> int:
        """Process 0's `value`, on every process."""
        if self.process_count == 1:
            return value
        import numpy as np
        from jax.experimental import multihost_utils

        return int(multihost_utils.broadcast_one_to_all(np.int32(value)))

    def gather(self, value: int) -> list[int]:
        """Every process's `value`, in process order (a collective: every process must ask)."""
        if self.process_count == 1:
            return [value]
        import numpy as np
        from jax.experimental import multihost_utils

        return [int(v) for v in np.ravel(multihost_utils.process_allgather(np.int32(value)))]

    def gather_text(self, text: str, size: int = 256) -> list[str]:
        """Every process's `text` (its first `size` UTF-8 bytes), in process order (a collective)."""
        if self.process_count == 1:
            return [text]
        import numpy as np
        from jax.experimental import multihost_utils

        mine = np.zeros(size, np.uint8)
        raw = text.encode()[:size]
        mine[: len(raw)] = np.frombuffer(raw, np.uint8)
        rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, size)
        return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]


def _check_gpus_seen(devices: tuple[Any, ...]) -> None:
    """Refuse to train on the CPU of a machine whose NVIDIA GPUs jax cannot see (jax installed for
    CPUs only): one line, the fix. JAX_PLATFORMS=cpu says the CPU is meant."""
    if devices[0].platform != "cpu" or os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return
    gpus = detect.nvidia_gpus()
    if gpus:
        raise ConfigError(
            f"this machine has {len(gpus)} NVIDIA GPU(s) (nvidia-smi) but jax sees only its CPU: install "
            "jax for CUDA (pip install -c constraints.txt -e '.[cuda12]'), or set JAX_PLATFORMS=cpu "
            "to train on the CPU"
        )


def _platform(devices: tuple[Any, ...]) -> str:
    """cpu or gpu: what the rules for dtypes, backends and kernels ask of a job's devices."""
    return "cpu" if devices[0].platform == "cpu" else "gpu"


def _world_of_one_process(world_size: int, devices: tuple[Any, ...]) -> tuple[Any, ...]:
    """The guides' `--world_size N` in one process (their one-process-per-GPU spawn): in JAX one
    process drives its devices, so it trains on N of them, if there are N."""
    if world_size > len(devices):
        kind = devices[0].platform
        raise ConfigError(
            f"--world_size {world_size} but this process has {len(devices)} {kind} device(s); use at most "
            f"{len(devices)}, start {world_size} processes (torchrun --nproc_per_node={world_size} "
            "scripts/train.py ...), or drop --world_size"
        )
    return devices[:world_size]


# ------------------------------------------------------------------------------------- checks
# The rules that need the launch (before joining) or the devices (after): the config's own value
# checks, which need neither, are in jaxtrain/config/checks.py.


def check_launch(cfg: Config, launch: LaunchSpec) -> None:
    """The global batch splits evenly between processes (each loads its own rows); the guides'
    --world_size, --local_rank and --single_gpu agree with the launcher."""
    c, n_processes = cfg.compat, launch.num_processes
    start = f"torchrun --nproc_per_node={c.world_size} scripts/train.py ..."
    if not cfg.ddp.enabled and n_processes > 1:
        raise ConfigError(
            f"ddp.enabled is false but this job has {n_processes} processes; start one process, or set "
            "ddp.enabled true (distribution is detected from the launcher)"
        )
    # One process with --world_size N means N local devices (checked once they are known).
    if c.world_size and c.world_size != n_processes and n_processes > 1:
        raise ConfigError(
            f"--world_size {c.world_size} but this job has {n_processes} process(es); jaxtrain starts no "
            f"processes itself: {start}, or drop --world_size"
        )
    if c.single_gpu and n_processes > 1:
        raise ConfigError(f"--single_gpu but this job has {n_processes} processes; start one, or drop it")
    local_rank = 0 if launch.local_rank is None and n_processes == 1 else launch.local_rank
    if c.local_rank >= 0 and local_rank is not None and c.local_rank != local_rank:
        raise ConfigError(
            f"--local_rank {c.local_rank} but the launcher says this process's local rank is "
            f"{local_rank}; drop --local_rank (jaxtrain reads it from the launcher)"
        )
    check_batch_split(global_rows(cfg), n_processes)


OPTIONAL = ("pipeline", "expert", "context")  # axes a mesh leaves at 1 unless asked for: unsaid in advice


def resolve_mesh(mesh: MeshConfig, n_devices: int) -> MeshConfig:
    """Fill in the -1 axis; the product must be the device count (the error gives one that is)."""
    sizes = {a: getattr(mesh, a) for a in MESH_AXES}
    known = math.prod(n for n in sizes.values() if n != -1)
    free = [a for a, n in sizes.items() if n == -1]
    if free and n_devices % known == 0:
        sizes[free[0]] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        inner = {a: n for a, n in sizes.items() if a != "data" and n != -1 and (a not in OPTIONAL or n > 1)}
        fits = n_devices % math.prod(inner.values()) == 0
        hint = (
            f"--mesh.data -1 {' '.join(f'--mesh.{a} {n}' for a, n in inner.items())}"
            if fits
            else _fsdp_hint(inner, n_devices)
        )
        raise ConfigError(
            f"mesh {mesh_str({a: getattr(mesh, a) for a in MESH_AXES})} does not multiply to the "
            f"{n_devices} devices of this job; e.g. {hint}"
        )
    return dataclasses.replace(mesh, **sizes)


def _fsdp_hint(inner: dict[str, int], n_devices: int) -> str:
    """A mesh that multiplies to n_devices: the expert and context sizes given where they divide it
    (a mixture of experts needs its expert axis), every other device in fsdp."""
    kept = {a: n for a, n in inner.items() if a in OPTIONAL and n_devices % n == 0}
    flags = "".join(f" --mesh.{a} {n}" for a, n in kept.items())
    return f"--mesh.data -1{flags} --mesh.fsdp {n_devices // math.prod(kept.values())} --mesh.tensor 1"


def with_topology(cfg: Config, n_devices: int, n_processes: int, platform: str = "cpu") -> Config:
    """Resolve the mesh and batch settings against the devices; errors give the numbers."""
    check_batch_split(global_rows(cfg), n_processes)
    if cfg.dtype == "float16" and platform == "cpu":
        raise ConfigError(
            "dtype float16 needs a GPU (XLA:CPU has no float16 matmul with float32 accumulation); "
            "use --dtype bfloat16 on CPU"
        )
    if cfg.compat.backend == "nccl" and platform != "gpu":
        raise ConfigError(
            f"--backend nccl needs GPUs, but this job runs on {platform}; use --backend gloo or drop "
            "--backend (JAX picks NCCL between GPUs, gloo between CPU processes)"
        )
    if cfg.compat.single_gpu and n_devices != 1:
        raise ConfigError(
            f"--single_gpu but this process sees {n_devices} {platform} devices; on CPU drop "
            "--xla_force_host_platform_device_count from XLA_FLAGS, or drop --single_gpu"
        )
    mesh = resolve_mesh(cfg.mesh, n_devices)
    if cfg.model.d_model % mesh.fsdp:
        raise ConfigError(
            f"model.d_model {cfg.model.d_model} is not divisible by mesh.fsdp {mesh.fsdp}: FSDP splits "
            "every param along d_model; use an fsdp size that divides it"
        )
    # A tensor group shares its rows: the batch is split over data x expert x fsdp only.
    batch, accum = batch_plan(cfg, mesh.data * mesh.expert * mesh.fsdp, n_devices)
    return dataclasses.replace(cfg, batch_size=batch, gradient_accumulation_steps=accum, mesh=mesh)
