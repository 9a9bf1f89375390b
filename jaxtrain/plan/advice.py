"""When a plan does not fit: the nearest settings that do, and the search over layouts.

    fixes = advice.fits_with(cfg, p, target, hosts, gpus_per_host)   # each one planned: it fits
    found = advice.search(cfg, target, hosts, gpus_per_host, budget=16)

Every setting advised was itself planned (planner.plan_one) and fits. When none is found the
advice says in words what would help (`what_would_help`), never as a list of what was tried.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxtrain.config import Config, check
from jaxtrain.errors import UserError
from jaxtrain.observe.memory import fits
from jaxtrain.plan import targets
from jaxtrain.plan.compiled import usable_bytes
from jaxtrain.plan.planner import gb, plan_guarded
from jaxtrain.run.job import resolve_mesh

# What a search keeps of each plan that fits.
SEARCH_KEYS = (
    "total_bytes_per_device", "step_time_lower_bound_s", "mfu_ceiling", "bound_limited_by",
    "schedule_bound_s", "schedule_mfu_ceiling", "forecast",
)  # fmt: skip
FULL = {"model.remat": "full"}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """cfg with dotted-key overrides (mesh.fsdp, model.remat, device_batch_size, ...)."""
    for key, value in overrides.items():
        if "." in key:
            part, leaf = key.split(".")
            cfg = dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **{leaf: value})})
        else:
            cfg = dataclasses.replace(cfg, **{key: value})
    return cfg


def flags(overrides: dict[str, Any]) -> str:
    """Overrides as the command-line flags that set them."""
    return " ".join(f"--{k} {v}" for k, v in overrides.items())


def state_split(p: dict[str, Any]) -> int:
    """The fewest ways (a power of two) this plan's state must be split, fully sharded (fsdp x
    tensor), for a device's share of it to fit."""
    total = p["state_bytes_per_device"] * p["mesh"]["fsdp"] * p["mesh"]["tensor"]
    n = 1
    while not fits(total // n, p["usable_bytes_per_device"]):
        n *= 2
    return n


def nearer(cfg: Config, p: dict[str, Any], devices: int) -> list[dict[str, Any]]:
    """Settings nearest first. A state that alone does not fit: the fsdp that splits it enough (if
    the devices allow one). Else: full remat, half the device batch, twice the fsdp width."""
    mesh = p["mesh"]
    fsdp, tensor = mesh["fsdp"], mesh["tensor"]
    # fsdp takes what the other split axes leave (data fills the rest): never a mesh past the devices
    widest = devices // (tensor * mesh.get("expert", 1) * mesh.get("context", 1) * mesh.get("pipeline", 1))
    remat = [] if cfg.model.remat == "full" else [FULL]
    if not p["compiled"]:  # remat and batch leave the state as it is
        need = max(2 * fsdp, state_split(p) // tensor)
        wide = {"mesh.fsdp": need, "mesh.data": -1}
        return [wide, *({**wide, **r} for r in remat)] if need <= widest else []
    out = list(remat)
    if p["device_batch"] > 1:  # never advise the batch the job already has
        smaller: dict[str, Any] = (
            {"device_batch_size": max(1, p["device_batch"] // 2)}
            if cfg.total_batch_size
            else {"gradient_accumulation_steps": p["accumulation"] * 2}
        )
        out += [smaller, *({**smaller, **r} for r in remat)]
    if min(2 * fsdp, widest) > fsdp:
        wider = {"mesh.fsdp": min(2 * fsdp, widest), "mesh.data": -1}
        out += [wider, *({**wider, **r} for r in remat)]
    return out


def _try(cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> tuple[str, dict | None]:
    """Plan one candidate: ("fits" | "does not fit" | why it was not compiled, its plan). A candidate
    a user's config would be refused for (a tensor size the key/value heads do not divide, ...) is
    refused here by the same checks, not compiled; one XLA refuses, or aborts on, is its one line
    (planner.plan_guarded compiles in a child process)."""
    try:
        check(cfg)
        p = plan_guarded(cfg, target, hosts, gpus_per_host)
    except (UserError, jax.errors.JaxRuntimeError) as e:  # rejected, or the compiler failed
        return str(e).splitlines()[0], None
    if not p["compiled"]:
        return f"its state alone needs {gb(p['state_bytes_per_device'])}", p
    return ("fits" if p["fits"] else "does not fit"), p


def fits_with(
    cfg: Config, p: dict[str, Any], target: targets.GpuTarget, hosts: int, gpus_per_host: int, budget: int = 8
) -> list[dict[str, Any]]:
    """For a plan `p` that does not fit: up to two settings that plan as fitting, nearest first
    (`nearer`); when none of those fits, the fastest layouts a search finds (it varies tensor and
    expert too), within `budget` compiles. Empty when nothing was found."""
    found: list[dict[str, Any]] = []
    for overrides in nearer(cfg, p, hosts * gpus_per_host):
        verdict, q = _try(with_overrides(cfg, overrides), target, hosts, gpus_per_host)
        if verdict == "fits" and q is not None:
            found.append({"overrides": overrides, **{k: q[k] for k in SEARCH_KEYS}})
            if len(found) == 2:
                break
    if found or (not p["compiled"] and state_split(p) > hosts * gpus_per_host):
        return found
    print("none of the nearest settings fits; searching layouts:", flush=True)
    return search(cfg, target, hosts, gpus_per_host, budget)[:2]


def what_would_help(p: dict[str, Any]) -> str:
    """In words, for a plan that does not fit and for which no setting that fits was found."""
    devices = p["hosts"] * p["gpus_per_host"]
    if not p["compiled"]:
        n = state_split(p)
        if n > devices:
            return (
                f"nothing on {p['hosts']} x {p['gpus_per_host']} GPUs: its state alone must be split {n} "
                f"ways (fsdp x tensor), more than its {devices} GPUs; plan it on {n} or more"
            )
        return (
            f"nothing found: its state fits split {n} ways (fsdp x tensor), but no layout tried "
            "fits with its batch; try --search with a larger --search_budget"
        )
    if p["device_batch"] == 1:
        return (
            f"nothing found: one sequence of {p['seq_len']:,} tokens per device is already the smallest "
            f"batch; what would help: tensor parallelism (splits each layer's activations, up to "
            f"--mesh.tensor {p['gpus_per_host']} in a host), context parallelism (--mesh.context: splits "
            "each sequence over devices), --model.remat full, --model.token_chunks (the output head, its "
            "loss and the MLPs over pieces of the sequence), a wider fsdp (splits the state only) or a "
            "shorter --model.seq_len; --search tries all of them but token_chunks"
        )
    return "nothing found among the nearest settings: try --search, or a smaller --device_batch_size"


def print_fixes(p: dict[str, Any]) -> None:
    """What fits when `p` does not: its `fits_with` (each planned, and fitting), else what would help."""
    if p["fits"]:
        return
    fixes = p.get("fits_with", [])
    if fixes:
        print(
            "fits with: "
            + "; ".join(f"{flags(f['overrides'])} ({gb(f['total_bytes_per_device'])})" for f in fixes)
        )
    else:
        print("fits with: " + what_would_help(p))


def activation_floor(
    cfg: Config, device_batch: int, context: int = 1, pipeline: int = 1, rows: int = 0, tensor: int = 1
) -> int:
    """Bytes a device holds at least at this device batch, whatever the mesh and remat: the input
    of every layer, saved for the backward (tensor parallelism does not split it; context
    parallelism splits each sequence). Under a pipeline: its stage's input for each of its `rows`
    (every microbatch's), whatever the device batch, split along the sequence over tensor where
    context does not split it (parallel/pipeline.py: `held`)."""
    m = cfg.model
    per_row = m.seq_len * m.d_model * DTYPE_BYTES.get(cfg.dtype, 4) // context
    if pipeline > 1:
        return rows * per_row // (tensor if context == 1 else 1)
    return m.n_layer * device_batch * per_row


def layouts(cfg: Config, devices: int, gpus_per_host: int) -> list[tuple[int, int, int, int, list[int]]]:
    """(tensor, context, expert, pipeline, fsdp widths) to search, only meshes that can exist:
    tensor inside a host, largest first; context in what the host leaves, smallest first (1:
    whole sequences); then expert, largest first (1 for a dense model); then no pipeline, then the
    pipelines a dense scanned model's layers take (`pipelines`), deepest first; fsdp widths whose
    mesh divides the devices (data fills the rest). Each is held to the checks a user's config
    meets (config/checks.py: heads, key/value heads, experts, window over tensor and context) and
    to the device count (run/job.py: resolve_mesh), the same rules, before any compile."""
    powers = [2**i for i in range(devices.bit_length()) if devices % 2**i == 0]
    n_experts = cfg.model.moe.n_experts
    out = []
    for tensor in sorted((n for n in powers if n <= gpus_per_host), reverse=True):
        for context in [c for c in powers if c == 1 or c * tensor <= gpus_per_host]:
            inner = tensor * context
            experts = [e for e in powers if e * inner <= devices and n_experts % e == 0] if n_experts else [1]
            for expert in sorted(experts, reverse=True):
                for pipe in pipelines(cfg, devices // (inner * expert)):
                    fsdps = [f for f in powers if devices % (f * inner * expert * pipe) == 0]
                    if fsdps and can_exist(cfg, mesh_overrides(cfg, tensor, context, expert, pipe), devices):
                        out.append((tensor, context, expert, pipe, fsdps))
    return out


def mesh_overrides(cfg: Config, tensor: int, context: int, expert: int, pipe: int) -> dict[str, Any]:
    """A layout as the flags that set it over `cfg`: every axis the search varies that differs from
    the config's (a context or pipeline the config sets is undone where the layout has none)."""
    axes = {"context": context, "expert": expert, "pipeline": pipe}
    return {"mesh.data": -1, "mesh.tensor": tensor} | {
        f"mesh.{a}": n
        for a, n in axes.items()
        if n != getattr(cfg.mesh, a) or (a == "expert" and cfg.model.moe.n_experts)
    }


def can_exist(cfg: Config, mesh: dict[str, Any], devices: int) -> bool:
    """Whether a mesh (overrides, fsdp 1: wider ones are its multiples) passes the config's checks
    and multiplies to the devices: the rules a user's job meets, not a copy of them."""
    try:
        candidate = with_overrides(cfg, {**mesh, "mesh.fsdp": 1})
        check(candidate)
        resolve_mesh(candidate.mesh, devices)
    except UserError:
        return False
    return True


def inner_choice(expert: int, fsdp: int, inner: int, gpus_per_host: int) -> bool:
    """Whether laying expert inside fsdp (`mesh.expert_inner`) changes which collectives cross
    hosts: the expert group (with the `inner` tensor x context devices) fits a host and the fsdp
    groups do not all fit beside it."""
    return expert > 1 and fsdp > 1 and expert * inner <= gpus_per_host < expert * fsdp * inner


def pipelines(cfg: Config, devices: int) -> list[int]:
    """1, then the pipeline sizes (powers of two, at most `devices` and the layers of a dense
    scanned model) whose stages pad the layers by at most 1/16 of them, deepest first: a stage's
    tick runs its padding layers too (parallel/pipeline.py), so 126 layers over 32 stages cost 128,
    and 80 over 32, 96."""
    m = cfg.model
    if not m.scan_layers or m.moe.n_experts:
        return [1]
    sizes = [2**i for i in range(1, devices.bit_length()) if devices % 2**i == 0 and 2**i <= m.n_layer]
    deep = [p for p in sizes if 16 * (-(-m.n_layer // p) * p - m.n_layer) <= m.n_layer]
    return [1, *sorted(deep, reverse=True)]


class _Search:
    """One search's compiles, results and printed lines (see `search`)."""

    def __init__(self, cfg: Config, where: tuple[targets.GpuTarget, int, int], budget: int) -> None:
        self.cfg, self.where, self.budget = cfg, where, budget
        self.compiles = 0
        self.results: list[dict[str, Any]] = []

    def attempt(self, o: dict[str, Any]) -> str:
        verdict, p = _try(with_overrides(self.cfg, o), *self.where)
        self.compiles += p is not None and p["compiled"]
        line = verdict
        if p is not None and p["compiled"]:
            line += f", {gb(p['total_bytes_per_device'])}, floor {p['step_time_lower_bound_s']:.3g} s, "
            line += (
                f"schedule-aware {p['schedule_bound_s']:.3g} s ({100 * p['schedule_mfu_ceiling']:.0f}% MFU)"
            )
        shown = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in o.items() if v != -1)
        print(f"  {shown}: {line}", flush=True)
        if verdict == "fits" and p is not None:
            self.results.append({"overrides": o, **{k: p[k] for k in SEARCH_KEYS}})
        return verdict

    def narrowest(self, mesh: dict[str, Any], rest: dict[str, Any], fsdps: list[int]) -> dict[str, Any] | str:
        """The narrowest fsdp that fits this mesh and batch (its verdict at the widest if even that
        does not): memory falls as fsdp grows, so the widest is tried first, then bisected."""
        found: dict[str, Any] = {**mesh, "mesh.fsdp": fsdps[-1], **rest}
        verdict = self.attempt(found)
        if verdict != "fits":
            return verdict
        lo, hi = 0, len(fsdps) - 2
        while lo <= hi and self.compiles < self.budget:
            mid = (lo + hi) // 2
            o = {**mesh, "mesh.fsdp": fsdps[mid], **rest}
            verdict = self.attempt(o)
            if verdict == "fits":
                found, hi = o, mid - 1
            elif verdict == "does not fit" or verdict.startswith("its state alone"):
                lo = mid + 1
            else:
                break
        return found


def search(
    cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int, budget: int
) -> list[dict[str, Any]]:
    """Layouts that fit, fastest schedule-aware bound first. For each tensor and expert size
    (`layouts`), the device batch from the largest (no accumulation: the fewest gathers per step)
    down, skipping without a compile any whose saved layer inputs alone exceed a device
    (`activation_floor`) and any at which the widest fsdp does not fit; at the first that fits,
    the narrowest fsdp that does (data fills the rest), with expert laid inside fsdp too where
    that keeps the token exchange inside a host (`inner_choice`), then less remat where it still fits. At
    most `budget` compiles. Prints a line per setting as it goes."""
    devices = hosts * gpus_per_host
    rows = cfg.total_batch_size // cfg.model.seq_len if cfg.total_batch_size else cfg.batch_size
    limit = usable_bytes(target)
    s = _Search(cfg, (target, hosts, gpus_per_host), budget)
    skipped: set[tuple[int, int]] = set()
    for tensor, context, expert, pipe, fsdps in layouts(cfg, devices, gpus_per_host):
        shards = devices // (tensor * context * pipe)  # data x expert x fsdp: the batch is split over them
        if rows % shards:
            print(
                f"  tensor {tensor} x context {context} x pipeline {pipe}: {rows} sequences do not split "
                f"over {shards} shards"
            )
            continue
        # A pipeline takes one row per microbatch: the most microbatches, the smallest bubble.
        sizes = range(rows // shards, 0, -1) if pipe == 1 else [1]
        for b in [b for b in sizes if (rows // shards) % b == 0 and b & (b - 1) == 0]:
            floor = activation_floor(cfg, b, context, pipe, rows // shards, tensor)
            if not fits(floor, limit):
                if (b, context) not in skipped:
                    skipped.add((b, context))
                    print(f"  device batch {b}, context {context}: its layers' saved inputs alone need "
                          f"{gb(floor)}: not compiled")  # fmt: skip
                continue
            if s.compiles >= budget:
                print(f"  (search stopped after {budget} compiles: --search_budget)")
                return sorted(s.results, key=_forecast_s)
            batch = {"device_batch_size": b} if cfg.total_batch_size else {
                "gradient_accumulation_steps": rows // shards // b}  # fmt: skip
            mesh = mesh_overrides(cfg, tensor, context, expert, pipe)
            found = s.narrowest(mesh, {**batch, **FULL}, fsdps)
            if isinstance(found, dict):
                if inner_choice(expert, found["mesh.fsdp"], tensor * context, gpus_per_host):
                    s.attempt({**found, "mesh.expert_inner": True})  # the token exchange on NVLink
                for remat in ("dots", "none"):  # less recomputation, where memory allows
                    if s.compiles >= budget or s.attempt({**found, "model.remat": remat}) != "fits":
                        break
                break  # the largest device batch that fits: the fewest gathers per step
            if found != "does not fit":  # its state alone (at any batch), or rejected by the
                break  # config (heads not divisible by tensor, ...): the next layout
    return sorted(s.results, key=_forecast_s)


def _forecast_s(r: dict[str, Any]) -> float:
    """What a search ranks by: the forecast step time (forecast.py), the bound's for a plan without one."""
    return r["forecast"]["step_time_s"] if "forecast" in r else r["schedule_bound_s"]


def print_search(found: list[dict[str, Any]]) -> None:
    """A search's layouts that fit, fastest forecast first."""
    if found:
        print("layouts that fit, fastest forecast first (forecast: at speeds measured on H100s; "
              "schedule-aware: a bound, every op at peak):")  # fmt: skip
    for r in found:
        sched, floor = r["schedule_bound_s"] * 1e3, r["step_time_lower_bound_s"] * 1e3
        ceiling, floor_ceiling = 100 * r["schedule_mfu_ceiling"], 100 * r["mfu_ceiling"]
        f = r.get("forecast")
        likely = f"forecast {f['step_time_s'] * 1e3:.1f} ms (MFU {100 * f['mfu']:.1f}%), " if f else ""
        print(f"  {flags(r['overrides'])}: {likely}schedule-aware {sched:.1f} ms (ceiling {ceiling:.1f}%), "
              f"floor {floor:.1f} ms ({floor_ceiling:.1f}%), {gb(r['total_bytes_per_device'])}")  # fmt: skip
