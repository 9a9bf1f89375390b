"""Gradient accumulation into one float32 buffer.

Plain accumulation (step._local_grads) adds each microbatch's gradient, a fresh buffer jax.grad
returns, to the running sum: two float32 copies of a device's gradient live at once (Mixtral-8x7B
on 2 x 8 H100: 11.7 GB each). Here the scanned layer stacks, which hold nearly every param, run
under a backward of our own that adds each layer's gradient into the running sum as soon as it is
made (an update of one layer's slice of a loop carry: XLA does it in place), so besides the sum
only one layer's gradient exists at a time. The running sum goes into the backward as an input of
the stack whose "cotangent" is the updated sum: jax.grad with respect to it returns the new sum.
The params outside the stacks (embeddings, final norm, head) take the plain way.

The forward keeps each layer's input and the backward recomputes the layer before
differentiating it: remat "full", the only policy this path serves (`applies`). The arithmetic is
the plain path's, layer by layer: tests/test_accumulate.py checks the two agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig
from jaxtrain.model.documents import Documents
from jaxtrain.model.transformer import GPT, forward, layers, scanned_stacks

Metrics = dict[str, jax.Array]
# objective(rows, each token's loss [b, T], the "moe" collection or None) -> (loss, metrics)
Objective = Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Metrics]]


def applies(cfg: ModelConfig, accum: int) -> bool:
    """Whether the step accumulates through this module: a mixture of experts' several microbatches
    over scanned layers under full remat (one microbatch has nothing to accumulate). Dense models
    keep the plain path: there XLA overlaps each layer's FSDP gather with the layer before better
    (llama3_8b at 131,072 tokens on 8 x 8 H100, planned: 0.96 s of communication left exposed
    against 3.62 s through this module, for 1 GB less), and their memory does not need the room."""
    return accum > 1 and cfg.scan_layers and cfg.remat == "full" and cfg.moe.n_experts > 0


def _add_at(total: jax.Array, i: jax.Array, g: jax.Array) -> jax.Array:
    """total[i] += g in place on a loop carry. A scatter-add, which XLA:GPU compiles to one
    update that reads the row as it writes it: a dynamic slice and its update (the same sum) left
    the slice its own fusion, the row read and written twice (Qwen3-30B-A3B on 4 x 8 H100, planned:
    0.07 s a step, schedule-aware 27.5 -> 28.2%)."""
    return total.at[i].add(g.astype(total.dtype), indices_are_sorted=True, unique_indices=True)


def _stack(layer: Callable[..., tuple[jax.Array, Any]]) -> Callable[..., tuple[jax.Array, Any]]:
    """stack(params, total, x, doc) -> (x, sown): the layers of a scanned stack (params stacked on
    a leading dim) one after another; its backward adds each layer's gradient into `total`
    (stacked as the params) and returns the sum as `total`'s cotangent. `layer(p, x, doc) -> (x,
    sown)` is one layer."""

    def forward(params: Any, x: jax.Array, doc: Any) -> tuple[tuple[jax.Array, Any], jax.Array]:
        def body(h: jax.Array, p: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
            y, sown = layer(p, h, doc)
            return y, (h, sown)

        y, (inputs, sown) = jax.lax.scan(body, x, params)
        return (y, sown), inputs

    @jax.custom_vjp
    def stack(params: Any, total: Any, x: jax.Array, doc: Any) -> tuple[jax.Array, Any]:
        return forward(params, x, doc)[0]

    def fwd(params: Any, total: Any, x: jax.Array, doc: Any) -> tuple[tuple[jax.Array, Any], Any]:
        out, inputs = forward(params, x, doc)
        return out, (params, total, inputs, doc)

    def bwd(saved: Any, cotangent: tuple[jax.Array, Any]) -> tuple[None, Any, jax.Array, None]:
        params, total, inputs, doc = saved
        dy, dsown = cotangent

        def body(carry: tuple[jax.Array, Any], one: Any) -> tuple[tuple[jax.Array, Any], None]:
            dx, total = carry
            i, p, h, ds = one
            _, vjp = jax.vjp(lambda p, h: layer(p, h, doc), p, h)  # recomputes the layer: remat full
            dp, dx = vjp((dx, ds))
            return (dx, jax.tree.map(lambda t, g: _add_at(t, i, g), total, dp)), None

        n = jax.tree.leaves(params)[0].shape[0]
        (dx, total), _ = jax.lax.scan(body, (dy, total), (jnp.arange(n), params, inputs, dsown), reverse=True)
        return None, total, dx, None

    stack.defvjp(fwd, bwd)
    return stack


def _layer(model: GPT, moe: bool) -> Callable[..., tuple[jax.Array, Any]]:
    """layer(p, x, doc) -> (x, its "moe" collection): one block of `model` (params gathered as the
    step's layout asks), without remat of its own: the stack's backward recomputes it."""
    block = layers(model, moe, checkpointed=True)

    def layer(p: Any, x: jax.Array, doc: Any) -> tuple[jax.Array, Any]:
        (y, _), sown = block.apply({"params": p}, x, doc, mutable=["moe"])
        return y, sown.get("moe", {})

    return layer


def local_grads(
    model: GPT, rules: Any, objective: Objective, accum: int, params: Any, rows: jax.Array, scale: jax.Array
) -> tuple[Any, Metrics]:
    """step._local_grads' (gradient, metrics) of this device's rows over `accum` microbatches, the
    stacks' gradients summed in one buffer. `model`: the step's (its layout's gather and kernel)."""
    stacks = {name: _stack(_layer(model, moe)) for name, _, moe in scanned_stacks(model.cfg)}
    rest = {k: v for k, v in params.items() if k not in stacks}
    # What the layers compute with, made once a step: the stacks take no gradient of their own.
    layers = {name: params[name] for name in stacks}
    stack_in = model.placement.stack_in
    if stack_in is not None:  # the experts cast once (parallel/fsdp.py whole_experts)
        layers = {name: stack_in({"params": p})["params"] for name, p in layers.items()}

    def scaled_loss(rest: Any, totals: Any, mb: jax.Array) -> tuple[jax.Array, Metrics]:
        sown = {}

        def stack(name: str, x: jax.Array, doc: Documents | None) -> jax.Array:
            x, sown[name] = stacks[name](layers[name], totals[name], x, doc)
            return x

        losses = forward(model, rest | layers, mb, stack)
        moe = {name: s for name, s in sown.items() if s}
        loss, metrics = objective(mb, losses, moe or None)
        return loss * scale, metrics

    grad_fn = jax.grad(scaled_loss, argnums=(0, 1), has_aux=True)
    micro = rows.reshape(accum, rows.shape[0] // accum, rows.shape[1])

    def body(carry: tuple[Any, Any, Metrics], mb: jax.Array) -> tuple[tuple[Any, Any, Metrics], None]:
        rest_sum, totals, metrics_sum = carry
        (g, totals), metrics = grad_fn(rest, totals, mb)
        return (jax.tree.map(jnp.add, rest_sum, g), totals, jax.tree.map(jnp.add, metrics_sum, metrics)), None

    with nn.logical_axis_rules(rules):  # the backward is traced inside too: its layers constrain
        # float32 sums, the compute params' gradients (parallel/fsdp.py compute_params) included
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (rest, layers))
        shapes = jax.eval_shape(grad_fn, rest, zeros[1], micro[0])[1]
        start = (*zeros, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        (rest_sum, totals, metrics), _ = jax.lax.scan(body, start, micro)
    # The stacks' sums as their params: what stack_in put beside them (model.matmul fp8's scales,
    # parallel/fsdp.py with_scales) took a gradient of zero, and the params have no such entry.
    totals = {name: _like(totals[name], params[name]) for name in stacks}
    grads = jax.tree.map(lambda x: x / accum, rest_sum | totals)
    return grads, jax.tree.map(lambda x: x / accum, metrics)


def _like(tree: Any, like: Any) -> Any:
    """`tree`'s entries at the keys of `like` (nested dicts of the same names), the rest dropped."""
    if not isinstance(like, Mapping):
        return tree
    return {key: _like(tree[key], sub) for key, sub in like.items()}
