"""The device mesh and every sharding decision. Only this module knows the topology.

Data parallel today: a 1-D mesh with axis `data`; parameters and optimizer state are
replicated, batches are split on their first axis. An `fsdp` axis would be added here
(mesh shape, `param_sharding`, `BATCH_AXES`) without touching the model or the step.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
# Axes a batch is split over; an fsdp axis would join this tuple.
BATCH_AXES = (DATA_AXIS,)


def make_mesh(devices: list[jax.Device] | None = None) -> Mesh:
    """A mesh over every device of every process, with a named `data` axis."""
    devices = devices or jax.devices()
    return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def check_mesh(mesh: Mesh) -> None:
    """Fail early if code built for named axes meets a mesh without them."""
    missing = [a for a in BATCH_AXES if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"mesh axes {mesh.axis_names} lack {missing}")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_spec() -> P:
    """Rows split over the batch axes; everything else whole."""
    return P(BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec())


def param_sharding(mesh: Mesh, abstract_tree: Any) -> Any:
    """Sharding for every leaf of the train state: replicated under pure data parallelism."""
    return jax.tree.map(lambda _: replicated(mesh), abstract_tree)


def global_batch(local_rows: np.ndarray, mesh: Mesh, global_rows: int) -> jax.Array:
    """This process's rows of the global batch -> one global array sharded over `data`."""
    shape = (global_rows, *local_rows.shape[1:])
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local_rows, shape)


def local_copy(tree: Any) -> Any:
    """Host numpy copy of a replicated tree from this process's own shard (no collective)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
