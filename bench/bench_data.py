"""The loader on many shards: data wait, memory per process, and the first-step delay.

    .venv/bin/python bench/bench_data.py                      # 10, 100, 1000 shards of one token set
    .venv/bin/python bench/bench_data.py --shards 1000 --step_ms 50
    .venv/bin/python bench/bench_data.py --shards 2,3 --total_tokens 60000 --steps 4 --batch 2 \
        --seq 64 --step_ms 1                                  # smoke

The same tokens (--total_tokens, llm.c uint16 shards) are cut into each shard count. Each count
runs in a fresh process, one after another in one run (so the figures are comparable), and reports:
  open_cold_s   validating the set the first time (header, length, largest-id scan)
  open_warm_s   what a relaunch pays before its first step (one stat per shard, one cache read)
  wait_frac     time blocked on the loader / total, with a simulated step of --step_ms
  tokens_per_s  the loader alone, nothing else running
  rss_mib       the process's resident memory after the run (VmRSS), and its peak (VmHWM)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _write_shards(directory: Path, n: int, total: int) -> None:
    from jaxtrain.text.format import HEADER_INTS, HEADER_MAGIC

    directory.mkdir(parents=True)
    each = total // n
    rng = np.random.default_rng(0)
    for i in range(n):
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = HEADER_MAGIC, 1, each
        body = rng.integers(0, 50257, each, dtype=np.uint16)
        (directory / f"train_{i:05d}.bin").write_bytes(header.tobytes() + body.tobytes())


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return float("nan")


def _measure(
    directory: str, steps: int, batch: int, seq: int, step_ms: float, threads: int
) -> dict[str, float]:
    from jaxtrain.data import loader as data
    from jaxtrain.data import sources

    spec = f"{directory}/train_*.bin"
    t = time.perf_counter()
    srcs = sources.open_sources(spec, "train", 50304, "auto", seq)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    srcs = sources.open_sources(spec, "train", 50304, "auto", seq)
    warm = time.perf_counter() - t
    rss_open = _status("VmRSS")

    t = time.perf_counter()
    n = sum(1 for _ in data.train_loader(srcs, batch, 0, 0, steps, 0, 1, threads, 4))
    rate = n * batch * (seq + 1) / (time.perf_counter() - t)

    # As in loop.py: the step runs (here: sleeps) while grain reads the next batches.
    wait, t0 = 0.0, time.perf_counter()
    it = iter(data.train_loader(srcs, batch, 1, 0, steps, 0, 1, threads, 4))
    for _ in range(steps):
        t = time.perf_counter()
        next(it)
        wait += time.perf_counter() - t
        time.sleep(step_ms / 1000)
    total = time.perf_counter() - t0
    return {
        "open_cold_s": round(cold, 3),
        "open_warm_s": round(warm, 4),
        "wait_frac": round(wait / total, 4),
        "tokens_per_s": round(rate),
        "rss_after_open_mib": round(rss_open, 1),
        "rss_mib": round(_status("VmRSS"), 1),
        "peak_rss_mib": round(_status("VmHWM"), 1),
        "open_maps": len(srcs[0].shards._open),
    }


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    """Prints each shard count's figures; returns them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", default="10,100,1000")
    p.add_argument("--total_tokens", type=int, default=50_000_000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32, help="rows this process loads per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--step_ms", type=float, default=100.0, help="simulated step time")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="", help="also write the results as JSON here")
    p.add_argument("--_child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        result = _measure(args._child, args.steps, args.batch, args.seq, args.step_ms, args.threads)
        print(json.dumps(result))
        return {}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")  # a cold scan cache for each set
        for n in map(int, args.shards.split(",")):
            directory = Path(tmp) / f"s{n}"
            _write_shards(directory, n, args.total_tokens)
            cmd = [sys.executable, __file__, "--_child", str(directory), "--steps", str(args.steps),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--step_ms", str(args.step_ms),
                   "--threads", str(args.threads)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ)
            results[n] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{n:>5} shards: {results[n]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
