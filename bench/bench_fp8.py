"""FP8 against bf16 matmuls on CPU (XLA:CPU runs the FP8 types): configs/llama_tiny.yaml trained
for 300 steps each way, a few seeds; the validation loss at the end and the gap (issue 48: within 2%).

    nice -n 10 .venv/bin/python bench/bench_fp8.py                 # seeds 0 1 2: bench/results/fp8_cpu.json
    .venv/bin/python bench/bench_fp8.py --seeds 0 --total_steps 20 # smoke

Each run is scripts/train.py in its own process (the run a user makes), bfloat16 compute, the same
seed (init and data order) for both; FP8 is model.matmul fp8 with the head in FP8 too
(model.head_matmul fp8). The gap of a seed is fp8 / bf16 - 1 of its final validation loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"bf16": [], "fp8": ["--model.matmul", "fp8", "--model.head_matmul", "fp8"]}


def train(seed: int, mode: str, steps: int, out: Path) -> dict:
    """One run: its final validation loss, its last logged train loss and its wall time."""
    run_dir = out / f"{mode}_{seed}"
    argv = [
        sys.executable, str(ROOT / "scripts" / "train.py"), "--config", "configs/llama_tiny.yaml",
        "--dtype", "bfloat16", "--seed", str(seed), "--total_steps", str(steps),
        "--eval_interval", str(steps), "--checkpoint_interval", str(10 * steps), "--sample_tokens", "0",
        "--run_dir", str(run_dir), *MODES[mode],
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    loss = [r["loss"] for r in records if "loss" in r]
    return {"val_loss": val[-1], "train_loss": loss[-1], "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--total_steps", type=int, default=300)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fp8_cpu.json"))
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            run = {"seed": seed} | {m: train(seed, m, args.total_steps, Path(tmp)) for m in MODES}
            run["gap"] = run["fp8"]["val_loss"] / run["bf16"]["val_loss"] - 1
            runs.append(run)
            print(json.dumps(run), flush=True)
    gaps = [r["gap"] for r in runs]
    result = {
        "config": "configs/llama_tiny.yaml", "dtype": "bfloat16", "total_steps": args.total_steps,
        "runs": runs, "mean_gap": statistics.mean(gaps), "max_abs_gap": max(abs(g) for g in gaps),
        "gap_spread": max(gaps) - min(gaps),
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
