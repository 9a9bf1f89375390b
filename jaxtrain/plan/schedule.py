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
                `-done`, for what is left of the transfer then: the exposed communication.
Loops run their body trip-count times in order (so a gather a pipelined loop starts in one trip
and waits for in the next overlaps that trip's work); a conditional takes its slower branch. No
run of this program on this target is faster: every op runs at the speed its FLOPs and bytes
allow and every collective at the links' full bandwidth. Unlike the floor, the compute of an op
cannot hide a transfer the schedule does not put beside it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from jaxtrain.plan import hlo
from jaxtrain.plan.targets import GpuTarget


@dataclass
class Clock:
    """Where the replay is: the compute stream's time, the links', transfers in flight."""

    now: float = 0.0
    links_free: dict[str, float] = field(default_factory=dict)  # "nvlink" / "network" -> free from
    in_flight: dict[str, float] = field(default_factory=dict)  # async start -> its transfer's end
    busy: float = 0.0  # time the stream spent running ops
    exposed: float = 0.0  # time the stream spent waiting on collectives

    def send(self, legs: dict[str, float]) -> float:
        """Queue a transfer issued now on the links it uses (seconds on each); when it ends."""
        used = [link for link, seconds in legs.items() if seconds > 0]
        start = max([self.now, *(self.links_free.get(link, 0.0) for link in used)])
        end = start + max(legs.values(), default=0.0)
        for link in used:
            self.links_free[link] = end
        return end

    def wait(self, until: float) -> None:
        if until > self.now:
            self.exposed += until - self.now
            self.now = until


class Replay:
    """One compiled program replayed on a target (see the module docstring)."""

    def __init__(self, text: str, layout: hlo.Placement, target: GpuTarget, peak_flops: float) -> None:
        self.program = hlo.Program(text)
        self.layout = layout
        self.target = target
        self.peak = peak_flops

    def run(self) -> Clock:
        clock = Clock()
        self._run(self.program.entry, clock)
        clock.wait(max(clock.in_flight.values(), default=0.0))
        return clock

    def _seconds(self, op: hlo.Op, ops: dict[str, hlo.Op]) -> dict[str, float]:
        t = hlo.transfer(op, ops, self.layout)
        return {
            "nvlink": t.nvlink / self.target.nvlink_bytes_per_s,
            "network": t.network / self.target.network_bytes_per_s,
        }

    def _run(self, comp: str, clock: Clock) -> None:
        program = self.program
        ops = program.comps[comp]
        for op in ops.values():
            code, body, callee = op.opcode, program.body(op), program.callee(op)
            if code == "while" and body:
                for _ in range(program.trip_count(op, ops)):
                    self._run(body, clock)
            elif code == "conditional":
                runs = []
                for branch in program.branches(op):
                    runs.append(copy.deepcopy(clock))
                    self._run(branch, runs[-1])
                if runs:
                    slowest = max(runs, key=lambda c: c.now)
                    clock.__dict__.update(slowest.__dict__)
            elif code == "async-start" and callee:
                inner = program.comps[callee][program.roots[callee]]
                if inner.opcode in hlo.COLLECTIVES:
                    clock.in_flight[op.name] = clock.send(self._seconds(inner, program.comps[callee]))
                else:  # async compute: counted on the one stream, a bound that stays a bound
                    self._run(callee, clock)
            elif code == "call" and callee:
                self._run(callee, clock)
            elif code.endswith("-start") and code.removesuffix("-start") in hlo.COLLECTIVES:
                clock.in_flight[op.name] = clock.send(self._seconds(op, ops))
            elif code.endswith("-done"):
                for name in op.operands:
                    clock.wait(clock.in_flight.pop(name, 0.0))
            elif code in hlo.COLLECTIVES:
                clock.wait(clock.send(self._seconds(op, ops)))
            else:
                seconds = max(
                    hlo.flops(op, program.comps, ops) / self.peak,
                    2 * program.written(op) / self.target.hbm_bytes_per_s,
                )
                clock.now += seconds
                clock.busy += seconds
