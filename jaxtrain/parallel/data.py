"""Data parallelism: the batch split over the batch axes (data, expert, fsdp), each device computing
the gradient of its own rows; the means over those shards, and the gradient reduced over them once
a step, however many microbatches (tests/test_step.py), outside the microbatch loop.

A param split over a batch axis (fsdp's, an expert's) gets its gradient summed over that axis
already (fsdp's reduce-scatter, the experts' exchange back): divided there. Under ZeRO-1 a
reduce-scatter over data stands in for the all-reduce (parallel/fsdp.py `scatter_over_data`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.model.params import logical_axes
from jaxtrain.parallel import fsdp
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.text.format import NO_LOSS


class Shards:
    """The batch shards of a mesh, as the inside of the step's shard_map sees them; `manual`: the
    params' manual specs (parallel/mesh.py `manual_part`)."""

    def __init__(self, sizes: dict[str, int], manual: Any) -> None:
        self.sizes, self.manual = sizes, manual

    def _pmean(self, tree: Any, axes: tuple[str, ...]) -> Any:
        """Mean over those of `axes` with more than one device. A pmean over size-1 manual axes
        beside an automatic tensor axis fails XLA's SPMD partitioner ("Cross-partition allreduce
        must be in (partial) manual partitioning mode")."""
        axes = tuple(a for a in axes if self.sizes[a] > 1)
        return jax.lax.pmean(tree, axes) if axes else tree

    def loss_targets(self, rows: jax.Array) -> jax.Array:
        """How many targets of the whole global batch take loss (a loss-masked batch)."""
        targets = jnp.sum((rows[:, 1:] & NO_LOSS) == 0).astype(jnp.float32)
        axes = tuple(a for a in mesh_lib.BATCH_AXES if self.sizes[a] > 1)  # as in _pmean
        return jax.lax.psum(targets, axes) if axes else targets

    def target_share(self, targets: jax.Array, accum: int) -> jax.Array:
        """The global batch's loss-target count per microbatch of each shard: each microbatch's loss
        is its sum over its loss targets over this, so the mean over microbatches and shards (what
        the step takes) is the global sum over the global loss-target count, however the batch is
        split. A batch with no loss target has loss 0, not NaN."""
        return jnp.maximum(targets, 1.0) / (accum * math.prod(self.sizes.values()))

    def mean(self, tree: Any) -> Any:
        """Mean over the batch shards."""
        return self._pmean(tree, mesh_lib.BATCH_AXES)

    def reduce_grads(self, grads: Any, out_specs: Any) -> Any:
        """Mean over every batch shard, each gradient left in its manual spec in `out_specs`. A
        param split over a batch axis gets its gradient summed over that axis already (fsdp's
        reduce-scatter, the experts' all-to-all back): divided there. Where `out_specs` adds
        `data` (ZeRO-1: the moments' layout, mesh_lib.zero1_spec) a reduce-scatter over it
        stands in for the all-reduce: each data shard gets only its slice, half the bytes."""

        def one(path: tuple, g: jax.Array, spec: P, out: P) -> jax.Array:
            g = g.astype(jnp.float32)  # compute params' (`compute_params`): reduced as every other
            split = mesh_lib.spec_axes(spec)
            scatter = [
                i for i, e in enumerate(out) if mesh_lib.DATA_AXIS in set(mesh_lib.entry_axes(e)) - split
            ]
            if scatter:
                g = fsdp.scatter_over_data(g, scatter[0], logical_axes(path, g.ndim))
                split = split | {mesh_lib.DATA_AXIS}
            g = self._pmean(g, tuple(a for a in mesh_lib.BATCH_AXES if a not in split))
            return g / math.prod(self.sizes[a] for a in mesh_lib.BATCH_AXES if a in split)

        return jax.tree_util.tree_map_with_path(one, grads, self.manual, out_specs)  # specs: up to grads
