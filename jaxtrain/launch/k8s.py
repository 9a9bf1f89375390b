"""Kubernetes: the manifest --mode create_k8s writes (a JobSet, or an Indexed Job with its headless
Service), and --mode k8s, which starts a pod's local workers.

The pods find their place in the job from their own environment (jaxtrain/cluster/detect.py,
source k8s): the manifest exposes the JobSet labels the controller puts on every pod as variables
(detect.K8S_LABELS) through the downward API, and Kubernetes sets JOB_COMPLETION_INDEX in every pod
of an Indexed Job. Pod i's hostname is <name>-workers-<i>-0; the coordinator is pod 0's,
<name>-workers-0-0.<name> (JobSet's spec.coordinator), reached through JobSet's headless Service.
A pod that fails fails its Job (backoffLimit 0) and JobSet recreates every Job, at most
--max-restarts times: the run resumes from its run dir, which every pod must reach (a bucket,
gs:// or s3://, or a shared volume, --pvc). Credentials go in by reference only (--secret,
--secret-file, --service-account).
The command line is jaxtrain/launch/cli.py. Never imports jax.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jaxtrain.cluster.detect import K8S_COMPLETIONS, K8S_JOB_NAME, K8S_LABELS, K8S_PORT, detect
from jaxtrain.config import DistConfig
from jaxtrain.errors import ArgumentError
from jaxtrain.launch.local import LocalPlan, local_gpus

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "workers"
CONTAINER = "jaxtrain"
# The pod's grace between SIGTERM and SIGKILL: enough for its workers to save a checkpoint (they
# get WORKER_GRACE_S of it from --mode k8s, which then kills them), then for that to end.
POD_GRACE_S, WORKER_GRACE_S = 120, 90
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
# Variables that hold a secret's value, which a manifest must never carry: they come from a Secret.
# A *_FILE or *_PATH variable names a file (GOOGLE_APPLICATION_CREDENTIALS, a token file) and may.
_CREDENTIAL = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY")


@dataclass(frozen=True)
class Mount:
    name: str  # the Secret's or PersistentVolumeClaim's name
    path: str  # where the pod sees it


def _mounts(flag: str, items: list[str]) -> list[Mount]:
    mounts = []
    for item in items:
        name, sep, path = item.partition(":")
        if not sep or not _DNS_NAME.fullmatch(name) or not path.startswith("/"):
            raise ArgumentError(f"{flag} {item!r} is not NAME:/PATH (NAME: a Kubernetes object's name)")
        mounts.append(Mount(name, path))
    return mounts


def _env_literals(items: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ArgumentError(f"--env {item!r} is not KEY=VALUE")
        if _CREDENTIAL.search(key.upper()) and not key.upper().endswith(("_FILE", "_PATH")):
            raise ArgumentError(
                f"--env {key}=...: a credential's value would be written into the manifest; put it in a "
                "Kubernetes Secret (kubectl create secret generic NAME --from-literal=KEY=VALUE) and pass "
                "--secret NAME"
            )
        pairs.append((key, value))
    return pairs


def _checked(args: argparse.Namespace) -> None:
    """Every flag of create_k8s checked before anything is written."""
    nodes = args.nodes if args.nodes is not None else 1
    if nodes < 1:
        raise ArgumentError(f"--num-nodes must be >= 1, got {nodes}")
    if args.gpus_per_node < 0:
        raise ArgumentError(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}")
    if args.task_per_gpu and args.gpus_per_node < 1:
        raise ArgumentError("--task-per-gpu needs --gpus-per-node G (G >= 1)")
    if not args.image:
        raise ArgumentError("--mode create_k8s needs --image IMAGE (a container image holding jaxtrain)")
    if args.max_restarts < 0:
        raise ArgumentError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    # The longest hostname, <name>-workers-<N-1>-0, is one DNS label: at most 63 characters.
    longest = f"{args.job_name}-{REPLICATED_JOB}-{nodes - 1}-0"
    if not _DNS_LABEL.fullmatch(args.job_name) or len(longest) > 63:
        raise ArgumentError(
            f"--job-name {args.job_name!r} must be lower-case letters, digits and '-', start with a letter, "
            f"and leave the pods' hostnames ({longest}) at most 63 characters"
        )
    for flag, name in (("--namespace", args.namespace), ("--service-account", args.service_account)):
        if name is not None and not _DNS_LABEL.fullmatch(name):
            raise ArgumentError(f"{flag} {name!r} is not a Kubernetes name (lower-case letters, digits, '-')")
    for name in args.secret:
        if not _DNS_NAME.fullmatch(name):
            raise ArgumentError(f"--secret {name!r} is not a Kubernetes Secret's name")
    if not args.image_workdir.startswith("/"):
        raise ArgumentError(f"--image-workdir {args.image_workdir!r} must be an absolute path")


def _container(args: argparse.Namespace, script_args: list[str], jobset: bool) -> dict[str, Any]:
    """The one container of every pod: the pod's launcher, its environment, GPUs, /dev/shm."""
    command = ["python", "scripts/run_distributed.py", "--mode", "k8s", "--grace", str(WORKER_GRACE_S)]
    if args.task_per_gpu:
        command += ["--nproc-per-node", str(args.gpus_per_node)]
    if args.script != "scripts/train.py":
        command += ["--script", args.script]
    env: list[dict[str, Any]] = []
    labels = dict(K8S_LABELS) if jobset else {K8S_JOB_NAME[0]: K8S_JOB_NAME[1]}
    for var, label in labels.items():
        env.append({"name": var, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}})
    if not jobset:
        env.append({"name": K8S_COMPLETIONS, "value": str(args.nodes or 1)})
    env += [{"name": k, "value": v} for k, v in _env_literals(args.env)]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": args.image,
        "workingDir": args.image_workdir,
        "command": [*command, "--", *script_args],
        "env": env,
    }
    if args.secret:
        container["envFrom"] = [{"secretRef": {"name": name}} for name in args.secret]
    if args.gpus_per_node:
        gpus = str(args.gpus_per_node)
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    mounts += [
        {"name": f"secret-{i}", "mountPath": m.path, "readOnly": True}
        for i, m in enumerate(_mounts("--secret-file", args.secret_file))
    ]
    mounts += [{"name": f"shared-{i}", "mountPath": m.path} for i, m in enumerate(_mounts("--pvc", args.pvc))]
    container["volumeMounts"] = mounts
    return container


def _pod_spec(args: argparse.Namespace, script_args: list[str], jobset: bool) -> dict[str, Any]:
    # JAX's collectives move data through shared memory: a container's default /dev/shm is 64 MB.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    volumes += [
        {"name": f"secret-{i}", "secret": {"secretName": m.name}}
        for i, m in enumerate(_mounts("--secret-file", args.secret_file))
    ]
    volumes += [
        {"name": f"shared-{i}", "persistentVolumeClaim": {"claimName": m.name}}
        for i, m in enumerate(_mounts("--pvc", args.pvc))
    ]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a failure fails the Job; JobSet restarts the whole set
        "terminationGracePeriodSeconds": POD_GRACE_S,
        "containers": [_container(args, script_args, jobset)],
        "volumes": volumes,
    }
    if args.service_account:
        spec["serviceAccountName"] = args.service_account  # GKE Workload Identity, EKS IRSA / Pod Identity
    if args.gpus_per_node:
        # GPU node pools are often tainted so that only pods asking for GPUs land there.
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def _metadata(args: argparse.Namespace, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "jaxtrain"}}
    if args.namespace:
        meta["namespace"] = args.namespace
    return meta


def jobset(args: argparse.Namespace, script_args: list[str]) -> dict[str, Any]:
    """A JobSet of --num-nodes Jobs of one pod each, restarted whole up to --max-restarts times."""
    name = args.job_name
    job = {
        "completionMode": "Indexed",
        "parallelism": 1,
        "completions": 1,
        "backoffLimit": 0,
        "template": {"spec": _pod_spec(args, script_args, jobset=True)},
    }
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(args, name),
        "spec": {
            "failurePolicy": {"maxRestarts": args.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "coordinator": {"replicatedJob": REPLICATED_JOB, "jobIndex": 0, "podIndex": 0},
            "replicatedJobs": [
                {"name": REPLICATED_JOB, "replicas": args.nodes or 1, "template": {"spec": job}}
            ],
        },
    }


def indexed_job(args: argparse.Namespace, script_args: list[str]) -> list[dict[str, Any]]:
    """For clusters without JobSet: a headless Service and an Indexed Job of --num-nodes pods.

    Kubernetes replaces a failed pod alone; the others fail on the lost peer and are replaced in
    turn, so a restart of the whole job costs up to N pod failures: backoffLimit allows N per restart.
    """
    name, nodes = args.job_name, args.nodes or 1
    pod = _pod_spec(args, script_args, jobset=False)
    pod["subdomain"] = name  # hostnames <name>-<index>.<name>, through the Service below
    selector = {"jaxtrain.job": name}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(args, name),
        "spec": {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses": True},
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(args, name),
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": args.max_restarts * nodes,
            "template": {"metadata": {"labels": selector}, "spec": pod},
        },
    }
    return [service, job]


def manifest(args: argparse.Namespace, script_args: list[str], invocation: str) -> str:
    """The YAML text of the JobSet (or, with --indexed-job, the Service and the Indexed Job)."""
    _checked(args)
    docs = indexed_job(args, script_args) if args.indexed_job else [jobset(args, script_args)]
    head = (
        f"# jaxtrain on Kubernetes: {args.nodes or 1} pod(s) x {args.gpus_per_node} GPU(s). Start it with:\n"
        f"#     kubectl apply -f {args.manifest}\n# Made by: {invocation}\n"
    )
    return head + yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def unshared_run_dir(args: argparse.Namespace, script_args: list[str]) -> str | None:
    """The training's --run_dir when no pod but the one that wrote it could read it back (neither a
    bucket nor under a --pvc mount); None when it is shared."""
    run_dir = "runs/<config name> (the default)"
    for i, word in enumerate(script_args):
        if word == "--run_dir" and i + 1 < len(script_args):
            run_dir = script_args[i + 1]
        elif word.startswith("--run_dir="):
            run_dir = word.partition("=")[2]
    if "://" in run_dir:
        return None
    absolute = Path(args.image_workdir, run_dir)
    shared = [Path(m.path) for m in _mounts("--pvc", args.pvc)]
    return None if any(absolute.is_relative_to(p) for p in shared) else run_dir


def write_manifest(args: argparse.Namespace, script_args: list[str], invocation: str) -> Path:
    """Write the manifest to --manifest; nothing is written when a flag is refused."""
    text = manifest(args, script_args, invocation)
    local = unshared_run_dir(args, script_args)
    if local:
        print(
            f"warning: --run_dir {local} is on each pod's own disk: a restarted pod cannot resume from "
            "it; put it on a shared volume (--pvc CLAIM:DIR and a run dir under DIR) or in a bucket",
            file=sys.stderr,
        )
    path = Path(args.manifest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def plan_pod(args: argparse.Namespace, environ: dict[str, str]) -> LocalPlan:
    """--mode k8s: this pod's workers (one, or --nproc-per-node), from the pod's environment."""
    if "JOB_COMPLETION_INDEX" not in environ:
        raise ArgumentError(
            "--mode k8s runs in a pod of a JobSet or Indexed Job, and JOB_COMPLETION_INDEX is not set; "
            "write the manifest with --mode create_k8s"
        )
    pod = detect(DistConfig(), environ)
    if pod.source != "k8s":
        raise ArgumentError(f"--mode k8s: this pod's place comes from {pod.source}, not from Kubernetes")
    per_pod = args.nproc_per_node or 1
    if per_pod < 1:
        raise ArgumentError(f"--nproc-per-node must be >= 1, got {per_pod}")
    first = pod.process_id * per_pod
    coordinator = pod.coordinator_address or f"127.0.0.1:{K8S_PORT}"  # a pod alone: its own
    gpus = local_gpus(environ)
    gpu_sets = None
    if gpus and per_pod > 1:
        if len(gpus) % per_pod:
            raise ArgumentError(f"{len(gpus)} GPUs cannot be split evenly between {per_pod} processes")
        k = len(gpus) // per_pod
        gpu_sets = tuple(",".join(gpus[i * k : (i + 1) * k]) for i in range(per_pod))
    return LocalPlan(pod.num_processes * per_pod, tuple(range(first, first + per_pod)), coordinator, gpu_sets)
