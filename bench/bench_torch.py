"""jaxtrain against a bare jax loop and a nanoGPT-style PyTorch loop (eager and torch.compile), same
shapes, same machine, interleaved in one run; prints tokens/s medians and ratios.

    pip install -e '.[bench]'                       # torch==2.13.0, the CPU build
    python bench/bench_torch.py                     # the issue's shape and configs/default.yaml's
    python bench/bench_torch.py --shapes issue --rounds 5 --steps 30
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=none python bench/bench_torch.py   # without YNN
    python bench/bench_torch.py --shapes default --steps 2 --warmup 2 --rounds 1 --model.n_layer 1  # smoke

The PyTorch model matches jaxtrain's GPT: pre-norm RMSNorm blocks, rotary positions, causal
scaled-dot-product attention, GELU MLP (4x), no biases, tied embeddings; AdamW with global-norm
clipping at 1.0; float32. Each round runs every loop once, in a fixed order, so machine noise hits
them alike; the models and compiled steps are built once and reused across rounds (jaxtrain's
own train() relaunches each round, its compile cache warm after the first).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jaxtrain import xla_env  # isort: skip
from jaxtrain.cluster.detect import detect  # isort: skip
from jaxtrain.config import load_config  # isort: skip

# The flags (and CPU device count) scripts/train.py sets for the default job, before jax starts.
_DEFAULT_JOB = load_config(["--config", "configs/default.yaml"])
xla_env.set_flags(_DEFAULT_JOB, detect(_DEFAULT_JOB.dist))

import jax  # noqa: E402
import torch  # noqa: E402
from bench_loop import bare_loop, jaxtrain_loop  # noqa: E402
from torch_gpt import TorchGPT  # noqa: E402

from jaxtrain.config import Config  # noqa: E402
from jaxtrain.run.job import Job  # noqa: E402

SHAPES = {  # name -> train.py flags
    "issue": ["--model.n_layer", "4", "--model.d_model", "256", "--model.n_head", "4",
              "--model.seq_len", "256", "--batch_size", "16"],
    "default": [],
}  # fmt: skip


class TorchLoop:
    """A nanoGPT-style training loop on pre-made batches; the model persists across rounds."""

    def __init__(self, cfg: Config, compiled: bool) -> None:
        torch.manual_seed(0)
        self.cfg, self.model = cfg, TorchGPT(cfg)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.b1, cfg.optim.b2),
            weight_decay=cfg.optim.weight_decay,
        )  # fmt: skip
        self.step_fn = torch.compile(self._step) if compiled else self._step
        g = torch.Generator().manual_seed(0)
        shape = (cfg.batch_size, cfg.model.seq_len + 1)
        self.batches = [torch.randint(0, cfg.model.vocab_size, shape, generator=g) for _ in range(4)]

    def _step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.gradient_clip_val)
        return loss

    def run(self, steps: int, warmup: int) -> float:
        """Tokens/s over `steps` steps after `warmup` (torch.compile compiles in the first)."""
        for i in range(warmup + steps):
            if i == warmup:
                t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            loss = self.step_fn(self.batches[i % 4])
            self.opt.step()
        loss.item()
        return steps * self.cfg.batch_size * self.cfg.model.seq_len / (time.perf_counter() - t0)


def _ratio_line(name: str, ours: list[float], theirs: list[float]) -> str:
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    spread = f"min {min(ratios):.2f}, max {max(ratios):.2f}"
    return f"  jaxtrain / {name:<14}: {statistics.median(ratios):.2f}x median of rounds ({spread})"


def main(argv: list[str] | None = None) -> dict:
    """Prints the figures; returns them (what --json writes)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="issue,default", help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="", help="also write every round's figures and the ratios here")
    args, rest = parser.parse_known_args(argv)
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"XLA_FLAGS={flags!r}; torch {torch.__version__}, {torch.get_num_threads()} threads; {device}")
    report: dict = {"xla_flags": flags, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "device": device, "cpus": os.cpu_count(), "steps": args.steps, "warmup": args.warmup,
                    "rounds": args.rounds, "shapes": {}}  # fmt: skip
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            sys.exit(f"error: --shapes {shape}: not one of {', '.join(SHAPES)}")
        cfg = load_config(["--config", "configs/default.yaml", *SHAPES[shape], *rest])
        cfg = Job.of_devices(cfg, jax.devices()).cfg  # resolved as training resolves it here
        m = cfg.model
        print(f"\n{shape}: {m.n_layer}L d{m.d_model} {m.n_head}H T{m.seq_len} B{cfg.batch_size}")
        loops = {"torch eager": TorchLoop(cfg, False), "torch.compile": TorchLoop(cfg, True)}
        results: dict[str, list[float]] = {k: [] for k in ("jaxtrain", "bare jax", *loops)}
        waits = []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                tps, wait = jaxtrain_loop(cfg, args.steps, args.warmup, Path(tmp) / f"r{r}")
                results["jaxtrain"].append(tps)
                waits.append(wait)
                results["bare jax"].append(bare_loop(cfg, args.steps, args.warmup))
                for name, loop in loops.items():
                    results[name].append(loop.run(args.steps, args.warmup if r == 0 else 2))
                print(
                    f"  round {r}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items()) + " tok/s"
                )
        for name, values in results.items():
            spread = f"{min(values):,.0f}..{max(values):,.0f}"
            print(f"  {name:<14} {statistics.median(values):>9,.0f} tok/s median ({spread})")
        for name in ("bare jax", *loops):
            print(_ratio_line(name, results["jaxtrain"], results[name]))
        report["shapes"][shape] = {
            "tokens_per_s": results,
            "median": {k: statistics.median(v) for k, v in results.items()},
            "ratio_median": {
                k: statistics.median(a / b for a, b in zip(results["jaxtrain"], v, strict=True))
                for k, v in results.items()
                if k != "jaxtrain"
            },
            "data_wait_frac": statistics.median(waits),
        }
        print(f"  jaxtrain data wait: {100 * statistics.median(waits):.2f}% of step time (median of rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
