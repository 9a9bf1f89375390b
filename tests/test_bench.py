"""Every bench in bench/ at its smallest setting, so none can rot unnoticed again (bench_loop.py
crashed for a release after train() changed, and nothing ran it).

Each runs in this process through its main(argv) (the 8 fake CPU devices of conftest.py) except
bench_restore_memory.py, which must be two real processes, and the processes the benches start
themselves (bench_data.py, bench_export.py and bench_gpu.py measure in fresh children). The
figures are too small to mean anything; what is checked is that every figure a bench reports is
there, finite and consistent with the others. bench_gpu.py runs its jaxtrain side on the CPU: its
PyTorch side needs CUDA, which this machine has not (bench_torch.py runs the same TorchGPT on CPU).
"""

import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    """Imports a bench by its file name; they import their siblings and read configs/ from the
    checkout, as when run as `python bench/X.py` from it. XLA_FLAGS and XDG_CACHE_HOME come back
    afterwards (bench_torch.py adds its CPU flags, bench_data.py points the cache at a temp dir)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.chdir(ROOT)
    for name in ("XLA_FLAGS", "XDG_CACHE_HOME"):
        monkeypatch.setenv(name, os.environ[name])
    return importlib.import_module


def _positive(*values: float) -> None:
    assert all(isinstance(v, float | int) and math.isfinite(v) and v > 0 for v in values), values


@pytest.mark.slow
def test_bench_loop(bench, capsys):
    """`make bench`: jaxtrain's train() against a bare jax+optax loop."""
    figures = bench("bench_loop").main(
        ["--config", "configs/tiny.yaml", "--steps", "2", "--warmup", "2", "--rounds", "1"]
    )
    _positive(*figures["bare"], *figures["jaxtrain"])
    assert all(0 <= w < 1 for w in figures["data_wait"])
    printed = re.search(r"ratio jaxtrain/bare : ([\d.]+) median", capsys.readouterr().out)
    ratio = figures["jaxtrain"][0] / figures["bare"][0]
    assert printed and float(printed[1]) == pytest.approx(ratio, abs=1e-3)


@pytest.mark.slow
def test_bench_torch(bench, tmp_path):
    """jaxtrain, bare jax, torch eager and torch.compile on one tiny shape (torch.compile's first
    compile of a session takes ~35 s of this test on 2 cores; its cache in /tmp makes later ones fast)."""
    out = tmp_path / "torch.json"
    tiny = ["--model.n_layer", "1", "--model.d_model", "32", "--model.seq_len", "32", "--batch_size", "8"]
    report = bench("bench_torch").main(
        ["--shapes", "default", "--steps", "2", "--warmup", "2", "--rounds", "1", "--json", str(out), *tiny]
    )
    shape = report["shapes"]["default"]
    assert set(shape["median"]) == {"jaxtrain", "bare jax", "torch eager", "torch.compile"}
    _positive(*shape["median"].values(), *shape["ratio_median"].values())
    assert shape["ratio_median"]["torch eager"] == pytest.approx(
        shape["median"]["jaxtrain"] / shape["median"]["torch eager"]
    )
    assert 0 <= shape["data_wait_frac"] < 1
    assert json.loads(out.read_text())["shapes"]["default"]["median"] == shape["median"]


@pytest.mark.slow
def test_bench_gpu_times_exactly_the_steps_it_counts(bench, tmp_path):
    """The orchestrator, its child process and the jaxtrain run it times (on the CPU here, 3 steps
    after 2): the run's metrics.jsonl holds a record a step, the timed ones exactly the steps
    counted, each starting where the one before ended; tokens/s is the tokens a step over their
    median; a window one step short, or a record of two steps, is refused. The report names its
    command, commit and log."""
    import statistics

    gpu, out = bench("bench_gpu"), tmp_path / "gpu.json"
    tiny = ["--model.n_layer", "1", "--model.d_model", "64", "--model.n_head", "2", "--model.seq_len", "64",
            "--total_batch_size", "512", "--device_batch_size", "1"]  # fmt: skip
    report = gpu.main(
        ["--runs", "124m/auto/none", "--steps", "3", "--warmup", "2", "--data_tokens", "65536",
         "--work", str(tmp_path), "--out", str(out), *tiny]
    )  # fmt: skip
    run = report["runs"]["124m/auto/none"]
    assert "error" not in run, run.get("error")
    _positive(run["tokens_per_sec"], run["step_time_s"], run["loss_last"], run["wall_s"])
    assert run["device_kind"] == "cpu" and run["batch"] == [8, 1, 64]  # 512 tokens / seq 64, 8 devices
    assert json.loads(out.read_text())["runs"]["124m/auto/none"]["tokens_per_sec"] == run["tokens_per_sec"]
    lines = (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and run["timed_steps"] == [3, 5]
    assert run["step_times_s"] == [r["step_time_s"] for r in records[2:]]
    assert run["step_time_s"] == statistics.median(run["step_times_s"])
    assert run["tokens_per_sec"] == 512 / run["step_time_s"] == gpu.rate(run)
    # The window is the steps counted, end to end: from step 2's end to step 5's, by the wall clock.
    assert abs(records[-1]["t"] - records[1]["t"] - run["window_s"]) <= gpu.WINDOW_SLACK_S
    with pytest.raises(ValueError, match="timed window: steps"):
        gpu.figures(records[:2] + records[3:], 2, 3, 512)  # one timed step not recorded
    with pytest.raises(ValueError, match="timed window: steps"):
        gpu.figures(records[:-1], 2, 3, 512)  # the window one step short
    both = (records[3]["step_time_s"] + records[4]["step_time_s"]) / 2
    with pytest.raises(ValueError, match="timed window: steps"):
        gpu.figures([*records[:3], records[4] | {"step_time_s": both}], 2, 3, 512)  # steps 4, 5 as one
    assert report["command"].endswith(f"--out {out} {' '.join(tiny)}")
    assert report["log"] == str(tmp_path / "gpu.log") and len(report["commit"]) >= 40
    assert "=== 124m/auto/none\n$ " in (tmp_path / "gpu.log").read_text()


def test_bench_gpu_figures_share_the_median_step_and_refuse_a_gap(bench):
    """Written records (a GPU's, with a peak): tokens/s, MFU and step time all from the median step
    (not the mean: one fast step moves none of them); a step that starts 5 ms after the previous
    one's end leaves time uncounted, and is refused."""
    gpu = bench("bench_gpu")
    per_token, peak, tokens = 6e8, 1e15, 65536  # model FLOPs a token per device, the device's peak
    steps, t = [0.5, 0.6, 0.62, 0.3, 0.61], [100.0]
    for d in steps:
        t.append(t[-1] + d)
    records = [{"step": i, "step_time_s": d, "t": round(t[i], 3), "loss": 3.0, "data_wait_frac": 0.01,
                "tokens_per_sec": tokens / d, "mfu": tokens / d * per_token / peak,
                "flops_per_sec_per_device": tokens / d * per_token}
               for i, d in enumerate(steps, 1)]  # fmt: skip
    out = gpu.figures(records, 1, 4, tokens)
    assert out["step_time_s"] == 0.605 and out["step_times_s"] == steps[1:]  # median of 0.6, 0.62, 0.3, 0.61
    assert out["tokens_per_sec"] == pytest.approx(tokens / 0.605, rel=1e-12)
    assert out["mfu"] == pytest.approx(tokens * per_token / peak / 0.605, rel=1e-12)
    assert out["flops_per_step_per_device"] == pytest.approx(tokens * per_token)
    assert out["peak_flops_per_device"] == pytest.approx(peak)
    late = [*records[:3], records[3] | {"t": records[3]["t"] + 0.005}, records[4]]
    with pytest.raises(ValueError, match=r"step 4 starts \+5.0 ms from step 3's end"):
        gpu.figures(late, 1, 4, tokens)
    # A committed run (its tokens_per_sec of another statistic) read by its median step.
    committed = {"batch": [512, 32, 1024], "step_time_s": 1.0148120627999986}
    assert gpu.rate(committed) == pytest.approx(516636, abs=1)


def test_bench_gpu_reports_say_what_made_them(bench, tmp_path):
    """A new report's command, commit, versions and log (bench_gpu.provenance); every GPU result in
    bench/results (a file with an H200's runs) names its command, commit, versions and log, or says
    which are missing, and each of its jaxtrain runs has its median step and batch."""
    gpu = bench("bench_gpu")
    made = gpu.provenance(["--runs", "124m/auto/none"], "", tmp_path / "gpu.log")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    head = head.stdout.strip()
    assert made["commit"].startswith(head) and len(head) == 40
    assert made["command"].endswith("bench/bench_gpu.py --runs 124m/auto/none")
    assert made["versions"]["jax"] and made["versions"]["jaxlib"] and "driver" in made["versions"]
    assert made["log"] == str(tmp_path / "gpu.log")
    found = 0
    for path in sorted((ROOT / "bench" / "results").rglob("*.json")):
        report = json.loads(path.read_text())
        runs = report.get("runs") if isinstance(report.get("runs"), dict) else {}
        if not any(isinstance(r, dict) and "H200" in str(r.get("device_kind")) for r in runs.values()):
            continue
        found += 1
        said = {k: report.get(k) for k in ("command", "commit", "versions", "log")}
        missing = [k for k, v in said.items() if not v]
        assert not missing or all(k in report.get("provenance", "") for k in missing), (path, missing)
        assert report.get("statistic"), path
        for name, run in runs.items():
            if "device_kind" in run and not name.startswith("torch/"):
                assert run["step_time_s"] > 0 and len(run["batch"]) == 3, (path, name)
    assert found == 3  # gpu_bench_h200.json, gpu_check_h200_1/bench.json, gpu_check_h200_2/bench_fp8.json


def test_bench_export(bench, tmp_path):
    """Host memory of exporting a saved state (the export in a fresh process, sampled)."""
    small = ["--model.vocab_size", "4096", "--model.d_model", "128", "--model.n_layer", "1",
             "--model.n_head", "4", "--model.n_kv_head", "2", "--model.seq_len", "32"]  # fmt: skip
    out = bench("bench_export").main(["--dir", str(tmp_path), *small])
    assert out["largest_param_mb"] == 2  # the 4096 x 128 float32 embedding (and the untied head)
    assert out["params_mb"] >= 2 * out["largest_param_mb"] and out["files"] == 1
    _positive(out["baseline_rss_mb"], out["peak_rss_mb"], out["export_s"])
    # The sampled peak is the exporting process's own, in MiB, and the export's: the kernel's
    # high-water mark of that process agrees (a sampler of another process, in other units or too
    # slow to see the peak would not), and exporting a 2 MiB param grew it by at least that.
    assert abs(out["peak_rss_mb"] - out["kernel_peak_rss_mb"]) <= out["largest_param_mb"], out
    assert out["growth_mb"] >= out["largest_param_mb"], out
    assert (tmp_path / "hf" / "config.json").is_file()


def test_bench_generate(bench):
    results = bench("bench_generate").main(["--shapes", "default", "--new_tokens", "16", "--rounds", "1"])
    r = results["default (d128 L4 T128)"]
    _positive(r["cached_tokens_per_s"], r["uncached_tokens_per_s"])
    assert r["speedup"] == pytest.approx(r["cached_tokens_per_s"] / r["uncached_tokens_per_s"], abs=0.02)


@pytest.mark.slow
def test_bench_sharding(bench):
    """Five layouts of configs/tiny.yaml on the 8 devices: memory from the built runs, then timed."""
    out = bench("bench_sharding").main(["--shapes", "tiny", "--rounds", "1", "--steps", "1"])
    layouts = out["shapes"]["tiny"]["layouts"]
    assert list(layouts) == ["DP", "ZeRO-1", "FSDP", "TP", "FSDPxTP"]
    assert layouts["DP"]["state_x_dp"] == 1 and layouts["DP"]["mesh_data_fsdp_tensor"] == "8/1/1"
    assert layouts["FSDP"]["state_x_dp"] < 0.25  # fsdp 8 holds about an eighth of the state
    assert layouts["ZeRO-1"]["state_x_dp"] < 1  # the moments split, the params not
    for row in layouts.values():
        _positive(row["state_bytes"], row["peak_bytes"], row["compile_s"], row["tokens_per_s"])
        _positive(row["tokens_per_s_x_dp"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_restore_memory(tmp_path):
    """Two real processes (one CPU device each) save, then restore as fsdp 2 and as data 2."""
    small = ["--model.n_layer", "1", "--model.d_model", "64", "--model.n_head", "2",
             "--model.vocab_size", "256"]  # fmt: skip
    cmd = [sys.executable, "scripts/run_distributed.py", "--mode", "manual", "--world-size", "2",
           "--script", "bench/bench_restore_memory.py", "--", "--run_dir", str(tmp_path / "run"),
           *small]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x.removeprefix("[rank 1] ") for x in (proc.stdout + proc.stderr).splitlines()]
    records = [json.loads(x) for x in lines if x.startswith('{"layout"')]
    owned = {(r["layout"], r["process"]): r["owned_mb"] for r in records}
    assert sorted(owned) == [("fsdp 1", 0), ("fsdp 1", 1), ("fsdp 2", 0), ("fsdp 2", 1)]
    assert owned["fsdp 2", 0] < 0.55 * owned["fsdp 1", 0]  # half of every param, and of its moments
    for r in records:
        assert math.isfinite(r["peak_rss_growth_mb"])


def test_bench_data(bench):
    """The loader on 2 and 3 shards, each count measured in a child process."""
    results = bench("bench_data").main(
        ["--shards", "2,3", "--total_tokens", "60000", "--steps", "4", "--batch", "2", "--seq", "64",
         "--step_ms", "1"]
    )  # fmt: skip
    assert sorted(results) == [2, 3]
    for r in results.values():
        _positive(r["tokens_per_s"], r["rss_mib"], r["peak_rss_mib"], r["open_warm_s"])
        assert 0 <= r["wait_frac"] <= 1 and r["peak_rss_mib"] >= r["rss_mib"]


def test_trace_top(bench, tmp_path):
    """A jax.profiler trace (what --profile_steps writes): the traced function's calls are counted."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def traced_step(x):
        return jnp.tanh(x @ x).sum()

    x = jnp.ones((128, 128))
    traced_step(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            traced_step(x).block_until_ready()
    tracks = bench("trace_top").main([str(tmp_path), "--match", "CPU", "--top", "5"])
    python = next(totals for track, totals in tracks.items() if track.endswith("/ python"))
    calls = [us for name, us in python.items() if "traced_step" in name]
    assert calls and all(us > 0 for us in calls)
