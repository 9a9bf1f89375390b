"""Orbax checkpoints: bitwise save/restore, and a resumed run that matches an unbroken one."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.disk.checkpoint import Checkpointer
from jaxtrain.run.build import build
from jaxtrain.run.job import Job

ROOT = Path(__file__).resolve().parents[1]


def test_save_restore_is_bitwise(tmp_path):
    run = build(Job.of_devices(load_config(["--config", "configs/tiny.yaml"]), jax.devices()))
    state = run.init_state()
    # Make the optimizer state non-trivial so the test would see it lost.
    state = state.replace(
        opt_state=jax.tree.map(lambda x: x + 0.5 if x.dtype == np.float32 else x, state.opt_state)
    )
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    ckpt.save(7, state, {"step": 7, "config": {}})
    ckpt.wait()
    restored = Checkpointer(tmp_path / "ckpt", keep=2, read_only=True).restore(7, run.target)
    a, b = jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(restored))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert all(
        leaf.sharding == s
        for leaf, s in zip(jax.tree.leaves(restored), jax.tree.leaves(run.shardings), strict=True)
    )
    ckpt.close()


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "configs/tiny.yaml")]
    cmd += ["--run_dir", str(run_dir), "--log_interval", "1", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


@pytest.mark.slow
def test_resume_reproduces_the_same_losses_bitwise(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _train(whole)
    _train(broken)
    # Lose everything after step 10, as if the run had stopped there, then relaunch.
    shutil.rmtree(broken / "checkpoints" / "20")
    out = _train(broken)
    assert "resumed from" in out.stdout and "checkpoints/10" in out.stdout
    a, b = _losses(whole), _losses(broken)
    assert sorted(b) == list(range(1, 21))  # steps 11..20 logged once, not twice
    assert all(a[s] == b[s] for s in range(11, 21)), (a, b)  # bitwise: same floats
    ra = Checkpointer(whole / "checkpoints", keep=2, read_only=True)
    rb = Checkpointer(broken / "checkpoints", keep=2, read_only=True)
    assert ra.read_meta(20)["data_position"] == rb.read_meta(20)["data_position"] == 20
    final_a, final_b = jax.tree.leaves(ra.restore(20)), jax.tree.leaves(rb.restore(20))
    assert final_a and all(np.array_equal(x, y) for x, y in zip(final_a, final_b, strict=True))


def test_a_failed_save_logged_by_asyncio_keeps_one_line_other_tracebacks_stay(tmp_path):
    """A disk that fills mid-save: tensorstore's error may reach asyncio's "Task exception was never
    retrieved", traceback and all (seen in CI). A record whose exception passed through orbax keeps
    its first line (the StorageError after it says the rest); any other keeps its traceback."""
    import logging

    from jaxtrain.disk import checkpoint

    def raised(filename: str) -> tuple:
        try:
            exec(compile("raise ValueError('RESOURCE_EXHAUSTED: No space left on device')", filename, "exec"))
        except ValueError:
            return sys.exc_info()
        raise AssertionError("not raised")

    def record(exc_info: tuple) -> logging.LogRecord:
        return logging.LogRecord(
            "asyncio", logging.ERROR, "/usr/lib/python3.11/asyncio/base_events.py", 1,
            "Task exception was never retrieved\nfuture: <Task finished>", None, exc_info,
        )  # fmt: skip

    ours = record(raised("/venv/site-packages/orbax/checkpoint/_src/serialization/serialization.py"))
    assert checkpoint._ONE_LINE.filter(ours)
    assert (ours.getMessage(), ours.exc_info) == ("Task exception was never retrieved", None)
    other = record(raised("/venv/site-packages/somewhere/else.py"))
    assert checkpoint._ONE_LINE.filter(other) and other.exc_info is not None
    Checkpointer(tmp_path / "checkpoints", keep=1)  # installs the filter on both loggers
    assert all(checkpoint._ONE_LINE in logging.getLogger(n).filters for n in ("absl", "asyncio"))
