"""The preflight at job start (jaxtrain/run/verdicts.py): which kernels it checks, auto's fallback and
a named kernel's refusal when a check differs ($JAXTRAIN_FAULTS preflight_differs), the verdict agreed
by two real processes naming the one whose check failed, and the cache a second run reads.

On CPU the kernels checked are the CPU-proven ones against themselves (`--preflight on`); a planted
fault skews one kernel's outputs as a wrong kernel or a bad GPU would.
"""

import socket
import time

import jax
import pytest
from processes import TINY, ok, run_train

from jaxtrain.config import load_config
from jaxtrain.faults import FaultPlan, Faults
from jaxtrain.run import kernels, verdicts
from jaxtrain.run.job import Job

DENSE = [*TINY, "--total_steps", "2", "--preflight", "on"]
MOE = [*DENSE, "--model.mlp", "swiglu", "--model.moe.n_experts", "4", "--model.moe.d_expert", "32"]


def _job(argv, devices=2):
    return Job.of_devices(load_config(argv), jax.devices()[:devices])


def _settled(job):
    return kernels.settle(job.cfg.model, "cpu", "float32")


def test_auto_checks_only_the_gpu_only_kernels_and_on_checks_all():
    job = _job([*MOE[:-2], "--preflight", "auto", "--mesh.expert", "2"])  # MOE without preflight on
    cpu = verdicts.choices(job.cfg, _settled(job), "float32", "cpu")
    assert (cpu.attention, cpu.grouped_matmul, cpu.exchange) == ("", "", "")  # nothing GPU-only on CPU
    gpu = kernels.settle(job.cfg.model, "gpu", "bfloat16", "9.0")
    picked = verdicts.choices(job.cfg, gpu, "bfloat16", "gpu")
    assert (picked.attention, picked.grouped_matmul, picked.exchange) == (
        "cudnn",
        "",
        "ragged",
    )  # d64: not pallas
    on = _job([*MOE, "--mesh.expert", "2", "--mesh.tensor", "2", "--model.n_head", "4"], 4)
    picked = verdicts.choices(on.cfg, _settled(on), "float32", "cpu")
    assert (picked.attention, picked.grouped_matmul, picked.exchange) == ("xla", "blocks", "padded")
    assert (picked.heads, picked.expert_dim, picked.length) == ((2, 2, 16, 16), 16, 32)  # per tensor shard


def test_fallback_is_the_cpu_proven_kernel_or_none():
    cfg = _settled(_job(MOE))
    assert kernels.fallen_back(cfg, "grouped_matmul").moe.grouped_matmul == "ragged_dot"
    assert kernels.fallen_back(cfg, "attention") is None  # xla is the proven one: nothing to fall to
    assert kernels.fallen_back(cfg, "exchange") is None


def test_auto_falls_back_with_one_line_when_a_check_differs():
    job = _job(MOE)
    faults = Faults(FaultPlan(preflight_differs="expert_mlps"), 0)
    cleared = verdicts.clear(job, _settled(job), "float32", faults)
    assert cleared.model.moe.grouped_matmul == "ragged_dot" and cleared.model.attention_impl == "xla"
    assert len(cleared.warnings) == 1 and cleared.checked == 2 and not cleared.cached
    line = cleared.warnings[0]
    assert line.startswith("preflight: the blocks grouped matmul failed on cpu (out off by")
    assert line.endswith("running the ragged_dot grouped matmul instead") and "\n" not in line


def test_a_kernel_chosen_by_name_that_differs_exits_2_in_one_line(tmp_path):
    out = run_train(
        tmp_path / "run", 1, 1, *DENSE, "--model.attention_impl", "xla", faults="preflight_differs=attention"
    )
    assert out.returncode == 2, out.stderr[-2000:]
    error = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in out.stderr
    assert error[0].startswith("error: preflight: xla attention failed on cpu (out off by")
    assert "use --model.attention_impl auto" in error[0] and "--preflight off" in error[0]
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything ran


def test_a_pass_is_cached_and_the_second_run_checks_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    job = _job(DENSE)
    first = verdicts.clear(job, _settled(job), "float32", None)
    t0 = time.perf_counter()
    second = verdicts.clear(job, _settled(job), "float32", None)
    spent = time.perf_counter() - t0
    assert (first.checked, first.cached) == (1, False) and (second.checked, second.cached) == (0, True)
    assert len(list((tmp_path / "jaxtrain" / "preflight").glob("*.json"))) == 1
    assert spent < first.seconds / 5, (spent, first.seconds)  # measured: see the commit message
    assert "cached" in second.summary and not second.warnings


@pytest.mark.multiprocess
def test_two_processes_agree_and_name_the_host_whose_check_failed(tmp_path):
    """2 processes x 2 devices, MoE over expert 2 (the exchange checked on each process's pair): only
    process 1's grouped matmul differs; both fall back alike and train, process 0's log names it."""
    run_dir = tmp_path / "run"
    argv = [*MOE, "--mesh.expert", "2"]
    faults = "preflight_differs=expert_mlps,preflight_process=1"
    ok(run_train(run_dir, 2, 2, *argv, faults=faults))
    log = (run_dir / "train.log").read_text()
    warned = [x for x in log.splitlines() if "WARNING preflight:" in x]
    host = socket.gethostname()
    assert len(warned) == 1, log
    assert f"failed on process 1 (host {host}) only, of 2 processes: a bad GPU there?" in warned[0]
    assert warned[0].endswith("running the ragged_dot grouped matmul instead")
    assert "3 check(s) on 2 device(s)" in log and "done: step 2" in log
    own = (run_dir / "logs" / "process_1.log").read_text()
    assert "preflight on this process: FAIL  expert_mlps blocks d64 ff32 float32" in own


def test_off_and_a_described_cluster_run_no_preflight():
    from jaxtrain.run.build import build

    assert build(_job([*DENSE, "--preflight", "off"])).preflight.summary == "preflight: off"
    assert build(_job(DENSE)).preflight.checked == 0  # Job.of_devices: nothing launched, nothing run
