"""The whole script, as a user runs it: run dir contents, wandb offline, bad input, plotting."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return _run("scripts/train.py", "--config", "configs/tiny.yaml", "--run_dir", str(run_dir), *extra)


@pytest.mark.slow
def test_whole_script_has_a_pulse(tmp_path):
    run_dir = tmp_path / "run"
    out = _train(run_dir, "--use_wandb", "--wandb_mode", "offline", "--sample_tokens", "20")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sample from the trained model" in out.stdout
    assert "parameters" in out.stdout and "MFLOPs per token" in out.stdout
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["batch_size"] == 16 and saved["model"]["n_layer"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert all(
        {"step", "loss", "lr", "tokens_per_sec", "grad_norm", "step_time_s"} <= r.keys() for r in train
    )
    assert train[-1]["loss"] < train[0]["loss"]
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]
    assert "step     20" in (run_dir / "train.log").read_text()
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb offline run files missing"
    for p in [run_dir, *run_dir.rglob("*")]:
        if p.is_file() or p.is_dir():
            assert not p.stat().st_mode & stat.S_IWOTH, f"{p} is world-writable"
    # A second launch of the same command (make train twice, a SLURM requeue): one line, exit 0,
    # nothing written (orbax's StepAlreadyExistsError and a 40-line traceback, before).
    files = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    again = _train(run_dir, "--use_wandb", "--wandb_mode", "offline", "--sample_tokens", "20")
    assert again.returncode == 0 and not again.stderr, again.stderr[-3000:]
    said = again.stdout.splitlines()
    assert len(said) == 2 and said[0].startswith("distributed: ")  # every launch's first line
    assert said[1:] == [
        f"run {run_dir} is complete at step 20 (total_steps 20): nothing to train; to train longer "
        "relaunch with --total_steps above 20, to start afresh pass another --run_dir or --overwrite"
    ]
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == files
    plot = _run("scripts/plot_metrics.py", str(run_dir))
    assert plot.returncode == 0 and (run_dir / "loss.png").stat().st_size > 1000


def _write(path: Path, tokens: np.ndarray) -> Path:
    tokens.tofile(path)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.bin", "does not exist"),
        (lambda d: _write(d / "empty.bin", np.zeros(0, np.uint16)), "is empty"),
        (lambda d: _write(d / "short.bin", np.arange(10, dtype=np.uint16)), "fewer than the 33"),
        (lambda d: _write(d / "big.bin", np.full(4096, 300, np.uint16)), "300"),
        (lambda d: (d / "odd.bin").write_bytes(b"\x01" * 4097) and d / "odd.bin", "not a multiple"),
    ],
)
def test_bad_data_is_a_clear_error_before_compile(tmp_path, make, message):
    path = make(tmp_path)
    out = _train(tmp_path / "run", "--train_data_path", str(path), "--valid_data_path", str(path))
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr
    assert "compiled" not in out.stdout


def test_incompatible_run_dir_is_refused_and_kept(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"n_layer": 7}, "batch_size": 16}))
    before = (run_dir / "config.yaml").read_text()
    out = _train(run_dir)
    assert out.returncode == 2
    assert "holds a run with a different config" in out.stderr and "--overwrite" in out.stderr
    assert (run_dir / "config.yaml").read_text() == before
    assert os.listdir(run_dir) == ["config.yaml"]


@pytest.mark.slow
def test_a_run_sized_by_total_batch_size_resumes_on_another_device_count(tmp_path):
    # The saved config holds the batch_size its topology derived (32 rows); the relaunch's
    # config, before its topology is known, holds tiny.yaml's 16: the same global batch all the same.
    run_dir, sized = tmp_path / "run", ("--total_batch_size", "1024", "--device_batch_size", "4")
    two = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    train = [sys.executable, "scripts/train.py", "--config", "configs/tiny.yaml", "--run_dir", str(run_dir)]
    first = subprocess.run(
        [*train, *sized, "--total_steps", "10", "--eval_interval", "0"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=two,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert "4 microbatch(es)" in first.stdout  # 32 rows / (4 per device x 2 devices)
    again = _train(run_dir, *sized, "--total_steps", "12", "--eval_interval", "0")  # 8 devices
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/10" in again.stdout and "1 microbatch(es)" in again.stdout
