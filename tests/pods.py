"""Kubernetes pods simulated as processes: the environment, hostname and command a manifest gives
each pod, as the JobSet and Job controllers and the kubelet fill them in, and (root) network
namespaces as the pods' own hosts, each name resolving as the cluster's DNS would.

    from pods import Pods, jobset_pods, indexed_job_pods

What is simulated, and from where: the pod labels are the JobSet controller's
(kubernetes-sigs/jobset pkg/controllers/jobset_controller.go, labelAndAnnotateObject); pod i of
Job j of a JobSet is named <jobset>-<rjob>-<j>-<i> with subdomain spec.network.subdomain (default
the JobSet's name), a lone Indexed Job's <job>-<i> with its template's subdomain; the Job controller
sets JOB_COMPLETION_INDEX, and the kubelet HOSTNAME, the Kubernetes service variables and each
Secret an `envFrom` names (`secrets`, as the API server holds them; one missing fails the pod, as
the kubelet's CreateContainerConfigError does). The image's own environment is the test's (`base`);
what the manifest asks for replaces it. This machine is on the pods' network too, at
<subnet>.254 (`Pods.host`): a server bound there (an object store) is one the pods reach as a
cluster's pods reach a store outside the cluster, by its address. (No jax here.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What the kubelet gives every container (the API server's Service, as seen from a pod).
KUBELET_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
Secrets = dict[str, dict[str, str]]  # the cluster's Secrets by name: each its keys and values


@dataclass(frozen=True)
class Pod:
    hostname: str
    subdomain: str
    env: dict[str, str]  # what the manifest and Kubernetes give the container, beyond the image's
    command: list[str]  # the container's command and args
    workdir: str | None

    @property
    def fqdn(self) -> str:
        return f"{self.hostname}.{self.subdomain}"


def _container_env(
    container: dict[str, Any], labels: dict[str, str], annotations: dict[str, str], secrets: Secrets
) -> dict[str, str]:
    """The container's `envFrom` Secrets' keys, then its `env` over them (Kubernetes: `env` wins),
    each value or downward-API field resolved against the pod's metadata."""
    env = {}
    for source in container.get("envFrom", []):
        name = source["secretRef"]["name"]  # the only kind our manifests use
        assert name in secrets, f"CreateContainerConfigError: secret {name!r} not found"
        env.update({source.get("prefix", "") + k: v for k, v in secrets[name].items()})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]  # the only kind our manifests use
        kind, _, key = path.partition("[")
        source = {"metadata.labels": labels, "metadata.annotations": annotations}[kind]
        env[item["name"]] = source.get(key.strip("]'\""), "")  # a missing label reads as ""
    return env


def jobset_pods(
    jobset: dict[str, Any], restart_attempt: int = 0, secrets: Secrets | None = None
) -> list[Pod]:
    """Every pod of a JobSet's restart `restart_attempt`, in job order, with labels as its controller
    sets them, the Secrets its `envFrom` names taken from `secrets`."""
    name, spec = jobset["metadata"]["name"], jobset["spec"]
    subdomain = spec.get("network", {}).get("subdomain") or name
    rjobs = spec["replicatedJobs"]
    total = sum(r.get("replicas", 1) for r in rjobs)
    coordinator = spec.get("coordinator")
    pods, global_index = [], 0
    for rjob in rjobs:
        for j in range(rjob.get("replicas", 1)):
            labels = {
                "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                "jobset.sigs.k8s.io/restart-attempt": str(restart_attempt),
                "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob.get("replicas", 1)),
                "jobset.sigs.k8s.io/global-replicas": str(total),
                "jobset.sigs.k8s.io/job-index": str(j),
                "jobset.sigs.k8s.io/job-global-index": str(global_index),
            }
            if coordinator:
                labels["jobset.sigs.k8s.io/coordinator"] = (
                    f"{name}-{coordinator['replicatedJob']}-{coordinator.get('jobIndex', 0)}-"
                    f"{coordinator.get('podIndex', 0)}.{subdomain}"
                )
            job = rjob["template"]["spec"]
            for i in range(job.get("completions", 1)):
                hostname = f"{name}-{rjob['name']}-{j}-{i}"
                pods.append(_pod(job["template"], hostname, subdomain, i, labels, secrets or {}))
            global_index += 1
    return pods


def indexed_job_pods(job: dict[str, Any], secrets: Secrets | None = None) -> list[Pod]:
    """Every pod of a lone Indexed Job; `secrets` as for jobset_pods."""
    name, spec = job["metadata"]["name"], job["spec"]
    labels = {"batch.kubernetes.io/job-name": name, "job-name": name}
    template = spec["template"]
    labels.update(template.get("metadata", {}).get("labels", {}))
    subdomain = template["spec"]["subdomain"]
    secrets = secrets or {}
    return [_pod(template, f"{name}-{i}", subdomain, i, labels, secrets) for i in range(spec["completions"])]


def _pod(
    template: dict[str, Any],
    hostname: str,
    subdomain: str,
    index: int,
    labels: dict[str, str],
    secrets: Secrets,
) -> Pod:
    labels = {**template.get("metadata", {}).get("labels", {}), **labels}
    annotations = {**labels, "batch.kubernetes.io/job-completion-index": str(index)}
    (container,) = template["spec"]["containers"]
    env = {**KUBELET_ENV, "HOSTNAME": hostname, "JOB_COMPLETION_INDEX": str(index)}
    env.update(_container_env(container, labels, annotations, secrets))
    command = [*container.get("command", []), *container.get("args", [])]
    return Pod(hostname, subdomain, env, command, container.get("workingDir"))


def netns_works() -> str | None:
    """Why namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "needs the `ip` (iproute2) and `unshare` commands"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr}"


HOST = 254  # this machine's (the root namespace's) last octet on the pods' network


class Pods:
    """One network namespace per pod, joined by a bridge in a namespace of its own (the root
    namespace's firewall never sees their traffic between pods); each pod's /etc/hosts names every
    pod as the cluster's DNS answers the headless Service's names. The root namespace joins the
    bridge too, at `host`, for servers outside the cluster. Use as a context manager."""

    def __init__(self, pods: list[Pod], prefix: str, subnet: str) -> None:
        self.pods, self.prefix, self.subnet = pods, prefix, subnet
        self.namespaces = [f"{prefix}{i}" for i in range(len(pods))]
        assert len(pods) < HOST

    @property
    def host(self) -> str:
        """This machine's address on the pods' network: bind a server there for the pods to reach."""
        return f"{self.subnet}.{HOST}"

    def __enter__(self) -> Pods:
        self.down()
        switch = f"{self.prefix}sw"
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        _ip("link", "add", f"{self.prefix}h", "type", "veth", "peer", "name", f"{self.prefix}hb")
        _ip("link", "set", f"{self.prefix}hb", "netns", switch)
        _ip("-n", switch, "link", "set", f"{self.prefix}hb", "master", "br0", "up")
        _ip("addr", "add", f"{self.host}/24", "dev", f"{self.prefix}h")
        _ip("link", "set", f"{self.prefix}h", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.subnet}.{i + 1} {p.fqdn} {p.hostname}\n" for i, p in enumerate(self.pods)
        )
        for i, ns in enumerate(self.namespaces):
            inside, outside = f"{self.prefix}p{i}", f"{self.prefix}b{i}"
            _ip("netns", "add", ns)
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "netns", switch)
            _ip("-n", switch, "link", "set", outside, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def down(self) -> None:
        subprocess.run(["ip", "link", "del", f"{self.prefix}h"], capture_output=True, timeout=30)
        for ns in [*self.namespaces, f"{self.prefix}sw"]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    def start(
        self, i: int, pod: Pod, base: dict[str, str], image: dict[str, str], **popen: Any
    ) -> subprocess.Popen:
        """Pod i's container in its namespace under its hostname: the image's environment `base`
        with the pod's over it; `image` maps the manifest's words to this machine's (its python,
        its working dir)."""
        command = [image.get(word, word) for word in pod.command]
        workdir = image.get(pod.workdir or "", pod.workdir)
        script = 'hostname "$0" && exec "$@"'
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "sh", "-c", script, pod.hostname,
             *command],
            env={**base, **pod.env}, cwd=workdir, **popen,
        )  # fmt: skip


@contextlib.contextmanager
def stopped(procs: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    """Yield `procs`; afterwards kill any still running."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
