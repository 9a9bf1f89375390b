"""docs/scaling.md's plan tables, made from the committed plans (bench/results/plan_*.json, which
`tests/gpu_plans.py bench/results all` writes), so no figure in them is copied by hand.

    .venv/bin/python bench/scaling_tables.py     # rewrites each block between its two markers

A block is `<!-- plans:NAME -->` ... `<!-- /plans:NAME -->` in docs/scaling.md; tests/test_plan.py
checks that the committed blocks are what this makes of the committed JSON.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import calibration  # noqa: E402  (bench/ is no package: the published runs beside the forecast)

DOC = ROOT / "docs" / "scaling.md"
RESULTS = ROOT / "bench" / "results"

# The dense plans, in the table's order (the model column is the parameter count).
DENSE = [
    "gpt2_124m_h100x1", "gpt2_124m_h100x8_data8", "gpt2_124m_h100x8_fsdp8", "gpt2_124m_h100x8_zero1",
    "gpt2_124m_h100x8_fsdp4_tensor2", "gpt2_124m_h100x8_fsdp4_tensor2_fp16", "gpt2_124m_h100_2x8_data16",
    "gpt_1p5b_h100x8_fsdp8", "gpt_1p5b_h100_8x8_data8_fsdp8", "gpt_7b_h100x8_fsdp8",
    "gpt_7b_h100_8x8_data8_fsdp8", "llama3_8b_h100x8", "llama3_8b_h100_8x8", "llama3_8b_h100_8x8_fsdp16",
    "llama3_8b_h100_8x8_reduce_compute", "llama2_7b_h100x8_maxtext", "llama3_70b_h100_16x8_maxtext",
    "llama3_70b_h100_128x8",
    "gpt_70b_h100_128x8_data2_fsdp64_tensor8", "gpt_19b_h100x1", "llama3_8b_128k_h100_8x8",
    "llama3_70b_128k_h100_32x8", "llama3_8b_1m_h100_16x8", "llama3_405b_h100_256x8",
    "llama3_405b_h100_256x8_fsdp64", "llama3_405b_128l_h100_256x8_pipeline32",
    "llama3_405b_128l_h100_256x8_pipeline16_fsdp2",
    "llama3_70b_h100_128x8_pipeline8",
]  # fmt: skip
# The mixtures of experts, each with the words of its model column.
MOE = {
    "qwen3_30b_a3b_h100_4x8": "Qwen3-30B-A3B, as shipped (experts inside each host, grouped matmul `pallas`)",
    "qwen3_30b_a3b_h100_4x8_data4_zero1": "data across the hosts, ZeRO-1 (shipped before)",
    "qwen3_30b_a3b_h100_4x8_expert8_fsdp4": "experts spread over the 4 hosts (shipped before that)",
    "qwen3_30b_a3b_h100x8": "one host",
    "qwen3_30b_a3b_8l_h100x8": "Qwen3-30B-A3B, 8 of 48 layers (CI)",
    "mixtral_8x7b_h100_4x8": "Mixtral-8x7B, as shipped (grouped matmul `pallas`)",
    "mixtral_8x7b_h100_4x8_ragged_dot": "the same with `ragged_dot`",
    "mixtral_8x7b_h100_2x8": "2 hosts",
    "deepseek_v3_671b_h100_128x8": "DeepSeek-V3-671B, as configured",
    "moe_tiny_dropless_h100x8": "moe_tiny, dropless (CI)",
    "deepseek_tiny_heads192_h100x8": "DeepSeek-style tiny, query heads of 192: cuDNN attention (CI)",
}
DENSE_HEAD = (
    "| model | GPUs | mesh | batch / device x microbatches | total GB / GPU | fsdp GB gathered / "
    "reduce-scattered per GPU per step | sent GB NVLink / network | floor ms (limit), MFU ceiling | "
    "schedule-aware ms (exposed), MFU ceiling | plan |\n" + "| --- " * 10 + "|"
)
MOE_HEAD = (
    "| model | GPUs | mesh | batch / device x microbatches | total GB / GPU | all-to-all GB per GPU "
    "per step: NVLink / network | fsdp GB gathered / reduce-scattered | floor s (limit), MFU ceiling | "
    "schedule-aware s (exposed), MFU ceiling | plan |\n" + "| --- " * 10 + "|"
)


def _mesh(p: dict) -> str:
    axes = " x ".join(f"{a} {n}" for a, n in p["mesh"].items() if n > 1) or "1 GPU"
    inner = ", expert inside fsdp" if p.get("expert_inner") else ""
    return axes + (" + zero1" if p["zero1"] and p["mesh"]["data"] > 1 else "") + inner


def _moved(p: dict, kind: str, axis: str, key: str = "bytes") -> float:
    """GB a GPU moves a step in collectives of this kind over this axis (inside and across hosts)."""
    return sum(c[key] for c in p["collectives"] if c["kind"] == kind and c["axis"] == axis) / 1e9


def _size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _bounds(p: dict, unit: float, digits: int, pct: int) -> tuple[str, str]:
    """The floor (its limit) and the schedule-aware bound (what it leaves exposed), each with its
    MFU ceiling; times in 1 / unit seconds."""
    floor, sched, exposed = (
        p[k] * unit for k in ("step_time_lower_bound_s", "schedule_bound_s", "exposed_comm_s")
    )
    return (
        f"{floor:,.{digits}f} ({p['bound_limited_by']}), {100 * p['mfu_ceiling']:.{pct}f}%",
        f"{sched:,.{digits}f} ({exposed:,.{digits if unit == 1 else 0}f}), "
        f"{100 * p['schedule_mfu_ceiling']:.{pct}f}%",
    )


def dense_row(name: str, p: dict) -> str:
    where, plan = f"{p['hosts']} x {p['gpus_per_host']}", f"`plan_{name}.json`"
    if not p["compiled"]:
        state = f"state alone {p['state_bytes_per_device'] / 1e9:.0f}"
        return f"| {_size(p['n_params'])} | {where} | - | - | {state} | not compiled | - | - | - | {plan} |"
    fsdp = f"{_moved(p, 'all-gather', 'fsdp'):.2f} / {_moved(p, 'reduce-scatter', 'fsdp'):.2f}"
    nvlink, network = (sum(c[k] for c in p["collectives"]) / 1e9 for k in ("nvlink_bytes", "network_bytes"))
    cells = [_size(p["n_params"]), where, _mesh(p), f"{p['device_batch']} x {p['accumulation']}",
             f"{p['total_bytes_per_device'] / 1e9:.1f}", fsdp, f"{nvlink:,.1f} / {network:,.1f}",
             *_bounds(p, 1e3, 1, 0), plan]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def moe_row(name: str, label: str, p: dict) -> str:
    total = f"{p['total_bytes_per_device'] / 1e9:.1f}" + ("" if p["fits"] else ": does not fit")
    inside, across = (
        _moved(p, "all-to-all", "expert", k) + _moved(p, "ragged-all-to-all", "expert", k)
        for k in ("nvlink_bytes", "network_bytes")
    )
    gathered, scattered = _moved(p, "all-gather", "fsdp"), _moved(p, "reduce-scatter", "fsdp")
    fsdp = f"{gathered:,.1f} / {scattered:,.1f}" if p["mesh"]["fsdp"] > 1 else "-"
    where, batch = f"{p['hosts']} x {p['gpus_per_host']}", f"{p['device_batch']} x {p['accumulation']}"
    cells = [label, where, _mesh(p), batch, total, f"{inside:,.1f} / {across:,.1f}", fsdp,
             *_bounds(p, 1, 2, 1), f"`plan_{name}.json`"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def tables(results: Path = RESULTS) -> dict[str, str]:
    """Each block's table, from the plans in `results`."""

    def plan(name: str) -> dict:
        return json.loads((results / f"plan_{name}.json").read_text())

    return {
        "dense": "\n".join([DENSE_HEAD, *(dense_row(n, plan(n)) for n in DENSE)]),
        "moe": "\n".join([MOE_HEAD, *(moe_row(n, label, plan(n)) for n, label in MOE.items())]),
        "calibration": calibration.table(),
    }


def render(doc: str, made: dict[str, str]) -> str:
    """`doc` with each marked block replaced by its table; a marker missing is an error."""
    for name, table in made.items():
        block = re.compile(rf"(<!-- plans:{name} [^\n]*-->\n).*?(\n<!-- /plans:{name} -->)", re.S)
        if not block.search(doc):
            raise SystemExit(f"{DOC}: no block <!-- plans:{name} ... --> ... <!-- /plans:{name} -->")
        doc = block.sub(lambda m, table=table: m.group(1) + table + m.group(2), doc)
    return doc


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text(), tables(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS)))
