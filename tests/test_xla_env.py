"""XLA_FLAGS as jaxtrain sets them (jaxtrain/xla_env.py): ours added, the user's own win."""

import os

import pytest

from jaxtrain import xla_env
from jaxtrain.config import load_config
from jaxtrain.errors import UserError
from jaxtrain.xla_env import CPU_FLAGS, GPU_FLAGS, compiler_options, merged_flags


def test_the_users_flag_wins_and_ours_fill_in_the_rest():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    flags = merged_flags(mine, (*CPU_FLAGS, *GPU_FLAGS)).split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert set(GPU_FLAGS[1:]) | set(CPU_FLAGS) | {"--xla_dump_to=/tmp/x"} <= set(flags)
    assert len(flags) == len(CPU_FLAGS) + len(GPU_FLAGS) + 1


def test_a_mixture_in_pieces_on_gpus_starts_collectives_early_and_in_fp8_keeps_reduce_scatters_in():
    """The options go to that job's compiles alone (xla_env.compiler_options): starting early slows
    a dense job's plan (Llama-3-70B on 128 x 8 H100, 58.2 -> 53.7%), and XLA:CPU has no use for
    them. Four collectives in flight, not GPU_FLAGS' two: the pieces' exchanges leave room."""
    early = {
        "xla_gpu_experimental_collective_start_as_early_as_possible": True,
        "xla_gpu_experimental_parallel_collective_overlap_limit": "4",
    }
    assert "--xla_gpu_experimental_parallel_collective_overlap_limit=2" in GPU_FLAGS
    pieces = load_config(["--config", "configs/deepseek_v3_671b.yaml"])
    assert pieces.model.moe.chunks > 1
    assert compiler_options(pieces, "gpu") == early
    assert compiler_options(pieces, "cpu") is None
    assert compiler_options(load_config(["--config", "configs/moe_tiny.yaml"]), "gpu") is None
    assert compiler_options(load_config(["--config", "configs/llama3_70b.yaml"]), "gpu") is None
    # FP8 (no Triton GEMMs): a mixture in pieces keeps each layer's reduce-scatter in its backward,
    # a dense job pipelines it still (planned, Llama-3-70B on 128 x 8: 3.285 -> 4.023 s without)
    fp8 = ["--model.matmul", "fp8"]
    pieces_fp8 = compiler_options(load_config(["--config", "configs/deepseek_v3_671b.yaml", *fp8]), "gpu")
    assert pieces_fp8 == {**early, **xla_env.FP8_OPTIONS, "xla_gpu_enable_pipelined_reduce_scatter": False}
    dense_fp8 = compiler_options(load_config(["--config", "configs/llama3_70b.yaml", *fp8]), "gpu")
    assert dense_fp8 == xla_env.FP8_OPTIONS


def test_tensor_beside_fsdp_across_hosts_runs_its_all_reduces_on_the_compute_stream():
    """Only where tensor's all-reduces would queue behind fsdp's cross-host transfers (xla_env
    says why); the planner compiles a job with the options its run would get (tests/test_gpu_compile.py)."""
    seventy = load_config(["--config", "configs/llama3_70b.yaml"])  # fsdp 16 x tensor 2
    assert compiler_options(seventy, "gpu", fsdp_across_hosts=True) == xla_env.SYNC_TENSOR_OPTIONS
    assert compiler_options(seventy, "gpu", fsdp_across_hosts=False) is None
    assert compiler_options(seventy, "cpu", fsdp_across_hosts=True) is None
    fsdp_only = load_config(["--config", "configs/llama3_70b.yaml", "--mesh.tensor", "1"])
    assert compiler_options(fsdp_only, "gpu", fsdp_across_hosts=True) is None
    fp8 = load_config(["--config", "configs/llama3_70b.yaml", "--model.matmul", "fp8"])
    assert compiler_options(fp8, "gpu", True) == {**xla_env.FP8_OPTIONS, **xla_env.SYNC_TENSOR_OPTIONS}


def test_flags_this_xla_does_not_know_are_left_out_or_refused(monkeypatch, tmp_path):
    """XLA aborts at its start on a flag it does not know (jaxtrain's are jax 0.10.2's XLA's; later
    ones drop flags): ours are left out, and said; the user's own is a one-line UserError."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setattr(xla_env, "GPU_FLAGS", (*GPU_FLAGS, "--xla_gpu_no_such_flag=true"))
    monkeypatch.setattr(xla_env, "DROPPED", [])
    xla_env.set_flags()
    assert xla_env.DROPPED == ["--xla_gpu_no_such_flag"]  # every real one is known
    assert os.environ["XLA_FLAGS"].split() == [*CPU_FLAGS, *GPU_FLAGS, "--xla_dump_to=/tmp/x"]
    (cached,) = (tmp_path / "jaxtrain" / "xla_flags").iterdir()  # once a jaxlib and set of names
    monkeypatch.setattr(xla_env.subprocess, "run", None)  # a second look reads the cache alone
    assert xla_env.unknown_flags(os.environ["XLA_FLAGS"] + " --xla_gpu_no_such_flag=true") == [
        "--xla_gpu_no_such_flag"
    ]
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_sheduler=true")  # a typo
    with pytest.raises(UserError, match="^XLA_FLAGS: the XLA of jaxlib .* does not know "
                       "--xla_gpu_enable_latency_hiding_sheduler: remove it"):  # fmt: skip
        xla_env.set_flags()
