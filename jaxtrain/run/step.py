"""Pure train and eval steps on a data x expert x fsdp x context x tensor mesh, with scanned gradient
accumulation.

The step is one jitted function. Inside it a `shard_map` is manual over the batch axes
(data, expert, fsdp) and leaves `tensor` to the compiler (GSPMD), guided by the model's logical
activation constraints:
  - each device computes the gradient of its own rows, all microbatches scanned;
  - fsdp-split params are all-gathered one layer at a time as the model runs (`GPT.gather`),
    so autodiff turns each gather into a reduce-scatter of that layer's gradient: no full
    gradient is all-reduced on fsdp (tests/test_sharding.py checks the compiled HLO);
  - one `pmean` over `data` per optimizer step, however many microbatches;
  - MoE layers exchange tokens over `expert` by all-to-all (model/moe.py), so an expert's
    gradient arrives summed over the expert axis, as an fsdp-split param's does over fsdp.
Why explicit collectives for data and fsdp: GSPMD alone all-reduced the whole fsdp gradient and
then sliced it (XLA:CPU), and an explicit data reduction stays once per step, outside the
microbatch loop (tests/test_step.py).
The optimizer update runs outside the shard_map on the sharded state (ZeRO-1's data-split params
and moments included: the step gathers the params once, before its shard_map, `compute_copy`);
XLA places it.

A step with a non-finite loss or gradient leaves params and optimizer state unchanged; every
process decides identically because it judges reduced values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtrain.config import Config, ConfigError, ModelConfig
from jaxtrain.faults import NO_FAULTS, FaultPlan, poison_gradients
from jaxtrain.model.attention import attention_kernel, cudnn_max_head_dim
from jaxtrain.model.grouped import refusal
from jaxtrain.model.moe import balance_loss, grouped_matmul, router_stats, update_router_bias
from jaxtrain.model.params import logical_axes, path_names
from jaxtrain.model.transformer import GPT
from jaxtrain.run import accumulate, pipeline
from jaxtrain.run import mesh as mesh_lib
from jaxtrain.run.optim import lr_schedule
from jaxtrain.run.state import TrainState
from jaxtrain.text.format import NO_LOSS, TOKEN_BITS

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Dynamic loss scaling (float16): double the scale after this many finite steps in a row.
_SCALE_GROWTH_INTERVAL = 2000

Metrics = dict[str, jax.Array]


def compute_dtype(cfg: Config) -> Any:
    return _DTYPES[cfg.dtype]


def _token_loss(
    model: GPT, params: Any, rows: jax.Array, mean: Callable[[Any], Any], share: jax.Array | None = None
) -> tuple[jax.Array, Metrics]:
    """(loss to differentiate, metrics) of rows [b, T+1] (`_objective`)."""
    tokens = rows & TOKEN_BITS
    losses, sown = model.apply({"params": params}, tokens[:, :-1], tokens[:, 1:], mutable=["moe"])
    return _objective(model.cfg, mean, share, rows, losses, sown.get("moe"))


def _objective(
    cfg: ModelConfig,
    mean: Callable[[Any], Any],
    share: jax.Array | None,
    rows: jax.Array,
    losses: jax.Array,
    moe_stats: Any,
) -> tuple[jax.Array, Metrics]:
    """(loss to differentiate, metrics) from each token's cross-entropy `losses` [b, T] of rows
    [b, T+1]: their mean in float32 (metrics' `loss`), plus a mixture of experts' router losses
    from its "moe" collection, averaged over its MoE layers.
    `mean`: the mean over the batch shards, for the whole batch's expert load. With a loss mask
    (`share`, see `_ParamLayout.kept_share`): the sum over the targets that take loss (no NO_LOSS
    bit) over `share`."""
    loss = losses.mean() if share is None else jnp.where(rows[:, 1:] & NO_LOSS, 0.0, losses).sum() / share
    if moe_stats is None:
        return loss, {"loss": loss}
    stats, moe = router_stats(moe_stats), cfg.moe
    load = mean(stats["load"])  # the whole batch's: balance_loss's mean over devices is the batch's
    balance = balance_loss(load, stats["probs"]).mean()
    z = stats["z"].mean()
    total = loss + moe.balance_coef * balance + moe.z_loss_coef * z
    metrics = {"loss": loss, "moe_balance_loss": balance, "moe_z_loss": z, "expert_load": load}
    return total, metrics | {"moe_dropped": stats["dropped"].mean()}


def _fsdp_gather(p: jax.Array, axes: Any, dim: int, dtype: Any, reduce_dtype: Any) -> jax.Array:
    """The whole param from this device's shard on the manual `axes` (fsdp, and expert for a dense
    param: mesh_lib.param_spec), gathered in `dtype` (every use of a weight
    is in the compute dtype, and a cast commutes with a gather: the same values, a fraction of the
    bytes); its gradient is reduce-scattered in `reduce_dtype`, then kept in the param's dtype."""

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


class _ParamLayout:
    """How params sit on the mesh, as the inside of the shard_map sees them."""

    def __init__(
        self,
        mesh: Mesh,
        param_specs: Any,
        dtype: Any = jnp.float32,
        reduce_dtype: Any = None,
        zero1: bool = False,
    ) -> None:
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        self.manual = jax.tree.map(mesh_lib.manual_part, param_specs, is_leaf=is_spec)
        self.manual_by_path = mesh_lib.manual_by_path(param_specs)
        # Params split over fsdp, or dense ones over expert (mesh_lib.param_spec): layers gather them.
        self.gathers = any(mesh.shape[a] > 1 for a in (mesh_lib.FSDP_AXIS, mesh_lib.EXPERT_AXIS))
        self.sizes = {a: int(mesh.shape[a]) for a in mesh_lib.BATCH_AXES}
        self.stages = int(mesh.shape[mesh_lib.PIPELINE_AXIS])  # > 1: run/pipeline.py's schedule
        self.rules = mesh_lib.activation_rules(mesh)
        self.platform = mesh.devices.flat[0].platform  # what the step compiles for, not jax's default
        self.capability = getattr(mesh.devices.flat[0], "compute_capability", "")  # GPUs: "9.0"...
        self.tensor = int(mesh.shape[mesh_lib.TENSOR_AXIS])
        self.dtype, self.reduce_dtype = dtype, dtype if reduce_dtype is None else reduce_dtype
        # ZeRO-1 keeps the params split over data (mesh_lib.state_specs): the step gathers them
        # once, its weights in the compute dtype (`compute_copy`); a pipeline casts its own.
        self.copies = zero1 and self.sizes[mesh_lib.DATA_AXIS] > 1 and self.stages == 1

    def compute_copy(self, params: Any, tied: bool) -> Any:
        """The params as the step computes with them, before its shard_map gathers them over data:
        the weights every use of which is in the compute dtype (kernels but the router's, an untied
        embedding) cast first, so the gather moves half the bytes, once a step, and no microbatch
        casts them again; their gradients come in the compute dtype, as the matmuls give them, and
        are summed in float32 (the microbatch sums, `reduce_grads`): the values of casting at use.
        Left as they are: what the layers gather (their gather casts, and its reduce-scatter keeps
        the gradient float32) and a tied embedding (its two uses' gradients would add in bfloat16)."""
        if not self.copies:
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
        dtype; each gather's gradient is a reduce-scatter (`_fsdp_gather`)."""

        def one(path: tuple, p: jax.Array) -> jax.Array:
            names = (*where, *path_names(path)[1:])  # [0]: the collection
            logical = logical_axes(names, p.ndim)
            dim, axes = self._gathered(names, p.ndim)
            if dim is None or axes is None:
                return p
            gather = functools.partial(
                _fsdp_gather, axes=axes, dim=dim, dtype=self.dtype, reduce_dtype=self.reduce_dtype
            )
            # Manual over tensor too for the gather: left automatic, XLA first gathered the weight
            # whole over tensor, then over fsdp (the whole float32 weight on every device).
            return mesh_lib.over_tensor(gather, p, logical)

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

    def model(self, model: GPT) -> GPT:
        """The model with its attention kernel chosen for the mesh's devices, and FSDP's per-layer gather."""
        kernel = attention_kernel(model.cfg, self.platform, model.dtype, self.capability)
        most = cudnn_max_head_dim(self.capability)
        if kernel == "cudnn" and self.platform == "gpu" and model.cfg.head_size > most:
            raise ConfigError(
                f"model.attention_impl cudnn takes heads of at most {most} on GPUs of compute "
                f"capability {self.capability}, and this model's are {model.cfg.head_size}; use "
                "model.attention_impl auto (XLA's kernel)"
            )
        cfg = dataclasses.replace(model.cfg, attention_impl=kernel)
        why = refusal(self.platform, self.capability, cfg.d_model, cfg.expert_dim // self.tensor)
        if cfg.moe.grouped_matmul == "auto":
            impl = grouped_matmul(self.platform, self.capability)
            # Experts whose widths the Hopper kernel's tiles do not take: XLA's ragged_dot, as elsewhere.
            impl = "ragged_dot" if impl == "pallas" and why else impl
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, grouped_matmul=impl))
        if cfg.moe.n_experts and cfg.moe.grouped_matmul == "pallas" and why:
            raise ConfigError(why)
        stack_in = self.whole_experts if cfg.moe.n_experts else None
        return model.clone(cfg=cfg, gather=self.gather if self.gathers else None, stack_in=stack_in)

    def loss(
        self, model: GPT, params: Any, rows: jax.Array, share: jax.Array | None = None
    ) -> tuple[jax.Array, Metrics]:
        with nn.logical_axis_rules(self.rules):
            return _token_loss(self.model(model), params, rows, self.mean, share)

    def _pmean(self, tree: Any, axes: tuple[str, ...]) -> Any:
        """Mean over those of `axes` with more than one device. A pmean over size-1 manual axes
        beside an automatic tensor axis fails XLA's SPMD partitioner ("Cross-partition allreduce
        must be in (partial) manual partitioning mode")."""
        axes = tuple(a for a in axes if self.sizes[a] > 1)
        return jax.lax.pmean(tree, axes) if axes else tree

    def kept(self, rows: jax.Array) -> jax.Array:
        """How many targets of the whole global batch take loss (a loss-masked batch)."""
        kept = jnp.sum((rows[:, 1:] & NO_LOSS) == 0).astype(jnp.float32)
        axes = tuple(a for a in mesh_lib.BATCH_AXES if self.sizes[a] > 1)  # as in _pmean
        return jax.lax.psum(kept, axes) if axes else kept

    def kept_share(self, kept: jax.Array, accum: int) -> jax.Array:
        """The global batch's kept count per microbatch of each shard: each microbatch's loss is its
        kept sum over this, so the mean over microbatches and shards (what the step takes) is the
        global kept sum over the global kept count, however the batch is split. A batch keeping
        nothing has loss 0, not NaN."""
        return jnp.maximum(kept, 1.0) / (accum * math.prod(self.sizes.values()))

    def mean(self, tree: Any) -> Any:
        """Mean over the batch shards."""
        return self._pmean(tree, mesh_lib.BATCH_AXES)

    def reduce_grads(self, grads: Any, out_specs: Any) -> Any:
        """Mean over every batch shard, each gradient left in its manual spec in `out_specs`. A
        param split over a batch axis gets its gradient summed over that axis already (fsdp's
        reduce-scatter, the experts' all-to-all back): divided there. Where `out_specs` adds
        `data` (ZeRO-1: the moments' layout, mesh_lib.zero1_spec) a reduce-scatter over it
        stands in for the all-reduce: each data shard gets only its slice, half the bytes."""

        def one(path: tuple, g: jax.Array, spec: P, out: P) -> jax.Array:
            g = g.astype(jnp.float32)  # a compute copy's (`compute_copy`): reduced as every other
            split = mesh_lib.spec_axes(spec)
            scatter = [
                i for i, e in enumerate(out) if mesh_lib.DATA_AXIS in set(mesh_lib.entry_axes(e)) - split
            ]
            if scatter:
                g = mesh_lib.scatter_over_data(g, scatter[0], logical_axes(path, g.ndim))
                split = split | {mesh_lib.DATA_AXIS}
            g = self._pmean(g, tuple(a for a in mesh_lib.BATCH_AXES if a not in split))
            return g / math.prod(self.sizes[a] for a in mesh_lib.BATCH_AXES if a in split)

        return jax.tree_util.tree_map_with_path(one, grads, self.manual, out_specs)  # specs: up to grads


def _local_grads(
    model: GPT,
    layout: _ParamLayout,
    accum: int,
    params: Any,
    rows: jax.Array,
    scale: jax.Array,
    share: jax.Array | None = None,
) -> tuple[Any, Metrics]:
    """Gradient and loss metrics of this device's rows, averaged over `accum` microbatches."""

    def scaled_loss(p: Any, mb: jax.Array) -> tuple[jax.Array, Metrics]:
        loss, metrics = layout.loss(model, p, mb, share)
        return loss * scale, metrics

    if accumulate.applies(model.cfg, accum):
        objective = functools.partial(_objective, model.cfg, layout.mean, share)
        return accumulate.local_grads(
            layout.model(model), layout.rules, objective, accum, params, rows, scale
        )
    grad_fn = jax.grad(scaled_loss, has_aux=True)
    if accum == 1:
        return grad_fn(params, rows)

    def body(carry: tuple[Any, Metrics], mb: jax.Array) -> tuple[tuple[Any, Metrics], None]:
        g, metrics = grad_fn(params, mb)
        return jax.tree.map(jnp.add, carry, (g, metrics)), None

    micro = rows.reshape(accum, rows.shape[0] // accum, rows.shape[1])
    # float32 sums, a compute copy's gradients (_ParamLayout.compute_copy) included
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    zeros = (zeros, jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, micro[0])[1]))
    sums, _ = jax.lax.scan(body, zeros, micro)
    return jax.tree.map(lambda x: x / accum, sums)


def _loss_scale(state: TrainState, finite: jax.Array, fp16: bool) -> tuple[jax.Array, jax.Array]:
    """(loss scale, finite steps in a row) after a step: float16's dynamic scale doubles after
    _SCALE_GROWTH_INTERVAL good steps in a row and halves (to at least 1) at a bad one."""
    good = jnp.where(finite, state.good_steps + 1, 0)
    if not fp16:
        return state.loss_scale, good
    grow = good >= _SCALE_GROWTH_INTERVAL
    scale = jnp.where(
        finite,
        jnp.where(grow, state.loss_scale * 2, state.loss_scale),
        jnp.maximum(state.loss_scale / 2, 1.0),
    )
    return scale, jnp.where(grow, 0, good)


def _grads_on_mesh(
    device_grads: Callable, layout: _ParamLayout, mesh: Mesh, param_specs: Any, zero1: bool
) -> Callable:
    """device_grads(out_specs, params, rows, scale, step) run over the step's manual axes: the mean
    gradient, under ZeRO-1 already split over data as the moments are (mesh_lib.zero1_spec)."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731

    def run(params: Any, *args: jax.Array) -> tuple[Any, Metrics]:
        specs = param_specs
        if zero1:
            specs = jax.tree.map(
                lambda s, p: mesh_lib.zero1_spec(s, p.shape, mesh), specs, params, is_leaf=is_spec
            )
        manual = jax.tree.map(mesh_lib.manual_part, specs, is_leaf=is_spec)
        # check_vma=False: we reduce explicitly, exactly once per step. `tensor` and `context` stay automatic.
        return jax.shard_map(
            functools.partial(device_grads, manual),
            mesh=mesh,
            in_specs=(layout.manual, mesh_lib.batch_spec(), P(), P()),
            out_specs=(manual, P()),
            axis_names=mesh_lib.manual_axes(mesh),
            check_vma=False,
        )(params, *args)

    return run


def make_train_step(
    cfg: Config,
    model: GPT,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    param_specs: Any,
    faults: FaultPlan = NO_FAULTS,
) -> Callable:
    """train_step(state, batch) -> (state, metrics); batch is int32 [global_batch, T+1]."""
    # XLA:CPU runs every collective in float32 anyway, and its promotion of a bfloat16
    # reduce-scatter aborts the compiler (CHECK in AllReducePromotion, jax 0.10.2): float32 there.
    platform = mesh.devices.flat[0].platform
    reduce_dtype = model.dtype if cfg.mesh.reduce_dtype == "compute" and platform != "cpu" else jnp.float32
    layout = _ParamLayout(mesh, param_specs, model.dtype, reduce_dtype, cfg.mesh.zero1)
    accum, schedule, clip = cfg.gradient_accumulation_steps, lr_schedule(cfg), cfg.gradient_clip_val
    fp16 = cfg.dtype == "float16"
    masked = cfg.loss_mask  # unmasked data keeps the plain mean: its losses stay bit for bit
    bias_rate = cfg.model.moe.bias_update_rate

    def device_grads(
        grad_specs: Any, params: Any, rows: jax.Array, scale: jax.Array, step: jax.Array
    ) -> tuple[Any, Metrics]:
        if faults.nan_step > 0:  # test-only fault, traced only when asked for
            scale = poison_gradients(faults, scale, step, jax.lax.axis_index(mesh_lib.BATCH_AXES) == 0)
        share = layout.kept_share(layout.kept(rows), accum) if masked else None
        local = pipeline.local_grads if layout.stages > 1 else _local_grads
        grads, metrics = local(model, layout, accum, params, rows, scale, share)
        return layout.reduce_grads(grads, grad_specs), layout.mean(metrics)

    sharded_grads = _grads_on_mesh(device_grads, layout, mesh, param_specs, cfg.mesh.zero1)

    def apply(state: TrainState, grads: Any, grad_norm: jax.Array, finite: jax.Array) -> tuple[Any, Any]:
        """The optimizer's update, or the state unchanged where the step is not finite. A select,
        not a branch: XLA updates the donated state in place through a select fused into the
        update, while a `lax.cond`'s outputs took new buffers, about two float32 copies of the
        params (Mixtral-8x7B on 2 x 8 H100, planned: 6.0 GB of 16.1 GB of temporaries at 8 layers)."""
        if clip > 0:  # global-norm clipping here, reusing the norm we log anyway
            factor = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * factor, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        kept = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(kept, optax.apply_updates(state.params, updates), state.params)
        return params, jax.tree.map(kept, opt_state, state.opt_state)

    def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        compute = layout.compute_copy(state.params, cfg.model.tie_embeddings)
        grads, loss_metrics = sharded_grads(compute, batch, state.loss_scale, state.step)
        loss = loss_metrics["loss"]
        if fp16:
            grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = apply(state, grads, grad_norm, finite)
        if bias_rate:  # auxiliary-loss-free balancing: no gradient's, so beside the optimizer's update
            params = update_router_bias(params, loss_metrics["expert_load"], bias_rate * finite)
        scale, good = _loss_scale(state, finite, fp16)
        new_state = state.replace(  # type: ignore[attr-defined]  # added by flax.struct.dataclass
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            loss_scale=scale,
            good_steps=good,
            bad_steps=jnp.where(finite, 0, state.bad_steps + 1),
            skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        )
        metrics = {
            **loss_metrics,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "finite": finite,
            "bad_steps": new_state.bad_steps,
            "skipped_steps": new_state.skipped_steps,
            "loss_scale": scale,
        }
        return new_state, metrics

    return train_step


def make_eval_step(
    model: GPT, mesh: Mesh, param_specs: Any, accum: int = 1, masked: bool = False, zero1: bool = False
) -> Callable:
    """eval_step(params, batch) -> metrics of the global batch: `loss` (its mean; a mixture of
    experts' router figures beside it, as the train step's), taken in `accum` microbatches
    of the train step's device batch, one after another: evaluation fits wherever training does
    (the whole batch at once needed 145 GB per device for llama3_8b on 8 H100s). masked: the
    batch carries a loss mask, the loss is the train step's (over kept targets), and the metrics
    carry the kept count (`kept`), so evaluations over several batches weigh each by it.
    zero1: the params come split over data (the train step's `compute_copy`)."""
    layout = _ParamLayout(mesh, param_specs, model.dtype, zero1=zero1)

    def device_metrics(params: Any, rows: jax.Array) -> Metrics:
        kept = layout.kept(rows) if masked else None
        share = None if kept is None else layout.kept_share(kept, accum)
        if layout.stages > 1:
            metrics = layout.mean(
                pipeline.loss(layout.model(model), layout.rules, layout.manual, params, rows, accum, share)[1]
            )
        elif accum == 1:
            metrics = layout.mean(layout.loss(model, params, rows, share)[1])
        else:
            micro = rows.reshape(accum, rows.shape[0] // accum, rows.shape[1])
            # Equal microbatches: the mean of their means is the mean over every row.
            per_micro = jax.lax.map(lambda mb: layout.loss(model, params, mb, share)[1], micro)
            metrics = layout.mean(jax.tree.map(lambda x: x.mean(axis=0), per_micro))
        return metrics if kept is None else metrics | {"kept": kept}

    metrics = jax.shard_map(
        device_metrics,
        mesh=mesh,
        in_specs=(layout.manual, mesh_lib.batch_spec()),
        out_specs=P(),
        axis_names=mesh_lib.manual_axes(mesh),
        check_vma=False,
    )
    return lambda params, rows: metrics(layout.compute_copy(params, model.cfg.tie_embeddings), rows)


def jit_steps(
    cfg: Config,
    model: GPT,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    state_shardings: Any,
    faults: FaultPlan = NO_FAULTS,
) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped]:
    """Jit both steps once with explicit shardings; the train step donates the old state."""
    replicated = mesh_lib.replicated(mesh)
    batch = mesh_lib.batch_sharding(mesh)
    # How the step holds the params: whole over data, where ZeRO-1 stores them split.
    param_specs = jax.tree.map(lambda s: mesh_lib.without(s.spec, mesh_lib.DATA_AXIS), state_shardings.params)
    train = jax.jit(
        make_train_step(cfg, model, tx, mesh, param_specs, faults),
        in_shardings=(state_shardings, batch),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        make_eval_step(
            model, mesh, param_specs, cfg.gradient_accumulation_steps, cfg.loss_mask, cfg.mesh.zero1
        ),
        in_shardings=(state_shardings.params, batch),
        out_shardings=replicated,
    )
    return train, evaluate
