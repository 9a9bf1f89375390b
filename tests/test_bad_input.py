"""Bad input at every entry point: one line naming the problem and the fix, exit 2, in seconds.

Each case runs a real script (train.py, prepare_data.py, run_distributed.py, launch_multi_node.sh,
test_distributed.py, plot_metrics.py) as a subprocess, except train.py's cases that are about
the input and not about a process: those call the same entry point in this process
(jaxtrain.run.cli.main under exit_on_user_error, as scripts/train.py does), with the environment a
subprocess would get. A real-process sample of every kind stays (REAL_PROCESS), with every case
that depends on the process itself (its device count, joining a job). Each must end with exit
code 2, stderr's last line `error: ...` holding a phrase that names the problem, no traceback,
within TIMEOUT_S, and leave every file it was pointed at as it was. Then the security checks: no
secret in the run dir, no world-writable files, no Python objects from YAML, no pickles.

    pytest tests/test_bad_input.py     # about 1 minute on 2 cores
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import processes
import pytest
import yaml

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.config import load_config, to_yaml
from jaxtrain.run import cli

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60
TRAIN = [sys.executable, "scripts/train.py"]
TINY_ARGS = [*TRAIN, "--config", "configs/tiny.yaml"]
TINY = [*TINY_ARGS, "--run_dir", "{tmp}/run"]  # never the repo's runs/tiny
WANDB = ["--use_wandb", "--wandb_mode", "offline"]  # as the shared run was made
PREPARE = [sys.executable, "scripts/prepare_data.py"]
LAUNCH = [sys.executable, "scripts/run_distributed.py"]
MULTI = ["bash", "scripts/launch_multi_node.sh"]
HEALTH = [sys.executable, "scripts/test_distributed.py"]
PLOT = [sys.executable, "scripts/plot_metrics.py"]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher, JAXTRAIN_ or wandb variables: CPU, 2 devices, plus `extra`."""
    return processes.clean_env(2, drop=("JAXTRAIN_", "WANDB_"), **{"WANDB_SILENT": "true", **extra})


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def last_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = TIMEOUT_S, **kw: Any) -> Ran:
    t0 = time.monotonic()
    out = subprocess.run(
        argv, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=timeout, **kw
    )
    return Ran(out.returncode, out.stdout, out.stderr, time.monotonic() - t0)


def run_here(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capfd: Any) -> Ran:
    """train.py's entry point in this process, with the environment `run` would give a subprocess
    (this process's 8 CPU devices aside): what it prints, its exit code, its seconds."""
    assert argv[:2] == TRAIN, argv
    started_with = os.environ["XLA_FLAGS"]  # this process's backend has started: it keeps them
    for key in list(os.environ):
        if key not in env:
            monkeypatch.delenv(key)
    for key, value in {**env, "XLA_FLAGS": started_with}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    umask = os.umask(0o022)  # train.py narrows the umask for its run dir: given back after
    os.umask(umask)
    capfd.readouterr()
    t0 = time.monotonic()
    try:
        exit_on_user_error(cli.main)(argv[2:])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        os.umask(umask)
    out, err = capfd.readouterr()
    return Ran(code, out, err, time.monotonic() - t0)


def snapshot(*roots: Path) -> dict[str, tuple[str, int, int]]:
    """(sha256, mtime_ns, mode) of every file and dir under `roots`: what 'nothing changed' means."""
    out = {}
    for root in roots:
        for p in [root, *root.rglob("*")] if root.exists() else []:
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            out[str(p)] = (digest, st.st_mtime_ns if p.is_file() else 0, stat.S_IMODE(st.st_mode))
    return out


# ---------------------------------------------------------------- one real run, shared


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Any]:
    """A finished tiny run (checkpoints at steps 10 and 20), made with a wandb key in the env and
    umask 000, so the security tests can look at what it wrote."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    secret = "wk-" + secrets.token_hex(20)
    out = run(
        [*TINY_ARGS, "--run_dir", str(run_dir), *WANDB],
        env=clean_env(WANDB_API_KEY=secret, JAXTRAIN_TEST_SECRET=secret),
        timeout=240,
        umask=0,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {"run_dir": run_dir, "secret": secret, "out": out}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- setups: files a case points at


def _tokens(name: str, data: bytes) -> Callable[[dict], None]:
    def setup(ctx: dict) -> None:
        path = ctx["tmp"] / name
        path.write_bytes(data)
        ctx["watch"].append(path)

    return setup


def _llmc_header_lies(ctx: dict) -> None:
    header = np.zeros(256, "<i4")
    header[:3] = (20240520, 1, 5000)  # says 5000 tokens, holds 100
    path = ctx["tmp"] / "lies.bin"
    path.write_bytes(header.tobytes() + np.arange(100, dtype="<u2").tobytes())
    ctx["watch"].append(path)


def _yaml_file(name: str, text: str) -> Callable[[dict], None]:
    def setup(ctx: dict) -> None:
        (ctx["tmp"] / name).parent.mkdir(exist_ok=True)
        (ctx["tmp"] / name).write_text(text)
        ctx["watch"].append(ctx["tmp"] / name)

    return setup


def _incompatible_run_dir(ctx: dict) -> None:
    run_dir = ctx["tmp"] / "run"
    run_dir.mkdir()
    cfg = load_config(["--config", "configs/tiny.yaml", "--model.n_layer", "7"])  # as train.py saves it
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "train.log").write_text("an earlier run's log\n")
    ctx["watch"].append(run_dir)


def _garbled_run_config(ctx: dict) -> None:
    run_dir = ctx["tmp"] / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model: [unclosed\n")
    ctx["watch"].append(run_dir)


def _copy_trained(ctx: dict) -> Path:
    """A copy of the shared run to break; its checkpoints, metrics and config must survive a relaunch."""
    run_dir = ctx["tmp"] / "run"
    shutil.copytree(ctx["trained"]["run_dir"], run_dir, symlinks=True)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["run_dir"] = str(run_dir)  # as if it had been trained here
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    ctx["watch"] += [run_dir / "checkpoints", run_dir / "metrics.jsonl", run_dir / "wandb_id"]
    ctx["same_bytes"].append(run_dir / "config.yaml")  # rewritten with the same text before the restore
    return run_dir


def _state_deleted(ctx: dict) -> None:
    run_dir = _copy_trained(ctx)
    for p in (run_dir / "checkpoints" / "20" / "state").iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _state_truncated(ctx: dict) -> None:
    run_dir = _copy_trained(ctx)
    for p in (run_dir / "checkpoints" / "20" / "state").rglob("*"):
        if p.is_file():
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])


def _meta_garbage(ctx: dict) -> None:
    _meta_garbage_in(_copy_trained(ctx))


def _all_truncated(ctx: dict) -> None:
    """Every checkpoint damaged: nothing to fall back on."""
    run_dir = _copy_trained(ctx)
    for p in (run_dir / "checkpoints").rglob("*"):
        if p.is_file() and p.parent.name == "d":  # the array data, one file per checkpoint here
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])


def _damaged_source(ctx: dict) -> None:
    """An explicit --resume_from step dir that is damaged (the run dir itself is new)."""
    src = ctx["tmp"] / "src"
    shutil.copytree(ctx["trained"]["run_dir"], src, symlinks=True)
    _meta_garbage_in(src)
    ctx["watch"].append(src)


def _meta_garbage_in(run_dir: Path) -> None:
    for p in (run_dir / "checkpoints" / "20" / "meta").iterdir():
        p.write_bytes(b"\x00garbage{{{")


def _empty_checkpoints_dir(ctx: dict) -> None:
    (ctx["tmp"] / "nockpt" / "checkpoints").mkdir(parents=True)


def _port_in_use(ctx: dict) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    ctx["port"] = s.getsockname()[1]
    ctx["cleanup"].append(s.close)


def _closed(ctx: dict) -> None:
    ctx["port"] = _closed_port()


def _no_sbatch(ctx: dict) -> None:
    (ctx["tmp"] / "bin").mkdir()
    ctx["env"]["PATH"] = str(ctx["tmp"] / "bin")


def _hostfile(lines: str) -> Callable[[dict], None]:
    def setup(ctx: dict) -> None:
        (ctx["tmp"] / "hosts.txt").write_text(lines)

    return setup


def _prepared(ctx: dict) -> None:
    (ctx["tmp"] / "in.txt").write_text("hello world\n" * 200)
    out = ctx["tmp"] / "data"
    out.mkdir()
    (out / "train.bin").write_bytes(b"\x01\x00" * 64)
    (out / "val.bin").write_bytes(b"\x02\x00" * 8)
    ctx["watch"].append(out)


def _a_file(ctx: dict) -> None:
    (ctx["tmp"] / "afile").write_text("not a directory\n")
    ctx["watch"].append(ctx["tmp"] / "afile")


def _metrics(ctx: dict) -> None:
    (ctx["tmp"] / "run").mkdir()
    (ctx["tmp"] / "run" / "metrics.jsonl").write_text('{"step": 5, "loss": 3.0}\n')
    ctx["watch"].append(ctx["tmp"] / "run")


def _fake_nvidia_smi(ctx: dict) -> None:
    """An nvidia-smi that lists two GPUs, first on PATH: a GPU machine whose jax is the CPU build."""
    script = ctx["tmp"] / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    script.chmod(0o755)


def _no_url_folder(ctx: dict) -> None:
    ctx["watch"].append(ROOT / "https:")  # must not come to exist


def _watch_tmp(ctx: dict) -> None:
    ctx["watch"].append(ctx["tmp"])  # nothing may appear in it


def _text(ctx: dict) -> None:
    (ctx["tmp"] / "in.txt").write_text("hello world\n" * 200)


# ---------------------------------------------------------------- the table
# ruff: noqa: E501  (one case per line reads best)


@dataclass
class Case:
    id: str
    argv: list[str]  # {tmp}, {trained}, {port} are filled in
    phrase: str  # must appear in stderr's last line, which starts with `error:`
    setup: Callable[[dict], None] | None = None
    env: dict[str, str] = field(default_factory=dict)


CASES = [
    # -- train.py: config and flags
    Case("train-typo-key", [*TINY, "--batch_sise", "8"], "unknown config key 'batch_sise' (did you mean 'batch_size'?)"),
    Case("train-wrong-type", [*TINY, "--batch_size", "lots"], "config key 'batch_size' must be int, got 'lots'"),
    Case("train-impossible-heads", [*TINY, "--model.n_head", "3"], "model.d_model 64 is not divisible by model.n_head 3"),
    Case("train-zero-steps", [*TINY, "--total_steps", "0"], "config key 'total_steps' must be > 0"),
    Case("train-bad-choice", [*TINY, "--dtype", "fp8"], "config key 'dtype' must be one of float32|bfloat16|float16"),
    # -- train.py: the PyTorch guides' flags, checked against the job
    Case("guide-world-size", [*TINY, "--distributed", "--world_size", "4"], "--world_size 4 but this process has 2 cpu device(s)"),
    Case("guide-local-rank", [*TINY, "--local-rank=1"], "--local_rank 1 but the launcher says this process's local rank is 0"),
    Case("guide-nccl-on-cpu", [*TINY, "--backend", "nccl"], "--backend nccl needs GPUs, but this job runs on cpu"),
    Case("guide-bad-backend", [*TINY, "--backend", "mpi"], "config key 'compat.backend' must be one of auto|nccl|gloo"),
    Case("guide-negative-epochs", [*TINY, "--epochs", "-1"], "config key 'epochs' must be >= 0"),
    Case("guide-single-gpu-many-devices", [*TINY, "--single_gpu"], "--single_gpu but this process sees 2 cpu devices"),
    Case("train-flag-without-value", [*TINY, "--batch_size"], "flag --batch_size needs a value"),
    Case("train-positional", [*TINY, "configs/tiny.yaml"], "unexpected argument 'configs/tiny.yaml'"),
    Case("train-missing-config", [*TRAIN, "--config", "{tmp}/nope.yaml", "--run_dir", "{tmp}/run"], "nope.yaml not found"),
    Case("train-config-syntax", [*TRAIN, "--config", "{tmp}/broken.yaml", "--run_dir", "{tmp}/run"], "is not valid YAML at line",
         _yaml_file("broken.yaml", "model:\n  n_layer: [2\nbatch_size: 4\n")),
    Case("train-config-not-mapping", [*TRAIN, "--config", "{tmp}/list.yaml", "--run_dir", "{tmp}/run"], "must hold a mapping",
         _yaml_file("list.yaml", "- 1\n- 2\n")),
    Case("train-batch-vs-devices", [*TINY, "--batch_size", "3"], "microbatch 3 (batch_size 3 / gradient_accumulation_steps 1) is not divisible by 2 devices"),
    Case("train-gpus-jax-cannot-see", [*TINY], "this machine has 2 NVIDIA GPU(s) (nvidia-smi) but jax sees only its CPU",
         _fake_nvidia_smi, env={"JAX_PLATFORMS": "", "PATH": "{tmp}/bin:" + os.environ["PATH"]}),
    Case("train-float16-on-cpu", [*TINY, "--dtype", "float16"], "dtype float16 needs a GPU"),
    Case("train-pallas-on-cpu", [*TINY, "--model.moe.n_experts", "2", "--model.moe.grouped_matmul", "pallas"],
         "model.moe.grouped_matmul pallas needs Hopper GPUs (9.0), not cpu"),
    Case("train-cudnn-on-cpu", [*TINY, "--config", "configs/deepseek_tiny.yaml", "--model.attention_impl", "cudnn"],
         "model.attention_impl cudnn needs NVIDIA GPUs, and this job runs on cpu"),
    # -- train.py: data files
    Case("data-missing", [*TINY, "--train_data_path", "{tmp}/missing.bin"], "missing.bin does not exist"),
    Case("data-is-a-dir", [*TINY, "--train_data_path", "{tmp}"], "is not a file"),
    Case("data-empty", [*TINY, "--train_data_path", "{tmp}/empty.bin"], "is empty (0 bytes)", _tokens("empty.bin", b"")),
    Case("data-short", [*TINY, "--train_data_path", "{tmp}/short.bin"], "holds 10 tokens, fewer than the 33",
         _tokens("short.bin", np.arange(10, dtype="<u2").tobytes())),
    Case("data-odd-length", [*TINY, "--train_data_path", "{tmp}/odd.bin"], "not a multiple of 2 (uint16): it is truncated",
         _tokens("odd.bin", b"\x01" * 4097)),
    Case("data-out-of-vocab", [*TINY, "--train_data_path", "{tmp}/big.bin"], "holds token id 300 at position 0 but model.vocab_size is 256",
         _tokens("big.bin", np.full(4096, 300, "<u2").tobytes())),
    Case("data-header-lies", [*TINY, "--train_data_path", "{tmp}/lies.bin"], "header says 5000 tokens but the file holds 100", _llmc_header_lies),
    Case("data-bad-valid", [*TINY, "--valid_data_path", "{tmp}/nothing.bin"], "nothing.bin does not exist"),
    # -- train.py: run dirs and checkpoints
    Case("rundir-incompatible", [*TINY], "holds a run with a different config (model.n_layer: 7 -> 2",
         _incompatible_run_dir),
    Case("rundir-garbled-config", [*TINY], "config.yaml is not a saved config (bad YAML or not a mapping); fix it, or pass --overwrite",
         _garbled_run_config),
    Case("rundir-not-a-mapping", [*TINY], "config.yaml is not a saved config", _yaml_file("run/config.yaml", "- 1\n")),
    Case("rundir-is-a-file", [*TINY, "--run_dir", "{tmp}/afile"], "run dir {tmp}/afile cannot be made: {tmp}/afile is a file", _a_file),
    Case("rundir-under-a-file", [*TINY, "--run_dir", "{tmp}/afile/run"], "cannot be made: {tmp}/afile is a file", _a_file),
    Case("resume-from-a-file", [*TINY, "--resume_from", "{tmp}/afile"], "--resume_from {tmp}/afile is a file", _a_file),
    Case("resume-missing", [*TINY, "--resume_from", "{tmp}/nowhere"], "--resume_from {tmp}/nowhere does not exist"),
    Case("resume-empty", [*TINY, "--resume_from", "{tmp}/nockpt"], "holds no complete checkpoint",
         _empty_checkpoints_dir),
    Case("resume-other-shape", [*TINY, "--resume_from", "{trained}/checkpoints", "--model.n_layer", "3"],
         "was written by a different config (model.n_layer: 2 -> 3)"),
    Case("resume-other-batch", [*TINY, "--resume_from", "{trained}/checkpoints/10", "--batch_size", "32"],
         "checkpoints/10 was written by a different config (batch_size: 16 -> 32)"),
    Case("resume-other-optimizer", [*TINY, "--resume_from", "{trained}/checkpoints/10", "--optim.name", "muon"],
         "checkpoints/10 was written by a different config (optim.name: 'adamw' -> 'muon')"),
    Case("ckpt-none-readable", [*TINY, *WANDB], "checkpoints is readable (20: ", _all_truncated),
    # -- train.py: URLs in path keys (read as a local path, gs://bucket/x made a folder gs:/bucket/x and
    # failed at the first save), here of schemes no key reads
    Case("url-run-dir", [*TRAIN, "--config", "configs/tiny.yaml", "--run_dir", "https://host/x"],
         "run_dir names a URL (https://host/x)", _no_url_folder),
    Case("url-train-data", [*TINY, "--train_data_path", "ftp://b/train.bin"], "train_data_path names a URL (ftp://b/train.bin)"),
    Case("url-in-a-source-list", [*TINY, "--valid_data_path", "[{{path: a.bin}}, {{path: 'https://x/v.bin'}}]"],
         "valid_data_path names a URL (https://x/v.bin)"),
    Case("url-init-from-hf", [*TINY, "--init_from", "hf:https://host/model"], "init_from names a URL (https://host/model)"),
    Case("resume-from-damaged", [*TINY, "--resume_from", "{tmp}/src/checkpoints/20"], "src/checkpoints/20 is unreadable", _damaged_source),
    # -- train.py: the distributed environment
    Case("env-jax-half-set", [*TINY], "JAX_NUM_PROCESSES set but JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID not",
         env={"JAX_NUM_PROCESSES": "2"}),
    Case("env-torchrun-half-set", [*TINY], "RANK set but MASTER_ADDR, MASTER_PORT, WORLD_SIZE not", env={"RANK": "0"}),
    Case("env-mpich-world", [*TINY], "PMI_SIZE=2: a launcher jaxtrain cannot read started several processes",
         env={"PMI_SIZE": "2", "PMI_RANK": "1"}),
    Case("env-rank-too-big", [*TINY], "RANK=2 is out of range for WORLD_SIZE=2",
         env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "2", "RANK": "2"}),
    Case("env-not-a-number", [*TINY], "JAX_NUM_PROCESSES='two' is not an integer",
         env={"JAX_COORDINATOR_ADDRESS": "127.0.0.1:29999", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}),
    Case("env-bad-address", [*TINY], "coordinator address 'localhost' is not HOST:PORT",
         env={"JAX_COORDINATOR_ADDRESS": "localhost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}),
    Case("coordinator-unreachable", [*TINY, "--dist.init_timeout", "5"], "could not reach the coordinator within 5 s", _closed,
         env={"JAX_COORDINATOR_ADDRESS": "127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}),
    Case("coordinator-port-in-use", [*TINY, "--dist.init_timeout", "5"], "port {port} is already in use", _port_in_use,
         env={"JAX_COORDINATOR_ADDRESS": "127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}),
    Case("peer-never-joins", [*TINY, "--dist.init_timeout", "5"], "timed out after 5 s waiting for all processes to join", _closed,
         env={"JAX_COORDINATOR_ADDRESS": "127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}),
    # -- run_distributed.py
    Case("launch-no-mode", [*LAUNCH, "--world-size", "2"], "the following arguments are required: --mode"),
    Case("launch-world-size-0", [*LAUNCH, "--mode", "manual", "--world-size", "0", "--", "--config", "configs/tiny.yaml"],
         "--world-size must be >= 1, got 0"),
    Case("launch-rank-too-big", [*LAUNCH, "--mode", "manual", "--world-size", "2", "--rank", "2", "--coordinator", "127.0.0.1:29999"],
         "--rank 2 is out of range for --world-size 2"),
    Case("launch-bad-coordinator", [*LAUNCH, "--mode", "manual", "--world-size", "2", "--rank", "1", "--coordinator", "node0"],
         "coordinator address 'node0' is not HOST:PORT"),
    Case("launch-missing-script", [*LAUNCH, "--mode", "manual", "--world-size", "1", "--script", "scripts/nope.py"],
         "--script scripts/nope.py not found"),
    Case("launch-slurm-without-sbatch", [*LAUNCH, "--mode", "slurm", "--", "--config", "configs/tiny.yaml"], "sbatch not found", _no_sbatch),
    Case("k8s-zero-nodes", [*LAUNCH, "--mode", "create_k8s", "--num-nodes", "0", "--image", "i", "--manifest", "{tmp}/k8s/job.yaml"],
         "--num-nodes must be >= 1, got 0", _watch_tmp),
    Case("k8s-credential-value", [*LAUNCH, "--mode", "create_k8s", "--image", "i", "--env", "AWS_SECRET_ACCESS_KEY=abc",
         "--manifest", "{tmp}/job.yaml"], "a credential's value would be written into the manifest", _watch_tmp),
    Case("k8s-outside-a-pod", [*LAUNCH, "--mode", "k8s", "--", "--config", "configs/tiny.yaml"], "JOB_COMPLETION_INDEX is not set"),
    Case("k8s-pod-without-a-count", [*TINY], "set JOB_COMPLETIONS to the Job's completions", env={"JOB_COMPLETION_INDEX": "1"}),
    # -- launch_multi_node.sh
    Case("multi-missing-args", [*MULTI, "10.0.0.1"], "expected 3 arguments, got 1"),
    Case("multi-bad-node-count", [*MULTI, "10.0.0.1", "two", "0"], "num_nodes must be a positive integer, got 'two'"),
    Case("multi-bad-port", [*MULTI, "10.0.0.1:99999", "2", "0"], "coordinator must be HOST or HOST:PORT"),
    Case("multi-no-hostfile", [*MULTI, "10.0.0.1", "2", "0"], "set HOSTFILE"),
    Case("multi-missing-hostfile", [*MULTI, "10.0.0.1", "2", "0"], "HOSTFILE {tmp}/none.txt is not a readable file",
         env={"HOSTFILE": "{tmp}/none.txt"}),
    Case("multi-too-few-hosts", [*MULTI, "10.0.0.1", "2", "0"], "lists 1 hosts, need 2", _hostfile("# hosts\nnode0\n\n"),
         env={"HOSTFILE": "{tmp}/hosts.txt"}),
    Case("multi-node-rank-too-big", [*MULTI, "10.0.0.1", "2", "0"], "NODE_RANK must be in 0..1, got '5'", env={"NODE_RANK": "5"}),
    Case("multi-args-without-dashes", [*MULTI, "10.0.0.1", "1", "0", "--config", "x"], "training arguments go after --"),
    # -- test_distributed.py
    Case("health-unknown-flag", [*HEALTH, "--bogus"], "unrecognized arguments: --bogus"),
    Case("health-bad-size", [*HEALTH, "--max_bytes", "12X"], "'12X' is not a size"),
    Case("health-bad-iters", [*HEALTH, "--iters", "0"], "--iters must be >= 1, got 0"),
    # -- prepare_data.py
    Case("prepare-no-args", [*PREPARE], "the following arguments are required"),
    Case("prepare-missing-input", [*PREPARE, "{tmp}/nope.txt", "--out_dir", "{tmp}/out"], "input {tmp}/nope.txt does not exist"),
    Case("prepare-output-exists", [*PREPARE, "{tmp}/in.txt", "--out_dir", "{tmp}/data"], "data/train.bin already exists; pass --overwrite",
         _prepared),
    Case("prepare-out-dir-is-a-file", [*PREPARE, "{tmp}/in.txt", "--out_dir", "{tmp}/afile"], "--out_dir {tmp}/afile cannot be made: {tmp}/afile is a file",
         lambda ctx: (_text(ctx), _a_file(ctx))),
    Case("prepare-chat-no-seq-len", [*PREPARE, "{tmp}/chats.jsonl", "--chat", "--out_dir", "{tmp}/out"],
         "--chat needs --seq_len N, the window of the model to train (e.g. 1024); none given"),
    Case("prepare-bad-fraction", [*PREPARE, "{tmp}/in.txt", "--out_dir", "{tmp}/out", "--val_fraction", "1.5"],
         "--val_fraction must be in [0, 1), got 1.5", _text),
    # -- plot_metrics.py
    Case("plot-missing-run", [*PLOT, "{tmp}/norun"], "norun/metrics.jsonl not found"),
    Case("plot-out-folder-missing", [*PLOT, "{tmp}/run", "--out", "{tmp}/nope/loss.png"], "folder {tmp}/nope does not exist", _metrics),
    Case("plot-out-bad-format", [*PLOT, "{tmp}/run", "--out", "{tmp}/loss.xyz"], "cannot write .xyz files", _metrics),
    Case("plot-no-args", [*PLOT], "the following arguments are required: run_dirs"),
]  # fmt: skip

# train.py cases run as real processes: those that depend on the process (its 2 CPU devices, joining
# a job, an unset environment), and one of each other kind.
REAL_PROCESS = {
    "guide-world-size", "guide-single-gpu-many-devices", "train-batch-vs-devices",  # device count
    "coordinator-unreachable", "coordinator-port-in-use", "peer-never-joins",  # joining a job
    "train-typo-key", "data-missing", "rundir-incompatible", "resume-other-shape", "ckpt-none-readable",
    "env-jax-half-set", "url-run-dir",
}  # fmt: skip

_USES_TRAINED = {c.id for c in CASES if any("{trained}" in a for a in c.argv)} | {
    c.id for c in CASES if c.setup in (_all_truncated, _damaged_source)
}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2(
    case: Case, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    ctx: dict[str, Any] = {
        "tmp": tmp_path,
        "watch": [],
        "same_bytes": [],
        "cleanup": [],
        "env": {},
        "port": 0,
    }
    if case.id in _USES_TRAINED:
        ctx["trained"] = request.getfixturevalue("trained")
        ctx["watch"].append(ctx["trained"]["run_dir"])
    try:
        if case.setup:
            case.setup(ctx)
        fill = {"tmp": tmp_path, "port": ctx["port"], "trained": ctx.get("trained", {}).get("run_dir")}
        argv = [a.format(**fill) for a in case.argv]
        env = clean_env(**{k: v.format(**fill) for k, v in case.env.items()}, **ctx["env"])
        before = snapshot(*ctx["watch"])
        text_before = [p.read_bytes() for p in ctx["same_bytes"]]
        in_process = case.argv[:2] == TRAIN and case.id not in REAL_PROCESS
        out = run_here(argv, env, monkeypatch, capfd) if in_process else run(argv, env)
        after = snapshot(*ctx["watch"])
        text_after = [p.read_bytes() for p in ctx["same_bytes"]]
    finally:
        for close in ctx["cleanup"]:
            close()
    assert out.returncode == 2, f"exit {out.returncode}:\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.last_line.startswith("error: "), out.stderr[-3000:]
    assert case.phrase.format(**fill) in out.last_line, out.stderr[-3000:]
    assert out.seconds < TIMEOUT_S
    assert before == after, "a file the command was pointed at changed"
    assert text_before == text_after, "a file the command was pointed at changed"


# ---------------------------------------------------------------- a damaged newest checkpoint


@pytest.mark.parametrize(
    "damage", [_state_deleted, _state_truncated, _meta_garbage], ids=lambda f: f.__name__[1:]
)
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_run_resumes(damage, trained, tmp_path) -> None:
    """Automatic resume: checkpoints/20 is renamed (bytes kept), a warning names it, step 10 resumes."""
    ctx: dict[str, Any] = {"tmp": tmp_path, "trained": trained, "watch": [], "same_bytes": []}
    damage(ctx)
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    damaged, ten = snapshot(ckpts / "20"), snapshot(ckpts / "10")
    out = run([*TINY_ARGS, "--run_dir", str(run_dir), *WANDB], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    aside = next((run_dir / "damaged_checkpoints").iterdir())
    assert f"WARNING checkpoint {ckpts}/20 is unreadable (" in out.stdout
    assert f"moved aside to {aside}" in out.stdout
    moved = {k.replace(str(aside), str(ckpts / "20")): v[0] for k, v in snapshot(aside).items()}
    assert moved == {k: v[0] for k, v in damaged.items()}  # renamed, every byte kept
    assert f"resumed from {ckpts}/10" in out.stdout
    assert {k: v[0] for k, v in snapshot(ckpts / "10").items()} == {k: v[0] for k, v in ten.items()}
    steps = [
        r["step"]
        for r in map(yaml.safe_load, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert steps == sorted(set(steps)) and steps[-1] == 20  # every step once


# ---------------------------------------------------------------- beyond one line


def _rank_errors(out: Ran) -> dict[str, str]:
    """rank ("0" for the unprefixed first one) -> its `error: ` line, from the launcher's output."""
    found = {}
    for line in (out.stdout + out.stderr).splitlines():
        m = re.match(r"(?:\[rank (\d+)\] )?error: (.*)", line)
        if m and not m[2].startswith("rank "):  # not the launcher's own summary
            assert m[1] or "0" not in found, f"two unprefixed error lines: {line}"
            found[m[1] or "0"] = m[2]
    return found


_NOT_DIVISIBLE = "global batch_size 16 is not divisible by 3 processes; use a multiple of 3"


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> Ran:
    """run_distributed.py with 3 processes and the tiny config's global batch of 16."""
    run_dir = tmp_path_factory.mktemp("three") / "run"
    argv = [*LAUNCH, "--mode", "manual", "--world-size", "3", "--", *TINY_ARGS[2:], "--run_dir", str(run_dir)]
    return run(argv, clean_env(), timeout=120)


def test_batch_not_divisible_by_processes_every_rank_says_so(three_ranks: Ran) -> None:
    """Each rank gives the same line, the launcher names the rank and exits 2."""
    out = three_ranks
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    # Every rank checks the split before it imports jax (jaxtrain/run/cli.py), so each one speaks
    # before the launcher stops the others at the first failure.
    said = _rank_errors(out)
    assert said == {rank: _NOT_DIVISIBLE for rank in ("0", "1", "2")}, said
    assert re.match(r"error: rank \d \(pid \d+\) exited with code 2", out.last_line), out.stderr[-3000:]
    assert out.seconds < TIMEOUT_S


def test_a_bad_data_file_is_one_line_on_every_rank(tmp_path: Path) -> None:
    """Checked before joining: no rank dies in JAX's abort because a peer left first."""
    argv = [*LAUNCH, "--mode", "manual", "--world-size", "2", "--", *TINY_ARGS[2:]]
    argv += ["--run_dir", str(tmp_path / "run"), "--train_data_path", str(tmp_path / "none.bin")]
    out = run(argv, clean_env())
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    said = _rank_errors(out)
    assert set(said) == {"0", "1"}, said
    assert all(re.match(r"token file \S+none.bin does not exist", m) for m in said.values()), said
    assert not (tmp_path / "run").exists()


def test_rank_0s_error_reaches_the_launchers_stderr(three_ranks: Ran) -> None:
    assert re.search(r"^error: " + re.escape(_NOT_DIVISIBLE), three_ranks.stderr, re.M), three_ranks.stderr


def test_overwrite_accepts_an_incompatible_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _incompatible_run_dir({"tmp": tmp_path, "watch": []})
    out = run(
        [*TINY_ARGS, "--run_dir", str(run_dir), "--overwrite", "--total_steps", "2", "--eval_interval", "0"],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["n_layer"] == 2 and saved["total_steps"] == 2
    assert "an earlier run's log" not in (run_dir / "train.log").read_text()


def test_a_resume_compatible_change_is_accepted(trained: dict[str, Any], tmp_path: Path) -> None:
    """More steps is no new run: the relaunch resumes from the last checkpoint."""
    ctx: dict[str, Any] = {"tmp": tmp_path, "trained": trained, "watch": [], "same_bytes": []}
    run_dir = _copy_trained(ctx)
    out = run(
        [*TINY_ARGS, "--run_dir", str(run_dir), "--total_steps", "21", "--eval_interval", "0"], timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'}/20" in out.stdout
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["total_steps"] == 21


# ---------------------------------------------------------------- security


def test_no_secret_in_the_run_dir_or_output(trained: dict[str, Any]) -> None:
    secret, run_dir = trained["secret"], trained["run_dir"]
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb did not run: the test proves nothing"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 10
    leaks = [str(p) for p in files if secret.encode() in p.read_bytes()]
    assert not leaks, f"the secret appears in {leaks}"
    assert secret not in trained["out"].stdout + trained["out"].stderr


def test_nothing_in_the_run_dir_is_world_writable_even_with_umask_0(trained: dict[str, Any]) -> None:
    run_dir = trained["run_dir"]
    writable = [
        str(p)
        for p in [run_dir, *run_dir.rglob("*")]
        if p.lstat().st_mode & stat.S_IWOTH and not p.is_symlink()
    ]
    assert not writable, f"world-writable: {writable[:10]}"


def test_yaml_python_tags_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f'batch_size: !!python/object/apply:os.system ["touch {marker}"]\n')
    out = run([*TRAIN, "--config", str(evil), "--run_dir", str(tmp_path / "run")])
    assert out.returncode == 2 and out.last_line.startswith("error: ") and "evil.yaml" in out.last_line
    assert not marker.exists(), "YAML constructed a Python object"
    assert "Traceback" not in out.stderr


def test_a_python_tag_in_a_run_dirs_config_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f'seed: !!python/object/apply:os.system ["touch {marker}"]\n')
    before = snapshot(run_dir)
    out = run([*TINY_ARGS, "--run_dir", str(run_dir)])
    assert out.returncode == 2 and "config.yaml is not a saved config" in out.last_line, out.stderr[-2000:]
    assert not marker.exists() and snapshot(run_dir) == before


def test_nothing_loads_pickles() -> None:
    """No pickle, no np.load(allow_pickle=True), no yaml.load/unsafe_load anywhere in the package
    (every room, at any depth) or the scripts."""
    pattern = re.compile(
        r"\bimport pickle\b|\bpickle\.|allow_pickle\s*=\s*True|yaml\.(unsafe_)?load\(|cloudpickle|dill\b"
    )
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in [*ROOT.glob("jaxtrain/**/*.py"), *ROOT.glob("scripts/*.py")]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
    assert len(list(ROOT.glob("jaxtrain/**/*.py"))) > 60  # every module, not the flat few
