"""GPU targets we can compile for without owning one: one table, each figure with its source (their
peak FLOP/s: jaxtrain/observe/peaks.py, the table the MFU of training logs uses too).

    devices = target_devices("h100", hosts=2, gpus_per_host=8)   # after use_plugin(), before jax starts

XLA's GPU compiler needs only a description of the device (`GpuTargetConfig`, a text proto) to
compile for it, so `jax.experimental.topologies.get_topology_desc` gives devices of a cluster that
is not here, each with its process (host) index. That needs the CUDA plugin of the installed jax,
which lives outside the venv (`make gpu-plugin` installs it into .cuda-plugin/) so that CPU runs
never load it: `use_plugin()` puts it on sys.path for the one process that asks.

Bandwidths are per direction, per GPU. Sources:
  [H100]  NVIDIA H100 Tensor Core GPU datasheet (SXM5 column),
          https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
  [H200]  NVIDIA H200 Tensor Core GPU datasheet (SXM column), https://www.nvidia.com/en-us/data-center/h200/
  [A100]  NVIDIA A100 Tensor Core GPU datasheet (SXM columns),
          https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
  [L40S]  NVIDIA L40S datasheet, https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413
  [B200]  NVIDIA HGX B200 / DGX B200 datasheets (8-GPU totals divided by 8; sparse rates halved),
          https://www.nvidia.com/en-us/data-center/hgx/ and https://www.nvidia.com/en-us/data-center/dgx-b200/
  [DGX]   DGX H100/H200/B200 user guides: eight ConnectX-7 400 Gb/s compute NICs, one per GPU; DGX A100 user
          guide: eight ConnectX-6 200 Gb/s HDR NICs, one per GPU
  [CUDA]  CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (threads,
          shared memory, registers per SM and per block)
  [XLA]   the device description XLA reads from a real H100 80GB HBM3 (its memory size in bytes as
          cudaMemGetInfo reports it), printed in jax-ml/jax issue 28376 and openxla/xla PR 25919
  [smi]   nvidia-smi's total memory of the card (MiB)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxtrain import xla_env
from jaxtrain.cluster import lifeline
from jaxtrain.disk.files import cache_root
from jaxtrain.errors import UserError
from jaxtrain.observe import peaks

# The plugin installs its own cuDNN and CUDA runtime wheels (make gpu-plugin: jax 0.10.2 brings
# nvidia-cudnn-cu12 9.28 and CUDA 12.9); XLA gates cuDNN features on these versions.
CUDNN_VERSION = (9, 28)
CUDA_RUNTIME_VERSION = (12, 9)


def plugin_dir() -> Path:
    """Where `make gpu-plugin` keeps the CUDA plugin of the installed jax: once per user and jax
    version (~3 GB), so a fresh clone does not fetch it again; JAXTRAIN_CUDA_PLUGIN wins."""
    default = cache_root() / "cuda-plugin" / importlib.metadata.version("jax")
    return Path(os.environ.get("JAXTRAIN_CUDA_PLUGIN") or default)


@dataclass(frozen=True)
class GpuTarget:
    name: str
    device_kind: str  # what jax's device_kind says on the real GPU (peaks.PEAK_FLOPS keys on it)
    compute_capability: tuple[int, int]
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # GPU-to-GPU inside a host, per direction
    network_bytes_per_s: float  # GPU to another host (its NIC), per direction
    sm_count: int
    clock_ghz: float  # boost
    l2_bytes: int
    fp32_cores_per_sm: int
    # [CUDA] limits per compute capability
    threads_per_sm: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    link: str = "NVLink"  # what carries nvlink_bytes_per_s: the name the planner prints


TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget(
        name="h100",
        device_kind="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        memory_bytes=84_929_347_584,  # [XLA] 80 GB HBM3 [H100]
        hbm_bytes_per_s=3.35e12,  # [H100]
        nvlink_bytes_per_s=450e9,  # [H100] NVLink 900 GB/s both directions
        network_bytes_per_s=50e9,  # [DGX] 400 Gb/s per GPU
        sm_count=132,  # [H100] (SXM5: 132 SMs)
        clock_ghz=1.98,  # [H100] max boost
        l2_bytes=50 * 2**20,  # [H100]
        fp32_cores_per_sm=128,
        threads_per_sm=2048,
        shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024,
    ),
    "h200": GpuTarget(
        name="h200",
        device_kind="NVIDIA H200",
        compute_capability=(9, 0),
        memory_bytes=143_771 * 2**20,  # [smi] 141 GB HBM3e [H200]
        hbm_bytes_per_s=4.8e12,  # [H200]
        nvlink_bytes_per_s=450e9,  # [H200] 900 GB/s both directions
        network_bytes_per_s=50e9,  # [DGX] 400 Gb/s per GPU
        sm_count=132,
        clock_ghz=1.98,
        l2_bytes=50 * 2**20,
        fp32_cores_per_sm=128,
        threads_per_sm=2048,
        shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024,
    ),
    "a100": GpuTarget(
        name="a100",
        device_kind="NVIDIA A100-SXM4-80GB",
        compute_capability=(8, 0),
        memory_bytes=81_920 * 2**20,  # [smi] 80 GB HBM2e [A100]
        hbm_bytes_per_s=2.039e12,  # [A100] 80GB SXM
        nvlink_bytes_per_s=300e9,  # [A100] NVLink 600 GB/s both directions
        network_bytes_per_s=25e9,  # [DGX] 200 Gb/s per GPU
        sm_count=108,  # [A100]
        clock_ghz=1.41,  # [A100] boost
        l2_bytes=40 * 2**20,  # [A100]
        fp32_cores_per_sm=64,
        threads_per_sm=2048,
        shared_memory_per_sm=164 * 1024,
        shared_memory_per_block_optin=163 * 1024,
    ),
    "a100_40g": GpuTarget(
        name="a100_40g",
        device_kind="NVIDIA A100-SXM4-40GB",
        compute_capability=(8, 0),
        memory_bytes=40_960 * 2**20,  # [smi] 40 GB HBM2 [A100]
        hbm_bytes_per_s=1.555e12,  # [A100] 40GB SXM
        nvlink_bytes_per_s=300e9,
        network_bytes_per_s=25e9,  # [DGX] 200 Gb/s per GPU
        sm_count=108,
        clock_ghz=1.41,
        l2_bytes=40 * 2**20,
        fp32_cores_per_sm=64,
        threads_per_sm=2048,
        shared_memory_per_sm=164 * 1024,
        shared_memory_per_block_optin=163 * 1024,
    ),
    "l40s": GpuTarget(
        name="l40s",
        device_kind="NVIDIA L40S",
        compute_capability=(8, 9),
        memory_bytes=46_068 * 2**20,  # [smi] 48 GB GDDR6 [L40S]
        hbm_bytes_per_s=864e9,  # [L40S]
        nvlink_bytes_per_s=32e9,  # [L40S] no NVLink: PCIe Gen4 x16, 64 GB/s both directions
        network_bytes_per_s=25e9,  # assumption: one 200 Gb/s NIC per GPU (no reference system)
        sm_count=142,  # [L40S]
        clock_ghz=2.52,  # [L40S] boost
        l2_bytes=96 * 2**20,  # [L40S]
        fp32_cores_per_sm=128,
        threads_per_sm=1536,
        shared_memory_per_sm=100 * 1024,
        shared_memory_per_block_optin=99 * 1024,
        link="PCIe",
    ),
    "b200": GpuTarget(
        name="b200",
        device_kind="NVIDIA B200",
        compute_capability=(10, 0),
        memory_bytes=180 * 10**9,  # [B200] 1,440 GB HBM3e per 8 GPUs
        hbm_bytes_per_s=8e12,  # [B200] 64 TB/s per 8 GPUs
        nvlink_bytes_per_s=900e9,  # [B200] NVLink 5, 1.8 TB/s both directions
        network_bytes_per_s=50e9,  # [DGX] 400 Gb/s per GPU
        sm_count=148,
        clock_ghz=1.965,  # not in the datasheets: an assumption (XLA uses it only for cost models)
        l2_bytes=126 * 2**20,  # not in the datasheets: an assumption, as the clock
        fp32_cores_per_sm=128,
        threads_per_sm=2048,
        shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024,
    ),
}


def get(name: str) -> GpuTarget:
    """The target called `name`, or a one-line error listing the known ones."""
    if name not in TARGETS:
        raise UserError(f"unknown --target {name!r}; known targets: {', '.join(TARGETS)}")
    return TARGETS[name]


def peak_flops(target: GpuTarget, dtype: str) -> float:
    """A target's dense tensor-core peak for the step's compute dtype."""
    peak = peaks.peak_flops(target.device_kind, dtype)
    if peak is None:  # every target has both (tests/test_plan.py)
        raise KeyError(f"jaxtrain/observe/peaks.py has no {dtype} peak for {target.device_kind}")
    return peak


def target_config(target: GpuTarget) -> str:
    """The `GpuTargetConfig` text proto XLA's GPU compiler reads in place of a real device."""
    major, minor = target.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {target.shared_memory_per_sm}
  threads_per_core_limit: {target.threads_per_sm}
  core_count: {target.sm_count}
  fpus_per_core: {target.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(target.hbm_bytes_per_s)}
  l2_cache_size: {target.l2_bytes}
  clock_rate_ghz: {target.clock_ghz}
  device_memory_size: {target.memory_bytes}
  shared_memory_per_block_optin: {target.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {CUDNN_VERSION[0]} minor: {CUDNN_VERSION[1]} }}
runtime_version {{ major: {CUDA_RUNTIME_VERSION[0]} minor: {CUDA_RUNTIME_VERSION[1]} }}
device_description_str: "{target.device_kind}"
"""


def use_plugin(xla_logs: bool = False) -> None:
    """Make the CUDA plugin importable by this process, with no GPU and no driver; call before jax.

    JAX_PLATFORMS=cpu: no CUDA client is created (the plugin only compiles);
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK: else its start-up calls cuInit and prints a traceback.
    XLA_FLAGS get the GPU flags a GPU launch runs with (xla_env.GPU_FLAGS), so the program planned
    is the program trained. XLA's own log lines (its scheduler's cost-model complaints, printed on
    every compile of a large job) stay out of a plan unless `xla_logs` (--verbose).
    """
    where = plugin_dir()
    if not (where / "jax_plugins").is_dir():
        raise UserError(
            f"no CUDA plugin in {where}: run `make gpu-plugin` (installs the plugin matching this "
            "jax there, ~3 GB, once per jax version), or point JAXTRAIN_CUDA_PLUGIN at one"
        )
    if "jax" in sys.modules:
        raise RuntimeError("use_plugin() must run before jax is imported")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    if not xla_logs:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    xla_env.set_flags()
    sys.path.insert(0, str(where))


def start_child(stderr_path: str, parent: int) -> None:
    """The start of a child process that compiles plans (planner.in_child): it dies with `parent`
    (no orphan compiling on after the planner is gone), its stderr into `stderr_path` (what XLA
    prints as it aborts, read back as one line), the plugin on its path."""
    lifeline.die_with_parent(parent)
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    use_plugin()  # XLA_FLAGS and TF_CPP_MIN_LOG_LEVEL as the parent set them: inherited


def target_devices(target: GpuTarget, hosts: int, gpus_per_host: int) -> list[Any]:
    """The devices of `hosts` x `gpus_per_host` of `target` (each with its process_index), to compile for."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(target), topology=f"1x{hosts}x{gpus_per_host}"
    )
    return list(topology.devices)


@contextlib.contextmanager
def cudnn_gates(target: GpuTarget) -> Iterator[None]:
    """jax's Python-side cuDNN attention checks answered for `target`'s GPUs while a step compiles.

    jax gates cuDNN attention's head sizes (256 on Hopper, else 128) and its latent-attention mode
    on the compute capability of the local GPU (`check_compute_capability` in
    jax/_src/cudnn/fused_attention_stablehlo.py), and with no GPU here it answers "none": the
    planner would refuse programs the target's GPUs run. Here the answer is the target's, as a
    real GPU of it gives; XLA itself already compiles for the target (`target_config`)."""
    from jax._src.cudnn import fused_attention_stablehlo as gates

    def at_least(capability: str) -> bool:
        return target.compute_capability >= tuple(int(x) for x in capability.split("."))

    def equal(capability: str) -> bool:
        return target.compute_capability == tuple(int(x) for x in capability.split("."))

    saved = gates.check_compute_capability, gates.is_cuda_compute_capability_equal
    gates.check_compute_capability, gates.is_cuda_compute_capability_equal = at_least, equal
    try:
        yield
    finally:
        gates.check_compute_capability, gates.is_cuda_compute_capability_equal = saved
