"""The forecast (jaxtrain/plan/forecast.py) beside every measured step it can be held against: the
published MaxText runs on H100s and jaxtrain's own runs on an H200 (bench/bench_gpu.py), each
planned with jaxtrain's own program for the same model, batch and layout (tests/gpu_plans.py
writes bench/results/plan_<case>.json). A step measured is the median step of its run.

forecast.py's two fitted constants (GEMM_EFFICIENCY, KERNEL_S) are fitted here, by least squares
of the log error over every row (`fit`); each row's error with the constants fitted on the other
rows alone (`leave_one_out`) says how it does on a run it was not fitted on.
tests/test_plan_forecast.py keeps every row within ROW_TOLERANCE, the mean signed error within
MEAN_TOLERANCE, and forecast.py's constants at the fit.

    .venv/bin/python bench/calibration.py      # prints the table (docs/planning.md holds it too)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from scipy import optimize

from jaxtrain.plan import forecast, schedule, targets

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ROW_TOLERANCE = 0.15  # every row: |forecast / measured - 1|
MEAN_TOLERANCE = 0.05  # the mean of the signed errors over the rows: no bias

# NVIDIA JAX-Toolbox's MaxText guide (performance table of its DGX H100 runs, bf16):
#   https://docs.nvidia.com/jax-toolbox/frameworks/max-text/overview (was rosetta/docs/... in
#   github.com/NVIDIA/JAX-Toolbox); Llama 3 70B as in NVIDIA's DGX Cloud benchmarking recipe for MaxText.
MAXTEXT = "NVIDIA JAX-Toolbox MaxText, DGX H100"
RUNS = [
    {"case": "llama2_7b_h100x8_maxtext", "job": "Llama 2 7B, 1 x 8 H100, fsdp 8, global batch 16 x 4096",
     "measured_step_s": 0.721, "source": MAXTEXT},
    {"case": "llama3_70b_h100_16x8_maxtext",
     "job": "Llama 3 70B, 16 x 8 H100, fsdp 128, global batch 256 x 8192",
     "measured_step_s": 15.57, "source": MAXTEXT + " (DGX Cloud recipe)"},
]  # fmt: skip


# Measured by jaxtrain itself on one H200 (bench/bench_gpu.py, 2026-11-28). Each run's step is the
# median step bench_gpu.py recorded (`step_time_s`), read from the committed bench JSON; each plan is
# the same job's (tests/gpu_plans.py, the *_bench cases).
MEASURED_HERE = [
    {"case": "gpt2_124m_h200x1_bench", "job": "GPT-2 124M, 1 H200, 512 x 1024 tokens a step",
     "bench": "gpu_bench_h200.json", "run": "124m/auto/none"},
    {"case": "gpt2_350m_h200x1_bench", "job": "GPT-2 350M (24 x 1024), 1 H200, 512 x 1024",
     "bench": "gpu_bench_h200.json", "run": "350m/auto/none"},
    {"case": "gpt_1b_h200x1_bench", "job": "GPT 0.9B (16 x 2048), 1 H200, 64 x 1024",
     "bench": "gpu_check_h200_2/bench_fp8.json", "run": "1b/auto/none"},
    {"case": "gpt_1b_fp8_h200x1_bench", "job": "the same 0.9B, its projections in FP8",
     "bench": "gpu_check_h200_2/bench_fp8.json", "run": "1b_fp8/auto/none"},
]  # fmt: skip


def plan(case: str) -> dict:
    return json.loads((RESULTS / f"plan_{case}.json").read_text())


def measured_step_s(run: dict) -> float:
    """A row's measured step: the published one, or the median step of a run measured here."""
    if "measured_step_s" in run:
        return run["measured_step_s"]
    return json.loads((RESULTS / run["bench"]).read_text())["runs"][run["run"]]["step_time_s"]


def forecast_s(case: str, **constants: float) -> float:
    """The forecast of `case`'s plan re-costed from its trace, at forecast.py's constants or at
    `constants` (gemm_efficiency, kernel_s) in their place."""
    p = plan(case)
    target = targets.get(p["target"])
    costs = forecast.Achievable(
        target, targets.peak_flops(target, p["dtype"]), p["forecast"]["expert_load"], **constants
    )
    return schedule.replay(p["schedule_trace"], costs).now


def every_run() -> list[dict]:
    return RUNS + MEASURED_HERE


def fit(runs: list[dict]) -> dict[str, float]:
    """GEMM_EFFICIENCY and KERNEL_S by least squares of log(forecast / measured) over `runs`."""
    measured = [measured_step_s(run) for run in runs]

    def loss(x: np.ndarray) -> float:
        constants = {"gemm_efficiency": x[0], "kernel_s": x[1] * 1e-6}
        return sum(
            math.log(forecast_s(run["case"], **constants) / m) ** 2
            for run, m in zip(runs, measured, strict=True)
        )

    found = optimize.minimize(
        loss, np.array([0.7, 5.0]), method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-12}
    )
    return {"gemm_efficiency": float(found.x[0]), "kernel_s": float(found.x[1]) * 1e-6}


def leave_one_out() -> dict[str, float]:
    """Each row's error at the constants fitted on every other row."""
    runs = every_run()
    out = {}
    for run in runs:
        constants = fit([r for r in runs if r is not run])
        out[run["case"]] = forecast_s(run["case"], **constants) / measured_step_s(run) - 1
    return out


# The forecast's constants before they were fitted (forecast.py until this table): the best-case GEMM
# rate and no kernel cost. Shown beside the fit in the table, as where the forecast came from.
BEFORE = {"gemm_efficiency": 780e12 / forecast.H100_PEAK, "kernel_s": 0.0}


def rows(loo: dict[str, float] | None = None) -> list[dict]:
    """Every row: its job, the measured step, the plan's bound, the forecast before the fit and now,
    the error now, and (given) the error left out of the fit."""
    out = []
    for run in every_run():
        p, measured = plan(run["case"]), measured_step_s(run)
        now = forecast_s(run["case"])
        out.append(run | {
            "measured_step_s": measured, "bound_s": p["schedule_bound_s"],
            "before_s": forecast_s(run["case"], **BEFORE), "forecast_s": now, "error": now / measured - 1,
            "loo_error": (loo or {}).get(run["case"]),
        })  # fmt: skip
    return out


def table(loo: dict[str, float] | None = None) -> str:
    """The rows as a markdown table, and the mean signed error."""
    columns = ["measured run", "measured s / step (median)", "bound s", "forecast before s", "forecast s",
               "error", "error left out", "plan"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
    rs = rows(loo)
    for r in rs:
        source = r.get("source") or f"jaxtrain, `{r['bench']}`"
        left = "" if r["loo_error"] is None else f"{100 * r['loo_error']:+.1f}%"
        times = [f"{r[k]:.3f}" for k in ("measured_step_s", "bound_s", "before_s", "forecast_s")]
        cells = [
            f"{r['job']} ({source})",
            *times,
            f"{100 * r['error']:+.1f}%",
            left,
            f"`plan_{r['case']}.json`",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    mean, worst = sum(r["error"] for r in rs) / len(rs), max(abs(r["error"]) for r in rs)
    lines.append(f"\nMean signed error {100 * mean:+.1f}% over {len(rs)} rows; worst {100 * worst:.1f}%.")
    if loo:
        mean, worst = sum(loo.values()) / len(loo), max(map(abs, loo.values()))
        lines.append(f"Left out of the fit: mean {100 * mean:+.1f}%, worst {100 * worst:.1f}%.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"fit on every row: {fit(every_run())}")
    print(table(leave_one_out()))
