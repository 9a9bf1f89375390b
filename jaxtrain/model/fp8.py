"""FP8 matmuls (model.matmul fp8): a `dot_general` whose operands are rounded to FP8, each tensor
scaled by its own current maximum, for `nn.DenseGeneral(dot_general=...)` (model/layers.py `dense`).

    y = fp8_dot_general(x, w, dimension_numbers)   # x, w bfloat16: y bfloat16

The forward multiplies e4m3 operands (3 mantissa bits, range 448), both backward GEMMs the e5m2
incoming gradient (2 mantissa bits, range 57344: gradients span more octaves) against the saved e4m3
operands. Each operand is written as XLA's GPU compiler recognises a scaled FP8 GEMM: convert(f8) ->
bf16, times a scalar scale, into the dot (on an H100 cuBLASLt's FP8 GEMM, `__cublas$lt$matmul$f8`,
when Triton GEMMs are off: docs/fp8.md). XLA:CPU runs the same program, the same roundings.

Scaling: per tensor, current (torchtitan's "tensorwise" default): the scale is computed from the
tensor in the step, so it carries no state (checkpoints do not depend on it; a resume is bitwise).
Each scale is a power of two (the smallest at or above the tensor's max over the format's largest
value): exact in bfloat16, so quantize and dequantize round only once; a batch shard's scale equals
the whole batch's unless their maxima straddle a power of two (the step runs the model per batch
shard); and rounding a rounded tensor again changes no value, so fsdp can gather a weight already
rounded by the whole weight's scale (parallel/fsdp.py) and the dot's own rounding keeps it as it is.
Where a weight was rounded once already (fsdp's gather, the pipeline's once-a-step cast), its e4m3
bytes and scale (`QUANTIZED`, `SCALE` beside its kernel) are multiplied as they are
(`fp8_dot_quantized`): the same values, without a pass over the weight in every GEMM.
Where tensor parallelism cuts an activation or a gradient, each device's block of it has a scale
of its own (`tensor_blocks`): no max is taken across devices. Under remat the activations' scales
are saved for the recompute (`saving_scales`).
A non-finite tensor gives a non-finite scale and a non-finite result, which the step skips.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

FORWARD = jnp.float8_e4m3fn
GRADIENT = jnp.float8_e5m2
# A projection's weight already rounded to FORWARD (the e4m3 array) and its scale, beside its kernel
# in the variables a layer computes with (put there by parallel/fsdp.py and parallel/pipeline.py).
QUANTIZED = "fp8_kernel"
TRANSPOSED = "fp8_kernel_t"  # QUANTIZED laid out for the forward GEMM (`fp8_dot_quantized`), where given
SCALE = "fp8_scale"
# The name of an activation's scale (`activation_scale`) for remat: `saving_scales` keeps these.
SAVED = "fp8_activation_scale"
# The name scope of every product rounded to FP8 here, forward and backward: a compiled program's
# GEMMs under it must be FP8 GEMMs on a GPU (observe/gemms.py, checked where a job starts).
SCOPE = "fp8_dot"

# The projections model.matmul fp8 multiplies in FP8 (each `layers.dense(..., matmul=cfg.matmul)`),
# by their param path's (module, layer) ending: what fsdp may gather as FP8 (`projection`).
PROJECTIONS = frozenset(
    {("attn", name) for name in ("qkv", "q", "kv", "out", "q_a", "q_b", "kv_a", "kv_b")}
    | {("mlp", name) for name in ("fc", "gate_up", "out")}
    | {("moe", name) for name in ("shared_fc", "shared_gate_up", "shared_out")}  # the shared experts' mlp()
)


def projection(names: tuple[str, ...]) -> bool:
    """Whether the param at path `names` is a kernel that model.matmul fp8 multiplies in FP8."""
    return names[-1:] == ("kernel",) and names[-3:-1] in PROJECTIONS


# A mixture's routed experts' stacked weights [E, ...] (model/moe.py `_Stack`): FP8 under
# model.moe.grouped_matmul pallas_fp8, one scale an expert (model/grouped_fp8.py).
EXPERTS = frozenset({("moe", name) for name in ("gate_up", "fc", "out")})


def experts(names: tuple[str, ...]) -> bool:
    """Whether the param at path `names` is a stack of routed experts' weights (`EXPERTS`)."""
    return names[-1:] == ("kernel",) and names[-3:-1] in EXPERTS


# A tensor's scales, one a block: (axis, n), its `axis` cut into n equal blocks; WHOLE: one scale.
Blocks = tuple[int, int]
WHOLE: Blocks = (0, 1)


def scale_of(x: jax.Array, dtype: Any, blocks: Blocks = WHOLE) -> jax.Array:
    """float32: the scale of x for FP8 `dtype` (`scale_for` its max|x|), a scalar; with `blocks`
    (axis, n > 1) one a block, each of its block's max, shaped [1, ..., n, 1, ...] to scale x's
    blocked view (`_view`: `axis` cut into n and the rest)."""
    axis, n = blocks
    if n == 1:
        return scale_for(jnp.max(jnp.abs(x)), dtype)
    view = x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1 :])
    kept = tuple(d for d in range(view.ndim) if d != axis)
    return scale_for(jnp.max(jnp.abs(view), axis=kept, keepdims=True), dtype)


def _blocked(x: jax.Array, scale: jax.Array) -> bool:
    """Whether `scale` is x's blocked scale (`scale_of` with blocks): one dim more than x, the view's.
    Any other scale broadcasts against x as it is (a scalar; the experts' [E, 1, 1])."""
    return scale.ndim == x.ndim + 1


def _view(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x as its blocked `scale` (`scale_of`) scales it: the axis of scale's n blocks cut into n."""
    axis = next(d for d, size in enumerate(scale.shape) if size > 1)
    n = scale.shape[axis]
    return x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1 :])


def tensor_blocks(
    kernel_axes: tuple[str | None, ...],
    dims: Any,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    split: frozenset[str],
    n: int,
) -> tuple[Blocks, Blocks]:
    """(x's blocks, the output gradient's) for a dense of kernel logical axes `kernel_axes` whose
    `split` axes tensor parallelism cuts n ways: where it cuts a dim the dot contracts (a
    row-parallel dot: attention's and the MLP's output projections) x is scaled one block a tensor
    shard along x's matching dim, and where it cuts a dim the output keeps (a column-parallel dot:
    q, kv, gate_up) so is the output's gradient along it; WHOLE elsewhere, or where n does not
    divide the dim. Each device then takes its block's max alone: a tensor-wide max is an all-reduce
    over tensor, which the step waits on (Llama 3 70B on 128 x 8: 3 a layer in the backward, each
    behind the layer's fsdp reduce-scatter across hosts, docs/fp8.md)."""
    (lc, rc), batch = dims
    if n == 1 or batch != ((), ()):
        return WHOLE, WHOLE
    x_blocks = next(
        ((i, n) for i, r in zip(lc, rc, strict=True) if kernel_axes[r] in split and x_shape[i] % n == 0),
        WHOLE,
    )
    kept = [d for d in range(len(w_shape)) if d not in rc]
    out = len(x_shape) - len(lc)  # the output: x's kept dims, then the kernel's
    g_blocks = next(
        ((out + j, n) for j, d in enumerate(kept) if kernel_axes[d] in split and w_shape[d] % n == 0), WHOLE
    )
    return x_blocks, g_blocks


def scale_for(amax: jax.Array, dtype: Any) -> jax.Array:
    """float32 scalar: the smallest power of two 2^e at or above `amax` / `dtype`'s largest value, so
    a tensor of that max divided by it fits the format (amax 0: taken as 1, zeros stay zeros; a NaN or
    inf amax is the scale). At, not only above: a rounded tensor's max (at most the largest value
    times s) then gives s again, or s / 2 when it is half of that, where every value doubles exactly:
    rounding it again changes nothing (fsdp's FP8 gathers rely on it)."""
    amax = amax.astype(jnp.float32)
    # frexp and ldexp, not exp2(ceil(log2)): XLA:CPU's exp2(-15.0) is not exactly 2^-15.
    m, e = jnp.frexp(jnp.where(amax == 0, 1.0, amax) / float(jnp.finfo(dtype).max))
    e = jnp.where(m == 0.5, e - 1, e)  # amax / largest is 2^(e-1) exactly: that is the scale
    return jnp.where(jnp.isfinite(amax), jnp.ldexp(jnp.float32(1), e), amax)


def activation_scale(x: jax.Array, blocks: Blocks = WHOLE) -> jax.Array:
    """x's FORWARD scale (by `blocks`), named SAVED: a policy from `saving_scales` keeps it for the
    backward, so remat's recompute of the forward rounds x by the saved scale (the same value)
    rather than taking x's max again, where x is split over a mesh axis an all-reduce the recompute
    would wait on (docs/fp8.md). No gradient flows through a scale."""
    return checkpoint_name(scale_of(jax.lax.stop_gradient(x), FORWARD, blocks), SAVED)


def saving_scales(matmul: str, policy: Any = None) -> Any:
    """The remat policy for model.matmul `matmul`: `policy` (None: save nothing), and under fp8 the
    activations' scales too: one float32 a projection a layer, which spare the recompute their maxima
    (`activation_scale`)."""
    if matmul != "fp8":
        return policy
    names = jax.checkpoint_policies.save_only_these_names(SAVED)
    return names if policy is None else jax.checkpoint_policies.save_from_both_policies(policy, names)


def to_fp8(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """x divided by `scale` and rounded to FP8 `dtype` (a scale from `scale_of`, of x or of a whole
    tensor x is a part of, or any scale that broadcasts against x; a blocked one, `_blocked`, divides
    each block by its own)."""
    if not _blocked(x, scale):
        return (x.astype(jnp.float32) / scale).astype(dtype)
    return (_view(x, scale).astype(jnp.float32) / scale).astype(dtype).reshape(x.shape)


def quantize(x: jax.Array, dtype: Any, blocks: Blocks = WHOLE) -> tuple[jax.Array, jax.Array]:
    """x rounded to FP8 `dtype` after dividing by its scale (one a block: `blocks`), and the scale."""
    scale = scale_of(x, dtype, blocks)
    return to_fp8(x, scale, dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """The pattern XLA's GPU GEMM rewriter folds into an FP8 GEMM: convert, then a scalar multiply.
    A blocked scale multiplies each block by its own: where the blocks are the tensor shards, each
    device's block is one scalar after XLA's partitioner, and the pattern is the same (an H100
    program keeps its cuBLASLt FP8 GEMMs: tests/test_gpu_compile.py)."""
    if not _blocked(q, scale):
        return q.astype(dtype) * scale.astype(dtype)
    return (_view(q, scale).astype(dtype) * scale.astype(dtype)).reshape(q.shape)


def _dot(x: jax.Array, w: jax.Array, dims: Any) -> jax.Array:
    return jax.lax.dot_general(x, w, dims)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_dot(x: jax.Array, w: jax.Array, sx: jax.Array, dims: Any, g_blocks: Blocks) -> jax.Array:
    return _fp8_forward(x, w, sx, dims, g_blocks)[0]


def _in_step(wq: jax.Array, sx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(wq, sx) through an optimization barrier: the weight's FP8 array tied to the activation's scale,
    a value of this microbatch. In a loop over microbatches (the pipeline's ticks) the weight's
    dequantize is loop-invariant, and XLA's loop-invariant code motion hoisted it out of the loop as a
    bf16 array: the GEMM inside, no longer fed an FP8 operand, compiled to a bf16 one (Llama 3 405B
    on 256 x 8: the forward's 60 projection GEMMs and the head's 7, of 257). The weight's own max and
    rounding, before the barrier, are still hoisted: made once for every microbatch."""
    return jax.lax.optimization_barrier((wq, sx))


def _fp8_forward(
    x: jax.Array, w: jax.Array, sx: jax.Array, dims: Any, g_blocks: Blocks
) -> tuple[jax.Array, Any]:
    xq, (wq, sw) = to_fp8(x, sx, FORWARD), quantize(w, FORWARD)
    wq, sx = _in_step(wq, sx)
    y = _dot(dequantize(xq, sx, x.dtype), dequantize(wq, sw, w.dtype), dims)
    # The FP8 operands are what the backward needs: half the bytes of saving x and w.
    return y, (xq, sx, wq, sw)


def _fp8_backward(dims: Any, g_blocks: Blocks, saved: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    xq, sx, wq, sw = saved
    gq, sg = quantize(g, GRADIENT, g_blocks)
    x, w = dequantize(xq, sx, g.dtype), dequantize(wq, sw, g.dtype)
    # dot_general's own transpose rule writes both GEMMs (dx = g . w^T, dw = x^T . g) for any
    # dimension numbers; each multiplies the dequantized e5m2 gradient by a dequantized e4m3 operand.
    _, vjp = jax.vjp(lambda a, b: _dot(a, b, dims), x, w)
    dx, dw = vjp(dequantize(gq, sg, g.dtype))
    return dx, dw


def _fp8_dot_backward(dims: Any, g_blocks: Blocks, saved: Any, g: jax.Array) -> tuple[jax.Array, ...]:
    dx, dw = _fp8_backward(dims, g_blocks, saved, g)
    return dx, dw, jnp.zeros_like(saved[1])  # none reaches the scale


_fp8_dot.defvjp(_fp8_forward, _fp8_dot_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _quantized_dot(
    x: jax.Array,
    w: jax.Array,
    wq: jax.Array,
    wt: jax.Array | None,
    sw: jax.Array,
    sx: jax.Array,
    dims: Any,
    g_blocks: Blocks,
) -> jax.Array:
    return _quantized_forward(x, w, wq, wt, sw, sx, dims, g_blocks)[0]


def _quantized_forward(
    x: jax.Array,
    w: jax.Array,
    wq: jax.Array,
    wt: jax.Array | None,
    sw: jax.Array,
    sx: jax.Array,
    dims: Any,
    g_blocks: Blocks,
) -> tuple[jax.Array, Any]:
    # w's values are not read: wq and sw are its rounding (`fp8_dot_quantized`); w carries the gradient.
    xq = to_fp8(x, sx, FORWARD)
    if wt is None:
        wq_step, sx = _in_step(wq, sx)
        y = _dot(dequantize(xq, sx, x.dtype), dequantize(wq_step, sw, w.dtype), dims)
    else:  # wq with its contracted dims last: the forward GEMM's layout (`fp8_dot_quantized`)
        wt, sx = _in_step(wt, sx)
        y = _dot(dequantize(xq, sx, x.dtype), dequantize(wt, sw, w.dtype), _contracting_last(dims, wq.ndim))
    return y, (xq, sx, wq, sw)


def _quantized_backward(dims: Any, g_blocks: Blocks, saved: Any, g: jax.Array) -> tuple[Any, ...]:
    dx, dw = _fp8_backward(dims, g_blocks, saved, g)
    _, sx, wq, sw = saved
    return dx, dw, jnp.zeros_like(wq), None, jnp.zeros_like(sw), jnp.zeros_like(sx)  # none reaches a rounding


_quantized_dot.defvjp(_quantized_forward, _quantized_backward)


def contracted(names: tuple[str, ...], ndim: int) -> int:
    """How many leading dims of the projection kernel at `names` (`projection`) its dense contracts:
    an output projection's all but the last ([heads, head_dim, d]), any other's the first."""
    return ndim - 1 if names[-2] in ("out", "shared_out") else 1


def contracting_last(wq: jax.Array, contracted: int) -> jax.Array:
    """A kernel with its `contracted` leading dims moved last: [in..., out...] -> [out..., in...]."""
    return jnp.transpose(wq, (*range(contracted, wq.ndim), *range(contracted)))


def _contracting_last(dims: Any, ndim: int) -> Any:
    """`dims` for the kernel laid out by `contracting_last`."""
    (lc, rc), batch = dims
    if batch != ((), ()) or rc != tuple(range(len(rc))):
        raise ValueError(f"an FP8 kernel given transposed must contract its leading dims, not {dims}")
    return (lc, tuple(range(ndim - len(rc), ndim))), batch


def fp8_dot_quantized(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    quantized: jax.Array,
    scale: jax.Array,
    transposed: jax.Array | None = None,
    blocks: tuple[Blocks, Blocks] = (WHOLE, WHOLE),
) -> jax.Array:
    """`fp8_dot_general` of lhs and rhs, where `quantized` (FORWARD) and `scale` are rhs already
    rounded: dequantize(quantized, scale) must be rhs's FP8 rounding by some power-of-two scale
    (the rounding `fp8_dot_general` takes of it is then the same values: `scale_for`). The dot
    multiplies them as they are, skipping rhs's max and its rounding (a read of the whole weight, a
    read and an e4m3 write, in every GEMM); rhs's values are not read, it takes the gradient.
    `transposed`: `quantized` laid out by `contracting_last`, which the forward multiplies: an FP8
    GEMM on Hopper takes both operands contracting-dim-minor, so a kernel rounded outside a loop (the
    pipeline's ticks) is otherwise transposed again inside it, at every use (the backward's GEMM
    takes `quantized` as it is). `blocks`: as `fp8_dot_general`'s."""
    x_blocks, g_blocks = blocks
    with jax.named_scope(SCOPE):
        sx = activation_scale(lhs, x_blocks)
        return _quantized_dot(
            lhs, rhs, quantized, transposed, scale, sx, _hashable(dimension_numbers), g_blocks
        )


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    blocks: tuple[Blocks, Blocks] = (WHOLE, WHOLE),
) -> jax.Array:
    """`jax.lax.dot_general`'s signature (what flax's DenseGeneral calls) over FP8-rounded operands
    (module docstring); the result in the operands' dtype. `blocks`: (lhs's, the output gradient's)
    scales one a block (`tensor_blocks`), else one a tensor."""
    del precision, preferred_element_type  # FP8 GEMMs accumulate in float32 and return lhs's dtype
    x_blocks, g_blocks = blocks
    with jax.named_scope(SCOPE):
        return _fp8_dot(lhs, rhs, activation_scale(lhs, x_blocks), _hashable(dimension_numbers), g_blocks)


def _hashable(dims: Any) -> Any:
    """((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)) as tuples of ints."""
    (lc, rc), (lb, rb) = dims
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
