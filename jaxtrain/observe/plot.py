"""A run's metrics.jsonl as one PNG (scripts/plot_metrics.py): loss, tokens/s and learning-rate
curves of one or several runs, and each run's wall time split by goodput.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

from jaxtrain.errors import UserError
from jaxtrain.observe import goodput

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of a run: loss, val_loss, tokens_per_sec, lr."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found; pass a run dir written by scripts/train.py")
    series: dict[str, list[tuple[int, float]]] = {k: [] for k in ("loss", "val_loss", "tokens_per_sec", "lr")}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        for key, points in series.items():
            if key in r and "event" not in r:
                points.append((r["step"], r[key]))
    if not series["loss"] and not series["val_loss"]:
        raise UserError(f"{path} holds no loss records yet; plot it after the first log_interval steps")
    return series


def plot_goodput(ax: plt.Axes, run_dirs: list[Path]) -> None:
    """One stacked bar per run: its wall time split into goodput's parts."""
    left_by_run = [0.0] * len(run_dirs)
    splits = [goodput.split(goodput.read_records(d / "metrics.jsonl")) for d in run_dirs]
    for part in goodput.PARTS:
        widths = [s[part] for s in splits]
        ax.barh(range(len(run_dirs)), widths, left=left_by_run, label=part.removesuffix("_s"))
        left_by_run = [a + b for a, b in zip(left_by_run, widths, strict=True)]
    labels = [f"{d.name}\n{100 * s['goodput']:.0f}% goodput" for d, s in zip(run_dirs, splits, strict=True)]
    ax.set_yticks(range(len(run_dirs)), labels)
    ax.set_xlabel("wall time over all launches (s)")
    ax.legend(fontsize=7, loc="lower right")


def plot_runs(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Plot the runs into `out` (default: <first run dir>/loss.png); returns the path written."""
    runs = [(run_dir, read_metrics(run_dir)) for run_dir in run_dirs]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    out = out or run_dirs[0] / "loss.png"
    if out.suffix and out.suffix[1:].lower() not in fig.canvas.get_supported_filetypes():
        raise UserError(f"--out {out}: cannot write {out.suffix} files; end the name in .png, .svg or .pdf")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: folder {out.parent} does not exist; create it or pass another --out")
    panels = (
        (axes[0, 0], ("loss", "val_loss"), "loss (nats/token)"),
        (axes[0, 1], ("tokens_per_sec",), "tokens/s"),
        (axes[1, 0], ("lr",), "learning rate"),
    )
    for ax, keys, ylabel in panels:
        for run_dir, series in runs:
            for key in keys:
                if series[key]:
                    style = "o-" if key == "val_loss" else "-"
                    ax.plot(*zip(*series[key], strict=True), style, label=f"{run_dir.name} {key}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    plot_goodput(axes[1, 1], run_dirs)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    return out
