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
device batch 16, so 32 microbatches a step); tokens/s and MFU come from its metrics.jsonl after
`--warmup` steps. MFU = flops_per_token * tokens/s / peak, both from jaxtrain (model.py, metrics.py).
"""

import argparse
import json
import os
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


def _config(shape: str, data: Path, extra: list[str]):
    import jax

    from jaxtrain.config import load_config
    from jaxtrain.run.job import Job

    argv = ["--config", "configs/gpt2_124m.yaml", "--train_data_path", str(data / "train.bin"),
            "--valid_data_path", str(data / "val.bin"), *SHAPES[shape], *extra]  # fmt: skip
    return Job.of_devices(load_config(argv), jax.devices()).cfg  # resolved as training resolves it


def _jaxtrain(shape: str, attn: str, remat: str, args: argparse.Namespace, extra: list[str]) -> dict:
    import jax
    from bench_loop import jaxtrain_loop  # a sibling: this file runs as a script

    cfg = _config(shape, args.data, ["--model.attention_impl", attn, "--model.remat", remat, *extra])
    run_dir = Path(tempfile.mkdtemp(dir=args.work))
    t0 = time.perf_counter()
    tps, wait = jaxtrain_loop(cfg, args.steps, args.warmup, run_dir)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "loss" in r and r["step"] > args.warmup]
    return {
        "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
        "tokens_per_sec": tps, "mfu": statistics.median(r.get("mfu") or 0.0 for r in timed) or None,
        "data_wait_frac": wait, "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "mem_peak_gb": max((r.get("mem_peak_gb", 0.0) for r in records), default=None),
        "loss_last": timed[-1]["loss"], "wall_s": time.perf_counter() - t0, "run_dir": str(run_dir),
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
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % 2])
    torch.cuda.synchronize()
    tps = args.steps * cfg.batch_size * t / (time.perf_counter() - start)
    kind = torch.cuda.get_device_name()
    peak = peak_flops(kind)
    return {
        "device_kind": kind, "torch": torch.__version__, "tokens_per_sec": tps,
        "mfu": tps * flops_per_token(cfg.model, n_params) / peak if peak else None,
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
    parser.add_argument("--commit", default="", help="recorded in the JSON (the GPU machine has no .git)")
    parser.add_argument("--data_tokens", type=int, default=64 * 2**20, help="random training tokens written")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args(argv)
    if args.child:
        _child(args.child, args, extra)
        return None
    work = Path(args.work or tempfile.mkdtemp())
    (work / "data").mkdir(parents=True, exist_ok=True)
    _write_tokens(work / "data", args.data_tokens)
    report = {"commit": args.commit, "steps": args.steps, "warmup": args.warmup, "extra_flags": extra,
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
            lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
            result = json.loads(lines[-1][len(RESULT) :]) if lines else {"error": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            result = {"error": f"timed out after {args.run_timeout_s} s: {str(e.stderr)[-2000:]}"}
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
