"""Reading XLA's compiled HLO text: ops and computations, array bytes, a collective's replica
groups and the bytes it sends inside a host and across hosts, a matmul's or fused attention's FLOPs.

The text is what `jax.stages.Compiled.as_text()` prints for the GPU target (scripts/plan.py);
compiled.py tallies a whole step with it, schedule.py replays the step's schedule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from jaxtrain.observe.gemms import FP8_GEMM

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1,
}  # fmt: skip
ARRAY = re.compile(r"([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
FP8_DTYPES = ("f8e4m3fn", "f8e5m2")  # the operands of an FP8 GEMM on Hopper
# model/grouped.py's FLOPS_SCOPE and FP8_FLOPS_SCOPE: a scope in the op's op_name naming the kernel's
# routed FLOPs, and (fp8_) whether it multiplies on FP8 tensor cores.
GROUPED_FLOPS = re.compile(r"grouped_matmul_(fp8_)?flops_(\d+)")
COLLECTIVES = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
)  # fmt: skip
# Ops that move no bytes of their own, or whose bytes other terms count (collectives, loops).
NO_TRAFFIC = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "iota", "async-start", "async-done", "async-update",
    "copy-start", "copy-done", "send", "send-done", "recv", "recv-done", "add-dependency", "opt-barrier",
}  # fmt: skip


def nbytes(shape: str) -> int:
    return sum(
        DTYPE_BYTES.get(dt, 1) * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in ARRAY.findall(shape)
    )


@dataclass
class Op:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text inside the op's parentheses: a constant's value


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def parse_op(line: str) -> Op | None:
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
    return Op(m.group(1), shape, opcode, operands, rest[close:], rest[paren + 1 : close - 1])


def parse_hlo(hlo: str) -> tuple[dict[str, dict[str, Op]], dict[str, str], str]:
    """Computations of an HLO module's text: ops by name (in order), each one's root, the entry's name."""
    comps: dict[str, dict[str, Op]] = {}
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
        op = parse_op(line) if current else None
        if op:
            comps[current][op.name] = op
            if line.lstrip().startswith("ROOT "):
                roots[current] = op.name
    return comps, roots, entry


def groups(attrs: str, n_devices: int) -> list[list[int]]:
    """Replica groups (partition ids) of a collective: explicit lists, the iota form, or the mesh
    form (`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`: partitions laid out row-major on that mesh,
    a group for each point of the axes not named)."""
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if named:
        axes = [(a, int(n)) for a, n in re.findall(r"'([\w.]+)'=(\d+)", named.group(1))]
        grouped = re.findall(r"'([\w.]+)'", named.group(2))
        ids = np.arange(math.prod(n for _, n in axes)).reshape([n for _, n in axes])
        inner = [i for i, (a, _) in enumerate(axes) if a in grouped]
        outer = [i for i in range(len(axes)) if i not in inner]
        size = math.prod(axes[i][1] for i in inner)
        return ids.transpose(outer + inner).reshape(-1, size).tolist()
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
class Placement:
    """Where partition i sits: its mesh coordinates and its host."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    hosts: list[int]

    def axis_of(self, group: list[int]) -> str:
        coords = np.array(np.unravel_index(group, self.shape)).T
        varying = [a for i, a in enumerate(self.axes) if len(set(coords[:, i])) > 1]
        return "+".join(varying) or "-"


@dataclass(frozen=True)
class Transfer:
    """What one collective moves, per device: its buffer (a ragged all-to-all's: the rows it
    routes, `routed`), and an ideal ring's bytes sent over NVLink (inside a host) and over the
    network (to other hosts, every GPU's NIC in use)."""

    kind: str
    axis: str
    crosses_hosts: bool
    size: int
    nvlink: float
    network: float


def routed(op: Op, ops: dict[str, Op]) -> int:
    """The bytes a ragged all-to-all sends per device, assumed: the smaller of its input and output
    buffers (operands 0 and 1), in even shares to the peers of its group. Its sizes are known only
    when it runs; in the expert exchange (model/moe.py) the input holds a device's routed copies and
    the output a bound on what it receives (there, and the reverse back), and an even router sends
    every device as many copies as it sends. So for an even router this is exact; an uneven one
    moves more into some devices (at most their output buffers) and less into others."""
    arrays = [nbytes(ops[n].shape) for n in op.operands[:2] if n in ops]
    if len(arrays) < 2:  # an async start's result opens with its operands: (input, output, ...)
        arrays = [nbytes(f"{t}[{d}]") for t, d in ARRAY.findall(op.shape)[:2]]
    return min(arrays)


def transfer(op: Op, ops: dict[str, Op], layout: Placement) -> Transfer:
    """The bytes collective `op` (sync or an async start) moves, and over which mesh axes."""
    kind = op.opcode.removesuffix("-start")
    in_bytes = sum(nbytes(ops[n].shape) for n in op.operands if n in ops)
    out_bytes = nbytes(op.shape)
    if op.opcode.endswith("-start") and len(ARRAY.findall(op.shape)) > len(op.operands):
        # An async start's result holds its operands first (then its results, and a permute's
        # u32 contexts), one operand or a tuple of them; an all-reduce-start's holds its results only.
        out_bytes -= in_bytes
    size = routed(op, ops) if kind == "ragged-all-to-all" else max(in_bytes, out_bytes)
    all_groups = groups(op.attrs, len(layout.hosts))
    group = all_groups[0]
    hosts = [layout.hosts[i] for i in group]
    n_hosts = len(set(hosts))
    per_host = len(group) // n_hosts
    if kind == "collective-permute":
        crosses = any(layout.hosts[a] != layout.hosts[b] for a, b in all_groups)
        nvlink, network = (0.0, float(size)) if crosses else (float(size), 0.0)
        axis = layout.axis_of(sorted({d for pair in all_groups for d in pair}))
    else:
        crosses = n_hosts > 1
        ring = 2.0 if kind == "all-reduce" else 1.0
        if kind in ("all-to-all", "ragged-all-to-all"):
            n = len(group)
            nvlink, network = (per_host - 1) / n * size, (n - per_host) / n * size
        else:
            nvlink = ring * (per_host - 1) / per_host * size
            network = ring * (n_hosts - 1) / n_hosts * size / per_host
        axis = layout.axis_of(group)
    return Transfer(kind, axis, crosses, size, nvlink, network)


def _dims(shape: str) -> list[int]:
    m = ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def flops(op: Op, comps: dict[str, dict[str, Op]], ops: dict[str, Op]) -> float:
    """The matmul FLOPs of one op: a dot, a fusion's dots (kCustom gemm fusions hold one), a cuBLAS
    call, cuDNN's fused attention (QK^T and PV: 4 x q elements x keys; its backward 2.5 times
    that; half of each when causal, as cuDNN skips the masked blocks), or the experts' grouped
    matmul kernel (a Mosaic GPU call: the FLOPs of the rows routed to it under an even load, which
    model/grouped.py names in its scope; the buffer's other rows it skips). Other ops: 0."""
    if op.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attrs)
        lhs = _dims(ops[op.operands[0]].shape) if op.operands and op.operands[0] in ops else []
        k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting and lhs else 1
        return 2.0 * math.prod(_dims(op.shape)) * k
    if op.opcode == "fusion":
        callee = re.search(r"calls=%([\w.\-]+)", op.attrs)
        inner = comps.get(callee.group(1), {}) if callee else {}
        return sum(flops(o, comps, inner) for o in inner.values() if o.opcode in ("dot", "fusion"))
    if op.opcode != "custom-call":
        return 0.0
    target = re.search(r'custom_call_target="([^"]+)"', op.attrs)
    name = target.group(1) if target else ""
    if name.startswith("__cudnn$fmha"):
        # operand_layout_constraints give q and k first, each [batch, seq, heads, head_dim].
        layouts = op.attrs.split("operand_layout_constraints=")[-1]
        shapes = [[int(d) for d in dims.split(",") if d] for _, dims in ARRAY.findall(layouts)[:2]]
        if len(shapes) < 2 or len(shapes[1]) < 2:
            return 0.0
        causal = 0.5 if re.search(r'"mask_type":\s*"CAUSAL"', op.attrs) else 1.0
        return 4.0 * math.prod(shapes[0]) * shapes[1][1] * causal * (2.5 if "Backward" in name else 1.0)
    if name == "mosaic_gpu_v2":
        routed = GROUPED_FLOPS.findall(op.attrs)
        return float(routed[-1][1]) if routed else 0.0
    if "gemm" in name or "matmul" in name:
        lhs_contracting = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', op.attrs)
        lhs = _dims(ops[op.operands[0]].shape) if op.operands and op.operands[0] in ops else []
        idx = [int(i) for i in re.findall(r"\d+", lhs_contracting.group(1))] if lhs_contracting else []
        out = _dims(op.shape)  # the first array: the product (a tuple's second is scratch space)
        return 2.0 * math.prod(out) * math.prod(lhs[i] for i in idx if i < len(lhs))
    return 0.0


def _fp8_operand(op: Op, ops: dict[str, Op]) -> bool:
    first = ops.get(op.operands[0]) if op.operands else None
    return first is not None and first.shape.startswith(FP8_DTYPES)


def fp8(op: Op, comps: dict[str, dict[str, Op]], ops: dict[str, Op]) -> bool:
    """Whether a matmul op runs on FP8 tensor cores: cuBLASLt's FP8 GEMM (FP8_GEMM), a dot whose
    operands are FP8, alone or in a GEMM fusion (XLA's Triton GEMM: what a compile without a GPU
    to autotune on picks, tests/test_plan.py), or the experts' grouped matmul kernel whose scope
    says fp8 (the same scope `flops` reads). The FLOPs are hlo.flops's either way."""
    if op.opcode == "dot":
        return _fp8_operand(op, ops)
    if op.opcode == "fusion":
        callee = re.search(r"calls=%([\w.\-]+)", op.attrs)
        inner = comps.get(callee.group(1), {}) if callee else {}
        return any(fp8(o, comps, inner) for o in inner.values() if o.opcode in ("dot", "fusion"))
    if op.opcode != "custom-call":
        return False
    target = re.search(r'custom_call_target="([^"]+)"', op.attrs)
    name = target.group(1) if target else ""
    if name == "mosaic_gpu_v2":
        scopes = GROUPED_FLOPS.findall(op.attrs)
        return bool(scopes) and scopes[-1][0] == "fp8_"
    return name == FP8_GEMM or (("gemm" in name or "matmul" in name) and _fp8_operand(op, ops))


class Program:
    """A compiled module's text, parsed: its computations, and what each op runs or writes."""

    def __init__(self, text: str) -> None:
        self.comps, self.roots, self.entry = parse_hlo(text)

    def trip_count(self, op: Op, ops: dict[str, Op]) -> int:
        """How often a while loop runs its body: XLA's known_trip_count, else read from the loop
        itself (`i < N` in its condition, i starting at a constant: the microbatch loop), else 1."""
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attrs)
        if trip:
            return int(trip.group(1))
        cond = re.search(r"condition=%([\w.\-]+)", op.attrs)
        bound = self._compared_constant(cond.group(1)) if cond else None
        if bound is None:
            return 1
        init = 0
        start = ops.get(op.operands[0]) if op.operands else None
        if start is not None and start.opcode == "tuple" and start.operands:
            first = ops.get(start.operands[0])
            while first is not None and first.opcode == "copy" and first.operands:
                first = ops.get(first.operands[0])
            if first is not None and first.opcode == "constant" and re.fullmatch(r"-?\d+", first.args):
                init = int(first.args)
        return max(1, bound - init)

    def _compared_constant(self, comp: str) -> int | None:
        """N in a loop condition `i < N` (directly or inside the fusion it calls)."""
        for op in self.comps.get(comp, {}).values():
            if op.opcode == "compare" and "direction=LT" in op.attrs:
                for name in op.operands:
                    const = self.comps[comp].get(name)
                    if const and const.opcode == "constant" and re.fullmatch(r"-?\d+", const.args):
                        return int(const.args)
            if op.opcode == "fusion" and (callee := self.callee(op)):
                found = self._compared_constant(callee)
                if found is not None:
                    return found
        return None

    def body(self, op: Op) -> str | None:
        m = re.search(r"body=%([\w.\-]+)", op.attrs)
        return m.group(1) if m else None

    def branches(self, op: Op) -> list[str]:
        names = re.findall(r"(?:true_computation|false_computation)=%([\w.\-]+)", op.attrs)
        listed = re.search(r"branch_computations=\{([^}]*)\}", op.attrs)
        return names + (re.findall(r"%([\w.\-]+)", listed.group(1)) if listed else [])

    def callee(self, op: Op) -> str | None:
        m = re.search(r"(?:calls|to_apply)=%([\w.\-]+)", op.attrs)
        return m.group(1) if m and m.group(1) in self.comps else None

    def written(self, op: Op) -> int:
        """Bytes a top-level op writes to memory: a fusion its output (only the update of an
        in-place update), a library call its results (not its scratch space), no bytes for ops
        that move none of their own (NO_TRAFFIC) or that other terms count (collectives)."""
        code = op.opcode
        if code in NO_TRAFFIC or code.endswith("-done") or code.removesuffix("-start") in COLLECTIVES:
            return 0
        if code == "custom-call":
            return sum(nbytes(f"{t}[{d}]") for t, d in ARRAY.findall(op.shape) if t not in ("u8", "s8"))
        callee = self.callee(op) if code == "fusion" else None
        if callee is None or callee not in self.roots:
            return nbytes(op.shape)
        inner = self.comps[callee]
        root = inner[self.roots[callee]]
        total = 0
        for out in [inner[n] for n in root.operands] if root.opcode == "tuple" else [root]:
            update = {"dynamic-update-slice": 1, "scatter": 2}.get(out.opcode)
            total += nbytes(inner[out.operands[update]].shape) if update else nbytes(out.shape)
        return total
