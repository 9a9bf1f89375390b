"""Plan a training job on GPUs you do not have: compile its train and eval steps for the target
with XLA's real GPU compiler (no GPU, no CUDA driver), then print per-device memory, whether it
fits, the attention kernel, the collectives of one optimizer step and a step-time LOWER BOUND
(jaxtrain/plan/compiled.py says how it is computed; it is a floor, not a prediction).

    make gpu-plugin                                   # once per jax version: the CUDA plugin
    .venv/bin/python scripts/plan.py --config configs/gpt2_124m.yaml --target h100          # 1 x 8
    .venv/bin/python scripts/plan.py --config configs/gpt2_124m.yaml --target h100 --hosts 2 \
        --mesh.fsdp 8 --json plan.json
    .venv/bin/python scripts/plan.py --config configs/gpt2_124m.yaml --target a100 --search

Takes every flag of scripts/train.py, plus --target (jaxtrain/plan/targets.py), --hosts N,
--gpus_per_host G (default 8), --json FILE, --search (compile the meshes and remat settings that
fit, ranked by the bound). Exit 0: fits; 1: does not fit (the nearest settings that fit are
printed); 2: bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.config import Config, load_config  # noqa: E402
from jaxtrain.errors import ArgumentError  # noqa: E402
from jaxtrain.hf.config import with_hf_model  # noqa: E402
from jaxtrain.plan import targets  # noqa: E402

EXIT_DOES_NOT_FIT = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--target", default="h100")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--gpus_per_host", type=int, default=8)
    p.add_argument("--json", default="")
    p.add_argument("--search", action="store_true")
    return p


def compile_for(cfg: Config, devices: list[Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The run training would build (jaxtrain/run/build.py), built for `devices`, its steps compiled."""
    from jaxtrain.run import mesh as mesh_lib
    from jaxtrain.run.build import build
    from jaxtrain.run.job import Job

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
    from jaxtrain.plan import compiled as plan

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


def _with(cfg: Config, overrides: dict[str, Any]) -> Config:
    """cfg with dotted-key overrides (mesh.fsdp, model.remat, device_batch_size, ...)."""
    for key, value in overrides.items():
        if "." in key:
            part, leaf = key.split(".")
            cfg = dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **{leaf: value})})
        else:
            cfg = dataclasses.replace(cfg, **{key: value})
    return cfg


def _nearer(cfg: Config, resolved: dict[str, Any], gpus_per_host: int) -> list[dict[str, Any]]:
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


def _search(cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> list[dict[str, Any]]:
    """Every data x fsdp x tensor mesh (fsdp x tensor inside a host) x remat that compiles and fits."""
    import jax

    from jaxtrain.errors import UserError

    results = []
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= gpus_per_host]
    for tensor in sizes:
        for fsdp in (n for n in sizes if n * tensor <= gpus_per_host):
            for remat in ("none", "dots", "full"):
                o = {"mesh.data": -1, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "model.remat": remat}
                try:
                    p = plan_one(_with(cfg, o), target, hosts, gpus_per_host)
                except (UserError, jax.errors.JaxRuntimeError) as e:  # rejected, or the compiler failed
                    print(f"  fsdp {fsdp} tensor {tensor} remat {remat}: {str(e).splitlines()[0]}")
                    continue
                print(f"  fsdp {fsdp} tensor {tensor} remat {remat}: {_gb(p['total_bytes_per_device'])} "
                      f"bound {p['step_time_lower_bound_s'] * 1e3:.1f} ms {'fits' if p['fits'] else ''}",
                      flush=True)  # fmt: skip
                if p["fits"]:
                    results.append({"overrides": o, **{k: p[k] for k in _SEARCH_KEYS}})
    return sorted(results, key=lambda r: r["step_time_lower_bound_s"])


_SEARCH_KEYS = ("total_bytes_per_device", "step_time_lower_bound_s", "mfu_ceiling", "bound_limited_by")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _print(p: dict[str, Any]) -> None:
    mesh = " x ".join(f"{a} {n}" for a, n in p["mesh"].items())
    rows = [
        ("target", f"{p['hosts']} x {p['gpus_per_host']} {p['device_kind']}"),
        ("mesh", mesh + (" + zero1" if p["zero1"] else "")),
        ("batch", f"global {p['global_batch']} x {p['seq_len']}, {p['accumulation']} microbatch(es) of "
                  f"{p['device_batch']} per device; {p['dtype']}, remat {p['remat']}"),
        ("params", f"{p['n_params']:,}"),
        ("state + batch / device", _gb(p["state_bytes_per_device"])),
        ("temporaries / device", _gb(p["temp_bytes_per_device"])),
        ("total / device", _gb(p["total_bytes_per_device"])),
        ("eval step total / device", _gb(p["eval_total_bytes_per_device"])),
        ("usable / device", f"{_gb(p['usable_bytes_per_device'])} of {_gb(p['device_memory_bytes'])}: "
                            + ("FITS" if p["fits"] else "DOES NOT FIT")),
        ("attention", p["attention"]),
        ("compile", f"{p['compile_s']:.1f} s"),
    ]  # fmt: skip
    for k, v in rows:
        print(f"{k:<26}{v}")
    print("collectives per optimizer step (bytes: per-device buffers; sent: an ideal ring's, per device):")
    for c in p["collectives"]:
        where = "crosses hosts" if c["crosses_hosts"] else "inside a host"
        sent = _gb(c["network_bytes"] if c["crosses_hosts"] else c["nvlink_bytes"])
        size = _gb(c["bytes"])
        print(f"  {c['kind']:<19} over {c['axis']:<12} x{c['count']:<5} {size:>10}  sent {sent:>10}  {where}")
    terms = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p["bound_terms_s"].items())
    bound, limit = p["step_time_lower_bound_s"] * 1e3, p["bound_limited_by"]
    print(f"step time lower bound     {bound:.1f} ms ({limit}-bound; {terms})")
    print(
        f"MFU ceiling               {100 * p['mfu_ceiling']:.1f}% (from the bound: a ceiling, no prediction)"
    )


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    target = targets.get(args.target)
    if args.hosts < 1 or args.gpus_per_host < 1:
        raise ArgumentError(f"--hosts {args.hosts} --gpus_per_host {args.gpus_per_host}: both must be >= 1")
    cfg = load_config(rest, __doc__ or "", fill=with_hf_model)
    if "jax" not in sys.modules:
        targets.use_plugin()
    p = plan_one(cfg, target, args.hosts, args.gpus_per_host)
    if not p["fits"]:
        from jaxtrain.plan import compiled as plan

        candidates = _nearer(cfg, p, args.gpus_per_host)
        p["fits_with"] = plan.nearest_fits(
            candidates,
            lambda o: _compile_only(_with(cfg, o), target, args.hosts, args.gpus_per_host),
            p["usable_bytes_per_device"],
            tries=len(candidates),
        )
    if args.search:
        print("search:", flush=True)
        p["search"] = _search(cfg, target, args.hosts, args.gpus_per_host)
    _print(p)
    if not p["fits"]:
        fixes = [" ".join(f"--{k} {v}" for k, v in f["overrides"].items()) for f in p.get("fits_with", [])]
        tried = _nearer(cfg, p, args.gpus_per_host)
        print("fits with: " + ("; ".join(fixes) if fixes else f"none of {tried}"))
    for r in p.get("search", []):
        print(f"  {r['overrides']}: bound {r['step_time_lower_bound_s'] * 1e3:.1f} ms, "
              f"MFU ceiling {100 * r['mfu_ceiling']:.1f}%, {_gb(r['total_bytes_per_device'])}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(p, indent=1) + "\n")
    return 0 if p["fits"] else EXIT_DOES_NOT_FIT


def _compile_only(cfg: Config, target: targets.GpuTarget, hosts: int, gpus_per_host: int) -> Any:
    return compile_for(cfg, targets.target_devices(target, hosts, gpus_per_host))[0]


if __name__ == "__main__":
    sys.exit(main())
