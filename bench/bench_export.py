"""Host memory of scripts/export_hf.py: it should hold about one param at a time, not the model.

    .venv/bin/python bench/bench_export.py --dir /tmp/export_bench    # ~5 min on 2 cores, ~3 GB disk
    .venv/bin/python bench/bench_export.py --dir /tmp/export_bench --model.n_layer 8   # train.py flags

Saves the train state (params + both Adam moments, float32) of a 337M-parameter Llama-shaped model
(d_model 1024, 24 layers, 32k vocabulary, untied head, unrolled layers) as a jaxtrain checkpoint,
then exports it in a fresh process in 200 MB safetensors shards, sampling that process's resident
memory every 5 ms, and prints its growth over the export beside the checkpoint's size and the
largest param. Flags of scripts/train.py after the bench's own change the model. Results:
bench/results/export_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = [
    "--model.vocab_size", "32768", "--model.d_model", "1024", "--model.n_layer", "24",
    "--model.n_head", "16", "--model.n_kv_head", "4", "--model.mlp", "swiglu",
    "--model.tie_embeddings", "false", "--model.seq_len", "256",
]  # fmt: skip


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _kernel_peak_mb() -> float:
    """The kernel's high-water mark of this process's resident memory (VmHWM: since its exec, unlike
    getrusage's ru_maxrss, which keeps the forked parent's): what the sampling must find."""
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    return int(kib) / 1024


def _save(directory: Path, flags: list[str]) -> int:
    """A fresh train state saved as training saves it; returns the largest param's bytes."""
    import jax

    from jaxtrain.config import load_config, to_dict
    from jaxtrain.disk.checkpoint import Checkpointer
    from jaxtrain.run.build import build
    from jaxtrain.run.job import Job

    run = build(Job.of_devices(load_config([*MODEL, *flags]), jax.devices()))
    ckpt = Checkpointer(directory / "checkpoints", 1)
    ckpt.save(1, run.init_state(), {"step": 1, "config": to_dict(run.cfg)})
    ckpt.wait()
    return max(a.size * a.dtype.itemsize for a in jax.tree.leaves(run.abstract.params))


def _measure(directory: Path) -> dict:
    from jaxtrain.hf.export import export  # imports jax, orbax, tokenizers: part of the baseline

    base, peak, done = _rss_mb(), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss_mb())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    result = export(str(directory), directory / "hf", max_shard_bytes=200 * 2**20)
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    return {
        "baseline_rss_mb": round(base),
        "peak_rss_mb": round(max(peak[0], _rss_mb())),
        "kernel_peak_rss_mb": round(_kernel_peak_mb()),
        "export_s": round(seconds, 1),
        "files": len(result["files"]),
    }


def main(argv: list[str] | None = None) -> dict | None:
    """Prints the figures as JSON; returns them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--measure", action="store_true", help="(internal) the child that exports")
    args, flags = parser.parse_known_args(argv)
    if args.measure:
        print(json.dumps(_measure(args.dir)))
        return None
    largest = _save(args.dir, flags)
    child = subprocess.run(
        [sys.executable, __file__, "--dir", str(args.dir), "--measure"],
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(child.stdout.splitlines()[-1])
    step_dir = args.dir / "checkpoints" / "1"
    ckpt_bytes = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    hf_bytes = sum(p.stat().st_size for p in (args.dir / "hf").glob("*.safetensors"))
    out.update(
        checkpoint_mb=round(ckpt_bytes / 2**20),  # fresh Adam moments are zeros: they compress away
        params_mb=round(hf_bytes / 2**20),
        largest_param_mb=round(largest / 2**20),  # wte and lm_head
        growth_mb=out["peak_rss_mb"] - out["baseline_rss_mb"],
    )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
