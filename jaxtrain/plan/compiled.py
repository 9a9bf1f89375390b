"""What a compiled train step needs on its target: memory, attention kernel, collectives, a time bound.

Pure analysis of `jax.stages.Compiled` programs (compiled for any target, scripts/plan.py compiles
them for GPUs we do not have); nothing here builds or runs a step.

The step-time LOWER BOUND (never a prediction) is the largest of five times, each a floor no real
step beats, assuming perfect overlap of everything:
  compute  model FLOPs per device (6N + 6*L*d*T per token, model.flops_per_token: causal
           attention at half, as the schedule replay counts cuDNN's causal kernel) at the
           target's dense peak (the MFU's numerator: every non-matmul op left out);
  hbm      a floor on HBM traffic at the HBM bandwidth: every buffer a top-level kernel of the
           compiled program writes is written once and read once (program outputs: written only;
           in-place updates: the update only), plus one read of every argument. Collectives are
           left out of it, and so are reads by several kernels of one buffer;
  nvlink   per device, the bytes an ideal ring sends inside a host for each collective;
  network  per device, the bytes that must leave its host for each collective whose group spans
           hosts, with every GPU's NIC in use (a host's share pooled over its GPUs in the group);
  program  the compiled program's own matmul FLOPs per device (hlo.flops) at the dense peak (its
           FP8 GEMMs at the FP8 peak): what `compute` leaves out and the program runs anyway,
           remat's recomputation, a pipeline's bubble ticks (run on zeros) and padding layers.
mfu_ceiling = compute / bound: no step of this program on this target can reach a higher MFU.
The peak of compute and of every MFU is the dtype's that runs (`mfu_dtype`): the step's dtype, or
FP8 where the program runs GEMMs in FP8 (hlo.fp8), as observe/peaks.py says.
Loop bodies count once per trip (microbatches, scanned layers), so every figure is per optimizer step.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from jaxtrain.observe import peaks
from jaxtrain.observe.memory import compiled_bytes, fits, reserve_bytes
from jaxtrain.plan import forecast, hlo, schedule
from jaxtrain.plan.targets import GpuTarget, peak_flops

# jax's GPU client preallocates this fraction of device memory for XLA's allocator by default
# (jax docs, "GPU memory allocation"); XLA_PYTHON_CLIENT_MEM_FRACTION changes it.
DEFAULT_MEM_FRACTION = 0.75


def mem_fraction(environ: dict[str, str] | None = None) -> float:
    """The share of device memory XLA may use: XLA_PYTHON_CLIENT_MEM_FRACTION, else jax's 0.75."""
    env = os.environ if environ is None else environ
    return float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))


def usable_bytes(target: GpuTarget) -> int:
    """What XLA may allocate on one of the target's devices (mem_fraction of its memory)."""
    return int(target.memory_bytes * mem_fraction())


def attention_kernel(hlo: str) -> str:
    """`cudnn` when the program calls cuDNN's fused attention, else `xla` (attention as plain HLO)."""
    return "cudnn" if "__cudnn$fmha" in hlo else "xla"


def attention_calls(text: str) -> dict[str, Any]:
    """cuDNN's fused attention calls in the program text: forward and backward (each loop body's
    call printed once), and the per-device q shapes they take ([batch, seq, heads, head_dim])."""
    calls = re.findall(
        r'custom_call_target="__cudnn\$fmha(\w*)", operand_layout_constraints=\{\w+\[([\d,]+)\]', text
    )
    return {
        "forward": sum(1 for kind, _ in calls if not kind.endswith("Backward")),
        "backward": sum(1 for kind, _ in calls if kind.endswith("Backward")),
        "q_shapes": sorted({tuple(int(d) for d in dims.split(",")) for _, dims in calls}),
    }


@dataclass
class _Tally:
    written: float = 0.0
    flops: float = 0.0  # matmul FLOPs of the compiled program (hlo.flops), per step
    fp8_flops: float = 0.0  # those of them on FP8 tensor cores (hlo.fp8)
    collectives: dict[tuple[str, str, bool], dict[str, float]] = field(default_factory=dict)

    @staticmethod
    def most_of(branches: list[_Tally]) -> _Tally:
        """What the costliest branch of a conditional could cost, figure by figure: the step's
        update sits in one branch (the other skips a non-finite step) and may hold collectives
        while writing less than the other."""
        most = _Tally(
            written=max((b.written for b in branches), default=0.0),
            flops=max((b.flops for b in branches), default=0.0),
            fp8_flops=max((b.fp8_flops for b in branches), default=0.0),
        )
        for b in branches:
            for key, c in b.collectives.items():
                mine = most.collectives.setdefault(key, dict.fromkeys(c, 0.0))
                for k, v in c.items():
                    mine[k] = max(mine[k], v)
        return most

    def add(self, other: _Tally) -> None:
        self.written += other.written
        self.flops += other.flops
        self.fp8_flops += other.fp8_flops
        for key, c in other.collectives.items():
            mine = self.collectives.setdefault(key, dict.fromkeys(c, 0.0))
            for k, v in c.items():
                mine[k] = max(mine[k], v) if k == "largest_bytes" else mine[k] + v


class _Walker:
    """Walks the program as it runs once: loop bodies times their trip count, the costlier branch."""

    def __init__(self, text: str, layout: hlo.Placement) -> None:
        self.program = hlo.Program(text)
        self.layout = layout

    def tally(self) -> _Tally:
        return self._walk(self.program.entry, 1.0)

    def _walk(self, comp: str, mult: float) -> _Tally:
        tally = _Tally()
        program = self.program
        ops = program.comps[comp]
        for op in ops.values():
            body, callee = program.body(op), program.callee(op)
            if op.opcode == "while" and body:
                tally.add(self._walk(body, mult * program.trip_count(op, ops)))
            elif op.opcode == "conditional":
                tally.add(_Tally.most_of([self._walk(n, mult) for n in program.branches(op)]))
            elif op.opcode in ("call", "async-start") and callee:
                tally.add(self._walk(callee, mult))
            elif op.opcode.removesuffix("-start") in hlo.COLLECTIVES:
                self._collective(tally, op, ops, mult)
            else:
                tally.written += mult * program.written(op)
                flops = mult * hlo.flops(op, program.comps, ops)
                tally.flops += flops
                tally.fp8_flops += flops if flops and hlo.fp8(op, program.comps, ops) else 0.0
        return tally

    def _collective(self, tally: _Tally, op: hlo.Op, ops: dict[str, hlo.Op], mult: float) -> None:
        t = hlo.transfer(op, ops, self.layout)
        c = tally.collectives.setdefault(
            (t.kind, t.axis, t.crosses_hosts),
            {"count": 0.0, "bytes": 0.0, "largest_bytes": 0.0, "nvlink_bytes": 0.0, "network_bytes": 0.0},
        )
        c["count"] += mult
        c["largest_bytes"] = max(c["largest_bytes"], t.size)
        c["bytes"] += mult * t.size
        c["nvlink_bytes"] += mult * t.nvlink
        c["network_bytes"] += mult * t.network


@dataclass(frozen=True)
class Facts:
    """What the analysis needs beside the compiled programs."""

    target: GpuTarget
    mesh: dict[str, int]
    hosts: int
    gpus_per_host: int
    device_hosts: list[int]  # the host of each partition, in mesh order
    n_params: int
    model_flops_per_step: float
    dtype: str
    tokens_per_step: int = 0  # global batch x window: the tokens per second per GPU
    expert_load: float = 1.0  # the most loaded expert's rows over an even share (forecast.expert_load)
    wide: float = 0.0  # the padded exchange's bytes over the ragged one's (links.widen; 0: dropless)


def compiled_flops(text: str, layout: hlo.Placement) -> float:
    """The matmul FLOPs one run of a compiled program performs (loops times their trips)."""
    return _Walker(text, layout).tally().flops


def analyze(train: Any, evaluate: Any | None, facts: Facts, compile_s: float) -> dict[str, Any]:
    """The plan of one compiled train step (+ eval step) on its target: memory, kernels, comms, bound."""
    text = train.as_text()
    mem = compiled_bytes(train)
    layout = hlo.Placement(tuple(facts.mesh), tuple(facts.mesh.values()), facts.device_hosts)
    tally = _Walker(text, layout).tally()
    t = facts.target
    n_devices = len(facts.device_hosts)
    limit = usable_bytes(t)
    eval_total = compiled_bytes(evaluate)["total_bytes"] if evaluate is not None else 0
    # Outputs (the new state, donated or not) are written, never read back within the step.
    hbm_bytes = 2 * tally.written - int(train.memory_analysis().output_size_in_bytes) + mem["argument_bytes"]
    collectives: list[dict[str, Any]] = [
        {"kind": k, "axis": a, "crosses_hosts": x, "count": int(round(c["count"])), "bytes": int(c["bytes"]),
         "largest_bytes": int(c["largest_bytes"]),
         "nvlink_bytes": int(c["nvlink_bytes"]), "network_bytes": int(c["network_bytes"])}
        for (k, a, x), c in sorted(tally.collectives.items())
    ]  # fmt: skip
    peak = peak_flops(t, facts.dtype)
    fp8_peak = schedule.op_peak(t, peak, schedule.FP8_GEMM)  # `peak` on a target with no FP8 unit
    mfu_dtype = peaks.FP8 if tally.fp8_flops and fp8_peak != peak else facts.dtype
    times = {
        "compute": facts.model_flops_per_step / n_devices / peak_flops(t, mfu_dtype),
        "program": (tally.flops - tally.fp8_flops) / peak + tally.fp8_flops / fp8_peak,
        "hbm": hbm_bytes / t.hbm_bytes_per_s,
        "nvlink": sum(c["nvlink_bytes"] for c in collectives) / t.nvlink_bytes_per_s,
        "network": sum(c["network_bytes"] for c in collectives) / t.network_bytes_per_s,
    }
    bound = max(times.values())
    events = schedule.trace(text, layout)
    replay = schedule.replay(events, schedule.Roofline(t, peak))
    return {
        "state_bytes_per_device": mem["argument_bytes"],
        "temp_bytes_per_device": mem["temp_bytes"],
        "total_bytes_per_device": mem["total_bytes"],
        "eval_total_bytes_per_device": eval_total,
        "device_memory_bytes": t.memory_bytes,
        "usable_bytes_per_device": limit,
        "reserve_bytes_per_device": reserve_bytes(limit),
        "fits": fits(max(mem["total_bytes"], eval_total), limit),
        "attention": attention_kernel(text),
        "attention_calls": attention_calls(text),
        "collectives": collectives,
        "hbm_bytes_floor": int(hbm_bytes),
        "model_flops_per_step": facts.model_flops_per_step,
        # What the program's matmuls compute per device (remat's recomputation included).
        "compiled_flops_per_device": tally.flops,
        "fp8_flops_per_device": tally.fp8_flops,
        "mfu_dtype": mfu_dtype,  # whose peak the compute floor and every MFU are against
        "bound_terms_s": times,
        "bound_limited_by": max(times, key=lambda k: times[k]),
        "step_time_lower_bound_s": bound,
        "mfu_ceiling": times["compute"] / bound,
        # schedule.py: the compiled order replayed; the exposed part is what its overlap leaves.
        "schedule_bound_s": replay.now,
        "schedule_busy_s": replay.busy,
        "exposed_comm_s": replay.exposed,
        # Never clamped: both bounds count causal attention at half (model.flops_per_token), so
        # the replay is at least the compute floor (tests/test_plan.py checks every plan).
        "schedule_mfu_ceiling": times["compute"] / replay.now,
        # forecast.py: the same replay at the speeds measured on real GPUs, a forecast, not a bound.
        "forecast": forecast.block(
            events,
            t,
            peak,
            facts.expert_load,
            facts.tokens_per_step,
            n_devices,
            facts.model_flops_per_step,
            peak_flops(t, mfu_dtype),
            facts.wide,
        ),
        "schedule_tokens_per_s_per_gpu": facts.tokens_per_step / replay.now / n_devices,
        "compile_s": round(compile_s, 2),
        # The replay's events (schedule.trace): the plan costed again without a compile.
        "schedule_trace": events,
    }
