"""FSDP (ZeRO-3) and ZeRO-1: params split over devices that each compute with them whole.

Under fsdp every large param, its gradient and both Adam moments are split over `fsdp` (and over
`expert` and `context` for the params their devices share: parallel/mesh.py `param_spec`). Inside
the step each layer's params are all-gathered as the layer runs (`Fsdp.gather`, the model's
Placement.gather), in the compute dtype, so autodiff turns each gather into a reduce-scatter of that
layer's gradient (`gather_param`): no full gradient is all-reduced over fsdp (tests/test_sharding.py
checks the compiled HLO). Why explicit collectives: GSPMD alone all-reduced the whole fsdp gradient
and then sliced it (XLA:CPU).

With `mesh.zero1` the params and the optimizer state are also split over `data`: the step gathers a
compute params once, before its shard_map (`Fsdp.compute_params`), and reduce-scatters the gradient over
data into the moments' layout (`scatter_over_data`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxtrain.model.params import logical_axes, path_names
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import tensor


def gather_param(p: jax.Array, axes: Any, dim: int, dtype: Any, reduce_dtype: Any) -> jax.Array:
    """The whole param from this device's shard on the manual `axes` (fsdp, and expert for a dense
    param: mesh_lib.param_spec), gathered in `dtype` (every use of a weight
    is in the compute dtype, and a cast commutes with a gather: the same values, a fraction of the
    bytes); its gradient is reduce-scattered in `reduce_dtype`, then held in the param's dtype."""

    @jax.custom_vjp
    def gather(x: jax.Array) -> jax.Array:
        return jax.lax.all_gather(x.astype(dtype), axes, axis=dim, tiled=True)

    def forward(x: jax.Array) -> tuple[jax.Array, None]:
        return gather(x), None

    def backward(_: None, g: jax.Array) -> tuple[jax.Array]:
        shard = jax.lax.psum_scatter(g.astype(reduce_dtype), axes, scatter_dimension=dim, tiled=True)
        return (shard.astype(p.dtype),)

    gather.defvjp(forward, backward)
    return gather(p)


def scatter_over_data(g: Any, dim: int, logical: tuple[str | None, ...]) -> Any:
    """ZeRO-1's reduce-scatter over `data` of a gradient (`logical` axes) on `dim` (`zero1_spec`);
    manual over tensor where that dim is not split over it. Left automatic beside a tensor axis,
    XLA moved the gradient whole over tensor (Llama 3 405B on 256 x 8: 86.9 GB a GPU, planned)."""
    scatter = functools.partial(
        jax.lax.psum_scatter, axis_name=mesh_lib.DATA_AXIS, scatter_dimension=dim, tiled=True
    )
    split = mesh_lib.tensor_part(logical, g.shape, jax.sharding.get_abstract_mesh())
    return scatter(g) if split[dim] is not None else tensor.over_tensor(scatter, g, logical)


class Fsdp:
    """The params' gathers inside the step: which dim of which param is gathered over which manual
    axes (from `param_specs`), in `dtype`, its gradient reduce-scattered in `reduce_dtype`.
    `gathers_once`: ZeRO-1's params (split over data) are gathered once a step, their weights in
    the compute dtype (`compute_params`)."""

    def __init__(self, param_specs: Any, dtype: Any, reduce_dtype: Any, gathers_once: bool) -> None:
        self.manual_by_path = mesh_lib.manual_by_path(param_specs)
        self.dtype, self.reduce_dtype, self.gathers_once = dtype, reduce_dtype, gathers_once

    def compute_params(self, params: Any, tied: bool) -> Any:
        """The params as the step computes with them, before its shard_map gathers them over data:
        the weights every use of which is in the compute dtype (kernels but the router's, an untied
        embedding) cast first, so the gather moves half the bytes, once a step, and no microbatch
        casts them again; their gradients come in the compute dtype, as the matmuls give them, and
        are summed in float32 (the microbatch sums, `reduce_grads`): the values of casting at use.
        Left as they are: what the layers gather (their gather casts, and its reduce-scatter keeps
        the gradient float32) and a tied embedding (its two uses' gradients would add in bfloat16)."""
        if not self.gathers_once:
            return params

        def one(path: tuple, p: jax.Array) -> jax.Array:
            names = path_names(path)
            weight = names[-1] == "kernel" and "router" not in names
            if not (weight or (names[-1] == "embedding" and not tied)):
                return p
            dim, axes = self._gathered(names, p.ndim)
            return p if dim is not None and axes is not None else p.astype(self.dtype)

        return jax.tree_util.tree_map_with_path(one, params)

    def gather(self, variables: Any, where: tuple[str, ...] = ()) -> Any:
        """Whole params of one layer (or embedding) from this device's fsdp shards, in the compute
        dtype; each gather's gradient is a reduce-scatter (`gather_param`)."""

        def one(path: tuple, p: jax.Array) -> jax.Array:
            names = (*where, *path_names(path)[1:])  # [0]: the collection
            logical = logical_axes(names, p.ndim)
            dim, axes = self._gathered(names, p.ndim)
            if dim is None or axes is None:
                return p
            gather = functools.partial(
                gather_param, axes=axes, dim=dim, dtype=self.dtype, reduce_dtype=self.reduce_dtype
            )
            # Manual over tensor too for the gather: left automatic, XLA first gathered the weight
            # whole over tensor, then over fsdp (the whole float32 weight on every device).
            return tensor.over_tensor(gather, p, logical)

        return jax.tree_util.tree_map_with_path(one, variables)

    def _gathered(self, names: tuple[str, ...], ndim: int) -> tuple[int | None, Any]:
        """(the dim `gather` gathers of the param at `names` with `ndim` dims, the mesh axes it
        gathers over): (None, ...) or (..., None) for a param each layer uses as it is."""
        dim = mesh_lib.fsdp_logical_dim(logical_axes(names, ndim))
        # Not over `pipeline`: a stack split over it there is regrouped by stage before any layer runs.
        entry = None if dim is None else mesh_lib.manual_of(names, ndim, self.manual_by_path)[dim]
        return dim, mesh_lib.entry_without(entry, mesh_lib.PIPELINE_AXIS)

    def whole_experts(self, variables: Any) -> Any:
        """A scanned stack's params with its experts' weights that no layer gathers cast to the
        compute dtype once for every layer, not in each: their gradients then stack over the
        layers in it, not in float32 (half the bytes; the same values: the experts' matmuls give
        their weight gradients in the compute dtype)."""

        def one(path: tuple, p: jax.Array) -> jax.Array:
            names = path_names(path)[1:]  # [0]: the collection
            if names[-3:-1] not in (("moe", "gate_up"), ("moe", "fc"), ("moe", "out")):
                return p
            dim, axes = self._gathered(names, p.ndim - 1)
            return p.astype(self.dtype) if dim is None or axes is None else p

        return jax.tree_util.tree_map_with_path(one, variables)
