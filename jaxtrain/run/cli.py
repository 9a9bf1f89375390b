"""The command line of scripts/train.py (its docstring is the usage): the config from YAML and
flags, where this process sits, the XLA flags, then the task (train, test, predict).

Imports no jax until XLA_FLAGS are set: XLA reads them once, when the first backend starts.
"""

from __future__ import annotations

from jaxtrain import xla_env
from jaxtrain.cluster.detect import detect
from jaxtrain.config import global_rows, load_config
from jaxtrain.config.batch import check_batch_split
from jaxtrain.hf.config import with_hf_model


def main(argv: list[str], usage: str = "") -> None:
    """Run the task `argv` configures; bad input raises a UserError (the script makes it one line)."""
    cfg = load_config(argv, usage, fill=with_hf_model)
    launch = detect(cfg.dist)  # where this process sits: once per launch, before jax starts
    # Before jax starts (a second or more): every rank of a job with a bad split says so at once.
    check_batch_split(global_rows(cfg), launch.num_processes)
    xla_env.set_flags(cfg, launch)
    from jaxtrain.run.tasks import run_task  # imports jax

    run_task(cfg, launch, launch_time=xla_env.LAUNCH_TIME)
