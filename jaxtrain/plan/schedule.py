"""The step as its compiled schedule runs it: how much communication the schedule leaves exposed.

XLA's GPU compiler puts each computation's ops in one order (`is_scheduled=true`: the text lists
them in it) and runs them one after another on a compute stream; an async collective runs beside
that stream from its `-start` to its `-done`. Replaying the order, each op at its own roofline,
gives a schedule-aware LOWER BOUND on the step (still never a prediction):
  an op         max(its matmul FLOPs at the dense peak, twice the bytes it writes at HBM bandwidth:
                written once, read once, as the floor in compiled.py counts them);
  a collective  its ideal ring's bytes at NVLink and at network bandwidth, the slower leg's time;
                NVLink and the network are two queues: a transfer starts when it is issued and
                the transfers before it on the links it uses are done;
  waiting       a synchronous collective stalls the stream for all of it; an async one only at its
                `-done`, for what is left of the transfer then: the exposed communication;
  synchronous   XLA runs one (a plain collective, or a `-start` marked `"is_sync":true`) on the
                compute stream itself, not on the async collectives' stream (its CollectiveThunk:
                "Launch collective operation on a main stream"), so it does not queue behind the
                async transfers in flight: it starts at once, and delays each of them whose slowest
                leg is on a link it uses by its own time there (the two share that link).
Loops run their body trip-count times in order (so a gather a pipelined loop starts in one trip
and waits for in the next overlaps that trip's work); a conditional takes its slower branch. No
run of this program on this target is faster: every op runs at the speed its FLOPs and bytes
allow and every collective at the links' full bandwidth. Unlike the floor, the compute of an op
cannot hide a transfer the schedule does not put beside it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Protocol

from jaxtrain.observe import links, peaks
from jaxtrain.parallel.expert import PADDED_SCOPE
from jaxtrain.plan import hlo
from jaxtrain.plan.targets import GpuTarget

FP8_GEMM = "gemm_fp8"  # a GEMM on FP8 tensor cores (hlo.fp8): at the target's FP8 peak
GROUPED, FP8_GROUPED = "grouped", "grouped_fp8"  # the experts' kernel: bf16, or FP8 (`pallas_fp8`)
FP8_KINDS = (FP8_GEMM, FP8_GROUPED)


def op_peak(target: GpuTarget, peak: float, kind: str) -> float:
    """The dense peak an op of `kind` runs at: an FP8 GEMM or grouped kernel at the target's FP8
    peak (where it has one), every other op at `peak`, the step's dtype's."""
    fp8 = peaks.peak_flops(target.device_kind, peaks.FP8) if kind in FP8_KINDS else None
    return fp8 or peak


@dataclass
class Clock:
    """Where the replay is: the compute stream's time, the links', transfers in flight."""

    now: float = 0.0
    links_free: dict[str, float] = field(default_factory=dict)  # "nvlink" / "network" -> free from
    in_flight: dict[str, float] = field(default_factory=dict)  # async start -> its transfer's end
    busy: float = 0.0  # time the stream spent running ops
    exposed: float = 0.0  # time the stream spent waiting on collectives
    # What it waited on: a transfer's `label` -> (seconds, how many such transfers it waited on)
    waited: dict[tuple, tuple[float, int]] = field(default_factory=dict)
    labels: dict[str, tuple] = field(default_factory=dict)  # async start -> its transfer's label
    slowest: dict[str, str] = field(default_factory=dict)  # async start -> the link its transfer is bound by

    def send(self, legs: dict[str, float]) -> float:
        """Queue a transfer issued now on the links it uses (seconds on each); when it ends."""
        used = [link for link, seconds in legs.items() if seconds > 0]
        start = max([self.now, *(self.links_free.get(link, 0.0) for link in used)])
        end = start + max(legs.values(), default=0.0)
        for link in used:
            self.links_free[link] = end
        return end

    def beside(self, legs: dict[str, float]) -> float:
        """Run a synchronous transfer now, beside the async ones in flight (the module docstring):
        each of those bound by a link this one uses ends its time on that link later; when it ends."""
        for name, link in self.slowest.items():
            end = self.in_flight.get(name, 0.0)
            if legs.get(link, 0.0) > 0 and end > self.now:
                self.in_flight[name] = end + legs[link]
        for link, seconds in legs.items():
            if seconds > 0 and self.links_free.get(link, 0.0) > self.now:
                self.links_free[link] += seconds
        return self.now + max(legs.values(), default=0.0)

    def wait(self, until: float, label: tuple | None = None) -> None:
        if until > self.now:
            self.exposed += until - self.now
            if label is not None:
                seconds, count = self.waited.get(label, (0.0, 0))
                self.waited[label] = (seconds + until - self.now, count + 1)
            self.now = until


def label(xfer: list) -> tuple[str, int, bool]:
    """A transfer's (kind, bytes, whether it crosses hosts): what `Clock.waited` sums waits by."""
    kind, size, _, network = xfer[:4]
    return kind, int(size), network > 0


# The replay's events, JSON as the plan stores them (`schedule_trace`), so a plan is costed again
# without its compile (jaxtrain/plan/forecast.py, tests/test_plan_forecast.py):
#   ["op", kind, flops, bytes, keys, causal, n]  n ops in a row alike: kind "gemm" (cuBLAS, a dot),
#                           "gemm_fp8" (one on FP8 tensor cores),
#                           "attention" / "attention_bwd" (cuDNN; keys: the keys' length), "grouped"
#                           (the experts' kernel), "grouped_fp8" (its FP8 tiles), "memory" (no
#                           matmul: its bytes only)
#   ["start", name, xfer] / ["done", [names]] / ["sync", xfer]   xfer: [kind, size, nvlink, network]
#                           (a ragged all-to-all's: then its (update, peer) slots)
#   ["loop", trips, [events]] / ["cond", [[events], ...]]


def _kind(op: hlo.Op, flops: float) -> tuple[str, int, bool]:
    """What runs an op (see the events above), the keys its attention reads, whether causal."""
    target = re.search(r'custom_call_target="([^"]+)"', op.attrs) if op.opcode == "custom-call" else None
    name = target.group(1) if target else ""
    if name.startswith("__cudnn$fmha"):
        layouts = op.attrs.split("operand_layout_constraints=")[-1]
        shapes = [[int(d) for d in dims.split(",") if d] for _, dims in hlo.ARRAY.findall(layouts)[:2]]
        keys = shapes[1][1] if len(shapes) > 1 and len(shapes[1]) > 1 else 0
        causal = bool(re.search(r'"mask_type":\s*"CAUSAL"', op.attrs))
        return ("attention_bwd" if "Backward" in name else "attention"), keys, causal
    if name == "mosaic_gpu_v2" and flops:
        return GROUPED, 0, False
    return ("gemm" if flops else "memory"), 0, False


def _op_event(op: hlo.Op, program: hlo.Program, ops: dict[str, hlo.Op]) -> list | None:
    """An op's event (above), None for an op with no FLOPs and no bytes."""
    flops, written = hlo.flops(op, program.comps, ops), 2 * program.written(op)
    if not (flops or written):  # written once, read once (the floor in compiled.py counts so)
        return None
    kind, keys, causal = _kind(op, flops)
    if kind in ("gemm", GROUPED) and hlo.fp8(op, program.comps, ops):
        kind = FP8_GEMM if kind == "gemm" else FP8_GROUPED
    return ["op", kind, int(flops), written, keys, causal, 1]


def trace(text: str, layout: hlo.Placement) -> list:
    """The compiled program's schedule as events (above): each op's FLOPs and bytes, each
    collective's transfer, loops with their trip counts, conditionals with their branches."""
    program = hlo.Program(text)

    def xfer(op: hlo.Op, ops: dict[str, hlo.Op]) -> list:
        t = hlo.transfer(op, ops, layout)
        if t.kind == "ragged-all-to-all":
            # Its (update, peer) slots, which XLA's GPU runtime sends one by one (observe/links.py RAGGED):
            # the length of its input offsets (operand 2), peers x updates a peer.
            operand = ops.get(op.operands[2]) if len(op.operands) > 2 else None
            offsets = hlo._dims(operand.shape) if operand is not None else []
            return [t.kind, t.size, t.nvlink, t.network, *offsets[:1]]
        padded = re.search(rf"{PADDED_SCOPE}_slots_(\d+)", op.attrs) if t.kind == "all-to-all" else None
        if padded:  # the padded stand-in's rows (parallel/expert.py), named with the ragged one's slots
            return [links.PADDED, t.size, t.nvlink, t.network, int(padded.group(1))]
        return [t.kind, t.size, t.nvlink, t.network]

    def walk(comp: str) -> list:
        events: list = []
        ops = program.comps[comp]
        for op in ops.values():
            code, body, callee = op.opcode, program.body(op), program.callee(op)
            if code == "while" and body:
                events.append(["loop", program.trip_count(op, ops), walk(body)])
            elif code == "conditional":
                events.append(["cond", [walk(branch) for branch in program.branches(op)]])
            elif code == "async-start" and callee:
                inner = program.comps[callee][program.roots[callee]]
                if inner.opcode in hlo.COLLECTIVES:
                    events.append(_started(op, xfer(inner, program.comps[callee])))
                else:  # async compute: counted on the one stream, a bound that stays a bound
                    events += walk(callee)
            elif code == "call" and callee:
                events += walk(callee)
            elif code.endswith("-start") and code.removesuffix("-start") in hlo.COLLECTIVES:
                events.append(_started(op, xfer(op, ops)))
            elif code.endswith("-done"):
                events.append(["done", op.operands])
            elif code in hlo.COLLECTIVES:
                events.append(["sync", xfer(op, ops)])
            elif (event := _op_event(op, program, ops)) is not None:
                events.append(event)
        return _merged(events)

    return walk(program.entry)


def _started(op: hlo.Op, xfer: list) -> list:
    """An async start's event: "sync" where XLA runs it synchronously (`"is_sync":true`, which its
    `-done` then waits on at once: that done's wait finds nothing in flight)."""
    return ["sync", xfer] if '"is_sync":true' in op.attrs else ["start", op.name, xfer]


def _merged(events: list) -> list:
    """Ops alike in one run between other events counted once, n times: the stream runs a run's
    ops one after another, so their order inside it changes no time."""
    out: list = []
    run: dict[tuple, int] = {}
    for event in [*events, None]:
        if event is not None and event[0] == "op":
            run[tuple(event[:-1])] = run.get(tuple(event[:-1]), 0) + event[-1]
            continue
        out += [[*op, n] for op, n in run.items()]
        run = {}
        if event is not None:
            out.append(event)
    return out


class Costs(Protocol):
    """Seconds an op takes, and seconds a transfer holds each link it uses."""

    def op(self, kind: str, flops: float, written: float, keys: int, causal: bool) -> float: ...

    def legs(self, xfer: list) -> dict[str, float]: ...

    def host_wait(self, xfer: list) -> float:
        """Seconds the host holds the stream before `xfer` starts, after draining every transfer in
        flight (XLA's ragged all-to-all across processes: observe/links.py RAGGED); 0 for most."""
        ...


@dataclass(frozen=True)
class Roofline:
    """The bound's costs: each op at its roofline (its matmul FLOPs at the dense peak, `op_peak`,
    or its bytes at HBM bandwidth), each transfer's ideal ring bytes at the links' full bandwidth."""

    target: GpuTarget
    peak: float

    def op(self, kind: str, flops: float, written: float, keys: int, causal: bool) -> float:
        return max(flops / op_peak(self.target, self.peak, kind), written / self.target.hbm_bytes_per_s)

    def legs(self, xfer: list) -> dict[str, float]:
        _, _, nvlink, network = xfer[:4]
        return {
            "nvlink": nvlink / self.target.nvlink_bytes_per_s,
            "network": network / self.target.network_bytes_per_s,
        }

    def host_wait(self, xfer: list) -> float:
        return 0.0  # a bound: no host in it


def replay(events: list, costs: Costs) -> Clock:
    """The stream and the links through `events` (a trace), each op and transfer at `costs`."""
    clock = Clock()
    _replay(events, costs, clock)
    clock.wait(max(clock.in_flight.values(), default=0.0))
    return clock


def _replay(events: list, costs: Costs, clock: Clock) -> None:
    for event in events:
        what = event[0]
        if what == "loop":
            for _ in range(event[1]):
                _replay(event[2], costs, clock)
        elif what == "cond":
            runs = []
            for branch in event[1]:
                runs.append(copy.deepcopy(clock))
                _replay(branch, costs, runs[-1])
            if runs:
                slowest = max(runs, key=lambda c: c.now)
                clock.__dict__.update(slowest.__dict__)
        elif what in ("start", "sync"):
            xfer = event[-1]
            if held := costs.host_wait(xfer):
                # The host drains the collectives' stream, then holds the compute stream `held` more.
                clock.wait(max(clock.in_flight.values(), default=0.0), label(xfer))
                clock.wait(clock.now + held, label(xfer))
            if what == "sync":
                clock.wait(clock.beside(costs.legs(xfer)), label(xfer))
                continue
            legs = costs.legs(xfer)
            clock.in_flight[event[1]] = clock.send(legs)
            clock.labels[event[1]] = label(xfer)
            clock.slowest[event[1]] = max(legs, key=legs.__getitem__)
        elif what == "done":
            for name in event[1]:
                clock.slowest.pop(name, None)
                clock.wait(clock.in_flight.pop(name, 0.0), clock.labels.pop(name, None))
        else:
            _, kind, flops, written, keys, causal, n = event
            seconds = n * costs.op(kind, flops, written, keys, causal)
            clock.now += seconds
            clock.busy += seconds


class Replay:
    """One compiled program replayed on a target at its roofline (see the module docstring)."""

    def __init__(self, text: str, layout: hlo.Placement, target: GpuTarget, peak_flops: float) -> None:
        self.events = trace(text, layout)
        self.costs = Roofline(target, peak_flops)

    def run(self) -> Clock:
        return replay(self.events, self.costs)
