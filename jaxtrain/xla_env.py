"""XLA settings jaxtrain chooses for the user: CPU compiler flags and the persistent compile cache.

    from jaxtrain import xla_env
    xla_env.set_flags()   # first thing a script does, before jax starts a backend

CPU: --xla_cpu_experimental_ynn_fusion_type=dot (matmuls to XNNPACK's YNN kernels), and for a
single-process training run with the default mesh one CPU device per core (at most
MAX_CPU_DEVICES) where the batch splits evenly over them; why, the measurements and the
alternatives tried: docs/cpu_speed.md. XLA reads XLA_FLAGS once, when the first backend starts,
so these go into the environment before then; a flag the user set there wins. They are xla_cpu_*
flags: a GPU run applies them to its host-side computations only.

The compile cache keeps compiled executables across launches (a requeue or resume skips most of
its compile). Processes and hosts may share its folder: jax writes from process 0 only, and with a
size limit every read and write holds a file lock, so nobody reads an entry half written.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from jaxtrain.cluster.detect import LaunchSpec
from jaxtrain.config import Config, MeshConfig
from jaxtrain.config.batch import batch_plan
from jaxtrain.disk.files import cache_root, write_text
from jaxtrain.errors import UserError

# When this process started its work, for goodput: imported first by scripts/train.py.
LAUNCH_TIME = time.time()

CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=dot",)
# What large JAX jobs run with on GPUs, after NVIDIA JAX-Toolbox's "Tips for High-Performance
# LLMs with JAX and XLA" (rosetta/docs/GPU_performance.md; its containers set the first one): the
# latency-hiding scheduler, FSDP's pipelined gathers and reduce-scatters over a double-buffered
# layer loop, and collectives combined up to the doc's thresholds. Each exists in jax 0.10.2's
# XLA (an unknown flag aborts it); XLA:CPU ignores them, so they are set for every launch, and
# scripts/plan.py compiles with them too. Two collectives in flight, not one: a cross-host fsdp
# gather then runs beside tensor parallelism's NVLink all-reduces instead of queueing behind them
# (planned, schedule-aware bound: Llama-3-70B on 128 x 8 H100, tensor 2 x fsdp 16, 3.71 -> 3.20 s;
# tensor 8: 4.21 -> 3.77 s; 8B on 1 x 8 and 8 x 8, MaxText's 70B on 16 x 8: within 0.2%).
GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=8589934592",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=8589934592",
    "--xla_gpu_all_reduce_combine_threshold_bytes=8589934592",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
)
# A job's FP8 matmuls compile with these (compiler_options says why; run/preflight.py's FP8 check too).
FP8_OPTIONS: dict[str, str | bool] = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_disable_hlo_passes": "dot-merger",
}
# A mixture in pieces with FP8 matmuls: each layer's fsdp reduce-scatter stays in the layer's own
# backward, not pipelined into the next one's (compiler_options says why).
FP8_PIECES_OPTIONS: dict[str, str | bool] = {"xla_gpu_enable_pipelined_reduce_scatter": False}
# Tensor parallelism beside an fsdp group across hosts: its all-reduces run synchronously on the
# compute stream, and every collective starts as soon as its operands exist (compiler_options says why).
SYNC_TENSOR_OPTIONS: dict[str, str | bool] = {
    "xla_gpu_disable_async_collectives": "ALLREDUCE",
    "xla_gpu_experimental_collective_start_as_early_as_possible": True,
}
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")  # XLA's fatal line at its start, then it aborts
DROPPED: list[str] = []  # jaxtrain's flags this XLA does not know: set_flags left them out
MAX_CPU_DEVICES = 8  # measured at 2 cores only; past this each device's slice of the batch gets thin
CACHE_MAX_BYTES = 8 * 2**30  # least recently used entries go past this
# A step compiled faster than this is cheaper to recompile than to read and write to disk.
CACHE_MIN_COMPILE_S = 0.2


def merged_flags(user_flags: str, defaults: tuple[str, ...] = CPU_FLAGS) -> str:
    """The user's XLA_FLAGS plus each default whose flag name the user did not set."""
    user_names = {f.split("=", 1)[0] for f in user_flags.split()}
    added = [f for f in defaults if f.split("=", 1)[0] not in user_names]
    return " ".join([*added, *user_flags.split()])


def cpu_device_count(cfg: Config, launch: LaunchSpec) -> int:
    """CPU devices for this process when jaxtrain may choose: one per core that the batch splits
    evenly over (1 when the choice is not ours: see the module docstring)."""
    if cfg.task != "train" or launch.num_processes != 1 or cfg.mesh != MeshConfig():
        return 1
    cores = min(len(os.sched_getaffinity(0)), MAX_CPU_DEVICES)
    for n in range(cores, 1, -1):
        try:
            batch_plan(cfg, n, n)  # the default mesh is pure data parallelism: n batch shards
            return n
        except UserError:
            continue
    return 1


def set_flags(cfg: Config | None = None, launch: LaunchSpec | None = None) -> None:
    """Put jaxtrain's CPU and GPU flags into XLA_FLAGS (the user's own settings win), and with a
    config and its launch, the CPU device count it trains fastest on (cpu_device_count). Checked
    against the XLA that runs (unknown_flags): ours it does not know are left out (DROPPED), one
    of the user's is a UserError."""
    defaults: tuple[str, ...] = (*CPU_FLAGS, *GPU_FLAGS)
    if cfg is not None and launch is not None and (n := cpu_device_count(cfg, launch)) > 1:
        defaults = (*defaults, f"{DEVICE_COUNT_FLAG}={n}")
    user = os.environ.get("XLA_FLAGS", "")
    unknown = unknown_flags(merged_flags(user, defaults))
    theirs = [f for f in unknown if f in _names(user)]
    if theirs:
        raise UserError(
            f"XLA_FLAGS: the XLA of jaxlib {_jaxlib()} does not know {' '.join(theirs)}: remove it from "
            "XLA_FLAGS (it would abort the run)"
        )
    DROPPED[:] = unknown  # ours: run without them, and say so (run/loop.py logs it)
    os.environ["XLA_FLAGS"] = merged_flags(user, tuple(f for f in defaults if _names(f)[0] not in unknown))


def _names(flags: str) -> list[str]:
    return [f.split("=", 1)[0] for f in flags.split()]


def _jaxlib() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ""


def unknown_flags(flags: str) -> list[str]:
    """The names in `flags` the XLA that runs does not know: it aborts at its start on any (jaxtrain's
    own are flags of jax 0.10.2's XLA, and XLA removes flags). Found by starting a CPU backend with
    them in a child process (0.7 s here) once per jaxlib version and set of names, then cached in
    cache_root()/xla_flags. A child that fails for another reason finds none (the run says why)."""
    names = sorted(set(_names(flags)))
    if not names:
        return []
    key = hashlib.sha256(json.dumps([_jaxlib(), names]).encode()).hexdigest()[:20]
    path = cache_root() / "xla_flags" / f"{key}.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        return list(json.loads(path.read_text())["unknown"])
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    child = [sys.executable, "-c", "import jax; jax.devices()"]
    done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=300)
    said = [m.group(1) for line in done.stderr.splitlines() if (m := UNKNOWN.search(line))]
    if done.returncode != 0 and not said:
        return []
    unknown = sorted(set(_names(said[0]))) if said else []
    with contextlib.suppress(OSError):
        write_text(path, json.dumps({"jaxlib": _jaxlib(), "names": names, "unknown": unknown}) + "\n")
    return unknown


def compiler_options(
    cfg: Config, platform: str, fsdp_across_hosts: bool = False
) -> dict[str, str | bool] | None:
    """XLA options for one job's steps, on top of XLA_FLAGS (given to each compile: XLA reads
    XLA_FLAGS once a process, and a plan or test compiles several jobs in one). A mixture of
    experts exchanging its tokens in pieces (model.moe.chunks > 1) on GPUs: every collective starts
    as soon as its operands exist, so a piece's exchange is in flight while another's experts run
    (planned, schedule-aware: DeepSeek-V3 on 128 x 8 H100 in 2 pieces 28.8 -> 30.0%, 4 pieces 31.0%;
    it costs a job in one piece, 28.6 -> 27.3%, and Llama-3-70B on 128 x 8, 58.2 -> 53.7%); and four
    collectives may be in flight, not two: the pieces' exchanges no longer hold a layer's fsdp
    reduce-scatter back until they are done (planned: Qwen3-30B-A3B on 4 x 8, expert 8 inside fsdp 4,
    40.6 -> 42.7%, at 3: 42.4%, at 8: 38.3%; DeepSeek-V3 31.5 -> 33.1%; Mixtral-8x7B on 2 x 8
    55.1 -> 55.3%, but on 4 x 8 55.1 -> 54.7%). FP8 matmuls (model.matmul fp8): no Triton GEMMs, so
    XLA rewrites each scaled FP8 dot into cuBLASLt's FP8 GEMM (with them on, the compiler for an H100
    emitted FP8 and bf16 dots alike as Triton fusions; MaxText's GPU runs turn them off too), and no
    dot merger, which joined q's and kv's dots (one input, two weights' scales) into a bf16 GEMM
    (docs/fp8.md). A mixture in pieces with FP8 matmuls also keeps each layer's fsdp reduce-scatter
    in that layer's backward (XLA's pipelining of it into the next layer's is off): with cuBLAS
    calls in place of Triton GEMMs, XLA's scheduler started the pipelined reduce-scatter of the
    experts' gradients one GEMM before it waited on it (planned, Qwen3-30B-A3B on 4 x 8: 342 ms a
    step exposed on it, forecast 2.757 -> 2.493 s; its bf16 program compiled without Triton GEMMs
    waits the same 344 ms; with them pipelining pays, bf16 2.524 -> 2.564 s unpipelined, and dense
    FP8 jobs need it, Llama-3-70B on 128 x 8 3.285 -> 4.023 s unpipelined).

    Tensor parallelism (tensor > 1) beside an fsdp group across hosts (`fsdp_across_hosts`): XLA
    runs every async collective on one stream, in order, so each layer's tensor all-reduce (on the
    critical path: the next matmul waits for it) queued behind the cross-host fsdp reduce-scatter or
    gather started before it. All-reduces are then synchronous, which XLA runs on the compute stream
    beside the async stream's transfers (its CollectiveThunk), and every collective starts as soon as
    its operands exist (without it XLA's scheduler started the reduce-scatters late beside synchronous
    all-reduces). Planned, Llama-3-70B on 128 x 8 H100, fsdp 16 x tensor 2, forecast: FP8 3.182 ->
    2.824 s, bf16 4.474 -> 4.231 s. Inside one host it costs (gpt2_124m, fsdp 4 x tensor 2 on 1 x 8:
    0.142 -> 0.146 s), and a data all-reduce that overlaps the backward (no fsdp) would be exposed."""
    if platform == "cpu":
        return None
    options: dict[str, str | bool] = {}
    fp8 = "fp8" in (cfg.model.matmul, cfg.model.head_matmul)
    if cfg.model.moe.chunks > 1:
        options["xla_gpu_experimental_collective_start_as_early_as_possible"] = True
        options["xla_gpu_experimental_parallel_collective_overlap_limit"] = "4"  # an int, as XLA parses it
        if fp8:
            options.update(FP8_PIECES_OPTIONS)
    if fp8:
        options.update(FP8_OPTIONS)
    if cfg.mesh.tensor > 1 and fsdp_across_hosts:
        options.update(SYNC_TENSOR_OPTIONS)
    return options or None


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/jaxtrain/xla, else ~/.cache/jaxtrain/xla."""
    return cache_root() / "xla"


def enable_compile_cache(setting: str) -> Path | None:
    """Turn jax's persistent cache on at `setting` ("" = the default folder, "off" = none)."""
    import jax

    if setting == "off":
        return None
    path = Path(setting) if setting else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home only costs the compile; the run goes on
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def compile_cache_dir() -> str | None:
    """Where jax's persistent compile cache is (enable_compile_cache set it), None when off."""
    import jax

    return getattr(jax.config, "jax_compilation_cache_dir")  # noqa: B009  (typed stubs lack it)
