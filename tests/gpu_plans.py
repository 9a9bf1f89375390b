"""Plans of the jobs CI compiles for GPUs (tests/test_gpu_compile.py), several in one process.

    .venv/bin/python tests/gpu_plans.py OUT_DIR [CASE ...]     # writes OUT_DIR/plan_<case>.json
    nice -n 15 .venv/bin/python tests/gpu_plans.py bench/results all    # every committed plan
    .venv/bin/python bench/scaling_tables.py                  # then docs/scaling.md's tables

Each plan is what `scripts/plan.py <flags> --json F` writes less its advice (planner.plan_one);
a SEARCHES case what `scripts/plan.py <flags> --search --json F` writes (search_<case>.json).
One process compiles them all, since starting jax with the CUDA plugin costs seconds each time.
bench/results/plan_*.json and search_*.json come from here (`all`: about 20 minutes here).
"""

import contextlib
import io
import json
import logging
import re
import sys
import time
from pathlib import Path

GPT2 = ["--config", "configs/gpt2_124m.yaml"]
# 6.6B: 32 layers of 4096, T 2048; 65B: 80 layers of 8192, T 4096. One sequence per batch shard,
# scanned layers (compile time flat in depth), full remat.
GPT_7B = [*GPT2, "--model.n_layer", "32", "--model.d_model", "4096", "--model.n_head", "32",
          "--model.seq_len", "2048", "--model.scan_layers", "true", "--model.remat", "full",
          "--device_batch_size", "1"]  # fmt: skip
GPT_70B = [*GPT2, "--model.n_layer", "80", "--model.d_model", "8192", "--model.n_head", "64",
           "--model.seq_len", "4096", "--model.scan_layers", "true", "--model.remat", "full",
           "--device_batch_size", "1"]  # fmt: skip
# GPT-2 XL's shape (1.56B): 48 layers of 1600, 25 heads of 64, T 1024; 8 sequences per device.
GPT_1P5B = [*GPT2, "--model.n_layer", "48", "--model.d_model", "1600", "--model.n_head", "25",
            "--model.scan_layers", "true", "--model.remat", "full", "--device_batch_size", "8"]  # fmt: skip
QWEN3_MOE = ["--config", "configs/qwen3_30b_a3b.yaml"]
# The ragged exchange named where a case checks its bytes: inside one host auto picks the padded one
# (observe/links.py pick_exchange: XLA's one-shot kernel is the slower there).
RAGGED = ["--model.moe.exchange", "ragged"]
FULL = ["--model.remat", "full"]
LAYERS_128 = ["--model.n_layer", "128", "--mesh.zero1", "true"]
# case -> (flags, target, hosts, gpus per host)
CASES = {
    "gpt2_124m_h100x8_data8": (GPT2, "h100", 1, 8),
    "gpt2_124m_h100x8_fsdp8": ([*GPT2, "--mesh.data", "1", "--mesh.fsdp", "8"], "h100", 1, 8),
    "gpt2_124m_h100x8_fsdp4_tensor2_fp16": (
        [*GPT2, "--mesh.fsdp", "4", "--mesh.tensor", "2", "--dtype", "float16"],
        "h100",
        1,
        8,
    ),  # fmt: skip
    "gpt2_124m_h100x8_zero1": ([*GPT2, "--mesh.zero1", "true"], "h100", 1, 8),
    "gpt2_124m_h100_2x8_data16": (GPT2, "h100", 2, 8),
    "gpt_7b_h100x8_fsdp8": ([*GPT_7B, "--total_batch_size", "16384", "--mesh.fsdp", "8"], "h100", 1, 8),
    # Llama-3-70B as shipped (4M-token batches) on 1,024 H100: tensor 2 inside a host, fsdp 16 and
    # data 32 across, one sequence per device in one microbatch (the layout `--search` ranks first).
    "llama3_70b_h100_128x8": (["--config", "configs/llama3_70b.yaml"], "h100", 128, 8),
    # 19.5B on one H100: its state alone does not fit, the verdict comes without a compile.
    "gpt_19b_h100x1": (
        [*GPT2, "--model.n_layer", "96", "--model.d_model", "4096", "--model.n_head", "32"],
        "h100",
        1,
        1,
    ),  # fmt: skip
    # Qwen3-30B-A3B's layers (128 experts, 8 per token, capacity_factor 1.25), 8 of its 48: the
    # experts over expert 8 inside one host, tokens exchanged by all-to-all (scanned layers: the
    # compile takes as long as the whole model's, which does not fit one host).
    "qwen3_30b_a3b_8l_h100x8": (
        # One sequence a microbatch in one piece, its logits whole (the config ships eight in 8
        # pieces, the head's in 8): CI's compile stays as short as it was (pieces:
        # deepseek_tiny_heads192_h100x8).
        [
            "--config",
            "configs/qwen3_30b_a3b.yaml",
            "--model.n_layer",
            "8",
            "--mesh.fsdp",
            "1",
            "--device_batch_size",
            "1",
            "--model.moe.chunks",
            "1",
            "--model.token_chunks",
            "1",
            *RAGGED,
            "--model.remat",
            "full",
        ],
        "h100",
        1,
        8,
    ),  # fmt: skip
    # moe_tiny dropless (capacity_factor 0) over expert 8: each device's receive buffer holds every
    # peer's copies, but the ragged exchange sends only the routed ones (a compile of seconds).
    "moe_tiny_dropless_h100x8": (
        ["--config", "configs/moe_tiny.yaml", "--mesh.expert", "8", "--dtype", "bfloat16", *RAGGED],
        "h100",
        1,
        8,
    ),
    # deepseek_tiny with DeepSeek-V3's head sizes (192 for queries and keys, 128 for values):
    # cuDNN's attention on Hopper, 2 microbatches summed in one gradient buffer (run/accumulate.py),
    # each MoE layer's tokens in 2 pieces (the job's compiles start collectives early: xla_env).
    "deepseek_tiny_heads192_h100x8": (
        [
            "--config",
            "configs/deepseek_tiny.yaml",
            "--mesh.expert",
            "8",
            "--dtype",
            "bfloat16",
            "--model.nope_head_dim",
            "128",
            "--model.rope_head_dim",
            "64",
            "--model.v_head_dim",
            "128",
            "--model.scan_layers",
            "true",
            "--model.remat",
            "full",
            "--gradient_accumulation_steps",
            "2",
            "--model.moe.chunks",
            "2",
            *RAGGED,
        ],
        "h100",
        1,
        8,
    ),  # fmt: skip
    # Not compiled in CI: one GPU, the bfloat16 twin of the fp16 tensor-parallel case, and the
    # shapes of docs/scaling.md.
    "gpt_70b_h100_128x8_data2_fsdp64_tensor8": (
        [
            *GPT_70B,
            "--total_batch_size",
            "524288",
            "--mesh.data",
            "2",
            "--mesh.fsdp",
            "64",
            "--mesh.tensor",
            "8",
        ],
        "h100",
        128,
        8,
    ),  # fmt: skip
    "gpt_1p5b_h100x8_fsdp8": ([*GPT_1P5B, "--total_batch_size", "524288", "--mesh.fsdp", "8"], "h100", 1, 8),
    "gpt_1p5b_h100_8x8_data8_fsdp8": (
        [*GPT_1P5B, "--total_batch_size", "524288", "--mesh.fsdp", "8"],
        "h100",
        8,
        8,
    ),  # fmt: skip
    "gpt_7b_h100_8x8_data8_fsdp8": (
        [*GPT_7B, "--total_batch_size", "131072", "--mesh.fsdp", "8"],
        "h100",
        8,
        8,
    ),  # fmt: skip
    # Issue 25's targets beside the published runs (docs/scaling.md): NVIDIA's MaxText job (Llama 3
    # 70B, 16 x 8 H100, global batch 256 x 8192, fsdp over all 128), llama3_8b as shipped.
    "llama3_70b_h100_16x8_maxtext": (
        [
            "--config",
            "configs/llama3_70b.yaml",
            "--total_batch_size",
            "2097152",
            "--mesh.fsdp",
            "128",
            "--mesh.tensor",
            "1",
            "--device_batch_size",
            "2",
        ],
        "h100",
        16,
        8,
    ),  # fmt: skip
    # NVIDIA's MaxText Llama 2 7B on 1 x 8 H100 (bench/calibration.py): fsdp 8, global batch 16 x 4096;
    # Llama 2's shape from llama3_8b's config (its remat, dots), no ZeRO-1 (one host).
    "llama2_7b_h100x8_maxtext": (
        [
            "--config",
            "configs/llama3_8b.yaml",
            "--model.vocab_size",
            "32000",
            "--model.seq_len",
            "4096",
            "--model.n_kv_head",
            "32",
            "--model.d_ff",
            "11008",
            "--model.rope_theta",
            "10000",
            "--total_batch_size",
            "65536",
            "--device_batch_size",
            "2",
            "--mesh.fsdp",
            "8",
            "--mesh.zero1",
            "false",
        ],
        "h100",
        1,
        8,
    ),  # fmt: skip
    "llama3_8b_h100x8": (["--config", "configs/llama3_8b.yaml"], "h100", 1, 8),
    "llama3_8b_h100_8x8": (["--config", "configs/llama3_8b.yaml"], "h100", 8, 8),
    "llama3_8b_h100_8x8_fsdp16": (["--config", "configs/llama3_8b.yaml", "--mesh.fsdp", "16"], "h100", 8, 8),
    # Issue 26's mixtures of experts (docs/scaling.md): as shipped, then the experts inside a host
    # (they do not fit), and the other grouped matmuls (blocks, XLA:GPU's ragged_dot) for Qwen3's
    # 16 experts a GPU and Mixtral's one.
    "qwen3_30b_a3b_h100_4x8": (QWEN3_MOE, "h100", 4, 8),
    "mixtral_8x7b_h100_4x8": (["--config", "configs/mixtral_8x7b.yaml", "--mesh.fsdp", "4"], "h100", 4, 8),
    "mixtral_8x7b_h100_4x8_ragged_dot": (
        [
            "--config",
            "configs/mixtral_8x7b.yaml",
            "--mesh.fsdp",
            "4",
            "--model.moe.grouped_matmul",
            "ragged_dot",
        ],
        "h100",
        4,
        8,
    ),
    # The layouts shipped before (full remat): experts spread over 4 hosts (expert 8 x fsdp 4 laid
    # as usual, fsdp inside), before the expert axis split the dense params; data 4 across the
    # hosts with ZeRO-1, before expert was laid inside fsdp. One host, full remat.
    "qwen3_30b_a3b_h100_4x8_expert8_fsdp4": (
        [*QWEN3_MOE, *FULL, "--mesh.expert_inner", "false"],
        "h100",
        4,
        8,
    ),
    "qwen3_30b_a3b_h100_4x8_data4_zero1": (
        [*QWEN3_MOE, *FULL, "--mesh.fsdp", "1", "--mesh.zero1", "true"],
        "h100",
        4,
        8,
    ),
    "qwen3_30b_a3b_h100x8": ([*QWEN3_MOE, *FULL, "--mesh.fsdp", "1"], "h100", 1, 8),
    "mixtral_8x7b_h100_2x8": (["--config", "configs/mixtral_8x7b.yaml", "--mesh.fsdp", "2"], "h100", 2, 8),
    "deepseek_v3_671b_h100_128x8": (["--config", "configs/deepseek_v3_671b.yaml"], "h100", 128, 8),
    # Megatron's rule (experts inside a host, pipeline stages across the hosts), for DeepSeek-V3:
    # 16 stages of 4 MoE layers (6 padding), its 3 dense layers on stage 0; ZeRO-1 over data 8.
    "deepseek_v3_671b_h100_128x8_pipeline16_expert8": (
        [
            "--config",
            "configs/deepseek_v3_671b.yaml",
            "--mesh.pipeline",
            "16",
            "--mesh.expert",
            "8",
            "--mesh.data",
            "8",
            "--mesh.fsdp",
            "1",
            "--mesh.zero1",
            "true",
            "--device_batch_size",
            "1",
        ],
        "h100",
        128,
        8,
    ),  # fmt: skip
    # The two-hop exchange (mesh.expert_node): expert 64 laid inside fsdp 16, so each expert group
    # is 8 hosts of 8, one of DeepSeek-V3's 8 routing groups on each: a token crosses to at most 4.
    "deepseek_v3_671b_h100_128x8_expert64_node8": (
        [
            "--config",
            "configs/deepseek_v3_671b.yaml",
            "--mesh.expert",
            "64",
            "--mesh.fsdp",
            "16",
            "--mesh.expert_inner",
            "true",
            "--mesh.expert_node",
            "8",
        ],
        "h100",
        128,
        8,
    ),  # fmt: skip
    # Each device's 2 sequences in 2 groups through every MoE block (model.moe.overlap_groups): one
    # group's exchange free to run beside the other's attention and experts.
    "deepseek_v3_671b_h100_128x8_overlap2": (
        ["--config", "configs/deepseek_v3_671b.yaml", "--model.moe.overlap_groups", "2"],
        "h100",
        128,
        8,
    ),
    # The same 8 exchange pieces a layer without the groups: what the groups' gain is made of.
    "deepseek_v3_671b_h100_128x8_chunks8": (
        ["--config", "configs/deepseek_v3_671b.yaml", "--model.moe.chunks", "8"],
        "h100",
        128,
        8,
    ),
    # Qwen3-235B-A22B as shipped (issue 60): experts inside each host, fsdp 32 across the hosts.
    "qwen3_235b_a22b_h100_32x8": (["--config", "configs/qwen3_235b_a22b.yaml"], "h100", 32, 8),
    "llama3_8b_h100_8x8_reduce_compute": (
        ["--config", "configs/llama3_8b.yaml", "--mesh.reduce_dtype", "compute"],
        "h100",
        8,
        8,
    ),  # fmt: skip
    "gpt2_124m_h100x1": (GPT2, "h100", 1, 1),
    "gpt2_124m_h100x8_fsdp4_tensor2": ([*GPT2, "--mesh.fsdp", "4", "--mesh.tensor", "2"], "h100", 1, 8),
    # Issue 34's long windows: 131,072 tokens, each sequence split over a host (context 8).
    "llama3_8b_128k_h100_8x8": (["--config", "configs/llama3_8b_128k.yaml"], "h100", 8, 8),
    # A million tokens: context 16 x fsdp 8 (each sequence over two hosts), the head, loss and MLPs
    # over 16 pieces of the sequence; and context 8 inside a host x fsdp 16, shipped before.
    "llama3_8b_1m_h100_16x8": (["--config", "configs/llama3_8b_1m.yaml"], "h100", 16, 8),
    "llama3_8b_1m_h100_16x8_context8": (
        ["--config", "configs/llama3_8b_1m.yaml", "--mesh.context", "8", "--mesh.fsdp", "16"],
        "h100",
        16,
        8,
    ),
    # Issue 46: the same two with documents masked (cuDNN's packed documents, model/documents.py).
    "llama3_8b_128k_docs_h100_8x8": (
        ["--config", "configs/llama3_8b_128k.yaml", "--model.doc_eos", "128001"],
        "h100",
        8,
        8,
    ),
    "llama3_8b_1m_docs_h100_16x8": (
        ["--config", "configs/llama3_8b_1m.yaml", "--model.doc_eos", "128001"],
        "h100",
        16,
        8,
    ),
    # Context 8 inside a host x fsdp 16 (shipped before): with documents it does not fit.
    "llama3_8b_1m_docs_h100_16x8_context8": (
        [
            "--config",
            "configs/llama3_8b_1m.yaml",
            "--model.doc_eos",
            "128001",
            "--mesh.context",
            "8",
            "--mesh.fsdp",
            "16",
        ],
        "h100",
        16,
        8,
    ),  # fmt: skip
    "llama3_70b_128k_h100_32x8": (
        [
            "--config",
            "configs/llama3_70b.yaml",
            "--model.seq_len",
            "131072",
            "--mesh.tensor",
            "1",
            "--mesh.context",
            "8",
            "--mesh.fsdp",
            "32",
            "--mesh.data",
            "1",
        ],
        "h100",
        32,
        8,
    ),  # fmt: skip
    # Llama 3 405B on 2,048 H100 (issue 35): as shipped (pipeline 32 x tensor 8 x data 8 + ZeRO-1,
    # its 126 layers padded to 4 a stage); and at 128 layers (before padding was built, the two
    # layers more stood for it), parallel/pipeline.py's GPipe ticks. Issue 35's start: the last case.
    "llama3_405b_h100_256x8": (["--config", "configs/llama3_405b.yaml"], "h100", 256, 8),
    "llama3_405b_128l_h100_256x8_pipeline32": (
        ["--config", "configs/llama3_405b.yaml", *LAYERS_128, "--mesh.pipeline", "32", "--mesh.fsdp", "1"],
        "h100",
        256,
        8,
    ),  # fmt: skip
    "llama3_405b_128l_h100_256x8_pipeline16_fsdp2": (
        ["--config", "configs/llama3_405b.yaml", *LAYERS_128, "--mesh.pipeline", "16", "--mesh.fsdp", "2"],
        "h100",
        256,
        8,
    ),  # fmt: skip
    # Llama-3-70B on 1,024 H100 with a pipeline (stages of 10 layers, 32 microbatches): below as shipped.
    "llama3_70b_h100_128x8_pipeline8": (
        [
            "--config",
            "configs/llama3_70b.yaml",
            "--mesh.pipeline",
            "8",
            "--mesh.tensor",
            "8",
            "--mesh.fsdp",
            "1",
            "--mesh.zero1",
            "true",
        ],
        "h100",
        128,
        8,
    ),  # fmt: skip
    # Llama 3 405B as shipped before its pipeline (issue 35's start): tensor 8 x fsdp 64 x data 4,
    # 8 microbatches, each gathering every layer over the network.
    "llama3_405b_h100_256x8_fsdp64": (
        [
            "--config",
            "configs/llama3_405b.yaml",
            "--mesh.pipeline",
            "1",
            "--mesh.fsdp",
            "64",
            "--mesh.zero1",
            "false",
        ],
        "h100",
        256,
        8,
    ),  # fmt: skip
}
# Issue 47's peers (bench/peers.py): each model at the GPU count and global batch of its fastest
# published H100 run, in the layout we ship.
PEER_CASES: dict[str, tuple[list[str], str, int, int]] = {
    "llama3_8b_h100x8_gbs128": (
        ["--config", "configs/llama3_8b.yaml", "--total_batch_size", "1048576"], "h100", 1, 8),
    # fsdp 32 x tensor 2 (data 1): as shipped (fsdp 16, data 2) the state takes 26 GB a GPU and the
    # step 75.2 GB, past an H100's 60.5 usable.
    "llama3_70b_h100_8x8_gbs256": (
        ["--config", "configs/llama3_70b.yaml", "--total_batch_size", "2097152", "--mesh.fsdp", "32"],
        "h100", 8, 8),
    "llama3_405b_h100_128x8_gbs1536": (
        ["--config", "configs/llama3_405b.yaml", "--total_batch_size", "12582912"], "h100", 128, 8),
    "qwen3_30b_a3b_h100_2x8_gbs1024": (
        [*QWEN3_MOE, *FULL, "--mesh.fsdp", "2", "--total_batch_size", "4194304"], "h100", 2, 8),
    "deepseek_v3_671b_h100_128x8_gbs8192": (
        ["--config", "configs/deepseek_v3_671b.yaml", "--total_batch_size", "33554432"], "h100", 128, 8),
}  # fmt: skip
CASES |= PEER_CASES
# What jaxtrain measured on one H200 (bench/bench_gpu.py, bench/calibration.py MEASURED_HERE): the
# forecast held against runs it was not made from. bench_gpu's shapes on gpt2_124m.yaml.
GPT_1B = [*GPT2, "--model.n_layer", "16", "--model.d_model", "2048", "--model.n_head", "16",
          "--total_batch_size", "65536"]  # fmt: skip
CASES |= {
    "gpt2_124m_h200x1_bench": (GPT2, "h200", 1, 1),
    "gpt2_350m_h200x1_bench": (
        [*GPT2, "--model.n_layer", "24", "--model.d_model", "1024", "--model.n_head", "16"], "h200", 1, 1),
    "gpt_1b_h200x1_bench": (GPT_1B, "h200", 1, 1),
    "gpt_1b_fp8_h200x1_bench": ([*GPT_1B, "--model.matmul", "fp8"], "h200", 1, 1),
}  # fmt: skip
CI_CASES = list(CASES)[:11]
# scripts/plan.py runs that do not fit, each suggestion they print then planned in turn
# (tests/test_gpu_compile.py: each must fit). Two layers of gpt2_124m at 128 sequences a device on
# 2 hosts of one L40S: the logits alone do not fit; fsdp spans the hosts (warned once).
ADVICE = {
    "gpt2_2l_l40s_2x1": [*GPT2, "--model.n_layer", "2", "--device_batch_size", "128", "--mesh.fsdp", "2",
                         "--target", "l40s", "--hosts", "2", "--gpus_per_host", "1"],
}  # fmt: skip
# case -> (flags, target, hosts, gpus per host, --search_budget): the plan and a --search's layouts.
SEARCHES = {"llama3_70b_h100_128x8": (["--config", "configs/llama3_70b.yaml"], "h100", 128, 8, 16)}


def _cases(names: list[str]) -> list[str]:
    """`all`: every committed plan, the ones that take longest to compile (experts) first."""
    if names != ["all"]:
        return names
    slow = [c for c in CASES if c.startswith(("mixtral", "qwen3", "deepseek"))]
    return slow + [c for c in CASES if c not in slow] + [f"search_{c}" for c in SEARCHES]


def _run(argv: list[str]) -> dict:
    """scripts/plan.py's main in this process: its exit code, what it printed and logged."""
    from jaxtrain.plan import cli

    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    logging.getLogger("jaxtrain").addHandler(handler)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = cli.main(argv, "")
    logging.getLogger("jaxtrain").removeHandler(handler)
    return {"argv": argv, "code": code, "stdout": out.getvalue(), "log": logs.getvalue()}


def advise(out_dir: Path, name: str) -> None:
    """advice_<name>.json: the run as given, then one run with each suggestion it printed."""
    first = _run(ADVICE[name])
    line = re.search(r"^fits with: (.*)$", first["stdout"], re.M)
    fixes = [re.sub(r" \([\d.]+ GB\)$", "", f) for f in line.group(1).split("; ")] if line else []
    followed = [_run(ADVICE[name] + fix.split()) for fix in fixes if fix.startswith("--")]
    (out_dir / f"advice_{name}.json").write_text(json.dumps({"first": first, "followed": followed}, indent=1))


def main(out_dir: Path, names: list[str]) -> None:
    from jaxtrain.plan import targets

    targets.use_plugin()
    from jaxtrain.config import load_config
    from jaxtrain.plan import cli, planner  # import jax, so after use_plugin

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _cases(names):
        if name in ADVICE:
            advise(out_dir, name)
            continue
        searched = name.removeprefix("search_")
        flags, target, hosts, gpus, *budget = SEARCHES[searched] if searched != name else CASES[name]
        t0 = time.perf_counter()
        where = ["--target", target, "--hosts", str(hosts), "--gpus_per_host", str(gpus)]
        if budget:
            where += ["--search", "--search_budget", str(budget[0])]
        cfg, where_ = load_config(flags), (targets.get(target), hosts, gpus)
        plan = cli.plan_job(cfg, *where_, budget[0]) if budget else planner.plan_one(cfg, *where_)
        plan["command"] = " ".join(["scripts/plan.py", *flags, *where])
        out = out_dir / f"{name if budget else 'plan_' + name}.json"
        out.write_text(json.dumps(plan, indent=1) + "\n")
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or [*CI_CASES, *ADVICE])
