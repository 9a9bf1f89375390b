"""Where this process sits in a job, from whatever the launcher or cluster provides (no jax here).

Sources, first match wins:
  1. flags      --dist.coordinator_address HOST:PORT --dist.num_processes N --dist.process_id R
  2. jax_env    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (JAX_LOCAL_DEVICE_IDS)
  3. torchrun   MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK);
                under torchrun's agent (TORCHELASTIC_RUN_ID set) the coordinator is MASTER_PORT+1
  4. openmpi    a process mpirun started: OMPI_COMM_WORLD_SIZE, _RANK, _LOCAL_RANK; the coordinator
                is derived from OMPI_MCA_orte_hnp_uri as JAX's own Open MPI detection does
  5. slurm      a task started by srun: SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, ...
  6. k8s        a pod of a Kubernetes Indexed Job (JOB_COMPLETION_INDEX, which Kubernetes sets), in a
                JobSet or not: see K8S_LABELS and _from_k8s for the variables and the rule
  7. single     one process, no coordinator; refused when another launcher says it started several
Under SLURM, Open MPI and Kubernetes a coordinator given alone (flag, JAX_COORDINATOR_ADDRESS or
MASTER_ADDR+MASTER_PORT) replaces the derived one; anywhere else a partial set is an error.
`--dist.local_device_ids` overrides the local devices of any source.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxtrain.config import DistConfig
from jaxtrain.errors import UserError

_JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_TORCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
_SLURM_VARS = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
_OMPI_URI = "OMPI_MCA_orte_hnp_uri"  # mpirun's own address; Open MPI 5 no longer sets it
# Process counts other MPI launchers (MPICH and Intel MPI's hydra, MVAPICH) give their processes:
# jaxtrain cannot tell where their process 0 runs, so a count over 1 is refused, never run as N
# copies of process 0 writing one run dir.
_UNREAD_WORLD_SIZES = ("PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# JAX's own SLURM convention, so a job started by either picks the same port.
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 65535 - 2**12 + 1, 2**12
# Kubernetes: every pod has a network namespace of its own, so one fixed port serves every job.
K8S_PORT = 29500
# The pod's JobSet labels (jobset.sigs.k8s.io/..., set by the JobSet controller on every pod) that
# a manifest exposes as variables through the downward API; the manifest create_k8s writes
# (jaxtrain/launch/k8s.py) exposes exactly these.
K8S_LABELS = {
    "JOBSET_NAME": "jobset.sigs.k8s.io/jobset-name",
    "JOBSET_REPLICATED_JOB": "jobset.sigs.k8s.io/replicatedjob-name",
    "JOBSET_JOB_INDEX": "jobset.sigs.k8s.io/job-global-index",  # JobSet v0.7 and later
    "JOBSET_JOBS": "jobset.sigs.k8s.io/global-replicas",  # v0.7
    "JOBSET_COORDINATOR": "jobset.sigs.k8s.io/coordinator",  # v0.7: HOST of spec.coordinator's pod
    "JOBSET_RESTART_ATTEMPT": "jobset.sigs.k8s.io/restart-attempt",
}
# An Indexed Job's pods, outside a JobSet: the Job's name (Kubernetes' label on its pods) names
# the headless Service too, and its completions are written into the pod's env by the manifest.
K8S_JOB_NAME = ("JOB_NAME", "batch.kubernetes.io/job-name")
K8S_COMPLETIONS = "JOB_COMPLETIONS"  # pods per Job: the Job's spec.completions (JobSet's default 1)


@dataclass(frozen=True)
class LaunchSpec:
    source: str  # "flags" | "jax_env" | "torchrun_env" | "openmpi" | "slurm" | "k8s" | "single"
    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None
    details: dict[str, str]  # the raw values that were used (env names -> values), for logging
    local_rank: int | None = None  # this process's index on its host, where the launcher says it


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port); UserError if malformed."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"coordinator address '{address}' is not HOST:PORT; write e.g. 10.0.0.1:29500")
    return host, int(port)


def _int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} is not an integer; set it to a whole number") from None


def _device_ids(name: str, value: str) -> tuple[int, ...]:
    parts = [v.strip() for v in value.split(",") if v.strip()]
    if not parts or not all(p.isdigit() for p in parts) or len(set(map(int, parts))) != len(parts):
        raise UserError(f"{name}={value!r} must be distinct non-negative device ids, e.g. 0,1")
    return tuple(map(int, parts))


def _check(source: str, spec: dict, names: tuple[str, str, str]) -> None:
    """Raise before any connection attempt if the numbers cannot describe a job."""
    coord, n, pid = names
    if spec["num_processes"] < 1:
        raise UserError(f"{n}={spec['num_processes']} must be >= 1 ({source})")
    if not 0 <= spec["process_id"] < spec["num_processes"]:
        raise UserError(
            f"{pid}={spec['process_id']} is out of range for {n}={spec['num_processes']}; "
            f"process ids run 0..{spec['num_processes'] - 1} ({source})"
        )
    if spec["num_processes"] > 1:
        if not spec["coordinator_address"]:
            raise UserError(f"{n}={spec['num_processes']} needs {coord} HOST:PORT ({source})")
        split_address(spec["coordinator_address"])


def _partial(source: str, given: list[str], needed: tuple[str, ...]) -> UserError:
    missing = [n for n in needed if n not in given]
    return UserError(
        f"{', '.join(given)} set but {', '.join(missing)} not ({source}): set all of "
        f"{', '.join(needed)}, or none of them"
    )


def _in_slurm_task(environ: Mapping[str, str]) -> bool:
    return "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ


def _ranks_known(environ: Mapping[str, str]) -> bool:
    """SLURM tasks, Open MPI processes and Kubernetes pods know their ranks: a coordinator may
    come alone."""
    return _in_slurm_task(environ) or "OMPI_COMM_WORLD_SIZE" in environ or "JOB_COMPLETION_INDEX" in environ


def _from_flags(dist: DistConfig, environ: Mapping[str, str]) -> dict | None:
    given = {
        "--dist.coordinator_address": dist.coordinator_address,
        "--dist.num_processes": str(dist.num_processes) if dist.num_processes else "",
        "--dist.process_id": str(dist.process_id) if dist.process_id >= 0 else "",
    }
    set_names = [k for k, v in given.items() if v]
    if not set_names or set_names == ["--dist.coordinator_address"] and _ranks_known(environ):
        return None  # nothing, or only a coordinator for SLURM or Open MPI to use
    if dist.num_processes == 1 and not dist.coordinator_address:
        return {"coordinator_address": None, "num_processes": 1, "process_id": max(dist.process_id, 0)}
    if len(set_names) < 3:
        raise _partial("flags", set_names, tuple(given))
    return {
        "coordinator_address": dist.coordinator_address,
        "num_processes": dist.num_processes,
        "process_id": dist.process_id,
        "details": dict(given),
    }


def _from_jax_env(environ: Mapping[str, str]) -> dict | None:
    set_names = [n for n in _JAX_VARS if environ.get(n)]
    if not set_names or set_names == ["JAX_COORDINATOR_ADDRESS"] and _ranks_known(environ):
        return None  # nothing, or only a coordinator for SLURM or Open MPI to use
    if len(set_names) < 3:
        raise _partial("jax_env", set_names, _JAX_VARS)
    out: dict[str, Any] = {
        "coordinator_address": environ["JAX_COORDINATOR_ADDRESS"],
        "num_processes": _int("JAX_NUM_PROCESSES", environ["JAX_NUM_PROCESSES"]),
        "process_id": _int("JAX_PROCESS_ID", environ["JAX_PROCESS_ID"]),
        "details": {n: environ[n] for n in _JAX_VARS},
    }
    if environ.get("JAX_LOCAL_DEVICE_IDS"):
        out["local_device_ids"] = _device_ids("JAX_LOCAL_DEVICE_IDS", environ["JAX_LOCAL_DEVICE_IDS"])
        out["details"]["JAX_LOCAL_DEVICE_IDS"] = environ["JAX_LOCAL_DEVICE_IDS"]
    return out


def _from_torchrun_env(environ: Mapping[str, str]) -> dict | None:
    extra = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
    set_names = [n for n in _TORCH_VARS + extra if environ.get(n)]
    if not set_names or _ranks_known(environ) and not {"WORLD_SIZE", "RANK"} & set(set_names):
        return None  # nothing, or only MASTER_ADDR/PORT for SLURM or Open MPI to use
    if any(n not in set_names for n in _TORCH_VARS):
        raise _partial("torchrun_env", [n for n in set_names if n in _TORCH_VARS] or set_names, _TORCH_VARS)
    port = _int("MASTER_PORT", environ["MASTER_PORT"])
    details = {n: environ[n] for n in set_names}
    if environ.get("TORCHELASTIC_RUN_ID"):
        # torchrun's agent holds its TCPStore on MASTER_PORT on the master node for the whole run;
        # every process derives the same next port for JAX's coordinator.
        details["TORCHELASTIC_RUN_ID"] = environ["TORCHELASTIC_RUN_ID"]
        port += 1
        if port > 65535:
            raise UserError(
                "MASTER_PORT=65535 leaves no port for JAX's coordinator (MASTER_PORT+1); "
                "pass torchrun a lower --master_port"
            )
    out: dict[str, Any] = {
        "coordinator_address": f"{environ['MASTER_ADDR']}:{port}",
        "num_processes": _int("WORLD_SIZE", environ["WORLD_SIZE"]),
        "process_id": _int("RANK", environ["RANK"]),
        "details": details,
    }
    if environ.get("LOCAL_RANK"):
        out["local_rank"] = _int("LOCAL_RANK", environ["LOCAL_RANK"])
        # torchrun starts one process per GPU and LOCAL_RANK names its GPU.
        if _int("LOCAL_WORLD_SIZE", environ.get("LOCAL_WORLD_SIZE", "2")) > 1:
            out["local_device_ids"] = (out["local_rank"],)
    return out


def _ompi_coordinator(uri: str) -> str:
    """JAX's rule (jax/_src/clusters/ompi_cluster.py): mpirun's first TCP address, and a port
    in 61440..65535 from the Open MPI job id, so every process derives the same one."""
    m = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    job = uri.split(".", 1)[0]
    if not m or not job.isdigit():
        raise UserError(
            f"cannot read mpirun's address from {_OMPI_URI}={uri!r}; pass every process the "
            "coordinator: mpirun -x JAX_COORDINATOR_ADDRESS=HOST:PORT (HOST: rank 0's host)"
        )
    host = next(g for g in m.groups() if g is not None)
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{int(job) // 2**12 % _SLURM_PORT_SPAN + _SLURM_PORT_BASE}"


def _from_ompi(dist: DistConfig, environ: Mapping[str, str]) -> dict | None:
    if "OMPI_COMM_WORLD_SIZE" not in environ:
        return None
    if any(n not in environ for n in _OMPI_VARS):
        raise _partial("openmpi", [n for n in _OMPI_VARS if n in environ], _OMPI_VARS)
    details = {n: environ[n] for n in _OMPI_VARS}
    num = _int("OMPI_COMM_WORLD_SIZE", environ["OMPI_COMM_WORLD_SIZE"])
    override = _coordinator_override(dist, environ)
    coordinator = None
    if override:
        details[override[0]] = override[1]
        coordinator = override[1]
    elif environ.get(_OMPI_URI):
        details[_OMPI_URI] = environ[_OMPI_URI]
        coordinator = _ompi_coordinator(environ[_OMPI_URI])
    elif num > 1:
        raise UserError(
            f"mpirun started {num} processes but sets no {_OMPI_URI} (Open MPI 5 or later) to find "
            "process 0 by; pass every process the coordinator: mpirun -x JAX_COORDINATOR_ADDRESS=HOST:PORT "
            "(HOST: rank 0's host)"
        )
    local_rank = _int("OMPI_COMM_WORLD_LOCAL_RANK", environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    local_size = _int("OMPI_COMM_WORLD_LOCAL_SIZE", environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    return {
        "coordinator_address": coordinator,
        "num_processes": num,
        "process_id": _int("OMPI_COMM_WORLD_RANK", environ["OMPI_COMM_WORLD_RANK"]),
        # Several processes on a host: one GPU each, as torchrun; one process keeps them all.
        "local_device_ids": (local_rank,) if local_size > 1 else None,
        "local_rank": local_rank,
        "details": details,
    }


def _refuse_unread_world(environ: Mapping[str, str]) -> None:
    """Several processes that cannot find each other must not all act as process 0."""
    for name in _UNREAD_WORLD_SIZES:
        if environ.get(name, "1").strip() not in ("", "0", "1"):
            raise UserError(
                f"{name}={environ[name]}: a launcher jaxtrain cannot read started several processes, "
                "and each would act as process 0; give every process JAX_COORDINATOR_ADDRESS, "
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID, or start them with torchrun, Open MPI's mpirun, "
                "srun or scripts/run_distributed.py"
            )


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'n[003-005,9],m' -> 'n003'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise UserError(f"cannot read SLURM node list {nodelist!r}")
    prefix, ranges = m.groups()
    return prefix + re.split(r"[,-]", ranges)[0] if ranges else prefix


def _tasks_on_node(environ: Mapping[str, str]) -> int:
    """Tasks of this step on this node, from SLURM's compressed 'N(xM),K' per-node counts."""
    counts = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
    per_node: list[int] = []
    for part in filter(None, counts.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            return 1
        per_node += [int(m[1])] * int(m[2] or 1)
    node = _int("SLURM_NODEID", environ.get("SLURM_NODEID", "0"))
    return per_node[node] if node < len(per_node) else 1


def _slurm_devices(environ: Mapping[str, str], local_id: int) -> tuple[int, ...] | None:
    """One task per node keeps every GPU; several tasks on a node split them."""
    tasks = _tasks_on_node(environ)
    if tasks <= 1 or environ.get("SLURM_GPUS_PER_TASK"):
        return None  # all local devices, or SLURM already bound each task's GPUs
    visible = [v for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) <= 1 and "CUDA_VISIBLE_DEVICES" in environ:
        return None
    if not visible:
        return (local_id,)  # JAX's own SLURM default: GPU number = local task id
    if len(visible) % tasks:
        raise UserError(
            f"{len(visible)} GPUs (CUDA_VISIBLE_DEVICES) cannot be split between {tasks} tasks on this "
            "node; use a task count that divides the GPUs, or --gpus-per-task"
        )
    per = len(visible) // tasks
    return tuple(range(local_id * per, (local_id + 1) * per))


def _coordinator_override(dist: DistConfig, environ: Mapping[str, str]) -> tuple[str, str] | None:
    if dist.coordinator_address:
        return "--dist.coordinator_address", dist.coordinator_address
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS", environ["JAX_COORDINATOR_ADDRESS"]
    if environ.get("MASTER_ADDR") or environ.get("MASTER_PORT"):
        if not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
            raise UserError("set both MASTER_ADDR and MASTER_PORT, or neither (slurm)")
        return "MASTER_ADDR:MASTER_PORT", f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    return None


def _from_slurm(dist: DistConfig, environ: Mapping[str, str]) -> dict | None:
    if not _in_slurm_task(environ):
        return None  # outside a job, or in an salloc shell: not a task srun started
    missing = [n for n in _SLURM_VARS if n not in environ]
    nodelist_var = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if environ.get(n)), None)
    if missing or not nodelist_var:
        raise _partial(
            "slurm", ["SLURM_JOB_ID", "SLURM_PROCID"], ("SLURM_JOB_ID", *_SLURM_VARS, "SLURM_STEP_NODELIST")
        )
    details = {n: environ[n] for n in ("SLURM_JOB_ID", *_SLURM_VARS, nodelist_var)}
    num = _int("SLURM_NTASKS", environ["SLURM_NTASKS"])
    if "SLURM_STEP_ID" not in environ and num > 1:
        raise UserError(
            f"this is the batch script of a SLURM job with SLURM_NTASKS={num}, not one of its tasks; "
            "start training with srun (or scripts/run_distributed.py --mode slurm)"
        )
    override = _coordinator_override(dist, environ)
    if override:
        details[override[0]] = override[1]
        coordinator = override[1]
    else:
        port = _int("SLURM_JOB_ID", environ["SLURM_JOB_ID"]) % _SLURM_PORT_SPAN + _SLURM_PORT_BASE
        coordinator = f"{_first_host(environ[nodelist_var])}:{port}"
    local_id = _int("SLURM_LOCALID", environ["SLURM_LOCALID"])
    return {
        "coordinator_address": coordinator,
        "num_processes": num,
        "process_id": _int("SLURM_PROCID", environ["SLURM_PROCID"]),
        "local_device_ids": _slurm_devices(environ, local_id),
        "local_rank": local_id,
        "details": details,
    }


def _from_k8s(dist: DistConfig, environ: Mapping[str, str]) -> dict | None:
    """A pod of an Indexed Job (JOB_COMPLETION_INDEX), one process per pod.

    In a JobSet (JOBSET_NAME): process = JOBSET_JOB_INDEX x JOB_COMPLETIONS + JOB_COMPLETION_INDEX,
    of JOBSET_JOBS x JOB_COMPLETIONS (JOB_COMPLETIONS defaults to 1, JobSet's one pod per Job); the
    coordinator is JOBSET_COORDINATOR, else the first pod's hostname
    <jobset>-<replicated job>-0-0.<jobset> (JobSet's default subdomain). A lone Indexed Job: process
    JOB_COMPLETION_INDEX of JOB_COMPLETIONS, the coordinator <JOB_NAME>-0.<JOB_NAME> (its headless
    Service named after it). Port K8S_PORT.
    """
    if "JOB_COMPLETION_INDEX" not in environ:
        return None
    index = _int("JOB_COMPLETION_INDEX", environ["JOB_COMPLETION_INDEX"])
    details = {"JOB_COMPLETION_INDEX": environ["JOB_COMPLETION_INDEX"]}
    details.update({n: environ[n] for n in (*K8S_LABELS, K8S_JOB_NAME[0], K8S_COMPLETIONS) if environ.get(n)})
    in_jobset = bool(environ.get("JOBSET_NAME"))
    if not in_jobset and not environ.get(K8S_COMPLETIONS):
        raise UserError(
            f"a pod of a Kubernetes Indexed Job (JOB_COMPLETION_INDEX={index}) that does not say how "
            f"many pods the job has: expose the JobSet labels ({', '.join(K8S_LABELS)}), or set "
            f"{K8S_COMPLETIONS} to the Job's completions (scripts/run_distributed.py --mode create_k8s "
            "writes both)"
        )
    per_job = _int(K8S_COMPLETIONS, environ.get(K8S_COMPLETIONS) or "1")
    if in_jobset:
        missing = [
            n for n in ("JOBSET_REPLICATED_JOB", "JOBSET_JOB_INDEX", "JOBSET_JOBS") if not environ.get(n)
        ]
        if missing:
            raise UserError(
                f"a JobSet's pod with {', '.join(missing)} empty or unset: the manifest exposes them from "
                f"the pod's labels ({', '.join(K8S_LABELS[n] for n in missing)}), which JobSet v0.7 and "
                "later set; write it with scripts/run_distributed.py --mode create_k8s"
            )
        jobs = _int("JOBSET_JOBS", environ["JOBSET_JOBS"])
        job = _int("JOBSET_JOB_INDEX", environ["JOBSET_JOB_INDEX"])
        name, rjob = environ["JOBSET_NAME"], environ["JOBSET_REPLICATED_JOB"]
        host = environ.get("JOBSET_COORDINATOR") or f"{name}-{rjob}-0-0.{name}"
        num, process = jobs * per_job, job * per_job + index
    else:
        if not environ.get(K8S_JOB_NAME[0]):
            lone = ("JOB_COMPLETION_INDEX", K8S_COMPLETIONS, K8S_JOB_NAME[0])
            raise _partial("k8s", ["JOB_COMPLETION_INDEX", K8S_COMPLETIONS], lone)
        host = f"{environ[K8S_JOB_NAME[0]]}-0.{environ[K8S_JOB_NAME[0]]}"
        num, process = per_job, index
    override = _coordinator_override(dist, environ)
    coordinator = f"{host}:{K8S_PORT}"
    if override:
        details[override[0]] = coordinator = override[1]
    return {
        "coordinator_address": coordinator,
        "num_processes": num,
        "process_id": process,
        "details": details,
    }


def detect(dist: DistConfig, environ: Mapping[str, str] = os.environ) -> LaunchSpec:
    """Work out this process's place in the job; pure, raises UserError on inconsistent values."""
    names = {
        "flags": ("--dist.coordinator_address", "--dist.num_processes", "--dist.process_id"),
        "jax_env": _JAX_VARS,
        "torchrun_env": ("MASTER_ADDR:MASTER_PORT", "WORLD_SIZE", "RANK"),
        "openmpi": ("the coordinator", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
        "slurm": ("the coordinator", "SLURM_NTASKS", "SLURM_PROCID"),
        "k8s": ("the coordinator", "pods", "process"),
    }
    found = None
    for source, get in (
        ("flags", lambda: _from_flags(dist, environ)),
        ("jax_env", lambda: _from_jax_env(environ)),
        ("torchrun_env", lambda: _from_torchrun_env(environ)),
        # before slurm: mpirun inside an allocation starts its daemons through srun
        ("openmpi", lambda: _from_ompi(dist, environ)),
        ("slurm", lambda: _from_slurm(dist, environ)),
        ("k8s", lambda: _from_k8s(dist, environ)),
    ):
        found = get()
        if found is not None:
            _check(source, found, names[source])
            break
    else:
        _refuse_unread_world(environ)
        source, found = "single", {"coordinator_address": None, "num_processes": 1, "process_id": 0}
    details = dict(found.get("details", {}))
    local_ids = found.get("local_device_ids")
    if dist.local_device_ids:
        local_ids = _device_ids("--dist.local_device_ids", dist.local_device_ids)
        details["--dist.local_device_ids"] = dist.local_device_ids
    return LaunchSpec(
        source=source,
        coordinator_address=found["coordinator_address"] if found["num_processes"] > 1 else None,
        num_processes=found["num_processes"],
        process_id=found["process_id"],
        local_device_ids=local_ids,
        details=details,
        local_rank=found.get("local_rank"),
    )


def coordinator_reachable(address: str, timeout: float) -> bool:
    """True if a TCP connection to HOST:PORT opens within `timeout` seconds (one attempt)."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_in_use(port: int) -> bool:
    """True if something already listens on `port` on this host (any address)."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                # SO_REUSEADDR mirrors the coordinator's own bind: lingering TIME_WAIT is no conflict.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            # no IPv6 on this host: the IPv4 attempt decides
    return False


def wait_for_coordinator(address: str, timeout: float, poll_s: float = 0.5, attempt_s: float = 5.0) -> bool:
    """Connect to the coordinator at HOST:PORT until it accepts or `timeout` s pass; True if it did.

    Process 0 may still be starting it, so a refused connection is tried again every `poll_s`
    seconds; one attempt waits at most `attempt_s` (a firewall drops packets instead of refusing).
    """
    deadline = time.monotonic() + timeout
    while not coordinator_reachable(address, min(attempt_s, timeout)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def describe(spec: LaunchSpec) -> str:
    """One line saying where this process sits, for the start-up log."""
    devices = ",".join(map(str, spec.local_device_ids)) if spec.local_device_ids else "all"
    raw = " ".join(f"{k}={v}" for k, v in spec.details.items())
    return (
        f"distributed: source={spec.source} process {spec.process_id}/{spec.num_processes} "
        f"local_devices={devices} coordinator={spec.coordinator_address or '-'}"
        + (f" [{raw}]" if raw else "")
    )


def nvidia_gpus() -> list[str]:
    """The indices of the NVIDIA GPUs nvidia-smi lists on this machine ([] without it: no GPU)."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True
    )
    return out.stdout.split() if out.returncode == 0 else []
