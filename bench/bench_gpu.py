"""jaxtrain on one GPU: tokens/s and MFU per model shape, attention implementation, remat policy
and XLA setting, and a nanoGPT-style PyTorch loop (torch.compile, fused AdamW, bf16 autocast,
F.scaled_dot_product_attention) on the same GPU, same shapes, same run. Every figure goes to JSON.

    python bench/bench_gpu.py --out bench/results/gpu.json                  # the default runs
    python bench/bench_gpu.py --runs 124m/auto/none,124m/cudnn/dots,torch/124m --steps 6
    python bench/bench_gpu.py --runs 124m/auto/none/lhs --device_batch_size 32   # flags pass through
    python bench/bench_gpu.py --runs 124m/auto/none --steps 2 --warmup 1 --data_tokens 65536 \
        --model.n_layer 1 --model.d_model 64 --model.n_head 2 --model.seq_len 64 \
        --total_batch_size 512 --device_batch_size 1     # smoke: jaxtrain's side also runs on a CPU

A run is `shape/attention_impl/remat[/xla]` for jaxtrain (xla: a name in XLA_SETTINGS) or
`torch/shape`. Each run is its own process (XLA reads its flags once, at start, and a run that
runs out of memory must not take the rest with it), on random tokens written once. jaxtrain runs
through its own train() with configs/gpt2_124m.yaml (T=1024, bfloat16, 524,288 tokens per step,
device batch 16, so 32 microbatches a step).

One statistic, the median step: a run logs every step (log_interval 1), each record the time from
the previous step's end to its own, and `timed_window` checks that the `--steps` records after
`--warmup` are exactly those steps, end to end with no gap. Then step_time_s is their median,
tokens/s = tokens a step / step_time_s and MFU = model FLOPs a step per device / peak / step_time_s
(the FLOPs and peak jaxtrain's training log uses). PyTorch's steps are timed by CUDA events between
steps, the same way. Each report names its command, commit, versions and log (`provenance`).
"""

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {  # name -> train.py flags on top of configs/gpt2_124m.yaml
    "124m": [],
    "350m": ["--model.n_layer", "24", "--model.d_model", "1024", "--model.n_head", "16"],
    # 0.91B (16 layers of 2048: 805M in the layers) at 65,536 tokens a step: GEMMs wide enough for FP8 to pay
    "1b": [
        "--model.n_layer",
        "16",
        "--model.d_model",
        "2048",
        "--model.n_head",
        "16",
        "--total_batch_size",
        "65536",
    ],
}
SHAPES["1b_fp8"] = [*SHAPES["1b"], "--model.matmul", "fp8"]  # its projections in FP8 (docs/fp8.md)
XLA_SETTINGS = {  # name -> environment on top of the caller's
    "default": {},
    "lhs": {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"},
    "nocmdbuf": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "noprealloc": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
}
DEFAULT_RUNS = (
    "124m/auto/none,torch/124m,124m/xla/none,124m/cudnn/none,124m/auto/dots,350m/auto/none,torch/350m"
)
RESULT = "BENCH_RESULT "
# A step's start against the previous step's end: their wall-clock stamps are kept to the ms.
WINDOW_SLACK_S = 0.002
ROOT = Path(__file__).resolve().parent.parent


def provenance(argv: list[str], commit: str, log: Path) -> dict:
    """What made a report: the command, the commit (git's, else --commit's, else said unknown),
    the versions of python, jax, jaxlib, the CUDA plugin, torch, the driver, and the log's path."""
    from jaxtrain.health.checks import software_versions
    from jaxtrain.health.gpu_stages import PACKAGES

    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()  # fmt: skip
        commit = head.stdout.strip() + (" with uncommitted changes" if dirty else "")
    elif not commit:
        commit = "unknown: no .git here and no --commit given"
    driver = None
    if shutil.which("nvidia-smi"):
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        done = subprocess.run(smi, capture_output=True, text=True)
        driver = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    versions = {k: v for k, v in software_versions(PACKAGES).items() if v != "missing"}
    return {"command": shlex.join([sys.executable, "bench/bench_gpu.py", *argv]), "commit": commit,
            "versions": versions | {"driver": driver}, "log": str(log)}  # fmt: skip


def _config(shape: str, data: Path, extra: list[str]):
    import jax

    from jaxtrain.config import load_config
    from jaxtrain.run.job import Job

    argv = ["--config", "configs/gpt2_124m.yaml", "--train_data_path", str(data / "train.bin"),
            "--valid_data_path", str(data / "val.bin"), *SHAPES[shape], *extra]  # fmt: skip
    return Job.of_devices(load_config(argv), jax.devices()).cfg  # resolved as training resolves it


def timed_train(cfg, steps: int, warmup: int, run_dir: Path) -> list[dict]:
    """jaxtrain's own train() (as scripts/train.py runs it, one process) for warmup + steps steps,
    a record a step; its metrics.jsonl's training records. `cfg`: resolved on the devices."""
    import dataclasses
    import logging

    from jaxtrain.cluster.detect import detect
    from jaxtrain.run.loop import train

    cfg = dataclasses.replace(
        cfg, run_dir=str(run_dir), overwrite=True, total_steps=warmup + steps, log_interval=1,
        eval_interval=0, checkpoint_interval=10**9, sample_tokens=0, progress_bar=False,
    )  # fmt: skip
    log = logging.getLogger("jaxtrain")
    log.disabled = True  # keep the benchmark's output to its figures
    try:
        train(cfg, detect(cfg.dist))
    finally:
        log.disabled = False  # a caller in the same process (tests/test_bench.py) logs again
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


def timed_window(records: list[dict], warmup: int, steps: int) -> list[float]:
    """The durations of steps warmup+1 .. warmup+steps, one each, from a record a step; raises
    ValueError unless the records hold exactly those steps, each record one step (its step one past
    the record before), and each step starting where the one before ended (its wall-clock stamp
    `t`, ms, less its duration is the previous stamp): the window is the steps it counts."""
    logged = [r["step"] for r in records]
    if logged != list(range(1, warmup + steps + 1)):
        raise ValueError(f"timed window: steps {logged} logged, want 1..{warmup + steps}, a record each")
    by_step = {r["step"]: r for r in records}
    want = range(warmup, warmup + steps + 1)  # the last warm-up step's end opens the window
    durations = [by_step[s]["step_time_s"] for s in want[1:]]
    for s, d in zip(want[1:], durations, strict=True):
        gap = by_step[s]["t"] - d - by_step[s - 1]["t"]
        if abs(gap) > WINDOW_SLACK_S:
            raise ValueError(f"timed window: step {s} starts {gap * 1000:+.1f} ms from step {s - 1}'s end")
    return durations


def rate(run: dict) -> float:
    """A run's tokens/s from its median step: tokens a step (batch rows x seq_len) / step_time_s.
    Reads any run record of a bench JSON, the committed ones too (their tokens_per_sec may be of
    another statistic: their `statistic` says)."""
    rows, _, seq_len = run["batch"]
    return rows * seq_len / run["step_time_s"]


def figures(records: list[dict], warmup: int, steps: int, tokens_per_step: int) -> dict:
    """A run's figures from its timed window (`timed_window`), each from its median step."""
    durations = timed_window(records, warmup, steps)
    timed = records[warmup:]
    step_s, window_s = statistics.median(durations), sum(durations)
    # Model FLOPs a token per device and the peak, as the training log has them (observe/metrics.py).
    per_token = timed[0].get("flops_per_sec_per_device", 0.0) / timed[0]["tokens_per_sec"]
    mfu_per_tps = (timed[0].get("mfu") or 0.0) / timed[0]["tokens_per_sec"]
    return {
        "tokens_per_sec": tokens_per_step / step_s, "mfu": tokens_per_step * mfu_per_tps / step_s or None,
        "step_time_s": step_s, "step_times_s": durations, "window_s": window_s,
        "timed_steps": [warmup + 1, warmup + steps],
        "flops_per_step_per_device": tokens_per_step * per_token or None,
        "peak_flops_per_device": per_token / mfu_per_tps if mfu_per_tps else None,
        "data_wait_frac": sum(r["data_wait_frac"] * r["step_time_s"] for r in timed) / window_s,
        "loss_last": timed[-1]["loss"],
    }  # fmt: skip


def _jaxtrain(shape: str, attn: str, remat: str, args: argparse.Namespace, extra: list[str]) -> dict:
    import jax

    cfg = _config(shape, args.data, ["--model.attention_impl", attn, "--model.remat", remat, *extra])
    run_dir = Path(tempfile.mkdtemp(dir=args.work))
    t0 = time.perf_counter()
    records = timed_train(cfg, args.steps, args.warmup, run_dir)
    return {
        "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
        **figures(records, args.warmup, args.steps, cfg.batch_size * cfg.model.seq_len),
        "mem_peak_gb": max((r.get("mem_peak_gb", 0.0) for r in records), default=None),
        "wall_s": time.perf_counter() - t0, "run_dir": str(run_dir),
        "batch": [cfg.batch_size, cfg.gradient_accumulation_steps, cfg.model.seq_len],
    }  # fmt: skip


def _torch(shape: str, args: argparse.Namespace, extra: list[str]) -> dict:
    import torch
    from torch_gpt import TorchGPT

    from jaxtrain.model.transformer import flops_per_token
    from jaxtrain.observe.metrics import peak_flops

    cfg = _config(shape, args.data, extra)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = TorchGPT(cfg).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.b1, cfg.optim.b2),
                            weight_decay=cfg.optim.weight_decay, fused=True)  # fmt: skip
    compiled = torch.compile(model)
    accum, t = cfg.gradient_accumulation_steps, cfg.model.seq_len
    micro = cfg.batch_size // accum
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, 50257, (accum, micro, t + 1), device="cuda", generator=g) for _ in range(2)]
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[cfg.dtype]

    def step(batch: torch.Tensor) -> torch.Tensor:
        for i in range(accum):
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                loss = compiled(batch[i, :, :-1], batch[i, :, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clip_val)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(batches[i % 2])
    torch.cuda.synchronize()
    # An event between steps, queued with them (no wait between steps): step i's time is from the
    # event before it to the one after, so the window is the steps it counts, end to end.
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    ends[0].record()
    for i in range(args.steps):
        loss = step(batches[i % 2])
        ends[i + 1].record()
    torch.cuda.synchronize()
    durations = [a.elapsed_time(b) / 1000 for a, b in zip(ends, ends[1:], strict=False)]
    step_s, tokens = statistics.median(durations), cfg.batch_size * t
    kind = torch.cuda.get_device_name()
    peak = peak_flops(kind)
    flops = tokens * flops_per_token(cfg.model, n_params)
    return {
        "device_kind": kind, "torch": torch.__version__, "tokens_per_sec": tokens / step_s,
        "mfu": flops / peak / step_s if peak else None, "step_time_s": step_s, "step_times_s": durations,
        "timed_steps": [args.warmup + 1, args.warmup + args.steps], "window_s": sum(durations),
        "flops_per_step_per_device": flops, "peak_flops_per_device": peak or None,
        "mem_peak_gb": torch.cuda.max_memory_allocated() / 2**30, "loss_last": float(loss) * accum,
        "wall_s": time.perf_counter() - t0, "batch": [cfg.batch_size, accum, t],
    }  # fmt: skip


def _child(run: str, args: argparse.Namespace, extra: list[str]) -> None:
    parts = run.split("/")
    if parts[0] == "torch":
        result = _torch(parts[1], args, extra)
    else:
        result = _jaxtrain(parts[0], parts[1], parts[2], args, extra)
    print(RESULT + json.dumps(result), flush=True)


def _write_tokens(data: Path, tokens: int) -> None:
    """Random GPT-2 token ids as flat uint16 nanoGPT files: throughput does not depend on the text."""
    rng = np.random.default_rng(0)
    rng.integers(0, 50257, tokens, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 50257, min(tokens, 2**20), dtype=np.uint16).tofile(data / "val.bin")


def main(argv: list[str] | None = None) -> dict | None:
    """Prints each run's figures; returns the report (what --out writes)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=DEFAULT_RUNS)
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps (a multiple of --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="", help="JSON file, rewritten after every run")
    parser.add_argument("--work", default="", help="folder for data and run dirs (kept; default: a temp dir)")
    parser.add_argument("--budget_s", type=float, default=0, help="start no run after this many seconds")
    parser.add_argument("--run_timeout_s", type=float, default=300)
    parser.add_argument("--commit", default="", help="recorded where there is no .git (a GPU machine's copy)")
    parser.add_argument("--data_tokens", type=int, default=64 * 2**20, help="random training tokens written")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log", default="", help="runs' output (default: --out's .log)")
    args, extra = parser.parse_known_args(argv)
    if args.child:
        _child(args.child, args, extra)
        return None
    work = Path(args.work or tempfile.mkdtemp())
    (work / "data").mkdir(parents=True, exist_ok=True)
    _write_tokens(work / "data", args.data_tokens)
    log = Path(args.log or (Path(args.out).with_suffix(".log") if args.out else work / "bench_gpu.log"))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    report = {**provenance(sys.argv[1:] if argv is None else argv, args.commit, log),
              "statistic": "median step (tokens_per_sec = tokens a step / step_time_s, mfu the same)",
              "steps": args.steps, "warmup": args.warmup, "extra_flags": extra,
              "config": "configs/gpt2_124m.yaml", "shapes": SHAPES, "xla_settings": XLA_SETTINGS,
              "runs": {}}  # fmt: skip
    t_start = time.monotonic()
    for run in args.runs.split(","):
        if args.budget_s and time.monotonic() - t_start > args.budget_s:
            print(f"{run:<24} skipped: past --budget_s", flush=True)
            continue
        parts = run.split("/")
        env = dict(os.environ)
        setting = parts[3] if len(parts) > 3 else "default"
        for key, value in XLA_SETTINGS[setting].items():
            env[key] = f"{env.get(key, '')} {value}".strip() if key == "XLA_FLAGS" else value
        cmd = [sys.executable, __file__, "--child", run, "--data", str(work / "data"), "--work", str(work),
               "--steps", str(args.steps), "--warmup", str(args.warmup), *extra]  # fmt: skip
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.run_timeout_s)
            said = f"{proc.stdout}{proc.stderr}exit {proc.returncode}"
            lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
            result = json.loads(lines[-1][len(RESULT) :]) if lines else {"error": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            said = f"{e.stdout or ''}{e.stderr or ''}timed out"
            result = {"error": f"timed out after {args.run_timeout_s} s: {str(e.stderr)[-2000:]}"}
        with log.open("a") as f:
            f.write(f"=== {run}\n$ {shlex.join(cmd)}\n{said}\n")
        result.update(env_xla_flags=env.get("XLA_FLAGS", ""), setting=setting)
        report["runs"][run] = result
        if "error" in result:
            print(f"{run:<24} FAILED: {result['error'][-1500:]}", flush=True)
        else:
            mfu = f"{100 * result['mfu']:.1f}%" if result.get("mfu") else "n/a"
            print(f"{run:<24} {result['tokens_per_sec']:>10,.0f} tok/s  MFU {mfu:>6}  "
                  f"peak mem {result.get('mem_peak_gb') or 0:.1f} GB  loss {result['loss_last']:.3f}  "
                  f"({result['wall_s']:.0f} s)", flush=True)  # fmt: skip
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for shape in SHAPES:
        ours, theirs = report["runs"].get(f"{shape}/auto/none", {}), report["runs"].get(f"torch/{shape}", {})
        if "tokens_per_sec" in ours and "tokens_per_sec" in theirs:
            ratio = ours["tokens_per_sec"] / theirs["tokens_per_sec"]
            report[f"jaxtrain_over_torch_compile_{shape}"] = ratio
            print(f"{shape}: jaxtrain (auto, no remat) / torch.compile = {ratio:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
