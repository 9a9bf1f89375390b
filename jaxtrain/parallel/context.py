"""Context parallelism: long windows, each sequence split along its length over `context`.

Every token's work is local but attention's, which needs whole sequences: its queries, keys and
values are re-split by heads over context, an all-to-all each way (Ulysses: each device attends over
whole sequences for 1/context of its heads, the causal work alike on every device), and the plain
causal kernel runs per device (`attend`, the model's Placement.attend). The rules that split the
logical `length` over context are parallel/mesh.py's (CONTEXT_RULES).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def attend(
    kernel: Callable[..., jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None,
    impl: str,
) -> jax.Array:
    """The Placement's `attend` hook (model/attention.py): cuDNN's kernel, and any kernel on
    sequences split over context, run per device (`per_device`); XLA's on whole sequences as it is."""
    if impl == "cudnn" or context_axis() is not None:
        return per_device(kernel, q, k, v, segments)
    return kernel(q, k, v, segments)


def context_axis() -> str | None:
    """The mesh axis the step splits sequences over (the logical `length`), None if whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    axis = (nn.logical_to_mesh_axes(("length",)) or P(None))[0]
    return axis if isinstance(axis, str) and mesh.shape[axis] > 1 else None


def per_device(
    kernel: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None
) -> jax.Array:
    """kernel(q, k, v, segments) on each device's own rows and heads, manual over the mesh axes
    still automatic.

    cuDNN attention's custom partitioner cannot place a call inside a partly manual shard_map (the
    train step is manual over data and fsdp, automatic over tensor): XLA's GPU compiler stops on an
    AssertionError in it. With every mesh axis manual, jax lowers the kernel as is, so the
    automatic axes (tensor, context) become manual here, splitting heads as the model's logical
    activation axes place them. Outside any mesh the kernel runs as is.

    Sequences split over context are made whole for the kernel by an all-to-all that splits the
    device's heads instead (Ulysses: each device attends over whole sequences for 1/context of its
    heads, the causal work alike on every device), and back after it; key/value heads are repeated
    first where fewer than context x tensor. (Left to the compiler, the same re-split failed XLA's
    SPMD partitioner beside a tensor axis, jax 0.10.2.) Documents' segment ids are gathered whole,
    [B, T] int32, and the kernel turns them into its own form (cuDNN's packed offsets and lengths:
    model/documents.py `levels`): no T x S mask exists here either.
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = set(mesh.axis_names) - set(mesh.manual_axes)
    if mesh.empty or not auto:
        return kernel(q, k, v, segments)
    placed = nn.logical_to_mesh_axes(("batch", "length", "heads", None)) or P()
    spec = P(*(axis if axis in auto else None for axis in placed))
    context = context_axis()
    if context is not None:
        split = math.prod(int(mesh.shape[a]) for a in (spec[1], spec[2]) if a is not None)
        if k.shape[2] % split:  # each device's share of heads needs its own key/value heads
            repeat = split // math.gcd(k.shape[2], split)
            k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)

    def local(q: jax.Array, k: jax.Array, v: jax.Array, *segments: jax.Array) -> jax.Array:
        if context is None:
            return kernel(q, k, v, *segments, *(() if segments else (None,)))
        q, k, v = (jax.lax.all_to_all(x, context, 2, 1, tiled=True) for x in (q, k, v))
        whole = [jax.lax.all_gather(s, context, axis=1, tiled=True) for s in segments]
        y = kernel(q, k, v, whole[0] if whole else None)
        return jax.lax.all_to_all(y, context, 1, 2, tiled=True)

    operands = (q, k, v) if segments is None else (q, k, v, segments)
    in_specs = (spec,) * 3 + ((P(spec[0], spec[1]),) if segments is not None else ())
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=spec, axis_names=auto)(*operands)
