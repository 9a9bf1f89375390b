"""When a plan does not fit: the nearest settings that do, and the search over layouts (its
candidates and their order: candidates.py).

    fixes = advice.fits_with(cfg, p, target, hosts, gpus_per_host)   # each one planned: it fits
    found = advice.search(cfg, target, hosts, gpus_per_host, budget=16)

Every setting advised was itself planned (planner.plan_one) and fits. When none is found the
advice says in words what would help (`what_would_help`), never as a list of what was tried.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from jaxtrain.config import Config, check
from jaxtrain.errors import UserError
from jaxtrain.observe.memory import fits
from jaxtrain.plan import candidates, targets
from jaxtrain.plan.candidates import inner_choice, layouts, mesh_overrides, with_overrides
from jaxtrain.plan.compiled import usable_bytes
from jaxtrain.plan.planner import Refused, gb, plan_guarded

# What a search keeps of each plan that fits.
SEARCH_KEYS = (
    "total_bytes_per_device", "step_time_lower_bound_s", "mfu_ceiling", "bound_limited_by",
    "schedule_bound_s", "schedule_mfu_ceiling", "forecast",
)  # fmt: skip
FULL = {"model.remat": "full"}
FITS_BUDGET = 8  # compiles fits_with's search may take when none of the nearest settings fits
# How far below the device's limit the projected memory of the widest fsdp may be and still not
# be compiled (`_Search.could_fit`): XLA's temporaries do not fall exactly as projected.
WIDEST_MARGIN = 0.05
# Compiles a search keeps, once a layout fits, for the fastest one's narrower fsdp widths and less
# remat (`_Search.narrower`, `_Search.less_remat`).
DEPTH_RESERVE = 3


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
    except Refused as e:  # XLA refused it or aborted: why, short (the search's line names the layout)
        return f"not compiled: {e.reason}", None
    except (UserError, jax.errors.JaxRuntimeError) as e:  # rejected, or the compiler failed
        return str(e).splitlines()[0], None
    if not p["compiled"]:
        return f"its state alone needs {gb(p['state_bytes_per_device'])}", p
    return ("fits" if p["fits"] else "does not fit"), p


def fits_with(
    cfg: Config,
    p: dict[str, Any],
    target: targets.GpuTarget,
    hosts: int,
    gpus_per_host: int,
    budget: int = FITS_BUDGET,
) -> list[dict[str, Any]]:
    """For a plan `p` that does not fit: up to two settings that plan as fitting, nearest first
    (`nearer`); when none of those fits, the fastest layouts a search finds (it varies tensor and
    expert too), within `budget` compiles (0: no search). Empty when nothing was found."""
    found: list[dict[str, Any]] = []
    for overrides in nearer(cfg, p, hosts * gpus_per_host):
        verdict, q = _try(with_overrides(cfg, overrides), target, hosts, gpus_per_host)
        if verdict == "fits" and q is not None:
            found.append({"overrides": overrides, **{k: q[k] for k in SEARCH_KEYS}})
            if len(found) == 2:
                break
    if found or not budget or (not p["compiled"] and state_split(p) > hosts * gpus_per_host):
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


class _Search:
    """One search's compiles, results and printed lines (see `search`)."""

    def __init__(self, cfg: Config, where: tuple[targets.GpuTarget, int, int], budget: int) -> None:
        self.cfg, self.where, self.budget = cfg, where, budget
        self.compiles = 0
        self.results: list[dict[str, Any]] = []
        # (device batch, tensor, context, pipeline) already said not compiled
        self.skipped: set[tuple[int, ...]] = set()
        self.total = 0  # the bytes per device of the last plan compiled (0: none)
        # (a layout's result at its widest fsdp, the widths below it a first pass did not try)
        self.between: list[tuple[dict[str, Any], list[int]]] = []

    def attempt(self, o: dict[str, Any]) -> str:
        verdict, p = _try(with_overrides(self.cfg, o), *self.where)
        self.compiles += p is not None and p["compiled"]
        self.total = p["total_bytes_per_device"] if p is not None and p["compiled"] else 0
        line = verdict
        if p is not None and p["compiled"]:
            line += f", {gb(p['total_bytes_per_device'])}, floor {p['step_time_lower_bound_s']:.3g} s, "
            line += (
                f"schedule-aware {p['schedule_bound_s']:.3g} s ({100 * p['schedule_mfu_ceiling']:.0f}% MFU)"
            )
            if "forecast" in p:
                f = p["forecast"]
                line += f", forecast {f['step_time_s']:.3g} s ({100 * f['mfu']:.1f}% MFU)"
        shown = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in o.items() if v != -1)
        print(f"  {shown}: {line}", flush=True)
        if verdict == "fits" and p is not None:
            self.results.append({"overrides": o, **{k: p[k] for k in SEARCH_KEYS}})
        return verdict

    def narrowest(
        self, mesh: dict[str, Any], rest: dict[str, Any], fsdps: list[int], start: int
    ) -> dict[str, Any] | str:
        """The narrowest fsdp that fits this mesh and batch, as far as a first pass looks (else the
        verdict that stopped it): `start` (candidates.first_fsdp: no narrower width can fit), then the
        next wider; where neither fits, the widest (if it could: `could_fit`), the widths between
        left to `narrower` (memory falls as fsdp grows)."""
        wider = fsdps[fsdps.index(start) + 1 :]
        totals = []
        for f in [start, *wider[:1]]:
            found: dict[str, Any] = {**mesh, "mesh.fsdp": f, **rest}
            verdict = self.attempt(found)
            totals.append(self.total)
            if verdict == "fits" or not _too_big(verdict) or self.compiles >= self.budget:
                return found if verdict == "fits" else verdict
        if len(wider) < 2 or not self.could_fit(totals, wider[-1] // wider[0]):
            return verdict
        found = {**mesh, "mesh.fsdp": wider[-1], **rest}
        verdict = self.attempt(found)
        if verdict == "fits" and len(wider) > 2:
            self.between.append((self.results[-1], wider[1:-1]))
        return found if verdict == "fits" else verdict

    def narrower(self) -> None:
        """The widths a first pass left between a layout's widest, which fit, and the width below
        that did not, bisected where that layout is the fastest found (a narrower fsdp gathers
        over fewer devices, a wider data reduces more), while the budget lasts."""
        if not self.between:
            return
        fastest, widths = min(self.between, key=lambda b: _forecast_s(b[0]))
        if _forecast_s(fastest) > min(map(_forecast_s, self.results)):
            return  # a slower layout's narrower widths: the budget goes to the fastest's remat
        found = fastest["overrides"]
        lo, hi = 0, len(widths) - 1
        while lo <= hi and self.compiles < self.budget:
            mid = (lo + hi) // 2
            verdict = self.attempt({**found, "mesh.fsdp": widths[mid]})
            if verdict == "fits":
                hi = mid - 1
            elif _too_big(verdict):
                lo = mid + 1
            else:
                break

    def could_fit(self, totals: list[int], widening: int) -> bool:
        """Whether a width `widening` times the second of two compiled widths (each twice the
        last) could fit, judged generously: each further doubling saving as much again as the
        last one did (under ZeRO-1 memory falls about so; a state split over fsdp alone saves half
        as much each time). Not compiled when even that, less a margin, is more than a device holds."""
        if len(totals) < 2 or not all(totals):
            return True
        saved = totals[0] - totals[1]
        least = totals[1] - saved * math.log2(widening)
        return fits(int(least * (1 - WIDEST_MARGIN)), usable_bytes(self.where[0]))

    def layout(self, layout: candidates.Layout, devices: int, gpus_per_host: int, limit: int) -> None:
        """One layout's plan that fits, if any: the device batch from the largest (no accumulation:
        the fewest gathers per step) down, skipping without a compile any whose saved layer inputs
        and head's logits alone exceed a device (candidates.memory_floor) and any at which no fsdp
        fits; at the first that fits, its narrowest fsdp (data fills the rest), with expert laid
        inside fsdp too where that keeps the token exchange inside a host (`inner_choice`)."""
        cfg, (tensor, context, expert, pipe, fsdps) = self.cfg, layout
        rows, shards = candidates.rows_of(cfg), devices // (tensor * context * pipe)  # data x expert x fsdp
        if rows % shards:
            print(f"  tensor {tensor} x context {context} x pipeline {pipe}: {rows} sequences do not split "
                  f"over {shards} shards")  # fmt: skip
            return
        # A pipeline takes one row per microbatch: the most microbatches, the smallest bubble.
        sizes = range(rows // shards, 0, -1) if pipe == 1 else [1]
        for b in [b for b in sizes if (rows // shards) % b == 0 and b & (b - 1) == 0]:
            least = candidates.memory_floor(cfg, b, tensor, context, pipe, rows // shards)
            if not fits(least, limit):
                if (b, tensor, context, pipe) not in self.skipped:
                    self.skipped.add((b, tensor, context, pipe))
                    print(f"  device batch {b}, tensor {tensor} x context {context} x pipeline {pipe}: "
                          f"its layers' saved inputs and the head's logits alone need {gb(least)}: "
                          "not compiled")  # fmt: skip
                continue
            if self.compiles >= self.budget:
                return
            batch = {"device_batch_size": b} if cfg.total_batch_size else {
                "gradient_accumulation_steps": rows // shards // b}  # fmt: skip
            start = candidates.first_fsdp(cfg, layout, devices, least, limit)
            mesh = mesh_overrides(cfg, tensor, context, expert, pipe)
            found = self.narrowest(mesh, {**batch, **FULL}, fsdps, start)
            if isinstance(found, dict):
                if inner_choice(expert, found["mesh.fsdp"], tensor * context, gpus_per_host):
                    self.attempt({**found, "mesh.expert_inner": True})  # the token exchange on NVLink
                return
            if found != "does not fit":  # its state alone (at any batch), or rejected by the
                return  # config (heads not divisible by tensor, ...) or by XLA: the next layout

    def less_remat(self) -> None:
        """Less recomputation (dots, then none) where memory allows, for the layouts found, fastest
        forecast first, while the budget lasts."""
        for r in sorted(self.results, key=_forecast_s):
            for remat in ("dots", "none"):
                if (
                    self.compiles >= self.budget
                    or self.attempt({**r["overrides"], "model.remat": remat}) != "fits"
                ):
                    break


def _too_big(verdict: str) -> bool:
    """Whether a candidate was refused for its memory alone (a wider fsdp or smaller batch may fit)."""
    return verdict == "does not fit" or verdict.startswith("its state alone")


def search(
    cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int, budget: int
) -> list[dict[str, Any]]:
    """Layouts that fit, fastest forecast first, within `budget` compiles. The layouts (`layouts`)
    are compiled in the order of an estimate from the model's shape (candidates.ranked: the ones a
    fixed order left past the budget come first), each once at its largest device batch and
    narrowest fsdp that can fit (`_Search.layout`), breadth before depth; the last DEPTH_RESERVE
    compiles try the fastest found at narrower fsdp widths and less remat. Prints a line per
    setting as it goes."""
    devices = hosts * gpus_per_host
    s = _Search(cfg, (target, hosts, gpus_per_host), budget)
    order = candidates.ranked(cfg, layouts(cfg, devices, gpus_per_host), devices, gpus_per_host, target)
    shown = "; ".join(
        f"{_layout_name(layout)} {est:.3g} s" for est, layout in order[:4] if est < float("inf")
    )
    print(f"  {len(order)} layouts, compiled in the order of an estimate from the shape (no compile): "
          f"{shown}, ...", flush=True)  # fmt: skip
    for _, layout in order:
        if s.compiles >= budget - (DEPTH_RESERVE if s.results else 0):
            print(f"  (layouts stopped after {s.compiles} compiles of --search_budget {budget})")
            break
        s.layout(layout, devices, gpus_per_host, usable_bytes(target))
    s.narrower()
    s.less_remat()
    return sorted(s.results, key=_forecast_s)


def _layout_name(layout: candidates.Layout) -> str:
    axes = zip(("tensor", "context", "expert", "pipeline"), layout[:4], strict=False)
    return " x ".join(f"{a} {n}" for a, n in axes if n > 1) or "fsdp only"


def _forecast_s(r: dict[str, Any]) -> float:
    """What a search ranks by: the forecast step time (forecast.py), the bound's for a plan without one."""
    return r["forecast"]["step_time_s"] if "forecast" in r else r["schedule_bound_s"]


def versus_given(p: dict[str, Any], found: list[dict[str, Any]]) -> str:
    """One line: the fastest layout a search found against the job as given (`p`, {} where its
    layout was refused), by forecast step time; "" when the search found none."""
    if not found:
        return ""
    best, how = _forecast_s(found[0]), flags(found[0]["overrides"])
    said = f"best layout found vs the job as given: {1e3 * best:.1f}"
    if not p or not p["compiled"]:
        return f"{said} ms a step (forecast) with {how}; the job as given was not compiled"
    if not p["fits"]:
        size = gb(p["total_bytes_per_device"])
        return f"{said} ms a step (forecast) with {how}; the job as given does not fit ({size})"
    given = _forecast_s(p)
    ratio = given / best
    verdict = f"{ratio:.2f}x faster" if ratio >= 1 else f"{ratio:.2f}x: the job as given is faster"
    return f"{said} vs {1e3 * given:.1f} ms a step (forecast), {verdict}, with {how}"


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
