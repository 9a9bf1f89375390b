"""The GPU program, compiled for real by XLA's GPU compiler for GPUs this machine does not have.

One subprocess (tests/gpu_plans.py) compiles every job with the CUDA plugin on its path: the
plugin never enters this pytest process, so the CPU tests never see it. `make test` installs the
plugin first (make gpu-plugin); without it these tests fail, naming the fix.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_plans import ADVICE, CI_CASES
from processes import clean_env

ROOT = Path(__file__).resolve().parent.parent
# The first test waits for every compile: minutes on a loaded 2-core machine (CI: 1,553-1,608 s of
# its niced wait beside the CPU suite, too near a 1,800 s limit; 4.6 min of CPU alone). A guard
# against a hang, not a speed rule: a fresh-clone .ci/run on a machine running at half its usual
# speed (user CPU 83 min where it was 43; the CPU suite 48.5 min) waited past 2,700 s, so 3,600 s,
# which keeps the whole run inside CI's 90 minutes there.
WAIT_S = 3600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(WAIT_S)]
H100 = "gpt2_124m_h100x8_"
MESHES = ["data8", "fsdp8", "fsdp4_tensor2_fp16", "zero1"]
# Bytes of gpt2_124m's largest parameter (the 50304 x 768 float32 embedding), one fsdp-8 shard of it.
LARGEST_PARAM = 50304 * 768 * 4
# The weight matrices of the ZeRO-1 jobs, whose step gathers them in bfloat16: GPT-2 124M's 12
# layers of 12 d^2 (attention 4 d^2, MLP 8 d^2).
ZERO1_WEIGHTS = {"gpt2_124m_h100x8_zero1": 12 * 12 * 768**2}
# tests/gpu_plans.py's mixture of experts: 8 layers of Qwen3-30B-A3B on one host of 8.
MOE = "qwen3_30b_a3b_8l_h100x8"
QWEN3_MOE = {"d_model": 2048, "n_layer": 8, "n_experts": 128, "k": 8, "d_expert": 768, "vocab": 151936}
# configs/moe_tiny.yaml, dropless over expert 8 (one expert a GPU).
TINY_MOE = {"d_model": 128, "n_layer": 4, "n_experts": 8, "k": 2, "d_expert": 176, "vocab": 256}
MOE_SHAPES = {MOE: QWEN3_MOE, "moe_tiny_dropless_h100x8": TINY_MOE}
# deepseek_tiny with DeepSeek-V3's head sizes: its dense first layer, shared expert and latent
# projections are outside `_exchange`'s count of gathered params, so only its exchange is counted
# (test_deepseek_layers_exchange_the_routed_rows).
HEADS_192 = "deepseek_tiny_heads192_h100x8"


@pytest.fixture(scope="module")
def plans_dir(tmp_path_factory):
    # JAXTRAIN_PLANS_DIR=bench/results keeps them (how bench/results/plan_*.json were made).
    out = Path(os.environ.get("JAXTRAIN_PLANS_DIR") or tmp_path_factory.mktemp("plans"))
    # In two processes, each compiling every other job: niced beside the CPU suite they take what
    # CPU it leaves, and both cores once it ends (in one process, the compiles ran on 1.5 min past
    # the suite's end in a fresh-clone .ci/run here).
    halves = [[*CI_CASES[0::2], *ADVICE], CI_CASES[1::2]]
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "gpu_plans.py"), str(out), *cases],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cases in halves
    ]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, stdout + stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def plans(plans_dir):
    return {c: json.loads((plans_dir / f"plan_{c}.json").read_text()) for c in CI_CASES}


@pytest.mark.parametrize("case", list(ADVICE))
def test_every_suggestion_the_planner_prints_plans_as_fitting(plans_dir, case):
    """scripts/plan.py on a job that does not fit, then on each suggestion it printed, flags as
    printed: each fits. The link inside an L40S host is PCIe, and the warning that fsdp spans
    hosts is logged once though the advice planned several layouts."""
    runs = json.loads((plans_dir / f"advice_{case}.json").read_text())
    first = runs["first"]
    assert first["code"] == 1 and ": DOES NOT FIT" in first["stdout"], first["stdout"]
    printed = [line for line in first["stdout"].splitlines() if line.startswith("fits with: ")]
    assert len(printed) == 1 and printed[0].startswith("fits with: --"), first["stdout"]
    assert len(runs["followed"]) == printed[0].count("; ") + 1
    for run in runs["followed"]:
        assert " ".join(run["argv"][-2:]) in printed[0]
        assert run["code"] == 0 and ": FITS" in run["stdout"], run["stdout"]
    assert first["log"].count("spans hosts") == 1, first["log"]
    assert "PCIe 0.0 ms" in first["stdout"] and "nvlink" not in first["stdout"].lower()


@pytest.mark.parametrize("case", [c for c in CI_CASES if c != "gpt_19b_h100x1"])
def test_the_schedule_aware_bound_is_never_below_the_floor(plans, case):
    """Both count causal attention at half (model.flops_per_token, hlo.flops): at a long window
    the replay once fell below the floor, its ceiling clamped to 100%."""
    p = plans[case]
    assert p["schedule_bound_s"] >= p["step_time_lower_bound_s"], p["bound_terms_s"]
    assert p["schedule_mfu_ceiling"] == pytest.approx(p["bound_terms_s"]["compute"] / p["schedule_bound_s"])


@pytest.mark.parametrize("mesh", MESHES)
def test_gpt2_124m_compiles_and_fits_8_h100(plans, mesh):
    p = plans[H100 + mesh]
    assert p["fits"], p
    assert 0 < p["temp_bytes_per_device"] and p["total_bytes_per_device"] <= p["usable_bytes_per_device"]
    assert p["global_batch"] == 512 and p["device_batch"] == 16
    assert 0 < p["mfu_ceiling"] <= 1 and p["step_time_lower_bound_s"] > 0
    assert p["dtype"] == ("float16" if mesh.endswith("fp16") else "bfloat16")
    assert all(not c["crosses_hosts"] for c in p["collectives"])


@pytest.mark.parametrize("case", [H100 + m for m in MESHES] + ["gpt2_124m_h100_2x8_data16", HEADS_192])
def test_attention_compiles_to_cudnn(plans, case):
    """auto picks cuDNN's fused attention on GPUs, and it compiles under every mesh (it once failed
    inside the step's partly manual shard_map), in bfloat16 and float16, and on Hopper with heads
    of 192 and values of 128 (DeepSeek-V3's: XLA's attention held 25 GB of its temporaries)."""
    assert plans[case]["attention"] == "cudnn"


def test_each_mesh_reduces_over_its_axes(plans):
    kinds = {m: {(c["kind"], c["axis"]) for c in plans[H100 + m]["collectives"]} for m in MESHES}
    assert ("all-reduce", "data") in kinds["data8"]
    assert {("all-gather", "fsdp"), ("reduce-scatter", "fsdp")} <= kinds["fsdp8"]
    assert any(axis == "tensor" for _, axis in kinds["fsdp4_tensor2_fp16"])
    # ZeRO-1 splits the moments: less state per device than plain data parallelism.
    zero1, data8 = plans[H100 + "zero1"], plans[H100 + "data8"]
    assert zero1["state_bytes_per_device"] < 0.5 * data8["state_bytes_per_device"]


def test_fsdp_never_all_reduces_more_than_one_shard(plans):
    fsdp = plans[H100 + "fsdp8"]
    largest = max((c["largest_bytes"] for c in fsdp["collectives"] if c["kind"] == "all-reduce"), default=0)
    assert largest <= LARGEST_PARAM // 8, fsdp["collectives"]
    # The check would catch the regression: data parallelism all-reduces whole gradients.
    data8 = plans[H100 + "data8"]["collectives"]
    assert max(c["largest_bytes"] for c in data8 if c["kind"] == "all-reduce") >= LARGEST_PARAM


def test_two_hosts_reduce_gradients_across_the_network(plans):
    p = plans["gpt2_124m_h100_2x8_data16"]
    assert p["fits"] and p["mesh"] == {"data": 16, "fsdp": 1, "tensor": 1} and p["accumulation"] == 2
    crossing = [c for c in p["collectives"] if c["crosses_hosts"]]
    assert crossing and all(c["axis"] == "data" and c["network_bytes"] > 0 for c in crossing)
    assert p["bound_terms_s"]["network"] > 0


def test_7b_fits_8_h100_with_fsdp(plans):
    p = plans["gpt_7b_h100x8_fsdp8"]
    assert 6e9 < p["n_params"] < 7e9 and p["mesh"]["fsdp"] == 8
    assert p["fits"], p


def test_llama3_70b_as_shipped_fits_1024_h100_at_full_speed(plans):
    p = plans["llama3_70b_h100_128x8"]
    assert 70e9 < p["n_params"] < 71e9 and p["hosts"] == 128 and p["accumulation"] == 1
    assert p["mesh"] == {"data": 32, "fsdp": 16, "tensor": 2} and p["device_batch"] == 1
    assert p["fits"], p
    assert any(c["crosses_hosts"] and c["axis"] == "fsdp" for c in p["collectives"])
    # Issue 25's targets: the floor is bound by the program's matmuls (full remat recomputes the
    # forward, about 6N / 8N: 79.5% as compiled, the head not recomputed), and the compiled order
    # replayed leaves the step compute-bound enough for a 60% ceiling, counting attention in full
    # as then: 56% with causal attention at half (6N + 6LdT over 6N + 12LdT is 0.933 here).
    assert p["mfu_ceiling"] >= 0.75, p["bound_terms_s"]
    assert 0.56 <= p["schedule_mfu_ceiling"] <= p["mfu_ceiling"], p["schedule_bound_s"]
    assert p["schedule_bound_s"] >= p["step_time_lower_bound_s"]


def test_moe_tokens_go_by_ragged_all_to_all_inside_the_host(plans):
    """The experts stay put and the tokens move: one ragged all-to-all per direction and pass,
    sending a device's routed copies (not a capacity-sized buffer for each peer), after two tiny
    int32 all-to-alls of their sizes; never an all-gather of tokens or of experts (the dense
    params are gathered over the expert axis, split over it as over fsdp), every byte inside the host."""
    p = plans[MOE]
    assert p["fits"] and p["mesh"] == {"data": 1, "expert": 8, "fsdp": 1, "tensor": 1}, p
    moved = {(c["kind"], c["axis"]): c for c in p["collectives"]}
    kinds = {("ragged-all-to-all", "expert"), ("all-to-all", "expert"), ("all-reduce", "expert")}
    kinds |= {("all-gather", "expert"), ("reduce-scatter", "expert")}
    assert set(moved) == kinds, p["collectives"]
    assert not any(c["crosses_hosts"] for c in p["collectives"])
    ragged, sizes = moved[("ragged-all-to-all", "expert")], moved[("all-to-all", "expert")]
    copies = p["device_batch"] * p["seq_len"] * QWEN3_MOE["k"]
    assert ragged["largest_bytes"] == copies * QWEN3_MOE["d_model"] * 2
    analytic = _exchange(QWEN3_MOE, p)
    assert ragged["bytes"] == analytic[("ragged-all-to-all", "expert")]
    assert sizes["bytes"] == analytic[("all-to-all", "expert")]
    # Named ragged (tests/gpu_plans.py): inside one host auto would take the padded one, faster there
    # as XLA runs the ragged one (observe/links.py), and the plan says so.
    assert p["forecast"]["exchange"]["compiled"] == "ragged" and p["forecast"]["exchange"]["auto"] == "padded"


def test_a_dropless_exchange_sends_the_routed_rows_not_its_receive_buffer(plans):
    """Dropless, a device's receive buffer holds every peer's copies (8 x its own), but each ragged
    all-to-all sends a device's copies once: the padded exchange sent 8 times the bytes."""
    p = plans["moe_tiny_dropless_h100x8"]
    ragged = [c for c in p["collectives"] if c["kind"] == "ragged-all-to-all"]
    copies = p["device_batch"] * p["seq_len"] * TINY_MOE["k"]
    assert [c["largest_bytes"] for c in ragged] == [copies * TINY_MOE["d_model"] * 2], p["collectives"]
    assert ragged[0]["bytes"] == _exchange(TINY_MOE, p)[("ragged-all-to-all", "expert")]


def test_deepseek_layers_exchange_the_routed_rows(plans):
    """DeepSeek's stacks (a dense layer, then MoE ones under one gradient buffer: run/accumulate.py)
    exchange exactly what `_exchange` counts for its 2 MoE layers: the routed copies there and back
    in the forward, and three more transfers of them in the backward (none in its recomputation),
    in 2 pieces (each its own sizes first)."""
    p = plans[HEADS_192]
    tiny = {"d_model": 64, "n_layer": 2, "n_experts": 8, "k": 2, "d_expert": 32, "vocab": 256, "pieces": 2}
    moved = {(c["kind"], c["axis"]): c["bytes"] for c in p["collectives"]}
    want = _exchange(tiny, p)
    for key in (("ragged-all-to-all", "expert"), ("all-to-all", "expert")):
        assert moved[key] == want[key], (key, p["collectives"])


def test_a_job_whose_state_cannot_fit_gets_its_verdict_without_a_compile(plans):
    p = plans["gpt_19b_h100x1"]
    assert not p["compiled"] and not p["fits"]
    assert p["state_bytes_per_device"] > p["usable_bytes_per_device"] > 60e9


def _exchange(moe: dict[str, int], p: dict) -> dict[tuple[str, str], float]:
    """A mixture of experts under expert parallelism (experts whole on each device: no fsdp or
    tensor), bytes per device per step: in each MoE layer, per microbatch, each device's
    device_batch x T x k routed token copies (bfloat16 rows) go to the devices holding their
    experts by a ragged all-to-all, and the results come back by another, piece by piece (the planner counts
    the rows routed, hlo.routed: all of them, as capacity_factor 1.25 bounds the receive buffer
    above them). Under full remat, in the backward (model/moe.py `_routed`) the copies go again
    with their gradient and the gates (2 bytes a copy), and the copies' gradient and the gates'
    come back: 5 transfers of the copies; without remat, jax's backward sends the two gradients:
    4. Each device sends each peer one slice per expert of the peer's (so the receiver's rows come
    grouped by expert). The sizes go first by two int32 all-to-alls (ep x 2 x the experts a device,
    each), again under full remat; without it each of jax's backward ragged all-to-alls sends its
    offsets by two more of that length. Every param not an expert's is
    split over the expert axis (its d_model dim, as over fsdp): gathered in bfloat16 each
    microbatch (a scanned layer's again under full remat, the two untied embeddings once) and its
    gradient reduce-scattered in float32; the norms' scales (a few KB, all-reduced) are left to
    the check that nothing else moves a weight-sized buffer."""
    ep, d, layers = p["mesh"]["expert"], moe["d_model"], moe["n_layer"]
    passes = 2 if p["remat"] == "full" else 1
    copies = p["device_batch"] * p["seq_len"] * moe["k"]
    local, pieces = moe["n_experts"] // ep, moe.get("pieces", 1)
    sizes = pieces * passes * 2 * ep * 2 * local * 4
    rows = (5 * d + 2) * copies * 2  # the routed block's own backward, under remat
    if p["remat"] != "full":
        sizes, rows = sizes + pieces * 2 * 2 * ep * local * 4, 4 * copies * d * 2
    experts = layers * moe["n_experts"] * 3 * d * moe["d_expert"]
    dense, embeddings = p["n_params"] - experts, 2 * moe["vocab"] * d
    return {
        ("ragged-all-to-all", "expert"): p["accumulation"] * layers * rows,
        ("all-to-all", "expert"): p["accumulation"] * layers * sizes,
        ("all-gather", "expert"): p["accumulation"] * (passes * (dense - embeddings) + embeddings) * 2,
        ("reduce-scatter", "expert"): p["accumulation"] * dense * 4,
    }


def _analytic(p: dict, case: str) -> dict[tuple[str, str], float]:
    """The bytes per device per step each collective must move (buffers, as the plan counts them):
    fsdp gathers params in the compute dtype (2 bytes), once per microbatch and again in the
    backward under full remat, each device its tensor shard; gradients reduce-scatter in float32
    once per microbatch; data parallelism all-reduces the float32 gradients (of its shard) once,
    or under ZeRO-1 reduce-scatters them (the same buffer, half the bytes sent) into the params'
    and moments' split, and gathers the params once, their weight matrices (`ZERO1_WEIGHTS`) as
    a bfloat16 copy, the rest (GPT-2's tied embedding, norms, biases) in float32."""
    n, mesh, accum = p["n_params"], p["mesh"], p["accumulation"]
    regathers = 2 if p["remat"] == "full" else 1
    out: dict[tuple[str, str], float] = {}
    if mesh["fsdp"] > 1:
        out[("all-gather", "fsdp")] = accum * regathers * n / mesh["tensor"] * 2
        out[("reduce-scatter", "fsdp")] = accum * n / mesh["tensor"] * 4
    if mesh["data"] > 1:
        reduce = "reduce-scatter" if p["zero1"] else "all-reduce"
        out[(reduce, "data")] = n / (mesh["fsdp"] * mesh["tensor"]) * 4
    if p["zero1"] and mesh["data"] > 1:
        out[("all-gather", "data")] = n * 4 - ZERO1_WEIGHTS[case] * 2
    return out | (_exchange(MOE_SHAPES[case], p) if case in MOE_SHAPES else {})


@pytest.mark.parametrize("case", [c for c in CI_CASES if c not in ("gpt_19b_h100x1", HEADS_192)])
def test_every_collective_moves_its_analytic_bytes(plans, case):
    p = plans[case]
    moved: dict[tuple[str, str], float] = {}
    for c in p["collectives"]:  # the plan keys them by crossing hosts too: one kind and axis may do both
        moved[(c["kind"], c["axis"])] = moved.get((c["kind"], c["axis"]), 0) + c["bytes"]
    for key, want in _analytic(p, case).items():
        assert moved.get(key, 0) == pytest.approx(want, rel=0.1), (key, p["collectives"])
    # Tensor parallelism moves activations, never a weight: no all-gather over `tensor`.
    assert not [c for c in p["collectives"] if c["kind"] == "all-gather" and "tensor" in c["axis"]]
    # No collective the analysis does not expect moves a weight-sized buffer.
    expected = set(_analytic(p, case)) | {("all-reduce", "tensor")}
    others = [c for c in p["collectives"] if (c["kind"], c["axis"]) not in expected]
    assert all(c["largest_bytes"] < 0.01 * p["n_params"] for c in others), others


@pytest.mark.parametrize("case", [c for c in CI_CASES if c != "gpt_19b_h100x1"])
def test_both_fused_attention_calls_take_each_devices_share(plans, case):
    p = plans[case]
    calls = p["attention_calls"]
    assert calls["forward"] > 0 and calls["backward"] > 0, calls
    heads = 64 if case.startswith("llama3_70b") else 32 if case.startswith(("gpt_7b", "qwen3")) else 12
    head_dim = 128 if case.startswith(("llama3_70b", "gpt_7b", "qwen3")) else 64
    if case.startswith("moe_tiny"):
        heads, head_dim = 4, 32
    if case == HEADS_192:
        heads, head_dim = 4, 192  # the values padded to the queries' size: jax's API takes one
    want = [p["device_batch"], p["seq_len"], heads // p["mesh"]["tensor"], head_dim]
    assert calls["q_shapes"] == [want], calls


# Temporaries per device as compiled today (GB): a change that grows one by 10% shows here.
TEMP_GB = {
    "gpt2_124m_h100x8_data8": 11.82,
    "gpt2_124m_h100x8_fsdp8": 11.44,
    "gpt2_124m_h100x8_fsdp4_tensor2_fp16": 6.41,
    "gpt2_124m_h100x8_zero1": 11.82,
    "gpt2_124m_h100_2x8_data16": 11.82,
    "gpt_7b_h100x8_fsdp8": 13.32,
    "llama3_70b_h100_128x8": 35.30,
    "qwen3_30b_a3b_8l_h100x8": 13.64,
    "deepseek_tiny_heads192_h100x8": 0.0049,
}


@pytest.mark.parametrize("case", list(TEMP_GB))
def test_temporaries_stay_where_they_are(plans, case):
    assert 0 < plans[case]["temp_bytes_per_device"] <= 1.1 * TEMP_GB[case] * 1e9, plans[case][
        "temp_bytes_per_device"
    ]


def test_plan_script_refuses_bad_input_in_one_line():
    script = str(ROOT / "scripts" / "plan.py")
    env = clean_env()
    for argv, extra, says in [
        (["--target", "h1000"], {}, "unknown --target 'h1000'; known targets: h100,"),
        (["--hosts", "0"], {}, "--hosts 0 --gpus_per_host 8: both must be >= 1"),
        ([], {"JAXTRAIN_CUDA_PLUGIN": os.devnull}, "run `make gpu-plugin`"),
    ]:
        proc = subprocess.run(
            [sys.executable, script, *argv], env=env | extra, capture_output=True, text=True
        )
        assert proc.returncode == 2, proc.stderr
        assert says in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def _documents_program(*flags: str) -> dict:
    """tests/gpu_documents.py: a step of configs/llama3_8b_128k.yaml with documents masked, one layer,
    one sequence, compiled for GPUs in its own process (the CUDA plugin)."""
    script = [sys.executable, str(ROOT / "tests" / "gpu_documents.py"), *flags]
    proc = subprocess.run(script, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_documents_reach_cudnn_packed_with_no_t_by_s_array_at_131072_tokens():
    """Llama 3 8B's layer at 131,072 tokens, each sequence over context 8 (the shipped 128K layout
    on one host), documents masked (doc_eos): on H100 every cuDNN call, forward and backward,
    takes the packed documents (q, k, v, then q/kv lengths and offsets: 7 operands forward; at most
    15 documents a block, model/documents.py) on whole sequences, and no array of
    the program has two dims of 131,072 or more. Before Hopper (A100, a window of 8,192, small
    vocab and MLP so only a T x S array has two such dims) documents are the [B, 1, T, S] bias,
    which the same check finds."""
    packed = _documents_program(
        "h100", "--model.n_layer", "1", "--total_batch_size", "131072", "--mesh.fsdp", "1"
    )
    assert packed["seq_len"] == 131072 and packed["long_shapes"] == [], packed["long_shapes"]
    calls = packed["cudnn_calls"]
    assert {c["target"] for c in calls} == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}, calls
    assert all(c["max_seg"] == 15 for c in calls), calls
    assert all(c["operands"] == 7 for c in calls if c["target"] == "__cudnn$fmhaSoftmax"), calls
    # The levels' blocks: the window, 8,192 and 512 tokens (model/documents.py block_sizes), each
    # call one query head of the 4 a GPU's key/value head serves (jax steps packed keys by the
    # query's heads), 4 calls a level forward and backward.
    assert {c["q"] for c in calls} == {"1,131072,1,128", "16,8192,1,128", "256,512,1,128"}, calls
    backward = [c["q"] for c in calls if c["target"] == "__cudnn$fmhaSoftmaxBackward"]
    assert sorted(backward) == sorted(["1,131072,1,128", "16,8192,1,128", "256,512,1,128"] * 4), calls
    small = ["--model.seq_len", "8192", "--total_batch_size", "8192", "--model.vocab_size", "4096"]
    small += ["--model.doc_eos", "4000", "--model.d_ff", "7168", "--mesh.fsdp", "1", "--mesh.context", "1"]
    dense = _documents_program("a100", "--model.n_layer", "1", *small)
    assert "bf16[1,1,8192,8192]" in dense["long_shapes"], dense
    assert {c["max_seg"] for c in dense["cudnn_calls"]} == {1}, dense["cudnn_calls"]


def _gemms(argv: list[str]) -> dict:
    """tests/gpu_gemms.py's count of the GEMMs and gathers of the job `argv` compiled for H100s, in a
    process of its own (the CUDA plugin never enters pytest's)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_gemms.py"), *argv],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_fp8_projections_compile_to_cublaslt_fp8_gemms():
    """model.matmul fp8 on an H100 (issue 48): every projection's forward GEMM (e4m3 x e4m3) and both
    backward GEMMs (the e5m2 gradient x an e4m3 operand) are cuBLASLt FP8 GEMMs; the head, left in
    bf16 (model.head_matmul compute), is bf16 cuBLAS GEMMs. fsdp gathers the projections' weights as
    e4m3 (each shard rounded by the whole weight's scale: parallel/fsdp.py), half of bf16's bytes;
    the embedding and the bf16 head's table are gathered in bf16. Over tensor 2 the activations
    and gradients it cuts are scaled one block a device (model/fp8.py `tensor_blocks`): the GEMMs
    stay FP8 (the blocked scale is one scalar a device once partitioned) and no bf16 max is
    all-reduced (8 before: 2 layers x the output projections' inputs and q's, kv's and gate_up's
    gradients)."""
    argv = ["--config", "configs/llama_tiny.yaml", "--dtype", "bfloat16", "--model.n_layer", "2"]
    argv += [
        "--model.matmul",
        "fp8",
        "--mesh.fsdp",
        "4",
        "--mesh.tensor",
        "2",
        "--mesh.data",
        "1",
        "--gpus",
        "8",
    ]
    gemms = _gemms(argv)
    # 2 layers x 5 projections (q, kv, attention out, gate_up, down), each 3 GEMMs; the head's 3.
    assert gemms["kinds"] == {"__cublas$lt$matmul$f8": 30, "__cublas$lt$matmul": 3}, gemms
    fp8 = gemms["operands"]["__cublas$lt$matmul$f8"]
    assert fp8["f8e4m3fn f8e4m3fn"] == 10, fp8  # the forward
    assert fp8.get("f8e5m2 f8e4m3fn", 0) + fp8.get("f8e4m3fn f8e5m2", 0) == 20, fp8  # the backward
    assert gemms["operands"]["__cublas$lt$matmul"] == {"bf16 bf16": 3}, gemms
    # The arrays gathered: 2 layers x 5 projections in e4m3 (before: all 12 in bf16), wte and lm_head.
    assert gemms["gathers"] == {"f8e4m3fn": 10, "bf16": 2}, gemms
    assert "bf16" not in gemms["small_all_reduces"], gemms  # the weights' maxima: float32, combined
    # The job's start counts the same (observe/gemms.py) and lets the step run
    assert gemms["census"] == {"fp8": 30, "cublas": 3, "other": 0, "asked_fp8": 30, "not_fp8": 0}, gemms
    assert gemms["refused"] is None, gemms


def test_an_fp8_step_compiled_without_the_fp8_options_is_refused_by_the_jobs_start_check():
    """Without xla_env.FP8_OPTIONS (Triton GEMMs on) the compiler for an H100 emits the projections'
    FP8 dots as Triton GEMM fusions over bf16 operands: none of one layer's 15 FP8 products is an
    FP8 GEMM. run/build.py's check (what compile_train runs where a job starts) refuses the step in
    one line naming how many and which."""
    argv = ["--config", "configs/llama_tiny.yaml", "--dtype", "bfloat16", "--model.n_layer", "1"]
    gemms = _gemms([*argv, "--model.matmul", "fp8", "--without_fp8_options"])
    assert gemms["census"] == {"fp8": 0, "cublas": 0, "other": 18, "asked_fp8": 15, "not_fp8": 15}, gemms
    line = gemms["refused"]
    assert line.startswith("model.matmul fp8: 15 of the train step's 15 FP8 GEMMs compiled to other "), line
    assert "(15 __triton_nested_gemm_fusion; the first: jit(train_step)/" in line and "\n" not in line, line


def test_a_pipelines_fp8_gemms_stay_fp8_inside_its_tick_loop():
    """Under a pipeline the weights are the same in every tick, and XLA's loop-invariant code motion
    hoisted each FP8 weight's dequantize out of the tick loop as a bf16 array: the forward's GEMMs,
    no longer fed an FP8 operand, compiled to bf16 ones (Llama 3 405B on 256 x 8: 67 of its 257;
    here 10 of 34). model/fp8.py ties the weight to the tick's activation (`_in_step`): every GEMM,
    the head's too (model.head_matmul fp8), is cuBLASLt's FP8 one."""
    argv = ["--config", "configs/llama_tiny.yaml", "--dtype", "bfloat16", "--model.n_layer", "2"]
    argv += ["--model.scan_layers", "true", "--model.matmul", "fp8", "--model.head_matmul", "fp8"]
    argv += ["--mesh.pipeline", "2", "--mesh.data", "4", "--gpus", "8"]
    gemms = _gemms(argv)
    assert gemms["kinds"] == {"__cublas$lt$matmul$f8": 34}, gemms
    # The forward GEMMs (e4m3 x e4m3): 2 before the tie, the other 10 bf16.
    assert gemms["operands"]["__cublas$lt$matmul$f8"]["f8e4m3fn f8e4m3fn"] == 12, gemms
