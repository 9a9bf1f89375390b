"""Pipeline parallelism: the scanned layer stack split into stages over the `pipeline` mesh axis.

Each stage holds n_layer / pipeline consecutive layers (the stack's `layers` dim split over the
axis: the same global array on any mesh, so checkpoints move between pipeline sizes). The step's
shard_map is manual over `pipeline` too, and the schedule is GPipe inside the differentiated
function, as MaxText does it:
  - every stage embeds its rows (only stage 0's embedding is used);
  - tick t: every stage runs its layers on what it holds (stage 0: microbatch t), then a
    `ppermute` hands each stage's output to the next; the last stage's output at tick t is
    microbatch t - (pipeline - 1), so M microbatches take M + pipeline - 1 ticks;
  - the head and loss run per microbatch on the last stage's outputs (every stage computes them;
    only the last stage's count: its loss is the one differentiated, the others are zeroed);
  - jax.grad of that gives the backward: ppermute's transpose sends gradients back a stage a tick.
The bubble, (pipeline - 1) / (M + pipeline - 1) of each stage's layer work, is real compute on
zeros in this SPMD program, so the compiled program (and the planner's replay of it) counts it.
With remat `full` a stage is one checkpoint: a tick keeps only its stage's input, and the backward
recomputes that stage's layers once (the cost per-layer remat has), holding one stage's activations.
Params used outside the stack (embeddings, final norm, head) are whole on every stage; their
gradients are summed over the stages (each is zero where its stage does not use it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxtrain.model.documents import Documents, documents
from jaxtrain.model.transformer import GPT, block_class, layer_stack, scanned_stacks
from jaxtrain.run import mesh as mesh_lib
from jaxtrain.text.format import NO_LOSS, TOKEN_BITS

AXIS = mesh_lib.PIPELINE_AXIS
Metrics = dict[str, jax.Array]


def bubble(stages: int, micro: int) -> float:
    """The share of each stage's ticks that compute nothing: (stages - 1) / (micro + stages - 1)."""
    return (stages - 1) / (micro + stages - 1)


def _stage(model: GPT) -> Callable[[Any, jax.Array, Documents | None], jax.Array]:
    """run(stack params, x, doc) -> x: this stage's layers (its share of the scanned stack)."""
    cfg = model.cfg
    whole = cfg.remat == "full"  # the stage is the checkpoint: its layers inside need none
    block = block_class(dataclasses.replace(cfg, remat="none") if whole else cfg, model.gather)

    def run(params: Any, x: jax.Array, doc: Documents | None) -> jax.Array:
        length = jax.tree.leaves(params)[0].shape[0]
        stack = layer_stack(block, length)(cfg, model.dtype, False, False)
        return stack.apply({"params": params}, x, doc)[0]

    return jax.checkpoint(run) if whole else run


def _ticks(model: GPT, stack: Any, x: jax.Array, doc: Documents | None, micro: int) -> jax.Array:
    """The last stage's outputs [micro, b, T, d] for inputs x [micro * b, T, d] (stage 0's)."""
    stages, stage = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    split = lambda a: a.reshape(micro, a.shape[0] // micro, *a.shape[1:])  # noqa: E731
    xs, docs = split(x), jax.tree.map(split, doc)
    run = _stage(model)
    shift = [(i, i + 1) for i in range(stages - 1)]  # the last stage's output leaves the pipeline

    def tick(held: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        fresh = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, micro - 1), keepdims=False)
        mine = jnp.clip(t - stage, 0, micro - 1)  # the microbatch this stage holds (bubble: clipped)
        d = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, mine, keepdims=False), docs)
        out = run(stack, jnp.where(stage == 0, fresh, held), d)
        return jax.lax.ppermute(out, AXIS, shift), out

    _, outs = jax.lax.scan(tick, jnp.zeros_like(xs[0]), jnp.arange(micro + stages - 1))
    return outs[stages - 1 :]


def loss(
    model: GPT, rules: Any, params: Any, rows: jax.Array, micro: int, share: jax.Array | None = None
) -> tuple[jax.Array, Metrics]:
    """(loss to differentiate, metrics) of this device's rows [n, T+1] in `micro` microbatches:
    the mean of their mean next-token losses (a loss mask's kept sums over `share`, as
    step._token_loss), as gradient accumulation takes it. The loss is the last stage's (zero on
    the others: the sum over stages is the loss); metrics are the last stage's on every stage."""
    stages, stage = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    cfg = model.cfg
    tokens = rows & TOKEN_BITS
    inputs = tokens[:, :-1]
    masked = cfg.doc_bos >= 0 or cfg.doc_eos >= 0
    doc = documents(inputs, cfg.doc_bos, cfg.doc_eos) if masked else None
    (name, _, _), variables = scanned_stacks(cfg)[0], {"params": params}
    with nn.logical_axis_rules(rules):
        x: jax.Array = model.clone(span="embed").apply(variables, inputs)  # type: ignore[assignment]
        outs = _ticks(model, params[name], x, doc, micro)
        head = model.clone(span="head")

        @jax.checkpoint  # one microbatch's logits at a time, recomputed for the backward
        def one(h: jax.Array, r: jax.Array) -> jax.Array:
            losses = optax.softmax_cross_entropy_with_integer_labels(
                head.apply(variables, h), r[:, 1:] & TOKEN_BITS
            )
            return (
                losses.mean() if share is None else jnp.where(r[:, 1:] & NO_LOSS, 0.0, losses).sum() / share
            )

        split = rows.reshape(micro, rows.shape[0] // micro, rows.shape[1])
        mean = jax.lax.map(lambda a: one(*a), (outs, split)).mean()
    mine = jnp.where(stage == stages - 1, mean, 0.0)
    return mine, {"loss": jax.lax.psum(mine, AXIS)}


def sum_over_stages(grads: Any, manual: Any) -> Any:
    """Gradients of params whole on every stage (not split over `pipeline`), summed over stages."""

    def one(g: jax.Array, spec: P) -> jax.Array:
        split = {a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,))}
        return g if AXIS in split else jax.lax.psum(g, AXIS)

    return jax.tree.map(one, grads, manual, is_leaf=lambda x: isinstance(x, P))


def local_grads(
    model: GPT,
    layout: Any,
    accum: int,
    params: Any,
    rows: jax.Array,
    scale: jax.Array,
    share: jax.Array | None = None,
) -> tuple[Any, Metrics]:
    """step._local_grads through the pipeline (`layout`: step._ParamLayout): the gradient of this
    device's rows over `accum` microbatches, in one backward pass of the whole schedule."""

    def scaled_loss(p: Any) -> tuple[jax.Array, Metrics]:
        value, metrics = loss(layout.model(model), layout.rules, p, rows, accum, share)
        return value * scale, metrics

    grads, metrics = jax.grad(scaled_loss, has_aux=True)(params)
    return sum_over_stages(grads, layout.manual), metrics
