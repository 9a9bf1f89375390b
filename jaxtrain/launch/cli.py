"""Start a training script as several processes: locally, one rank of a multi-host job, SLURM, or
Kubernetes.

The command line of scripts/run_distributed.py (this docstring is its --help). --mode manual:
jaxtrain/launch/local.py, whose processes jaxtrain/launch/supervise.py starts and watches;
--mode slurm and create_slurm: jaxtrain/launch/slurm.py; --mode k8s and create_k8s:
jaxtrain/launch/k8s.py. Never imports jax, so --help answers at once (tests/test_layout.py checks).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from jaxtrain.errors import ArgumentError
from jaxtrain.launch import k8s, slurm
from jaxtrain.launch.local import plan_manual, run_local
from jaxtrain.parser import Parser

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SCRIPT = "scripts/train.py"


def build_parser() -> argparse.ArgumentParser:
    """The run_distributed.py command line; everything after `--` goes to the script."""
    p = Parser(prog="scripts/run_distributed.py", description=__doc__)
    p.add_argument("--mode", choices=("manual", "slurm", "create_slurm", "k8s", "create_k8s"), required=True)
    p.add_argument("--script", default=DEFAULT_SCRIPT, help="script to run (default scripts/train.py)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the script")
    m = p.add_argument_group("manual")
    # torchrun's spellings (--nproc_per_node, --nnodes, --node_rank, --master_addr, --master_port)
    # are accepted too, with torchrun's meaning.
    m.add_argument("--world-size", type=int, help="total processes in the job (default nodes x P)")
    m.add_argument("--rank", type=int, help="run only this rank (multi-host, one process here)")
    m.add_argument(
        "--node-rank", "--node_rank", type=int, help="run ranks node_rank*P .. node_rank*P+P-1 here"
    )
    m.add_argument("--nproc-per-node", "--nproc_per_node", type=int, help="P: processes on this machine")
    m.add_argument("--coordinator", help="HOST:PORT of rank 0 (default 127.0.0.1:<free port>)")
    m.add_argument("--master-addr", "--master_addr", help="HOST of rank 0 (torchrun's; with --port)")
    m.add_argument(
        "--port", "--master-port", "--master_port", type=int, help="coordinator port (default: a free one)"
    )
    m.add_argument("--log-dir", help="write rank>0 output to DIR/rank_<r>.log instead of the terminal")
    m.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL (after a process crashed, at most 2: with one gone, "
        "the others' checkpoint cannot complete)",
    )
    s = p.add_argument_group("slurm, create_slurm (create_k8s: --nodes --gpus-per-node --task-per-gpu --env)")
    s.add_argument(
        "--nodes", "--num-nodes", "--nnodes", type=int, help="nodes (default 1, or the allocation's)"
    )
    s.add_argument("--ntasks-per-node", type=int, help="processes per node (default 1: all its GPUs)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU job)")
    s.add_argument("--task-per-gpu", action="store_true", help="one process per GPU instead of per node")
    s.add_argument("--cpus-per-task", type=int, help="CPUs for each process")
    s.add_argument("--time", default="01:00:00", help="time limit, HH:MM:SS")
    s.add_argument("--partition", help="SLURM partition")
    s.add_argument("--account", help="SLURM account")
    s.add_argument("--job-name", default="jaxtrain")
    s.add_argument("--output", default=slurm.DEFAULT_OUTPUT, help="job log (%%x name, %%j job id)")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="export in the job")
    s.add_argument("--signal-seconds", type=int, default=90, help="requeue this long before the limit")
    s.add_argument("--workdir", default=str(REPO), help="directory the job runs in")
    s.add_argument("--sbatch-script", default=slurm.DEFAULT_SBATCH, help="file create_slurm writes")
    s.add_argument("--follow", action="store_true", help="after sbatch, print the job log until it ends")
    k = p.add_argument_group("create_k8s (--mode k8s runs in each pod; --nproc-per-node there)")
    k.add_argument("--image", help="container image with jaxtrain installed (its repo at --image-workdir)")
    k.add_argument("--image-workdir", default="/app", help="the repo's directory in the image (/app)")
    k.add_argument("--manifest", default="k8s/jaxtrain.yaml", help="file create_k8s writes")
    k.add_argument("--max-restarts", type=int, default=3, help="restarts of the whole job after a failure")
    k.add_argument(
        "--indexed-job", action="store_true", help="an Indexed Job and headless Service, no JobSet"
    )
    k.add_argument("--namespace", help="Kubernetes namespace (default: kubectl's)")
    k.add_argument(
        "--secret", action="append", default=[], metavar="NAME", help="a Secret whose keys become variables"
    )
    k.add_argument(
        "--secret-file", action="append", default=[], metavar="NAME:DIR", help="a Secret's keys as files"
    )
    k.add_argument("--service-account", help="the pods' service account (Workload Identity, IRSA)")
    k.add_argument(
        "--pvc", action="append", default=[], metavar="CLAIM:DIR", help="a shared volume (e.g. for --run_dir)"
    )
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split launcher flags from the script's arguments at the first `--`."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return build_parser().parse_args(argv[:cut]), argv[cut + 1 :]


def main(argv: list[str]) -> int:
    """run_distributed.py: parse, plan, launch; returns the exit code."""
    args, script_args = parse_args(argv)
    invocation = shlex.join(["python", "scripts/run_distributed.py", *argv])
    if args.mode == "create_slurm":
        path = slurm.write_sbatch(args, script_args, Path(args.sbatch_script), invocation)
        print(f"wrote {path}; submit it with: sbatch {path}")
        return 0
    if args.mode == "create_k8s":
        path = k8s.write_manifest(args, script_args, invocation)
        print(f"wrote {path}; start it with: kubectl apply -f {path}")
        return 0
    if args.mode == "slurm":
        if "SLURM_JOB_ID" in os.environ:
            return slurm.run_srun(args, script_args, dict(os.environ))
        return slurm.submit(args, script_args, invocation)
    plan = k8s.plan_pod(args, dict(os.environ)) if args.mode == "k8s" else plan_manual(args, dict(os.environ))
    if not Path(args.script).is_file():
        raise ArgumentError(f"--script {args.script} not found; pass an existing script")
    return run_local(plan, [args.python, args.script, *script_args], args.log_dir, args.grace)
