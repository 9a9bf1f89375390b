"""FP8 against bf16 matmuls on CPU (XLA:CPU runs the FP8 types): configs/llama_tiny.yaml trained
for 300 steps each way, a few seeds; the validation loss at the end and the gap (issue 48: within 2%).

    nice -n 10 .venv/bin/python bench/bench_fp8.py                 # seeds 0 1 2: bench/results/fp8_cpu.json
    nice -n 10 .venv/bin/python bench/bench_fp8.py --seeds 3 --modes f32   # add to the results
    .venv/bin/python bench/bench_fp8.py --seeds 0 --total_steps 20 --out /tmp/smoke.json

Each run is scripts/train.py in its own process (the run a user makes), the same seed (init and
data order) in every mode: `bf16` (bfloat16 compute), `fp8` (the same, with model.matmul fp8 and
the head in FP8 too: model.head_matmul fp8), `fp8_proj` (the projections in FP8, the head in bf16:
model.head_matmul's default) and `f32` (float32 compute: the reference for what rounding alone
moves, since the gap between two runs of this small model at its learning rate's peak can be set
by where a loss spike takes each). The gap of a seed is fp8 / bf16 - 1 of its final validation
loss; `proj_gap` (fp8_proj / bf16 - 1) and the gaps to f32 likewise. A run adds its modes to the
seed's record in --out, keeping the rest: a seed or a mode is added without rerunning the others.

FP8 dispatch (a mixture of experts' copies sent to their experts in e4m3, model.moe.dispatch_dtype
auto beside model.matmul fp8 under remat; docs/moe.md), against the same run with its copies in bf16:

    nice -n 10 .venv/bin/python bench/bench_fp8.py --config configs/moe_tiny.yaml --seeds 0 1 \
        --modes fp8_remat fp8_remat_bf16_dispatch --out bench/results/fp8_dispatch_cpu.json

Its pass rule, written before its first run: `dispatch_gap` (fp8_remat / fp8_remat_bf16_dispatch - 1
of the final validation loss) within 1% on every seed.

Gradients reduce-scattered in bf16 (`mesh.reduce_dtype compute`, issue 62) against float32 (the
default), bf16 compute under fsdp 8 on 8 CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 nice -n 10 .venv/bin/python bench/bench_fp8.py \
        --seeds 0 1 --modes bf16_fsdp8 bf16_fsdp8_reduce_compute --out bench/results/reduce_dtype_cpu.json

Its pass rule, written before its first run: `reduce_gap` (bf16_fsdp8_reduce_compute / bf16_fsdp8
- 1 of the final validation loss) within 2% on every seed (issue 48's bound for FP8 matmuls).
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
MODES = {
    "bf16": ["--dtype", "bfloat16"],
    "fp8": ["--dtype", "bfloat16", "--model.matmul", "fp8", "--model.head_matmul", "fp8"],
    "fp8_proj": ["--dtype", "bfloat16", "--model.matmul", "fp8"],
    "f32": ["--dtype", "float32"],
    # A mixture of experts under remat, where FP8 projections dispatch the copies in FP8 (auto)
    "fp8_remat": ["--dtype", "bfloat16", "--model.matmul", "fp8", "--model.remat", "full"],
    "fp8_remat_bf16_dispatch": [
        "--dtype",
        "bfloat16",
        "--model.matmul",
        "fp8",
        "--model.remat",
        "full",
        "--model.moe.dispatch_dtype",
        "compute",
    ],  # fmt: skip
    # fsdp 8 (8 CPU devices: XLA_FLAGS), its gradients reduce-scattered in float32 or in bf16
    "bf16_fsdp8": ["--dtype", "bfloat16", "--mesh.fsdp", "8", "--mesh.data", "1"],
    "bf16_fsdp8_reduce_compute": [
        "--dtype",
        "bfloat16",
        "--mesh.fsdp",
        "8",
        "--mesh.data",
        "1",
        "--mesh.reduce_dtype",
        "compute",
    ],  # fmt: skip
}
DEFAULT_MODES = ["bf16", "f32", "fp8", "fp8_proj"]
GAPS = {
    "gap": ("fp8", "bf16"), "proj_gap": ("fp8_proj", "bf16"), "bf16_vs_f32": ("bf16", "f32"),
    "fp8_vs_f32": ("fp8", "f32"), "fp8_proj_vs_f32": ("fp8_proj", "f32"),
    "dispatch_gap": ("fp8_remat", "fp8_remat_bf16_dispatch"),
    "reduce_gap": ("bf16_fsdp8_reduce_compute", "bf16_fsdp8"),
}  # fmt: skip


def git_head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def train(config: str, seed: int, mode: str, steps: int, out: Path) -> dict:
    """One run: its final validation loss, its last logged train loss, its wall time, the code's commit."""
    run_dir = out / f"{mode}_{seed}"
    argv = [
        sys.executable, str(ROOT / "scripts" / "train.py"), "--config", config,
        "--seed", str(seed), "--total_steps", str(steps), "--eval_interval", str(steps),
        "--checkpoint_interval", str(10 * steps), "--sample_tokens", "0", "--run_dir", str(run_dir),
        *MODES[mode],
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    loss = [r["loss"] for r in records if "loss" in r]
    return {
        "val_loss": val[-1], "train_loss": loss[-1], "wall_s": round(time.perf_counter() - t0, 1),
        "code": git_head(),
    }  # fmt: skip


def summary(runs: list[dict]) -> dict:
    """Each gap of every seed that has both of its modes, and their mean, largest and spread."""
    out: dict = {}
    for name, (a, b) in GAPS.items():
        for run in runs:
            if a in run and b in run:
                run[name] = run[a]["val_loss"] / run[b]["val_loss"] - 1
        gaps = [run[name] for run in runs if name in run]
        if gaps:
            out[name] = {
                "seeds": len(gaps), "mean": statistics.mean(gaps), "max_abs": max(abs(g) for g in gaps),
                "spread": max(gaps) - min(gaps),
            }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="configs/llama_tiny.yaml")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=DEFAULT_MODES)
    parser.add_argument("--total_steps", type=int, default=300)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fp8_cpu.json"))
    args = parser.parse_args()
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    if result and (result.get("total_steps"), result.get("config")) != (args.total_steps, args.config):
        sys.exit(f"{out} holds {result['total_steps']}-step runs of {result['config']}: pass another --out")
    by_seed = {run["seed"]: run for run in result.get("runs", [])}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            run = by_seed.setdefault(seed, {"seed": seed})
            for mode in args.modes:
                run[mode] = train(args.config, seed, mode, args.total_steps, Path(tmp))
                print(json.dumps({"seed": seed, mode: run[mode]}), flush=True)
            runs = [by_seed[s] for s in sorted(by_seed)]
            result = {"config": args.config, "total_steps": args.total_steps, "runs": runs}
            result["summary"] = summary(runs)
            out.write_text(
                json.dumps(result, indent=1) + "\n"
            )  # after each seed: a stopped bench keeps its runs
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
