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
import time
from typing import Any

import jax

from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.plan import compiled as plan
from jaxtrain.plan import targets
from jaxtrain.run import mesh as mesh_lib
from jaxtrain.run.build import build
from jaxtrain.run.job import Job

# What a search keeps of each plan that fits.
SEARCH_KEYS = ("total_bytes_per_device", "step_time_lower_bound_s", "mfu_ceiling", "bound_limited_by")


def compile_for(cfg: Config, devices: list[Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The run training would build (jaxtrain/run/build.py), built for `devices`, its steps compiled."""
    run = build(Job.of_devices(cfg, devices))
    cfg = run.cfg  # resolved on the devices: mesh, global batch, microbatches
    t0 = time.perf_counter()
    train_compiled = run.compile_train()
    compile_s = time.perf_counter() - t0
    shards = cfg.mesh.data * cfg.mesh.fsdp
    facts = {
        "cfg": cfg,
        "mesh": mesh_lib.mesh_shape(run.mesh),
        "device_hosts": [d.process_index for d in run.mesh.devices.flat],
        "n_params": run.n_params,
        "model_flops_per_step": run.flops_per_token * cfg.batch_size * cfg.model.seq_len,
        "global_batch": cfg.batch_size,
        "accumulation": cfg.gradient_accumulation_steps,
        "device_batch": cfg.batch_size // cfg.gradient_accumulation_steps // shards,
        "compile_s": compile_s,
    }
    return train_compiled, run.compile_eval(), facts


def plan_one(cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> dict[str, Any]:
    """The plan (jaxtrain/plan/compiled.py: analyze) of `cfg` on hosts x gpus_per_host of `target`."""
    devices = targets.target_devices(target, hosts, gpus_per_host)
    train, evaluate, f = compile_for(cfg, devices)
    facts = plan.Facts(
        target=target, mesh=f["mesh"], hosts=hosts, gpus_per_host=gpus_per_host,
        device_hosts=f["device_hosts"], n_params=f["n_params"],
        model_flops_per_step=f["model_flops_per_step"], dtype=f["cfg"].dtype,
    )  # fmt: skip
    head = {
        "target": target.name, "device_kind": target.device_kind, "hosts": hosts,
        "gpus_per_host": gpus_per_host, "mesh": f["mesh"], "zero1": f["cfg"].mesh.zero1,
        "dtype": f["cfg"].dtype, "remat": f["cfg"].model.remat, "global_batch": f["global_batch"],
        "device_batch": f["device_batch"], "accumulation": f["accumulation"],
        "seq_len": f["cfg"].model.seq_len, "n_params": f["n_params"],
    }  # fmt: skip
    return head | plan.analyze(train, evaluate, facts, f["compile_s"])


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """cfg with dotted-key overrides (mesh.fsdp, model.remat, device_batch_size, ...)."""
    for key, value in overrides.items():
        if "." in key:
            part, leaf = key.split(".")
            cfg = dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **{leaf: value})})
        else:
            cfg = dataclasses.replace(cfg, **{key: value})
    return cfg


def nearer(cfg: Config, resolved: dict[str, Any], gpus_per_host: int) -> list[dict[str, Any]]:
    """Settings nearest first: remat, then half the device batch, then twice the fsdp size."""
    out: list[dict[str, Any]] = []
    fsdp = resolved["mesh"]["fsdp"]
    tensor = resolved["mesh"]["tensor"]
    smaller: dict[str, Any] = (
        {"device_batch_size": max(1, resolved["device_batch"] // 2)}
        if cfg.total_batch_size
        else {"gradient_accumulation_steps": resolved["accumulation"] * 2}
    )
    wider = {"mesh.fsdp": min(fsdp * 2, gpus_per_host // tensor), "mesh.data": -1}
    if cfg.model.remat != "full":
        out.append({"model.remat": "full"})
    out += [smaller, {**smaller, "model.remat": "full"}]
    if wider["mesh.fsdp"] > fsdp:
        out += [wider, {**wider, "model.remat": "full"}]
    return out


def fits_with(
    cfg: Config, resolved: dict[str, Any], target: targets.GpuTarget, hosts: int, gpus_per_host: int
) -> list[dict[str, Any]]:
    """For a plan that does not fit: the nearest settings (`nearer`) whose train step fits."""
    candidates = nearer(cfg, resolved, gpus_per_host)

    def compile_train(overrides: dict[str, Any]) -> Any:
        devices = targets.target_devices(target, hosts, gpus_per_host)
        return compile_for(with_overrides(cfg, overrides), devices)[0]

    return plan.nearest_fits(
        candidates,
        compile_train,
        resolved["usable_bytes_per_device"],
        tries=len(candidates),
    )


def search(cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> list[dict[str, Any]]:
    """Every data x fsdp x tensor mesh (fsdp x tensor inside a host) x remat that compiles and fits,
    fastest bound first; prints a line per setting as it goes (a search takes minutes)."""
    results = []
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= gpus_per_host]
    for tensor in sizes:
        for fsdp in (n for n in sizes if n * tensor <= gpus_per_host):
            for remat in ("none", "dots", "full"):
                o = {"mesh.data": -1, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "model.remat": remat}
                try:
                    p = plan_one(with_overrides(cfg, o), target, hosts, gpus_per_host)
                except (UserError, jax.errors.JaxRuntimeError) as e:  # rejected, or the compiler failed
                    print(f"  fsdp {fsdp} tensor {tensor} remat {remat}: {str(e).splitlines()[0]}")
                    continue
                print(f"  fsdp {fsdp} tensor {tensor} remat {remat}: {gb(p['total_bytes_per_device'])} "
                      f"bound {p['step_time_lower_bound_s'] * 1e3:.1f} ms {'fits' if p['fits'] else ''}",
                      flush=True)  # fmt: skip
                if p["fits"]:
                    results.append({"overrides": o, **{k: p[k] for k in SEARCH_KEYS}})
    return sorted(results, key=lambda r: r["step_time_lower_bound_s"])


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def print_plan(p: dict[str, Any]) -> None:
    """The plan as a table, its collectives and its bound."""
    mesh = " x ".join(f"{a} {n}" for a, n in p["mesh"].items())
    rows = [
        ("target", f"{p['hosts']} x {p['gpus_per_host']} {p['device_kind']}"),
        ("mesh", mesh + (" + zero1" if p["zero1"] else "")),
        ("batch", f"global {p['global_batch']} x {p['seq_len']}, {p['accumulation']} microbatch(es) of "
                  f"{p['device_batch']} per device; {p['dtype']}, remat {p['remat']}"),
        ("params", f"{p['n_params']:,}"),
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
    print(f"step time lower bound     {bound:.1f} ms ({limit}-bound; {terms})")
    print(
        f"MFU ceiling               {100 * p['mfu_ceiling']:.1f}% (from the bound: a ceiling, no prediction)"
    )


def print_fixes(p: dict[str, Any], tried: list[dict[str, Any]]) -> None:
    """What fits when `p` does not (its `fits_with`), and a search's results, fastest first."""
    if not p["fits"]:
        fixes = [" ".join(f"--{k} {v}" for k, v in f["overrides"].items()) for f in p.get("fits_with", [])]
        print("fits with: " + ("; ".join(fixes) if fixes else f"none of {tried}"))
    for r in p.get("search", []):
        print(f"  {r['overrides']}: bound {r['step_time_lower_bound_s'] * 1e3:.1f} ms, "
              f"MFU ceiling {100 * r['mfu_ceiling']:.1f}%, {gb(r['total_bytes_per_device'])}")  # fmt: skip
