"""FSDP (ZeRO-3) and ZeRO-1: params split over devices that each compute with them whole.

Under fsdp every large param, its gradient and both Adam moments are split over `fsdp` (and over
`expert` and `context` for the params their devices share: parallel/mesh.py `param_spec`). Inside
the step each layer's params are all-gathered as the layer runs (`Fsdp.gather`, the model's
Placement.gather), in the compute dtype, so autodiff turns each gather into a reduce-scatter of that
layer's gradient (`gather_quantized`): no full gradient is all-reduced over fsdp (tests/test_sharding.py
checks the compiled HLO). Why explicit collectives: GSPMD alone all-reduced the whole fsdp gradient
and then sliced it (XLA:CPU).

Under model.matmul fp8 a projection's weight (model/fp8.py `projection`) is gathered as FP8:
each device rounds its shard to e4m3 by the whole weight's scale (the max over the shards: in a
scanned stack one all-reduce for every layer before they run, `Fsdp.with_scales`; else one scalar's
all-reduce a gather), the gather moves the e4m3 bytes (half of bf16's) and the whole weight is
dequantized after: the values the one-device FP8 dot multiplies, exactly (`gather_quantized`).

With `mesh.zero1` the params and the optimizer state are also split over `data`: the step gathers a
compute params once, before its shard_map (`Fsdp.compute_params`), and reduce-scatters the gradient over
data into the moments' layout (`scatter_over_data`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.model import fp8
from jaxtrain.model.params import logical_axes, path_names
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import tensor


def gather_quantized(
    p: jax.Array,
    axes: Any,
    dim: int,
    dtype: Any,
    reduce_dtype: Any,
    fp8_over: tuple[str, ...] = (),
    fp8_scale: jax.Array | None = None,
    fp8_kept: int = 0,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """(the whole param from this device's shard on the manual `axes` (fsdp, and expert for a dense
    param: mesh_lib.param_spec), gathered in `dtype` (every use of a weight is in the compute dtype,
    and a cast commutes with a gather: the same values, a fraction of the bytes), its gradient
    reduce-scattered in `reduce_dtype`, then held in the param's dtype; and with `fp8_over`, the
    manual axes a weight the layer multiplies in FP8 is split over, the gathered e4m3 array and its
    scale, else None, None): each device rounds its shard to e4m3 by the whole weight's scale (`whole_scale`),
    the gather moves the e4m3 bytes, the whole weight is dequantized after: the values are the
    one-device dot's rounding of the whole weight (a non-finite shard makes the scale, or its own
    values, non-finite everywhere); by `fp8_scale` where its stack gives it
    (`Fsdp.with_scales`); its gradient as any weight's, through the whole param (FP8's rounding
    passes it through). `fp8_kept`: the leading dims whose every index has a scale of its own (1: a
    stack of experts [E, ...], one an expert; the scale then [E]).
    Where the dot takes the e4m3 array (model/fp8.py `fp8_dot_quantized`), the
    dequantized whole param is never computed: it only carries the gradient."""

    def gather_all(x: jax.Array) -> jax.Array:
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True)

    @jax.custom_vjp
    def gather(x: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        x = x.astype(dtype)
        if not fp8_over:
            return gather_all(x), None
        scale = scale.reshape(*scale.shape, *(1,) * (x.ndim - scale.ndim))  # each kept index's own
        quantized = gather_all(fp8.to_fp8(x, scale, fp8.FORWARD))
        return fp8.dequantize(quantized, scale, x.dtype), quantized

    def forward(x: jax.Array, scale: jax.Array) -> tuple[tuple[jax.Array, jax.Array | None], jax.Array]:
        return gather(x, scale), scale

    def backward(scale: jax.Array, g: tuple[jax.Array, Any]) -> tuple[jax.Array, jax.Array]:
        shard = reduce_scatter(g[0], reduce_dtype, axes, dim)
        return shard.astype(p.dtype), jnp.zeros_like(scale)

    gather.defvjp(forward, backward)
    if fp8_over and fp8_scale is None:
        fp8_scale = whole_scale(
            jnp.max(jnp.abs(p.astype(dtype)), axis=tuple(range(fp8_kept, p.ndim))), fp8_over
        )
    scale = jnp.float32(1) if fp8_scale is None else fp8_scale
    whole, quantized = gather(p, scale)
    return whole, jax.lax.stop_gradient(quantized), (jax.lax.stop_gradient(scale) if fp8_over else None)


def reduce_scatter(g: jax.Array, dtype: Any, axes: Any, dim: int) -> jax.Array:
    """The gradient `g` summed over the manual `axes` in `dtype`, this device's part of `dim` kept.
    XLA:CPU sums every collective in float32, and its promotion of a bfloat16 reduce-scatter aborts
    the compiler (a CHECK in AllReducePromotion, jax 0.10.2): there the promotion is written out,
    the addends rounded to bfloat16, summed in float32, the sum rounded once more. What XLA's
    promotion computes, so mesh.reduce_dtype compute rounds on CPU too (NCCL's ring on GPUs also
    rounds each partial sum: more rounding than this)."""
    if dtype == jnp.float32 or mesh_lib.platform() != "cpu":
        return jax.lax.psum_scatter(g.astype(dtype), axes, scatter_dimension=dim, tiled=True)
    promoted = g.astype(dtype).astype(jnp.float32)
    return jax.lax.psum_scatter(promoted, axes, scatter_dimension=dim, tiled=True).astype(dtype)


def whole_scale(amax: jax.Array, over: tuple[str, ...]) -> jax.Array:
    """A weight's FP8 scale from this device's max of its shard(s) `amax`: the max over the manual
    axes `over` it is split over (an all-reduce) is the whole weight's max, so its scale."""
    amax = jax.lax.stop_gradient(amax).astype(jnp.float32)  # no gradient flows through a scale
    return fp8.scale_for(jax.lax.pmax(amax, over), fp8.FORWARD)


SCALE = fp8.SCALE  # a projection's FP8 scale beside its kernel (`Fsdp.with_scales`, `Fsdp.gather`)


def beside(variables: Any, entries: list[tuple[tuple, dict[str, jax.Array]]]) -> Any:
    """`variables` (nested dicts) with each (kernel's tree path, {name: array}) put beside that kernel."""
    out = jax.tree_util.tree_map(lambda x: x, variables)  # new dicts, the same arrays

    def parent(tree: Any, keys: tuple) -> Any:
        for key in keys:
            tree = tree[key]
        return tree

    for path, named in entries:
        parent(out, tuple(k.key for k in path[:-1])).update(named)
    return out


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

    def gather_for(self, matmul: str, fp8_experts: bool = False) -> Any:
        """The layers' gather for model.matmul `matmul`: with fp8, the projections' weights as FP8,
        and the routed experts' with `fp8_experts` (model.moe.grouped_matmul pallas_fp8). Bound
        methods (not a new partial each time): two placements of one layout compare equal."""
        if matmul != "fp8":
            return self.gather
        return self.gather_fp8_experts if fp8_experts else self.gather_fp8

    def gather_fp8(self, variables: Any, where: tuple[str, ...] = ()) -> Any:
        """`gather` with the projections' weights gathered as FP8 (model.matmul fp8)."""
        return self.gather(variables, where, fp8_weights=True)

    def gather_fp8_experts(self, variables: Any, where: tuple[str, ...] = ()) -> Any:
        """`gather_fp8` with the routed experts' weights gathered as FP8 too, one scale an expert:
        the FP8 experts' kernels multiply them as they are (model/grouped_fp8.py), and the gather
        moves half the bytes (on Qwen3-30B-A3B's 4 x 8 plan, the experts' weights are most of what
        each layer gathers across the hosts)."""
        return self.gather(variables, where, fp8_weights=True, fp8_experts=True)

    def _fp8_rounded(self, names: tuple[str, ...], fp8_weights: bool, fp8_experts: bool) -> int | None:
        """How a gathered param is rounded to FP8: None (it is not), 0 (one scale: a projection under
        model.matmul fp8), 1 (one scale an expert: the routed experts' stacks under pallas_fp8)."""
        if fp8_weights and fp8.projection(names):
            return 0
        return 1 if fp8_experts and fp8.experts(names) else None

    def gather(
        self,
        variables: Any,
        where: tuple[str, ...] = (),
        fp8_weights: bool = False,
        fp8_experts: bool = False,
    ) -> Any:
        """Whole params of one layer (or embedding) from this device's fsdp shards, in the compute
        dtype; each gather's gradient is a reduce-scatter (`gather_quantized`). `fp8_weights`
        (model.matmul fp8): the projections' weights gathered as FP8 (`gather_quantized`), by the
        scales their stack put beside them (`with_scales`) where it did; the gathered e4m3 array and
        its scale put beside the kernel (fp8.QUANTIZED, fp8.SCALE), which the layer's dot multiplies
        as they are (model/layers.py `Fp8Dot`); with `fp8_experts` the routed experts' weights too,
        one scale an expert (model/moe.py `_Stack`)."""
        flat = jax.tree_util.tree_flatten_with_path(variables)[0]
        scales = {path_names(path)[1:-1]: s for path, s in flat if path_names(path)[-1] == SCALE}
        given: list[tuple[tuple, dict[str, jax.Array]]] = []

        def one(path: tuple, p: jax.Array) -> jax.Array:
            names = (*where, *path_names(path)[1:])  # [0]: the collection
            if names[-1] == SCALE:
                return p
            logical = logical_axes(names, p.ndim)
            dim, axes = self._gathered(names, p.ndim)
            if dim is None or axes is None:
                return p
            kept = self._fp8_rounded(names, fp8_weights, fp8_experts)
            over = self._fp8_over(axes, logical, p.shape) if kept is not None else ()
            gather = functools.partial(
                gather_quantized, axes=axes, dim=dim, dtype=self.dtype, reduce_dtype=self.reduce_dtype,
                fp8_over=over, fp8_scale=scales.get(path_names(path)[1:-1]) if over else None,
                fp8_kept=kept or 0,
            )  # fmt: skip
            # Manual over tensor too for the gather: left automatic, XLA first gathered the weight
            # whole over tensor, then over fsdp (the whole float32 weight on every device).
            whole, quantized, scale = tensor.over_tensor(gather, p, logical, lambda spec: (spec, spec, P()))
            if quantized is not None:
                given.append((path, {fp8.QUANTIZED: quantized, SCALE: scale}))
            return whole

        return beside(jax.tree_util.tree_map_with_path(one, variables), given)

    def stack_in_for(self, matmul: str, moe: bool, fp8_experts: bool = False) -> Any:
        """The hook a scanned stack's params pass through before its layers run (Placement.stack_in):
        a mixture's experts cast (`whole_experts`), model.matmul fp8's scales (`with_scales`; the
        routed experts' too with `fp8_experts`, as `gather_for`)."""
        if matmul == "fp8":
            if not moe:
                return self.with_scales
            return self.experts_and_their_scales if fp8_experts else self.experts_and_scales
        return self.whole_experts if moe else None

    def experts_and_scales(self, variables: Any) -> Any:
        """`whole_experts`, then `with_scales`."""
        return self.with_scales(self.whole_experts(variables))

    def experts_and_their_scales(self, variables: Any) -> Any:
        """`whole_experts`, then `with_scales` with the routed experts' scales too."""
        return self.with_scales(self.whole_experts(variables), fp8_experts=True)

    def with_scales(self, variables: Any, fp8_experts: bool = False) -> Any:
        """A scanned stack's params with each gathered projection's FP8 scale, one a layer (with
        `fp8_experts` each routed expert's too: [layers, E]), beside its kernel (`SCALE`), for
        `gather`: every layer's maxima in one all-reduce before the layers run, not one a layer that
        its gather waits on (docs/fp8.md). No gradient flows through a scale."""
        flat = jax.tree_util.tree_flatten_with_path(variables)[0]
        picked = {i: self._stack_over(path, p, fp8_experts) for i, (path, p) in enumerate(flat)}
        picked = {i: (over, kept) for i, (over, kept) in picked.items() if over}
        if not picked:
            return variables
        # Each layer's (each expert's) max of each weight, then the max over the manual axes, every
        # weight's at once.
        amax = {}
        for i, (_, kept) in picked.items():
            p = flat[i][1]
            amax[i] = jnp.max(jnp.abs(p.astype(self.dtype)), axis=tuple(range(1 + kept, p.ndim)))
        scales = {}
        for over in {over for over, _ in picked.values()}:
            group = [i for i, (o, _) in picked.items() if o == over]
            whole = whole_scale(jnp.concatenate([amax[i].reshape(-1) for i in group]), over)
            ends = np.cumsum([amax[i].size for i in group])
            for i, part in zip(group, jnp.split(whole, ends[:-1]), strict=True):
                scales[i] = part.reshape(amax[i].shape)
        return beside(variables, [(flat[i][0], {SCALE: scales[i]}) for i in picked])

    def _stack_over(
        self, path: tuple, p: jax.Array, fp8_experts: bool = False
    ) -> tuple[tuple[str, ...], int]:
        """(The manual axes a stacked projection's layers are split over, where `with_scales` gives
        its scales, or () for any other param; its leading dims past the layers' with a scale each:
        `_fp8_rounded`). Not a weight split over tensor: its gather runs manual over tensor
        (`tensor.over_tensor`, one array in), where a value from here cannot enter; it takes its
        own all-reduce there."""
        names = path_names(path)[1:]  # [0]: the collection
        kept = self._fp8_rounded(names, True, fp8_experts)
        if kept is None:
            return (), 0
        dim, axes = self._gathered(names, p.ndim - 1)
        if dim is None or axes is None:
            return (), 0
        over = self._fp8_over(axes, logical_axes(names, p.ndim), p.shape)
        return (() if mesh_lib.TENSOR_AXIS in over else over), kept

    @staticmethod
    def _fp8_over(axes: Any, logical: tuple[str | None, ...], shape: tuple[int, ...]) -> tuple[str, ...]:
        """The manual axes a weight of `logical` axes gathered over `axes` is split over, as its
        gather sees it: `axes`, and tensor where `tensor.over_tensor` makes it manual. The FP8
        scale is the max over them all, so it is the whole weight's."""
        split = mesh_lib.tensor_part(logical, shape, jax.sharding.get_abstract_mesh())
        over_tensor = any(entry is not None for entry in split)
        return (*mesh_lib.entry_axes(axes), *((mesh_lib.TENSOR_AXIS,) if over_tensor else ()))

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
            if not fp8.experts(names):
                return p
            dim, axes = self._gathered(names, p.ndim - 1)
            return p.astype(self.dtype) if dim is None or axes is None else p

        return jax.tree_util.tree_map_with_path(one, variables)
