"""Sharded checkpoints from real processes: 2 processes x 4 devices as data 2 x fsdp 4 (fsdp inside
each process). Each process writes its own shards; the checkpoint resumes on other meshes and
process counts; kill -9 and relaunch stays bitwise, under fsdp and under expert, context and
pipeline parallelism.
"""

import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from processes import logged_losses, ok, processes_marked, rank_pid, run_train, start_train, wait_for_step
from shared import bitwise_same_end

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FSDP = ["--mesh.fsdp", "4"]  # data -1 = 2: the outer axis spans the processes


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory) -> Path:
    """An uninterrupted 2-process x 4-device data 2 x fsdp 4 run of 20 steps, checkpoints at 10, 20."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    ok(run_train(run_dir, 2, 4, *FSDP))
    return run_dir


def test_each_process_writes_its_own_shards(sharded_reference):
    state = sharded_reference / "checkpoints" / "20" / "state"
    written = {
        p: sum(f.stat().st_size for f in (state / f"ocdbt.process_{p}").rglob("*") if f.is_file())
        for p in (0, 1)
    }
    # Neither process gathers the state to write it alone: each writes a fair part.
    assert all(n > 0.3 * sum(written.values()) for n in written.values()), written
    records = [json.loads(x) for x in (sharded_reference / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r.get("event") == "start")  # after goodput's "launch" event
    assert start["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1} and start["attention"] == "xla"  # auto on CPU
    assert (start["processes"], start["devices"], start["step"]) == (2, 8, 0)
    # float32 params + two moments, split 4 ways (norm scales stay whole, hence not exactly 12N/4)
    assert 12 * start["n_params"] / 4 <= start["state_bytes_per_device"] < 12 * start["n_params"] / 3
    assert start["peak_bytes_per_device"] > start["state_bytes_per_device"] and start["compile_s"] > 0
    # The XLA flags the backend started with: the launch's device count, ours for CPUs and GPUs.
    flags = start["xla_flags"].split()
    assert "--xla_force_host_platform_device_count=4" in flags, flags
    assert {
        "--xla_cpu_experimental_ynn_fusion_type=dot",
        "--xla_gpu_enable_latency_hiding_scheduler=true",
    } <= set(flags)


@pytest.mark.parametrize(
    "procs, devices, mesh",
    [(1, 2, ["--mesh.fsdp", "2"]), (1, 1, []), (4, 2, ["--mesh.fsdp", "2"])],
    ids=["1x2-fsdp2", "1x1", "4x2-dp4xfsdp2"],
)
def test_sharded_checkpoint_resumes_on_other_meshes(sharded_reference, tmp_path, procs, devices, mesh):
    run_dir = tmp_path / "run"
    shutil.copytree(sharded_reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "20")  # as if the 2x4 job had stopped after step 10
    out = ok(run_train(run_dir, procs, devices, *mesh))
    assert "checkpoints/10" in out.stdout + out.stderr
    a, b = logged_losses(sharded_reference), logged_losses(run_dir)
    # Same global batches; only the order of float additions differs with the layout.
    np.testing.assert_allclose([b[s] for s in range(11, 21)], [a[s] for s in range(11, 21)], rtol=2e-4)


def test_kill_9_under_fsdp_then_relaunch_is_bitwise_identical(sharded_reference, tmp_path):
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    proc = start_train(run_dir, 2, 4, marker, *FSDP, faults="stall_step=15,stall_process=1")
    wait_for_step(run_dir, 15, proc)
    os.kill(rank_pid(marker, 1), signal.SIGKILL)
    t0 = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - t0 < 30
    assert not processes_marked(marker), "processes left behind"
    out = ok(run_train(run_dir, 2, 4, *FSDP))
    assert "checkpoints/10" in out.stdout + out.stderr
    bitwise_same_end(sharded_reference, run_dir, 11, 20)


def test_fsdp_across_processes_trains_and_says_what_it_costs(tmp_path):
    steps = ["--total_steps", "2", "--checkpoint_interval", "2"]
    out = ok(run_train(tmp_path / "run", 2, 2, "--mesh.fsdp", "4", *steps))
    assert "mesh fsdp x tensor = 4 devices spans hosts (2 devices per process)" in out.stdout + out.stderr


def test_a_context_and_tensor_group_across_processes_trains_as_in_one_process(tmp_path):
    """Both processes' devices hold the same rows (context 2 x tensor 2 over 2 processes of 2): each
    loads them (mesh.data_share), as the 1M-token window over two hosts does (context 16). It
    stopped at the first batch before, jax's 'Invalid host data' traceback."""
    layout = ["--mesh.context", "2", "--mesh.tensor", "2", "--mesh.data", "1", "--model.n_head", "4"]
    steps = ["--total_steps", "3", "--checkpoint_interval", "3", "--log_interval", "1"]
    ok(run_train(tmp_path / "two", 2, 2, *layout, *steps))
    ok(run_train(tmp_path / "one", 1, 4, *layout, *steps))
    a, b = logged_losses(tmp_path / "two"), logged_losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3] and a == pytest.approx(b, rel=1e-5), (a, b)


# tests/test_moe.py's experts (8, 2 per token)
MOE = [
    "--model.n_head", "4", "--model.mlp", "swiglu", "--model.moe.n_experts", "8",
    "--model.moe.d_expert", "32",
]  # fmt: skip


def test_experts_inside_each_process_and_fsdp_across_them_train_as_in_one_process(tmp_path):
    """The same experts over expert 2 laid inside fsdp 2 (`mesh.expert_inner`, Qwen3-30B-A3B's
    layout on 4 hosts): each process's 2 devices are an expert group and fsdp's gathers and
    reduce-scatters cross the processes. The losses are those of the same mesh in one process."""
    layout = [
        *MOE,
        "--mesh.expert",
        "2",
        "--mesh.fsdp",
        "2",
        "--mesh.data",
        "1",
        "--mesh.expert_inner",
        "true",
    ]
    steps = ["--total_steps", "3", "--checkpoint_interval", "3"]
    two = ok(run_train(tmp_path / "two", 2, 2, *layout, *steps))
    ok(run_train(tmp_path / "one", 1, 4, *layout, *steps))
    assert "spans hosts" not in two.stdout + two.stderr  # fsdp across processes is what was asked
    assert "expert inside fsdp" in (tmp_path / "two" / "train.log").read_text()
    a, b = logged_losses(tmp_path / "two"), logged_losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3] and a == pytest.approx(b, rel=1e-5), (a, b)


# The experts over expert 2 across the processes (each MoE layer's token
# all-to-all crosses them), sequences split in two inside each (context 2 x fsdp 2): one launch
# for both axes.
EXPERT_CONTEXT = [*MOE, "--mesh.expert", "2", "--mesh.context", "2", "--mesh.fsdp", "2", "--mesh.data", "1"]
# One stage per process (pipeline is the outer axis), its layer of experts exchanged over expert 2
# inside the process, 2 microbatches over fsdp 2: a mixture of experts under a pipeline (the dense
# pipeline's steps are the same code less the exchange and the router's figures).
PIPELINE = [
    *MOE, "--model.scan_layers", "true", "--mesh.pipeline", "2", "--mesh.expert", "2", "--mesh.fsdp", "2",
    "--mesh.data", "1", "--gradient_accumulation_steps", "2",
]  # fmt: skip


@pytest.mark.parametrize("layout", [EXPERT_CONTEXT, PIPELINE], ids=["expert_context", "pipeline"])
def test_kill_9_under_expert_context_or_pipeline_x_expert_parallelism_then_relaunch_is_bitwise_identical(
    tmp_path, layout
):
    """The killed launch is its own uninterrupted reference: it ran steps 11-15 past checkpoint 10
    before the kill, and the relaunch from that checkpoint must compute them again bit for bit (a
    separate reference run would cost one more launch and compile). Read before the relaunch, which
    marks those records redone."""
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    proc = start_train(run_dir, 2, 4, marker, *layout, faults="stall_step=15,stall_process=1")
    wait_for_step(run_dir, 15, proc)
    os.kill(rank_pid(marker, 1), signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and not processes_marked(marker), "processes left behind"
    first = logged_losses(run_dir)
    out = ok(run_train(run_dir, 2, 4, *layout))
    assert "checkpoints/10" in out.stdout + out.stderr
    relaunch = logged_losses(run_dir)
    assert max(first) == 15 and sorted(relaunch) == list(range(1, 21)), (first, relaunch)
    assert all(first[s] == relaunch[s] for s in range(11, 16)), (first, relaunch)
    # Process 0's log says once per launch that the all-to-all crosses hosts (each process warns).
    warning = "mesh expert 2 spans hosts (4 devices per process)"
    assert (run_dir / "train.log").read_text().count(warning) == (2 if layout is EXPERT_CONTEXT else 0)
