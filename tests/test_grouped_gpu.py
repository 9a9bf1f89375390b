"""The experts' grouped matmul compiled for 8 H100 computes the routed rows only: its matmul FLOPs,
counted as the planner counts them (plan/hlo.py `flops`), are the active FLOPs within 10%.

One subprocess (tests/grouped_flops.py) compiles one MoE layer's forward and backward with the CUDA
plugin, for Mixtral-8x7B's experts (8 of 14336: one a GPU under expert 8, two under expert 4) and
Qwen3-30B-A3B's (128 of 768: sixteen a GPU), and Qwen3's again with `pallas_fp8` (the FP8
kernels lower for an H100, and the planner costs the experts' FLOPs, and only theirs, at the FP8
peak). About a minute and a half.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from processes import clean_env

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def counted():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "grouped_flops.py")],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", ["mixtral_expert8", "mixtral_expert4", "qwen3_expert8", "qwen3_expert8_fp8"])
def test_the_gpu_default_grouped_matmul_computes_only_the_routed_rows(counted, case):
    """ragged_dot's dense fallback computes every row against every local expert, and both it and
    `blocks` compute the whole dropless exchange buffer (mesh.expert times the routed rows). With
    `pallas_fp8` the experts' kernels are FP8 (their scope says so: plan/hlo.py `fp8`), the
    router's float32 matmul is not; in bf16 nothing is."""
    flops = counted[case]
    assert abs(flops["compiled"] / flops["active"] - 1) < 0.1, flops
    assert flops["fp8"] == (flops["experts"] if case.endswith("_fp8") else 0), flops
    # The schedule's replay (the bound, the forecast) costs the FP8 kernels at the FP8 peak too: it
    # costed them at bf16's before (plan/schedule.py `FP8_GROUPED`).
    kinds = flops["kinds"]
    assert kinds.get("grouped_fp8", 0) == (flops["experts"] if case.endswith("_fp8") else 0), kinds
    if case.endswith("_fp8"):
        assert "grouped" not in kinds, kinds
