"""Side by side with the peers (issue 47): published, measured tokens per second per GPU of the
trainers a user would otherwise pick, on H100s, for the models jaxtrain ships, and beside them
jaxtrain's forecast and bound (jaxtrain/plan/forecast.py) for the same model, GPU count and
global batch (tests/gpu_plans.py PEER_CASES writes the plans). Every peer figure below was read
from the page named beside it; a model with no published H100 run we could find has no peer row
(said in the table). Tokens per second per GPU, not MFU: peers count attention FLOPs differently.

    .venv/bin/python bench/peers.py           # prints the table (docs/scaling.md leads with it)
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

MB = "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary-archive.md"
NEMO = "https://github.com/NVIDIA/NeMo/blob/main/docs/source/performance/performance_summary.md"
AUTOMODEL = "https://github.com/NVIDIA-NeMo/Automodel/blob/main/docs/performance-summary.md"
TITAN = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
MAXTEXT = "https://docs.nvidia.com/jax-toolbox/frameworks/max-text/overview"
# torchtitan's runs: H100 SXM with 96 GB HBM2e at a 500 W power limit (its page says so), not 80 GB at 700 W.
TITAN_GPU = "H100 96 GB, 500 W"

# model, trainer (version), GPUs, global batch (sequences x tokens), layout, precision, tokens/s/GPU, source
PEERS: list[tuple[str, str, int, str, str, str, int, str]] = [
    ("Llama 3 8B", "Megatron-Bridge (NeMo 25.11)", 8, "128 x 8192", "FSDP 8, MBS 1, GA 16",
     "FP8 (current scaling)", 14451, MB),
    ("Llama 3 8B", "NeMo 24.07", 8, "128 x 8192", "CP 2, MBS 1", "FP8", 12036, NEMO),
    ("Llama 3 8B", f"torchtitan 9dec370 ({TITAN_GPU})", 8, "16 (window not stated)",
     "FSDP 8, torch.compile, selective AC", "BF16", 6667, TITAN),
    ("Llama 3 8B", f"torchtitan 9dec370 ({TITAN_GPU})", 8, "16 (window not stated)",
     "FSDP 8, torch.compile, selective AC", "FP8 linears", 8532, TITAN),
    ("Llama 3 70B", "Megatron-Bridge (NeMo 26.02)", 64, "256 x 8192", "TP 4, PP 8, VP 5, MBS 1", "FP8",
     1621, MB),
    ("Llama 3 70B", "NeMo 24.07", 64, "128 x 8192", "TP 4, PP 4, CP 2, VP 5", "FP8", 1533, NEMO),
    ("Llama 3 70B", "MaxText (NVIDIA JAX-Toolbox, DGX Cloud recipe)", 128, "256 x 8192", "FSDP 128", "BF16",
     round(256 * 8192 / 15.57 / 128), MAXTEXT),  # its 15.57 s a step (bench/calibration.py)
    ("Llama 3 70B", f"torchtitan 9dec370 ({TITAN_GPU})", 256, "512 (window not stated)",
     "FSDP 32 x TP 8, async TP, compile, full AC", "FP8 linears", 876, TITAN),
    ("Llama 3 405B", "Megatron-Bridge (NeMo 26.02)", 1024, "1536 x 8192", "TP 8, PP 8, CP 2, VP 8, MBS 1",
     "FP8", 311, MB),
    ("Llama 3 405B", f"torchtitan 9dec370 ({TITAN_GPU})", 512, "256 (window not stated)",
     "FSDP 8 x TP 8 x PP 8, interleaved 1F1B, async TP, full AC", "FP8 linears", 128, TITAN),
    ("Qwen3-30B-A3B", "Megatron-Bridge (NeMo 26.02)", 16, "1024 x 4096", "PP 2, VP 12, EP 8, MBS 1", "FP8",
     5113, MB),
    ("Qwen3-30B-A3B", "NeMo AutoModel (2025-10-02)", 8, "512 x 4096", "EP 8, FSDP 8, MBS 4, GA 16",
     "BF16, balanced routing forced", 12040, AUTOMODEL),
    # As issue 60 quotes Megatron-Bridge 26.04's performance summary (its batch not read here).
    ("Qwen3-235B-A22B", "Megatron-Bridge (26.04)", 256, "not read here", "TP 2 PP 8 EP 32", "BF16", 2132, MB),
    ("Qwen3-235B-A22B", "Megatron-Bridge (26.04)", 256, "not read here", "TP 2 PP 8 EP 32", "FP8", 1712, MB),
    ("DeepSeek-V3", "Megatron-Bridge (NeMo 25.09)", 1024, "8192 x 4096", "TP 2, PP 8, VP 4, EP 64, dropless",
     "not stated (its note on FP8 scaling granularity covers it)", 1297, MB),
    ("DeepSeek-V3", "NeMo AutoModel (2025-10-02)", 1024, "8192 x 4096", "PP 4, VP 8, EP 64, FSDP 256, GA 4",
     "BF16, balanced routing forced", 865, AUTOMODEL),
]  # fmt: skip
# Each model's jaxtrain plan at the GPU count and batch of its fastest peer above (tests/gpu_plans.py
# PEER_CASES), or, where that does not fit, the words saying so and the plan it was read from.
OURS = {
    "Llama 3 8B": "llama3_8b_h100x8_gbs128",
    "Llama 3 70B": "llama3_70b_h100_8x8_gbs256",
    "Llama 3 405B": "llama3_405b_h100_128x8_gbs1536",
    "Qwen3-30B-A3B": "qwen3_30b_a3b_h100_2x8_gbs1024",
    "Qwen3-235B-A22B": "qwen3_235b_a22b_h100_32x8",
    "DeepSeek-V3": "deepseek_v3_671b_h100_128x8_gbs8192",
    "Mixtral-8x7B": "mixtral_8x7b_h100_4x8",
}
NO_PEER = {
    "Mixtral-8x7B": "no published measured H100 pre-training run found (the NeMo tables read here have "
    "Mixtral on B200 and GB200 only)"
}
# Where jaxtrain's plan is not at the fastest peer's GPU count, why.
NOTE = {
    "Qwen3-30B-A3B": ", on Megatron-Bridge's 16 GPUs: on 8 it does not fit "
    "(`plan_qwen3_30b_a3b_h100x8.json`)",
    "Qwen3-235B-A22B": ", at the shipped config's 2,048 x 4,096 tokens a step (the peers' batch "
    "not read here)",
}
HEAD = (
    "| model | trainer (version) | H100s | global batch | layout | precision | tokens/s/GPU | source |\n"
    + "| --- " * 8
    + "|"
)


def _plan(name: str, results: Path) -> dict | None:
    path = results / f"plan_{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def ours(model: str, results: Path = RESULTS) -> str:
    """jaxtrain's row for `model`: its plan's forecast and bound, and the forecast over the best peer."""
    name = OURS[model]
    p = _plan(name, results)
    where = f"`plan_{name}.json`"
    if p is None:
        return f"| **{model}** | **jaxtrain** (not planned yet) | | | | | | {where} |"
    gpus, batch = p["hosts"] * p["gpus_per_host"], f"{p['global_batch']} x {p['seq_len']}"
    mesh = " x ".join(f"{a} {n}" for a, n in p["mesh"].items() if n > 1) + (
        " + zero1" if p["zero1"] and p["mesh"]["data"] > 1 else ""
    )
    if not p.get("fits") or "forecast" not in p:
        why = "does not fit" if not p.get("fits") else "planned before the forecast"
        return (
            f"| **{model}** | **jaxtrain**: {why} | {gpus} | {batch} | {mesh} | {p['dtype']} | - | {where} |"
        )
    likely, bound = p["forecast"]["tokens_per_s_per_gpu"], p["schedule_tokens_per_s_per_gpu"]
    best = max((row[6] for row in PEERS if row[0] == model), default=0)
    ratio = f"; **{likely / best:.2f}x** the best peer" if best else ""
    what = f"**jaxtrain forecast** (bound {bound:,.0f}){ratio}{NOTE.get(model, '')}"
    return (
        f"| **{model}** | {what} | {gpus} | {batch} | {mesh} | {p['dtype']} | **{likely:,.0f}** | {where} |"
    )


def table(results: Path = RESULTS) -> str:
    """The peers of each model, then jaxtrain's forecast for it, one table."""
    lines = [HEAD]
    for model in OURS:
        for m, trainer, gpus, batch, layout, precision, tokens, source in PEERS:
            if m == model:
                cells = [m, trainer, f"{gpus:,}", batch, layout, precision, f"{tokens:,}", source]
                lines.append("| " + " | ".join(cells) + " |")
        if model in NO_PEER:
            lines.append(f"| {model} | {NO_PEER[model]} | | | | | | |")
        lines.append(ours(model, results))
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
