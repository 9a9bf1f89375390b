"""The preflight at job start (jaxtrain/run/verdicts.py): which kernels it checks, auto's fallback and
a named kernel's refusal when a check differs ($JAXTRAIN_FAULTS preflight_differs), the compiled step
running the fallback afterwards, the verdict agreed by two real processes naming the one whose check
failed, and the cache a second run reads.

On CPU the kernels checked are the CPU-proven ones against themselves (`--preflight on`); a planted
fault skews one kernel's outputs as a wrong kernel or a bad GPU would.
"""

import dataclasses
import socket
import time

import jax
import ml_dtypes
import numpy as np
import pytest
from processes import TINY, run_train

from jaxtrain import faults as faults_lib
from jaxtrain.cluster.detect import LaunchSpec
from jaxtrain.config import ConfigError, load_config
from jaxtrain.model import fp8
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import kernels, verdicts
from jaxtrain.run import preflight as pf
from jaxtrain.run.build import build
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


def test_pallas_is_never_settled_for_four_byte_values():
    qwen = load_config(["--config", "configs/qwen3_30b_a3b.yaml"]).model
    assert kernels.settle(qwen, "gpu", "bfloat16", "9.0").moe.grouped_matmul == "pallas"
    assert kernels.settle(qwen, "gpu", "float32", "9.0").moe.grouped_matmul == "ragged_dot"
    named = dataclasses.replace(qwen, moe=dataclasses.replace(qwen.moe, grouped_matmul="pallas"))
    with pytest.raises(ConfigError, match="pallas takes bfloat16 or float16, not float32"):
        kernels.settle(named, "gpu", "float32", "9.0")


def test_a_ragged_exchange_that_fails_falls_back_to_the_padded_one_or_is_refused_by_name():
    job = _job([*MOE, "--mesh.expert", "2"])
    on_gpu = kernels.settle(job.cfg.model, "gpu", "bfloat16", "9.0")
    assert on_gpu.moe.exchange == "ragged" and _settled(job).moe.exchange == "padded"
    failed = {"exchange": [(0, socket.gethostname())]}
    model, lines = verdicts._decide(job, on_gpu, failed, [])
    assert model.moe.exchange == "padded" and lines == [
        "preflight: the ragged expert exchange failed on cpu; running the padded expert exchange instead"
    ]
    named = _job([*MOE, "--mesh.expert", "2", "--model.moe.exchange", "ragged"])
    with pytest.raises(ConfigError) as refused:
        verdicts._decide(named, on_gpu, failed, [])
    assert str(refused.value).startswith("preflight: the ragged expert exchange failed on cpu; ")
    assert "use --model.moe.exchange auto" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="model.moe.exchange ragged needs GPUs"):
        kernels.settle(named.cfg.model, "cpu", "float32")


def test_fallback_is_the_cpu_proven_kernel_or_none():
    cfg = _settled(_job(MOE))
    assert kernels.fallen_back(cfg, "grouped_matmul").moe.grouped_matmul == "ragged_dot"
    assert kernels.fallen_back(cfg, "attention") is None  # xla is the proven one: nothing to fall to
    assert kernels.fallen_back(cfg, "exchange") is None  # padded: the one proven on CPU


def test_fp8_matmuls_are_checked_on_gpus_at_the_jobs_widths_and_refused_by_name():
    argv = [*DENSE[:-2], "--dtype", "bfloat16", "--model.matmul", "fp8", "--mesh.tensor", "2"]
    argv += ["--model.d_ff", "96"]
    job = _job([*argv, "--preflight", "auto"])
    settled = kernels.settle(job.cfg.model, "cpu", "bfloat16")
    assert verdicts.choices(job.cfg, settled, "bfloat16", "cpu").matmul == ""  # XLA:CPU's dot: not GPU-only
    on_gpu = kernels.settle(job.cfg.model, "gpu", "bfloat16", "9.0")
    gpu = verdicts.choices(job.cfg, on_gpu, "bfloat16", "gpu")
    assert (gpu.matmul, gpu.d_model, gpu.d_ff) == ("cublaslt", 64, 48)  # d_ff per tensor shard
    on = _job([*argv, "--preflight", "on"])
    picked = verdicts.choices(on.cfg, settled, "bfloat16", "cpu")
    (check,) = [c for c in pf.checks(picked, "cpu", "") if c.name.startswith("fp8_matmul")]
    assert check.name == "fp8_matmul m32 k64 n48"
    assert pf.run_check(check, jax.devices()[:1]).passed
    # Its reference rounds with numpy (ml_dtypes), not model/fp8.py: the two agree bitwise
    x = jax.random.normal(jax.random.key(0), (32, 64), "float32").astype("bfloat16") * 1e-4
    for ours, theirs in ((fp8.FORWARD, ml_dtypes.float8_e4m3fn), (fp8.GRADIENT, ml_dtypes.float8_e5m2)):
        q, scale = fp8.quantize(x, ours)
        np.testing.assert_array_equal(pf.numpy_rounded(x, theirs), np.asarray(q.astype("float32") * scale))
    skewed = pf.run_check(verdicts._skewed(check), jax.devices()[:1])
    assert not skewed.passed and skewed.failed.startswith("out off by")
    with pytest.raises(ConfigError) as refused:  # asked for by name: no fallback
        verdicts._decide(on, settled, {"matmul": [(0, socket.gethostname())]}, [skewed])
    line = str(refused.value)
    assert line.startswith("preflight: the FP8 matmuls (xla) failed on cpu (out off by ")
    assert "--model.matmul compute" in line and "\n" not in line


# The experts' dots in a compiled step by their op names: the blocks kernel's padded einsum, and the
# dots XLA:CPU makes of jax.lax.ragged_dot (model/moe.py expert_mlps)
BLOCKS_DOT, RAGGED_DOT = "bmd,bdf->bmf", "moe._experts/dot_general"


@pytest.mark.slow
def test_auto_falls_back_with_one_line_and_the_compiled_step_runs_the_fallback():
    """One process, built as scripts/train.py builds a joined job (run/build.py), with the blocks
    grouped matmul made to differ in its preflight: one warning line, and the train step compiled
    afterwards multiplies the experts with ragged_dot's dots and none of blocks' einsums (the same
    job without the preflight: blocks' einsums); it trains."""
    launched = LaunchSpec("single", None, 1, 0, None, {})
    job = dataclasses.replace(_job(MOE, 1), launch=launched)
    run = build(job, faults_lib.planned({"JAXTRAIN_FAULTS": "preflight_differs=expert_mlps"}))
    (warned,) = run.preflight.warnings
    assert warned.startswith("preflight: the blocks grouped matmul failed on cpu (cpu:0: out off by")
    assert warned.endswith("running the ragged_dot grouped matmul instead")
    assert "2 check(s) on 1 device(s)" in run.preflight.summary
    compiled = run.compile_train()
    text = compiled.as_text()
    assert RAGGED_DOT in text and BLOCKS_DOT not in text
    unchecked = build(_job([*MOE, "--preflight", "off"], 1))
    lowered = unchecked.train_step.lower(unchecked.target, unchecked.batch_shape).as_text(debug_info=True)
    assert unchecked.model.cfg.moe.grouped_matmul == "blocks" and BLOCKS_DOT in lowered
    state, cfg = run.init_state(), run.cfg
    rows = np.random.default_rng(0).integers(0, 256, (cfg.batch_size, cfg.model.seq_len + 1), np.int32)
    for _ in range(cfg.total_steps):
        state, metrics = compiled(state, mesh_lib.global_batch(rows, run.mesh, cfg.batch_size))
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))


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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_agree_and_a_named_kernel_that_differs_on_one_exits_2_naming_its_host(tmp_path):
    """2 processes x 2 devices, MoE over expert 2 (the exchange checked on each process's pair), the
    grouped matmul chosen by name: only process 1's differs, yet both refuse alike (the verdicts are
    gathered first), in one line naming process 1's host."""
    run_dir = tmp_path / "run"
    argv = [*MOE, "--mesh.expert", "2", "--model.moe.grouped_matmul", "blocks"]
    out = run_train(run_dir, 2, 2, *argv, faults="preflight_differs=expert_mlps,preflight_process=1")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    host = socket.gethostname()
    errors = [x for x in (out.stdout + out.stderr).splitlines() if "error: preflight:" in x]
    assert len(errors) == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]  # one line a process
    for line in errors:
        assert f"the blocks grouped matmul failed on process 1 (host {host}) only, of 2 processes" in line
        assert "use --model.moe.grouped_matmul auto" in line and "--preflight off" in line
    assert not (run_dir / "checkpoints").exists()  # refused before anything ran


def test_off_and_a_described_cluster_run_no_preflight():
    assert build(_job([*DENSE, "--preflight", "off"])).preflight.summary == "preflight: off"
    assert build(_job(DENSE)).preflight.checked == 0  # Job.of_devices: nothing launched, nothing run
