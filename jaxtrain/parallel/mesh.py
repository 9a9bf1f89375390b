"""The device mesh and every sharding decision. Only this module knows the topology.

The mesh is pipeline x data x expert x fsdp x context x tensor (config `mesh`):
  pipeline stages: each holds a run of consecutive layers of the scanned stack (its `layers` dim
          split, or where the stages do not divide the layers its d_model dim, regrouped in the
          step), and activations pass from stage to stage (parallel/pipeline.py). Outermost: across hosts.
  data    replicas; the outer axis, spanning processes (hosts). Batch rows split over it.
  expert  MoE: each device holds its share of every MoE layer's experts and receives the tokens
          routed to them by all-to-all (model/moe.py). Batch rows split over it too, and every
          other param is split over it as over fsdp (`param_spec`).
  fsdp    ZeRO-3: every large parameter, its gradient and both Adam moments split over it, and
          the batch rows too. Params are all-gathered for compute and gradients reduce-scattered.
  context long windows: each sequence split along its length; every token's work is local, and
          attention takes whole sequences for a share of the heads (an all-to-all each way).
  tensor  Megatron: attention heads, the MLP hidden dim and the vocabulary split over it; the
          residual stream is whole, so a layer needs one collective in and one out.
With `mesh.zero1` the params and the optimizer state are also split over `data`: each data shard
updates its slice, and the step gathers the params once, their weights in the compute dtype.

The model names the logical axes of its params and activations (model/params.py PARAM_AXES); the tables
below map logical axes to mesh axes, in one place. Devices are ordered by process, so `data`
is the axis that crosses hosts and fsdp x context x tensor groups stay inside one (one NVLink domain);
with `mesh.expert_inner` expert is laid inside fsdp instead (`device_grid`): expert groups stay
inside a host and fsdp crosses hosts.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import MESH_AXES, MeshConfig
from jaxtrain.model.params import path_names

log = logging.getLogger("jaxtrain")

PIPELINE_AXIS, DATA_AXIS, EXPERT_AXIS, FSDP_AXIS, CONTEXT_AXIS, TENSOR_AXIS = MESH_AXES
# Axes a batch is split over (a tensor group shares its rows); the step runs manual over these
# (and over `pipeline` when it has stages: each stage sees every row of its batch shard).
BATCH_AXES = (DATA_AXIS, EXPERT_AXIS, FSDP_AXIS)

# Logical axis of a parameter -> mesh axis. `embed` (d_model) is the dim FSDP splits: every
# matrix and embedding has one, and d_model is a multiple of the fsdp size in every sane shape.
PARAM_RULES: dict[str, str | None] = {
    "vocab": TENSOR_AXIS,
    "heads": TENSOR_AXIS,
    "mlp": TENSOR_AXIS,
    "embed": FSDP_AXIS,
    # Multi-head latent attention's up-projections from the latent (model/mla.py) have no d_model
    # dim: fsdp splits the latent's (left whole they were 3.2B params on every GPU, DeepSeek-V3).
    "latent": FSDP_AXIS,
    "expert": EXPERT_AXIS,
    "layers": PIPELINE_AXIS,  # a scanned stack's layer dim: each stage holds its run of layers
}
# Logical axis of an activation inside the step -> mesh axis. The step is already manual over
# the batch axes (each device holds its own rows), so only the tensor axis is left to place;
# `expert` names the (manual) axis MoE layers exchange tokens over (EXPERT_RULES).
ACTIVATION_RULES = (("heads", TENSOR_AXIS), ("mlp", TENSOR_AXIS), ("vocab", TENSOR_AXIS))
EXPERT_RULES = (("expert", EXPERT_AXIS),)
# Context parallelism: activations split along the sequence (`length`), left to the compiler as
# tensor is. Attention needs whole sequences: model/attention.py re-splits its queries, keys and
# values by heads over context, an all-to-all each way (Ulysses), and runs the plain causal kernel.
CONTEXT_RULES = (("length", CONTEXT_AXIS),)
# Axes a dense model's mesh leaves at 1 unless asked for: unsaid in what is printed.
OPTIONAL_AXES = (PIPELINE_AXIS, EXPERT_AXIS, CONTEXT_AXIS)


def platform() -> str | None:
    """The platform the traced step compiles for ("cpu", "gpu", ...), None outside a mesh."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else None


def activation_rules(mesh: Any) -> tuple[tuple[str, str], ...]:
    """The logical activation axes the step places on `mesh`'s axes (those larger than 1).

    With sequences split over context, the logits are not split over tensor by vocabulary: XLA's
    SPMD partitioner aborts on the loss over logits split both ways (a CHECK in
    spmd_partitioner_util.cc, jax 0.10.2, CPU); each tensor peer computes its tokens' whole logits.
    """
    tensor, context = mesh.shape[TENSOR_AXIS] > 1, mesh.shape[CONTEXT_AXIS] > 1
    return (
        tuple(rule for rule in ACTIVATION_RULES if tensor and not (context and rule[0] == "vocab"))
        + (CONTEXT_RULES if context else ())
        + (EXPERT_RULES if mesh.shape[EXPERT_AXIS] > 1 else ())
    )


def make_mesh(devices: list[jax.Device] | None = None, shape: MeshConfig | None = None) -> Mesh:
    """A pipeline x data x expert x fsdp x context x tensor mesh over `devices` (default: every
    device of every process), laid out by `device_grid`.

    `shape` must be resolved (config.with_topology); None means pure data parallelism.
    """
    devices = devices or jax.devices()
    if shape is None:
        shape = MeshConfig(data=len(devices))
    return Mesh(device_grid(devices, shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_grid(devices: list[Any], shape: MeshConfig) -> np.ndarray:
    """`devices` as an array of the mesh's axes (MESH_AXES order), process-major: consecutive
    devices share a host, so the inner axes stay on one. With `expert_inner` the devices are laid
    out with expert inside fsdp (each expert group on consecutive devices); the axes keep their
    order."""
    laid = list(MESH_AXES)
    if shape.expert_inner:
        e, f = laid.index(EXPERT_AXIS), laid.index(FSDP_AXIS)
        laid[e], laid[f] = laid[f], laid[e]
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.asarray(ordered, dtype=object).reshape([getattr(shape, a) for a in laid])
    return grid.transpose([laid.index(a) for a in MESH_AXES])


def expert_inner(mesh: Mesh) -> bool:
    """Whether the devices are laid out with expert inside fsdp (make_mesh's `expert_inner`): the
    next device along expert comes before the next along fsdp in process-major order."""
    if mesh.shape[EXPERT_AXIS] == 1 or mesh.shape[FSDP_AXIS] == 1:
        return False
    order = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
    second = {
        a: np.take(mesh.devices, 1, axis=mesh.axis_names.index(a)).flat[0] for a in (EXPERT_AXIS, FSDP_AXIS)
    }
    return order.index(second[EXPERT_AXIS]) < order.index(second[FSDP_AXIS])


def host_warnings(mesh: Mesh) -> list[str]:
    """One line for each axis whose collectives cross hosts when they need not (data is the axis
    meant to): fsdp x tensor past a host's devices, or an expert group with peers on another host
    (groups stride by fsdp x tensor inside `data`, so read off the device grid). Empty on one host."""
    hosts = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    per_process = int((hosts == hosts.flat[0]).sum())
    said = []
    group = [a for a in (FSDP_AXIS, CONTEXT_AXIS, TENSOR_AXIS) if a != CONTEXT_AXIS or mesh.shape[a] > 1]
    inner, named = math.prod(mesh.shape[a] for a in group), " x ".join(group)
    if inner > per_process and not expert_inner(mesh):  # there fsdp spans hosts as asked
        said.append(
            f"mesh {named} = {inner} devices spans hosts ({per_process} devices per process): its "
            "all-gathers and reduce-scatters of params and gradients (and tensor parallelism's per-layer "
            "all-reduces) cross the network, ~10-20x slower than NVLink; where the train state fits "
            f"{per_process} devices, {named} <= {per_process} with data across hosts keeps them "
            "inside a host, though a wider fsdp can still be faster (a smaller data all-reduce): "
            "scripts/plan.py --search ranks the layouts"
        )
    if spans_hosts(mesh, EXPERT_AXIS):
        said.append(
            f"mesh expert {mesh.shape[EXPERT_AXIS]} spans hosts ({per_process} devices per process): each "
            "MoE layer's token all-to-alls (forward and backward) cross the network; keep expert x fsdp "
            f"x tensor <= {per_process} (experts inside a host) with data across hosts, or send each "
            f"token once a host (mesh.expert_node {per_process} with mesh.expert_inner)"
        )
    return said


def spans_hosts(mesh: Mesh, axis: str) -> bool:
    """Whether a group of `axis` has devices in more than one process (host)."""
    hosts = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    return bool((hosts != hosts.take([0], axis=mesh.axis_names.index(axis))).any())


def per_process(mesh: Mesh, axis: str) -> int:
    """The devices of a group of `axis` in one process (host): its size where it spans none."""
    group = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])[0]
    return sum(d.process_index == group[0].process_index for d in group)


def check_mesh(mesh: Mesh) -> None:
    """Fail early if code built for named axes meets a mesh without them."""
    missing = [a for a in MESH_AXES if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"mesh axes {mesh.axis_names} lack {missing}")


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """Axis sizes by name; `pipeline`, `expert` and `context` only when used (a mesh reads as it
    did before them)."""
    return {a: int(mesh.shape[a]) for a in MESH_AXES if a not in OPTIONAL_AXES or mesh.shape[a] > 1}


def describe(mesh: Mesh) -> str:
    inner = " (expert inside fsdp)" if expert_inner(mesh) else ""
    return " x ".join(f"{a} {n}" for a, n in mesh_shape(mesh).items()) + inner


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_spec() -> P:
    """Rows split over the batch axes; everything else whole."""
    return P(BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec())


def param_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """Mesh spec of one param from its logical axes; a dim the axis does not divide stays whole.

    The dim fsdp splits is split over `expert` and `context` too, ZeRO over every device that
    computes with the whole param on rows of its own: a context group holds its params once, not
    `context` times, and so does an expert group its dense params (attention, embeddings, norms'
    neighbours: the expert axis folds onto the dense part's fsdp shards, as Megatron's Parallel
    Folding puts the expert layout on the dense part's data devices). Each layer's gradient is
    reduce-scattered over them, not all-reduced. A param with experts keeps `expert` on its
    expert dim. A scanned stack whose layers the pipeline does not divide (126 over 32) keeps
    them whole and is split over `pipeline` on that dim too, innermost of the manual axes (each
    stage's layers are regrouped from it in the step: parallel/pipeline.py `_on_stage`)."""
    uneven = "layers" in logical and shape[logical.index("layers")] % mesh.shape[PIPELINE_AXIS] != 0
    fsdp_axes = (
        FSDP_AXIS,
        *((EXPERT_AXIS,) if "expert" not in logical else ()),
        *((PIPELINE_AXIS,) if uneven else ()),
        CONTEXT_AXIS,
    )
    out: list[Any] = []
    for name, dim in zip(logical, shape, strict=True):
        axis = PARAM_RULES.get(name) if name else None
        axes = [a for a in (fsdp_axes if axis == FSDP_AXIS else (axis,)) if a and mesh.shape[a] > 1]
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes.pop()  # context, pipeline, then expert: fsdp alone where the dim does not split every way
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*out)


def zero1_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """ZeRO-1: `spec` with one more dim (the largest that divides) split over `data`: an optimizer
    moment's, and the step's gradient, reduce-scattered into it (run/step.py reduce_grads). On that
    dim `data` goes after the manual axes already there and before the automatic ones: a device's
    reduce-scatter over data of the block it holds then lands exactly its moments' slice."""
    n = mesh.shape[DATA_AXIS]
    if n == 1:
        return spec
    manual = {*BATCH_AXES, PIPELINE_AXIS}
    parts = list(spec) + [None] * (len(shape) - len(spec))
    held_by = [entry_axes(part) for part in parts]
    # A stack split over pipeline by d_model (param_spec) takes `data` there first, then any dim
    # not split over tensor: dims the step's reduce-scatter splits manual over tensor, without
    # moving the tensor shards (`scatter_over_data`).
    regrouped = [i > 0 and PIPELINE_AXIS in held_by[i] for i in range(len(shape))]
    order = sorted(range(len(shape)), key=lambda i: (not regrouped[i], TENSOR_AXIS in held_by[i], -shape[i]))
    for i in order:
        held = held_by[i]
        if shape[i] % (n * math.prod(mesh.shape[a] for a in held)) == 0:
            parts[i] = (*(a for a in held if a in manual), DATA_AXIS, *(a for a in held if a not in manual))
            return P(*parts)
    return spec


def state_specs(abstract_state: Any, param_axes: Any, mesh: Mesh, zero1: bool) -> Any:
    """PartitionSpec of every leaf of the train state.

    Params follow their logical axes. Each optimizer moment mirrors its param (optax keeps the
    param tree inside its state). Under ZeRO-1 both add `data`: no data shard holds more of the
    float32 params than it updates (the step gathers its compute params: run/step.py). Counters and
    scalars are replicated.
    """
    param_specs = jax.tree.map(
        lambda ax, a: param_spec(ax, a.shape, mesh), param_axes, abstract_state.params, is_leaf=_is_axes
    )
    by_shape_path = {
        path_names(path): spec for path, spec in jax.tree_util.tree_flatten_with_path(param_specs)[0]
    }

    def opt_leaf(path: tuple, leaf: Any) -> P:
        spec = _match_param(path, by_shape_path)
        if spec is None or not leaf.shape:
            return P()
        return zero1_spec(spec, leaf.shape, mesh) if zero1 else spec

    opt_specs = jax.tree_util.tree_map_with_path(opt_leaf, abstract_state.opt_state)
    if zero1:
        param_specs = jax.tree.map(
            lambda s, a: zero1_spec(s, a.shape, mesh), param_specs, abstract_state.params
        )
    return abstract_state.replace(
        params=param_specs,
        opt_state=opt_specs,
        **{k: P() for k in ("step", "loss_scale", "good_steps", "bad_steps", "skipped_steps")},
    )


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _match_param(path: tuple, param_paths: dict[tuple[str, ...], P]) -> P | None:
    """The spec of the param an optimizer leaf belongs to: its path ends with the param's path."""
    key = path_names(path)
    for n in range(len(key), 0, -1):
        if key[-n:] in param_paths:
            return param_paths[key[-n:]]
    return None


def shardings(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one spec entry (None, an axis or a tuple of axes)."""
    return entry if isinstance(entry, tuple) else (entry,) if entry else ()


def spec_axes(spec: P) -> set[str]:
    """The mesh axes a spec splits over."""
    return {a for entry in spec for a in entry_axes(entry)}


def _only(entry: Any, axes: Any) -> Any:
    """One spec entry with only the axes in `axes`."""
    left = tuple(a for a in entry_axes(entry) if a in axes)
    return left if len(left) > 1 else left[0] if left else None


def entry_without(entry: Any, axis: str) -> Any:
    """One spec entry without `axis`."""
    return _only(entry, set(MESH_AXES) - {axis})


def without(spec: P, axis: str) -> P:
    """`spec` without `axis` anywhere."""
    return P(*(entry_without(e, axis) for e in spec))


def manual_part(spec: P) -> P:
    """The part of a spec on the manual (batch and pipeline) axes: what shard_map's in/out specs name."""
    return P(*(_only(e, {*BATCH_AXES, PIPELINE_AXIS}) for e in spec))


def manual_by_path(param_specs: Any) -> dict[tuple[str, ...], P]:
    """Each param's manual spec (`manual_part`) by its path's names, for `manual_of`."""
    flat = jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {path_names(path): manual_part(spec) for path, spec in flat}


def manual_of(names: tuple[str, ...], ndim: int, by_path: dict[tuple[str, ...], P]) -> P:
    """The manual spec of the param whose path ends with `names` (one layer of a scanned stack
    included: its last `ndim` dims). Every param a layer gathers is in `by_path`."""
    # A dense and an MoE stack may both end with `names`: same logical axes, same dims, same spec.
    spec = next((spec for path, spec in by_path.items() if path[-len(names) :] == names), None)
    if spec is None:
        raise KeyError(f"no param ends with {'/'.join(names)}")
    entries = list(spec) + [None] * (ndim - len(spec))
    return P(*entries[len(entries) - ndim :])


def fsdp_logical_dim(logical: tuple[str | None, ...]) -> int | None:
    """The dim of a param FSDP splits, from its logical axes (config checks it divides)."""
    return next((i for i, name in enumerate(logical) if name and PARAM_RULES.get(name) == FSDP_AXIS), None)


def tensor_part(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Any) -> P:
    """The part of a param's spec on `tensor`, the axis the step leaves automatic (what a gather
    inside the step must keep split, so it moves only this device's tensor shard)."""
    spec = param_spec(logical, shape, mesh)
    return P(*(entry if entry == TENSOR_AXIS else None for entry in spec))


def bytes_per_device(abstract_tree: Any, specs: Any, mesh: Mesh) -> int:
    """Bytes one device holds of a tree laid out by `specs` (the largest share; shards are even)."""
    total = 0
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for leaf, spec in zip(jax.tree.leaves(abstract_tree), spec_leaves, strict=True):
        split = math.prod(mesh.shape[a] for entry in spec for a in entry_axes(entry))
        total += math.prod(leaf.shape) * leaf.dtype.itemsize // split
    return total


def data_share(mesh: Mesh) -> tuple[int, int]:
    """(which, of how many): this process's part of each global batch, the rows its devices hold.
    Rows split over the batch axes (data, expert, fsdp, in that order) and every device of a
    pipeline, context or tensor group holds the same ones, so processes that share such a group
    (a context group over two hosts) load the same part, and each process of a wider batch split
    its own (a process holding a whole stage of the pipeline loads all of it). A process's blocks of
    rows need not be one run (`expert_inner`: an expert group's blocks stride by fsdp); jax lays
    its part into them in order."""
    grid = mesh.devices
    axes = [mesh.axis_names.index(a) for a in BATCH_AXES]
    index = np.indices(grid.shape)
    block = np.ravel_multi_index([index[a] for a in axes], [grid.shape[a] for a in axes])
    processes = np.vectorize(lambda d: d.process_index, otypes=[int])(grid)
    held = {p: tuple(np.unique(block[processes == p])) for p in np.unique(processes)}
    shares = sorted(set(held.values()))  # processes holding the same rows share one
    assert len({b for s in shares for b in s}) == sum(map(len, shares)), shares  # disjoint, or equal
    return shares.index(held[jax.process_index()]), len(shares)


def global_batch(local_rows: np.ndarray, mesh: Mesh, global_rows: int) -> jax.Array:
    """This process's rows of the global batch -> one global array sharded over the batch axes."""
    shape = (global_rows, *local_rows.shape[1:])
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local_rows, shape)


def host_copy(tree: Any) -> Any:
    """Whole host numpy copy of a (possibly sharded) tree; every process must call it."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def manual_axes(mesh: Mesh) -> set[str]:
    """The axes the step runs manual over: the batch axes, and `pipeline` when it has stages (one
    stage stays out, so a mesh without a pipeline compiles the program it did before pipelines)."""
    return set(BATCH_AXES) | ({PIPELINE_AXIS} if mesh.shape[PIPELINE_AXIS] > 1 else set())
