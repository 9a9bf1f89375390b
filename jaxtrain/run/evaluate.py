"""The validation loss, one rule for training's evaluations and `--task test`.

A source's loss is the mean over its batches; over several sources (a mixture's, or a manifest's
named val sets) the loss is weighted as the sources are weighted in training, so the number
`--task test` prints for a checkpoint is the number its run logged as val_loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxtrain.data.sources import Source
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run.build import Run


def mean_loss(run: Run, params: Any, batches: Iterable[np.ndarray]) -> float:
    """Mean loss of `params` over batches of this process's rows (every process calls it); with a
    loss mask, the mean over every kept target of every batch."""
    return float(mean_metrics(run, params, batches)["loss"])


def mean_metrics(run: Run, params: Any, batches: Iterable[np.ndarray]) -> dict[str, np.ndarray]:
    """The eval step's metrics (loss; a mixture of experts' expert load...), each a mean over
    batches; with a loss mask each batch's loss weighs its kept count (the step's `kept`)."""
    # One batch in flight at a time. The eval steps do not depend on each other, so dispatched all at
    # once they run concurrently, and XLA:CPU's collectives then deadlock: with 2 or 4 devices on a
    # 2-core pool, one device's later steps hold the threads its peer needs to join an all-reduce
    # ("Expected 2 threads to join the rendezvous", abort after 40 s). The next batch is read while
    # this one computes.
    metrics: list[Any] = []
    for rows in batches:
        if metrics:
            metrics[-1] = jax.device_get(metrics[-1])
        metrics.append(run.eval_step(params, mesh_lib.global_batch(rows, run.mesh, run.cfg.batch_size)))
    metrics = jax.device_get(metrics)
    means = {k: np.mean([m[k] for m in metrics], axis=0) for k in metrics[0] if k != "kept"}
    if "kept" in metrics[0]:
        kept = np.array([m["kept"] for m in metrics], np.float64)
        loss = np.array([m["loss"] for m in metrics], np.float64)
        means["loss"] = np.sum(loss * kept) / max(np.sum(kept), 1.0)
    return means


def overall(per_source: dict[str, float], sources: Sequence[Source]) -> float:
    """The losses of several validation sets as one number: weighted as the sources are."""
    return float(np.average([per_source[s.name] for s in sources], weights=[s.weight for s in sources]))
