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
                its link for its kind (observe/links.py: NVLink inside a host, per GPU across);
  the exchange  an expert exchange (schedule.trace marks it: XLA's ragged all-to-all, or the padded
                all-to-all that stands in for it) either way, whichever the program was compiled
                with: the ragged one as XLA's GPU runtime runs it (observe/links.py), not as NCCL's
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

from jaxtrain.observe import links
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


def attention_flops_per_s(kind: str, causal: bool, keys: int) -> float:
    """cuDNN's measured rate for attention over `keys` keys: the nearest length at or below it."""
    i = max(0, bisect.bisect_right(LENGTHS, keys) - 1)
    return ATTENTION_TFLOPS[(kind, causal)][i] * 1e12


@dataclass(frozen=True)
class Achievable:
    """The forecast's costs (schedule.Costs): the module docstring's, on `target`. `exchange`:
    "ragged" or "padded" costs every expert exchange that way, whichever the program holds ("": as
    compiled)."""

    target: GpuTarget
    peak: float  # the dense peak of the step's dtype
    expert_load: float = 1.0  # the most loaded expert's rows over an even share
    exchange: str = ""
    wide: float = 0.0  # the padded exchange's bytes over the ragged one's (links.widen; 0: dropless)
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

    def scales(self) -> tuple[float, float]:
        """The target's NVLink and NIC over the H100's, which observe/links.py's figures are of."""
        return self.target.nvlink_bytes_per_s / 450e9, self.target.network_bytes_per_s / 50e9

    def legs(self, xfer: list) -> dict[str, float]:
        return links.legs(xfer, self.expert_load, self.exchange, *self.scales(), self.wide)

    def host_wait(self, xfer: list) -> float:
        return links.host_wait(xfer, self.exchange)


def forecast(
    events: list, target: GpuTarget, peak: float, load: float, exchange: str = "", wide: float = 0.0
) -> schedule.Clock:
    """The trace `events` replayed at achievable speeds (`exchange`: its expert exchanges run that
    way, the padded one `wide` x the ragged one's bytes: links.widen)."""
    return schedule.replay(events, Achievable(target, peak, load, exchange, wide))


def _largest_exchange(events: list) -> list | None:
    """The trace's expert exchange of the most bytes (the rows of a piece, not the plans' tables)."""
    found: list | None = None
    for event in events:
        inner = [event[2]] if event[0] == "loop" else event[1] if event[0] == "cond" else []
        candidates = [_largest_exchange(branch) for branch in inner]
        if event[0] in ("start", "sync") and event[-1][0] in (links.RAGGED, links.PADDED):
            candidates.append(event[-1])
        for xfer in candidates:
            if xfer is not None and (found is None or xfer[1] > found[1]):
                found = xfer
    return found


def exchanges(events: list, target: GpuTarget, peak: float, load: float, wide: float = 0.0) -> dict[str, Any]:
    """A trace's expert exchange: the step forecast both ways, its largest exchange both ways, the
    way compiled and the one auto takes (`pick_exchange` on that exchange), and `wide` (the padded
    one's bytes over the ragged one's: links.widen). {} for a trace with none."""
    xfer = _largest_exchange(events)
    if xfer is None:
        return {}
    scales = Achievable(target, peak).scales()
    one = links.exchange_seconds(xfer, load, *scales, wide)
    return {
        "ragged_s": forecast(events, target, peak, load, "ragged", wide).now,
        "padded_s": forecast(events, target, peak, load, "padded", wide).now,
        "one_ragged_s": one["ragged"],
        "one_padded_s": one["padded"],
        "compiled": "ragged" if xfer[0] == links.RAGGED else "padded",
        "auto": links.pick_exchange(xfer, load, *scales, wide),
    } | ({"wide": wide} if wide else {})


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
    wide: float = 0.0,
) -> dict[str, Any]:
    """A plan's "forecast": the trace replayed (`forecast`), its figures, the stream's busy and
    exposed time, the load, and for an expert exchange both ways of running it (`exchanges`;
    `wide`: links.widen)."""
    likely = forecast(events, target, peak, load)
    out = figures(likely.now, tokens_per_step, gpus, model_flops_per_step, mfu_peak)
    out |= {"busy_s": likely.busy, "exposed_comm_s": likely.exposed, "expert_load": load}
    if both := exchanges(events, target, peak, load, wide):
        out["exchange"] = both
    return out
