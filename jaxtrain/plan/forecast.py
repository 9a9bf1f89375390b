"""A FORECAST of the step: the compiled schedule replayed (schedule.py) with each op and transfer
at the speed measured on real H100s, not at the datasheet's peak. The bound says no run is
faster; the forecast says what a run most likely takes. Nothing here was measured by us: every
constant is a public measurement, named beside it, and none is fitted to the runs the forecast
is checked against (bench/calibration.py).

Each op and transfer of the replay (schedule.py's events), at:
  gemm          its FLOPs at GEMM_EFFICIENCY of the dense peak, or its bytes at the achievable HBM
                bandwidth, the slower (a skinny GEMM is memory-bound: the shape's part); an FP8
                GEMM at the same fraction of the FP8 peak (schedule.op_peak): an assumption, no
                public FP8 measurement of the same shapes beside the bf16 one;
  attention     cuDNN's fused attention at ATTENTION_TFLOPS[kind, causal] for its keys' length
                (the nearest length measured at or below it);
  grouped       the experts' kernel as a GEMM (its FP8 tiles, `pallas_fp8`, as an FP8 GEMM), times
                the load of its most loaded expert (the slowest expert holds every device), no
                public measurement of it by rows per expert;
  memory        its bytes at HBM_EFFICIENCY of the HBM bandwidth;
  a transfer    a latency and its ideal ring's bytes at the bus bandwidth nccl-tests measures on
                its link for its kind (NVLINK_BUSBW inside a host, NETWORK_BUSBW per GPU across);
                the expert exchange (ragged all-to-all) times the most loaded receiver's load.
Message size enters by the latency: a small transfer is mostly latency. The fractions are of the
H100's figures; on another target the same fractions of its own figures: an assumption.
Left out: kernel launch gaps, stragglers, data loading, host work, power throttling.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from jaxtrain.plan import schedule
from jaxtrain.plan.targets import TARGETS, GpuTarget, peak_flops

# The H100's bf16 dense peak (targets.py, observe/peaks.py): the rates below are fractions of it.
H100_PEAK = peak_flops(TARGETS["h100"], "bfloat16")

# [GEMM] 780 TFLOP/s, bf16 4224x8192 @ 8192x2048 on an H100 SXM (torch.compile max-autotune, vboost):
#   https://gist.github.com/Chillee/2ec89696db8b7ed1c24461159e325405
GEMM_EFFICIENCY = 780e12 / H100_PEAK
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
# An expert's load when the config gives no capacity factor (dropless): the shipped configs' 1.25.
DROPLESS_LOAD = 1.25


def attention_flops_per_s(kind: str, causal: bool, keys: int) -> float:
    """cuDNN's measured rate for attention over `keys` keys: the nearest length at or below it."""
    i = max(0, bisect.bisect_right(LENGTHS, keys) - 1)
    return ATTENTION_TFLOPS[(kind, causal)][i] * 1e12


@dataclass(frozen=True)
class Achievable:
    """The forecast's costs (schedule.Costs): the module docstring's, on `target`."""

    target: GpuTarget
    peak: float  # the dense peak of the step's dtype
    expert_load: float = 1.0  # the most loaded expert's rows over an even share

    def op(self, kind: str, flops: float, written: float, keys: int, causal: bool) -> float:
        memory = written / (self.target.hbm_bytes_per_s * HBM_EFFICIENCY)
        if kind in ("attention", "attention_bwd"):
            rate = attention_flops_per_s(kind, causal, keys) * self.peak / H100_PEAK
            return max(flops / rate, memory)
        load = self.expert_load if kind in (schedule.GROUPED, schedule.FP8_GROUPED) else 1.0
        peak = schedule.op_peak(self.target, self.peak, kind)
        return max(load * flops / (peak * GEMM_EFFICIENCY), memory)

    def legs(self, xfer: list) -> dict[str, float]:
        kind, _, nvlink, network = xfer
        load = self.expert_load if kind == "ragged-all-to-all" else 1.0
        scale_in = self.target.nvlink_bytes_per_s / 450e9  # the H100's NVLink, per direction
        scale_out = self.target.network_bytes_per_s / 50e9  # the H100's 400 Gb/s NIC
        legs = {"nvlink": 0.0, "network": 0.0}
        if nvlink:
            legs["nvlink"] = NVLINK_LATENCY_S + load * nvlink / (
                NVLINK_BUSBW.get(kind, NVLINK_BUSBW_OTHER) * scale_in
            )
        if network:
            legs["network"] = NETWORK_LATENCY_S + load * network / (
                NETWORK_BUSBW.get(kind, NETWORK_BUSBW_OTHER) * scale_out
            )
        return legs


def expert_load(capacity_factor: float, n_experts: int) -> float:
    """The load the forecast gives the most loaded expert: the capacity factor (what its receive
    buffer allows), DROPLESS_LOAD without one; 1 for a dense model."""
    if not n_experts:
        return 1.0
    return capacity_factor if capacity_factor > 0 else DROPLESS_LOAD


def forecast(events: list, target: GpuTarget, peak: float, load: float) -> schedule.Clock:
    """The trace `events` replayed at achievable speeds."""
    return schedule.replay(events, Achievable(target, peak, load))


def figures(
    step_s: float, tokens_per_step: int, gpus: int, model_flops_per_step: float, peak: float
) -> dict[str, Any]:
    """Step time, tokens per second per GPU and MFU (model FLOPs over the dense peak) of a step time."""
    return {
        "step_time_s": step_s,
        "tokens_per_s_per_gpu": tokens_per_step / step_s / gpus,
        "mfu": model_flops_per_step / gpus / peak / step_s,
    }
