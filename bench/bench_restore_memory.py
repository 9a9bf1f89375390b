"""Host memory of a sharded restore: each process should read only its own shards.

Run as 2 processes x 1 CPU device each (fsdp 2 puts half of every param on each process):

    .venv/bin/python scripts/run_distributed.py --mode manual --world-size 2 \\
        --script bench/bench_restore_memory.py -- --run_dir /tmp/restore_bench

It saves a fresh train state of a ~30M-parameter GPT (~0.35 GB in float32 with both Adam
moments), then, in a new child process per layout, restores it as fsdp 2 (half per process) and
as data 2 (whole state per process), and prints how much each process's peak RSS grew while
restoring, beside the bytes it owns, one JSON line per process and layout. Flags of
scripts/train.py after the bench's own change the model (a smoke run: --model.n_layer 1
--model.d_model 64 --model.n_head 2 --model.vocab_size 256).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
from pathlib import Path

import jax

from jaxtrain.cluster.detect import detect
from jaxtrain.config import load_config
from jaxtrain.disk.checkpoint import Checkpointer
from jaxtrain.run.build import Run, build
from jaxtrain.run.job import Job

MODEL = [
    "--model.n_layer",
    "8",
    "--model.d_model",
    "512",
    "--model.n_head",
    "8",
    "--model.vocab_size",
    "32768",
]


def _setup(fsdp: int, flags: list[str]) -> Run:
    """Join the other process and build the run training would, with `--mesh.fsdp fsdp`."""
    cfg = load_config([*MODEL, "--mesh.fsdp", str(fsdp), *flags])
    return build(Job.join(cfg, detect(cfg.dist)))


def _rss_mb() -> float:
    """Resident memory now (ru_maxrss is a high-water mark that start-up already set)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class _PeakRss:
    """Samples this process's resident memory every 5 ms while a block runs."""

    def __enter__(self) -> _PeakRss:
        self.base, self.peak, self.done = _rss_mb(), 0.0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, _rss_mb())


def restore(run_dir: Path, fsdp: int, flags: list[str]) -> None:
    run = _setup(fsdp, flags)
    owned = run.state_bytes_per_device
    with _PeakRss() as rss:
        state = Checkpointer(run_dir, keep=1, read_only=True).restore(0, run.target)
        jax.block_until_ready(state)
    grew = rss.peak - rss.base
    print(json.dumps({"layout": f"fsdp {fsdp}", "process": run.job.process_index, "owned_mb": owned / 2**20,
                      "peak_rss_growth_mb": grew}), flush=True)  # fmt: skip


def save(run_dir: Path, flags: list[str]) -> None:
    run = _setup(2, flags)
    # Process 0 alone records the checksums, as a run's (run/loop.py): two writers raced in CI (one
    # hashed the step dir while the other's temporary checksums file came and went).
    ckpt = Checkpointer(run_dir, keep=1, primary=jax.process_index() == 0)
    state = run.init_state()
    # Random moments, as after training: zeros would compress to nothing on disk.
    rng = jax.random.key(1)

    def noisy(x: jax.Array) -> jax.Array:
        return x + jax.random.normal(rng, x.shape, x.dtype) if x.dtype == jax.numpy.float32 else x

    state = state.replace(opt_state=jax.jit(lambda t: jax.tree.map(noisy, t))(state.opt_state))
    ckpt.save(0, state, {"step": 0})
    ckpt.wait()
    ckpt.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run_dir", type=Path, required=True)
    parser.add_argument("--restore_fsdp", type=int, default=0, help=argparse.SUPPRESS)  # child mode
    args, flags = parser.parse_known_args()
    if args.restore_fsdp:
        restore(args.run_dir, args.restore_fsdp, flags)
        return
    save(args.run_dir, flags)
    jax.distributed.shutdown()
    # Each layout in a fresh process, so one restore's peak does not hide the other's.
    for fsdp in (2, 1):
        child = [sys.executable, __file__, "--run_dir", str(args.run_dir), "--restore_fsdp", str(fsdp)]
        subprocess.run([*child, *flags], check=True)


if __name__ == "__main__":
    main()
