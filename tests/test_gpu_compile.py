"""The GPU program, compiled for real by XLA's GPU compiler for GPUs this machine does not have.

One subprocess (tests/gpu_plans.py) compiles every job with the CUDA plugin on its path: the
plugin never enters this pytest process, so the CPU tests never see it. `make test` installs the
plugin first (make gpu-plugin); without it these tests fail, naming the fix.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_plans import CI_CASES
from processes import clean_env

ROOT = Path(__file__).resolve().parent.parent
# The first test waits for every compile: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
H100 = "gpt2_124m_h100x8_"
MESHES = ["data8", "fsdp8", "fsdp4_tensor2_fp16", "zero1"]
# Bytes of gpt2_124m's largest parameter (the 50304 x 768 float32 embedding), one fsdp-8 shard of it.
LARGEST_PARAM = 50304 * 768 * 4


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    # JAXTRAIN_PLANS_DIR=bench/results keeps them (how bench/results/plan_*.json were made).
    out = Path(os.environ.get("JAXTRAIN_PLANS_DIR") or tmp_path_factory.mktemp("plans"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_plans.py"), str(out), *CI_CASES],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return {c: json.loads((out / f"plan_{c}.json").read_text()) for c in CI_CASES}


@pytest.mark.parametrize("mesh", MESHES)
def test_gpt2_124m_compiles_and_fits_8_h100(plans, mesh):
    p = plans[H100 + mesh]
    assert p["fits"], p
    assert 0 < p["temp_bytes_per_device"] and p["total_bytes_per_device"] <= p["usable_bytes_per_device"]
    assert p["global_batch"] == 512 and p["device_batch"] == 16
    assert 0 < p["mfu_ceiling"] <= 1 and p["step_time_lower_bound_s"] > 0
    assert p["dtype"] == ("float16" if mesh.endswith("fp16") else "bfloat16")
    assert all(not c["crosses_hosts"] for c in p["collectives"])


@pytest.mark.parametrize("case", [H100 + m for m in MESHES] + ["gpt2_124m_h100_2x8_data16"])
def test_attention_compiles_to_cudnn(plans, case):
    """auto picks cuDNN's fused attention on GPUs, and it compiles under every mesh (it once failed
    inside the step's partly manual shard_map), in bfloat16 and float16."""
    assert plans[case]["attention"] == "cudnn"


def test_gpt2_as_configured_needs_at_most_13_gb_of_temporaries(plans):
    assert plans[H100 + "data8"]["temp_bytes_per_device"] <= 13e9, plans[H100 + "data8"]


def test_each_mesh_reduces_over_its_axes(plans):
    kinds = {m: {(c["kind"], c["axis"]) for c in plans[H100 + m]["collectives"]} for m in MESHES}
    assert ("all-reduce", "data") in kinds["data8"]
    assert {("all-gather", "fsdp"), ("reduce-scatter", "fsdp")} <= kinds["fsdp8"]
    assert any(axis == "tensor" for _, axis in kinds["fsdp4_tensor2_fp16"])
    # ZeRO-1 splits the moments: less state per device than plain data parallelism.
    zero1, data8 = plans[H100 + "zero1"], plans[H100 + "data8"]
    assert zero1["state_bytes_per_device"] < 0.5 * data8["state_bytes_per_device"]


def test_fsdp_never_all_reduces_more_than_one_shard(plans):
    fsdp = plans[H100 + "fsdp8"]
    largest = max((c["largest_bytes"] for c in fsdp["collectives"] if c["kind"] == "all-reduce"), default=0)
    assert largest <= LARGEST_PARAM // 8, fsdp["collectives"]
    # The check would catch the regression: data parallelism all-reduces whole gradients.
    data8 = plans[H100 + "data8"]["collectives"]
    assert max(c["largest_bytes"] for c in data8 if c["kind"] == "all-reduce") >= LARGEST_PARAM


def test_two_hosts_reduce_gradients_across_the_network(plans):
    p = plans["gpt2_124m_h100_2x8_data16"]
    assert p["fits"] and p["mesh"] == {"data": 16, "fsdp": 1, "tensor": 1} and p["accumulation"] == 2
    crossing = [c for c in p["collectives"] if c["crosses_hosts"]]
    assert crossing and all(c["axis"] == "data" and c["network_bytes"] > 0 for c in crossing)
    assert p["bound_terms_s"]["network"] > 0


def test_7b_fits_8_h100_with_fsdp(plans):
    p = plans["gpt_7b_h100x8_fsdp8"]
    assert 6e9 < p["n_params"] < 7e9 and p["mesh"]["fsdp"] == 8
    assert p["fits"], p


def test_70b_compiles_for_128_hosts_and_fits(plans):
    p = plans["gpt_70b_h100_128x8_data2_fsdp64_tensor8"]
    assert 60e9 < p["n_params"] < 70e9 and p["hosts"] == 128
    assert p["fits"], p
    assert any(c["crosses_hosts"] and c["axis"] == "fsdp" for c in p["collectives"])


def test_plan_script_refuses_bad_input_in_one_line():
    script = str(ROOT / "scripts" / "plan.py")
    env = clean_env()
    for argv, extra, says in [
        (["--target", "h1000"], {}, "unknown --target 'h1000'; known targets: h100,"),
        (["--hosts", "0"], {}, "--hosts 0 --gpus_per_host 8: both must be >= 1"),
        ([], {"JAXTRAIN_CUDA_PLUGIN": os.devnull}, "run `make gpu-plugin`"),
    ]:
        proc = subprocess.run(
            [sys.executable, script, *argv], env=env | extra, capture_output=True, text=True
        )
        assert proc.returncode == 2, proc.stderr
        assert says in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
