"""The experts' grouped matmul in FP8 (`pallas_fp8`, asked for beside model.matmul fp8):
model/grouped_kernels.py's Hopper kernels on FP8 tiles, a custom_vjp as `ragged_matmul`.

    y = ragged_matmul_fp8(rows, w, sizes, routed)    # rows [m, k], w [E, k, n] bfloat16 -> [m, n]

Forward: the rows rounded to e4m3 by one scale, each expert's weights by its own (model/fp8.py's rule:
current, the smallest power of two at or above max / largest); dX and dW multiply the gradient
rounded to e5m2. Each kernel accumulates in float32 and multiplies a group's tile by its scales in
the epilogue (powers of two: exact). Two departures from model/fp8.py's dense dot, both forced:
- Mosaic's wgmma multiplies two operands of one FP8 type only (jax/experimental/mosaic/gpu/wgmma.py),
  so the backward rounds the saved e4m3 operands once more, to e5m2, and multiplies e5m2 by e5m2
  (the dense backward multiplies e5m2 by e4m3).
- The weights' scales are per expert: a scale over a device's experts would depend on which experts
  mesh.expert puts there (a layout would change the model), and the epilogue knows its group anyway.
The rows' scale is the device's routed rows' (as a batch shard's in fp8.py); rows past sum(sizes)
hold any bits (NaN among them), left out of the max (`_rows`) and never stored nor multiplied into
a routed row (the dW kernel zeroes them, and a neighbour's rows, in both operands).
Hopper's FP8 wgmma takes both operands K-major: the forward multiplies W^T [E, n, k] (an XLA
transpose of the FP8 weights), dX W as stored, dW rows^T [k, m] and gradient^T [n, m] (transposes
of FP8 buffers: half a bf16 transpose's bytes).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.model import fp8
from jaxtrain.model.grouped import FP8_FLOPS_SCOPE
from jaxtrain.model.grouped_kernels import ragged_dot, transposed_ragged_dot_fp8


def _rows(x: jax.Array, sizes: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Rows [m, k] -> rounded to FP8 `dtype` by the routed rows' scale, and that scale. The rows
    past sum(sizes) are left out of the max by a select inside its reduction (a product would keep
    a NaN) and rounded as they are: any bits, which no kernel stores or multiplies into a routed
    row. Zeroing them instead wrote the whole buffer once more in bf16 (XLA kept the select for
    both the max and the rounding): the dropless buffer holds mesh.expert times the routed rows."""
    routed = (jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None]
    scale = fp8.scale_for(jnp.max(jnp.where(routed, jnp.abs(x), 0)), dtype)
    return fp8.to_fp8(x, scale, dtype), scale


def _experts(w: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Weights [E, k, n] -> each expert's rounded to FP8 `dtype` by its own scale, and the scales [E]."""
    scales = jax.vmap(lambda we: fp8.scale_of(we, dtype))(w)
    return fp8.to_fp8(w, scales[:, None, None], dtype), scales


def _again(q: jax.Array) -> jax.Array:
    """An e4m3 operand rounded to e5m2 (its scale kept: e4m3's range is inside e5m2's)."""
    return q.astype(jnp.float32).astype(fp8.GRADIENT)


def _scoped(flops: float):  # type: ignore[no-untyped-def]
    return jax.named_scope(f"{FP8_FLOPS_SCOPE}{int(flops)}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ragged_matmul_fp8(
    rows: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    routed: int,
    interpret: bool = False,
    rounded: tuple[jax.Array, jax.Array] | None = None,
    w_rounded: tuple[jax.Array, jax.Array] | None = None,
    g_rounded: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """`grouped_kernels.ragged_matmul` (its arguments, its rows past sum(sizes)) in FP8 (module
    docstring): rows [m, k] sorted by expert x w [E, k, n] -> [m, n] bfloat16. `rounded`: the rows
    already in e4m3 and their scale (rows == their product), as the exchange delivers them
    (model/moe.py `Wire.rows_out`): multiplied as they are, no pass over the rows, which the
    forward then never reads (XLA drops what made them). The rows' gradient still goes to `rows`.
    `w_rounded`: the same for the weights, e4m3 [E, k, n] and each expert's scale [E] (fsdp's FP8
    gather: parallel/fsdp.py); w's gradient still goes to `w`. `g_rounded`: the gradient the
    output will get, already in e5m2 with its scale (model/moe.py `_routed_bwd`: by a scale
    shared over the devices it comes from): the backward multiplies it, not its cotangent (the
    same values: their product)."""
    return _forward(rows, w, sizes, routed, interpret, rounded, w_rounded, g_rounded)[0]


def _forward(rows, w, sizes, routed, interpret, rounded=None, w_rounded=None, g_rounded=None):  # type: ignore[no-untyped-def]
    xq, sx = _rows(rows, sizes, fp8.FORWARD) if rounded is None else rounded
    wq, sw = _experts(w, fp8.FORWARD) if w_rounded is None else w_rounded
    with _scoped(2.0 * routed * w.shape[1] * w.shape[2]):
        out = ragged_dot(xq, jnp.swapaxes(wq, 1, 2), sizes, True, interpret, sx * sw)
    # The FP8 operands are what the backward needs: half the bytes of rows and w.
    return out, (xq, sx, wq, sw, sizes, g_rounded)


def _backward(routed, interpret, saved, grad):  # type: ignore[no-untyped-def]
    xq, sx, wq, sw, sizes, g_rounded = saved
    gq, sg = _rows(grad, sizes, fp8.GRADIENT) if g_rounded is None else g_rounded
    flops = 2.0 * routed * wq.shape[1] * wq.shape[2]
    with _scoped(flops):  # w [E, k, n] is [E, N, K] for dX = g w^T: K-major as stored
        d_rows = ragged_dot(gq, _again(wq), sizes, True, interpret, sg * sw)
    with _scoped(flops):
        d_w = transposed_ragged_dot_fp8(
            _again(xq).T, gq.T, sizes, jnp.broadcast_to(sx * sg, sizes.shape), interpret
        )
    return d_rows, d_w, None, None, None, None  # none through the rounded operands: to `rows` and `w`


ragged_matmul_fp8.defvjp(_forward, _backward)
