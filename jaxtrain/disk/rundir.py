"""The run directory: config.yaml, metrics.jsonl, train.log, logs/, checkpoints/.

A run dir belongs to one run. Relaunching the same command resumes it; launching an
incompatible config into it is refused unless --overwrite.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from jaxtrain import config as config_lib
from jaxtrain.config import Config
from jaxtrain.disk import bucket
from jaxtrain.disk.files import require_writable, write_text
from jaxtrain.errors import UserError

# Keys that must match to continue a run: they fix the model shapes and the data stream.
# optim.name too: AdamW's and Muon's optimizer states have different trees.
RESUME_KEYS = ("model", "batch_size", "seed", "train_data_path", "token_dtype", "optim.name")


def resume_fingerprint(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """The part of a config that must be equal for a checkpoint to be continued."""
    flat = config_lib.flatten(cfg_dict)
    if flat.get("total_batch_size"):
        # The global batch in sequences: a saved config holds the batch_size its topology derived
        # from total_batch_size, a relaunch's holds the unresolved default.
        flat["batch_size"] = flat["total_batch_size"] // flat["model.seq_len"]
    return {k: v for k, v in flat.items() if any(k == r or k.startswith(f"{r}.") for r in RESUME_KEYS)}


def incompatibilities(saved: dict[str, Any], cfg: Config) -> list[str]:
    """`key: saved -> now` for each resume key that differs."""
    # A key the saved config lacks was added since it was written: it ran with the default.
    defaults = resume_fingerprint(config_lib.to_dict(Config()))
    old, new = {**defaults, **resume_fingerprint(saved)}, resume_fingerprint(config_lib.to_dict(cfg))
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def check(cfg: Config) -> None:
    """Refuse a run dir holding an incompatible run (every process runs this, before init)."""
    run_dir = cfg.resolved_run_dir
    require_writable(run_dir, "run dir")
    saved_path = run_dir / "config.yaml"
    if cfg.overwrite or not saved_path.exists():
        return
    try:
        saved = yaml.safe_load(saved_path.read_text()) or {}
    except yaml.YAMLError:
        saved = None
    if not isinstance(saved, dict):
        raise UserError(
            f"{saved_path} is not a saved config (bad YAML or not a mapping); fix it, or pass "
            "--overwrite to start afresh"
        )
    diff = incompatibilities(saved, cfg)
    if diff:
        raise UserError(
            f"run dir {run_dir} holds a run with a different config ({'; '.join(diff[:3])}); "
            "use another --run_dir, or --overwrite to discard it"
        )


def restrict_umask() -> None:
    """Make every file this process creates from now on (logs, checkpoints, wandb) not group- or
    world-writable, whatever umask it was started with; every process calls this before writing."""
    os.umask(os.umask(0o022) | 0o022)


def prepare(cfg: Config) -> Path:
    """Create the run dir (process 0 only); with --overwrite, discard the old run's outputs."""
    run_dir = cfg.resolved_run_dir
    if cfg.overwrite:
        for name in ("checkpoints", "metrics.jsonl", "train.log", "logs", "wandb", "wandb_id", "config.yaml"):
            if cfg.run_url:  # the bucket's copy too (the checkpoints are only there)
                bucket.rmtree(bucket.join(cfg.run_url, name))
                bucket.delete(bucket.join(cfg.run_url, name))
            p = run_dir / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o755)  # never world-writable, whatever the umask
    return run_dir


def save_config(cfg: Config) -> None:
    """Write config.yaml; called once the run has started (or resumed), so a failed launch changes nothing."""
    write_text(cfg.resolved_run_dir / "config.yaml", config_lib.to_yaml(cfg))


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after `step`, so a resumed run does not log a step twice.

    Timed events (launch, eval, checkpoint, end: jaxtrain/observe/goodput.py) stay, as they say where
    time went; a dropped timed record leaves a `redone` marker at its time, so goodput counts
    the time of the steps computed again as lost.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if "event" in record or record.get("step", 0) <= step:
            kept.append(line)
        elif "t" in record:
            kept.append(json.dumps({"event": "redone", "step": record["step"], "t": record["t"]}))
    write_text(path, "".join(f"{line}\n" for line in kept))
