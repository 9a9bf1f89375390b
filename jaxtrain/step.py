"""Pure train and eval steps: shard_map data parallelism, scanned gradient accumulation.

Each device computes the gradient of its own rows (all microbatches, scanned), then one
`pmean` over the batch axes reduces it: one gradient all-reduce per optimizer step, however
many microbatches. A step with a non-finite loss or gradient leaves params and optimizer
state unchanged; every process decides identically because it judges reduced values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtrain import mesh as mesh_lib
from jaxtrain.config import Config
from jaxtrain.faults import poison_gradients
from jaxtrain.model import GPT
from jaxtrain.optim import lr_schedule
from jaxtrain.state import TrainState

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Dynamic loss scaling (float16): double the scale after this many finite steps in a row.
_SCALE_GROWTH_INTERVAL = 2000

Metrics = dict[str, jax.Array]


def compute_dtype(cfg: Config) -> Any:
    return _DTYPES[cfg.dtype]


def _token_loss(model: GPT, params: Any, rows: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of rows [b, T+1], in float32."""
    logits = model.apply({"params": params}, rows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()


def _local_grads(
    model: GPT, accum: int, params: Any, rows: jax.Array, scale: jax.Array
) -> tuple[Any, jax.Array]:
    """Gradient and loss of this device's rows, averaged over `accum` microbatches."""

    def scaled_loss(p: Any, mb: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss = _token_loss(model, p, mb)
        return loss * scale, loss

    grad_fn = jax.grad(scaled_loss, has_aux=True)
    if accum == 1:
        return grad_fn(params, rows)

    def body(carry: tuple[Any, jax.Array], mb: jax.Array) -> tuple[tuple[Any, jax.Array], None]:
        g_sum, l_sum = carry
        g, loss = grad_fn(params, mb)
        return (jax.tree.map(jnp.add, g_sum, g), l_sum + loss), None

    micro = rows.reshape(accum, rows.shape[0] // accum, rows.shape[1])
    zeros = jax.tree.map(jnp.zeros_like, params)
    (g_sum, l_sum), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
    return jax.tree.map(lambda g: g / accum, g_sum), l_sum / accum


def _reduce(tree: Any) -> Any:
    return jax.lax.pmean(tree, mesh_lib.BATCH_AXES)


def make_train_step(cfg: Config, model: GPT, tx: optax.GradientTransformation, mesh: Mesh) -> Callable:
    """train_step(state, batch) -> (state, metrics); batch is int32 [global_batch, T+1]."""
    accum = cfg.gradient_accumulation_steps
    schedule = lr_schedule(cfg)
    fp16 = cfg.dtype == "float16"
    clip = cfg.gradient_clip_val

    def device_grads(
        params: Any, rows: jax.Array, scale: jax.Array, step: jax.Array
    ) -> tuple[Any, jax.Array]:
        if cfg.debug.nan_step > 0:  # test-only fault, traced only when asked for
            scale = poison_gradients(cfg.debug, scale, step, jax.lax.axis_index(mesh_lib.BATCH_AXES) == 0)
        grads, loss = _local_grads(model, accum, params, rows, scale)
        return _reduce(grads), _reduce(loss)

    # check_vma=False: params enter replicated and we reduce explicitly, exactly once.
    sharded_grads = jax.shard_map(
        device_grads,
        mesh=mesh,
        in_specs=(P(), mesh_lib.batch_spec(), P(), P()),
        out_specs=(P(), P()),
        check_vma=False,
    )

    def apply(state: TrainState, grads: Any, grad_norm: jax.Array) -> tuple[Any, Any]:
        if clip > 0:  # global-norm clipping here, reusing the norm we log anyway
            factor = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * factor, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    def skip(state: TrainState, grads: Any, grad_norm: jax.Array) -> tuple[Any, Any]:
        return state.params, state.opt_state

    def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        grads, loss = sharded_grads(state.params, batch, state.loss_scale, state.step)
        if fp16:
            grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # A branch, not a select: a good step pays nothing for the ability to skip a bad one.
        params, opt_state = jax.lax.cond(finite, apply, skip, state, grads, grad_norm)
        good = jnp.where(finite, state.good_steps + 1, 0)
        scale = state.loss_scale
        if fp16:
            grow = good >= _SCALE_GROWTH_INTERVAL
            scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), jnp.maximum(scale / 2, 1.0))
            good = jnp.where(grow, 0, good)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            loss_scale=scale,
            good_steps=good,
            bad_steps=jnp.where(finite, 0, state.bad_steps + 1),
            skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "finite": finite,
            "bad_steps": new_state.bad_steps,
            "skipped_steps": new_state.skipped_steps,
            "loss_scale": scale,
        }
        return new_state, metrics

    return train_step


def make_eval_step(model: GPT, mesh: Mesh) -> Callable:
    """eval_step(params, batch) -> mean loss over the global batch."""

    def device_loss(params: Any, rows: jax.Array) -> jax.Array:
        return _reduce(_token_loss(model, params, rows))

    return jax.shard_map(
        device_loss, mesh=mesh, in_specs=(P(), mesh_lib.batch_spec()), out_specs=P(), check_vma=False
    )


def jit_steps(
    cfg: Config, model: GPT, tx: optax.GradientTransformation, mesh: Mesh, state_shardings: Any
) -> tuple[Callable, Callable]:
    """Jit both steps once with explicit shardings; the train step donates the old state."""
    replicated = mesh_lib.replicated(mesh)
    batch = mesh_lib.batch_sharding(mesh)
    train = jax.jit(
        make_train_step(cfg, model, tx, mesh),
        in_shardings=(state_shardings, batch),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        make_eval_step(model, mesh),
        in_shardings=(state_shardings.params, batch),
        out_shardings=replicated,
    )
    return train, evaluate
