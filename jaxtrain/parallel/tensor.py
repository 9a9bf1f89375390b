"""Tensor parallelism (Megatron): attention heads, the MLP hidden dim and the vocabulary split over
the `tensor` axis, which the step leaves to the compiler (GSPMD), guided by the model's logical
activation constraints (parallel/mesh.py's rules). Here: what the compiler does not place well
alone, written per device: a collective over another axis kept manual over tensor (`over_tensor`),
and the experts' hidden dim split (`split_experts`: XLA's partitioner does not split a ragged_dot).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.model.moe import Given, expert_mlps
from jaxtrain.parallel import mesh as mesh_lib


def over_tensor(fn: Any, x: Any, logical: tuple[str | None, ...], out: Any = None) -> Any:
    """fn(x) manual over `tensor` too, where x (a param of `logical` axes, or its gradient) is split
    over it: left automatic, XLA moved such arrays whole over tensor around a collective over
    another axis (all-gathers over tensor of 8 times the bytes). fn's output is laid out as x;
    `out(x's spec)` gives its specs where it is more than one such array."""
    mesh = jax.sharding.get_abstract_mesh()
    tensor = mesh_lib.tensor_part(logical, x.shape, mesh)
    if all(entry is None for entry in tensor):
        return fn(x)
    out_specs = tensor if out is None else out(tensor)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tensor,
        out_specs=out_specs,
        axis_names={mesh_lib.TENSOR_AXIS},
        check_vma=False,
    )(x)


def split_experts(
    rows: jax.Array,
    sizes: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    impl: str,
    routed: int | None = None,
    given: Given | None = None,
) -> jax.Array:
    """expert_mlps with each expert's hidden dim split over the tensor axis, if the step has one:
    each device runs its slice of every expert (Megatron's column then row split) and one psum adds
    them (`given`, pallas_fp8's operands as given: the rows and the output's gradient whole on each,
    the weights split as w_in and w_out, each expert's scale whole). Written per device because XLA's
    partitioner does not split a ragged_dot. On CPU the sums
    over tensor (the psum, and the rows' gradient, summed as it comes in) move in float32: XLA:CPU
    aborted on a bfloat16 all-reduce inside a shard_map manual over part of the mesh (a C++ check,
    "Invalid binary instruction opcode copy", jax 0.10.2), every bfloat16 mixture over tensor."""
    axes = nn.logical_to_mesh_axes(("mlp",))  # the step's rules: None outside a step
    axis = axes[0] if axes else None
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh.empty or axis in mesh.manual_axes or mesh.shape[axis] == 1:
        return expert_mlps(rows, sizes, w_in, w_out, impl, routed, given)
    spec_in = jax.sharding.PartitionSpec(*(None,) * (w_in.ndim - 1), axis)
    spec_out = jax.sharding.PartitionSpec(None, axis, None)
    whole = jax.sharding.PartitionSpec()
    given = given or Given()
    specs = Given(rows=whole, w_in=(spec_in, whole), w_out=(spec_out, whole), grad=whole)
    given_specs = Given(*(None if value is None else spec for value, spec in zip(given, specs, strict=True)))
    dtype = rows.dtype
    sums = jnp.float32 if mesh_lib.platform() == "cpu" else dtype

    def part(r: jax.Array, s: jax.Array, a: jax.Array, b: jax.Array, q: Any) -> jax.Array:
        y = expert_mlps(r.astype(dtype), s, a, b, impl, routed, q)
        return jax.lax.psum(y.astype(sums), axis).astype(y.dtype)

    return jax.shard_map(
        part,
        mesh=mesh,
        in_specs=(whole, whole, spec_in, spec_out, given_specs),
        out_specs=whole,
        axis_names={axis},
        # Unchecked, as the step's: the Pallas kernel's gradients vary over no axis, and jax's
        # check refused the weights' (varying over `tensor`) in the backward.
        check_vma=False,
    )(rows.astype(sums), sizes, w_in, w_out, given)
