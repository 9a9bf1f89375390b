"""Expert parallelism: a mixture of experts' routed rows sent to the devices that hold their experts.

Each device holds `n_experts / expert` experts of every MoE layer (the `expert` mesh axis). Inside
the train step each device sends each peer exactly the copies for its experts by one
`ragged_all_to_all`, a slice per expert of the peer's, so they land grouped by expert as the
grouped matmul takes them (no sort), and gets the results back by another (model.moe.exchange
padded: a padded `all_to_all` stands in, same routing, more bytes; on XLA:CPU, which has no ragged
one, and on GPUs whose preflight finds the ragged one wrong). A device's receive buffer holds every
peer's copies (dropless), or `capacity_factor` x the copies an even router sends it, at most
`capacity_factor` x an even share from any one peer (the rest dropped, the same share of each
sender's, and counted). The model's routed block (model/moe.py `routed`)
schedules the pieces and runs the experts; the `Exchange` wire here moves their rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxtrain.model import auto
from jaxtrain.model.moe import Given, Groups, Pieces, Wire, _copies, dispatch, permute, routed
from jaxtrain.observe import links
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import tensor
from jaxtrain.parallel.mesh import EXPERT_AXIS

# The named scope of the padded stand-in's all-to-all of the rows, with the ragged one's (update,
# peer) slots after it: the planner knows it for the expert exchange by it (plan/schedule.py PADDED).
PADDED_SCOPE = "padded_exchange"


def padded_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
    width: int,
    axis_index_groups: Any = None,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` on a padded `all_to_all`, for XLA:CPU, which has no ragged one.
    As XLA's, each peer may get several slices: the four index arrays hold peers x U entries,
    peer-major (slice u to peer j at j * U + u). A peer's slices travel together in a buffer of
    `width` rows (at least the most rows one device sends another) and land where the ragged one
    puts them. Same arguments, same result, same gradient. `axis_index_groups`: as jax's, the
    peers are the devices of one's group (each group one exchange)."""
    peers = len(axis_index_groups[0]) if axis_index_groups else jax.lax.axis_size(axis_name)
    a2a = functools.partial(
        jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True,
        axis_index_groups=axis_index_groups,
    )  # fmt: skip
    rows = jnp.arange(width)

    def at(sizes: jax.Array, offsets: jax.Array, past: int) -> jax.Array:
        """Each peer's buffer row -> where it is in the rows its slices index (past: none)."""
        sizes, offsets = sizes.reshape(peers, -1), offsets.reshape(peers, -1)
        ends = jnp.cumsum(sizes, axis=1)
        which = jax.vmap(lambda e: jnp.searchsorted(e, rows, side="right"))(ends)  # [peers, width]
        inside = jnp.minimum(which, sizes.shape[1] - 1)
        first = jnp.take_along_axis(ends - sizes, inside, axis=1)
        where = jnp.take_along_axis(offsets, inside, axis=1) + rows - first
        return jnp.where(which < sizes.shape[1], where, past)

    send = operand.at[at(send_sizes, input_offsets, operand.shape[0])].get(mode="fill", fill_value=0)
    # Named with the ragged one's (update, peer) slots, so the planner knows this all-to-all for the
    # expert exchange and can cost the ragged one in its place (plan/forecast.py PADDED).
    with jax.named_scope(f"{PADDED_SCOPE}_slots_{send_sizes.shape[0]}"):
        got = a2a(send)
    landing = a2a(output_offsets)  # as the ragged one does
    to = at(recv_sizes, landing, output.shape[0])
    return output.at[to.reshape(-1)].set(got.reshape(peers * width, *got.shape[2:]), mode="drop")


def one_exchange(cfg: Any, mesh: Any, itemsize: int) -> list:
    """One of a job's expert exchanges as the planner traces it (observe/links.py exchange_xfer):
    the copies a device routes in one piece (its tokens of a microbatch x experts_per_token /
    moe.chunks / moe.overlap_groups) of d_model values, to the expert axis's devices, so many in
    one process, a slot for each of a peer's experts. `cfg`: the job's Config; what run/build.py
    costs auto's pick by."""
    shape = dict(mesh.shape)
    shards = shape[mesh_lib.DATA_AXIS] * shape[EXPERT_AXIS] * shape[mesh_lib.FSDP_AXIS]
    rows = cfg.batch_size // cfg.gradient_accumulation_steps // shards
    tokens = rows * cfg.model.seq_len // shape[mesh_lib.CONTEXT_AXIS]
    moe, ep = cfg.model.moe, shape[EXPERT_AXIS]
    size = tokens * moe.experts_per_token // (moe.chunks * moe.overlap_groups) * cfg.model.d_model * itemsize
    return links.exchange_xfer(size, ep, mesh_lib.per_process(mesh, EXPERT_AXIS), moe.n_experts // ep)


def receive_bound(n: int, ep: int, capacity_factor: float) -> int:
    """Rows a device's receive buffer holds when each of the ep devices routes n copies: every
    copy of every peer (dropless: no routing overflows it), else capacity_factor x the n a device
    receives when the router is even. The experts' grouped matmul computes over all of them
    (`blocks`, `ragged_dot`), or only over the rows received (`pallas`)."""
    return min(ep * n, math.ceil(capacity_factor * n)) if capacity_factor else ep * n


def pair_bound(n: int, ep: int, capacity_factor: float) -> int:
    """Rows a device sends one peer at most when each of the ep devices routes n copies: all n
    (dropless), else capacity_factor x the n / ep an even router sends it (GShard's capacity, per
    pair of devices rather than per expert). The padded exchange's buffer a peer (`Exchange.width`):
    ep x this rows, capacity_factor x n, where all n each were ep x n: the padded all-to-all's
    bytes 1.25x the ragged one's at Qwen3's capacity, not 8x over expert 8."""
    return max(1, min(n, math.ceil(capacity_factor * n / ep))) if capacity_factor else n


def _admitted(want: jax.Array, bound: int, pair: int) -> jax.Array:
    """Copies this device admits of what each peer wants to send it [ep]: at most `pair` of each
    peer's (`pair_bound`), then all of them if they fit in `bound` rows, else the same share of
    each peer's (rounded down; the rest dropped)."""
    want = jnp.minimum(want, pair)
    total = want.sum()
    share = jnp.floor(want.astype(jnp.float32) * (bound / jnp.maximum(total, 1).astype(jnp.float32)))
    admitted = jnp.where(total <= bound, want, jnp.minimum(share.astype(jnp.int32), want))
    # float rounding never overfills it
    return jnp.clip(bound - (jnp.cumsum(admitted) - admitted), 0, admitted)


class Plan(NamedTuple):
    """Who sends what where in one exchange (from its two tiny all-to-alls; no gradient), in
    slices of one peer's one expert: [ep x local] arrays, peer-major (ragged_all_to_all's several
    slices a peer). Ours to each peer's experts: `in_offsets` where they start in our rows,
    `send_sizes` how many it admits, `out_offsets` where they land in its buffer; each source's to
    ours: `recv_offsets` where they land, `recv_sizes` how many we admit, `their_offsets` where they
    start in its rows. A receiver's buffer is grouped by expert (source-major inside each): the
    grouped matmul's order, no sort. `sizes` the rows of each local expert; `held`: which of our
    rows a receiver admitted (the rest come back zero). Without expert parallelism only `sizes`: the
    rows stay where they are."""

    sizes: jax.Array
    # The rest: arrays, or None without expert parallelism
    in_offsets: Any = None
    send_sizes: Any = None
    out_offsets: Any = None
    recv_offsets: Any = None
    recv_sizes: Any = None
    their_offsets: Any = None
    held: Any = None


def _plan(
    experts: jax.Array, axis: str, ep: int, local: int, bound: int, pair: int, groups: Any = None
) -> Plan:
    """The exchange of rows sorted by global expert id `experts` [n] between the ep devices along
    `axis` (or of one's `groups`: jax's axis_index_groups; `local` experts each, `bound` rows
    received at most, `pair` from each peer: `receive_bound`, `pair_bound`, `_admitted`). Ids past
    the last expert are no expert's: never sent. Two
    tiny int32 all_to_alls settle it: each peer's copies per local expert and where they start in
    its rows, then what each receiver admits of them and where it puts them."""
    n = experts.shape[0]
    counts = jnp.zeros(ep * local, jnp.int32).at[experts].add(1, mode="drop").reshape(ep, local)
    in_offsets = jnp.cumsum(counts.reshape(-1)).reshape(ep, local) - counts  # rows sorted by expert
    a2a = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0, tiled=True)
    table = a2a(jnp.concatenate([counts, in_offsets], axis=1), axis_index_groups=groups)
    per_expert, their_offsets = table[:, :local], table[:, local:]  # [source, local expert]
    admitted = _admitted(per_expert.sum(axis=1), bound, pair)
    # A source's admitted rows are a prefix of its run, so of each expert's rows a prefix.
    before = jnp.cumsum(per_expert, axis=1) - per_expert
    recv_sizes = jnp.clip(admitted[:, None] - before, 0, per_expert)  # [source, local expert]
    sizes = recv_sizes.sum(axis=0)
    # Grouped by expert, each expert's rows source-major.
    recv_offsets = (jnp.cumsum(sizes) - sizes)[None, :] + jnp.cumsum(recv_sizes, axis=0) - recv_sizes
    reply = a2a(jnp.concatenate([recv_sizes, recv_offsets], axis=1), axis_index_groups=groups)
    send_sizes, out_offsets = reply[:, :local], reply[:, local:]  # per peer's expert: admitted, and where
    slot = jnp.minimum(experts, ep * local - 1)
    held = jnp.arange(n) - in_offsets.reshape(-1)[slot] < send_sizes.reshape(-1)[slot]
    flat = lambda a: a.reshape(-1)  # noqa: E731
    return Plan(
        sizes, flat(in_offsets), flat(send_sizes), flat(out_offsets), flat(recv_offsets), flat(recv_sizes),
        flat(their_offsets), held,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Placed(Wire):
    """The experts on a step's devices without expert parallelism: the rows stay, each expert's
    hidden dim split over `tensor` if the step has one (parallel/tensor.py `split_experts`)."""

    def experts(
        self,
        rows: jax.Array,
        w_in: jax.Array,
        w_out: jax.Array,
        *,
        plan: Any,
        given: Given | None = None,
    ) -> jax.Array:
        return tensor.split_experts(rows, plan.sizes, w_in, w_out, self.impl, self.routed, given)


@dataclasses.dataclass(frozen=True)
class Exchange(Placed):
    """Rows sent to their experts' devices along `axis` and back: by `ragged_all_to_all` (`exchange`
    ragged), or its padded stand-in of `width` rows a peer (padded)."""

    axis: str = ""
    width: int = 0
    groups: Any = None  # jax's axis_index_groups: the exchange goes inside each (`two_hops`)

    def _a2a(self, *args: jax.Array) -> jax.Array:
        if self.exchange == "ragged":
            return jax.lax.ragged_all_to_all(*args, axis_name=self.axis, axis_index_groups=self.groups)
        return padded_ragged_all_to_all(
            *args, axis_name=self.axis, width=self.width, axis_index_groups=self.groups
        )

    def _shared(self, amax: jax.Array) -> jax.Array:
        # every peer's rows may land in one buffer (two hops: any of the axis's, as one hop's scale)
        return jax.lax.pmax(amax, self.axis)

    def _out(self, x: jax.Array, plan: Any, buffer: jax.Array | None) -> jax.Array:
        shape = (self.bound, *x.shape[1:])
        if buffer is None or buffer.shape != shape or buffer.dtype != x.dtype:
            buffer = jnp.zeros(shape, x.dtype)
        return self._a2a(x, buffer, plan.in_offsets, plan.send_sizes, plan.out_offsets, plan.recv_sizes)

    def back(self, y: jax.Array, buffer: jax.Array, plan: Any) -> tuple[jax.Array, jax.Array]:
        got = self._a2a(y, buffer, plan.recv_offsets, plan.recv_sizes, plan.their_offsets, plan.send_sizes)
        return jnp.where(plan.held.reshape(-1, *(1,) * (y.ndim - 1)), got, 0), got


def _kind(wire: Wire) -> str:
    """The exchange a wire runs, ragged or padded: settled where the job meets its devices
    (run/kernels.py); `auto` outside a job is model/auto.py's rule for the platform the step
    compiles for."""
    return auto.exchange(mesh_lib.platform()) if wire.exchange == "auto" else wire.exchange


def experts(
    rows: Pieces,
    gates: Pieces,
    experts: Pieces,
    w_in: jax.Array,
    w_out: jax.Array,
    wire: Wire,
    capacity_factor: float,
    recomputed: bool,
    fp8_weights: Any = None,
    *,
    ep: int,
) -> tuple[Pieces, jax.Array]:
    """The Placement's `experts` hook (model/moe.py MoeMlp): each piece's routed rows through their
    experts, exchanged over `expert` where it splits them over `ep` devices; (outputs, share dropped).
    `fp8_weights`: the weights as the FP8 experts multiply them (model/moe.py `expert_mlps`)."""
    if ep == 1:
        plans = tuple(Groups(jnp.zeros(w_in.shape[0], jnp.int32).at[e].add(1)) for e in experts)
        placed = Placed(wire.impl, wire.routed, wire.dispatch)
        outs = routed(recomputed)(placed, rows, gates, w_in, w_out, plans, fp8_weights)
        return outs, jnp.zeros((), jnp.float32)
    return exchange(
        rows, gates, experts, EXPERT_AXIS, ep, w_in, w_out, wire.impl, capacity_factor,
        _kind(wire) == "ragged", wire.dispatch, recomputed, fp8_weights,
    )  # fmt: skip


def exchange(
    rows: Pieces,
    gates: Pieces,
    experts: Pieces,
    axis: str,
    ep: int,
    w_in: jax.Array,
    w_out: jax.Array,
    impl: str,
    capacity_factor: float,
    ragged: bool,
    dispatch: str = "",
    recomputed: bool = True,
    fp8_weights: Any = None,
    groups: Any = None,
    bound: int = 0,
) -> tuple[Pieces, jax.Array]:
    """Rows [n, d] sorted by global expert id `experts` [n], and their `gates` [n], in pieces ->
    (each piece's gates x its experts' outputs, computed on the devices along `axis` (ep of them)
    that hold those experts (w_in, w_out: this device's), the share of rows dropped: past their
    receiver's bound or a sender's share of a peer (`receive_bound`, `pair_bound`, `_admitted`:
    each piece's), zero out).

    Each device sends each peer exactly the rows it admits, by `ragged_all_to_all` (ragged) or its
    padded stand-in; both land them in the same places, so the routing is the same.
    `recomputed`: the block is recomputed in the backward (remat), where model/moe.py `routed`'s own
    backward saves a transfer; else jax's. `fp8_weights`: as `experts`. `groups`: jax's
    axis_index_groups (the exchange inside each, ep devices a group); `bound`: the receive bound, in
    place of `receive_bound`'s for n rows (`two_hops`: n counts rows of no expert)."""
    n = rows[0].shape[0]
    bound, pair = bound or receive_bound(n, ep, capacity_factor), pair_bound(n, ep, capacity_factor)
    plans = tuple(_plan(e, axis, ep, w_in.shape[0], bound, pair, groups) for e in experts)
    kind = "ragged" if ragged else "padded"
    wire = Exchange(impl, n, dispatch, bound, kind, axis, min(pair, bound), groups)
    admitted = sum(plan.send_sizes.sum() for plan in plans)
    outs = routed(recomputed)(wire, tuple(rows), tuple(gates), w_in, w_out, plans, fp8_weights)
    return outs, 1.0 - admitted / (n * len(rows))


def node_reach(moe: Any, nodes: int) -> int:
    """The most of `nodes` nodes (equal runs of the experts) one token's experts can be on: each of
    its experts_per_token on another, unless node-limited routing keeps it to topk_group of n_group
    groups (DeepSeek-V3), each group on whole nodes or each node holding whole groups."""
    reach = min(moe.experts_per_token, nodes)
    if moe.n_group > 1 and moe.topk_group < moe.n_group:
        if moe.n_group % nodes == 0:
            reach = min(reach, moe.topk_group)
        elif nodes % moe.n_group == 0:
            reach = min(reach, moe.topk_group * (nodes // moe.n_group))
    return reach


def node_groups(ep: int, node: int) -> tuple[list[list[int]], list[list[int]]]:
    """The expert axis's ep devices in nodes of `node` consecutive ones, as jax's axis_index_groups:
    (each node's devices, the devices at one place of every node)."""
    nodes = ep // node
    return (
        [[h * node + i for i in range(node)] for h in range(nodes)],
        [[h * node + i for h in range(nodes)] for i in range(node)],
    )


class _Hop(NamedTuple):
    """A piece's first hop (`two_hops`): where its token rows went and what came of them."""

    order: jax.Array  # the token rows [n * reach] sorted by node
    inverse: jax.Array
    plan: Plan
    copies: jax.Array  # [n * reach]: the copies each row carries (0: a row for no node)
    got: jax.Array  # the rows received [bound, d], their node-local experts [bound, k] and gates
    experts: jax.Array
    gates: jax.Array


def two_hops(
    tokens: Pieces,
    weights: Pieces,
    experts: Pieces,
    w_in: jax.Array,
    w_out: jax.Array,
    wire: Wire,
    capacity_factor: float,
    recomputed: bool,
    fp8_weights: Any = None,
    *,
    ep: int,
    node: int,
    reach: int,
) -> tuple[Pieces, jax.Array]:
    """The Placement's `nodes` hook (model/moe.py MoeMlp, mesh.expert_node): each piece's tokens
    [n, d], routed to `experts` [n, k] by `weights` [n, k], through their experts on the expert
    axis's ep devices in nodes of `node` -> (each piece's routed output [n, d] in float32, the share
    of copies dropped).

    First hop, between nodes: a token goes once to each node holding any of its experts (at most
    `reach`: `node_reach`), to the device at its sender's place there, with those experts' ids and
    gates (its copies for one node deduplicated: DeepSeek-V3's rule, where the network is the slow
    link). Second, inside the node: that device sends a copy to each of them (`exchange` over the
    node's devices), and sums what comes back, weighted, into the one row that goes back. Both hops
    are the one-hop exchange's (ragged or padded, FP8 dispatch), each within its groups; under
    `capacity_factor` the first hop takes as many rows as a node gets from an even router and the
    second as many copies as the one-hop exchange's device. Plain autodiff: remat resends the
    first hop (the one-hop exchange's own backward saves that)."""
    n, k = experts[0].shape
    d = tokens[0].shape[1]
    nodes, local = ep // node, w_in.shape[0]
    per_node = local * node  # the experts a node holds
    inside, across = node_groups(ep, node)
    kind = _kind(wire)
    rows1 = n * reach
    bound1, pair1 = receive_bound(rows1, nodes, capacity_factor), pair_bound(rows1, nodes, capacity_factor)
    hop = Exchange(wire.impl, rows1, wire.dispatch, bound1, kind, EXPERT_AXIS, min(pair1, bound1), across)

    def first(t: jax.Array, w: jax.Array, e: jax.Array) -> _Hop:
        at = e // per_node  # [n, k]: each copy's node
        need = jnp.zeros((n, nodes), jnp.bool_).at[jnp.arange(n)[:, None], at].set(True)
        # Each token's nodes, fewest first, then `nodes` (a row for no node: never sent) to fill reach
        top, picked = jax.lax.top_k(jnp.where(need, nodes - jnp.arange(nodes), 0), reach)
        dest = jnp.where(top > 0, picked, nodes)  # [n, reach]
        mine = at[:, None, :] == dest[:, :, None]  # [n, reach, k]: the copies each row carries
        ids = jnp.where(mine, e[:, None, :] - dest[:, :, None] * per_node, per_node).reshape(rows1, k)
        gates = jnp.where(mine, w[:, None, :], 0).reshape(rows1, k)
        order = jnp.argsort(dest.reshape(-1), stable=True)
        inverse = jnp.argsort(order)
        plan = _plan(dest.reshape(-1)[order], EXPERT_AXIS, nodes, 1, bound1, pair1, across)
        got = hop.out(dispatch(t, order, inverse, reach), plan)
        # The ids and gates go as they are (no dispatch dtype); rows past those received hold none
        real = (jnp.arange(bound1) < plan.sizes.sum())[:, None]
        got_ids = jnp.where(real, hop._out(ids[order], plan, None), per_node)
        got_gates = jnp.where(real, hop._out(gates[order], plan, None), 0)
        return _Hop(order, inverse, plan, mine.sum(-1).reshape(-1), got, got_ids, got_gates)

    hops = [first(*piece) for piece in zip(tokens, weights, experts, strict=True)]
    # Inside the node: each received row's copies sorted by node-local expert (none last), as many
    # as the one-hop exchange's device routes (all of them, dropless)
    copies = bound1 * k if not capacity_factor else min(bound1 * k, math.ceil(capacity_factor * n * k))
    sorted_ = [_copies(h.got, h.gates, h.experts, h.got.dtype) for h in hops]
    outs, share = exchange(
        tuple(c[2][:copies] for c in sorted_), tuple(c[3][:copies] for c in sorted_),
        tuple(c[4][:copies] for c in sorted_), EXPERT_AXIS, node, w_in, w_out, wire.impl,
        capacity_factor, kind == "ragged", wire.dispatch, recomputed, fp8_weights, inside,
        receive_bound(n * k, ep, capacity_factor),
    )  # fmt: skip
    ys, lost = [], jnp.zeros((), jnp.float32)
    for h, (order2, inverse2, _, _, ids2), out in zip(hops, sorted_, outs, strict=True):
        # Each received row's copies summed, and the row sent back to its token's device
        whole = jnp.concatenate([out, jnp.zeros((bound1 * k - copies, d), out.dtype)])
        summed = permute(whole, inverse2, order2).reshape(bound1, k, d).sum(axis=1, dtype=jnp.float32)
        back, _ = hop.back(summed.astype(out.dtype), jnp.zeros((rows1, d), out.dtype), h.plan)
        ys.append(permute(back, h.inverse, h.order).reshape(n, reach, d).sum(axis=1, dtype=jnp.float32))
        # Dropped: a row's copies where the first hop's receiver did not admit it, and copies past
        # `copies` or the second hop's bounds (rows of no expert are never sent)
        lost += jnp.sum(jnp.where(h.plan.held, 0, h.copies[h.order]))
        lost += jnp.sum(ids2[copies:] < per_node)
    taken = sum(jnp.sum(c[4][:copies] < per_node) for c in sorted_)
    lost += taken - (1.0 - share) * copies * len(hops)
    return tuple(ys), lost / (n * k * len(hops))
