"""What a compiled train step needs on its target: memory, attention kernel, collectives, a time bound.

Pure analysis of `jax.stages.Compiled` programs (compiled for any target, scripts/plan.py compiles
them for GPUs we do not have); nothing here builds or runs a step.

The step-time LOWER BOUND (never a prediction) is the largest of four times, each a floor no real
step beats, assuming perfect overlap of everything:
  compute  model FLOPs per device (6N + 12*L*d*T per token, model.flops_per_token) at the
           target's dense peak: remat's recomputation and every non-matmul op are left out;
  hbm      a floor on HBM traffic at the HBM bandwidth: every buffer a top-level kernel of the
           compiled program writes is written once and read once (program outputs: written only;
           in-place updates: the update only), plus one read of every argument. Collectives are
           left out of it, and so are reads by several kernels of one buffer;
  nvlink   per device, the bytes an ideal ring sends inside a host for each collective;
  network  per device, the bytes that must leave its host for each collective whose group spans
           hosts, with every GPU's NIC in use (a host's share pooled over its GPUs in the group).
mfu_ceiling = compute / bound: no step of this program on this target can reach a higher MFU.
Loop bodies count once per trip (microbatches, scanned layers), so every figure is per optimizer step.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxtrain.errors import UserError
from jaxtrain.observe.memory import compiled_bytes, fits
from jaxtrain.plan.targets import GpuTarget, peak_flops

# jax's GPU client preallocates this fraction of device memory for XLA's allocator by default
# (jax docs, "GPU memory allocation"); XLA_PYTHON_CLIENT_MEM_FRACTION changes it.
DEFAULT_MEM_FRACTION = 0.75

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1,
}  # fmt: skip
_ARRAY = re.compile(r"([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Ops that move no bytes of their own, or whose bytes other terms count (collectives, loops).
_NO_TRAFFIC = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "iota", "async-start", "async-done", "async-update",
    "copy-start", "copy-done", "send", "send-done", "recv", "recv-done", "add-dependency", "opt-barrier",
}  # fmt: skip


def mem_fraction(environ: dict[str, str] | None = None) -> float:
    """The share of device memory XLA may use: XLA_PYTHON_CLIENT_MEM_FRACTION, else jax's 0.75."""
    env = os.environ if environ is None else environ
    return float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))


def attention_kernel(hlo: str) -> str:
    """`cudnn` when the program calls cuDNN's fused attention, else `xla` (attention as plain HLO)."""
    return "cudnn" if "__cudnn$fmha" in hlo else "xla"


def _bytes(shape: str) -> int:
    return sum(
        _DTYPE_BYTES.get(dt, 1) * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in _ARRAY.findall(shape)
    )


@dataclass
class _Op:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _parse_op(line: str) -> _Op | None:
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if not m:
        return None
    rest = line[m.end() :]
    end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    opcode = rest[:paren]
    close = _balanced(rest, paren)
    operands = re.findall(r"%([\w.\-]+)", rest[paren:close])
    return _Op(m.group(1), shape, opcode, operands, rest[close:])


def parse_hlo(hlo: str) -> tuple[dict[str, dict[str, _Op]], dict[str, str], str]:
    """Computations of an HLO module's text: ops by name (in order), each one's root, the entry's name."""
    comps: dict[str, dict[str, _Op]] = {}
    roots: dict[str, str] = {}
    entry, current = "", ""
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            m = re.match(r"(ENTRY )?%([\w.\-]+) ", line)
            if m:
                current = m.group(2)
                comps[current] = {}
                entry = current if m.group(1) else entry
            continue
        op = _parse_op(line) if current else None
        if op:
            comps[current][op.name] = op
            if line.lstrip().startswith("ROOT "):
                roots[current] = op.name
    return comps, roots, entry


def _groups(attrs: str, n_devices: int) -> list[list[int]]:
    """Replica groups (partition ids) of a collective: explicit lists or the iota form."""
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")]
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    groups = re.findall(r"\{([\d,]+)\}", explicit.group(1)) if explicit else []
    return [[int(x) for x in g.split(",")] for g in groups] or [list(range(n_devices))]


@dataclass
class _Placement:
    """Where partition i sits: its mesh coordinates and its host."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    hosts: list[int]

    def axis_of(self, group: list[int]) -> str:
        coords = np.array(np.unravel_index(group, self.shape)).T
        varying = [a for i, a in enumerate(self.axes) if len(set(coords[:, i])) > 1]
        return "+".join(varying) or "-"


@dataclass
class _Tally:
    written: float = 0.0
    collectives: dict[tuple[str, str, bool], dict[str, float]] = field(default_factory=dict)

    def add(self, other: _Tally) -> None:
        self.written += other.written
        for key, c in other.collectives.items():
            mine = self.collectives.setdefault(key, dict.fromkeys(c, 0.0))
            for k, v in c.items():
                mine[k] = max(mine[k], v) if k == "largest_bytes" else mine[k] + v


class _Walker:
    """Walks the program as it runs once: loop bodies times their trip count, the costlier branch."""

    def __init__(self, hlo: str, layout: _Placement) -> None:
        self.comps, self.roots, self.entry = parse_hlo(hlo)
        self.layout = layout

    def tally(self) -> _Tally:
        return self._walk(self.entry, 1.0)

    def _walk(self, comp: str, mult: float) -> _Tally:
        tally = _Tally()
        ops = self.comps[comp]
        for op in ops.values():
            kind = op.opcode.removesuffix("-start")
            if op.opcode == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attrs)
                body = re.search(r"body=%([\w.\-]+)", op.attrs)
                if body:
                    tally.add(self._walk(body.group(1), mult * (int(trip.group(1)) if trip else 1)))
            elif op.opcode == "conditional":
                names = re.findall(r"(?:true_computation|false_computation)=%([\w.\-]+)", op.attrs)
                branches = re.search(r"branch_computations=\{([^}]*)\}", op.attrs)
                names += re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
                tally.add(max((self._walk(n, mult) for n in names), key=lambda t: t.written))
            elif op.opcode in ("call", "async-start"):
                callee = re.search(r"(?:calls|to_apply)=%([\w.\-]+)", op.attrs)
                if callee:
                    tally.add(self._walk(callee.group(1), mult))
            elif kind in _COLLECTIVES:
                self._collective(tally, op, ops, mult)
            elif op.opcode == "fusion":
                tally.written += mult * self._fusion_written(op)
            elif op.opcode == "custom-call":  # a library call's scratch space is not traffic
                tally.written += mult * sum(
                    _bytes(f"{dt}[{dims}]") for dt, dims in _ARRAY.findall(op.shape) if dt not in ("u8", "s8")
                )
            elif op.opcode not in _NO_TRAFFIC and not op.opcode.endswith("-done"):
                tally.written += mult * _bytes(op.shape)
        return tally

    def _fusion_written(self, op: _Op) -> int:
        """Bytes a fusion writes: its output, but only the update of an in-place (scatter) update."""
        callee = re.search(r"calls=%([\w.\-]+)", op.attrs)
        if not callee or callee.group(1) not in self.roots:
            return _bytes(op.shape)
        inner = self.comps[callee.group(1)]
        root = inner[self.roots[callee.group(1)]]
        outs = [inner[n] for n in root.operands] if root.opcode == "tuple" else [root]
        total = 0
        for out in outs:
            update = {"dynamic-update-slice": 1, "scatter": 2}.get(out.opcode)
            total += _bytes(inner[out.operands[update]].shape) if update else _bytes(out.shape)
        return total

    def _collective(self, tally: _Tally, op: _Op, ops: dict[str, _Op], mult: float) -> None:
        kind = op.opcode.removesuffix("-start")
        in_bytes = sum(_bytes(ops[n].shape) for n in op.operands if n in ops)
        out_bytes = _bytes(op.shape)
        if op.opcode.endswith("-start") and out_bytes > in_bytes and op.shape.startswith("(("):
            out_bytes -= in_bytes  # an async start's result holds its operands too
        size = max(in_bytes, out_bytes)
        groups = _groups(op.attrs, len(self.layout.hosts))
        group = groups[0]
        hosts = [self.layout.hosts[i] for i in group]
        n_hosts = len(set(hosts))
        per_host = len(group) // n_hosts
        if kind == "collective-permute":
            crosses = any(self.layout.hosts[a] != self.layout.hosts[b] for a, b in groups)
            nvlink, network = (0.0, size) if crosses else (size, 0.0)
            axis = self.layout.axis_of(sorted({d for pair in groups for d in pair}))
        else:
            crosses = n_hosts > 1
            ring = 2.0 if kind == "all-reduce" else 1.0
            if kind == "all-to-all":
                n = len(group)
                nvlink, network = (per_host - 1) / n * size, (n - per_host) / n * size
            else:
                nvlink = ring * (per_host - 1) / per_host * size
                network = ring * (n_hosts - 1) / n_hosts * size / per_host
            axis = self.layout.axis_of(group)
        c = tally.collectives.setdefault(
            (kind, axis, crosses),
            {"count": 0.0, "bytes": 0.0, "largest_bytes": 0.0, "nvlink_bytes": 0.0, "network_bytes": 0.0},
        )
        c["count"] += mult
        c["largest_bytes"] = max(c["largest_bytes"], size)
        c["bytes"] += mult * size
        c["nvlink_bytes"] += mult * nvlink
        c["network_bytes"] += mult * network


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


def analyze(train: Any, evaluate: Any | None, facts: Facts, compile_s: float) -> dict[str, Any]:
    """The plan of one compiled train step (+ eval step) on its target: memory, kernels, comms, bound."""
    hlo = train.as_text()
    mem = compiled_bytes(train)
    layout = _Placement(tuple(facts.mesh), tuple(facts.mesh.values()), facts.device_hosts)
    tally = _Walker(hlo, layout).tally()
    t = facts.target
    n_devices = len(facts.device_hosts)
    limit = int(t.memory_bytes * mem_fraction())
    eval_total = compiled_bytes(evaluate)["total_bytes"] if evaluate is not None else 0
    # Outputs (the new state, donated or not) are written, never read back within the step.
    hbm_bytes = 2 * tally.written - int(train.memory_analysis().output_size_in_bytes) + mem["argument_bytes"]
    collectives: list[dict[str, Any]] = [
        {"kind": k, "axis": a, "crosses_hosts": x, "count": int(round(c["count"])), "bytes": int(c["bytes"]),
         "largest_bytes": int(c["largest_bytes"]),
         "nvlink_bytes": int(c["nvlink_bytes"]), "network_bytes": int(c["network_bytes"])}
        for (k, a, x), c in sorted(tally.collectives.items())
    ]  # fmt: skip
    times = {
        "compute": facts.model_flops_per_step / n_devices / peak_flops(t, facts.dtype),
        "hbm": hbm_bytes / t.hbm_bytes_per_s,
        "nvlink": sum(c["nvlink_bytes"] for c in collectives) / t.nvlink_bytes_per_s,
        "network": sum(c["network_bytes"] for c in collectives) / t.network_bytes_per_s,
    }
    bound = max(times.values())
    return {
        "state_bytes_per_device": mem["argument_bytes"],
        "temp_bytes_per_device": mem["temp_bytes"],
        "total_bytes_per_device": mem["total_bytes"],
        "eval_total_bytes_per_device": eval_total,
        "device_memory_bytes": t.memory_bytes,
        "usable_bytes_per_device": limit,
        "fits": fits(max(mem["total_bytes"], eval_total), limit),
        "attention": attention_kernel(hlo),
        "collectives": collectives,
        "hbm_bytes_floor": int(hbm_bytes),
        "model_flops_per_step": facts.model_flops_per_step,
        "bound_terms_s": times,
        "bound_limited_by": max(times, key=lambda k: times[k]),
        "step_time_lower_bound_s": bound,
        "mfu_ceiling": times["compute"] / bound,
        "compile_s": round(compile_s, 2),
    }


def nearest_fits(
    candidates: list[dict[str, Any]], compile_with: Callable[[dict[str, Any]], Any], limit: int, tries: int
) -> list[dict[str, Any]]:
    """The first settings (in the order given, nearest first) whose compiled step fits `limit` bytes.

    compile_with(overrides) compiles the step with those config overrides; one that raises (a
    setting the config rejects) is passed over. At most `tries` compiles.
    """
    found: list[dict[str, Any]] = []
    for overrides in candidates[:tries]:
        t0 = time.perf_counter()
        try:
            total = compiled_bytes(compile_with(overrides))["total_bytes"]
        except UserError:  # a setting the config rejects is not a candidate
            continue
        if fits(total, limit):
            found.append({"overrides": overrides, "total_bytes_per_device": total,
                          "compile_s": round(time.perf_counter() - t0, 2)})  # fmt: skip
            if len(found) == 2:
                break
    return found
