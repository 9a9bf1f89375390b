"""--mode manual of scripts/run_distributed.py: which ranks run on this machine, with which GPUs
and coordinator, and starting them (supervised by jaxtrain/launch/supervise.py).

The children find their place in the job through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID (see jaxtrain/cluster/detect.py). The command line is jaxtrain/launch/cli.py.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from jaxtrain.cluster.detect import nvidia_gpus, split_address
from jaxtrain.errors import ArgumentError
from jaxtrain.launch.supervise import Spec, supervise


@dataclass(frozen=True)
class LocalPlan:
    world_size: int
    ranks: tuple[int, ...]
    coordinator: str
    gpu_sets: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES per local process, None: leave as is


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def local_gpus(environ: dict[str, str]) -> list[str]:
    """GPU ids this machine offers: CUDA_VISIBLE_DEVICES, else nvidia-smi; [] on CPU."""
    if environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return []
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    return nvidia_gpus()


def plan_manual(args: argparse.Namespace, environ: dict[str, str]) -> LocalPlan:
    """Which ranks run here, the coordinator, and each process's GPUs; UserError if inconsistent."""
    n = args.world_size
    sized = (args.nodes or 1) * (args.nproc_per_node or 1)  # torchrun's way: --nnodes x --nproc_per_node
    if n is None and (args.nodes or args.nproc_per_node):
        n = sized
    elif n is not None and args.nodes and n != sized:
        raise ArgumentError(f"--world-size {n} is not --nnodes {args.nodes} x --nproc-per-node; give one")
    if n is None:
        raise ArgumentError("--mode manual needs --world-size N (total processes), or --nproc-per-node")
    if n < 1:
        raise ArgumentError(f"--world-size must be >= 1, got {n}")
    if args.rank is not None and args.node_rank is not None:
        raise ArgumentError("give --rank R (one process) or --node-rank K (P processes), not both")
    if args.rank is not None:
        if not 0 <= args.rank < n:
            raise ArgumentError(f"--rank {args.rank} is out of range for --world-size {n}; use 0..{n - 1}")
        ranks: tuple[int, ...] = (args.rank,)
    else:
        per_node = args.nproc_per_node or (n if args.node_rank is None else 1)
        node = args.node_rank or 0
        if per_node < 1 or node < 0:
            raise ArgumentError("--nproc-per-node must be >= 1 and --node-rank >= 0")
        if (node + 1) * per_node > n:
            raise ArgumentError(
                f"--node-rank {node} x --nproc-per-node {per_node} needs ranks up to "
                f"{(node + 1) * per_node - 1}, beyond --world-size {n}"
            )
        ranks = tuple(range(node * per_node, (node + 1) * per_node))
    everything_here = len(ranks) == n
    if args.coordinator and (args.port or args.master_addr):
        raise ArgumentError("give --coordinator HOST:PORT or --master-addr HOST --port PORT, not both")
    if args.port is not None and not 0 < args.port < 65536:
        raise ArgumentError(f"--port must be in 1..65535, got {args.port}")
    if args.master_addr:
        if not args.port:
            raise ArgumentError(f"--master-addr {args.master_addr} needs --master-port PORT (rank 0's port)")
        coordinator = f"{args.master_addr}:{args.port}"
        split_address(coordinator)
    elif args.coordinator:
        split_address(args.coordinator)
        coordinator = args.coordinator
    elif everything_here:
        coordinator = f"127.0.0.1:{args.port or free_port()}"
    else:
        raise ArgumentError(
            f"this machine runs ranks {ranks[0]}..{ranks[-1]} of {n}: give --coordinator HOST:PORT "
            "(rank 0's address, reachable from every host)"
        )
    gpus = local_gpus(environ)
    gpu_sets = None
    if gpus and len(ranks) > 1:
        if len(gpus) % len(ranks):
            raise ArgumentError(
                f"{len(gpus)} GPUs ({','.join(gpus)}) cannot be split evenly between {len(ranks)} local "
                "processes; use a process count that divides the GPU count"
            )
        k = len(gpus) // len(ranks)
        gpu_sets = tuple(",".join(gpus[i * k : (i + 1) * k]) for i in range(len(ranks)))
    return LocalPlan(n, ranks, coordinator, gpu_sets)


def run_local(plan: LocalPlan, command: list[str], log_dir: str | None, grace: float) -> int:
    """Start one child per local rank and supervise them; returns the launcher's exit code.

    0 when every rank finished; else the first failing rank's own exit status (75 pre-empted,
    128+N for death by signal N); 128+N when the launcher itself got signal N.
    """
    specs = []
    for i, rank in enumerate(plan.ranks):
        env = dict(os.environ)
        env.update(
            JAX_COORDINATOR_ADDRESS=plan.coordinator,
            JAX_NUM_PROCESSES=str(plan.world_size),
            JAX_PROCESS_ID=str(rank),
            PYTHONUNBUFFERED="1",
        )
        if plan.gpu_sets:
            env["CUDA_VISIBLE_DEVICES"] = plan.gpu_sets[i]
        specs.append(Spec(f"rank {rank}", command, env=env))
    banner = f"jaxtrain launch: ranks {plan.ranks[0]}..{plan.ranks[-1]} of {plan.world_size}, coordinator "
    banner += f"{plan.coordinator}" + (f", rank logs in {log_dir}" if log_dir and len(plan.ranks) > 1 else "")
    return supervise(specs, grace, Path(log_dir) if log_dir else None, banner)
