"""Kubernetes (jaxtrain/launch/k8s.py, source k8s of jaxtrain/cluster/detect.py): the manifest
--mode create_k8s writes, checked against Kubernetes' own schemas (kubernetes-validate, strict) and
JobSet's CRD (tests/k8s/jobset_v1alpha2.schema.json); each pod's place found from exactly the
environment the manifest gives it (tests/pods.py fills it in as the controllers do); and four pods
simulated as processes in network namespaces of their own, under their own hostnames, that train
with their run dir in a bucket (moto, an S3-API server at this machine's address on the pods'
network, its endpoint and Secret given as the manifest gives them), lose one to kill -9, are all
restarted as JobSet's failure policy does, and resume bitwise from the bucket.

    pytest tests/test_k8s.py      # the pods' test needs root (network namespaces)
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pods import HOST, Pods, indexed_job_pods, jobset_pods, netns_works, stopped
from processes import TINY, clean_env, logged_losses, processes_marked, rank_pid
from stores import answering, free_port

from jaxtrain.cluster.detect import detect
from jaxtrain.config import DistConfig
from jaxtrain.errors import UserError
from jaxtrain.launch import cli, k8s

REPO = Path(__file__).resolve().parent.parent
BUCKET = "jaxtrain-pods"
SCHEMA = json.loads((REPO / "tests/k8s/jobset_v1alpha2.schema.json").read_text())
K8S_VERSION = "1.37.0"  # kubernetes-validate's newest schemas (constraints.txt pins the package)


GPT2 = ("--config", "configs/gpt2_124m.yaml")


def create(tmp_path: Path, *flags: str, script: tuple[str, ...] = GPT2) -> list:
    """The documents --mode create_k8s writes for `flags`, `script` the training's arguments."""
    path = tmp_path / "k8s.yaml"
    argv = ["--mode", "create_k8s", "--image", "ghcr.io/example/jaxtrain:1", "--manifest", str(path), *flags]
    assert cli.main([*argv, "--", *script]) == 0
    return list(yaml.safe_load_all(path.read_text()))


def closed(schema: Any) -> Any:
    """The CRD's schema as the API server applies it with kubectl's strict field validation: an
    object with listed properties takes no others (the server would prune them, kubectl refuses)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items() if k != "properties"}
    if "properties" in schema:
        out["properties"] = {name: closed(s) for name, s in schema["properties"].items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def as_job(rjob: dict) -> dict:
    """A replicated job's template as the Job the JobSet controller makes of it."""
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **rjob["template"]}


def pod_of(jobset: dict) -> dict:
    """The pod template's spec of a JobSet's (only) replicated job."""
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def check_jobset(doc: dict) -> None:
    """`doc` against JobSet's CRD, and its Job template (pod included) against Kubernetes' Job."""
    jsonschema.validate(doc, closed(SCHEMA), cls=jsonschema.Draft4Validator)
    for rjob in doc["spec"]["replicatedJobs"]:
        kubernetes_validate.validate(as_job(rjob), K8S_VERSION, strict=True)


def test_the_manifest_for_4_nodes_x_8_gpus_validates_against_kubernetes_and_jobset(tmp_path):
    flags = ("--num-nodes", "4", "--gpus-per-node", "8", "--secret", "bucket-keys", "--max-restarts", "5")
    (jobset,) = create(tmp_path, *flags, "--service-account", "trainer", "--pvc", "runs:/runs")
    check_jobset(jobset)
    spec = jobset["spec"]
    assert spec["failurePolicy"] == {"maxRestarts": 5}
    (rjob,) = spec["replicatedJobs"]
    assert rjob["replicas"] == 4 and rjob["template"]["spec"]["backoffLimit"] == 0
    pod = pod_of(jobset)
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["envFrom"] == [{"secretRef": {"name": "bucket-keys"}}]  # by reference, no value
    args = cli.build_parser().parse_args(["--mode", "create_k8s", "--pvc", "runs:/runs"])
    assert k8s.unshared_run_dir(args, ["--run_dir", "/runs/a"]) is None
    assert k8s.unshared_run_dir(args, ["--run_dir=gs://bucket/a"]) is None
    assert k8s.unshared_run_dir(args, ["--config", "configs/tiny.yaml"]) == "runs/<config name> (the default)"
    # The indexed Job and its headless Service, for clusters without JobSet.
    service, job = create(tmp_path, *flags, "--indexed-job")
    for doc in (service, job):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert service["spec"]["clusterIP"] == "None" and job["spec"]["completions"] == 4
    # The checks bite: a misspelt field fails each.
    wrong = copy.deepcopy(jobset)
    wrong["spec"]["replicatedJobs"][0]["replica"] = 4
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        check_jobset(wrong)
    wrong = copy.deepcopy(jobset)
    pod_of(wrong)["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(as_job(wrong["spec"]["replicatedJobs"][0]), K8S_VERSION, strict=True)


def test_each_pod_finds_its_place_from_the_environment_the_manifest_gives_it(tmp_path):
    (jobset,) = create(tmp_path, "--num-nodes", "4", "--gpus-per-node", "8")
    pods = jobset_pods(jobset, restart_attempt=1)
    assert [p.fqdn for p in pods] == [f"jaxtrain-workers-{i}-0.jaxtrain" for i in range(4)]
    specs = [detect(DistConfig(), pod.env) for pod in pods]  # the pod's variables and nothing else
    assert {s.source for s in specs} == {"k8s"} and [s.process_id for s in specs] == [0, 1, 2, 3]
    coordinator = f"{pods[0].fqdn}:{k8s.K8S_PORT}"
    assert {(s.num_processes, s.coordinator_address) for s in specs} == {(4, coordinator)}
    assert specs[2].details["JOBSET_RESTART_ATTEMPT"] == "1"
    older = {**pods[2].env, "JOBSET_JOBS": ""}  # a JobSet before v0.7 sets no global-replicas label
    with pytest.raises(UserError, match="JOBSET_JOBS empty or unset.*global-replicas.*v0.7"):
        detect(DistConfig(), older)
    # --mode k8s in pod 2: one worker with every GPU, or one per GPU.
    args = cli.build_parser().parse_args(["--mode", "k8s"])
    env = {**pods[2].env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(8)))}
    assert k8s.plan_pod(args, env) == k8s.LocalPlan(4, (2,), specs[0].coordinator_address, None)
    args = cli.build_parser().parse_args(["--mode", "k8s", "--nproc-per-node", "8"])
    plan = k8s.plan_pod(args, env)
    assert plan.world_size == 32 and plan.ranks == tuple(range(16, 24)) and plan.gpu_sets[3] == "3"
    # A lone Indexed Job: index, count and the coordinator through its headless Service.
    _, job = create(tmp_path, "--num-nodes", "4", "--indexed-job", "--job-name", "lm")
    specs = [detect(DistConfig(), pod.env) for pod in indexed_job_pods(job)]
    assert [(s.process_id, s.num_processes, s.coordinator_address) for s in specs] == [
        (i, 4, f"lm-0.lm:{k8s.K8S_PORT}") for i in range(4)
    ]


def _first_failure(procs: list[subprocess.Popen], timeout: float) -> int:
    """The index of the first pod whose container ends with an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if p.poll() not in (None, 0):
                return i
        time.sleep(0.05)
    raise AssertionError("no pod failed")


@pytest.mark.multihost
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.xdist_group("k8s_pods")
def test_four_pods_train_lose_one_to_kill_9_restart_together_and_resume_bitwise(tmp_path):
    why = netns_works()
    if why:
        pytest.skip(why)
    # The run dir in a bucket of an S3-API server outside the cluster, at this machine's address on
    # the pods' network; its keys in a Secret the manifest names, its endpoint in the manifest, as
    # a user points pods at an S3-compatible store. No run dir is shared: each pod has its own /tmp.
    prefix, subnet = f"jk{os.getpid() % 10000}", f"10.214.{os.getpid() % 200 + 20}"
    endpoint = f"http://{subnet}.{HOST}:{free_port()}"
    keys = {"AWS_ACCESS_KEY_ID": f"pods-{uuid.uuid4().hex[:8]}", "AWS_SECRET_ACCESS_KEY": uuid.uuid4().hex}
    args, run_dir = [*TINY, "--total_steps", "40", "--checkpoint_interval", "10"], f"s3://{BUCKET}/run"
    store = ("--secret", "bucket-keys", "--env", f"AWS_ENDPOINT_URL={endpoint}")
    store += ("--env", "AWS_REGION=us-east-1")
    (jobset,) = create(
        tmp_path, "--num-nodes", "4", "--gpus-per-node", "8", *store, script=(*args, "--run_dir", run_dir)
    )
    check_jobset(jobset)
    assert pod_of(jobset)["containers"][0]["envFrom"] == [{"secretRef": {"name": "bucket-keys"}}]
    assert keys["AWS_SECRET_ACCESS_KEY"] not in (tmp_path / "k8s.yaml").read_text()  # by reference only
    max_restarts = jobset["spec"]["failurePolicy"]["maxRestarts"]
    pod_grace = pod_of(jobset)["terminationGracePeriodSeconds"]
    secrets = {"bucket-keys": keys}  # the cluster's Secrets, which the kubelet reads
    marker = uuid.uuid4().hex
    image = {"python": sys.executable, "/app": str(REPO)}  # the image: this checkout and its python
    base = clean_env(1, drop=("AWS_", "STORAGE_EMULATOR_HOST"), JAXTRAIN_TEST_MARK=marker)  # the image's
    logs, disks = tmp_path / "pods", tmp_path / "disks"
    logs.mkdir()
    first_log = logs / "attempt0-pod0.log"
    restarts = 0
    pods = jobset_pods(jobset, secrets=secrets)
    with Pods(pods, prefix, subnet) as net, _s3_server(endpoint, keys, tmp_path / "s3.log") as server:
        server.ready()
        with stopped(_start_all(net, net.pods, base, image, logs / "attempt0", disks)) as procs:
            deadline = time.monotonic() + 180
            while _last_step(first_log) < 13 or server.get("run/checkpoints/10/checksums.json") is None:
                assert all(p.poll() is None for p in procs), first_log.read_text()[-3000:]
                assert time.monotonic() < deadline, "never got past the checkpoint of step 10"
                time.sleep(0.1)
            assert _last_step(first_log) < 40, "the run ended before the kill"
            os.kill(rank_pid(marker, 2), signal.SIGKILL)
            # JobSet: the failed pod fails its Job; the controller deletes every Job (SIGTERM to each
            # pod, SIGKILL after its grace) and creates them again with the next restart attempt.
            # Its peers may fail first, on the lost peer: any failed Job starts the restart. JobSet
            # reacts within seconds (the Job controller marks the Job failed, then JobSet sees it).
            _first_failure(procs, 60)
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[2].wait(timeout=5)
            assert procs[2].returncode == 128 + signal.SIGKILL  # its launcher names the kill
            t0 = time.monotonic()
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(timeout=pod_grace)
            stop_s = time.monotonic() - t0
        restarts += 1
        assert restarts <= max_restarts
        # The uninterrupted run: the same four processes, on this host, its run dir on disk; beside
        # the new pods (their start waits on the store's answers more than on the CPU).
        reference = tmp_path / "reference"
        with open(tmp_path / "reference.log", "w") as out:
            unbroken = subprocess.Popen(
                [sys.executable, "scripts/run_distributed.py", "--mode", "manual", "--world-size", "4", "--",
                 *args, "--run_dir", str(reference)],
                cwd=REPO, env=clean_env(1, JAXTRAIN_TEST_MARK=marker), stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        # New pods: new disks, the same Secret; all they find of the run is in the bucket.
        again = jobset_pods(jobset, restart_attempt=restarts, secrets=secrets)
        with (
            stopped([unbroken]),
            stopped(_start_all(net, again, base, image, logs / "attempt1", disks)) as procs,
        ):
            codes = [p.wait(timeout=300) for p in procs]
            assert unbroken.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-3000:]
        said = (logs / "attempt1-pod0.log").read_text()
        assert codes == [0, 0, 0, 0], said[-3000:]
        metrics = server.get("run/metrics.jsonl")
        assert server.get("run/job.lock") is None  # released at the end
    assert "jaxtrain launch: ranks 0..0 of 4, coordinator jaxtrain-workers-0-0.jaxtrain:29500" in said
    assert f"resumed from {run_dir}/checkpoints/" in said and "Kubernetes environment detected" not in said
    assert metrics is not None and _losses(metrics.decode()) == logged_losses(reference)  # bit for bit
    assert processes_marked(marker) == [], "processes left behind"
    assert not (REPO / "s3:").exists()  # nothing written locally under the URL's name
    print(f"the other pods stopped {stop_s:.1f} s after JobSet's SIGTERM")


class _Store:
    """The bucket BUCKET of an S3-API server, through boto3 with the pods' keys."""

    def __init__(self, endpoint: str, keys: dict[str, str], server: subprocess.Popen) -> None:
        self.endpoint, self.keys, self.server = endpoint, keys, server

    def ready(self) -> None:
        """Wait until the server answers, then create the bucket."""
        import boto3

        answering(self.endpoint, self.server)
        self.s3 = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=self.keys["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.keys["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip
        self.s3.create_bucket(Bucket=BUCKET)

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if there is none."""
        try:
            return self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None


@contextlib.contextmanager
def _s3_server(endpoint: str, keys: dict[str, str], log_path: Path) -> Iterator[_Store]:
    """moto in server mode at `endpoint`, started as tests/stores.py's fixture `s3` starts it but on
    this machine's address on the pods' network (Pods.host), where the pods reach it (that fixture's
    server, on 127.0.0.1, is out of their network namespaces' reach); stopped afterwards. Call
    ready() before use."""
    address = urllib.parse.urlsplit(endpoint)
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", str(address.hostname), "-p", str(address.port)],
            stdout=log, stderr=log,
        )  # fmt: skip
        try:
            yield _Store(endpoint, keys, server)
        finally:
            server.terminate()
            server.wait(10)


def _last_step(log: Path) -> int:
    """The last step a pod's container output (kubectl logs) shows, 0 before the first."""
    steps = re.findall(r"INFO step +(\d+) \| loss", log.read_text())
    return int(steps[-1]) if steps else 0


def _start_all(
    net: Pods, pods: list, base: dict, image: dict, log_prefix: Path, disks: Path
) -> list[subprocess.Popen]:
    """Every pod's container started, its output to LOG_PREFIX-pod<i>.log, its /tmp (TMPDIR: where
    a bucket run dir's records are kept before they go up) a fresh folder of its own under `disks`."""
    procs = []
    for i, pod in enumerate(pods):
        disk = disks / f"{log_prefix.name}-pod{i}"
        disk.mkdir(parents=True)
        with open(f"{log_prefix}-pod{i}.log", "w") as out:
            env = {**base, "TMPDIR": str(disk)}
            procs.append(net.start(i, pod, env, image, stdout=out, stderr=subprocess.STDOUT))
    return procs


def _losses(text: str) -> dict[int, float]:
    """The losses metrics.jsonl's text logs, by step."""
    records = [json.loads(x) for x in text.splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}
