"""The experts' grouped matmul on Hopper GPUs, computing only the rows routed to each expert.

XLA:GPU compiles `jax.lax.ragged_dot` to its dense fallback (every row against every expert, then a
mask: E times the FLOPs); its `xla_gpu_experimental_use_ragged_dot_grouped_gemm` option leaves that
HLO unchanged and `..._use_ragged_dot_fusion` aborts the compile (docs/moe.md). These are jax's
Pallas Mosaic-GPU kernels (jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py and
transposed_ragged_dot_mgpu.py, Apache-2.0; here in model/grouped_kernels.py), changed in two ways:
a tile holding no routed row returns at once (jax's runs the matmul of block 0 for it, so a
dropless exchange buffer of `expert` times the routed rows cost `expert` times the FLOPs), and the
SM count is H100's, not read from `jax.devices()` (a CPU device when the GPU program is compiled
without a GPU).

`grouped_kernels.ragged_matmul` is their custom_vjp: forward rows x W; dX by the same kernel
against W transposed; dW by the transposed kernel. `pallas_fp8` runs them on FP8 tiles (beside
model.matmul fp8: model/grouped_fp8.py). Each kernel call runs in a named scope carrying the FLOPs
of the rows the caller expects routed (`routed`; FP8_FLOPS_SCOPE for the FP8 kernels), which the
planner reads (plan/hlo.py `flops`, `fp8`): the HLO only shows the buffer, whose rows past the
routed ones the kernel skips. This module holds what the rest of jaxtrain reads without running
the kernels: their tiles and when
they cannot run. Pallas's Mosaic-GPU modules take 0.4 s of CPU to import, and every training
process imported them; only a job that runs the kernels imports model/grouped_kernels.py.
"""

from __future__ import annotations

BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 128, 64, 4  # 160 KB of shared memory of H100's 227
BLOCK_K_FP8 = 128  # FP8 tiles: the same 128 bytes a row (the same shared memory, 128-byte swizzle)
SMS = 132  # H100 SXM
HOPPER = "9.0"  # the compute capability the kernels' wgmma instructions need
FLOPS_SCOPE = "grouped_matmul_flops_"  # + the kernel's routed FLOPs, in the HLO's op_name
FP8_FLOPS_SCOPE = "grouped_matmul_fp8_flops_"  # the same for a kernel on FP8 tensor cores


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
