"""The GPU check behind scripts/gpu_check.py: does jaxtrain run on this machine's GPU, kernel by
kernel and step by step, within a time budget (its docstring is the usage; docs/gpu_check.md).

Stages run in order of importance (device, kernels, train, bench), each in processes of its own
(health/gpu_stages.py) with a time limit, so an abort or a hang in one costs only that part: the
stage goes on from its next part in a new process. The JSON report is rewritten after every
stage, so a run killed from outside still leaves what was measured; the summary table comes last
on stdout. This process never starts a jax backend: the stages hold the devices one at a time.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxtrain import versions as versions_lib
from jaxtrain.errors import ArgumentError
from jaxtrain.health import gpu_rules
from jaxtrain.health.gpu_rules import FP8_RUNS, LATE_STEPS, RULES_VERSION
from jaxtrain.health.gpu_stages import PART_MARK, ROOT, TRAIN_RUNS
from jaxtrain.parser import Parser

STAGES = ("device", "kernels", "train", "bench")
STAGE_LIMIT_S = {"device": 120, "kernels": 240, "train": 330, "bench": 420}
PART_LIMIT_S = {"device": 90, "kernels": 150, "train": 240, "bench": 420}  # then the part counts as hung
MIN_START_S = 20  # a stage starts only with this much of the budget left
REPORT = "gpu_check.json"
# The rule a failed part of a stage broke, where its judge names none (health/gpu_rules.py).
STAGE_RULE = {"device": "part.ran", "kernels": "kernels.within_tolerance", "train": "part.ran",
              "bench": "bench.finished"}  # fmt: skip


@dataclass(frozen=True)
class Options:
    out: Path
    budget_s: float
    stages: tuple[str, ...]
    train_steps: int
    train_runs: tuple[str, ...]
    work: str
    versions_why: str


def parse_args(argv: list[str], usage: str = "") -> tuple[Options, argparse.Namespace]:
    """The flags: the options, and the child's (a stage's process: --child STAGE)."""
    p = Parser(description=usage, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json and the stages' logs")
    p.add_argument("--budget_s", type=float, default=540, help="no stage starts past this many seconds")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    p.add_argument("--train_steps", type=int, default=20)
    p.add_argument(
        "--train_runs", default="", help="comma-separated train runs (default: all of the platform's)"
    )
    p.add_argument("--work", default="", help="folder for run dirs and caches (default: a temp dir)")
    p.add_argument(
        "--versions_why",
        default="",
        help="why jax's versions here are not constraints.txt's (the first line)",
    )
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--skip", default="[]", help=argparse.SUPPRESS)  # JSON: parts done (names hold commas)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    stages = tuple(s for s in args.stages.split(",") if s)
    wrong = sorted(set(stages) - set(STAGES))
    if wrong or not stages:
        raise ArgumentError(f"--stages {args.stages}: choose among {','.join(STAGES)}")
    runs = tuple(r for r in args.train_runs.split(",") if r)
    known = {name for platform in TRAIN_RUNS.values() for name in platform}
    if set(runs) - known:
        raise ArgumentError(f"--train_runs: no run {sorted(set(runs) - known)}; choose among {sorted(known)}")
    if args.budget_s <= 0 or args.train_steps < 1:
        raise ArgumentError("--budget_s and --train_steps must be positive")
    opts = Options(Path(args.out), args.budget_s, tuple(s for s in STAGES if s in stages), args.train_steps,
                   runs, args.work, args.versions_why)  # fmt: skip
    return opts, args


def main(argv: list[str], usage: str = "") -> int:
    """Exit code: 0 every stage asked for passed, 1 one did not; bad arguments raise ArgumentError."""
    opts, args = parse_args(argv, usage)
    if args.child:
        from jaxtrain.health import gpu_stages

        gpu_stages.run_stage(
            args.child, Path(args.work), json.loads(args.options), set(json.loads(args.skip))
        )
        return 0
    versions = running_versions(opts.versions_why)
    print(versions["line"], flush=True)  # the first line: what runs, and why if not what CI tests
    opts.out.mkdir(parents=True, exist_ok=True)
    work = Path(opts.work or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + opts.budget_s
    report: dict[str, Any] = {"argv": argv, "budget_s": opts.budget_s, "work": str(work),
                              "versions": versions, "rules_version": RULES_VERSION,
                              "rules": gpu_rules.record(), "stages": {}}  # fmt: skip
    platform = ""
    for stage in opts.stages:
        left = deadline - time.time()
        if left < MIN_START_S:
            report["stages"][stage] = {
                "status": "skipped",
                "seconds": 0,
                "summary": f"failed: not started, {left:.0f} s of budget left (rule part.ran)",
                "rules_failed": ["part.ran"],
            }
            continue
        if stage in ("train", "bench") and not platform:
            platform = _probe_platform(work)  # they start processes that hold the devices
        options = {"platform": platform, "train_steps": opts.train_steps, "train_runs": opts.train_runs,
                   "out": str(opts.out), "deadline": min(deadline, time.time() + STAGE_LIMIT_S[stage]),
                   "run_timeout_s": PART_LIMIT_S["train"] - 10}  # fmt: skip
        result = run_stage(stage, opts.out, work, options)
        if stage == "device":
            devices = result["parts"].get("versions", {}).get("devices") or [{}]
            platform = devices[0].get("platform", "")
        if stage == "train":
            judge_train(result, TRAIN_RUNS["cpu" if platform == "cpu" else "gpu"])
        name_rules(stage, result)
        result["summary"] = result.get("summary") or summary(stage, result)
        report["stages"][stage] = result
        _write(opts.out / REPORT, report)
    report["passed"] = all(s["status"] == "passed" for s in report["stages"].values())
    _write(opts.out / REPORT, report)
    print(table(report), flush=True)
    return 0 if report["passed"] else 1


def running_versions(why: str = "") -> dict[str, Any]:
    """The versions of jax, jaxlib and the CUDA plugins installed, constraints.txt's, and the line
    saying which run and, where they are not constraints.txt's, why (`why`, else that they are
    what is installed here). Read from the packages' metadata: no backend starts."""
    pinned = versions_lib.tested()
    names = {d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions()}
    stack = ["jax", "jaxlib", *sorted(n for n in names if re.fullmatch(r"jax-cuda\d+-(plugin|pjrt)", n))]
    running = {n: importlib.metadata.version(n) for n in stack if n in names}
    want = {n: v for n, v in pinned.items() if n in ("jax", "jaxlib") or n.startswith("jax-cuda")}
    others = {n: (v, got) for n, (v, got) in versions_lib.untested(pinned).items() if n not in want}
    return {"running": running, "constraints": want, "others_untested": others, "why": why,
            "line": versions_line(running, want, others, why)}  # fmt: skip


def versions_line(
    running: dict[str, str], want: dict[str, str], others: dict[str, tuple[str, str]], why: str = ""
) -> str:
    """'gpu_check: runs jax 0.11.2, ...; constraints.txt pins jax 0.10.2, ...: <why>' (by default:
    no CUDA plugin here, or these are what is installed), or '..., as constraints.txt pins them';
    then other pinned packages at other versions."""
    line = "gpu_check: runs " + (", ".join(f"{n} {v}" for n, v in running.items()) or "no jax")
    differ = [f"{n} {v}" for n, v in want.items() if running.get(n) != v]
    plugin = any(n.startswith("jax-cuda") for n in running)
    reason = why or (
        "these are the versions installed here (pip install -c constraints.txt -e '.[cuda12]' installs "
        "constraints.txt's)" if plugin else "no CUDA plugin is installed here (jax runs on the CPU)"
    )  # fmt: skip
    line += (
        f"; constraints.txt pins {', '.join(differ)}: {reason}"
        if differ
        else ", as constraints.txt pins them"
    )
    if others:
        line += "; also " + ", ".join(f"{n} {got} (pinned {v})" for n, (v, got) in sorted(others.items()))
    return line


def _env(work: Path) -> dict[str, str]:
    """The stages' environment: this repo first on the path, caches (datasets, compiled steps) in
    `work`, so a cache from an earlier run hides no compile; a process killed by a signal prints
    its Python stack (which kernel) to its log."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
            "XDG_CACHE_HOME": str(work / "cache"), "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1"}  # fmt: skip


def _probe_platform(work: Path) -> str:
    code = "import jax; print(jax.devices()[0].platform)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(work), capture_output=True, text=True, timeout=120
    )
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else "gpu"


def run_stage(stage: str, out: Path, work: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Run a stage's parts in processes until each has a result or the stage's time is up. A part
    that kills its process or outlives PART_LIMIT_S fails, naming how; the next process skips it."""
    t0 = time.time()
    progress = work / f"{stage}.jsonl"  # each process's own: it announces the parts again
    parts: list[str] | None = None
    seen: list[str] = []  # the parts that are observations, not checks (as the stage announced them)
    results: dict[str, dict[str, Any]] = {}
    error = ""
    with (out / f"{stage}.log").open("a") as log:
        while parts is None or len(results) < len(parts):
            if time.time() > options["deadline"] - 5:
                error = f"out of time after {time.time() - t0:.0f} s"
                break
            cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out),
                   "--child", stage, "--work", str(work), "--skip", json.dumps(list(results)),
                   "--options", json.dumps(options)]  # fmt: skip
            progress.unlink(missing_ok=True)
            start = (out / f"{stage}.log").stat().st_size
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(work), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            ended = _watch(proc, progress, options["deadline"], PART_LIMIT_S[stage])
            events = _events(progress)
            parts = next((e["parts"] for e in reversed(events) if "parts" in e), parts)
            seen = next((e.get("observations", []) for e in reversed(events) if "parts" in e), seen)
            results.update({e["part"]: e["result"] for e in events if "result" in e})
            if ended == "exited" and proc.returncode == 0:
                break
            running, how = _running(events, results), _how(ended, proc.returncode)
            note = _note(out / f"{stage}.log", start)
            if running is None:
                error = f"its process {how} outside any part: {note}"
                break
            began = next(
                (e["start"] for e in events if e.get("part") == running and "start" in e), time.time()
            )
            results[running] = {"passed": False, "failed": f"its process {how} in it: {note}",
                                "seconds": round(time.time() - began, 1),
                                "rules_failed": [] if running in seen else ["part.ran"]}  # fmt: skip
    _cap(out / f"{stage}.log")
    parts = parts or []
    # An observation is no check (rule kernels.observations): recorded apart, never judged or
    # counted among the checks, whether it ran, failed or was not reached.
    missing = [p for p in parts if p not in results and p not in seen]
    checks = {name: r for name, r in results.items() if name not in seen}
    observed = {name: r for name, r in results.items() if name in seen}
    passed = bool(checks) and not missing and not error and all(r.get("passed") for r in checks.values())
    return {"status": "passed" if passed else "failed", "seconds": round(time.time() - t0, 1),
            "parts": checks, "observations": observed, "not_run": missing, "error": error}  # fmt: skip


def _watch(proc: subprocess.Popen, progress: Path, deadline: float, part_limit: float) -> str:
    """Wait for the stage's process: 'exited', or 'hung' (a part past part_limit) or 'timed out'
    (the stage's deadline), after killing its process group."""
    while proc.poll() is None:
        events = _events(progress)
        started = next((e["start"] for e in reversed(events) if "start" in e), None)
        running = _running(events, {e["part"]: e for e in events if "result" in e})
        why = "timed out" if time.time() > deadline else ""
        if running is not None and started is not None and time.time() - started > part_limit:
            why = "hung"
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return why
        time.sleep(0.5)
    return "exited"


def _events(progress: Path) -> list[dict[str, Any]]:
    if not progress.exists():
        return []
    lines = progress.read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip().endswith("}")]  # a line being written is left


def _running(events: list[dict[str, Any]], results: dict[str, Any]) -> str | None:
    """The part the process last started and gave no result for."""
    last = next((e["part"] for e in reversed(events) if "start" in e), None)
    return last if last is not None and last not in results else None


def _how(ended: str, returncode: int | None) -> str:
    if ended != "exited":
        return ended
    if returncode is not None and returncode < 0:
        return f"died of {signal.Signals(-returncode).name}"
    return f"exited {returncode}"


def _note(log: Path, start: int) -> str:
    """What a process that died or hung printed in its last part (the log from byte `start`): its
    last lines before a signal handler's dump, and the innermost Python frame of that dump."""
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace").rsplit(PART_MARK, 1)[-1]
    said, *dump = re.split(r"\*\*\* SIG|Fatal Python error", text, maxsplit=1)
    lines = [x.strip() for x in said.splitlines()[1:] if x.strip()]
    frame = re.search(r'File "([^"]+)", line (\d+) in (\S+)', "".join(dump))
    where = [f"at {Path(frame[1]).name}:{frame[2]} in {frame[3]}"] if frame else []
    return " | ".join(lines[-3:] + where)[-600:] or "nothing printed"


def _cap(log: Path, keep: int = 4 * 2**20) -> None:
    """Keep a log's last `keep` bytes: a GPU machine sends back files of at most 16 MiB (a failed
    Mosaic compile can print its whole module)."""
    if log.exists() and log.stat().st_size > keep:
        with log.open("rb") as f:
            f.seek(-keep, os.SEEK_END)
            tail = f.read()
        log.write_bytes(b"[... cut ...]\n" + tail)


def _write(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------------------- judges


def judge_train(stage: dict[str, Any], runs: dict[str, tuple[str, list[str]]]) -> None:
    """Each run against its reference run by the train rules (health/gpu_rules.py): its first loss
    and the mean of its last LATE_STEPS (the worst step's difference recorded beside, not judged),
    and every run's peak bytes in use against its compiled step's (where the device says: GPUs).
    Adds the figures, the verdict and the rules broken to each run's result, and to the stage's."""
    parts = stage["parts"]
    for name, result in parts.items():
        broken = list(result.get("rules_failed", []))
        failed = [result["failed"]] if result.get("failed") else []
        ratio = result.get("memory_ratio")
        if ratio is not None and abs(ratio - 1) > gpu_rules.threshold("train.memory"):
            failed.append(f"peak memory {ratio:.2f} x the compiled step's")
            broken.append("train.memory")
        reference = runs.get(name, ("", []))[0]
        if reference and result.get("losses"):
            want = parts.get(reference, {}).get("losses")
            if not want:
                failed.append(f"no losses of its reference {reference}")
                broken.append("part.ran")
            else:
                said, rules = _judge_losses(result, result["losses"], want, reference, name in FP8_RUNS)
                failed, broken = failed + said, broken + rules
        result["passed"], result["failed"] = not failed, "; ".join(failed)
        result["rules_failed"] = list(dict.fromkeys(broken)) or (["part.ran"] if failed else [])
    if any(not r["passed"] for r in parts.values()):
        stage["status"] = "failed"


def _judge_losses(
    result: dict[str, Any], got: list[float], want: list[float], reference: str, fp8: bool
) -> tuple[list[str], list[str]]:
    """What is wrong with a run's losses `got` against its reference's `want`, and the rules broken
    (figures into `result`); `fp8`: an FP8 run against bf16, held by the fp8 rules."""
    pairs = [(a, b) for a, b in zip(got, want, strict=True) if a and b]
    if not pairs:
        return [f"no losses to compare with {reference}'s"], ["train.finite"]
    late = pairs[-LATE_STEPS:]
    first = abs(pairs[0][0] / pairs[0][1] - 1)
    change = sum(a for a, _ in late) / sum(b for _, b in late) - 1
    result["loss_vs_reference"] = max(abs(a / b - 1) for a, b in pairs)  # the worst step: a figure
    result["first_loss_vs_reference"], result["late_mean_vs_reference"] = first, abs(change)
    result["late_mean_change"] = change  # signed: below the reference's is negative
    first_rule, late_rule = ("train.fp8_first_step", "train.fp8_late_mean") if fp8 else (
        "train.first_step", "train.late_mean")  # fmt: skip
    failed, broken = [], []
    if not first <= gpu_rules.threshold(first_rule):
        failed.append(f"first loss {first:.2%} off {reference}'s")
        broken.append(first_rule)
    if fp8 and not change <= gpu_rules.threshold(late_rule):
        failed.append(f"last {len(late)} losses' mean {change:.2%} above {reference}'s")
        broken.append(late_rule)
    elif not fp8 and not abs(change) <= gpu_rules.threshold(late_rule):
        failed.append(f"last {len(late)} losses' mean {abs(change):.2%} off {reference}'s")
        broken.append(late_rule)
    return failed, broken


def name_rules(stage: str, result: dict[str, Any]) -> None:
    """Each failed part of a stage names the rules it broke (its judge's, else the stage's rule)."""
    for part in result["parts"].values():
        if not part.get("passed") and not part.get("rules_failed"):
            part["rules_failed"] = [STAGE_RULE[stage]]
    broken = [r for p in result["parts"].values() for r in p.get("rules_failed", []) if not p.get("passed")]
    if result.get("error") or result.get("not_run"):
        broken.append("part.ran")
    result["rules_failed"] = list(dict.fromkeys(broken))


def summary(stage: str, result: dict[str, Any]) -> str:
    """The stage's one line for the table: 'failed (rules ...): ' and its first failure where it
    failed, else its figures or its count of checks passed."""
    parts = result["parts"]
    bad = [f"{name}: {r.get('failed')}" for name, r in parts.items() if not r.get("passed")]
    if result.get("error"):
        bad.insert(0, result["error"])
    bad += [f"{name}: not run" for name in result.get("not_run", [])]
    line = f"{sum(bool(r.get('passed')) for r in parts.values())}/{len(parts)} checks passed"
    if result.get("observations"):
        line += f" ({len(result['observations'])} observations recorded, not judged)"
    if stage == "device" and "versions" in parts:
        v = parts["versions"]
        d = (v.get("devices") or [{}])[0]
        rate, copy = (
            parts.get("matmul", {}).get("tflops"),
            parts.get("copy", {}).get("tb_per_s_read_and_written"),
        )
        fp8 = parts.get("fp8_matmul", {}).get("gemm_tflops")
        figures = [f"{len(v.get('devices') or [])} x {d.get('kind')} cc {d.get('compute_capability') or '-'}",
                   f"jax {v['versions'].get('jax')}", f"bf16 matmul {rate:.3g} TFLOP/s" if rate else "",
                   f"FP8 {fp8:.3g}" if fp8 else "", f"copy {copy:.3g} TB/s" if copy else ""]  # fmt: skip
        line = ", ".join(f for f in figures if f)
    if result["status"] == "passed":
        return line
    rules = ", ".join(result.get("rules_failed", [])) or "part.ran"
    return f"failed (rule {rules}): {bad[0] if bad else line}"


def table(report: dict[str, Any]) -> str:
    """The summary for people: the verdict and the rules' version, one row per stage, each part's
    line, then each rule broken in the words of the report's rules (health/gpu_rules.py)."""
    rules = report["rules"]
    rows = [
        "",
        f"gpu_check: {'PASSED' if report.get('passed') else 'FAILED'}, judged by rules v{rules['version']} "
        f"({rules['source']})",
        f"{'stage':<9}{'status':<9}{'s':>6}  summary",
    ]
    for stage, r in report["stages"].items():
        rows.append(f"{stage:<9}{r['status']:<9}{r['seconds']:>6.0f}  {r.get('summary', '')[:300]}")
    for stage, r in report["stages"].items():
        for name, part in r.get("parts", {}).items():
            rows.append(
                f"  {stage:<8}{'pass' if part.get('passed') else 'FAIL':<5} {name}  {_figures(part)}"[:400]
            )
        rows += [f"  {stage:<8}NOT RUN {name}" for name in r.get("not_run", [])]
    for stage, r in report["stages"].items():  # no checks: what they measured, no verdict
        rows += [
            f"  {stage:<8}seen  {name}  {_figures(part)}"[:400]
            for name, part in r.get("observations", {}).items()
        ]
    broken = dict.fromkeys(x for r in report["stages"].values() for x in r.get("rules_failed", []))
    rows += [f"  rule {name} broken: {rules['rules'][name]['says']}" for name in broken]
    return "\n".join(rows)


def _figures(part: dict[str, Any]) -> str:
    shown = []
    if part.get("max_error") is not None:
        shown.append(f"max error {part['max_error']:.1e}")
    if part.get("loss_vs_reference") is not None:
        shown.append(f"loss {part['loss_vs_reference']:.2%} off reference")
    if part.get("memory_ratio") is not None:
        gb = f"{part['peak_bytes_in_use'] / 1e9:.2f} of {part['compiled_bytes'] / 1e9:.2f} GB"
        shown.append(f"memory {part['memory_ratio']:.2f} x compiled ({gb})")
    if part.get("losses"):
        shown.append(f"loss {part['losses'][0]:.3f} -> {part['losses'][-1]:.3f}")
    if part.get("runs"):
        shown += [f"{k} {v.get('tokens_per_sec') or 0:,.0f} tok/s" for k, v in part["runs"].items()]
    if part.get("failed"):
        shown.append(str(part["failed"])[:250])
    if part.get("rules_failed") and not part.get("passed"):
        shown.append(f"[rule {', '.join(part['rules_failed'])}]")
    shown.append(f"({part.get('seconds', 0):.1f} s)")
    return "  ".join(shown)
