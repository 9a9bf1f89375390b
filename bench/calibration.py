"""The forecast (jaxtrain/plan/forecast.py) beside published, measured step times of XLA-compiled
training on H100s: each run planned with jaxtrain's own program for the same model, batch and
layout (tests/gpu_plans.py writes bench/results/plan_<case>.json). The forecast's constants come
from kernel and link measurements, never from these rows; tests/test_plan_forecast.py re-costs
each committed plan's schedule and keeps the forecast within TOLERANCE of every row.

    .venv/bin/python bench/calibration.py      # prints the table (docs/scaling.md holds it too)
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TOLERANCE = 0.15

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


# Measured by jaxtrain itself on one H200 (bench/bench_gpu.py, 2026-11-28), after the forecast's
# constants were set: runs the forecast was not made from. Each run's step time is its tokens a step
# over the tokens per second bench_gpu.py measured (wall clock over 10 or 15 timed steps), read from
# the committed bench JSON; each plan is the same job's (tests/gpu_plans.py, the *_bench cases).
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


def _against(run: dict, measured_step_s: float) -> dict:
    """`run` with its plan's bound and forecast beside the step time measured, and the error."""
    p = plan(run["case"])
    forecast = p["forecast"]["step_time_s"]
    return run | {
        "measured_step_s": measured_step_s, "bound_s": p["schedule_bound_s"], "forecast_s": forecast,
        "error": forecast / measured_step_s - 1,
    }  # fmt: skip


def rows() -> list[dict]:
    """Each run with its plan's bound and forecast, and the forecast's error against the measurement."""
    return [_against(run, run["measured_step_s"]) for run in RUNS]


def measured_rows() -> list[dict]:
    """Each run measured here (its step: the tokens a step over the rate measured) beside its plan."""
    out = []
    for run in MEASURED_HERE:
        p = plan(run["case"])
        rate = json.loads((RESULTS / run["bench"]).read_text())["runs"][run["run"]]["tokens_per_sec"]
        out.append(_against(run, p["global_batch"] * p["seq_len"] / rate) | {"tokens_per_s": rate})
    return out


def _table(first: str, middle: list[str], rows: list[tuple[dict, list[str]]]) -> str:
    """A markdown table: `first` column (a row's job), `middle` ones (formatted cells), then the
    measured step, the bound, the forecast, its error and the plan."""
    columns = [first, *middle, "measured s / step", "jaxtrain bound s", "jaxtrain forecast s",
               "forecast error", "plan"]  # fmt: skip
    head = "| " + " | ".join(columns) + " |\n" + "| --- " * len(columns) + "|"
    lines = [
        f"| {' | '.join(cells)} | {r['measured_step_s']:.3f} | {r['bound_s']:.3f} | {r['forecast_s']:.3f} | "
        f"{100 * r['error']:+.1f}% | `plan_{r['case']}.json` |"
        for r, cells in rows
    ]
    return "\n".join([head, *lines])


def table() -> str:
    return _table(
        "published run (measured on H100s by its authors)", [],
        [(r, [f"{r['job']} ({r['source']})"]) for r in rows()],
    )  # fmt: skip


def measured_table() -> str:
    return _table(
        "run measured by jaxtrain (bench/bench_gpu.py)", ["measured tokens/s"],
        [(r, [f"{r['job']} (`{r['bench']}`)", f"{r['tokens_per_s']:,.0f}"]) for r in measured_rows()],
    )  # fmt: skip


if __name__ == "__main__":
    print(table())
    print()
    print(measured_table())
