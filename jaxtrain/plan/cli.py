"""The command line of scripts/plan.py (its docstring is the usage): plan one job, say what fits
when it does not, optionally search every mesh and remat setting, print, write --json.

Imports no jax until the CUDA plugin is on the path (targets.use_plugin): jax picks up its
plugins once, when it is first imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxtrain.config import Config, load_config
from jaxtrain.errors import ArgumentError, UserError
from jaxtrain.hf.config import with_hf_model
from jaxtrain.plan import targets

EXIT_DOES_NOT_FIT = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--target", default="h100")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--gpus_per_host", type=int, default=8)
    p.add_argument("--json", default="")
    p.add_argument("--search", action="store_true")
    p.add_argument("--search_budget", type=int, default=16)
    p.add_argument("--expert_load", type=float, default=0.0)
    return p


def job_config(argv: list[str], usage: str) -> Config:
    """The job's config as training resolves it (run/resolve.py: the data's framing too); without
    a data path, no data (training's default dataset frames nothing). Puts the plugin on the path."""
    cfg = load_config(argv, usage, fill=with_hf_model)
    if "jax" not in sys.modules:
        targets.use_plugin(xla_logs=cfg.verbose)
    from jaxtrain.run.resolve import resolve  # imports jax, so after use_plugin

    return resolve(cfg, default_data=False).cfg


def main(argv: list[str], usage: str) -> int:
    """Exit code: 0 fits (or a search found a layout that does), 1 does not fit (EXIT_DOES_NOT_FIT);
    bad input raises a UserError."""
    args, rest = _parser().parse_known_args(argv)
    target = targets.get(args.target)
    if args.hosts < 1 or args.gpus_per_host < 1:
        raise ArgumentError(f"--hosts {args.hosts} --gpus_per_host {args.gpus_per_host}: both must be >= 1")
    if args.expert_load and args.expert_load < 1:
        raise ArgumentError(
            f"--expert_load {args.expert_load:g}: the most loaded expert's rows over an even share is at "
            "least 1 (1: routing even; a run's metrics.jsonl gives its expert_load_max_mean)"
        )
    cfg = job_config(rest, usage)
    from jaxtrain.plan import advice, planner  # import jax, so after use_plugin

    p = plan_job(cfg, target, args.hosts, args.gpus_per_host, args.search_budget if args.search else 0)
    if (
        args.expert_load and "schedule_trace" in p
    ):  # the forecast at the load given (the search's: the config's)
        p = planner.recost(p, args.expert_load)
    if p.get("compiled") is not None:
        if args.search:  # after the search's lines: which plan this is
            print("the job as given:")
        planner.print_plan(p)
        advice.print_fixes(p)
    advice.print_search(p.get("search", []))
    if versus := advice.versus_given(p, p.get("search", [])):
        print(versus)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(p, indent=1) + "\n")
    return 0 if p.get("fits") or p.get("search") else EXIT_DOES_NOT_FIT


def plan_job(
    cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int, search_budget: int
) -> dict:
    """What --json holds: the plan of `cfg` as given (with `fits_with` when it does not fit) and,
    with a search budget, `search`: the layouts that fit, fastest first. A layout the config
    refuses raises, unless a search was asked for (it needs no layout that runs: {} then)."""
    from jaxtrain.plan import advice, planner  # import jax, so after use_plugin

    where = (target, hosts, gpus_per_host)
    try:
        p: dict = planner.plan_guarded(cfg, *where)  # an XLA abort is one line, not a dead process
    except UserError as e:
        if not search_budget:  # the layout given cannot run: one line, exit 2
            raise
        print(f"as given: {e}; searching", flush=True)
        p = {}
    if p and not p["fits"]:  # with --search, its own search is the one below (its compiles once)
        p["fits_with"] = advice.fits_with(cfg, p, *where, 0 if search_budget else advice.FITS_BUDGET)
    if search_budget:
        print("search:", flush=True)
        p["search"] = advice.search(cfg, *where, budget=search_budget)
        if p.get("fits_with") == []:  # what fits: the fastest the search found
            p["fits_with"] = p["search"][:2]
    return p
