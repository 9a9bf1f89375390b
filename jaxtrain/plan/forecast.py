"""A FORECAST of the step: the compiled schedule replayed (schedule.py) with each op and transfer
at the speed real H100s reach, not at the datasheet's peak. The bound says no run is faster; the
forecast says what a run most likely takes.

Each op and transfer of the replay (schedule.py's events), at:
  a kernel      KERNEL_S of fixed cost (its launch, the ramp-up and the tail of its last wave:
                many short kernels in a row, as a small model's step has, run far below their
                roofline), plus its own time below;
  gemm          its FLOPs at GEMM_EFFICIENCY of the dense peak, or its bytes at the achievable HBM
                bandwidth, the slower (a skinny GEMM is memory-bound: the shape's part); an FP8
                GEMM at the same fraction of the FP8 peak (schedule.op_peak);
  attention     cuDNN's fused attention at ATTENTION_TFLOPS[kind, causal] for its keys' length
                (the nearest length measured at or below it);
  grouped       the experts' kernel as a GEMM (its FP8 tiles, `pallas_fp8`, as an FP8 GEMM), times
                the load of its most loaded expert (the slowest expert holds every device), no
                public measurement of it by rows per expert;
  memory        its bytes at HBM_EFFICIENCY of the HBM bandwidth;
  a transfer    a latency and its ideal ring's bytes at the bus bandwidth nccl-tests measures on
                its link for its kind (NVLINK_BUSBW inside a host, NETWORK_BUSBW per GPU across);
  the exchange  an expert exchange (schedule.trace marks it: XLA's ragged all-to-all, or the padded
                all-to-all that stands in for it) either way, whichever the program was compiled
                with: the ragged one as XLA's GPU runtime runs it (RAGGED below), not as NCCL's
                all-to-all; the padded one as NCCL's all-to-all of peers x the ragged one's bytes.
Message size enters by the latency: a small transfer is mostly latency. The fractions are of the
H100's figures; on another target the same fractions of its own figures: an assumption.

Two constants are FITTED, GEMM_EFFICIENCY and KERNEL_S: by least squares of the log error over
every measured step in bench/calibration.py (the published MaxText runs and jaxtrain's own runs
on an H200), which also reports each row's error left out of the fit (leave-one-out);
tests/test_plan_forecast.py holds every row and the mean to their tolerances and the constants to
the fit. Every other constant is a public measurement, named beside it.
Left out: stragglers, data loading, host work other than the exchange's, power throttling.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from jaxtrain.plan import schedule
from jaxtrain.plan.targets import TARGETS, GpuTarget, peak_flops

# The H100's bf16 dense peak (targets.py, observe/peaks.py): the rates below are fractions of it.
H100_PEAK = peak_flops(TARGETS["h100"], "bfloat16")

# FITTED (module docstring): 0.681 of the dense peak, 674 TFLOP/s on an H100, sustained over the GEMMs
# of whole training programs. The best case is higher: 780 TFLOP/s, bf16 4224x8192 @ 8192x2048 on an
# H100 SXM, torch.compile max-autotune with vboost (https://gist.github.com/Chillee/2ec89696db8b7ed1c24461159e325405),
# one shape, tuned, at a raised clock; before this fit the forecast used it and was short on every row.
GEMM_EFFICIENCY = 0.681
# FITTED: each kernel's fixed cost, 8.3 us. Its parts: a launch (XLA groups kernels into CUDA graphs,
# whose nodes still start ~1-2 us apart), the ramp-up and the partly idle last wave of each kernel
# (a kernel of a few microseconds is mostly these), the dependent kernel waiting for the last block.
KERNEL_S = 8.3e-6
# [HBM] 2.8 TB/s of 3.35, coalesced loads on an H100 SXM5 under Nsight Compute:
#   https://mikamirai.com/blog/gpu-memory-bandwidth/
HBM_EFFICIENCY = 2.8e12 / 3.35e12
# [FA3] Shah et al., "FlashAttention-3" (arXiv 2407.08608), figure 5 and 6: cuDNN's bf16 attention on an
# H100 80GB SXM5, head size 128, TFLOP/s at keys of 512 .. 16k (FLOPs as hlo.flops counts them: causal
# at half, the backward 2.5 times the forward). The backward was measured without a causal mask only.
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
ATTENTION_TFLOPS = {
    ("attention", True): [315, 410, 484, 518, 529, 539],
    ("attention", False): [497, 574, 617, 609, 600, 595],
    ("attention_bwd", True): [305, 408, 465, 499, 518, 516],
    ("attention_bwd", False): [305, 408, 465, 499, 518, 516],
}
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
# The padded stand-in's all-to-all of the rows, as the trace names it (schedule.PADDED): [PADDED,
# size, nvlink, network, the slots of the ragged one it stands in for].
PADDED = schedule.PADDED
# An expert's load when the config gives no capacity factor (dropless): the shipped configs' 1.25.
DROPLESS_LOAD = 1.25


def attention_flops_per_s(kind: str, causal: bool, keys: int) -> float:
    """cuDNN's measured rate for attention over `keys` keys: the nearest length at or below it."""
    i = max(0, bisect.bisect_right(LENGTHS, keys) - 1)
    return ATTENTION_TFLOPS[(kind, causal)][i] * 1e12


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


def as_run(xfer: list, way: str) -> list:
    """An expert exchange's transfer as `way` ("ragged" or "padded") runs it: the padded all-to-all
    gives each peer a buffer of as many rows as the ragged one sends in all (parallel/expert.py), so
    peers x its bytes. Any other transfer as it is."""
    kind, size, nvlink, network = xfer[:4]
    if kind not in (RAGGED, PADDED) or not way or (kind == RAGGED) == (way == "ragged"):
        return xfer
    n = peers(xfer)
    times = 1 / n if kind == PADDED else n
    return [RAGGED if kind == PADDED else PADDED, size * times, nvlink * times, network * times, slots(xfer)]


@dataclass(frozen=True)
class Achievable:
    """The forecast's costs (schedule.Costs): the module docstring's, on `target`. `exchange`:
    "ragged" or "padded" costs every expert exchange that way, whichever the program holds ("": as
    compiled)."""

    target: GpuTarget
    peak: float  # the dense peak of the step's dtype
    expert_load: float = 1.0  # the most loaded expert's rows over an even share
    exchange: str = ""
    gemm_efficiency: float = GEMM_EFFICIENCY
    kernel_s: float = KERNEL_S

    def op(self, kind: str, flops: float, written: float, keys: int, causal: bool) -> float:
        memory = written / (self.target.hbm_bytes_per_s * HBM_EFFICIENCY)
        if kind in ("attention", "attention_bwd"):
            rate = attention_flops_per_s(kind, causal, keys) * self.peak / H100_PEAK
            return self.kernel_s + max(flops / rate, memory)
        load = self.expert_load if kind in (schedule.GROUPED, schedule.FP8_GROUPED) else 1.0
        peak = schedule.op_peak(self.target, self.peak, kind)
        return self.kernel_s + max(load * flops / (peak * self.gemm_efficiency), memory)

    def legs(self, xfer: list) -> dict[str, float]:
        kind, _, nvlink, network = as_run(xfer, self.exchange)[:4]
        scale_in = self.target.nvlink_bytes_per_s / 450e9  # the H100's NVLink, per direction
        scale_out = self.target.network_bytes_per_s / 50e9  # the H100's 400 Gb/s NIC
        legs = {"nvlink": 0.0, "network": 0.0}
        if kind == RAGGED and not network:  # the one-shot kernel (RAGGED)
            if nvlink:
                legs["nvlink"] = NVLINK_LATENCY_S + self.expert_load * nvlink / RAGGED_ONE_SHOT_BYTES_PER_S
            return legs
        # The ragged one's bytes follow the most loaded receiver; the padded one's buffers are fixed.
        load = self.expert_load if kind == RAGGED else 1.0
        kind = "all-to-all" if kind == PADDED else kind
        if nvlink:
            legs["nvlink"] = NVLINK_LATENCY_S + load * nvlink / (
                NVLINK_BUSBW.get(kind, NVLINK_BUSBW_OTHER) * scale_in
            )
        if network:
            legs["network"] = NETWORK_LATENCY_S + load * network / (
                NETWORK_BUSBW.get(kind, NETWORK_BUSBW_OTHER) * scale_out
            )
            if kind == RAGGED:
                legs["network"] += slots(xfer) * RAGGED_SLOT_S
        return legs

    def host_wait(self, xfer: list) -> float:
        """Seconds the host holds the stream before a transfer starts (schedule.Costs): XLA's ragged
        all-to-all across processes waits twice (RAGGED), on the offsets' all-to-all across the
        hosts, and each wait costs the next kernel a launch."""
        kind, _, _, network = as_run(xfer, self.exchange)[:4]
        return NETWORK_LATENCY_S + 2 * self.kernel_s if kind == RAGGED and network else 0.0


def expert_load(capacity_factor: float, n_experts: int) -> float:
    """The load the forecast gives the most loaded expert: the capacity factor (what its receive
    buffer allows), DROPLESS_LOAD without one; 1 for a dense model."""
    if not n_experts:
        return 1.0
    return capacity_factor if capacity_factor > 0 else DROPLESS_LOAD


def forecast(events: list, target: GpuTarget, peak: float, load: float, exchange: str = "") -> schedule.Clock:
    """The trace `events` replayed at achievable speeds (`exchange`: its expert exchanges run that way)."""
    return schedule.replay(events, Achievable(target, peak, load, exchange))


def exchange_seconds(target: GpuTarget, xfer: list, load: float) -> dict[str, float]:
    """One expert exchange forecast both ways: its slower link, and the host's wait."""
    out = {}
    for way in ("ragged", "padded"):
        costs = Achievable(target, 0.0, load, way)
        out[way] = max(costs.legs(xfer).values()) + costs.host_wait(xfer)
    return out


def pick_exchange(target: GpuTarget, xfer: list, load: float) -> str:
    """auto's expert exchange: the one `exchange_seconds` forecasts faster for the job's exchange
    (run/kernels.py at job start, and so the plan: the same rule)."""
    seconds = exchange_seconds(target, xfer, load)
    return "ragged" if seconds["ragged"] <= seconds["padded"] else "padded"


def exchange_xfer(size: float, peers: int, per_host: int, local_experts: int) -> list:
    """One ragged expert exchange's transfer as the trace holds it (hlo.transfer, schedule.trace):
    `size` bytes a device routes, to `peers` devices `per_host` on a host, peers x local experts slots."""
    nvlink, network = (per_host - 1) / peers * size, (peers - per_host) / peers * size
    return [RAGGED, size, nvlink, network, peers * local_experts]


def _largest_exchange(events: list) -> list | None:
    """The trace's expert exchange of the most bytes (the rows of a piece, not the plans' tables)."""
    found: list | None = None
    for event in events:
        inner = [event[2]] if event[0] == "loop" else event[1] if event[0] == "cond" else []
        candidates = [_largest_exchange(branch) for branch in inner]
        if event[0] in ("start", "sync") and event[-1][0] in (RAGGED, PADDED):
            candidates.append(event[-1])
        for xfer in candidates:
            if xfer is not None and (found is None or xfer[1] > found[1]):
                found = xfer
    return found


def exchanges(events: list, target: GpuTarget, peak: float, load: float) -> dict[str, Any]:
    """A trace's expert exchange: the step forecast both ways, its largest exchange both ways, the
    way compiled and the one auto takes (`pick_exchange` on that exchange). {} for a trace with none."""
    xfer = _largest_exchange(events)
    if xfer is None:
        return {}
    one = exchange_seconds(target, xfer, load)
    return {
        "ragged_s": forecast(events, target, peak, load, "ragged").now,
        "padded_s": forecast(events, target, peak, load, "padded").now,
        "one_ragged_s": one["ragged"],
        "one_padded_s": one["padded"],
        "compiled": "ragged" if xfer[0] == RAGGED else "padded",
        "auto": pick_exchange(target, xfer, load),
    }


def figures(
    step_s: float, tokens_per_step: int, gpus: int, model_flops_per_step: float, peak: float
) -> dict[str, Any]:
    """Step time, tokens per second per GPU and MFU (model FLOPs over the dense peak) of a step time."""
    return {
        "step_time_s": step_s,
        "tokens_per_s_per_gpu": tokens_per_step / step_s / gpus,
        "mfu": model_flops_per_step / gpus / peak / step_s,
    }


def block(
    events: list,
    target: GpuTarget,
    peak: float,
    load: float,
    tokens_per_step: int,
    gpus: int,
    model_flops_per_step: float,
    mfu_peak: float,
) -> dict[str, Any]:
    """A plan's "forecast": the trace replayed (`forecast`), its figures, the stream's busy and
    exposed time, the load, and for an expert exchange both ways of running it (`exchanges`)."""
    likely = forecast(events, target, peak, load)
    out = figures(likely.now, tokens_per_step, gpus, model_flops_per_step, mfu_peak)
    out |= {"busy_s": likely.busy, "exposed_comm_s": likely.exposed, "expert_load": load}
    if both := exchanges(events, target, peak, load):
        out["exchange"] = both
    return out
