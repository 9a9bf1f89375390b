"""The plan tables of docs/scaling.md and docs/moe.md, made from the committed plans
(bench/results/plan_*.json, which `tests/gpu_plans.py bench/results all` writes), so no planned
figure in them is copied by hand.

    .venv/bin/python bench/scaling_tables.py     # rewrites each block between its two markers

A block is `<!-- plans:NAME ... -->` ... `<!-- /plans:NAME -->`; BLOCKS names each page's blocks.
tests/test_plan.py checks that the committed blocks are what this makes of the committed JSON.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import calibration  # noqa: E402  (bench/ is no package: the published runs beside the forecast)
import peers  # noqa: E402  (the peers' published H100 runs beside jaxtrain's forecast)

DOC = ROOT / "docs" / "scaling.md"
MOE_DOC = ROOT / "docs" / "moe.md"
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
    "llama3_70b_128k_h100_32x8", "llama3_8b_1m_h100_16x8", "llama3_8b_1m_h100_16x8_context8",
    "llama3_405b_h100_256x8",
    "llama3_405b_h100_256x8_fsdp64", "llama3_405b_128l_h100_256x8_pipeline32",
    "llama3_405b_128l_h100_256x8_pipeline16_fsdp2",
    "llama3_70b_h100_128x8_pipeline8",
    # at the fastest published H100 run's GPUs and batch (bench/peers.py)
    "llama3_8b_h100x8_gbs128", "llama3_70b_h100_8x8_gbs256", "llama3_405b_h100_128x8_gbs1536",
    # FP8 GEMMs (issue 48, docs/fp8.md): MFU against FP8's peak
    "llama3_8b_h100x8_fp8", "llama3_70b_h100_16x8_maxtext_fp8", "llama3_70b_h100_128x8_fp8",
    "llama3_405b_h100_256x8_fp8",
    # documents masked (issue 46 item 2)
    "llama3_8b_128k_docs_h100_8x8", "llama3_8b_1m_docs_h100_16x8", "llama3_8b_1m_docs_h100_16x8_context8",
    # the jobs jaxtrain measured on one H200 (bench/calibration.py MEASURED_HERE)
    "gpt2_124m_h200x1_bench", "gpt2_350m_h200x1_bench", "gpt_1b_h200x1_bench", "gpt_1b_fp8_h200x1_bench",
]  # fmt: skip
# The mixtures of experts, each with the words of its model column.
MOE = {
    "qwen3_30b_a3b_h100_4x8": "Qwen3-30B-A3B, as shipped (experts inside each host, grouped matmul `pallas`)",
    "qwen3_30b_a3b_h100_4x8_fp8": "the same, model.matmul fp8, experts bf16 (`pallas` named)",
    "qwen3_30b_a3b_h100_4x8_fp8_experts": "the same, experts FP8 too (`pallas_fp8`: auto's pick)",
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
    "qwen3_30b_a3b_h100_2x8_gbs1024": "Qwen3-30B-A3B at Megatron-Bridge's 16 GPUs and batch (bench/peers.py)",
    "deepseek_v3_671b_h100_128x8_gbs8192": "DeepSeek-V3-671B at its peers' 1,024 GPUs and 8,192 x 4,096",
}
# The pipelined plans, with the no-pipeline layouts beside them.
PIPELINE = {
    "llama3_405b_h100_256x8": "Llama 3 405B as shipped: pipeline 32 x tensor 8 x data 8 + ZeRO-1, 126 layers "
    "(4 a stage, the last stage's 2 padding)",
    "llama3_405b_128l_h100_256x8_pipeline32": "the same at 128 layers",
    "llama3_405b_128l_h100_256x8_pipeline16_fsdp2": "pipeline 16 x tensor 8 x fsdp 2 x data 8 + ZeRO-1, "
    "128 layers",
    "llama3_405b_h100_256x8_fsdp64": "tensor 8 x fsdp 64 x data 4, no pipeline (shipped before)",
    "llama3_70b_h100_128x8_pipeline8": "Llama 3 70B on 128 x 8: pipeline 8 x tensor 8 x data 16 + ZeRO-1",
    "llama3_70b_h100_128x8": "Llama 3 70B as shipped, no pipeline: tensor 2 x fsdp 16 x data 32",
}
# Runs published by their authors (measured on H100s, not by us): job, what they published, and
# the plan of the same job with the words before its figures (None: not planned).
PUBLISHED = [
    ("Llama 3 70B, 16 x 8 H100, global batch 256 x 8192 (NVIDIA's MaxText DGX Cloud recipe)",
     "15.57 s per step, 506.6 TFLOP/s per GPU, 51% MFU", "llama3_70b_h100_16x8_maxtext", "fsdp 128"),
    ("Llama 2 70B, 8 x 8 H100, 128 x 4096 (same recipes)", "7.91 s, 460 TFLOP/s per GPU", None, ""),
    ("Llama 3 405B, 8,192-16,384 H100 (tensor 8, pipeline 16, fsdp, context parallel)", "38-43% MFU",
     "llama3_405b_h100_256x8",
     "2,048 H100, 16M-token batches, as shipped (pipeline 32 x tensor 8 x data 8 + ZeRO-1)"),
]  # fmt: skip
# Which blocks each page holds.
BLOCKS = {
    DOC: ["peers", "dense", "moe", "pipeline", "published", "calibration"],
    MOE_DOC: ["moe"],
}
PIPELINE_HEAD = (
    "| layout | GB / GPU | microbatches, bubble | floor s (limit) | schedule-aware s (ops + exposed), "
    "MFU ceiling | plan |\n" + "| --- " * 6 + "|"
)
PUBLISHED_HEAD = (
    "| job | published, measured on H100 | ours, compiled bounds (no GPU) |\n" + "| --- " * 3 + "|"
)
DENSE_HEAD = (
    "| model | GPUs | mesh | batch / device x microbatches | total GB / GPU | fsdp GB gathered / "
    "reduce-scattered per GPU per step | sent GB NVLink / network | floor ms (limit), MFU ceiling | "
    "schedule-aware ms (exposed), MFU ceiling | forecast ms, tokens/s/GPU, MFU | plan |\n"
    + "| --- " * 11
    + "|"
)
MOE_HEAD = (
    "| model | GPUs | mesh | batch / device x microbatches | total GB / GPU | all-to-all GB per GPU "
    "per step: NVLink / network | fsdp GB gathered / reduce-scattered | floor s (limit), MFU ceiling | "
    "schedule-aware s (exposed), MFU ceiling | forecast s, tokens/s/GPU, MFU | plan |\n" + "| --- " * 11 + "|"
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


def _forecast(p: dict, unit: float, digits: int) -> str:
    """The forecast (plan/forecast.py): step time in 1 / unit seconds, tokens/s per GPU, MFU."""
    if "forecast" not in p:
        return "- (planned before the forecast)"
    f = p["forecast"]
    return (
        f"{f['step_time_s'] * unit:,.{digits}f}, {f['tokens_per_s_per_gpu']:,.0f}, "
        f"{100 * f['mfu']:.{1 if unit == 1 else 0}f}%"
    )


def dense_row(name: str, p: dict) -> str:
    where, plan = f"{p['hosts']} x {p['gpus_per_host']}", f"`plan_{name}.json`"
    if not p["compiled"]:
        state = f"state alone {p['state_bytes_per_device'] / 1e9:.0f}"
        return (
            f"| {_size(p['n_params'])} | {where} | - | - | {state} | not compiled | - | - | - | - | {plan} |"
        )
    fsdp = f"{_moved(p, 'all-gather', 'fsdp'):.2f} / {_moved(p, 'reduce-scatter', 'fsdp'):.2f}"
    nvlink, network = (sum(c[k] for c in p["collectives"]) / 1e9 for k in ("nvlink_bytes", "network_bytes"))
    cells = [_size(p["n_params"]), where, _mesh(p), f"{p['device_batch']} x {p['accumulation']}",
             f"{p['total_bytes_per_device'] / 1e9:.1f}", fsdp, f"{nvlink:,.1f} / {network:,.1f}",
             *_bounds(p, 1e3, 1, 0), _forecast(p, 1e3, 1), plan]  # fmt: skip
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
             *_bounds(p, 1, 2, 1), _forecast(p, 1, 2), f"`plan_{name}.json`"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def pipeline_row(name: str, label: str, p: dict) -> str:
    stages, micro = p["mesh"].get("pipeline", 1), p["accumulation"]
    bubble = f"{100 * (stages - 1) / (micro + stages - 1):.1f}%" if stages > 1 else "-"
    total = f"{p['total_bytes_per_device'] / 1e9:.1f}" + ("" if p["fits"] else ": does not fit")
    sched = (
        f"{p['schedule_bound_s']:.2f} ({p['schedule_busy_s']:.2f} + {p['exposed_comm_s']:.2f}), "
        f"{100 * p['schedule_mfu_ceiling']:.1f}%"
    )
    floor = f"{p['step_time_lower_bound_s']:.2f} ({p['bound_limited_by']})"
    return f"| {label} | {total} | {micro}, {bubble} | {floor} | {sched} | `plan_{name}.json` |"


def published_row(job: str, published: str, name: str | None, words: str, p: dict | None) -> str:
    if name is None or p is None:
        return f"| {job} | {published} | not planned |"
    fits = f"fits ({p['total_bytes_per_device'] / 1e9:.1f} GB)" if p["fits"] else "does not fit"
    ours = (
        f"{words}: {fits}; floor {p['step_time_lower_bound_s']:.2f} s ({p['bound_limited_by']}, "
        f"{100 * p['mfu_ceiling']:.0f}%); schedule-aware {p['schedule_bound_s']:.2f} s: "
        f"**{100 * p['schedule_mfu_ceiling']:.1f}%** (`plan_{name}.json`)"
    )
    return f"| {job} | {published} | {ours} |"


def tables(results: Path = RESULTS) -> dict[str, str]:
    """Each block's table, from the plans in `results`."""

    def plan(name: str) -> dict:
        return json.loads((results / f"plan_{name}.json").read_text())

    published = [published_row(job, pub, n, how, plan(n) if n else None) for job, pub, n, how in PUBLISHED]
    return {
        "peers": peers.table(results),
        "dense": "\n".join([DENSE_HEAD, *(dense_row(n, plan(n)) for n in DENSE)]),
        "moe": "\n".join([MOE_HEAD, *(moe_row(n, label, plan(n)) for n, label in MOE.items())]),
        "pipeline": "\n".join([PIPELINE_HEAD, *(pipeline_row(n, w, plan(n)) for n, w in PIPELINE.items())]),
        "published": "\n".join([PUBLISHED_HEAD, *published]),
        "calibration": calibration.table(calibration.leave_one_out()),
    }


def render(doc: str, made: dict[str, str], names: list[str] | None = None, page: Path = DOC) -> str:
    """`doc` with each named block (all of `made` unless named) replaced by its table; a marker
    missing is an error."""
    for name in names if names is not None else list(made):
        block = re.compile(rf"(<!-- plans:{name} [^\n]*-->\n).*?(\n<!-- /plans:{name} -->)", re.S)
        if not block.search(doc):
            raise SystemExit(f"{page}: no block <!-- plans:{name} ... --> ... <!-- /plans:{name} -->")
        doc = block.sub(lambda m, table=made[name]: m.group(1) + table + m.group(2), doc)
    return doc


if __name__ == "__main__":
    made = tables(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS)
    for page, names in BLOCKS.items():
        page.write_text(render(page.read_text(), made, names, page))
