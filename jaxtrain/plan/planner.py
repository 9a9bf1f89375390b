"""A training job planned for GPUs we do not have: the run training would build, built for a
target's devices, its steps compiled by XLA's GPU compiler and analyzed (jaxtrain/plan/compiled.py).

    targets.use_plugin()                  # before jax starts: this module imports it
    from jaxtrain.plan import planner
    plan = planner.plan_one(cfg, targets.get("h100"), hosts=2, gpus_per_host=8)

`plan_one` is the plan of one job; `fits_with` the nearest settings that fit when it does not;
`search` every mesh and remat setting that fits. scripts/plan.py prints them (jaxtrain/plan/cli.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax

from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.observe.memory import fits
from jaxtrain.plan import compiled as plan
from jaxtrain.plan import targets
from jaxtrain.run import mesh as mesh_lib
from jaxtrain.run.build import Run, build
from jaxtrain.run.job import Job

log = logging.getLogger("jaxtrain")

# What a search keeps of each plan that fits.
SEARCH_KEYS = (
    "total_bytes_per_device", "step_time_lower_bound_s", "mfu_ceiling", "bound_limited_by",
    "schedule_bound_s", "schedule_mfu_ceiling",
)  # fmt: skip


def compile_for(cfg: Config, devices: list[Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The run training would build (jaxtrain/run/build.py), built for `devices`, its steps compiled."""
    run = build(Job.of_devices(cfg, devices))
    t0 = time.perf_counter()
    train_compiled = run.compile_train()
    return train_compiled, run.compile_eval(), _facts(run) | {"compile_s": time.perf_counter() - t0}


def _facts(run: Run) -> dict[str, Any]:
    cfg = run.cfg  # resolved on the devices: mesh, global batch, microbatches
    shards = cfg.mesh.data * cfg.mesh.expert * cfg.mesh.fsdp
    return {
        "cfg": cfg,
        "mesh": mesh_lib.mesh_shape(run.mesh),
        "device_hosts": [d.process_index for d in run.mesh.devices.flat],
        "n_params": run.n_params,
        "model_flops_per_step": run.flops_per_token * cfg.batch_size * cfg.model.seq_len,
        "global_batch": cfg.batch_size,
        "accumulation": cfg.gradient_accumulation_steps,
        "device_batch": cfg.batch_size // cfg.gradient_accumulation_steps // shards,
        "state_bytes": run.state_bytes_per_device,
    }


def _head(f: dict[str, Any], target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> dict[str, Any]:
    return {
        "target": target.name, "device_kind": target.device_kind, "hosts": hosts,
        "gpus_per_host": gpus_per_host, "mesh": f["mesh"], "zero1": f["cfg"].mesh.zero1,
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
    train = run.compile_train()
    evaluate = run.compile_eval()
    facts = plan.Facts(
        target=target, mesh=f["mesh"], hosts=hosts, gpus_per_host=gpus_per_host,
        device_hosts=f["device_hosts"], n_params=f["n_params"],
        model_flops_per_step=f["model_flops_per_step"], dtype=f["cfg"].dtype,
    )  # fmt: skip
    return head | {"compiled": True} | plan.analyze(train, evaluate, facts, time.perf_counter() - t0)


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """cfg with dotted-key overrides (mesh.fsdp, model.remat, device_batch_size, ...)."""
    for key, value in overrides.items():
        if "." in key:
            part, leaf = key.split(".")
            cfg = dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **{leaf: value})})
        else:
            cfg = dataclasses.replace(cfg, **{key: value})
    return cfg


def nearer(cfg: Config, resolved: dict[str, Any], devices: int) -> list[dict[str, Any]]:
    """Settings nearest first: remat, then half the device batch, then twice the fsdp size."""
    out: list[dict[str, Any]] = []
    fsdp = resolved["mesh"]["fsdp"]
    tensor = resolved["mesh"]["tensor"]
    smaller: dict[str, Any] = (
        {"device_batch_size": max(1, resolved["device_batch"] // 2)}
        if cfg.total_batch_size
        else {"gradient_accumulation_steps": resolved["accumulation"] * 2}
    )
    wider = {"mesh.fsdp": min(fsdp * 2, devices // tensor), "mesh.data": -1}
    if cfg.model.remat != "full":
        out.append({"model.remat": "full"})
    if resolved["device_batch"] > 1:  # never advise the batch the job already has
        out += [smaller, {**smaller, "model.remat": "full"}]
    if wider["mesh.fsdp"] > fsdp:
        out += [wider, {**wider, "model.remat": "full"}]
    return out


def _try(cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> tuple[str, dict | None]:
    """Plan one candidate: ("fits" | "does not fit" | why it was not compiled, its plan)."""
    try:
        p = plan_one(cfg, target, hosts, gpus_per_host)
    except (UserError, jax.errors.JaxRuntimeError) as e:  # rejected, or the compiler failed
        return str(e).splitlines()[0], None
    if not p["compiled"]:
        return f"its state alone needs {gb(p['state_bytes_per_device'])}", p
    return ("fits" if p["fits"] else "does not fit"), p


def fits_with(
    cfg: Config, resolved: dict[str, Any], target: targets.GpuTarget, hosts: int, gpus_per_host: int
) -> list[dict[str, Any]]:
    """For a plan that does not fit: the two nearest settings (`nearer`) whose steps fit. A setting
    that leaves the state as large as the state that did not fit is not compiled."""
    found: list[dict[str, Any]] = []
    for overrides in nearer(cfg, resolved, hosts * gpus_per_host):
        if not resolved["compiled"] and not any(k.startswith("mesh.") for k in overrides):
            continue  # remat and batch leave the state as it is
        verdict, p = _try(with_overrides(cfg, overrides), target, hosts, gpus_per_host)
        if verdict == "fits" and p is not None:
            found.append({"overrides": overrides, "total_bytes_per_device": p["total_bytes_per_device"]})
            if len(found) == 2:
                break
    return found


def devices_for_state(p: dict[str, Any]) -> int:
    """The fewest devices (a power of two) whose share of this plan's state fits, fully sharded."""
    shards = p["mesh"]["fsdp"] * p["mesh"]["tensor"]
    total = p["state_bytes_per_device"] * shards
    n = 1
    while not fits(total // n, p["usable_bytes_per_device"]):
        n *= 2
    return n


def search(
    cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int, budget: int
) -> list[dict[str, Any]]:
    """Layouts that fit, fastest schedule-aware bound first. For each tensor size (inside a host,
    largest first), the device batch from the largest (no accumulation: the fewest gathers per
    step) down; at each, the narrowest fsdp that fits (bisected: memory falls as fsdp grows; data
    fills the rest); then less remat where it still fits. A layout whose state alone cannot fit is
    passed over without a compile; at most `budget` compiles. Prints a line per setting as it goes."""
    devices = hosts * gpus_per_host
    rows = cfg.total_batch_size // cfg.model.seq_len if cfg.total_batch_size else cfg.batch_size
    powers = [2**i for i in range(devices.bit_length()) if devices % 2**i == 0]
    results: list[dict[str, Any]] = []
    compiles = 0

    def attempt(o: dict[str, Any]) -> str:
        nonlocal compiles
        verdict, p = _try(with_overrides(cfg, o), target, hosts, gpus_per_host)
        compiles += p is not None and p["compiled"]
        shown = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in o.items() if v != -1)
        line = verdict
        if p is not None and p["compiled"]:
            line += f", {gb(p['total_bytes_per_device'])}, floor {p['step_time_lower_bound_s']:.3g} s, "
            line += (
                f"schedule-aware {p['schedule_bound_s']:.3g} s ({100 * p['schedule_mfu_ceiling']:.0f}% MFU)"
            )
        print(f"  {shown}: {line}", flush=True)
        if verdict == "fits" and p is not None:
            results.append({"overrides": o, **{k: p[k] for k in SEARCH_KEYS}})
        return verdict

    for tensor in sorted((n for n in powers if n <= gpus_per_host), reverse=True):
        shards = devices // tensor  # data x fsdp: the batch is split over them
        if rows % shards:
            print(f"  tensor {tensor}: {rows} sequences do not split over {shards} batch shards")
            continue
        fsdps = [n for n in powers if n * tensor <= devices]
        for b in [b for b in powers if (rows // shards) % b == 0][::-1]:
            batch = {"device_batch_size": b} if cfg.total_batch_size else {
                "gradient_accumulation_steps": rows // shards // b}  # fmt: skip
            # Memory falls as fsdp grows: bisect for the narrowest fsdp that fits (fewest compiles).
            lo, hi, found = 0, len(fsdps) - 1, None
            while lo <= hi:
                if compiles >= budget:
                    print(f"  (search stopped after {budget} compiles: --search_budget)")
                    return sorted(results, key=lambda r: r["schedule_bound_s"])
                mid = (lo + hi) // 2
                o = {
                    "mesh.data": -1,
                    "mesh.fsdp": fsdps[mid],
                    "mesh.tensor": tensor,
                    **batch,
                    "model.remat": "full",
                }
                verdict = attempt(o)
                if verdict == "fits":
                    found, hi = o, mid - 1
                elif verdict == "does not fit" or verdict.startswith("its state alone"):
                    lo = mid + 1
                else:  # rejected by the config (heads not divisible by tensor, ...): next tensor
                    lo, hi = 1, 0
            if found is not None:
                for remat in ("dots", "none"):  # less recomputation, where memory allows
                    if compiles >= budget or attempt({**found, "model.remat": remat}) != "fits":
                        break
                break  # the largest device batch that fits: the fewest gathers per step
    return sorted(results, key=lambda r: r["schedule_bound_s"])


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def print_plan(p: dict[str, Any]) -> None:
    """The plan as a table, its collectives and its bounds."""
    mesh = " x ".join(f"{a} {n}" for a, n in p["mesh"].items())
    head = [
        ("target", f"{p['hosts']} x {p['gpus_per_host']} {p['device_kind']}"),
        ("mesh", mesh + (" + zero1" if p["zero1"] else "")),
        ("batch", f"global {p['global_batch']} x {p['seq_len']}, {p['accumulation']} microbatch(es) of "
                  f"{p['device_batch']} per device; {p['dtype']}, remat {p['remat']}"),
        ("params", f"{p['n_params']:,}"),
    ]  # fmt: skip
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
        ("usable / device", f"{gb(p['usable_bytes_per_device'])} of {gb(p['device_memory_bytes'])}: "
                            + ("FITS" if p["fits"] else "DOES NOT FIT")),
        ("attention", p["attention"]),
        ("compile", f"{p['compile_s']:.1f} s"),
    ]  # fmt: skip
    for k, v in rows:
        print(f"{k:<26}{v}")
    print("collectives per optimizer step (bytes: per-device buffers; sent: an ideal ring's, per device):")
    for c in p["collectives"]:
        where = "crosses hosts" if c["crosses_hosts"] else "inside a host"
        sent = gb(c["network_bytes"] if c["crosses_hosts"] else c["nvlink_bytes"])
        size = gb(c["bytes"])
        print(f"  {c['kind']:<19} over {c['axis']:<12} x{c['count']:<5} {size:>10}  sent {sent:>10}  {where}")
    terms = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p["bound_terms_s"].items())
    bound, limit = p["step_time_lower_bound_s"] * 1e3, p["bound_limited_by"]
    print(f"step time lower bound     {bound:.1f} ms ({limit}-bound, all overlapped; {terms})")
    ops, exposed = p["schedule_busy_s"] * 1e3, p["exposed_comm_s"] * 1e3
    print(f"schedule-aware bound      {p['schedule_bound_s'] * 1e3:.1f} ms (the compiled order replayed: "
          f"ops {ops:.1f} ms, communication left exposed {exposed:.1f} ms)")  # fmt: skip
    print(f"MFU ceiling               {100 * p['mfu_ceiling']:.1f}% from the floor, "
          f"{100 * p['schedule_mfu_ceiling']:.1f}% from the schedule (ceilings, no predictions)")  # fmt: skip


def print_fixes(p: dict[str, Any], tried: list[dict[str, Any]]) -> None:
    """What fits when `p` does not (its `fits_with`), and a search's results, fastest first."""
    if not p["fits"]:
        fixes = [" ".join(f"--{k} {v}" for k, v in f["overrides"].items()) for f in p.get("fits_with", [])]
        if fixes:
            print("fits with: " + "; ".join(fixes))
        elif not p["compiled"]:
            n = devices_for_state(p)
            print(f"fits with: none on {p['hosts']} x {p['gpus_per_host']} GPUs; its state alone needs "
                  f"{n} or more (--mesh.fsdp {n} on --hosts x --gpus_per_host >= {n})")  # fmt: skip
        else:
            print(f"fits with: none of {tried}")


def print_search(found: list[dict[str, Any]]) -> None:
    """A search's layouts that fit, fastest schedule-aware bound first."""
    if found:
        print("layouts that fit, fastest first:")
    for r in found:
        flags = " ".join(f"--{k} {v}" for k, v in r["overrides"].items())
        sched, floor = r["schedule_bound_s"] * 1e3, r["step_time_lower_bound_s"] * 1e3
        ceiling, floor_ceiling = 100 * r["schedule_mfu_ceiling"], 100 * r["mfu_ceiling"]
        size = gb(r["total_bytes_per_device"])
        print(f"  {flags}: schedule-aware {sched:.1f} ms (MFU ceiling {ceiling:.1f}%), "
              f"floor {floor:.1f} ms ({floor_ceiling:.1f}%), {size}")  # fmt: skip
