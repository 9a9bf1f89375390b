"""Loss curve of a run, as a PNG, from its metrics.jsonl.

python scripts/plot_metrics.py runs/default                # writes runs/default/loss.png
python scripts/plot_metrics.py runs/a runs/b --out cmp.png  # several runs on one plot
"""

import argparse
import json
from pathlib import Path

import matplotlib

from jaxtrain.cli import Parser
from jaxtrain.errors import UserError, exit_on_user_error

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, loss) and (step, val_loss) pairs of a run."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found; pass a run dir written by scripts/train.py")
    train, val = [], []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if "loss" in r:
            train.append((r["step"], r["loss"]))
        if "val_loss" in r:
            val.append((r["step"], r["val_loss"]))
    if not train and not val:
        raise UserError(f"{path} holds no loss records yet; plot it after the first log_interval steps")
    return train, val


@exit_on_user_error
def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="PNG path (default: <first run dir>/loss.png)")
    args = parser.parse_args()
    runs = [(run_dir, *read_metrics(run_dir)) for run_dir in args.run_dirs]
    fig, ax = plt.subplots(figsize=(8, 5))
    out = args.out or args.run_dirs[0] / "loss.png"
    if out.suffix and out.suffix[1:].lower() not in fig.canvas.get_supported_filetypes():
        raise UserError(f"--out {out}: cannot write {out.suffix} files; end the name in .png, .svg or .pdf")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: folder {out.parent} does not exist; create it or pass another --out")
    for run_dir, train, val in runs:
        if train:
            ax.plot(*zip(*train, strict=True), label=f"{run_dir.name} train")
        if val:
            ax.plot(*zip(*val, strict=True), "o-", label=f"{run_dir.name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
