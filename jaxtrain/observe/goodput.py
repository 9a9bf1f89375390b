"""Goodput across launches: timed events in metrics.jsonl, and the split of the whole wall time.

Each launch's process 0 appends, beside the step records (which carry `t`, unix seconds):
    {"event": "launch", "t": <process start>, "step": <start step>, "restore_s"}
    {"event": "start", "t", "compile_s", ...}                 after the step compiled
    {"event": "eval", "t", "step", "seconds"}                  each evaluation
    {"event": "checkpoint", "t", "step", "seconds"}            time a save blocked training
    {"event": "end", "t", "step", "reason"}                    done | preempted | non-finite | error
A launch killed without warning (SIGKILL, a lost node) writes no end: for goodput it ends at its
last record. A resumed launch rewrites the step records past its start step as `redone` markers
(rundir.truncate_metrics), so the time of steps computed twice stays in the file.

`split` cuts every launch at its records; each stretch between two records is spent on what the
later record says (its eval or checkpoint seconds, its data wait, steps for the rest). Steps
past the step the next launch resumed from are `lost_s`; the rest of a launch (process start,
imports, restore, shutdown) is `startup_s`. So the parts add up to `wall_s`, the sum of the
launches' lengths (time between launches, e.g. in a queue, is not counted).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jaxtrain.disk.files import LineFile
from jaxtrain.errors import UserError

PARTS = ("productive_s", "startup_s", "compile_s", "data_wait_s", "checkpoint_s", "eval_s", "lost_s")


class Timeline:
    """Appends this launch's timed events to metrics.jsonl; inert until `open` (process 0 only)."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def open(self, path: Path) -> None:
        self.path = path

    def event(self, name: str, **fields: Any) -> None:
        if self.path is None:
            return
        record = {"event": name, "t": round(fields.pop("t", time.time()), 3), **fields}
        events = LineFile(self.path)  # whole lines, between the Reporter's own
        try:
            events.write_line(json.dumps(record))
        finally:
            events.close()


def end_reason(error: BaseException | None) -> str:
    """The `reason` of an end event for the exception that ended the launch (None: done)."""
    from jaxtrain.errors import Interrupted, NonFiniteError, Preempted

    if error is None:
        return "done"
    if isinstance(error, Interrupted | KeyboardInterrupt):  # Ctrl-C, checkpoint saved or not
        return "interrupted"
    if isinstance(error, Preempted):
        return "preempted"
    if isinstance(error, NonFiniteError):
        return "non-finite"
    return "error"


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every JSON record of a metrics.jsonl (lines cut short by a kill are skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _launches(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The timed records of each launch, in order (records before the first launch event are old)."""
    launches: list[list[dict[str, Any]]] = []
    for r in records:
        if r.get("event") == "launch":
            launches.append([r])
        elif launches and "t" in r:
            launches[-1].append(r)
    return launches


def split(records: list[dict[str, Any]]) -> dict[str, Any]:
    """productive/startup/compile/data_wait/checkpoint/eval/lost seconds, wall_s, restarts, goodput."""
    totals = dict.fromkeys(PARTS, 0.0)
    launches = _launches(records)
    ends = []
    for i, launch in enumerate(launches):
        resumed_at = launches[i + 1][0].get("step", 0) if i + 1 < len(launches) else None
        parts = dict.fromkeys(PARTS, 0.0)
        wall = max(r["t"] for r in launch) - launch[0]["t"]
        prev = launch[0]["t"]
        for r in launch[1:]:
            stretch, prev = max(r["t"] - prev, 0.0), max(r["t"], prev)
            event = r.get("event")
            if event == "start":
                parts["compile_s"] += min(r.get("compile_s", 0.0), stretch)
                continue  # the rest: imports, restore, setup
            if event == "end":
                continue  # shutdown: start-up's mirror
            spent = min(r.get("seconds", 0.0), stretch)
            if event in ("eval", "checkpoint"):
                parts[f"{event}_s"] += spent
            waited = min(r.get("data_wait_frac", 0.0) * stretch, stretch - spent)
            steps = stretch - spent - waited
            if event == "redone" or (resumed_at is not None and r.get("step", 0) > resumed_at):
                parts["lost_s"] += steps + waited
            else:
                parts["data_wait_s"] += waited
                parts["productive_s"] += steps
        parts["startup_s"] = wall - sum(v for k, v in parts.items() if k != "startup_s")
        for k in PARTS:
            totals[k] += parts[k]
        ends.append(next((r["reason"] for r in launch if r.get("event") == "end"), "killed"))
    wall_s = sum(totals.values())
    return {
        **{k: round(v, 3) for k, v in totals.items()},
        "wall_s": round(wall_s, 3),
        "launches": len(launches),
        "restarts": max(len(launches) - 1, 0),
        "ends": ends,
        "goodput": round(totals["productive_s"] / wall_s, 4) if wall_s else 0.0,
    }


def split_run(run_dir: Path) -> dict[str, Any]:
    """`split` of a run dir's metrics.jsonl (scripts/goodput.py), or a one-line error."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found; pass a run dir written by scripts/train.py")
    result = split(read_records(path))
    if not result["launches"]:
        raise UserError(f"{path} holds no launch events (written by jaxtrain before goodput was recorded)")
    return result
