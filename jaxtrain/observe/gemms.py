"""The GEMMs of a compiled program, by kind, read from its text (`Compiled.as_text()`): cuBLASLt's
FP8 GEMM, other cuBLAS GEMMs (bf16), XLA's own (Triton GEMM fusions, plain dots); and the check an
FP8 job's train step must pass where it starts (run/build.py `compile_train`), which the plan
prints too (plan/planner.py).

    found = census(compiled.as_text())
    summary(counts(found))                # "15 FP8, 3 other cuBLAS, 0 XLA's own ...; all 15 ..."
    refusal(found, "gpu")                 # None, or one line: projections that did not become FP8

A projection model.matmul fp8 asked for in FP8 carries model/fp8.py's SCOPE in its op name, forward
and backward. On GPUs each must become an FP8 GEMM (cuBLASLt's, or a GEMM fusion fed FP8 operands),
else it multiplies in bf16 at bf16's speed: XLA's GEMM rewriter folds the dequantize into the GEMM
only under xla_env.FP8_OPTIONS. XLA:CPU has no FP8 GEMM at all: its dots multiply the FP8-rounded
operands converted back (the same roundings, emulated), so a CPU program is never refused.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from jaxtrain.model.fp8 import SCOPE

FP8_GEMM = "__cublas$lt$matmul$f8"  # cuBLASLt's FP8 GEMM, as XLA's GEMM rewriter calls it
FP8_TYPES = ("f8e4m3fn", "f8e5m2")
_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \(?([a-z][a-z0-9]*)\[")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_TARGET = re.compile(r'custom_call_target="(__cublas[^"]*)"')
_GEMM_FUSION = re.compile(r'"kind":"(__triton[a-z_]*gemm[a-z_]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_OPERANDS = re.compile(r" (?:dot|custom-call|fusion)\(([^)]*)\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ASKED = re.compile(rf"[/(]{SCOPE}[/)]")  # the scope as a path's part, or inside a transform's name


@dataclass(frozen=True)
class Gemm:
    """One GEMM instruction of a program (a loop's body counted once)."""

    kind: str  # its custom call's target, its GEMM fusion's kind, or "dot"
    fp8: bool  # on FP8 tensor cores: cuBLASLt's FP8 GEMM, or FP8 operands
    asked_fp8: bool  # a product model/fp8.py rounds to FP8 (SCOPE in its op name)
    op_name: str


def census(text: str) -> list[Gemm]:
    """Every GEMM of a compiled program's text: cuBLAS calls, GEMM fusions, and the dots outside them."""
    types: dict[str, str] = {}
    where: dict[str, str] = {}  # an op's name -> its computation
    lines: list[tuple[str, str, str]] = []  # (computation, op name, line)
    current = ""
    for line in text.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            header = _HEADER.match(line)
            current = header.group(1) if header else current
            continue
        op = _OP.match(line)
        if op:
            types[op.group(1)], where[op.group(1)] = op.group(2), current
            lines.append((current, op.group(1), line))
    fused = {m.group(1) for _, _, line in lines if _GEMM_FUSION.search(line) and (m := _CALLS.search(line))}
    fp8_dots = {c for c, _, line in lines if " dot(" in line and _fed_fp8(line, types)}
    found = []
    for comp, _, line in lines:
        name = _OP_NAME.search(line)
        op_name = name.group(1) if name else ""
        if (target := _TARGET.search(line)) and " custom-call(" in line:
            kind, fp8 = target.group(1), target.group(1) == FP8_GEMM or _fed_fp8(line, types)
        elif (fusion := _GEMM_FUSION.search(line)) and (callee := _CALLS.search(line)):
            kind, fp8 = fusion.group(1), callee.group(1) in fp8_dots
        elif " dot(" in line and comp not in fused:
            kind, fp8 = "dot", _fed_fp8(line, types)
        else:
            continue
        found.append(Gemm(kind, fp8, bool(_ASKED.search(op_name)), op_name))
    return found


def _fed_fp8(line: str, types: dict[str, str]) -> bool:
    """Whether the op on `line` takes an FP8 operand first (a GEMM's lhs)."""
    args = _OPERANDS.search(line)
    first = re.findall(r"%([\w.\-]+)", args.group(1))[:1] if args else []
    return bool(first) and types.get(first[0], "").startswith(FP8_TYPES)


def counts(found: list[Gemm]) -> dict[str, int]:
    """How many GEMMs of each kind: FP8 cuBLASLt (`fp8`: any FP8 GEMM), other cuBLAS, other (XLA's
    own dots and GEMM fusions); `asked_fp8`: those model/fp8.py rounds to FP8, `not_fp8`: of them,
    those that compiled to another GEMM."""
    asked = [g for g in found if g.asked_fp8]
    return {
        "fp8": sum(g.fp8 for g in found),
        "cublas": sum(not g.fp8 and g.kind.startswith("__cublas") for g in found),
        "other": sum(not g.fp8 and not g.kind.startswith("__cublas") for g in found),
        "asked_fp8": len(asked),
        "not_fp8": sum(not g.fp8 for g in asked),
    }


def summary(c: dict[str, int], platform: str = "gpu") -> str:
    """`counts` in words: '15 FP8, 3 other cuBLAS, 0 XLA's own ...; all of the 15 rounded to FP8 are
    FP8 GEMMs'; off GPUs, that those multiply in XLA's dots (the emulation: no FP8 GEMM there)."""
    line = f"{c['fp8']} FP8, {c['cublas']} other cuBLAS, {c['other']} XLA's own (dots, GEMM fusions)"
    line += " in the program (a loop's body once)"
    if c["asked_fp8"] and platform != "gpu":
        line += f"; the {c['asked_fp8']} rounded to FP8 are XLA's dots (no FP8 GEMM on {platform}: emulated)"
    elif c["asked_fp8"]:
        fp8 = c["asked_fp8"] - c["not_fp8"]
        line += f"; {'all' if not c['not_fp8'] else fp8} of the {c['asked_fp8']} rounded to FP8 are FP8 GEMMs"
    return line


def refusal(found: list[Gemm], platform: str) -> str | None:
    """One line where a GPU program's FP8 products compiled to other GEMMs (how many, which kinds, the
    first one's op name); None where they all became FP8 GEMMs, or on CPUs (no FP8 GEMM there: their
    dots multiply the rounded operands, the emulation jaxtrain runs on CPUs)."""
    if platform != "gpu":
        return None
    missed = [g for g in found if g.asked_fp8 and not g.fp8]
    if not missed:
        return None
    asked = sum(g.asked_fp8 for g in found)
    kinds = ", ".join(f"{n} {k}" for k, n in Counter(g.kind for g in missed).most_common())
    return (
        f"model.matmul fp8: {len(missed)} of the train step's {asked} FP8 GEMMs compiled to other GEMMs "
        f"({kinds}; the first: {missed[0].op_name}), which multiply in bf16 at bf16's speed; XLA folds "
        "FP8 GEMMs only under jaxtrain's FP8 options (xla_env.FP8_OPTIONS): use --model.matmul compute "
        "--model.head_matmul compute, or report it"
    )
