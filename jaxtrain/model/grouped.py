"""The experts' grouped matmul on Hopper GPUs, computing only the rows routed to each expert.

XLA:GPU compiles `jax.lax.ragged_dot` to its dense fallback (every row against every expert, then a
mask: E times the FLOPs); its `xla_gpu_experimental_use_ragged_dot_grouped_gemm` option leaves that
HLO unchanged and `..._use_ragged_dot_fusion` aborts the compile (docs/moe.md). These are jax's
Pallas Mosaic-GPU kernels (jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py and
transposed_ragged_dot_mgpu.py, Apache-2.0; here in model/grouped_kernels.py, imported only where
they run), changed in two ways: a tile holding no routed row returns at once (jax's runs the matmul
of block 0 for it, so a dropless exchange buffer of `expert` times the routed rows cost `expert`
times the FLOPs), and the SM count is H100's, not read from `jax.devices()` (a CPU device when the
GPU program is compiled without a GPU).

`ragged_matmul` is their custom_vjp: forward rows x W; dX by the same kernel against W transposed;
dW by the transposed kernel. Each kernel call runs in a named scope carrying the FLOPs of the rows
the caller expects routed (`routed`), which the planner reads (plan/hlo.py `flops`): the HLO only
shows the buffer, whose rows past the routed ones the kernel skips.
"""

from __future__ import annotations

import functools

import jax

BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 128, 64, 4  # 160 KB of shared memory of H100's 227
SMS = 132  # H100 SXM
HOPPER = "9.0"  # the compute capability the kernels' wgmma instructions need
FLOPS_SCOPE = "grouped_matmul_flops_"  # + the kernel's routed FLOPs, in the HLO's op_name


def refusal(platform: str, compute_capability: str, d: int, ff: int) -> str | None:
    """Why `grouped_matmul: pallas` cannot run experts of width d and hidden ff (per device) on the
    step's devices, in one line naming the fix; None if it can."""
    if platform != "gpu" or compute_capability != HOPPER:
        where = platform if platform != "gpu" else f"a GPU of compute capability {compute_capability}"
        return f"model.moe.grouped_matmul pallas needs Hopper GPUs (9.0), not {where}; use auto"
    for name, size in (("model.d_model", d), ("the expert hidden size per tensor shard", ff)):
        if size % BLOCK_M:
            return f"{name} {size} is not a multiple of {BLOCK_M} for grouped_matmul pallas; use blocks"
    return None


def _scoped(flops: float):  # type: ignore[no-untyped-def]
    return jax.named_scope(f"{FLOPS_SCOPE}{int(flops)}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ragged_matmul(
    rows: jax.Array, w: jax.Array, sizes: jax.Array, routed: int, interpret: bool = False
) -> jax.Array:
    """rows [m, k] sorted by expert, sizes[e] of them for expert e, times w [E, k, n] -> [m, n].
    Rows past sum(sizes) belong to no expert: they are not written (any bits, NaN among them), and
    whatever they hold in `rows` or in the gradient reaches no routed row nor w's gradient. The
    caller sends only the routed rows on (the exchange's slices): zeroing the rest took three
    passes over each buffer (0.14 s of Qwen3-30B-A3B's 1.71 s step on its 4 x 8 plan).
    `routed`: the rows the caller expects routed (for the planner's FLOPs; the kernel computes
    sum(sizes) rows, whatever m). `interpret`: run the kernels in Pallas's GPU interpreter (on
    CPU: tests)."""
    return _forward(rows, w, sizes, routed, interpret)[0]


def _forward(rows, w, sizes, routed, interpret):  # type: ignore[no-untyped-def]
    from jaxtrain.model import grouped_kernels as kernels  # Pallas's modules, imported where used

    with _scoped(2.0 * routed * w.shape[1] * w.shape[2]):
        return kernels.ragged_dot(rows, w, sizes, False, interpret), (rows, w, sizes)


def _backward(routed, interpret, saved, grad):  # type: ignore[no-untyped-def]
    from jaxtrain.model import grouped_kernels as kernels

    rows, w, sizes = saved
    grad = grad.astype(rows.dtype)
    flops = 2.0 * routed * w.shape[1] * w.shape[2]
    with _scoped(flops):
        d_rows = kernels.ragged_dot(grad, w, sizes, True, interpret)
    with _scoped(flops):
        d_w = kernels.transposed_ragged_dot(rows, grad, sizes, interpret)
    return d_rows, d_w, None


ragged_matmul.defvjp(_forward, _backward)
