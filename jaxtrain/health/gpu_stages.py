"""What each stage of the GPU check (health/gpu_check.py) runs, part by part, in its own process.

    device   versions, devices, driver; a bf16 matmul's rate and a device-to-device copy's bandwidth
    kernels  each GPU-only kernel against its reference (run/preflight.py), at the shipped widths
    train    short trains through scripts/train.py, one per kernel choice (judged in gpu_check.py)
    bench    bench/bench_gpu.py, a short run list

A stage's process announces its parts, then each part's start and result, as JSON lines in a
progress file: a part that kills its process (a Mosaic or ptxas abort) or hangs is then named, and
the stage goes on in a new process from the next part. The device and kernels stages hold the
devices themselves; train and bench start processes that do, and so never start a backend here.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from jaxtrain.health import gpu_rules

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax",
    "optax", "orbax-checkpoint", "grain", "wandb", "numpy", "ml_dtypes", "torch",
)  # fmt: skip
# The shipped MoE widths (d_model, each expert's hidden size): the Pallas kernels' tiles at each.
WIDTHS = {"qwen3_30b_a3b": (2048, 768), "mixtral_8x7b": (4096, 14336), "deepseek_v3": (7168, 2048)}
# Attention heads: query heads, key/value heads, head dim, value dim; with documents or not.
HEADS = {
    "gpt2": ((12, 12, 64, 64), False),
    "gpt2_documents": ((12, 12, 64, 64), True),
    "llama3_8b_documents": ((32, 8, 128, 128), True),
    "deepseek_mla": ((16, 16, 192, 128), False),
    "deepseek_mla_documents": ((16, 16, 192, 128), True),
}
# Train runs: name -> (reference run, train.py flags). GPU widths are multiples of 128 (the Pallas
# tiles), and XLA's attention's T x T scores make every run's step a few GB, so the step's memory,
# not the compiler's autotuning scratch, sets the devices' peak. The MoE runs name XLA's attention:
# they judge the grouped matmul alone.
GPT_GPU = ["--config", "configs/tiny.yaml", "--model.n_layer", "2", "--model.d_model", "512",
           "--model.n_head", "8", "--model.seq_len", "1024", "--batch_size", "32",
           "--dtype", "bfloat16"]  # fmt: skip
MOE_GPU = ["--config", "configs/moe_tiny.yaml", "--model.n_layer", "2", "--model.d_model", "256",
           "--model.d_ff", "512", "--model.moe.d_expert", "256", "--model.seq_len", "1024",
           "--batch_size", "32", "--dtype", "bfloat16", "--model.attention_impl", "xla"]  # fmt: skip
MOE_CPU = ["--config", "configs/moe_tiny.yaml", "--model.n_layer", "2", "--model.seq_len", "32",
           "--batch_size", "16"]  # fmt: skip
# Documents end at ':' (byte 58: every 128 bytes of the default dataset's Python on average), so a
# 1024-token window holds one-token documents, documents inside a 32-token block and across blocks:
# every level of cuDNN's packed form (model/documents.py).
DOCS = ["--model.doc_eos", "58"]
# A Llama-style model (grouped-query heads, SwiGLU): its projections in bf16, then in FP8.
LLAMA_GPU = ["--config", "configs/llama_tiny.yaml", "--model.n_layer", "2", "--model.d_model", "512",
             "--model.n_head", "8", "--model.n_kv_head", "4", "--model.d_ff", "1536",
             "--model.seq_len", "1024", "--batch_size", "32", "--dtype", "bfloat16"]  # fmt: skip
TRAIN_RUNS = {
    "gpu": {
        # Newest first: a budget that runs out cuts what earlier GPU runs proved (2026-11-28, H200:
        # the whole stage took 230 s, moe_pallas 56 s of it, compiling its Pallas kernels). The
        # experts' FP8 kernels (pallas_fp8, model/grouped_fp8.py) with FP8 projections: not yet run.
        # Under remat, as Qwen3-30B-A3B runs them: the routed block's own backward, the copies and
        # the gradient rounded by the layer's scales before the kernels (model/moe.py `_routed`).
        "moe_pallas_fp8": (
            "moe_ragged_dot",
            [
                *MOE_GPU,
                "--model.moe.grouped_matmul",
                "pallas_fp8",
                "--model.matmul",
                "fp8",
                "--model.remat",
                "dots",
            ],
        ),
        "gpt_xla_documents": ("", [*GPT_GPU, *DOCS, "--model.attention_impl", "xla"]),
        "gpt_cudnn_documents": ("gpt_xla_documents", [*GPT_GPU, *DOCS, "--model.attention_impl", "cudnn"]),
        "llama_bf16": ("", LLAMA_GPU),
        "llama_fp8": ("llama_bf16", [*LLAMA_GPU, "--model.matmul", "fp8"]),
        "gpt_xla": ("", [*GPT_GPU, "--model.attention_impl", "xla"]),
        "gpt_cudnn": ("gpt_xla", [*GPT_GPU, "--model.attention_impl", "cudnn"]),
        "moe_ragged_dot": ("", [*MOE_GPU, "--model.moe.grouped_matmul", "ragged_dot"]),
        "moe_pallas": ("moe_ragged_dot", [*MOE_GPU, "--model.moe.grouped_matmul", "pallas"]),
        "moe_blocks": ("moe_ragged_dot", [*MOE_GPU, "--model.moe.grouped_matmul", "blocks"]),
    },
    "cpu": {
        "gpt_xla": ("", ["--config", "configs/tiny.yaml", "--model.attention_impl", "xla"]),
        "moe_ragged_dot": ("", [*MOE_CPU, "--model.moe.grouped_matmul", "ragged_dot"]),
        "moe_blocks": ("moe_ragged_dot", [*MOE_CPU, "--model.moe.grouped_matmul", "blocks"]),
    },
}
# How each run is judged against its reference: health/gpu_rules.py (the FP8 runs: FP8_RUNS).
BENCH = {  # bench/bench_gpu.py's flags: a short run list; on CPU its documented smoke
    # Ten timed steps after five: over 2 steps after 1 an H200 read 900,934 tok/s (MFU 176%, not a
    # rate), over 15 after 5 516,636 by the median step (42%), the same build (2026-11-28).
    # FP8 against bf16 on a 0.9B model: on an H200 88 s and 102 s a run, compiles included
    # (2026-11-28; GPT-2 124M against PyTorch was measured before: docs/gpu_check.md).
    "gpu": ["--runs", "1b/auto/none,1b_fp8/auto/none", "--steps", "10", "--warmup", "5",
            "--data_tokens", "8388608"],
    "cpu": ["--runs", "124m/auto/none", "--steps", "2", "--warmup", "1", "--data_tokens", "65536",
            "--model.n_layer", "1", "--model.d_model", "64", "--model.n_head", "2", "--model.seq_len", "64",
            "--total_batch_size", "512", "--device_batch_size", "1"],
}  # fmt: skip

PART_MARK = "=== part: "
# tests only: "abort" adds a part that aborts its process, "observe" an observation that does
FAULT_ENV = "JAXTRAIN_GPU_CHECK_FAULT"
Part = tuple[str, Callable[[], dict[str, Any]]]  # name, what it measures (its result has "passed")


class Observation:
    """A part that measures and is no check: recorded apart, never judged (gpu_rules.py
    kernels.observations). Announced as such before it runs, so one that kills its process stays one."""

    def __init__(self, measure: Callable[[], dict[str, Any]]) -> None:
        self.measure = measure

    def __call__(self) -> dict[str, Any]:
        return self.measure()


def run_stage(stage: str, work: Path, options: dict[str, Any], skip: set[str]) -> None:
    """Run `stage`'s parts not in `skip`, each announced in work/<stage>.jsonl before and after."""
    parts = {"device": _device_parts, "kernels": _kernel_parts, "train": _train_parts, "bench": _bench_parts}
    found = parts[stage](work, options)
    if os.environ.get(FAULT_ENV) == "abort":  # tests: a part that kills its process, second
        found.insert(1, ("planted abort", os.abort))
    if os.environ.get(FAULT_ENV) == "observe":
        found.insert(1, ("planted observation", Observation(os.abort)))
    progress = work / f"{stage}.jsonl"
    seen = [name for name, measure in found if isinstance(measure, Observation)]
    _append(progress, {"parts": [name for name, _ in found], "observations": seen})
    for name, measure in found:
        if name in skip:
            continue
        print(f"{PART_MARK}{name}", flush=True)  # where the log of a part that dies starts
        _append(progress, {"part": name, "start": time.time()})
        t0 = time.perf_counter()
        try:
            result = measure()
        except Exception as e:  # noqa: BLE001  the part failed; the stage goes on with the next
            result = {"passed": False, "failed": f"{type(e).__name__}: {str(e)[:500]}"}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"{name}: {json.dumps(result)[:2000]}", flush=True)
        _append(progress, {"part": name, "result": result})


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------------- device


def _device_parts(work: Path, options: dict[str, Any]) -> list[Part]:
    return [("versions", _versions), ("matmul", _matmul_rate), ("fp8_matmul", _fp8_matmul_rate),
            ("copy", _copy_bandwidth)]  # fmt: skip


def _versions() -> dict[str, Any]:
    import jax

    from jaxtrain.health.checks import software_versions
    from jaxtrain.observe.memory import limit_bytes

    versions = software_versions(PACKAGES)
    devices = [
        {
            "id": d.id, "platform": d.platform, "kind": d.device_kind,
            "compute_capability": str(getattr(d, "compute_capability", "")),
            "bytes_limit": limit_bytes(d),
        }
        for d in jax.devices()
    ]  # fmt: skip
    smi, gpu_seen = "", False
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit"
        done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
        smi, gpu_seen = (
            (done.stdout or done.stderr).strip(),
            done.returncode == 0 and bool(done.stdout.strip()),
        )
    # jax falls back to the CPU, with only a warning, when its CUDA plugin does not load: every later
    # stage would then check the CPU paths, and pass.
    lost = gpu_seen and devices[0]["platform"] == "cpu"
    failed = "nvidia-smi sees a GPU but jax runs on the CPU: its CUDA plugin did not load" if lost else ""
    return {"passed": not lost, "failed": failed, "versions": versions, "devices": devices, "nvidia_smi": smi,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "rules_failed": ["device.gpu_used"] if lost else []}  # fmt: skip


def _timed(fn: Callable[[], Any], warmup: int = 3, rounds: int = 5, calls: int = 10) -> float:
    """Seconds a call of fn takes: the median over `rounds` of `calls` calls queued back to back and
    waited for once (a wait per call would add the host's dispatch, 5-10% of a 1 ms copy)."""
    for _ in range(warmup):
        fn().block_until_ready()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        fn().block_until_ready()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _matmul_rate() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    n = 8192 if jax.devices()[0].platform == "gpu" else 512  # a CPU takes minutes at 8192
    keys = jax.random.split(jax.random.key(0), 2)
    a, b = (jax.random.normal(k, (n, n), jnp.float32).astype(jnp.bfloat16) for k in keys)
    matmul = jax.jit(jnp.matmul)
    seconds = _timed(lambda: matmul(a, b))
    return {"passed": True, "n": n, "median_s": seconds, "tflops": 2 * n**3 / seconds / 1e12}


def _fp8_matmul_rate() -> dict[str, Any]:
    """The same matmul in FP8 as a job compiles it (xla_env.FP8_OPTIONS): e4m3 operands already
    rounded (cuBLASLt's FP8 GEMM alone), and bf16 operands through model/fp8.py (each rounded by its
    own scale first: what a projection pays). The planner's forecast assumes FP8 GEMMs at bf16's
    fraction of their peak, which no public measurement of the same shapes confirms (plan/forecast.py)."""
    import jax
    import jax.numpy as jnp

    from jaxtrain import xla_env
    from jaxtrain.model import fp8

    gpu = jax.devices()[0].platform == "gpu"
    n = 8192 if gpu else 128  # XLA:CPU's FP8 dot converts every product: the path, not a rate
    dims = (((1,), (0,)), ((), ()))
    keys = jax.random.split(jax.random.key(0), 2)
    a, b = (jax.random.normal(k, (n, n), jnp.float32).astype(jnp.bfloat16) for k in keys)
    qa, qb = (x.astype(fp8.FORWARD) for x in (a, b))
    one = jnp.float32(1)

    def compiled(fn: Callable[..., Any], *args: Any) -> Any:
        return jax.jit(fn).lower(*args).compile(xla_env.FP8_OPTIONS if gpu else None)

    gemm = compiled(
        lambda x, y: jax.lax.dot_general(
            fp8.dequantize(x, one, jnp.bfloat16), fp8.dequantize(y, one, jnp.bfloat16), dims
        ),
        qa, qb,
    )  # fmt: skip
    scaled = compiled(lambda x, y: fp8.fp8_dot_general(x, y, dims), a, b)
    gemm_s, scaled_s = _timed(lambda: gemm(qa, qb)), _timed(lambda: scaled(a, b))
    return {
        "passed": True, "n": n, "gemm_median_s": gemm_s, "gemm_tflops": 2 * n**3 / gemm_s / 1e12,
        "scaled_median_s": scaled_s, "scaled_tflops": 2 * n**3 / scaled_s / 1e12,
        "cublaslt_fp8": (gemm.as_text() or "").count("__cublas$lt$matmul$f8"),
    }  # fmt: skip


def _copy_bandwidth() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    nbytes = 2**30 if jax.devices()[0].platform == "gpu" else 2**24
    x = jnp.ones(nbytes // 2, jnp.bfloat16)
    double = jax.jit(lambda x: x * 2)  # reads and writes every byte once
    seconds = _timed(lambda: double(x))
    return {
        "passed": True,
        "bytes": nbytes,
        "median_s": seconds,
        "tb_per_s_read_and_written": 2 * nbytes / seconds / 1e12,
    }


# -------------------------------------------------------------------------------- kernels


def kernel_checks(platform: str, capability: str) -> list[Any]:
    """run/preflight.py's checks the GPU check runs: on GPUs the GPU-only kernels at the shipped
    widths, float32 tiles last (an observation: they may not fit shared memory); on CPUs the
    references and the Pallas forward in its interpreter, small."""
    from jaxtrain.model import auto  # where the Pallas kernels can run: auto's own rule
    from jaxtrain.run import preflight as pf

    if platform == "cpu":
        small = {"sizes": (100, 0, 37, 91), "buffer": 300}
        return [
            pf.fp8_check(64, 128, 96),
            pf.attention_check("xla", 4, 2, 32, 32, True, "bfloat16", length=32, batch=2),
            pf.grouped_check(128, 128, "bfloat16", interpret=True, backward=False, **small),  # type: ignore[arg-type]
            pf.expert_check("blocks", 128, 128, "bfloat16", **small),  # type: ignore[arg-type]
            pf.exchange_check("padded", d=32, rows=64),
        ]
    # Newest first (a budget that runs out cuts what earlier GPU runs proved): the experts' FP8
    # grouped matmul at Qwen3's widths (no GPU has run it yet: forward, dX and dW against the same
    # roundings in float32), FP8 at Llama 3 8B's MLP widths, attention with documents, the exchange;
    # then the Pallas kernels (181 s in all on an H200, 2026-11-28, each Pallas check 16-24 s of
    # compiling).
    d, ff = WIDTHS["qwen3_30b_a3b"]
    why = auto.pallas_refusal(platform, capability, d, ff, "bfloat16")
    found = [
        pf.refused(f"ragged_matmul pallas_fp8 d{d} ff{ff}", why)
        if why
        else pf.grouped_check(d, ff, "bfloat16", fp8=True)
    ]
    found.append(pf.fp8_check(1024, 4096, 14336))
    found += [
        pf.attention_check("cudnn", *heads, docs, "bfloat16", length=1024) for heads, docs in HEADS.values()
    ]
    found += [pf.exchange_check("ragged"), pf.exchange_check("ragged", buffer=True)]
    for d, ff in WIDTHS.values():
        why = auto.pallas_refusal(platform, capability, d, ff, "bfloat16")
        found.append(
            pf.refused(f"ragged_matmul pallas d{d} ff{ff}", why)
            if why
            else pf.grouped_check(d, ff, "bfloat16")
        )
    d, ff = WIDTHS["qwen3_30b_a3b"]
    found += [pf.expert_check(impl, d, ff, "bfloat16") for impl in ("pallas", "blocks", "ragged_dot")]
    found.append(pf.grouped_check(d, ff, "float32"))
    return found


def _kernel_parts(work: Path, options: dict[str, Any]) -> list[Part]:
    import jax

    from jaxtrain.run import preflight as pf

    devices = jax.devices()
    capability = str(getattr(devices[0], "compute_capability", ""))

    def measure(check: Any) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            verdict = pf.run_check(check, devices)
            if verdict.detail:
                print(f"{check.name}: {verdict.detail}", file=sys.stderr, flush=True)
            return {**asdict(verdict), "max_error": verdict.max_error, "detail": verdict.detail[-600:]}

        return run

    found = kernel_checks(devices[0].platform, capability)
    return [(c.name, Observation(measure(c)) if c.informational else measure(c)) for c in found]


# ---------------------------------------------------------------------------------- train


def train_runs(platform: str, only: Sequence[str] = ()) -> dict[str, tuple[str, list[str]]]:
    """The train runs on `platform` ("gpu" or "cpu"), or those of `only`, with their references."""
    runs = TRAIN_RUNS["cpu" if platform == "cpu" else "gpu"]
    unknown = sorted(set(only) - set(runs))
    if unknown:
        raise ValueError(f"no train run {unknown} on {platform}; choose among {sorted(runs)}")
    return {k: v for k, v in runs.items() if not only or k in only}


def _train_parts(work: Path, options: dict[str, Any]) -> list[Part]:
    runs = train_runs(options["platform"], options["train_runs"])
    return [(name, _trainer(name, flags, work, options)) for name, (_, flags) in runs.items()]


def _trainer(
    name: str, flags: list[str], work: Path, options: dict[str, Any]
) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        run_dir = work / "runs" / name
        steps = options["train_steps"]
        cmd = [sys.executable, "scripts/train.py", *flags, "--run_dir", str(run_dir), "--overwrite", "true",
               "--total_steps", str(steps), "--log_interval", "1", "--eval_interval", "0",
               "--checkpoint_interval", "1000000", "--sample_tokens", "0", "--progress_bar", "false",
               "--use_wandb", "false"]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=options["run_timeout_s"])
        print(f"--- {name}: {' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-6000:]}", flush=True)
        if done.returncode != 0:
            return {
                "passed": False,
                "failed": f"train.py exited {done.returncode}: {_last_line(done.stderr)}",
            }
        result = train_figures(run_dir / "metrics.jsonl", steps)
        said = [x for x in done.stdout.splitlines() + done.stderr.splitlines() if "INFO preflight" in x]
        result["preflight"] = said[0].split("INFO ", 1)[1][:400] if said else ""  # what it checked, or cached
        return result

    return run


def train_figures(metrics: Path, steps: int) -> dict[str, Any]:
    """A run's losses (one per step), its devices' peak bytes in use and the compiled step's bytes."""
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    start: dict[str, Any] = next((r for r in records if r.get("event") == "start"), {})
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    peaks = [r["mem_peak_gb"] * 1e9 for r in records if "mem_peak_gb" in r]
    compiled = start.get("peak_bytes_per_device")
    result = {
        "passed": len(losses) == steps and all(_finite(x) for x in losses.values()),
        "losses": [losses.get(s) for s in range(1, steps + 1)],
        "peak_bytes_in_use": max(peaks) if peaks else None,
        "compiled_bytes": compiled,
        "memory_ratio": max(peaks) / compiled if peaks and compiled else None,
        "attention": start.get("attention"),
    }
    if not result["passed"]:
        result["failed"] = f"{len(losses)} of {steps} steps logged, or a loss is not finite"
    return result


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and x == x and abs(x) != float("inf")


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:400] if lines else ""


# ---------------------------------------------------------------------------------- bench


def _bench_parts(work: Path, options: dict[str, Any]) -> list[Part]:
    def run() -> dict[str, Any]:
        out = Path(options["out"]) / "bench.json"
        # A run starts only before --budget_s and lasts --run_timeout_s at most: both end by the deadline.
        half = max(30, int((options["deadline"] - time.time()) / 2 - 10))
        cmd = [sys.executable, "bench/bench_gpu.py", *BENCH["cpu" if options["platform"] == "cpu" else "gpu"],
               "--out", str(out), "--log", str(out.with_name("bench_runs.log")),  # bench.log is the stage's
               "--work", str(work / "bench"), "--budget_s", str(half),
               "--run_timeout_s", str(half)]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(f"--- {' '.join(cmd)}\n{done.stdout[-6000:]}{done.stderr[-6000:]}", flush=True)
        report = json.loads(out.read_text()) if out.exists() else {"runs": {}}
        result = judge_bench(report, done.returncode, done.stderr)
        result["provenance"] = {k: report.get(k) for k in ("command", "commit", "versions", "log")}
        return result

    return [("bench_gpu", run)]


def judge_bench(report: dict[str, Any], returncode: int, stderr: str) -> dict[str, Any]:
    """bench_gpu.py's report judged by the bench rules (health/gpu_rules.py): each run's figures,
    the verdict, what failed and the rules broken."""
    runs = {
        name: {k: r.get(k) for k in ("tokens_per_sec", "mfu", "mem_peak_gb", "step_time_s", "error")}
        for name, r in report["runs"].items()
    }
    failed = [f"{name}: {_last_line(str(r['error']))}" for name, r in runs.items() if r["error"]]
    if returncode != 0 or not runs:
        failed.append(f"bench_gpu.py exited {returncode}: {_last_line(stderr)}")
    window = [x for x in failed if "timed window:" in x]  # bench_gpu.timed_window refused the run
    broken = ["bench.window"] * bool(window) + ["bench.finished"] * (len(failed) > len(window))
    peak = gpu_rules.threshold("bench.under_peak")  # past the peak is no rate
    past = [
        f"{name}: MFU {r['mfu']:.0%} is past the peak" for name, r in runs.items() if (r["mfu"] or 0) > peak
    ]
    broken += ["bench.under_peak"] if past else []
    failed += past
    return {"passed": not failed, "runs": runs, "failed": "; ".join(failed), "rules_failed": broken}
