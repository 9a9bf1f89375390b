"""The links a transfer crosses, as real GPUs run them: the bus bandwidth nccl-tests measures for
each collective on NVLink inside a host and on the network across hosts, their latencies, and the
expert exchange (XLA's ragged all-to-all, or the padded all-to-all standing in for it) as XLA's GPU
runtime runs it. Public measurements, named beside each figure, on H100s; another GPU's links scale
them (`scale_in`, `scale_out`: its NVLink and NIC over the H100's).

The forecast costs every transfer with `legs` and `host_wait` (plan/forecast.py); a job settles
`model.moe.exchange auto` with `pick_exchange` on the same costs (run/kernels.py), so the plan and
the job pick the same exchange.
"""

from __future__ import annotations

# [NCCL] nccl-tests bus bandwidth on 8 H100 SXM in one host (NVLink 4 + NVSwitch), large messages:
#   reduce-scatter 360, all-gather 350 GB/s: https://github.com/NVIDIA/nccl/issues/1281 ;
#   all-reduce 460-480 GB/s (NVLink SHARP): https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests
# The others (all-to-all, permutes) as all-gather: no public H100 figure we found.
NVLINK_BUSBW = {"all-reduce": 460e9, "reduce-scatter": 360e9, "all-gather": 350e9}
NVLINK_BUSBW_OTHER = 350e9
# [NCCL-IB] 32 hosts x 8 H100, one 400 Gb/s NIC a GPU, 2 GB messages: all-reduce 340 GB/s bus
#   bandwidth, all-gather 200 GB/s, per host of 8 GPUs: https://github.com/NVIDIA/nccl/issues/1218
NETWORK_BUSBW = {"all-reduce": 340e9 / 8}
NETWORK_BUSBW_OTHER = 200e9 / 8
# [LAT] nccl-tests on 2 hosts: 5.5 us for a collective of 0 bytes (its fixed cost), 24 us for 512 bytes
#   across the hosts: https://github.com/NVIDIA/nccl-tests/issues/128
NVLINK_LATENCY_S = 5.5e-6
NETWORK_LATENCY_S = 24e-6
# [RAGGED] XLA's ragged all-to-all on GPUs, read in xla/backends/gpu/runtime/ragged_all_to_all_thunk.cc
# at the XLA jaxlib 0.10.2 pins (the same code at openxla/xla 02b6a785), never NCCL's all-to-all:
#   inside one process's GPUs (jaxtrain runs one process a host, so an exchange within a host): the
#     one-shot copy kernel (xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel, on by
#     default), whose grid follows the number of updates, not the bytes: 16.42 GiB/s sent per GPU on
#     8 B200s, about 2% of NVLink (https://github.com/openxla/xla/issues/33386). A rate of the kernel,
#     whatever the link: on H100s the same.
#   across processes: an all-to-all of the output offsets and a copy of the sizes to the host, each
#     waited for by the host (BlockHostUntilDone), then one NCCL send and receive for each (update,
#     peer) slot, the empty ones included: about 12 us a slot (https://github.com/openxla/xla/issues/46982,
#     A100s; the fix, openxla/xla PR 47777, is not in the pinned XLA), its bytes near the network's
#     rate (issue 33386: ~100% of it across 2 hosts). While the host waits it launches nothing: the
#     stream drains, every transfer already in flight on the collectives' stream finishes first.
RAGGED_ONE_SHOT_BYTES_PER_S = 16.42 * 2**30
RAGGED_SLOT_S = 12e-6
RAGGED = "ragged-all-to-all"


# An expert's load when the config gives no capacity factor (dropless): the shipped configs' 1.25.
DROPLESS_LOAD = 1.25
# The padded stand-in's all-to-all of the rows, as the trace names it (plan/schedule.py): [PADDED,
# size, nvlink, network, the slots of the ragged one it stands in for].
PADDED = "padded-exchange"


def peers(xfer: list) -> int:
    """The devices of an all-to-all's group, from its bytes (hlo.transfer): a device keeps 1/n of
    its buffer and sends the rest, (n - 1) / n, over NVLink and the network."""
    _, size, nvlink, network = xfer[:4]
    kept = 1.0 - (nvlink + network) / size if size else 1.0
    return max(1, round(1.0 / kept)) if kept > 0 else 1


def slots(xfer: list) -> int:
    """An expert exchange's (update, peer) slots: XLA sends and receives once for each. The trace
    stores them (schedule.trace); a trace without them: one update a peer."""
    return int(xfer[4]) if len(xfer) > 4 else peers(xfer)


def widen(capacity_factor: float, peers: int) -> float:
    """The padded exchange's bytes over the ragged one's at an even load: each peer's buffer holds
    capacity_factor x an even share (parallel/expert.py pair_bound), so capacity_factor x; dropless,
    every row a device routes, so peers x. (0 in `as_run`: dropless.)"""
    return min(float(peers), capacity_factor) if capacity_factor else float(peers)


def as_run(xfer: list, way: str, wide: float = 0.0) -> list:
    """An expert exchange's transfer as `way` ("ragged" or "padded"; "": as it is) runs it: the
    padded all-to-all moves `wide` x the ragged one's bytes (`widen`; 0: dropless, peers x, each
    peer a buffer of as many rows as the ragged one sends in all: parallel/expert.py). Any other
    transfer as it is."""
    kind, size, nvlink, network = xfer[:4]
    if kind not in (RAGGED, PADDED) or not way or (kind == RAGGED) == (way == "ragged"):
        return xfer
    n = wide or peers(xfer)
    times = 1 / n if kind == PADDED else n
    return [RAGGED if kind == PADDED else PADDED, size * times, nvlink * times, network * times, slots(xfer)]


def legs(
    xfer: list, load: float, way: str = "", scale_in: float = 1.0, scale_out: float = 1.0, wide: float = 0.0
) -> dict[str, float]:
    """Seconds a transfer holds NVLink and the network: a latency and its ideal ring's bytes at the
    bus bandwidth of its kind; an expert exchange run `way` (RAGGED: inside a host the one-shot
    kernel's rate; across hosts its slots; its bytes times the most loaded receiver's `load`;
    `wide`: as `as_run`)."""
    kind, _, nvlink, network = as_run(xfer, way, wide)[:4]
    out = {"nvlink": 0.0, "network": 0.0}
    if kind == RAGGED and not network:  # the one-shot kernel (RAGGED)
        if nvlink:
            out["nvlink"] = NVLINK_LATENCY_S + load * nvlink / RAGGED_ONE_SHOT_BYTES_PER_S
        return out
    # The ragged one's bytes follow the most loaded receiver; the padded one's buffers are fixed.
    load = load if kind == RAGGED else 1.0
    kind = "all-to-all" if kind == PADDED else kind
    if nvlink:
        out["nvlink"] = NVLINK_LATENCY_S + load * nvlink / (
            NVLINK_BUSBW.get(kind, NVLINK_BUSBW_OTHER) * scale_in
        )
    if network:
        out["network"] = NETWORK_LATENCY_S + load * network / (
            NETWORK_BUSBW.get(kind, NETWORK_BUSBW_OTHER) * scale_out
        )
        if kind == RAGGED:
            out["network"] += slots(xfer) * RAGGED_SLOT_S
    return out


def host_wait(xfer: list, way: str = "") -> float:
    """Seconds the host holds the stream before a transfer starts (after the collectives' stream
    drains): XLA's ragged all-to-all across processes, the offsets' all-to-all across the hosts and
    the sizes' copy to the host, each waited for (RAGGED); 0 for every other."""
    kind, _, _, network = as_run(xfer, way)[:4]
    return 2 * NETWORK_LATENCY_S if kind == RAGGED and network else 0.0


def exchange_seconds(
    xfer: list, load: float, scale_in: float = 1.0, scale_out: float = 1.0, wide: float = 0.0
) -> dict[str, float]:
    """One expert exchange both ways: its slower link, and the host's wait (`wide`: as `as_run`)."""
    return {
        way: max(legs(xfer, load, way, scale_in, scale_out, wide).values()) + host_wait(xfer, way)
        for way in ("ragged", "padded")
    }


def pick_exchange(
    xfer: list, load: float, scale_in: float = 1.0, scale_out: float = 1.0, wide: float = 0.0
) -> str:
    """auto's expert exchange on GPUs: the way `exchange_seconds` says is faster for one exchange."""
    seconds = exchange_seconds(xfer, load, scale_in, scale_out, wide)
    return "ragged" if seconds["ragged"] <= seconds["padded"] else "padded"


def exchange_xfer(size: float, peers: int, per_host: int, local_experts: int) -> list:
    """One ragged expert exchange's transfer as the trace holds it (hlo.transfer, schedule.trace):
    `size` bytes a device routes, to `peers` devices `per_host` on a host, peers x local experts slots."""
    nvlink, network = (per_host - 1) / peers * size, (peers - per_host) / peers * size
    return [RAGGED, size, nvlink, network, peers * local_experts]


def expert_load(capacity_factor: float, n_experts: int) -> float:
    """The load the forecast gives the most loaded expert: the capacity factor (what its receive
    buffer allows), DROPLESS_LOAD without one; 1 for a dense model."""
    if not n_experts:
        return 1.0
    return capacity_factor if capacity_factor > 0 else DROPLESS_LOAD
