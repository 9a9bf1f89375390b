"""A training job planned for GPUs we do not have: the run training would build, built for a
target's devices, its steps compiled by XLA's GPU compiler and analyzed (jaxtrain/plan/compiled.py).

    targets.use_plugin()                  # before jax starts: this module imports it
    from jaxtrain.plan import planner
    plan = planner.plan_one(cfg, targets.get("h100"), hosts=2, gpus_per_host=8)

`plan_one` is the plan of one job, `print_plan` prints it; jaxtrain/plan/advice.py says what fits
when it does not and searches the layouts; scripts/plan.py prints them (jaxtrain/plan/cli.py).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import jax

from jaxtrain.config import Config
from jaxtrain.config.checks import mesh_str
from jaxtrain.errors import UserError
from jaxtrain.observe import gemms, links
from jaxtrain.observe.memory import fits
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline
from jaxtrain.plan import compiled as plan
from jaxtrain.plan import forecast, targets
from jaxtrain.run.build import Run, build
from jaxtrain.run.job import Job

log = logging.getLogger("jaxtrain")
_WARNED: set[str] = set()


def _facts(run: Run) -> dict[str, Any]:
    cfg = run.cfg  # resolved on the devices: mesh, global batch, microbatches
    shards = cfg.mesh.data * cfg.mesh.expert * cfg.mesh.fsdp
    return {
        "cfg": cfg,
        "mesh": mesh_lib.mesh_shape(run.mesh),
        "device_hosts": [d.process_index for d in run.mesh.devices.flat],
        "expert_inner": mesh_lib.expert_inner(run.mesh),
        "n_params": run.n_params,
        "model_flops_per_step": run.flops_per_token * cfg.batch_size * cfg.model.seq_len,
        "global_batch": cfg.batch_size,
        "accumulation": cfg.gradient_accumulation_steps,
        "device_batch": cfg.batch_size // cfg.gradient_accumulation_steps // shards,
        "state_bytes": run.state_bytes_per_device,
    }


def _head(f: dict[str, Any], target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> dict[str, Any]:
    stages = f["cfg"].mesh.pipeline  # the share of a stage's ticks that run on zeros (parallel/pipeline.py)
    bubble = {"pipeline_bubble": pipeline.bubble(stages, f["accumulation"])} if stages > 1 else {}
    return bubble | {
        "target": target.name, "device_kind": target.device_kind, "hosts": hosts,
        "gpus_per_host": gpus_per_host, "mesh": f["mesh"], "zero1": f["cfg"].mesh.zero1,
        **({"expert_inner": True} if f["expert_inner"] else {}),
        "dtype": f["cfg"].dtype, "remat": f["cfg"].model.remat, "global_batch": f["global_batch"],
        "device_batch": f["device_batch"], "accumulation": f["accumulation"],
        "seq_len": f["cfg"].model.seq_len, "n_params": f["n_params"],
    }  # fmt: skip


def plan_one(cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> dict[str, Any]:
    """The plan (jaxtrain/plan/compiled.py: analyze) of `cfg` on hosts x gpus_per_host of `target`.

    A job whose train state alone (params, optimizer moments: known from shapes, no compile)
    exceeds a device's usable memory gets its verdict at once, uncompiled: compiling a model that
    size takes minutes and could only say the same.
    """
    devices = targets.target_devices(target, hosts, gpus_per_host)
    run = build(Job.of_devices(cfg, devices))
    for warning in mesh_lib.host_warnings(run.mesh):  # what training's log would say at start
        if warning not in _WARNED:  # once: a search plans many layouts with the same warning
            _WARNED.add(warning)
            log.warning(warning)
    f = _facts(run)
    head = _head(f, target, hosts, gpus_per_host)
    limit = plan.usable_bytes(target)
    if not fits(f["state_bytes"], limit):
        return head | {
            "compiled": False, "fits": False, "state_bytes_per_device": f["state_bytes"],
            "usable_bytes_per_device": limit, "device_memory_bytes": target.memory_bytes,
        }  # fmt: skip
    t0 = time.perf_counter()
    with targets.cudnn_gates(target):
        train = run.compile_train()
        evaluate = run.compile_eval()
    facts = plan.Facts(
        target=target, mesh=f["mesh"], hosts=hosts, gpus_per_host=gpus_per_host,
        device_hosts=f["device_hosts"], n_params=f["n_params"],
        model_flops_per_step=f["model_flops_per_step"], dtype=f["cfg"].dtype,
        tokens_per_step=f["global_batch"] * f["cfg"].model.seq_len,
        expert_load=links.expert_load(f["cfg"].model.moe.capacity_factor, f["cfg"].model.moe.n_experts),
        wide=links.widen(f["cfg"].model.moe.capacity_factor, run.mesh.shape[mesh_lib.EXPERT_AXIS]),
    )  # fmt: skip
    analyzed = plan.analyze(train, evaluate, facts, time.perf_counter() - t0)
    # The train step's GEMMs by kind, as the job's start counts them (an FP8 one that did not
    # become an FP8 GEMM was refused there: run/build.py compile_train, observe/gemms.py)
    return head | {"compiled": True} | analyzed | {"gemms": gemms.counts(gemms.census(train.as_text() or ""))}


class Refused(UserError):
    """A layout whose program XLA refuses to compile, or aborts on; `reason`: why, without the
    layout (a search's line names it already)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


_CHILD: dict[str, Any] = {}  # the one child process that compiles plans: its pool and stderr file


def layout(cfg: Config, hosts: int, gpus_per_host: int) -> str:
    """The layout a plan is of, in words: its mesh (-1: the devices left) on its GPUs."""
    mesh = mesh_str(
        {a: getattr(cfg.mesh, a) for a in ("pipeline", "data", "expert", "fsdp", "context", "tensor")}
    )
    return f"mesh {mesh}{' + zero1' if cfg.mesh.zero1 else ''} on {hosts} x {gpus_per_host} GPUs"


def plan_guarded(cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> dict[str, Any]:
    """`plan_one` in a child process (`in_child`), so that a program XLA refuses, even by aborting
    its process (a `Check failed` in its SPMD partitioner, exit 134), is a Refused naming the
    layout, never a dead planner. The child's new host warnings are logged here, once."""
    what = f"compiling the {layout(cfg, hosts, gpus_per_host)}"
    verdict, value, warnings = in_child(_in_child, cfg, target, hosts, gpus_per_host, what=what)
    for warning in warnings:
        if warning not in _WARNED:
            _WARNED.add(warning)
            log.warning(warning)
    if verdict != "plan":
        raise Refused(value)
    return value


def in_child(fn: Any, *args: Any, what: str) -> Any:
    """fn(*args) in the child process that compiles plans: one serves every call of this process
    (jax and the plugin load once, a fresh interpreter: jax is not fork-safe), and one that died
    is started again for the next call. Its death is a Refused naming `what` and XLA's last word.
    Spawning re-runs the caller's main module in the child before the plugin is put on its path,
    so that module imports jax only under `if __name__ == "__main__"` (scripts/plan.py does)."""
    if "pool" not in _CHILD:
        stderr = tempfile.NamedTemporaryFile(prefix="jaxtrain-plan-", suffix=".log", delete=False).name
        atexit.register(_remove, stderr)
        spawn = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(
            1, mp_context=spawn, initializer=targets.start_child, initargs=(stderr, os.getpid())
        )
        _CHILD.update(pool=pool, stderr=stderr)
    try:
        return _CHILD["pool"].submit(fn, *args).result()
    except BrokenProcessPool:
        _CHILD.pop("pool").shutdown(wait=False)
        words = last_words(_CHILD["stderr"])
        raise Refused(f"XLA aborted {what}: {words}", f"XLA aborts compiling it: {words}") from None


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def _in_child(
    cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int
) -> tuple[str, Any, list]:
    """plan_guarded's work in the child: ("plan", the plan) or ("refused", one line); its warnings."""
    before = set(_WARNED)
    try:
        return "plan", plan_one(cfg, target, hosts, gpus_per_host), sorted(_WARNED - before)
    except UserError as e:
        return "refused", str(e).splitlines()[0], sorted(_WARNED - before)
    except jax.errors.JaxRuntimeError as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            "refused",
            f"XLA refused the {layout(cfg, hosts, gpus_per_host)}: {why}",
            sorted(_WARNED - before),
        )


def last_words(path: str) -> str:
    """Why a child died, in a few words: where XLA's fatal line (a `Check failed`) stopped it, as its
    source file and line (the check's own text is XLA's internals: logged at debug level), else the
    child's last line."""
    try:
        lines = [line.strip() for line in open(path, errors="replace").read().splitlines() if line.strip()]
    except OSError:
        lines = []
    failed = [line for line in lines if "Check failed" in line or "F0000" in line or "Fatal" in line]
    if failed:
        log.debug(f"XLA's last words: {failed[0]}")
        where = re.search(r"([\w.-]+\.(?:cc|h)):(\d+)\]", failed[0])
        return "an internal check failed" + (f" (XLA's {where[1]}:{where[2]})" if where else "")
    line = (lines[-1:] or ["the compiler's process died without a word"])[0]
    return line[:300] + ("..." if len(line) > 300 else "")


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def print_plan(p: dict[str, Any]) -> None:
    """The plan as a table, its collectives and its bounds."""
    mesh = " x ".join(f"{a} {n}" for a, n in p["mesh"].items()) + (" + zero1" if p["zero1"] else "")
    head = [
        ("target", f"{p['hosts']} x {p['gpus_per_host']} {p['device_kind']}"),
        ("mesh", mesh + (", expert inside fsdp" if p.get("expert_inner") else "")),
        ("batch", f"global {p['global_batch']} x {p['seq_len']}, {p['accumulation']} microbatch(es) of "
                  f"{p['device_batch']} per device; {p['dtype']}, remat {p['remat']}"),
        ("params", f"{p['n_params']:,}"),
    ]  # fmt: skip
    if "pipeline_bubble" in p:
        head.append(("pipeline bubble", f"{100 * p['pipeline_bubble']:.1f}% of each stage's ticks (GPipe)"))
    if not p["compiled"]:
        for k, v in head:
            print(f"{k:<26}{v}")
        state, usable = gb(p["state_bytes_per_device"]), gb(p["usable_bytes_per_device"])
        print(f"{'state / device':<26}{state} (params, optimizer moments) of {usable} usable: DOES NOT FIT")
        print(f"{'':<26}(not compiled: no batch or remat setting makes the state smaller)")
        return
    rows = head + [
        ("state + batch / device", gb(p["state_bytes_per_device"])),
        ("temporaries / device", gb(p["temp_bytes_per_device"])),
        ("total / device", gb(p["total_bytes_per_device"])),
        ("eval step total / device", gb(p["eval_total_bytes_per_device"])),
        ("usable / device", f"{gb(p['usable_bytes_per_device'])} of {gb(p['device_memory_bytes'])}, "
                            f"{gb(p.get('reserve_bytes_per_device', 0))} of it kept for autotuning and "
                            "workspaces: " + ("FITS" if p["fits"] else "DOES NOT FIT")),
        ("attention", p["attention"]),
        *([("GEMMs", gemms.summary(p["gemms"]))] if "gemms" in p else []),
        ("compile", f"{p['compile_s']:.1f} s"),
    ]  # fmt: skip
    for k, v in rows:
        print(f"{k:<26}{v}")
    link = targets.get(p["target"]).link  # inside a host: NVLink, or PCIe (targets.py)
    print("collectives per optimizer step (bytes: per-device buffers; sent: an ideal ring's, per device):")
    for c in p["collectives"]:
        where = "crosses hosts" if c["crosses_hosts"] else f"inside a host ({link})"
        sent = gb(c["network_bytes"] if c["crosses_hosts"] else c["nvlink_bytes"])
        size = gb(c["bytes"])
        print(f"  {c['kind']:<19} over {c['axis']:<12} x{c['count']:<5} {size:>10}  sent {sent:>10}  {where}")
    # The JSON keys the in-host link "nvlink" on every target.
    name = {"nvlink": link, "program": "the program's matmuls"}
    terms = ", ".join(f"{name.get(k, k)} {v * 1e3:.1f} ms" for k, v in p["bound_terms_s"].items())
    bound, limit = p["step_time_lower_bound_s"] * 1e3, name.get(p["bound_limited_by"], p["bound_limited_by"])
    print(f"step time lower bound     {bound:.1f} ms ({limit}-bound, all overlapped; {terms})")
    ops, exposed = p["schedule_busy_s"] * 1e3, p["exposed_comm_s"] * 1e3
    print(f"schedule-aware bound      {p['schedule_bound_s'] * 1e3:.1f} ms (the compiled order replayed: "
          f"ops {ops:.1f} ms, communication left exposed {exposed:.1f} ms)")  # fmt: skip
    print(f"MFU ceiling               {100 * p['mfu_ceiling']:.1f}% from the floor, "
          f"{100 * p['schedule_mfu_ceiling']:.1f}% from the schedule (ceilings, no predictions; against "
          f"the {p.get('mfu_dtype', p['dtype'])} peak)")  # fmt: skip
    if "forecast" in p:
        print_forecast(p)


def size(n: float) -> str:
    """Bytes in the largest unit they fill: 2 B, 134 MB, 8.15 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def forecast_waits(p: dict[str, Any], most: int = 3) -> str:
    """The transfers the forecast's stream waits on longest (its replay again: schedule.Clock.waited),
    by kind and size: where its exposed communication goes. "" for a plan with none. The replay
    knows no mesh axis; the plan's collectives table names them."""
    if "schedule_trace" not in p:
        return ""
    target = targets.get(p["target"])
    peak = targets.peak_flops(target, p["dtype"])
    clock = forecast.forecast(p["schedule_trace"], target, peak, p["forecast"]["expert_load"])
    # The longest, each at least a hundredth of the exposed time (latency-sized waits say nothing)
    waits = [
        w
        for w in sorted(clock.waited.items(), key=lambda item: -item[1][0])
        if w[1][0] >= clock.exposed / 100
    ]
    waits = waits[:most]
    said = [
        f"{ms(seconds)} on {count} {kind}{'s' if count > 1 else ''} of {size(n)}"
        + (" across hosts" if across else "")
        for (kind, n, across), (seconds, count) in waits
    ]
    return ", ".join(said) + f" (of {ms(clock.exposed)} exposed)" if said else ""


def ms(seconds: float) -> str:
    """Milliseconds, a decimal under 10: 778 ms, 2.3 ms."""
    return f"{1e3 * seconds:.0f} ms" if seconds >= 0.01 else f"{1e3 * seconds:.1f} ms"


def recost(p: dict[str, Any], load: float | None = None) -> dict[str, Any]:
    """Plan `p` with its forecast re-costed from its trace (forecast.block) at forecast.py's
    constants as they are now, and at the most loaded expert's `load` where given (a run's measured
    `expert_load_max_mean`, or 1 for routing forced even, as the peers' published runs force it)."""
    target = targets.get(p["target"])
    peak = targets.peak_flops(target, p["dtype"])
    gpus, tokens = p["hosts"] * p["gpus_per_host"], p["global_batch"] * p["seq_len"]
    mfu_peak = targets.peak_flops(target, p.get("mfu_dtype", p["dtype"]))
    load = p["forecast"]["expert_load"] if load is None else load
    events, wide = p["schedule_trace"], p["forecast"].get("exchange", {}).get("wide", 0.0)
    return p | {
        "forecast": forecast.block(
            events, target, peak, load, tokens, gpus, p["model_flops_per_step"], mfu_peak, wide
        )
    }


def print_forecast(p: dict[str, Any]) -> None:
    """The forecast beside the schedule-aware bound, and which is which."""
    f, load = p["forecast"], p["forecast"]["expert_load"]
    rows = [
        ("bound (no run is faster)", p["schedule_bound_s"], p["schedule_tokens_per_s_per_gpu"],
         p["schedule_mfu_ceiling"], ""),
        ("FORECAST (most likely)", f["step_time_s"], f["tokens_per_s_per_gpu"], f["mfu"],
         f"  (most loaded expert {load:g}x an even share)" if load != 1 else ""),
    ]  # fmt: skip
    print(f"{'':<26}{'step':>10} {'tokens/s/GPU':>13} {'MFU':>6}")
    for name, step, tokens, mfu, note in rows:
        print(f"{name:<26}{step:>9.3f}s {tokens:>13,.0f} {100 * mfu:>5.1f}%{note}")
    print(f"{'':<26}the bound: every op at peak, every link at line rate; the forecast: the same "
          "schedule at speeds measured on H100s (jaxtrain/plan/forecast.py), not measured here")  # fmt: skip
    if waits := forecast_waits(p):
        print(f"{'the forecast waits on':<26}{waits}")
    if x := f.get("exchange"):
        print(f"{'the expert exchange':<26}{exchange_line(x)}")


def exchange_line(x: dict[str, Any]) -> str:
    """The plan's expert exchange both ways (forecast.exchanges): the step and one exchange, which
    the program compiled and which auto takes, and why."""
    one = {way: x[f"one_{way}_s"] for way in ("ragged", "padded")}
    slower = max(one, key=one.__getitem__)
    return (
        f"compiled {x['compiled']}; step forecast {x['ragged_s']:.3f} s ragged, {x['padded_s']:.3f} s "
        f"padded; auto takes {x['auto']}: one exchange {ms(one[x['auto']])} against {ms(one[slower])} "
        f"{slower} (observe/links.py)"
    )
