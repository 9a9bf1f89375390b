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
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxtrain.model import auto
from jaxtrain.model.moe import Given, Groups, Pieces, Wire, routed
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
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` on a padded `all_to_all`, for XLA:CPU, which has no ragged one.
    As XLA's, each peer may get several slices: the four index arrays hold peers x U entries,
    peer-major (slice u to peer j at j * U + u). A peer's slices travel together in a buffer of
    `width` rows (at least the most rows one device sends another) and land where the ragged one
    puts them. Same arguments, same result, same gradient."""
    peers = jax.lax.axis_size(axis_name)
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
        got = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [peers, width, ...]
    landing = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # as the ragged one does
    to = at(recv_sizes, landing, output.shape[0])
    return output.at[to.reshape(-1)].set(got.reshape(peers * width, *got.shape[2:]), mode="drop")


def one_exchange(cfg: Any, mesh: Any, itemsize: int) -> list:
    """One of a job's expert exchanges as the planner traces it (observe/links.py exchange_xfer):
    the copies a device routes in one piece (its tokens of a microbatch x experts_per_token /
    moe.chunks) of d_model values, to the expert axis's devices, so many in one process, a slot for
    each of a peer's experts. `cfg`: the job's Config; what run/build.py costs auto's pick by."""
    shape = dict(mesh.shape)
    shards = shape[mesh_lib.DATA_AXIS] * shape[EXPERT_AXIS] * shape[mesh_lib.FSDP_AXIS]
    rows = cfg.batch_size // cfg.gradient_accumulation_steps // shards
    tokens = rows * cfg.model.seq_len // shape[mesh_lib.CONTEXT_AXIS]
    moe, ep = cfg.model.moe, shape[EXPERT_AXIS]
    size = tokens * moe.experts_per_token // moe.chunks * cfg.model.d_model * itemsize
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


def _plan(experts: jax.Array, axis: str, ep: int, local: int, bound: int, pair: int) -> Plan:
    """The exchange of rows sorted by global expert id `experts` [n] between the ep devices along
    `axis` (`local` experts each, `bound` rows received at most, `pair` from each peer:
    `receive_bound`, `pair_bound`, `_admitted`). Two
    tiny int32 all_to_alls settle it: each peer's copies per local expert and where they start in
    its rows, then what each receiver admits of them and where it puts them."""
    n = experts.shape[0]
    counts = jnp.zeros(ep * local, jnp.int32).at[experts].add(1, mode="drop").reshape(ep, local)
    in_offsets = jnp.cumsum(counts.reshape(-1)).reshape(ep, local) - counts  # rows sorted by expert
    table = jax.lax.all_to_all(jnp.concatenate([counts, in_offsets], axis=1), axis, 0, 0, tiled=True)
    per_expert, their_offsets = table[:, :local], table[:, local:]  # [source, local expert]
    admitted = _admitted(per_expert.sum(axis=1), bound, pair)
    # A source's admitted rows are a prefix of its run, so of each expert's rows a prefix.
    before = jnp.cumsum(per_expert, axis=1) - per_expert
    recv_sizes = jnp.clip(admitted[:, None] - before, 0, per_expert)  # [source, local expert]
    sizes = recv_sizes.sum(axis=0)
    # Grouped by expert, each expert's rows source-major.
    recv_offsets = (jnp.cumsum(sizes) - sizes)[None, :] + jnp.cumsum(recv_sizes, axis=0) - recv_sizes
    reply = jax.lax.all_to_all(jnp.concatenate([recv_sizes, recv_offsets], axis=1), axis, 0, 0, tiled=True)
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

    def _a2a(self, *args: jax.Array) -> jax.Array:
        if self.exchange == "ragged":
            return jax.lax.ragged_all_to_all(*args, axis_name=self.axis)
        return padded_ragged_all_to_all(*args, axis_name=self.axis, width=self.width)

    def _shared(self, amax: jax.Array) -> jax.Array:
        return jax.lax.pmax(amax, self.axis)  # every peer's rows may land in one buffer

    def _out(self, x: jax.Array, plan: Any, buffer: jax.Array | None) -> jax.Array:
        shape = (self.bound, *x.shape[1:])
        if buffer is None or buffer.shape != shape or buffer.dtype != x.dtype:
            buffer = jnp.zeros(shape, x.dtype)
        return self._a2a(x, buffer, plan.in_offsets, plan.send_sizes, plan.out_offsets, plan.recv_sizes)

    def back(self, y: jax.Array, buffer: jax.Array, plan: Any) -> tuple[jax.Array, jax.Array]:
        got = self._a2a(y, buffer, plan.recv_offsets, plan.recv_sizes, plan.their_offsets, plan.send_sizes)
        return jnp.where(plan.held.reshape(-1, *(1,) * (y.ndim - 1)), got, 0), got


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
    # Settled where the job meets its devices (run/kernels.py); auto outside a job: model/auto.py's
    # rule for the platform the step compiles for
    named = wire.exchange
    ragged = (auto.exchange(mesh_lib.platform()) if named == "auto" else named) == "ragged"
    return exchange(
        rows, gates, experts, EXPERT_AXIS, ep, w_in, w_out, wire.impl, capacity_factor, ragged,
        wire.dispatch, recomputed, fp8_weights,
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
) -> tuple[Pieces, jax.Array]:
    """Rows [n, d] sorted by global expert id `experts` [n], and their `gates` [n], in pieces ->
    (each piece's gates x its experts' outputs, computed on the devices along `axis` (ep of them)
    that hold those experts (w_in, w_out: this device's), the share of rows dropped: past their
    receiver's bound or a sender's share of a peer (`receive_bound`, `pair_bound`, `_admitted`:
    each piece's), zero out).

    Each device sends each peer exactly the rows it admits, by `ragged_all_to_all` (ragged) or its
    padded stand-in; both land them in the same places, so the routing is the same.
    `recomputed`: the block is recomputed in the backward (remat), where model/moe.py `routed`'s own
    backward saves a transfer; else jax's. `fp8_weights`: as `experts`."""
    n = rows[0].shape[0]
    bound, pair = receive_bound(n, ep, capacity_factor), pair_bound(n, ep, capacity_factor)
    plans = tuple(_plan(e, axis, ep, w_in.shape[0], bound, pair) for e in experts)
    wire = Exchange(impl, n, dispatch, bound, "ragged" if ragged else "padded", axis, min(pair, bound))
    admitted = sum(plan.send_sizes.sum() for plan in plans)
    outs = routed(recomputed)(wire, tuple(rows), tuple(gates), w_in, w_out, plans, fp8_weights)
    return outs, 1.0 - admitted / (n * len(rows))
