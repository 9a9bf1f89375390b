"""Pure train and eval steps: loss, gradient and update, on a pipeline x data x expert x fsdp x
context x tensor mesh.

The step is one jitted function. Inside it a `shard_map` is manual over the batch axes (data,
expert, fsdp; pipeline too when it has stages) and leaves tensor and context to the compiler. How
the model runs there is parallel/'s (parallel/placement.py places it: fsdp's per-layer gathers,
attention per device, the experts' exchange; parallel/data.py reduces the gradient once a step,
however many microbatches); the optimizer update runs outside the shard_map on the sharded state
(ZeRO-1's data-split params and moments included), where XLA places it. Several microbatches are
scanned, or accumulated into one buffer (run/accumulate.py), or run by the pipeline's schedule.

A step with a non-finite loss or gradient leaves params and optimizer state unchanged; every
process decides identically because it judges reduced values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtrain.config import Config, ModelConfig
from jaxtrain.faults import NO_FAULTS, FaultPlan, poison_gradients
from jaxtrain.model.head import mean_loss
from jaxtrain.model.moe import balance_loss, router_stats, update_router_bias
from jaxtrain.model.transformer import GPT
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline
from jaxtrain.parallel.placement import Layout
from jaxtrain.run import accumulate
from jaxtrain.run.optim import lr_schedule
from jaxtrain.run.state import TrainState
from jaxtrain.text.format import TOKEN_BITS

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
    (`share`, see parallel/data.py `target_share`): the sum over the targets that take loss (no NO_LOSS
    bit) over `share`."""
    loss = mean_loss(losses, rows, share)
    if moe_stats is None:
        return loss, {"loss": loss}
    stats, moe = router_stats(moe_stats), cfg.moe
    load = mean(stats["load"])  # the whole batch's: balance_loss's mean over devices is the batch's
    balance = balance_loss(load, stats["probs"]).mean()
    z = stats["z"].mean()
    total = loss + moe.balance_coef * balance + moe.z_loss_coef * z
    metrics = {"loss": loss, "moe_balance_loss": balance, "moe_z_loss": z, "expert_load": load}
    return total, metrics | {"moe_dropped": stats["dropped"].mean()}


def _loss(
    layout: Layout, model: GPT, params: Any, rows: jax.Array, share: jax.Array | None = None
) -> tuple[jax.Array, Metrics]:
    """(loss to differentiate, metrics) of this device's rows, the model placed by `layout`."""
    with nn.logical_axis_rules(layout.rules):
        return _token_loss(model, params, rows, layout.batch.mean, share)


def _local_grads(
    model: GPT,
    layout: Layout,
    accum: int,
    params: Any,
    rows: jax.Array,
    scale: jax.Array,
    share: jax.Array | None = None,
) -> tuple[Any, Metrics]:
    """Gradient and loss metrics of this device's rows, averaged over `accum` microbatches."""

    def scaled_loss(p: Any, mb: jax.Array) -> tuple[jax.Array, Metrics]:
        loss, metrics = _loss(layout, model, p, mb, share)
        return loss * scale, metrics

    if accumulate.applies(model.cfg, accum):
        objective = functools.partial(_objective, model.cfg, layout.batch.mean, share)
        return accumulate.local_grads(model, layout.rules, objective, accum, params, rows, scale)
    grad_fn = jax.grad(scaled_loss, has_aux=True)
    if accum == 1:
        return grad_fn(params, rows)

    def body(carry: tuple[Any, Metrics], mb: jax.Array) -> tuple[tuple[Any, Metrics], None]:
        g, metrics = grad_fn(params, mb)
        return jax.tree.map(jnp.add, carry, (g, metrics)), None

    micro = rows.reshape(accum, rows.shape[0] // accum, rows.shape[1])
    # float32 sums, the compute params' gradients (parallel/fsdp.py compute_params) included
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
    device_grads: Callable, layout: Layout, mesh: Mesh, param_specs: Any, zero1: bool
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


def _update(
    tx: optax.GradientTransformation,
    clip: float,
    state: TrainState,
    grads: Any,
    grad_norm: jax.Array,
    finite: jax.Array,
) -> tuple[Any, Any]:
    """(params, optimizer state) after the optimizer's update of `grads` (clipped to global norm
    `clip` when > 0, reusing the norm the step logs anyway), or unchanged where the step is not
    finite. A select, not a branch: XLA updates the donated state in place through a select fused
    into the update, while a `lax.cond`'s outputs took new buffers, about twice the float32
    params' bytes (Mixtral-8x7B on 2 x 8 H100, planned: 6.0 GB of 16.1 GB of temporaries at 8 layers)."""
    if clip > 0:
        factor = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * factor, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    if_finite = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(if_finite, optax.apply_updates(state.params, updates), state.params)
    return params, jax.tree.map(if_finite, opt_state, state.opt_state)


def make_train_step(
    cfg: Config,
    model: GPT,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    param_specs: Any,
    faults: FaultPlan = NO_FAULTS,
) -> Callable:
    """train_step(state, batch) -> (state, metrics); batch is int32 [global_batch, T+1]."""
    # (on CPU the bfloat16 sums' rounding is written out: parallel/fsdp.py `reduce_scatter`)
    reduce_dtype = model.dtype if cfg.mesh.reduce_dtype == "compute" else jnp.float32
    layout = Layout(mesh, param_specs, model.dtype, reduce_dtype, cfg.mesh.zero1, cfg.mesh.expert_node)
    model = layout.place(model)
    accum, schedule, clip = cfg.gradient_accumulation_steps, lr_schedule(cfg), cfg.gradient_clip_val
    fp16 = cfg.dtype == "float16"
    masked = cfg.loss_mask  # unmasked data keeps the plain mean: its losses stay bit for bit
    bias_rate = cfg.model.moe.bias_update_rate

    def device_grads(
        grad_specs: Any, params: Any, rows: jax.Array, scale: jax.Array, step: jax.Array
    ) -> tuple[Any, Metrics]:
        if faults.nan_step > 0:  # test-only fault, traced only when asked for
            scale = poison_gradients(faults, scale, step, jax.lax.axis_index(mesh_lib.BATCH_AXES) == 0)
        share = layout.batch.target_share(layout.batch.loss_targets(rows), accum) if masked else None
        local = pipeline.local_grads if layout.stages > 1 else _local_grads
        grads, metrics = local(model, layout, accum, params, rows, scale, share)
        return layout.batch.reduce_grads(grads, grad_specs), layout.batch.mean(metrics)

    sharded_grads = _grads_on_mesh(device_grads, layout, mesh, param_specs, cfg.mesh.zero1)

    def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        compute = layout.fsdp.compute_params(state.params, cfg.model.tie_embeddings)
        grads, loss_metrics = sharded_grads(compute, batch, state.loss_scale, state.step)
        loss = loss_metrics["loss"]
        if fp16:
            grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = _update(tx, clip, state, grads, grad_norm, finite)
        if bias_rate:  # auxiliary-loss-free balancing: no gradient's, so beside the optimizer's update
            params = update_router_bias(params, loss_metrics["expert_load"], bias_rate * finite)
        new_state = _stepped(state, params, opt_state, finite, fp16)
        metrics = {
            **loss_metrics,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "finite": finite,
            "bad_steps": new_state.bad_steps,
            "skipped_steps": new_state.skipped_steps,
            "loss_scale": new_state.loss_scale,
        }
        return new_state, metrics

    return train_step


def _stepped(state: TrainState, params: Any, opt_state: Any, finite: jax.Array, fp16: bool) -> TrainState:
    """The state after a step that updated to `params`, `opt_state` (unchanged where not `finite`):
    its counters, and float16's loss scale moved by whether the step was finite."""
    scale, good = _loss_scale(state, finite, fp16)
    return state.replace(  # type: ignore[attr-defined]  # added by flax.struct.dataclass
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        loss_scale=scale,
        good_steps=good,
        bad_steps=jnp.where(finite, 0, state.bad_steps + 1),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
    )


def make_eval_step(
    model: GPT,
    mesh: Mesh,
    param_specs: Any,
    accum: int = 1,
    masked: bool = False,
    zero1: bool = False,
    expert_node: int = 0,
) -> Callable:
    """eval_step(params, batch) -> metrics of the global batch: `loss` (its mean; a mixture of
    experts' router figures beside it, as the train step's), taken in `accum` microbatches
    of the train step's device batch, one after another: evaluation fits wherever training does
    (the whole batch at once needed 145 GB per device for llama3_8b on 8 H100s). masked: the
    batch carries a loss mask, the loss is the train step's (over its loss targets), and the
    metrics carry their count (`kept`), so evaluations over several batches weigh each by it.
    zero1: the params come split over data (the train step's `compute_params`); expert_node: the
    train step's two-hop exchange (mesh.expert_node)."""
    layout = Layout(mesh, param_specs, model.dtype, zero1=zero1, expert_node=expert_node)
    model, mean = layout.place(model), layout.batch.mean

    def device_metrics(params: Any, rows: jax.Array) -> Metrics:
        targets = layout.batch.loss_targets(rows) if masked else None
        share = None if targets is None else layout.batch.target_share(targets, accum)
        if layout.stages > 1:
            metrics = mean(
                pipeline.loss(model, layout.rules, layout.manual, params, rows, accum, share, mean)[1]
            )
        elif accum == 1:
            metrics = mean(_loss(layout, model, params, rows, share)[1])
        else:
            micro = rows.reshape(accum, rows.shape[0] // accum, rows.shape[1])
            # Equal microbatches: the mean of their means is the mean over every row.
            per_micro = jax.lax.map(lambda mb: _loss(layout, model, params, mb, share)[1], micro)
            metrics = mean(jax.tree.map(lambda x: x.mean(axis=0), per_micro))
        return metrics if targets is None else metrics | {"kept": targets}

    metrics = jax.shard_map(
        device_metrics,
        mesh=mesh,
        in_specs=(layout.manual, mesh_lib.batch_spec()),
        out_specs=P(),
        axis_names=mesh_lib.manual_axes(mesh),
        check_vma=False,
    )
    return lambda params, rows: metrics(layout.fsdp.compute_params(params, model.cfg.tie_embeddings), rows)


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
            model,
            mesh,
            param_specs,
            cfg.gradient_accumulation_steps,
            cfg.loss_mask,
            cfg.mesh.zero1,
            cfg.mesh.expert_node,
        ),
        in_shardings=(state_shardings.params, batch),
        out_shardings=replicated,
    )
    return train, evaluate
