"""Where a run's wall time went, over every launch: productive steps, start-up, compile, data
wait, checkpoints, eval and steps lost to a crash or pre-emption (computed, then redone).

python scripts/goodput.py runs/default          # a table
python scripts/goodput.py runs/default --json   # one JSON object
"""

import argparse
import json
from pathlib import Path

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.observe import goodput
from jaxtrain.parser import Parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


@exit_on_user_error
def main() -> None:
    args = parse_args()
    result = goodput.split_run(args.run_dir)
    if args.json:
        print(json.dumps(result))
        return
    wall = result["wall_s"] or 1.0
    for part in goodput.PARTS:
        print(f"{part:<14} {result[part]:>10.1f} s  {100 * result[part] / wall:5.1f}%")
    print(f"{'wall_s':<14} {result['wall_s']:>10.1f} s")
    ends = ", ".join(result["ends"])
    print(f"launches {result['launches']} (restarts {result['restarts']}; ended: {ends})")
    print(f"goodput {100 * result['goodput']:.1f}% (productive_s / wall_s)")


if __name__ == "__main__":
    main()
