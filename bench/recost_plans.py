"""Every committed plan's forecast re-costed from its stored schedule (`schedule_trace`) at
jaxtrain/plan/forecast.py's constants as they are now, without a compile: run after a change to
the forecast's constants or to its replay, so that no committed figure is of an older forecast.
tests/test_plan_forecast.py fails on a plan whose stored forecast is not its trace's.

    .venv/bin/python bench/recost_plans.py     # rewrites the "forecast" of each plan_*.json and search_*.json

A search's ranked candidates carry no trace: their forecasts stay as planned (the file says when).
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxtrain.plan import planner

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    for path in sorted([*RESULTS.glob("plan_*.json"), *RESULTS.glob("search_*.json")]):
        text = path.read_text()
        p = json.loads(text)
        if "schedule_trace" not in p:
            continue
        new = planner.recost(p)
        if new != p:
            indent = 1 if text.startswith('{\n "') else None
            path.write_text(json.dumps(new, indent=indent) + ("\n" if text.endswith("\n") else ""))
            print(
                f"{path.name}: {p['forecast']['step_time_s']:.3f} -> {new['forecast']['step_time_s']:.3f} s"
            )


if __name__ == "__main__":
    main()
