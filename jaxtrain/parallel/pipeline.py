"""Pipeline parallelism: the scanned layer stack split into stages over the `pipeline` mesh axis.

Each stage runs n_layer / pipeline consecutive layers (the stack's `layers` dim split over the
axis: the same global array on any mesh, so checkpoints move between pipeline sizes). Where the
stages do not divide the layers (Llama 3 405B's 126 over 32) the stack is stored whole by layers
and split over `pipeline` by d_model instead (still the one global array); once a step each
stage's ceil(n_layer / pipeline) layers are regrouped from it by an all-to-all of the weights cast
to the compute dtype, the last stages padded with zero layers (the identity; a tick costs them as
real ones: 128 layers' work for 126). `_on_stage`. The step's shard_map is manual over `pipeline`
too, and the schedule is GPipe inside the differentiated function, as MaxText does it:
  - tick t: stage s holds microbatch t - s; stage 0 embeds it, every stage runs its layers on
    what it holds, then a `ppermute` hands each stage's output to the next; the last stage
    finishes microbatch t - (pipeline - 1), so M microbatches take M + pipeline - 1 ticks;
  - the head and loss are not in the tick (SPMD: a tick costs every stage what the slowest stage
    does, so a head run by the last stage alone would cost all of them, every tick): finished
    outputs ride a ring of `ppermute`s to their owner, stage m % pipeline, which stores them
    (M / pipeline of them, one microbatch's activation each) and after the ticks runs the head
    and loss of each; the ring sends what the tick before left, so it runs beside the layers;
  - jax.grad of that gives the backward: ppermute's transpose sends gradients back a stage a tick.
The bubble, (pipeline - 1) / (M + pipeline - 1) of each stage's layer work, is real compute on
zeros in this SPMD program, so the compiled program (and the planner's replay of it) counts it.
With remat `full` a tick is one checkpoint: each tick saves only its stage's input, and the
backward recomputes that tick once (the cost per-layer remat has), holding one stage's activations
for one microbatch. Inside a tick the stage's layers run unrolled, on its weight matrices cast to
the compute dtype once a step (`_casts`), and under model.matmul fp8 the projections' rounded to e4m3
once a step, which every tick's dots multiply as they are; their gradient accumulates in float32
over the ticks (straight through the cast and the rounding).
Params used outside the stack (embeddings, final norm, head) are whole on every stage; their
gradients are summed over the stages (each is zero where its stage does not use it).
A mixture of experts' stack exchanges each stage's rows inside its expert group; each stage adds
its own layers' router losses on the ticks that hold a microbatch, and the router figures of every
layer reach every stage (`_router_metrics`). Its dense first layers (DeepSeek-V3's 3) are a second
stack, whole on every stage, that stage 0 runs after the embedding, in a conditional the other
stages skip (`_tick`): stage 0's ticks cost that much more, as they do Megatron's first stage.
Planned for Llama 3 405B on 256 x 8 H100 (docs/scaling.md "Pipeline parallelism").
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.model import fp8
from jaxtrain.model.documents import Documents
from jaxtrain.model.head import mean_loss
from jaxtrain.model.moe import balance_loss, router_stats
from jaxtrain.model.params import logical_axes, path_names
from jaxtrain.model.transformer import GPT, embed, head, layers, scanned_stacks
from jaxtrain.parallel import fsdp, tensor
from jaxtrain.parallel import mesh as mesh_lib

AXIS = mesh_lib.PIPELINE_AXIS
Metrics = dict[str, jax.Array]
Arrays3 = tuple[jax.Array, jax.Array, jax.Array]


def bubble(stages: int, micro: int) -> float:
    """The share of each stage's ticks that compute nothing: (stages - 1) / (micro + stages - 1)."""
    return (stages - 1) / (micro + stages - 1)


def _stage(model: GPT) -> Callable[[Any, jax.Array, Documents | None], tuple[jax.Array, Metrics | None]]:
    """run(params, x, doc) -> (x, router stats): this stage's layers (its share of the scanned
    stack), from the stack's params, or unrolled from one tree per layer (`_layers`); a mixture of
    experts' router statistics of those layers in order (model/moe.py `router_stats`: load and
    probs [layers, E], z and dropped [layers]), None for dense layers."""
    # With remat full the tick is the checkpoint (`_tick`): the layers inside it need none.
    checkpointed = model.cfg.remat == "full"
    moe = scanned_stacks(model.cfg)[-1][2]

    def run(params: Any, x: jax.Array, doc: Documents | None) -> tuple[jax.Array, Metrics | None]:
        if isinstance(params, list):
            layer, sown = layers(model, moe, checkpointed=checkpointed), {}
            for i, one in enumerate(params):
                out, mutated = layer.apply({"params": one}, x, doc, mutable=["moe"])
                x, sown[f"block_{i}"] = out[0], mutated.get("moe")
            return x, router_stats(sown) if moe else None
        length = jax.tree.leaves(params)[0].shape[0]
        stack = layers(model, moe, length, checkpointed)
        out, mutated = stack.apply({"params": params}, x, doc, mutable=["moe"])
        return out[0], router_stats({"blocks": mutated["moe"]}) if moe else None

    return run


@jax.custom_vjp
def _as_casts(master: jax.Array, casts: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """`casts`, master's layers cast to the compute dtype once a step (`_casts`), with master's
    gradient: a tick's layers read their weights as they are (no cast, no slice, nothing saved per
    tick for the backward), and the gradient the ticks add up stays float32."""
    return casts


def _as_casts_forward(
    master: jax.Array, casts: tuple[jax.Array, ...]
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    return casts, jnp.zeros((0,), master.dtype)


def _as_casts_backward(dtype: jax.Array, g: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
    return jnp.stack(g).astype(dtype.dtype), None


_as_casts.defvjp(_as_casts_forward, _as_casts_backward)


def _on_stage(p: jax.Array, spec: P, logical: tuple[str | None, ...]) -> jax.Array:
    """This stage's run of layers of a scanned stack's param, from this device's block `p` of it
    (laid out by its manual `spec`; `logical`: its logical axes): `p` itself where the stack is
    split by layers. Where the stages do not divide the layers (mesh_lib.param_spec), the stack
    padded with zero layers to ceil(layers / stages) per stage, on the last stages (a pre-norm
    block of zeros adds zero to the residual stream: the identity), then regrouped: by an
    all-to-all over `pipeline` where the stack is split over it on another dim (each stage gets its
    layers' slices from every peer: `pipeline` innermost of the manual axes there, so they join in
    order), sliced where every stage holds it whole. The transposes take the gradient back to the
    stored layout (summed over stages by `sum_over_stages` where it is whole) and drop the padding's."""
    axes = [mesh_lib.entry_axes(entry) for entry in spec]
    if axes and AXIS in axes[0]:
        return p
    stages = jax.lax.axis_size(AXIS)
    length = -(-p.shape[0] // stages)
    split = next((i for i, held in enumerate(axes) if AXIS in held), None)

    def regroup(x: jax.Array) -> jax.Array:
        x = jnp.pad(x, [(0, length * stages - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
        if split is None:
            return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(AXIS) * length, length, 0)
        return jax.lax.all_to_all(x, AXIS, 0, split, tiled=True)

    # Manual over tensor too: left automatic, XLA moved the weights whole over tensor (the 405B's
    # all-to-alls 8 times the bytes).
    return regroup(p) if split is None else tensor.over_tensor(regroup, p, logical)


def _stage_tree(name: str, stack: Any, specs: Any, one: Callable[..., Any]) -> Any:
    """one(p, spec, logical axes) over the leaves of the stack `name` and their manual specs."""

    def leaf(path: tuple, p: jax.Array, spec: P) -> Any:
        return one(p, spec, logical_axes((name, *path_names(path)), p.ndim))

    return jax.tree_util.tree_map_with_path(leaf, stack, specs)


def _casts(model: GPT, name: str, stack: Any, specs: Any) -> Any:
    """(casts, quantized): the stage's weight matrices (leaves of 3+ dims: [layers, in, ...], which
    the layers only use in the compute dtype) cast once for all ticks, one array per layer, None for
    the rest (norm scales, biases); under model.matmul fp8, each projection's layers also rounded to
    e4m3 once for all ticks (a tree as casts: one (e4m3 array, scale, the e4m3 array laid out for the
    forward GEMM: fp8.fp8_dot_quantized) a layer), which the ticks' dots
    multiply as they are (model/layers.py `Fp8Dot`; the values each dot's own rounding gave). Cast
    before any regrouping (`_on_stage`), which then moves half the bytes. None at all under FSDP,
    whose per-layer gather casts (and rounds: parallel/fsdp.py), and whose gathers overlap the layer
    before only in a layer loop (XLA's pipelined all-gather)."""
    if model.placement.gather is not None:
        return None

    def one(p: jax.Array, spec: P, logical: tuple[str | None, ...]) -> tuple[jax.Array, ...] | None:
        cast = jax.lax.stop_gradient(p.astype(model.dtype))
        return tuple(_on_stage(cast, spec, logical)) if p.ndim >= 3 else None

    def rounded(path: tuple, layers: tuple[jax.Array, ...] | None) -> tuple | None:
        if model.cfg.matmul != "fp8" or layers is None or not fp8.projection((name, *path_names(path))):
            return None
        contracted = fp8.contracted((name, *path_names(path)), layers[0].ndim)
        rounded = [fp8.quantize(layer, fp8.FORWARD) for layer in layers]
        return tuple((q, s, fp8.contracting_last(q, contracted)) for q, s in rounded)

    casts = _stage_tree(name, stack, specs, one)
    return casts, jax.tree_util.tree_map_with_path(rounded, casts, is_leaf=_is_layers)


ROUNDED = (fp8.QUANTIZED, fp8.SCALE, fp8.TRANSPOSED)  # what `_casts` gives each FP8 projection's layer


def _is_layers(x: Any) -> bool:
    return x is None or isinstance(x, tuple)


def _layers(stack: Any, casts: Any) -> Any:
    """The stage's params for `_stage`: one tree per layer, unrolled (a stage is a few layers:
    405B over 32 stages, 4; as a loop inside the tick loop XLA peeled it and copied each layer's
    saved activations and weight slices), each FP8 projection's e4m3 layer and scale beside its
    kernel (`_casts`); the stack itself where there are no casts."""
    if casts is None:
        return stack
    casts, quantized = casts
    length = jax.tree.leaves(stack)[0].shape[0]
    per_leaf = jax.tree.map(
        lambda p, c: tuple(p) if c is None else _as_casts(p, c), stack, casts, is_leaf=lambda c: c is None
    )
    layers = [
        jax.tree.map(operator.itemgetter(i), per_leaf, is_leaf=lambda x: isinstance(x, tuple))
        for i in range(length)
    ]
    rounded = [
        (path, q) for path, q in jax.tree_util.tree_flatten_with_path(quantized, is_leaf=_is_layers)[0] if q
    ]
    return [
        fsdp.beside(layer, [(path, dict(zip(ROUNDED, q[i], strict=True))) for path, q in rounded])
        for i, layer in enumerate(layers)
    ]


def _tick(model: GPT, share: jax.Array | None) -> tuple[Callable[..., Any], Callable[..., jax.Array]]:
    """(work, head_loss): work(params, casts, held, rows) -> (out, router stats), one stage's tick
    on the microbatch it holds (rows [b, T+1]; casts: `_casts`): stage 0 embeds it (the others take
    `held`, the previous stage's output), then the stage's layers run (`_stage`); head_loss(params, out,
    rows): the model's loss of a finished microbatch's output, its logits recomputed in the
    backward, never saved."""
    cfg, run, stage = model.cfg, _stage(model), jax.lax.axis_index(AXIS)
    *dense, (name, _, _) = scanned_stacks(cfg)
    checkpointed = cfg.remat == "full"  # the tick is the checkpoint (`_stage`)

    def first(params: Any, x: jax.Array, doc: Documents | None) -> jax.Array:
        """A mixture of experts' dense first layers (DeepSeek-V3's), whole on every stage and run
        by stage 0 alone (a conditional: the other stages skip their compute)."""
        if not dense:
            return x
        (stack, length, _) = dense[0]
        run_dense = layers(model, False, length, checkpointed)
        ran = lambda x: run_dense.apply({"params": params[stack]}, x, doc)[0]  # noqa: E731
        return jax.lax.cond(stage == 0, ran, lambda x: x, x)

    def loss(params: Any, out: jax.Array, rows: jax.Array) -> jax.Array:
        # Each token's loss, over model.token_chunks pieces as the pipeline-free step takes them.
        return mean_loss(head(model, params, out, rows), rows, share)

    def work(params: Any, casts: Any, held: jax.Array, rows: jax.Array) -> tuple[jax.Array, Metrics | None]:
        fresh, doc = embed(model, params, rows)
        return run(_layers(params[name], casts), jnp.where(stage == 0, first(params, fresh, doc), held), doc)

    tick = jax.checkpoint(work, policy=fp8.saving_scales(cfg.matmul)) if cfg.remat == "full" else work
    return tick, jax.checkpoint(loss)


def _held_rules(rules: Any) -> Any:
    """The step's rules, plus `held`: what a tick saves for the backward and sends to the next
    stage, split along the sequence over `tensor` (whose peers hold it whole in the layers): a
    tensor group saves and sends it once, not once per peer. Not where context splits the sequence."""
    axes = dict(rules)
    if "length" in axes or mesh_lib.TENSOR_AXIS not in axes.values():
        return rules
    return (*rules, ("held", mesh_lib.TENSOR_AXIS))


def _held(x: jax.Array) -> jax.Array:
    return nn.with_logical_constraint(x, ("batch", "held", "embed"))


def _store(finished: jax.Array, passing: jax.Array, m: jax.Array, micro: int) -> jax.Array:
    """`finished` [slots, ...] with `passing`, microbatch m's finished output, in slot m // stages
    if this stage owns m (m % stages): each stage stores every stages-th microbatch for the head."""
    stages, stage = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    slot = jnp.clip(m // stages, 0, finished.shape[0] - 1)
    old = jax.lax.dynamic_index_in_dim(finished, slot, keepdims=False)
    mine = (m >= 0) & (m < micro) & (m % stages == stage)
    return jax.lax.dynamic_update_index_in_dim(finished, jnp.where(mine, passing, old), slot, 0)


def _pass_on(
    passing: jax.Array, done: jax.Array, finished: jax.Array, t: jax.Array, stage: jax.Array, micro: int
) -> tuple[jax.Array, jax.Array]:
    """The ring at tick t: (what this stage sends on, `finished` with what it owns stored)."""
    stages = jax.lax.axis_size(AXIS)
    last = stages - 1
    ring = [(i, (i + 1) % stages) for i in range(stages)]  # finished outputs, to their owners
    # The last stage sends `done`, its output of the tick before (microbatch t - 1 - last); the
    # others pass on what reached them (microbatch t - stages - 1 - stage), each storing what it
    # owns. Sent from what the tick before left, the transfer runs beside the tick's layers, not
    # after them.
    sent = jnp.where(stage == last, done, passing)
    finished = _store(finished, sent, jnp.where(stage == last, t - 1 - last, t - stages - 1 - stage), micro)
    return jax.lax.ppermute(_held(sent), AXIS, ring), finished


def _router_sums(mean: Callable[[Any], Any], stats: Metrics, valid: jax.Array) -> Metrics:
    """One tick's router figures of this stage's MoE layers, zero where the stage holds no
    microbatch or a layer is padding (`valid` [layers]): as step._objective takes them for a
    microbatch, each layer's balance loss from the whole batch's load (`mean`: over the batch axes)."""
    load = mean(stats["load"])
    per_layer = {
        "load": load,
        "balance": balance_loss(load, stats["probs"]),
        "z": stats["z"],
        "dropped": stats["dropped"],
    }
    return {k: jnp.where(valid.reshape(-1, *(1,) * (v.ndim - 1)), v, 0) for k, v in per_layer.items()}


def _router_metrics(sums: Metrics, micro: int, n_layers: int) -> Metrics:
    """step._objective's router metrics from each stage's sums over its ticks: every stage's layers
    in order, on every stage (an all-reduce over `pipeline` of each stage's rows in place), averaged
    over microbatches (and layers: the balance and z losses, the share dropped)."""
    stage, stages = jax.lax.axis_index(AXIS), jax.lax.axis_size(AXIS)

    def whole(x: jax.Array) -> jax.Array:
        placed = jnp.zeros((stages * x.shape[0], *x.shape[1:]), x.dtype)
        placed = jax.lax.dynamic_update_slice_in_dim(placed, x, stage * x.shape[0], 0)
        return jax.lax.psum(placed, AXIS)[:n_layers] / micro

    every = {k: whole(v) for k, v in sums.items()}
    return {
        "moe_balance_loss": every["balance"].mean(), "moe_z_loss": every["z"].mean(),
        "expert_load": every["load"], "moe_dropped": every["dropped"].mean(),
    }  # fmt: skip


def loss(
    model: GPT,
    rules: Any,
    manual: Any,
    params: Any,
    rows: jax.Array,
    micro: int,
    share: jax.Array | None = None,
    mean: Callable[[Any], Any] = lambda x: x,
) -> tuple[jax.Array, Metrics]:
    """(loss to differentiate, metrics) of this device's rows [n, T+1] in `micro` microbatches:
    the mean of their mean next-token losses (a loss mask's sums over its loss targets over `share`, as
    step._token_loss), as gradient accumulation takes it. Each stage's loss is that of the
    microbatches whose head it ran (the sum over stages is the loss), plus, for a mixture of
    experts, the router losses of its own layers on every microbatch it held (step._objective's,
    whose layers' mean is split over the stages: `mean` is the batch's, for the expert load);
    metrics are the whole loss and router figures on every stage. `manual`: the params' manual
    specs (parallel/placement.py Layout.manual)."""
    stages, stage = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    last = stages - 1
    split = rows.reshape(micro, rows.shape[0] // micro, rows.shape[1])
    shift = [(i, i + 1) for i in range(last)]  # activations: the last stage's output leaves
    name, n_layers, moe = scanned_stacks(model.cfg)[-1]
    length = -(-n_layers // stages)  # each stage's layers, padding included (`_on_stage`)
    real = stage * length + jnp.arange(length) < n_layers

    def tick(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
        held, passing, done, finished, router = carry
        passing, finished = _pass_on(passing, done, finished, t, stage, micro)
        mine = jnp.clip(t - stage, 0, micro - 1)  # the microbatch this stage holds (bubble: clipped)
        out, stats = work(params, casts, held, jax.lax.dynamic_index_in_dim(split, mine, keepdims=False))
        if moe:
            sums = _router_sums(mean, stats, real & (t >= stage) & (t - stage < micro))
            router = jax.tree.map(jnp.add, router, sums)
        return (jax.lax.ppermute(_held(out), AXIS, shift), passing, out, finished, router), None

    def drain(carry: Arrays3, t: jax.Array) -> tuple[Arrays3, None]:
        passing, done, finished = carry  # the last microbatches on their way to their owners
        passing, finished = _pass_on(passing, done, finished, t, stage, micro)
        return (passing, done, finished), None

    def head(total: jax.Array, slot: jax.Array) -> tuple[jax.Array, None]:
        m = slot * stages + stage
        rows = jax.lax.dynamic_index_in_dim(split, jnp.minimum(m, micro - 1), keepdims=False)
        value = head_loss(params, jax.lax.dynamic_index_in_dim(finished, slot, keepdims=False), rows)
        return total + jnp.where(m < micro, value, 0.0), None

    with nn.logical_axis_rules(_held_rules(rules)):
        work, head_loss = _tick(model, share)
        casts = _casts(model, name, params[name], manual[name])
        # The stage's layers in the params' dtype: only the gradient's path where there are casts.
        params = {**params, name: _stage_tree(name, params[name], manual[name], _on_stage)}
        held = _held(jnp.zeros((split.shape[1], split.shape[2] - 1, model.cfg.d_model), model.dtype))
        finished = jnp.zeros((-(-micro // stages), *held.shape), held.dtype)
        finished = nn.with_logical_constraint(finished, (None, "batch", "held", "embed"))
        ticks = micro + last
        router: Metrics = {}  # a mixture of experts' sums over ticks, as `_router_sums` gives them
        if moe:
            zero = jnp.zeros(length, jnp.float32)
            router = {"load": jnp.zeros((length, model.cfg.moe.n_experts)), "balance": zero, "z": zero}
            router["dropped"] = zero
        carry = (held, held, held, finished, router)
        (_, passing, done, finished, router), _ = jax.lax.scan(tick, carry, jnp.arange(ticks))
        (_, _, finished), _ = jax.lax.scan(
            drain, (passing, done, finished), jnp.arange(ticks, ticks + stages)
        )
        total, _ = jax.lax.scan(head, jnp.zeros((), jnp.float32), jnp.arange(finished.shape[0]))
    mine = total / micro
    metrics = {"loss": jax.lax.psum(mine, AXIS)}
    if not moe:
        return mine, metrics
    coef = model.cfg.moe
    aux = (coef.balance_coef * router["balance"].sum() + coef.z_loss_coef * router["z"].sum()) / (
        micro * n_layers
    )
    return mine + aux, metrics | _router_metrics(router, micro, n_layers)


def sum_over_stages(grads: Any, manual: Any) -> Any:
    """Gradients of params whole on every stage (not split over `pipeline`), summed over stages."""

    def one(g: jax.Array, spec: P) -> jax.Array:
        return g if AXIS in mesh_lib.spec_axes(spec) else jax.lax.psum(g, AXIS)

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
    """step._local_grads through the pipeline (`model` placed by `layout`: parallel/placement.py): the
    gradient of this device's rows over `accum` microbatches, in one backward pass of the schedule."""

    def scaled_loss(p: Any) -> tuple[jax.Array, Metrics]:
        value, metrics = loss(model, layout.rules, layout.manual, p, rows, accum, share, layout.batch.mean)
        return value * scale, metrics

    grads, metrics = jax.grad(scaled_loss, has_aux=True)(params)
    return sum_over_stages(grads, layout.manual), metrics
