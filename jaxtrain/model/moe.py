"""Mixture of experts: a router picks each token's top-k experts, and only those run on it.

Routing (`route`): softmax top-k (Mixtral, Qwen3-MoE), or DeepSeek-V3's sigmoid scores picked with
a per-expert bias (selection only; moved after each step by `update_router_bias`) from the best
groups; shared experts (model/mlp.py) see every token. Dropless: the copies are sorted by expert
(`dispatch`, `permute`: gathers, and so are their gradients) and run as one grouped matmul
(`moe.grouped_matmul`: `jax.lax.ragged_dot`, `blocks` of BLOCK rows per expert, or `pallas`:
model/grouped.py's Hopper kernels, computing only the rows routed; `pallas_fp8`, on FP8 tiles,
beside model.matmul fp8). The routed rows reach their experts through a `Wire`: here they stay;
under expert parallelism the step's placement sends them to the devices that hold their experts
(parallel/expert.py). Under remat the routed block has a backward of its own (`_routed`: the
recomputation sends nothing); the copies may travel in FP8 (`dispatch_dtype`), and a layer's
tokens in pieces (`chunks`: one piece's exchange beside another's experts). The router's
statistics are sown into "moe" (`router_stats`) for the balancing loss (`balance_loss`). What each
choice costs, measured and planned: docs/moe.md and docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.config import ModelConfig, MoeConfig
from jaxtrain.model import auto, fp8
from jaxtrain.model.layers import constrain, dense, residual_std
from jaxtrain.model.mlp import mlp
from jaxtrain.model.placement import LOCAL, Placement


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block `layer` has experts: every `every`-th, counted from 1 (Hugging Face's sparse step),
    past the first `first_dense` and not one of `dense_layers`."""
    moe = cfg.moe
    dense_layers = {int(x) for x in moe.dense_layers.split(",") if x.strip()}
    return (
        moe.n_experts > 0
        and layer >= moe.first_dense
        and (layer + 1) % moe.every == 0
        and (layer not in dense_layers)
    )


BLOCK = 128  # rows per block of the `blocks` grouped matmul


def _activation(h: jax.Array, swiglu: bool) -> jax.Array:
    if swiglu:
        gate, up = jnp.split(h, 2, axis=-1)
        return nn.silu(gate) * up
    return nn.gelu(h)


class Given(NamedTuple):
    """What `pallas_fp8`'s kernels multiply as given, each (FP8 values, scale) or None (the kernel
    rounds it itself): the rows as they travelled (`Wire.rows_out`), w_in's and w_out's as fsdp
    gathered them (one scale an expert: parallel/fsdp.py), the output's gradient rounded where it
    landed (`_routed_bwd`)."""

    rows: Any = None
    w_in: Any = None
    w_out: Any = None
    grad: Any = None


def expert_mlps(
    rows: jax.Array,
    sizes: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    impl: str,
    routed: int | None = None,
    given: Given | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Rows [m, d] sorted by expert, `sizes[e]` of them for expert e -> each through its expert's MLP.

    w_in is [E, d, 2, ff] (SwiGLU: gate and up) or [E, d, ff] (GELU); w_out [E, ff, d]. Rows past
    sum(sizes) (exchange padding) belong to no expert: they come out zero, or under `pallas` and
    `pallas_fp8` (its FP8 tiles under model.matmul fp8: model/grouped_fp8.py) hold any bits (NaN
    among them: the exchange sends only routed rows back). `routed`: how many rows are routed here
    under an even load (default m), the FLOPs the planner counts for the Pallas kernels, which
    compute only the routed rows whatever the buffer. `given`: under `pallas_fp8`, the operands its
    kernels multiply as they are (`Given`). `interpret`: the Pallas kernels in their GPU
    interpreter (tests on CPU).
    """
    e, d = w_in.shape[:2]
    w_in, swiglu = w_in.reshape(e, d, -1), w_in.ndim == 4
    if impl in ("pallas", "pallas_fp8"):
        routed = rows.shape[0] if routed is None else routed
        # Pallas's modules: imported only where they run
        first: Any
        second: Any
        if impl == "pallas_fp8":
            from jaxtrain.model.grouped_fp8 import ragged_matmul_fp8

            given = given or Given()
            q_in = None if given.w_in is None else (given.w_in[0].reshape(e, d, -1), given.w_in[1])
            first = functools.partial(ragged_matmul_fp8, rounded=given.rows, w_rounded=q_in)
            second = functools.partial(ragged_matmul_fp8, w_rounded=given.w_out, g_rounded=given.grad)
        else:
            from jaxtrain.model.grouped_kernels import ragged_matmul

            first = second = ragged_matmul
        h = _activation(first(rows, w_in, sizes, routed, interpret), swiglu)
        return second(h, w_out, sizes, routed, interpret)
    if impl == "ragged_dot":
        h = _activation(jax.lax.ragged_dot(rows, w_in, sizes), swiglu)
        return jax.lax.ragged_dot(h, w_out, sizes)
    m = rows.shape[0]
    n_blocks = -(-m // BLOCK) + e  # each expert wastes less than one block
    padded = -(-sizes // BLOCK) * BLOCK
    ends = jnp.cumsum(sizes)
    expert = jnp.searchsorted(ends, jnp.arange(m), side="right")  # e for rows past sum(sizes)
    start = (jnp.cumsum(padded) - padded)[jnp.minimum(expert, e - 1)]
    # A row's place in the padded blocks; rows of no expert go past the end: dropped, read as zeros.
    pos = jnp.where(
        expert < e, start + jnp.arange(m) - (ends - sizes)[jnp.minimum(expert, e - 1)], n_blocks * BLOCK
    )
    blocks = jnp.zeros((n_blocks * BLOCK, d), rows.dtype).at[pos].set(rows, mode="drop")
    block_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_blocks) * BLOCK, side="right")
    block_expert = jnp.minimum(block_expert, e - 1)  # blocks past the last expert's hold zeros
    blocks = blocks.reshape(n_blocks, BLOCK, d)
    h = _activation(jnp.einsum("bmd,bdf->bmf", blocks, w_in[block_expert]), swiglu)
    out = jnp.einsum("bmf,bfd->bmd", h, w_out[block_expert]).reshape(n_blocks * BLOCK, -1)
    return out.at[pos].get(mode="fill", fill_value=0)


@jax.custom_vjp
def permute(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[perm] for a permutation `perm` of x's rows (`inverse` = argsort(perm)), whose gradient
    is the gather g[inverse]: the plain gather's is a scatter-add into a zeroed buffer (a write of
    the buffer, then one of every row, on the exchange buffers of each MoE layer)."""
    return x[perm]


def _permute_fwd(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x[perm], inverse


def _permute_bwd(inverse: jax.Array, g: jax.Array) -> tuple[jax.Array, None, None]:
    return g[inverse], None, None


permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch(tokens: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    """Token i's k copies (copy j of token i at i*k + j) in `order`: tokens[order // k]. Its
    gradient sums each token's copies by a gather (g[inverse], k rows a token), not a scatter-add."""
    return tokens[order // k]


def _dispatch_fwd(
    tokens: jax.Array, order: jax.Array, inverse: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:
    return tokens[order // k], inverse


def _dispatch_bwd(k: int, inverse: jax.Array, g: jax.Array) -> tuple[jax.Array, None, None]:
    copies = g[inverse].reshape(-1, k, g.shape[-1])
    return copies.sum(axis=1, dtype=jnp.float32).astype(g.dtype), None, None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Rows x [n, d] -> (x in `dtype` [n, d], float32 scales [n, d / block]): each block of 128
    values (fewer if d is not a multiple) scaled by its largest magnitude to dtype's largest."""
    n, d = x.shape
    blocks = x.reshape(n, d // math.gcd(d, 128), -1).astype(jnp.float32)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return (blocks / scale).astype(dtype).reshape(n, d), scale[..., 0]


def _dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    n, d = q.shape
    return (
        (q.reshape(n, scale.shape[1], -1).astype(jnp.float32) * scale[..., None]).astype(dtype).reshape(n, d)
    )


class Groups(NamedTuple):
    """The rows of each expert, in order (`sizes` [E]): how a piece's routed rows are grouped on this
    device. An exchange's plan (parallel/expert.py `Plan`) holds the same, and where the rows go."""

    sizes: jax.Array


@dataclasses.dataclass(frozen=True)
class Wire:
    """How routed rows reach their experts and come back, and what the experts run (static): here
    the rows stay where they are (one device); parallel/expert.py's wires send them over the mesh.
    `routed`: the rows an even load brings a device (what the pallas kernel's FLOPs count; default
    all of them); `dispatch`: the dtype the copies go to the experts in ("": as they are); `bound`:
    the rows a device receives at most (0: no exchange)."""

    impl: str
    routed: int | None = None
    dispatch: str = ""
    bound: int = 0
    exchange: str = "auto"  # moe.exchange: ragged | padded (auto: model/auto.py's, parallel/expert.py)
    # The Pallas kernels in their GPU interpreter (tests on CPU: model/grouped_kernels.py)
    interpret: bool = dataclasses.field(default=False, kw_only=True)

    def _out(self, x: jax.Array, plan: Any, buffer: jax.Array | None) -> jax.Array:
        return x

    def out(self, x: jax.Array, plan: Any, buffer: jax.Array | None = None) -> jax.Array:
        """Our rows x [n, ...] -> the rows the experts here take [bound, ...], grouped by local
        expert, landing in `buffer` (a dead array: its rows past the received ones stay; default
        zeros); copies [n, d] in the `dispatch` dtype on the way (DeepSeek-V3's FP8: quantized with
        or without an exchange, so the layout never changes the model)."""
        if not self.dispatch or x.ndim != 2:
            return self._out(x, plan, buffer)
        q, scale = _quantize(x, jnp.dtype(self.dispatch))
        return _dequantize(self._out(q, plan, None), self._out(scale, plan, None), x.dtype)

    def _shared(self, amax: jax.Array) -> jax.Array:
        """A max over the devices whose rows may land here (none: the rows stay)."""
        return amax

    def rows_scale(self, rows: Pieces, dtype: Any = fp8.FORWARD) -> jax.Array | None:
        """The scale the layer's copies (every piece's) go to FP8 experts by, rounded to `dtype`
        before they travel (`rows_out`): `pallas_fp8`'s e4m3 rows (and, where they land, the e5m2
        gradients of `_routed_bwd`), one power-of-two scale over every device that may send rows
        to the same experts (the kernel multiplies a buffer by one scale), from the max of all
        their copies (dropped ones too). None: the copies go as they are."""
        if self.impl != "pallas_fp8":
            return None
        amax = jnp.max(jnp.stack([jnp.max(jnp.abs(r)) for r in rows]))
        return fp8.scale_for(self._shared(amax), dtype)

    def rows_out(
        self, rows: jax.Array, plan: Any, buffer: jax.Array | None, scale: jax.Array | None
    ) -> tuple[jax.Array, Any]:
        """Our copies [n, d] -> (the rows the experts here take, as `out`; the FP8 rows as they
        landed and `scale`, or None): with a `scale` (`rows_scale`) the copies travel rounded to
        e4m3, half the bytes, and the experts' kernel multiplies them as they landed, with no pass
        over the buffer (model/grouped_fp8.py `rounded`); the rows in bf16 are their exact product,
        which that kernel never reads (XLA drops it)."""
        if scale is None:
            return self.out(rows, plan, buffer), None
        landed = self._out(fp8.to_fp8(rows, scale, fp8.FORWARD), plan, buffer)
        return fp8.dequantize(landed, scale, rows.dtype), (landed, scale)

    def back(self, y: jax.Array, buffer: jax.Array, plan: Any) -> tuple[jax.Array, jax.Array]:
        """The experts' rows y [bound, ...] (as `out` grouped them) -> (each to its row of ours
        [n, ...], rows a receiver dropped 0; the buffer they landed in), landing in `buffer`
        [n, ...] (dead after: no zeroed buffer written)."""
        return y, y

    def experts(
        self,
        rows: jax.Array,
        w_in: jax.Array,
        w_out: jax.Array,
        *,
        plan: Any,
        given: Given | None = None,
    ) -> jax.Array:
        return expert_mlps(rows, plan.sizes, w_in, w_out, self.impl, self.routed, given, self.interpret)


Pieces = tuple[jax.Array, ...]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _routed(
    wire: Wire, rows: Pieces, gates: Pieces, w_in: jax.Array, w_out: jax.Array, plans: Any, fp8_weights: Any
) -> Pieces:
    """Our routed copies, in pieces (each rows [n, d] sorted by expert, its gates [n] and `plans`)
    -> each piece's gates x its experts' outputs, computed where the experts are (`wire`);
    `fp8_weights`: the weights as the FP8 experts multiply them (a `Given` of w_in and w_out), or None.

    Its backward sends the copies again with their gradient and runs the experts there: what it
    saves is the copies (ours) alone, so a step under remat recomputes no exchange (jax's own
    backward saved the exchanged rows and results, and remat re-sent both): 5 transfers of the
    copies a layer, not 6. Pieces go one after another (`_pipelined`), so one piece's exchange
    runs beside another's experts."""
    return _routed_fwd(wire, rows, gates, w_in, w_out, plans, fp8_weights)[0]


def _pipelined(pieces: Any, arrive: Any, compute: Any, finish: Any) -> list[Any]:
    """finish(piece, compute(piece, arrive(piece))) for each piece: `arrive` sends it to the experts,
    `compute` runs them, `finish` sends the results back. Each piece's results go back only once
    the next piece's rows have arrived (an optimization barrier ties them), before its experts
    run: the next piece's rows travel beside this one's experts, and this one's results beside the
    next one's experts."""
    done: list[Any] = []
    last: Any = None  # (the piece before, what its experts made)
    for piece in pieces:
        got = arrive(piece)
        if last is not None:
            got, ready = jax.lax.optimization_barrier((got, last[1]))
            done.append(finish(last[0], ready))
        last = (piece, compute(piece, got))
    return [*done, finish(last[0], last[1])]


def _routed_fwd(
    wire: Wire,
    rows: Pieces,
    gates: Pieces,
    w_in: jax.Array,
    w_out: jax.Array,
    plans: Any,
    fp8_weights: Any,
    rounds: bool = True,
) -> tuple[Pieces, Any]:
    # Buffers of pieces before, dead by then, in place of zeroed ones (each a full write): each
    # piece's rows arrive in the receive buffer of the piece two before (`_pipelined` sends piece
    # i + 2 after piece i's experts ran; the rows past the received ones belong to no expert: any
    # values do), and its results land in the buffer the piece
    # before's landed in. Zeroed buffers for the first ones. XLA still copies the landing buffers
    # (measured on Qwen3's plan: 7 a layer, the bytes of the zeroed ones they replace).
    spare: list[jax.Array] = []
    landed: list[jax.Array] = []
    scale = wire.rows_scale(rows) if rounds else None

    def arrive(piece: Any) -> Any:
        r, _, plan = piece
        # The groups are known from the tiny all-to-alls, before the rows arrive; left free, XLA
        # starts the grouped matmul's set-up (`blocks` gathers each block's expert weights) during
        # the exchange: 2.9 GB more a GPU on Qwen3-30B-A3B's 4 x 8 plan (55.1 against 52.2).
        return jax.lax.optimization_barrier((*wire.rows_out(r, plan, _spare(spare, wire.bound), scale), plan))

    def compute(piece: Any, got: Any) -> tuple[jax.Array, jax.Array]:
        recv, rounded, plan = got
        out = wire.experts(
            recv, w_in, w_out, plan=plan, given=(fp8_weights or Given())._replace(rows=rounded)
        )
        return out, _landed(recv, rounded)

    def finish(piece: Any, made: tuple[jax.Array, jax.Array]) -> jax.Array:
        r, g, plan = piece
        out, recv = made
        # Not in the copies' own buffer: they are saved for the backward (XLA would copy them).
        buffer = _spare(landed, r.shape[0])
        ours, buffer = wire.back(out, jnp.zeros_like(r) if buffer is None else buffer, plan)
        spare.append(recv)
        landed.append(buffer)
        return ours * g[:, None]

    ys = _pipelined(zip(rows, gates, plans, strict=True), arrive, compute, finish)
    return tuple(ys), (rows, gates, w_in, w_out, plans, fp8_weights)


def _routed_bwd(wire: Wire, saved: Any, dys: Pieces) -> tuple[Any, ...]:
    rows, gates, w_in, w_out, plans, fp8_weights = saved
    spare: list[jax.Array] = []  # dead receive buffers, as in the forward (`_routed_fwd`)
    scale = wire.rows_scale(rows)  # the forward's (the same rows)
    # Under FP8 rows, each copy's gradient times its gate (what the experts' backward multiplies in
    # e5m2) is rounded where it lands by one scale from every sender's copies, as the rows: one
    # pass where it lands (a max there wrote it whole in bf16 first). The gates' gradient is
    # <out, dy> as it came, unrounded (the router stays in high precision).
    cot_scale = None
    if scale is not None:  # the gradient is rounded so exactly where the rows are
        cots = tuple((g[:, None] * dy).astype(dy.dtype) for g, dy in zip(gates, dys, strict=True))
        cot_scale = wire.rows_scale(cots, fp8.GRADIENT)

    def arrive(piece: Any) -> Any:
        r, g, plan, dy = piece
        recv, rounded = wire.rows_out(r, plan, _spare(spare, wire.bound), scale)
        recv_dy = wire.out(dy, plan, _spare(spare, wire.bound))
        return jax.lax.optimization_barrier((recv, rounded, recv_dy, wire.out(g, plan), plan))

    def compute(piece: Any, got: Any) -> tuple[Any, ...]:
        recv, rounded, recv_dy, recv_gates, plan = got
        cot = (recv_gates[:, None] * recv_dy).astype(recv_dy.dtype)
        cot_rounded = None if cot_scale is None else (fp8.to_fp8(cot, cot_scale, fp8.GRADIENT), cot_scale)
        given = (fp8_weights or Given())._replace(rows=rounded, grad=cot_rounded)
        experts = functools.partial(wire.experts, plan=plan, given=given)
        out, vjp = jax.vjp(experts, recv, w_in, w_out)
        dg = jnp.sum(out.astype(jnp.float32) * recv_dy.astype(jnp.float32), axis=-1).astype(piece[1].dtype)
        drecv, dw_in, dw_out = vjp(cot)
        return drecv, dw_in, dw_out, dg, (_landed(recv, rounded), recv_dy)

    def finish(piece: Any, grads: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        _, g, plan, dy = piece
        drecv, dw_in, dw_out, dg, received = grads
        spare.extend(received)  # dead once the experts' backward ran: for the piece two after
        # dy is dead once sent: the rows' gradient lands in it
        return wire.back(drecv, dy, plan)[0], wire.back(dg, jnp.zeros_like(g), plan)[0], dw_in, dw_out

    done = _pipelined(zip(rows, gates, plans, dys, strict=True), arrive, compute, finish)
    drows, dgates, dw_in, dw_out = zip(*done, strict=True)
    return drows, dgates, sum(dw_in), sum(dw_out), None, None


_routed.defvjp(_routed_fwd, _routed_bwd)


def _landed(recv: jax.Array, rounded: Any) -> jax.Array:
    """The buffer received rows landed in (`Wire.rows_out`): the FP8 one where they travelled rounded."""
    return recv if rounded is None else rounded[0]


def _spare(spare: list[jax.Array], rows: int) -> jax.Array | None:
    """The oldest dead buffer of a piece before, of `rows` rows (None: there is none). Its values
    are only overwritten: no gradient goes to them (jax's backward, without remat)."""
    return jax.lax.stop_gradient(spare.pop(0)) if spare and spare[0].shape[0] == rows else None


def routed(recomputed: bool) -> Any:
    """`_routed` for a block remat recomputes; without remat, where jax's backward saves what the
    forward made (4 transfers of the copies, the experts run once forward), its forward, as autodiff
    sees it, with the copies sent as they are: autodiff would carry their gradient back through the
    FP8 rows (`Wire.rows_out`), in FP8."""
    if recomputed:
        return _routed

    def autodiff(
        wire: Wire,
        rows: Pieces,
        gates: Pieces,
        w_in: jax.Array,
        w_out: jax.Array,
        plans: Any,
        fp8_weights: Any,
    ) -> Pieces:
        return _routed_fwd(wire, rows, gates, w_in, w_out, plans, fp8_weights, rounds=False)[0]

    return autodiff


def route(moe: MoeConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, ...]:
    """Router logits [N, E] (and the sigmoid router's bias [E]) -> each token's weights and experts
    [N, k], and its probabilities [N, E] (summing to 1) for the balancing loss. The bias gets no
    gradient: it only picks, through top_k's indices."""
    k = moe.experts_per_token
    if moe.router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, k)
        if moe.renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights * moe.routed_scale, experts, probs
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias
    if moe.n_group > 1:  # each group ranked by its two best experts; the rest of the groups masked
        n, e = choice.shape
        groups = choice.reshape(n, moe.n_group, e // moe.n_group)
        _, best = jax.lax.top_k(jax.lax.top_k(groups, 2)[0].sum(axis=-1), moe.topk_group)  # [N, topk_group]
        keep = jax.nn.one_hot(best, moe.n_group, dtype=jnp.bool_).any(axis=1)  # [N, n_group]
        choice = jnp.where(jnp.repeat(keep, e // moe.n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.renormalize:  # transformers' DeepseekV3 adds 1e-20 to the sum
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scale, experts, scores / scores.sum(axis=-1, keepdims=True)


def update_router_bias(params: Any, load: jax.Array, rate: jax.Array | float) -> Any:
    """params with each MoE layer's router bias moved by `rate` toward an even load (DeepSeek-V3's
    auxiliary-loss-free balancing): down where an expert got more than 1/E of the copies, up where
    less. `load` [L, E]: the step's load of each MoE layer, in layer order (`router_stats`)."""
    delta = rate * jnp.sign(1.0 / load.shape[-1] - load)

    def moved(block: Any, d: jax.Array) -> Any:
        return {**block, "moe": {**block["moe"], "router_bias": block["moe"]["router_bias"] + d}}

    if "blocks" in params:  # scanned: one stack [L, E]
        return {**params, "blocks": moved(params["blocks"], delta)}
    names = sorted((n for n in params if "moe" in params[n]), key=lambda n: int(n.split("_")[1]))
    return {**params, **{name: moved(params[name], delta[i]) for i, name in enumerate(names)}}


class _Stack(nn.Module):
    """The experts' matrices of one kind stacked [E, ...], as one float32 param named `kernel`:
    decayed and given to Muon like a dense layer's (run/optim.py reads param names). -> (the
    kernel, and its e4m3 values and each expert's scale where fsdp gathered it as FP8
    (fp8.QUANTIZED, fp8.SCALE: parallel/fsdp.py, for `pallas_fp8`), else None)."""

    shape: tuple[int, ...]
    std: float

    @nn.compact
    def __call__(self) -> tuple[jax.Array, Any]:
        kernel = self.param("kernel", nn.initializers.normal(self.std), self.shape, jnp.float32)
        if not self.has_variable("params", fp8.QUANTIZED):
            return kernel, None
        return kernel, (self.get_variable("params", fp8.QUANTIZED), self.get_variable("params", fp8.SCALE))


def _copies(tokens: jax.Array, weights: jax.Array, experts: jax.Array, dtype: Any) -> tuple[jax.Array, ...]:
    """Tokens [n, d] routed to `experts` with `weights` [n, k] -> (the order that sorts their
    copies by expert, its inverse, the copies [n * k, d] and their gates [n * k] in that order,
    and their experts). Token i's copies are i*k .. i*k + k-1 before the sort."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.argsort(order)
    rows = dispatch(tokens, order, inverse, experts.shape[1])
    return order, inverse, rows, permute(weights.astype(dtype).reshape(-1), order, inverse), flat[order]


class MoeMlp(nn.Module):
    """Routed experts (plus optional shared ones) in place of a block's MLP: [B, T, d] -> [B, T, d]."""

    cfg: ModelConfig
    dtype: Any
    placement: Placement = LOCAL

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, moe = self.cfg, self.cfg.moe
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        # The router in float32: a low-precision softmax over experts flips near-tied top-k picks.
        logits = dense(moe.n_experts, cfg.init_std, jnp.float32, "router")(tokens.astype(jnp.float32))
        bias = None
        if moe.router == "sigmoid":
            bias = self.param("router_bias", nn.initializers.zeros, (moe.n_experts,), jnp.float32)
        weights, experts, probs = route(moe, logits, bias)  # [N, k], [N, k], [N, E]
        w_in, w_out, fp8_weights = self._stacks(d)
        flat = experts.reshape(-1)  # [N * k]: token i's copies at i*k .. i*k + k-1
        y, dropped = self._experts(tokens, weights, experts, w_in, w_out, fp8_weights)
        y = y.astype(self.dtype).reshape(b, t, d)
        if moe.n_shared_experts:
            shared = mlp(
                cfg, self.dtype, x, moe.d_shared or moe.n_shared_experts * cfg.expert_dim, prefix="shared_"
            )
            if moe.shared_gate:
                shared = shared * nn.sigmoid(dense(1, cfg.init_std, self.dtype, "shared_gate")(x))
            y = y + shared

        load = jnp.zeros(moe.n_experts, jnp.float32).at[flat].add(1.0) / flat.size
        self.sow("moe", "load", jax.lax.stop_gradient(load))
        self.sow("moe", "probs", probs.mean(axis=0))
        self.sow("moe", "z", jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2))
        self.sow("moe", "dropped", dropped)
        return constrain(y, "batch", "length", "embed")

    def _stacks(self, d: int) -> tuple[jax.Array, jax.Array, Given | None]:
        """The routed experts' weights in the compute dtype, w_in [E, d, (2,) ff] and w_out [E, ff, d]:
        declared as this device's share (E / expert_split), as each device sees only its experts;
        and both as fsdp gathered them in FP8 (`_Stack`: a `Given` of w_in and w_out), or None."""
        cfg = self.cfg
        n_experts, ff = cfg.moe.n_experts // self.placement.expert_split, cfg.expert_dim
        shape_in = (n_experts, d, 2, ff) if cfg.mlp == "swiglu" else (n_experts, d, ff)
        w_in, q_in = _Stack(shape_in, cfg.init_std, name="gate_up" if cfg.mlp == "swiglu" else "fc")()
        w_out, q_out = _Stack((n_experts, ff, d), residual_std(cfg), name="out")()
        fp8_weights = None if q_in is None or q_out is None else Given(w_in=q_in, w_out=q_out)
        return w_in.astype(self.dtype), w_out.astype(self.dtype), fp8_weights

    def _experts(
        self,
        tokens: jax.Array,
        weights: jax.Array,
        experts: jax.Array,
        w_in: jax.Array,
        w_out: jax.Array,
        fp8_weights: Any = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Tokens [N, d] through the experts `experts` [N, k] picked, weighted by `weights` -> [N, d]
        in float32 (each token's copies summed), and the share of copies dropped (capacity);
        `fp8_weights`: w_in's and w_out's e4m3 values and scales, as fsdp gathered them (`_stacks`)."""
        moe, k, d = self.cfg.moe, self.cfg.moe.experts_per_token, tokens.shape[1]
        # Settled where the job meets its devices (run/kernels.py); outside a job auto is model/auto.py's
        impl = auto.outside_a_job("grouped_matmul", moe.grouped_matmul)
        # In pieces, each routed and exchanged by itself: one piece's exchange runs beside another's
        # experts (`_routed`). Pieces only schedule the exchange: where they do not divide the tokens
        # (decoding's one token a sequence; the config holds training's count) the layer goes whole.
        pieces = moe.chunks if tokens.shape[0] % moe.chunks == 0 else 1
        wire = Wire(impl, dispatch=self.cfg.dispatch, exchange=moe.exchange)
        recomputed = self.cfg.remat != "none"
        if self.placement.nodes is not None:  # the two-hop exchange takes tokens, not copies
            ys, dropped = self.placement.nodes(
                *(tuple(jnp.split(a, pieces)) for a in (tokens, weights.astype(self.dtype), experts)),
                w_in, w_out, wire, moe.capacity_factor, recomputed, fp8_weights,
            )  # fmt: skip
            return jnp.concatenate(ys), dropped
        split = zip(*(jnp.split(a, pieces) for a in (tokens, weights, experts)), strict=True)
        order, inverse, rows, gates, piece_experts = zip(
            *(_copies(tokens_, weights_, experts_, self.dtype) for tokens_, weights_, experts_ in split),
            strict=True,
        )
        if self.placement.experts is None:
            plans = tuple(Groups(jnp.zeros(moe.n_experts, jnp.int32).at[e].add(1)) for e in piece_experts)
            outs, dropped = (
                routed(recomputed)(wire, rows, gates, w_in, w_out, plans, fp8_weights),
                jnp.zeros((), jnp.float32),
            )
        else:  # where the experts are on the step's devices (parallel/expert.py)
            outs, dropped = self.placement.experts(
                rows, gates, piece_experts, w_in, w_out, wire, moe.capacity_factor, recomputed, fp8_weights
            )
        # Each token's copies summed (in float32, as the einsum with the weights did)
        y = jnp.concatenate(
            [
                permute(out, inv, o).reshape(-1, k, d).sum(axis=1, dtype=jnp.float32)
                for out, inv, o in zip(outs, inverse, order, strict=True)
            ]
        )
        return y, dropped


def router_stats(collection: Any) -> dict[str, jax.Array]:
    """The "moe" collection as arrays over MoE layers, in layer order: load and probs [L, E], z and
    dropped [L]. A layer that ran its sequences in equal groups (model.moe.overlap_groups) sowed
    each group's: their mean is the layer's."""

    def mean(sown: tuple[jax.Array, ...]) -> jax.Array:
        return sum(sown[1:], sown[0]) / len(sown)

    layers: list[tuple[int, Any]] = []
    for name, sub in collection.items():
        stats = sub["moe"]
        if name == "blocks":  # scanned: each sown value already stacks every layer
            return {key: mean(stats[key]) for key in _STATS}
        layers.append((int(name.split("_")[1]), stats))
    layers.sort(key=lambda item: item[0])
    return {key: jnp.stack([mean(s[key]) for _, s in layers]) for key in _STATS}


_STATS = ("load", "probs", "z", "dropped")


def balance_loss(load: jax.Array, probs: jax.Array) -> jax.Array:
    """Switch/GShard load balancing, per layer: n_experts * sum_e load_e * probs_e (1.0 when even).

    `load` should be the whole batch's (a constant to the gradient), `probs` this device's rows':
    then the mean over devices of this loss, and of its gradient, is the whole batch's. With
    gradient accumulation it is each microbatch's, and which rows make a microbatch depends on the
    layout: there the losses of two meshes differ slightly (1.5e-5 relative after 3 steps, measured).
    Hugging Face's Mixtral loss is experts_per_token times this (its load sums to k).
    """
    return load.shape[-1] * jnp.sum(load * probs, axis=-1)


def active_params(cfg: ModelConfig, n_params: int) -> int:
    """Params a token computes with: all but the routed experts it is not sent to."""
    moe = cfg.moe
    if not moe.n_experts:
        return n_params
    per_expert = (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * cfg.expert_dim
    n_moe_layers = sum(is_moe_layer(cfg, i) for i in range(cfg.n_layer))
    return n_params - n_moe_layers * (moe.n_experts - moe.experts_per_token) * per_expert
