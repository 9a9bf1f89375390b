"""scripts/gpu_check.py on CPU, where its stages run the reference paths small (the GPU-only kernels
run on a lent GPU: docs/gpu_check.md), and run/preflight.py's verdicts on kernels made to differ.

    pytest tests/test_gpu_check.py      # about 30 s on 2 cores
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from processes import clean_env

from jaxtrain.errors import ArgumentError
from jaxtrain.health import gpu_rules
from jaxtrain.health.gpu_check import judge_train, name_rules, parse_args, summary, table, versions_line
from jaxtrain.health.gpu_stages import judge_bench
from jaxtrain.run import preflight as pf

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_check_runs_end_to_end_on_cpu_and_reports_every_stage(tmp_path):
    """device, kernels and a 2-step train of the tiny GPT, as the GPU machine runs them (2 devices:
    the exchange crosses them)."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(out), "--stages", "device,kernels,train",
         "--train_runs", "gpt_xla", "--train_steps", "2", "--budget_s", "240",
         "--work", str(tmp_path / "work")],
        cwd=ROOT, env=clean_env(devices=2), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["passed"] and list(report["stages"]) == ["device", "kernels", "train"]
    assert {s["status"] for s in report["stages"].values()} == {"passed"}
    assert report["rules_version"] == gpu_rules.RULES_VERSION == report["rules"]["version"]
    device = report["stages"]["device"]["parts"]
    assert device["versions"]["devices"][0]["platform"] == "cpu" and device["matmul"]["tflops"] > 0
    assert device["fp8_matmul"]["gemm_tflops"] > 0 and device["fp8_matmul"]["scaled_tflops"] > 0
    kernels = report["stages"]["kernels"]["parts"]
    assert len(kernels) == 5 and all(k["passed"] and k["max_error"] < 2e-2 for k in kernels.values())
    assert any("interpreted" in name for name in kernels)  # the Pallas forward, in its interpreter
    assert any(name.startswith("fp8_matmul") for name in kernels)  # FP8 against its roundings in float32
    run = report["stages"]["train"]["parts"]["gpt_xla"]
    assert len(run["losses"]) == 2 and run["memory_ratio"] is None  # a CPU reports no memory
    assert run["preflight"] == "preflight: nothing GPU-only to check", run  # the job-start preflight, said
    assert sorted(p.name for p in out.iterdir()) == [
        "device.log",
        "gpu_check.json",
        "kernels.log",
        "train.log",
    ]
    lines = done.stdout.splitlines()  # the table comes last: a stage a row, then a part a row
    verdict = f"gpu_check: PASSED, judged by rules v{gpu_rules.RULES_VERSION} (jaxtrain/health/gpu_rules.py)"
    table = lines[lines.index(verdict) + 1 :]
    assert table[0].startswith("stage") and [x.split()[0] for x in table[1:4]] == [
        "device",
        "kernels",
        "train",
    ]
    assert len(table) == 4 + 4 + 5 + 1 and all(x.startswith("  ") for x in table[4:])


def test_a_kernel_that_differs_fails_with_what_differs():
    """A real kernel against a wrong reference (XLA's causal attention against a non-causal one),
    NaN where a kernel must not write, a refused kernel and a renamed one: each a failed verdict
    with its one line, never an exception."""
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 2, 8), jnp.float32) for i in range(3))
    attend = pf.kernel("attention")

    def wrong(devices):
        return {"out": (attend(q, k, v, "xla", None), jax.nn.dot_product_attention(q, k, v, is_causal=False))}

    verdict = pf.run_check(pf.Check("xla against non-causal", wrong, 1e-2), jax.devices())
    assert not verdict.passed and verdict.failed.startswith("out off by") and verdict.max_error > 1e-2
    nan = pf.run_check(pf.Check("nan", lambda d: {"d_w": (q * jnp.nan, q)}, 1e-2), jax.devices())
    assert not nan.passed and nan.failed == "d_w holds NaN or inf"
    choices = pf.Choices(grouped_matmul="pallas", d_model=100, expert_dim=256)
    [refused] = pf.preflight(choices, jax.devices()[:1])
    assert not refused.passed and "needs Hopper GPUs" in refused.failed


def test_a_renamed_kernel_fails_only_its_checks(monkeypatch):
    monkeypatch.setitem(pf.KERNELS, "attention", ("jaxtrain.model.attention:no_such_kernel",))
    verdict = pf.run_check(
        pf.attention_check("xla", 2, 2, 8, 8, False, "float32", length=8, batch=1), jax.devices()
    )
    assert not verdict.passed and "is gone (renamed?)" in verdict.failed


def test_train_runs_are_judged_against_their_reference():
    """The first step (same params, same batch) tightly; the last steps' mean within 1%, however far
    one step drifts (bf16 routing flips: an H200's Pallas run was 1.17% off at one step)."""
    runs = {name: ("ref", []) for name in ("ok", "drifts", "first", "off", "fat")} | {"ref": ("", [])}
    ref = [5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    stage = {"status": "passed", "parts": {
        "ref": {"passed": True, "losses": ref, "memory_ratio": 1.02},
        "ok": {"passed": True, "losses": [5.0, 4.01, 3.0, 3.0, 3.0, 3.0, 3.01], "memory_ratio": 0.97},
        "drifts": {"passed": True, "losses": [5.0, 4.0, 3.0, 3.04, 2.97, 3.0, 3.0], "memory_ratio": None},
        "first": {"passed": True, "losses": [5.01, *ref[1:]], "memory_ratio": None},
        "off": {"passed": True, "losses": [5.0, 4.0, 3.1, 3.1, 3.1, 3.1, 3.1], "memory_ratio": None},
        "fat": {"passed": True, "losses": ref, "memory_ratio": 1.3},
    }}  # fmt: skip
    judge_train(stage, runs)
    parts = stage["parts"]
    assert parts["ref"]["passed"] and parts["ok"]["passed"] and stage["status"] == "failed"
    assert parts["drifts"]["passed"] and abs(parts["drifts"]["loss_vs_reference"] - 0.04 / 3) < 1e-9
    assert parts["first"]["failed"] == "first loss 0.20% off ref's"
    assert parts["off"]["failed"] == "last 5 losses' mean 3.33% off ref's"
    assert parts["fat"]["failed"] == "peak memory 1.30 x the compiled step's"
    assert [parts[p]["rules_failed"] for p in ("ok", "first", "off", "fat")] == [
        [],
        ["train.first_step"],
        ["train.late_mean"],
        ["train.memory"],
    ]
    # FP8 is held to training no worse than bf16 by 2%: 2.5% below passes (an H200's run), above fails.
    fp8 = {"llama_fp8": ("llama_bf16", [])}
    for late, passed in ((2.925, True), (3.075, False)):
        stage = {"status": "passed", "parts": {
            "llama_bf16": {"passed": True, "losses": ref, "memory_ratio": None},
            "llama_fp8": {"passed": True, "losses": [5.02, 4.0, *[late] * 5], "memory_ratio": None},
        }}  # fmt: skip
        judge_train(stage, fp8)
        assert stage["parts"]["llama_fp8"]["passed"] is passed, stage
    assert stage["parts"]["llama_fp8"]["failed"] == "last 5 losses' mean 2.50% above llama_bf16's"
    assert stage["parts"]["llama_fp8"]["rules_failed"] == ["train.fp8_late_mean"]


def _train_stage(late: float) -> dict:
    ref = [5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    return {"status": "passed", "seconds": 1.0, "not_run": [], "error": "", "parts": {
        "ref": {"passed": True, "losses": ref, "memory_ratio": None},
        "run": {"passed": True, "losses": [5.0, 4.0, *[late] * 5], "memory_ratio": None},
    }}  # fmt: skip


def test_the_rules_table_is_the_one_source_of_the_verdict_the_json_and_the_summary(monkeypatch):
    """A threshold changed in health/gpu_rules.py alone changes the verdict, the rules the report
    records and the words its summary prints."""
    runs = {"ref": ("", []), "run": ("ref", [])}
    stage = _train_stage(3.045)  # 1.5% above the reference
    judge_train(stage, runs)
    assert stage["parts"]["run"]["rules_failed"] == ["train.late_mean"] and stage["status"] == "failed"
    looser = gpu_rules.Rule("train", "the last {late} steps' mean within {threshold:.1%}", 0.02, "a test")
    monkeypatch.setitem(gpu_rules.RULES, "train.late_mean", looser)
    stage = _train_stage(3.045)
    judge_train(stage, runs)
    assert stage["parts"]["run"]["passed"] and stage["status"] == "passed"
    assert gpu_rules.record()["rules"]["train.late_mean"] == {
        "stage": "train", "text": looser.text, "threshold": 0.02, "set": "a test",
        "says": "the last 5 steps' mean within 2.0%",
    }  # fmt: skip
    monkeypatch.setitem(gpu_rules.RULES, "train.late_mean", dataclasses.replace(looser, threshold=0.001))
    stage = _train_stage(3.0045)
    judge_train(stage, runs)
    name_rules("train", stage)
    report = {
        "passed": False,
        "rules": gpu_rules.record(),
        "stages": {"train": stage | {"summary": summary("train", stage)}},
    }
    assert stage["parts"]["run"]["rules_failed"] == ["train.late_mean"]  # 0.15% off
    assert "rule train.late_mean broken: the last 5 steps' mean within 0.1%" in table(report)


def test_a_stage_that_fails_says_failed_in_the_json_and_the_summary():
    """The stage's status, its summary line, the part's rule and the table's first line."""
    stage = _train_stage(3.1)
    judge_train(stage, {"ref": ("", []), "run": ("ref", [])})
    name_rules("train", stage)
    stage["summary"] = summary("train", stage)
    assert stage["status"] == "failed" and stage["rules_failed"] == ["train.late_mean"]
    assert stage["summary"] == "failed (rule train.late_mean): run: last 5 losses' mean 3.33% off ref's"
    report = {"passed": False, "rules": gpu_rules.record(), "stages": {"train": stage}}
    lines = table(report).splitlines()
    assert (
        lines[1]
        == f"gpu_check: FAILED, judged by rules v{gpu_rules.RULES_VERSION} (jaxtrain/health/gpu_rules.py)"
    )
    assert lines[3].startswith("train    failed") and "failed (rule train.late_mean)" in lines[3]
    assert "  train   FAIL  run  " in table(report) and "[rule train.late_mean]" in lines[-2]
    said = gpu_rules.RULES["train.late_mean"].says()
    assert lines[-1] == f"  rule train.late_mean broken: {said}" and "within 1%" in said


@pytest.mark.parametrize(
    "argv", [["--out", "o", "--stages", "kernels,nope"], ["--out", "o", "--train_runs", "x"]]
)
def test_bad_flags_are_one_line(argv):
    with pytest.raises(ArgumentError):
        parse_args(argv)


def test_a_part_that_kills_its_process_fails_alone_and_the_stage_goes_on(tmp_path):
    """A kernel that aborts (as a Mosaic or ptxas failure does) costs only its own verdict: the
    stage starts a new process from the next part."""
    out = tmp_path / "out"
    env = clean_env(JAXTRAIN_GPU_CHECK_FAULT="abort")
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(out), "--stages", "device", "--budget_s", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    stage = json.loads((out / "gpu_check.json").read_text())["stages"]["device"]
    assert stage["status"] == "failed" and list(stage["parts"]) == [
        "versions",
        "planted abort",
        "matmul",
        "fp8_matmul",
        "copy",
    ]
    assert stage["parts"]["planted abort"]["failed"].startswith("its process died of SIGABRT in it")
    assert all(stage["parts"][p]["passed"] for p in ("versions", "matmul", "fp8_matmul", "copy"))
    assert "  device  FAIL  planted abort  its process died of SIGABRT in it" in done.stdout


def test_an_observation_is_no_check_even_when_it_kills_its_process(tmp_path):
    """What run/preflight.py marks informational (the exchange's landing-buffer gradient) is recorded
    under the stage's observations, never among its checks: one planted that aborts its process
    leaves the stage passed, its checks counted without it."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(out), "--stages", "device", "--budget_s", "60"],
        cwd=ROOT, env=clean_env(JAXTRAIN_GPU_CHECK_FAULT="observe"), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stage = json.loads((out / "gpu_check.json").read_text())["stages"]["device"]
    assert stage["status"] == "passed" and list(stage["parts"]) == [
        "versions",
        "matmul",
        "fp8_matmul",
        "copy",
    ]
    assert list(stage["observations"]) == ["planted observation"] and not stage["not_run"]
    assert stage["observations"]["planted observation"]["failed"].startswith("its process died of SIGABRT")
    assert "  device  seen  planted observation  its process died of SIGABRT" in done.stdout
    assert "FAIL" not in done.stdout and "rule " not in done.stdout.split("gpu_check: PASSED")[1]
    report = json.loads((out / "gpu_check.json").read_text())  # the versions said first, and recorded
    assert done.stdout.splitlines()[0] == report["versions"]["line"]
    assert report["versions"]["line"].startswith(f"gpu_check: runs jax {jax.__version__}, jaxlib ")


def test_the_first_line_says_which_versions_run_and_why_they_are_not_constraints_txts():
    pinned = {"jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda12-plugin": "0.10.2"}
    assert versions_line(pinned, pinned, {}) == (
        "gpu_check: runs jax 0.10.2, jaxlib 0.10.2, jax-cuda12-plugin 0.10.2, as constraints.txt pins them"
    )
    h200 = {"jax": "0.11.2", "jaxlib": "0.11.2", "jax-cuda13-plugin": "0.11.2"}
    why = "the lent H200 has jax 0.11.2 with CUDA 13 and no network"
    assert versions_line(h200, pinned, {"flax": ("0.12.8", "0.12.12")}, why) == (
        "gpu_check: runs jax 0.11.2, jaxlib 0.11.2, jax-cuda13-plugin 0.11.2; constraints.txt pins jax "
        f"0.10.2, jaxlib 0.10.2, jax-cuda12-plugin 0.10.2: {why}; also flax 0.12.12 (pinned 0.12.8)"
    )
    said = "these are the versions installed here (pip install -c constraints.txt -e '.[cuda12]' installs"
    assert versions_line(h200, pinned, {}).endswith(f": {said} constraints.txt's)")
    cpu = {"jax": "0.10.2", "jaxlib": "0.10.2"}
    assert versions_line(cpu, pinned, {}) == (
        "gpu_check: runs jax 0.10.2, jaxlib 0.10.2; constraints.txt pins jax-cuda12-plugin 0.10.2: no CUDA "
        "plugin is installed here (jax runs on the CPU)"
    )


def test_the_bench_is_judged_by_its_rules():
    """A run bench_gpu.py refused for its timed window breaks bench.window, one that did not finish
    bench.finished, a rate past the peak bench.under_peak; figures from a good window pass."""
    good = {"tokens_per_sec": 516636.0, "mfu": 0.42, "step_time_s": 1.0148}
    short = {"error": "Traceback ...\nValueError: timed window: step 7 starts +880.0 ms from step 6's end"}
    past = {"tokens_per_sec": 9e5, "mfu": 1.76}  # as the first run's 2-step bench read 124m
    runs = {"124m/auto/none": good, "350m/auto/none": short, "1b/auto/none": {"error": "timed out"}}
    report = {"runs": runs | {"torch/124m": past}}
    judged = judge_bench(report, 0, "")
    assert not judged["passed"] and judged["rules_failed"] == [
        "bench.window",
        "bench.finished",
        "bench.under_peak",
    ]
    assert judged["failed"] == (
        "350m/auto/none: ValueError: timed window: step 7 starts +880.0 ms from step 6's end; "
        "1b/auto/none: timed out; torch/124m: MFU 176% is past the peak"
    )
    assert judge_bench({"runs": {"124m/auto/none": good}}, 0, "") == {
        "passed": True, "runs": {"124m/auto/none": good | {"mem_peak_gb": None, "error": None}}, "failed": "",
        "rules_failed": [],
    }  # fmt: skip


def test_the_docs_give_the_rules_of_the_table_at_its_version():
    """docs/gpu_check.md's rules table names every rule of health/gpu_rules.py, and its version."""
    page = (ROOT / "docs" / "gpu_check.md").read_text()
    assert f"## The pass rules (version {gpu_rules.RULES_VERSION})" in page
    named = set(
        re.findall(r"(?m)^\| `([a-z0-9_.]+)` \|", page.split("## The pass rules")[1].split("\n## ")[0])
    )
    assert named == set(gpu_rules.RULES)
