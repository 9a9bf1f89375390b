"""A run's loss curve, tokens/s, learning rate and goodput split, as one PNG, from its metrics.jsonl.

python scripts/plot_metrics.py runs/default                # writes runs/default/loss.png
python scripts/plot_metrics.py runs/a runs/b --out cmp.png  # several runs on one plot
"""

import argparse
from pathlib import Path

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.observe.plot import plot_runs
from jaxtrain.parser import Parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="PNG path (default: <first run dir>/loss.png)")
    return parser.parse_args(argv)


@exit_on_user_error
def main() -> None:
    args = parse_args()
    print(f"wrote {plot_runs(args.run_dirs, args.out)}")


if __name__ == "__main__":
    main()
