"""Memory and speed of the mesh layouts (DP, ZeRO-1, FSDP, TP, FSDP x TP) on 8 fake CPU devices.

    python bench/bench_sharding.py --rounds 3 --steps 5 --json bench/results/sharding_cpu.json
    python bench/bench_sharding.py --shapes default        # only the default job's model
    python bench/bench_sharding.py --shapes tiny --rounds 1 --steps 1      # smoke: configs/tiny.yaml

For each model shape and layout: train-state bytes per device (from the shardings), the compiled
train step's peak bytes per device (memory_analysis), each as a ratio to data parallelism's, and
tokens/s of the jitted step in float32. Every layout is compiled first; then each round times every
layout for `--steps` steps in turn, so machine noise hits all alike; the median over rounds and
the median of the per-round ratios to DP are reported.

Memory figures for gpt2_124m are of its real shape (seq 1024, batch 8), compiled from abstract
inputs only. Its tokens/s use seq_len 256 and are taken only if one DP step takes under
`--max_step_s` seconds and all layouts' states fit in memory; otherwise "not timed" and why.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.model.transformer import flops_per_token  # noqa: E402
from jaxtrain.observe.memory import compiled_bytes  # noqa: E402
from jaxtrain.parallel import mesh as mesh_lib  # noqa: E402
from jaxtrain.run.build import build  # noqa: E402
from jaxtrain.run.job import Job  # noqa: E402

LAYOUTS = {
    "DP": ["--mesh.data", "8"],
    "ZeRO-1": ["--mesh.zero1", "true"],
    "FSDP": ["--mesh.data", "1", "--mesh.fsdp", "8"],
    "TP": ["--mesh.data", "4", "--mesh.tensor", "2"],
    "FSDPxTP": ["--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.tensor", "2"],
}
COMMON = ["--total_batch_size", "0", "--gradient_accumulation_steps", "1", "--dtype", "float32"]
# shape -> (flags for the memory figures, extra flags for the timed step)
SHAPES = {
    "default": (["--config", "configs/default.yaml", "--batch_size", "32"], []),
    "gpt2_124m": (["--config", "configs/gpt2_124m.yaml", "--batch_size", "8"], ["--model.seq_len", "256"]),
    "tiny": (["--config", "configs/tiny.yaml"], []),  # not in the default --shapes: a smoke run
}


class Layout:
    """One shape on one mesh: the run training builds (config, shardings), its train step compiled
    from abstract inputs."""

    def __init__(self, argv: list[str]) -> None:
        self.run = build(Job.of_devices(load_config(COMMON + argv), jax.devices()))
        self.cfg = cfg = self.run.cfg
        self.state_bytes = self.run.state_bytes_per_device
        self.n_params = self.run.n_params
        self.rows = (cfg.batch_size, cfg.model.seq_len + 1)
        t0 = time.perf_counter()
        self.step = self.run.compile_train()
        self.compile_s = time.perf_counter() - t0
        self.peak_bytes = compiled_bytes(self.step)["total_bytes"]
        self.temp_bytes = int(self.step.memory_analysis().temp_size_in_bytes)  # activations, grads
        self.tokens = cfg.batch_size * cfg.model.seq_len
        self.state = self.batch = None

    def materialise(self) -> None:
        """Real state and one batch, then one untimed step (it pays for first-touch allocation)."""
        self.state = self.run.init_state()
        rows = np.random.default_rng(0).integers(0, self.cfg.model.vocab_size, self.rows, dtype=np.int32)
        self.batch = mesh_lib.global_batch(rows, self.run.mesh, self.cfg.batch_size)
        self.time_steps(1)

    def time_steps(self, steps: int) -> float:
        """Seconds for `steps` train steps, the last waited for."""
        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        return time.perf_counter() - t0

    def free(self) -> None:
        self.state = self.batch = None


def step_flops(lay: Layout) -> float:
    """Training FLOPs of one global step (model.flops_per_token x tokens)."""
    return flops_per_token(lay.cfg.model, lay.n_params) * lay.tokens


def timed(layouts: dict[str, Layout], args: argparse.Namespace, ref: tuple | None) -> tuple[dict, dict, str]:
    """Tokens/s per layout over interleaved rounds and per-round ratios to DP, or ({}, {}, why not).

    `ref` = (FLOP/s, shape) of a DP step timed earlier in this run: a step predicted slower than
    --max_step_s from it is not run at all.
    """
    dp = layouts["DP"]
    what = f"batch {dp.cfg.batch_size} x seq {dp.cfg.model.seq_len}"
    if ref and step_flops(dp) / ref[0] > args.max_step_s:
        est = step_flops(dp) / ref[0]
        return (
            {},
            {},
            f"one DP step at {what} ~{est:.0f}s > {args.max_step_s:.0f}s, from {ref[1]}'s DP FLOP/s",
        )
    # Interleaved rounds keep every layout's state (params + 2 moments) alive, plus its gradients.
    need = sum(8 * lay.state_bytes * 4 // 3 for lay in layouts.values())
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.7 * free:
        return {}, {}, f"all layouts' states need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    for name, lay in layouts.items():
        lay.materialise()
        if (s := lay.time_steps(1)) > args.max_step_s:
            return {}, {}, f"one {name} step at {what} took {s:.0f}s > {args.max_step_s:.0f}s"
    tps: dict[str, list[float]] = {name: [] for name in layouts}
    for r in range(args.rounds):
        for name, lay in layouts.items():
            tps[name].append(args.steps * lay.tokens / lay.time_steps(args.steps))
        print(f"  round {r}: " + ", ".join(f"{n} {v[-1]:,.0f}" for n, v in tps.items()), file=sys.stderr)
    for lay in layouts.values():
        lay.free()
    ratios = {n: [a / b for a, b in zip(v, tps["DP"], strict=True)] for n, v in tps.items()}
    return tps, ratios, what


def report(shape: str, mem: dict[str, Layout], tps: dict, ratios: dict, note: str) -> dict:
    """Print one shape's table; return its figures."""
    dp, m = mem["DP"], mem["DP"].cfg.model
    print(f"\n{shape}: {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, vocab {m.vocab_size}")
    print(f"  memory at batch {dp.cfg.batch_size} x seq {m.seq_len}; tokens/s", end=" ")
    print(f"at {note}, float32" if tps else f"not timed: {note}")
    head = ("layout", "mesh d/f/t", "state MiB", "x DP", "peak MiB", "x DP", "compile s", "tokens/s", "x DP")
    print("{:<8} {:>10} {:>10} {:>6} {:>10} {:>6} {:>9} {:>10} {:>6}".format(*head))
    rows = {}
    for name, lay in mem.items():
        mesh = f"{lay.cfg.mesh.data}/{lay.cfg.mesh.fsdp}/{lay.cfg.mesh.tensor}"
        row = rows[name] = {
            "mesh_data_fsdp_tensor": mesh,
            "state_bytes": lay.state_bytes,
            "state_x_dp": lay.state_bytes / dp.state_bytes,
            "peak_bytes": lay.peak_bytes,
            "peak_x_dp": lay.peak_bytes / dp.peak_bytes,
            "temp_bytes": lay.temp_bytes,
            "compile_s": lay.compile_s,
            "tokens_per_s": statistics.median(tps[name]) if tps else None,
            "tokens_per_s_x_dp": statistics.median(ratios[name]) if tps else None,
            "tokens_per_s_rounds": tps.get(name),
        }
        speed = (
            f"{row['tokens_per_s']:>10,.0f} {row['tokens_per_s_x_dp']:>6.3f}"
            if tps
            else f"{'not timed':>10} {'-':>6}"
        )
        print(
            f"{name:<8} {mesh:>10} {lay.state_bytes / 2**20:>10.2f} {row['state_x_dp']:>6.3f} "
            f"{lay.peak_bytes / 2**20:>10.2f} {row['peak_x_dp']:>6.3f} {lay.compile_s:>9.1f} {speed}"
        )
    return {
        "model": {"n_layer": m.n_layer, "d_model": m.d_model, "n_head": m.n_head, "vocab_size": m.vocab_size},
        "memory_batch": dp.cfg.batch_size,
        "memory_seq_len": m.seq_len,
        "timing": f"{note}, float32" if tps else f"not timed: {note}",
        "layouts": rows,
    }


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout
        return out.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    """Prints the tables; returns every figure (what --json writes)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--shapes", default="default,gpt2_124m")
    parser.add_argument(
        "--max_step_s", type=float, default=20.0, help="time a shape only if one step is faster"
    )
    parser.add_argument("--json", default="", help="write every figure here")
    args = parser.parse_args(argv)
    if jax.device_count() != 8:
        raise SystemExit(
            f"needs 8 devices, have {jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')})"
        )
    out = {
        "jax": jax.__version__,
        "commit": git_commit(),
        "devices": f"8 x {jax.devices()[0].device_kind}",
        "rounds": args.rounds,
        "steps": args.steps,
        "shapes": {},
    }
    ref = None  # (FLOP/s, shape) of the first DP step timed
    for shape in args.shapes.split(","):
        mem_argv, time_argv = SHAPES[shape]
        print(f"[{shape}] compiling {len(LAYOUTS)} layouts", file=sys.stderr)
        mem = {name: Layout(mem_argv + flags) for name, flags in LAYOUTS.items()}
        if time_argv:  # timed at another shape: compile that too, keep only the figures of these
            for lay in mem.values():
                lay.step = None
            print(f"[{shape}] compiling {len(LAYOUTS)} layouts at {' '.join(time_argv)}", file=sys.stderr)
            runs = {name: Layout(mem_argv + time_argv + flags) for name, flags in LAYOUTS.items()}
        else:
            runs = mem
        print(f"[{shape}] timing", file=sys.stderr)
        tps, ratios, note = timed(runs, args, ref)
        if tps and ref is None:
            ref = (step_flops(runs["DP"]) * statistics.median(tps["DP"]) / runs["DP"].tokens, shape)
        del runs
        out["shapes"][shape] = report(shape, mem, tps, ratios, note)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return out


if __name__ == "__main__":
    main()
