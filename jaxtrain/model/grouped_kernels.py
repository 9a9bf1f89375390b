"""model/grouped.py's Pallas Mosaic-GPU kernels and their custom_vjp `ragged_matmul` (jax's
jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py and transposed_ragged_dot_mgpu.py, Apache-2.0,
changed as model/grouped.py says). Imported only where the kernels run (Hopper, or the tests'
interpreter): Pallas's modules take 0.4 s of CPU to import."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# jax 0.10 exports no GPU interpreter parameters (only TPU's); interpret=True is the generic
# interpreter, which has no wgmma. Tests run the kernels on CPU with these.
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import GroupInfo

from jaxtrain.model.grouped import BLOCK_K, BLOCK_K_FP8, BLOCK_M, BLOCK_N, FLOPS_SCOPE, SMS, STAGES


def _params() -> plgpu.CompilerParams:
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    sizes: jax.Array,
    transpose_rhs: bool,
    interpret: bool,
    scales: jax.Array | None = None,
) -> jax.Array:
    """lhs [m, k] (rows sorted by group) x rhs [g, k, n] ([g, n, k] if transpose_rhs) -> [m, n].
    Rows past sum(sizes) are not written. FP8 operands (both of one FP8 type: Mosaic's wgmma takes
    no mixed pair; rhs K-major, transpose_rhs, as Hopper's FP8 wgmma needs) accumulate in float32,
    each group's tile multiplied by `scales[group]` (float32 [g]) in the epilogue, out in bfloat16."""
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    grid_m, grid_n = pl.cdiv(m, BLOCK_M) + g - 1, pl.cdiv(n, BLOCK_N)
    fp8 = jnp.dtype(lhs.dtype).itemsize == 1
    block_k = BLOCK_K_FP8 if fp8 else BLOCK_K  # 128 bytes a row of a tile either way
    scales = jnp.ones((g,), jnp.float32) if scales is None else scales

    def body(sizes_gmem, scales_gmem, lhs_gmem, rhs_gmem, o_gmem):  # type: ignore[no-untyped-def]
        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def tile(info):  # type: ignore[no-untyped-def]
            mi, ni = plgpu.planar_snake(info.index[0], (grid_m, grid_n), 1, 1)
            group = GroupInfo.create(sizes_gmem, BLOCK_M, mi)

            @pl.when(group.actual_size > 0)  # tiles past the routed rows: no matmul
            def _():  # type: ignore[no-untyped-def]
                def acc_scope(acc_ref):  # type: ignore[no-untyped-def]
                    plgpu.emit_pipeline(
                        lambda _, a, b: plgpu.wgmma(
                            acc_ref, a, plgpu.transpose_ref(b, (1, 0)) if transpose_rhs else b
                        ),
                        grid=(k // block_k,),
                        in_specs=[
                            plgpu.BlockSpec((BLOCK_M, block_k), lambda i: (group.block, i), delay_release=1),
                            plgpu.BlockSpec(
                                (BLOCK_N, block_k) if transpose_rhs else (block_k, BLOCK_N),
                                lambda i: (ni, i) if transpose_rhs else (i, ni),
                                delay_release=1,
                            ),
                        ],
                        max_concurrent_steps=STAGES,
                    )(lhs_gmem, rhs_gmem.at[group.group_id])
                    return acc_ref[...]

                acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_M, BLOCK_N)))
                if fp8:  # the epilogue: the group's scale (a power of two: exact)
                    acc = acc * scales_gmem[group.group_id]
                _store(acc, o_gmem, group, ni, m)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16 if fp8 else lhs.dtype),
        grid=(SMS,),
        grid_names=("sm",),
        compiler_params=_params(),
        interpret=InterpretGPUParams() if interpret else None,
    )
    return kernel(sizes, scales, lhs, rhs)


def _store(acc, o_gmem, group, ni, m):  # type: ignore[no-untyped-def]
    """Write a tile's rows of its group: TMA copies of static sizes, one per set bit of the count."""

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((BLOCK_M, BLOCK_N), dtype=o_gmem.dtype))
    def _(o_smem):  # type: ignore[no-untyped-def]
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        start, remaining = group.start_within_block, min(BLOCK_M, m)
        while remaining > 0:
            rows = 1 << int(math.log2(remaining))
            remaining //= 2

            @pl.when(group.actual_size & rows != 0)
            def _(start=start, rows=rows):  # type: ignore[no-untyped-def]  # traced now: bound now
                out = o_gmem.at[pl.ds(group.block_start + start, rows), pl.ds(ni * BLOCK_N, BLOCK_N)]
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, rows)], out)

            start += group.actual_size & rows
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _blocks_of(sizes: jax.Array, block: int) -> tuple[jax.Array, ...]:
    """Each group's first and last row (starts, ends: exclusive), how many blocks of `block` rows
    hold its rows, and the first of them (block-aligned)."""
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    block_starts = starts // block * block
    n_blocks = (-(ends // -block) * block - block_starts) // block
    return starts, ends, n_blocks, block_starts


def _transforms(dtype, block):  # type: ignore[no-untyped-def]
    """Shared memory's tiling and swizzle for tiles `block` values wide of `dtype`."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(block * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def transposed_ragged_dot(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, interpret: bool) -> jax.Array:
    """lhs [r, m], rhs [r, n], rows sorted by group -> [g, m, n]: each group's lhs^T rhs over its
    rows (zero for an empty group). Rows past sum(sizes) may hold anything (`_keep_group_rows`)."""
    r, m = lhs.shape
    n, g = rhs.shape[1], sizes.shape[0]
    starts, ends, n_blocks, block_starts = _blocks_of(sizes, BLOCK_K)
    transforms = _transforms(lhs.dtype, BLOCK_K)
    grid_m, grid_n = m // BLOCK_M, n // BLOCK_N

    def body(sizes_g, starts_g, ends_g, n_blocks_g, block_starts_g, lhs_g, rhs_g, o_g):  # type: ignore[no-untyped-def]
        @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
        def tile(info):  # type: ignore[no-untyped-def]
            gi = info.index[0]
            mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, 1)
            rows = pl.ds(pl.multiple_of(block_starts_g[gi], BLOCK_K), r)  # never read past its blocks

            def acc_scope(acc_ref):  # type: ignore[no-untyped-def]
                def step(block, a, b):  # type: ignore[no-untyped-def]
                    _keep_group_rows((a, b), block[0], n_blocks_g[gi], starts_g[gi], ends_g[gi], 0, interpret)
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(a, (1, 0)), b)

                @pl.when(sizes_g[gi] > 0)
                def _():  # type: ignore[no-untyped-def]
                    spec = functools.partial(plgpu.BlockSpec, delay_release=1, transforms=transforms)
                    plgpu.emit_pipeline(
                        step,
                        grid=(n_blocks_g[gi],),
                        in_specs=[
                            spec((BLOCK_K, BLOCK_M), lambda i: (i, mi)),
                            spec((BLOCK_K, BLOCK_N), lambda i: (i, ni)),
                        ],
                        max_concurrent_steps=STAGES,
                    )(lhs_g.at[rows, :], rhs_g.at[rows, :])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_M, BLOCK_N)))
            out = o_g.at[gi, pl.ds(mi * BLOCK_M, BLOCK_M), pl.ds(ni * BLOCK_N, BLOCK_N)]
            _store_whole(acc, out, transforms)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, m, n), lhs.dtype),
        grid=(SMS,),
        grid_names=("sm",),
        compiler_params=_params(),
        interpret=InterpretGPUParams() if interpret else None,
    )
    return kernel(sizes, starts, ends, n_blocks, block_starts, lhs, rhs)


def transposed_ragged_dot_fp8(
    lhs_t: jax.Array, rhs_t: jax.Array, sizes: jax.Array, scales: jax.Array, interpret: bool
) -> jax.Array:
    """`transposed_ragged_dot` on FP8 operands stored K-major (as Hopper's FP8 wgmma needs them):
    lhs_t [m, r], rhs_t [n, r] of one FP8 type, columns sorted by group -> [g, m, n] bfloat16, each
    group's lhs_t rhs_t^T over its columns accumulated in float32, times `scales[group]`. Columns
    past sum(sizes) may hold anything (`_keep_group_rows`, along the tiles' columns)."""
    m, r = lhs_t.shape
    n, g = rhs_t.shape[0], sizes.shape[0]
    starts, ends, n_blocks, block_starts = _blocks_of(sizes, BLOCK_K_FP8)
    transforms = _transforms(lhs_t.dtype, BLOCK_K_FP8)
    grid_m, grid_n = m // BLOCK_M, n // BLOCK_N

    def body(sizes_g, scales_g, starts_g, ends_g, n_blocks_g, block_starts_g, lhs_g, rhs_g, o_g):  # type: ignore[no-untyped-def]
        @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
        def tile(info):  # type: ignore[no-untyped-def]
            gi = info.index[0]
            mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, 1)
            cols = pl.ds(pl.multiple_of(block_starts_g[gi], BLOCK_K_FP8), r)

            def acc_scope(acc_ref):  # type: ignore[no-untyped-def]
                def step(block, a, b):  # type: ignore[no-untyped-def]
                    _keep_group_rows((a, b), block[0], n_blocks_g[gi], starts_g[gi], ends_g[gi], 1, interpret)
                    plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b, (1, 0)))

                @pl.when(sizes_g[gi] > 0)
                def _():  # type: ignore[no-untyped-def]
                    spec = functools.partial(plgpu.BlockSpec, delay_release=1, transforms=transforms)
                    plgpu.emit_pipeline(
                        step,
                        grid=(n_blocks_g[gi],),
                        in_specs=[
                            spec((BLOCK_M, BLOCK_K_FP8), lambda i: (mi, i)),
                            spec((BLOCK_N, BLOCK_K_FP8), lambda i: (ni, i)),
                        ],
                        max_concurrent_steps=STAGES,
                    )(lhs_g.at[:, cols], rhs_g.at[:, cols])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_M, BLOCK_N))) * scales_g[gi]
            out = o_g.at[gi, pl.ds(mi * BLOCK_M, BLOCK_M), pl.ds(ni * BLOCK_N, BLOCK_N)]
            _store_whole(acc, out, _transforms(jnp.bfloat16, BLOCK_N))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, m, n), jnp.bfloat16),
        grid=(SMS,),
        grid_names=("sm",),
        compiler_params=_params(),
        interpret=InterpretGPUParams() if interpret else None,
    )
    return kernel(sizes, scales, starts, ends, n_blocks, block_starts, lhs_t, rhs_t)


def _keep_group_rows(smems, block, n_blocks, start, end, axis, interpret):  # type: ignore[no-untyped-def]
    """A group's first and last blocks of rows (along `axis` of the tiles) hold its neighbours' rows
    too, and the last group's last block rows past the routed ones (never written: any bits, NaN
    among them): zeroed before the matmul, by a select (a product would keep a NaN)."""
    size = smems[0].shape[axis]

    def keep(rule):  # type: ignore[no-untyped-def]
        for smem in smems:
            iota = jax.lax.broadcasted_iota(jnp.int32, smem.shape, axis)
            if not interpret:  # a register layout for Mosaic; the interpreter has none (nor this op)
                iota = plgpu.layout_cast(iota, plgpu.Layout.WGMMA)
            rows = smem[...]
            # Mosaic selects no 8-bit values: FP8 goes through float16 (exact both ways; the hardware
            # converts e5m2 to float16, not to bfloat16)
            wide = rows.astype(jnp.float16) if rows.dtype.itemsize == 1 else rows
            smem[...] = jnp.where(rule(iota), wide, jnp.zeros_like(wide)).astype(rows.dtype)
        plgpu.commit_smem()

    pl.when(block == 0)(lambda: keep(lambda i: i >= jax.lax.rem(start, size)))
    pl.when(block == n_blocks - 1)(lambda: keep(lambda i: i <= jax.lax.rem(end - 1, size)))


def _store_whole(acc, out, transforms):  # type: ignore[no-untyped-def]
    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((BLOCK_M, BLOCK_N), out.dtype, transforms=transforms))
    def _(o_smem):  # type: ignore[no-untyped-def]
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


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
    with _scoped(2.0 * routed * w.shape[1] * w.shape[2]):
        return ragged_dot(rows, w, sizes, False, interpret), (rows, w, sizes)


def _backward(routed, interpret, saved, grad):  # type: ignore[no-untyped-def]
    rows, w, sizes = saved
    grad = grad.astype(rows.dtype)
    flops = 2.0 * routed * w.shape[1] * w.shape[2]
    with _scoped(flops):
        d_rows = ragged_dot(grad, w, sizes, True, interpret)
    with _scoped(flops):
        d_w = transposed_ragged_dot(rows, grad, sizes, interpret)
    return d_rows, d_w, None


ragged_matmul.defvjp(_forward, _backward)
