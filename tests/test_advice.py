"""jaxtrain/plan/advice.py's reasoning, in-process on plans as scripts/plan.py records them
(tests/test_gpu_compile.py plans each printed suggestion for real and checks that it fits)."""

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxtrain.config import load_config
from jaxtrain.plan import advice, candidates, planner, targets
from jaxtrain.plan import cli as plan_cli

ROOT = Path(__file__).resolve().parent.parent
USABLE_H100 = 63_697_010_688


def _cfg(*flags: str):
    return load_config(["--config", str(ROOT / "configs" / flags[0]), *flags[1:]])


@pytest.mark.parametrize("total_batch", [True, False])
def test_nearer_lists_remat_then_a_smaller_batch_then_wider_fsdp(total_batch):
    """The candidates, nearest first (fits_with plans each; the GPU test follows what it prints)."""
    flags = ["gpt2_124m.yaml"] + ([] if total_batch else ["--total_batch_size", "0", "--batch_size", "512"])
    cfg = _cfg(*flags)
    p = {"compiled": True, "mesh": {"data": 8, "fsdp": 1, "tensor": 1}, "device_batch": 16, "accumulation": 4}
    smaller = {"device_batch_size": 8} if total_batch else {"gradient_accumulation_steps": 8}
    wider = {"mesh.fsdp": 2, "mesh.data": -1}
    full = {"model.remat": "full"}
    assert advice.nearer(cfg, p, devices=8) == [full, smaller, {**smaller, **full}, wider, {**wider, **full}]
    # fsdp already spans the host: nothing wider; full remat already: never advised again.
    whole = {**p, "mesh": {"data": 1, "fsdp": 8, "tensor": 1}}
    assert advice.nearer(candidates.with_overrides(cfg, full), whole, devices=8) == [smaller]
    # Across hosts fsdp widens past one host; a device batch of 1 is never advised again.
    one = {**whole, "device_batch": 1}
    assert advice.nearer(cfg, one, devices=16) == [
        full,
        {"mesh.fsdp": 16, "mesh.data": -1},
        {**wider, **full, "mesh.fsdp": 16},
    ]
    # An expert axis leaves fsdp less room: expert 8 x fsdp 2 fills 16 devices.
    moe = {**p, "mesh": {"data": 1, "expert": 8, "fsdp": 2, "tensor": 1}, "device_batch": 1}
    assert advice.nearer(cfg, moe, devices=16) == [full]


def _uncompiled(hosts: int, gpus: int, mesh: dict, state: int) -> dict:
    return {
        "compiled": False, "fits": False, "hosts": hosts, "gpus_per_host": gpus,
        "device_kind": "NVIDIA H100 80GB HBM3", "mesh": mesh, "zero1": False, "global_batch": 512,
        "seq_len": 1024, "accumulation": 32, "device_batch": 16, "dtype": "bfloat16", "remat": "none",
        "n_params": 19_538_382_848, "state_bytes_per_device": state, "usable_bytes_per_device": USABLE_H100,
    }  # fmt: skip


def test_a_state_too_large_for_the_cluster_is_told_at_once_with_the_gpus_it_needs(capsys):
    """plan_one's uncompiled verdict as scripts/plan.py prints it (tests/test_gpu_compile.py
    checks that plan_one gives it without a compile): 19.5B on one H100."""
    p = _uncompiled(1, 1, {"data": 1, "fsdp": 1, "tensor": 1}, 234_460_594_204)
    assert advice.state_split(p) == 4  # 234 GB / 4 = 58.6 GB fits 63.7; / 2 does not
    assert advice.nearer(_cfg("gpt2_124m.yaml"), p, devices=1) == []  # nothing a setting can do
    planner.print_plan(p)
    advice.print_fixes(p)
    out = capsys.readouterr().out
    assert "234.46 GB (params, optimizer moments) of 63.70 GB usable: DOES NOT FIT" in out
    assert "fits with: nothing on 1 x 1 GPUs: its state alone must be split 4 ways (fsdp x tensor)" in out
    assert "plan it on 4 or more" in out


def test_a_state_too_large_for_its_mesh_is_advised_the_fsdp_that_splits_it(capsys):
    """A 405B-size state under tensor 8 x fsdp 8 on 256 x 8 GPUs: split 64 ways it needs 101 GB a
    GPU, split 128 ways 51 GB. The cluster has 2,048 GPUs: the advice is fsdp 16, never "needs 128
    or more" GPUs."""
    p = _uncompiled(256, 8, {"data": 32, "fsdp": 8, "tensor": 8}, 101_250_000_000)
    assert advice.state_split(p) == 128
    cfg = _cfg("llama3_70b.yaml", "--model.remat", "dots")
    wide = {"mesh.fsdp": 16, "mesh.data": -1}
    assert advice.nearer(cfg, p, devices=2048) == [wide, {**wide, "model.remat": "full"}]
    advice.print_fixes(p)  # had nothing that fit been found
    out = capsys.readouterr().out
    assert "its state fits split 128 ways" in out and "or more" not in out and "[" not in out


def test_one_sequence_per_device_is_told_what_would_help(capsys):
    """A 131,072-token window at one sequence a device: no batch advice; the context axis named."""
    p = json.loads((ROOT / "bench/results/plan_llama3_8b_h100x8.json").read_text())
    p |= {"fits": False, "seq_len": 131072, "device_batch": 1, "fits_with": []}
    advice.print_fixes(p)
    out = capsys.readouterr().out
    assert out.startswith("fits with: nothing found: one sequence of 131,072 tokens per device")
    assert "--mesh.tensor 8" in out and "--model.remat full" in out and "--mesh.context" in out
    assert "device_batch_size" not in out and "total_batch_size" not in out and "[" not in out


def test_fixes_print_as_flags_with_their_memory(capsys):
    p = {"fits": False, "compiled": True, "fits_with": [
        {"overrides": {"mesh.data": -1, "mesh.fsdp": 2, "mesh.tensor": 4, "model.remat": "full"},
         "total_bytes_per_device": 30_123_000_000}]}  # fmt: skip
    advice.print_fixes(p)
    assert capsys.readouterr().out == (
        "fits with: --mesh.data -1 --mesh.fsdp 2 --mesh.tensor 4 --model.remat full (30.12 GB)\n"
    )


def test_the_search_varies_the_expert_and_pipeline_axes():
    mixtral = _cfg("mixtral_8x7b.yaml")
    grid = candidates.layouts(mixtral, devices=16, gpus_per_host=8)
    # Expert largest first, each without a pipeline, then with Mixtral's 32 layers in the stages the
    # rest of the 16 GPUs take, deepest first.
    assert [(e, p) for t, c, e, p, _ in grid if t == 1 and c == 1] == [
        (8, 1), (8, 2), (4, 1), (4, 4), (4, 2), (2, 1), (2, 8), (2, 4), (2, 2), (1, 1), (1, 16), (1, 8),
        (1, 4), (1, 2),
    ]  # fmt: skip
    # DeepSeek-V3's 58 MoE layers after its 3 dense ones: 4 stages pad 2 of them, 8 would pad 6
    assert candidates.pipelines(_cfg("deepseek_v3_671b.yaml"), 1024) == [1, 4, 2]
    # DeepSeek-V3's 58 MoE layers after its 3 dense ones: 4 stages pad 2 of them, 8 would pad 6
    assert candidates.pipelines(_cfg("deepseek_v3_671b.yaml"), 1024) == [1, 4, 2]
    for tensor, context, expert, pipe, fsdps in grid:
        assert fsdps[-1] * tensor * context * expert * pipe == 16 and fsdps[0] == 1
    # Expert laid inside fsdp is tried where it moves the exchange into a host: expert 8 x fsdp 2
    # on 2 x 8 (not expert 8 x fsdp 1, nor expert 4 x fsdp 2 in one host, nor expert 16).
    assert candidates.inner_choice(8, 2, 1, 8) and candidates.inner_choice(4, 4, 2, 8)
    assert not any(
        candidates.inner_choice(*a, 8) for a in [(8, 1, 1), (4, 2, 1), (16, 2, 1), (1, 8, 1), (8, 2, 2)]
    )
    # A dense model: expert 1 only; tensor inside the host, largest first; context in what the host
    # leaves, where it divides the window and the heads (32 heads: context x tensor <= 32); no
    # pipeline, then the pipelines that divide its 32 layers in what is left, deepest first.
    dense = candidates.layouts(_cfg("llama3_8b.yaml"), devices=64, gpus_per_host=8)
    assert [(t, c) for t, c, e, pipe, _ in dense if pipe == 1] == [
        (8, 1),
        (4, 1),
        (4, 2),
        (2, 1),
        (2, 2),
        (2, 4),
        (1, 1),
        (1, 2),
        (1, 4),
        (1, 8),
    ]
    assert [pipe for t, c, _, pipe, _ in dense if (t, c) == (8, 1)] == [1, 8, 4, 2]
    for tensor, context, _, pipe, fsdps in dense:
        assert fsdps[-1] * tensor * context * pipe == 64
    assert {e for _, _, e, _, _ in dense} == {1}
    # Layer counts the stages do not divide, padded by at most 1/16: 126 (2 padding layers over
    # 64, 32, ... stages; none over 2), and 80 (none over 16; 16 of 96 over 32).
    assert candidates.pipelines(_cfg("llama3_405b.yaml"), 256) == [1, 64, 32, 16, 8, 4, 2]
    assert candidates.pipelines(_cfg("llama3_70b.yaml"), 128) == [1, 16, 8, 4, 2]


def test_a_device_batch_whose_layer_inputs_alone_exceed_a_gpu_is_not_compiled():
    """The search's bound before a compile: llama3_8b at a 131,072-token window holds at least
    32 layers' inputs of 131,072 x 4,096 bfloat16 values a sequence: 34.4 GB, so 2 sequences
    (68.7 GB) cannot fit an H100's 63.7 usable GB at any mesh."""
    cfg = _cfg("llama3_8b.yaml", "--model.seq_len", "131072")
    assert candidates.activation_floor(cfg, 1) == 32 * 131072 * 4096 * 2
    assert candidates.activation_floor(cfg, 2) > USABLE_H100 > candidates.activation_floor(cfg, 1)
    assert candidates.activation_floor(cfg, 8, context=8) == candidates.activation_floor(
        cfg, 1
    )  # split 8 ways


def test_the_plan_names_the_link_inside_a_host(capsys):
    """L40S has no NVLink: its GPUs talk over PCIe (jaxtrain/plan/targets.py)."""
    p = json.loads((ROOT / "bench/results/plan_gpt2_124m_h100x8_data8.json").read_text())
    planner.print_plan(copy.deepcopy(p) | {"target": "l40s", "device_kind": "NVIDIA L40S"})
    out = capsys.readouterr().out
    assert "nvlink" not in out.lower() and "PCIe" in out and "inside a host (PCIe)" in out
    planner.print_plan(p)
    assert "NVLink" in capsys.readouterr().out


def test_every_figure_of_a_printed_plan_is_its_json_by_hand(capsys):
    p = json.loads((ROOT / "bench/results/plan_gpt2_124m_h100x8_fsdp8.json").read_text())
    planner.print_plan(p)
    out = capsys.readouterr().out
    terms = p["bound_terms_s"]
    bound = max(terms.values())
    named = {"nvlink": "NVLink", "program": "the program's matmuls"}  # as print_plan names the terms
    limit = named.get(max(terms, key=terms.get), max(terms, key=terms.get))
    lines = [
        f"total / device            {p['total_bytes_per_device'] / 1e9:.2f} GB",
        f"state + batch / device    {p['state_bytes_per_device'] / 1e9:.2f} GB",
        f"step time lower bound     {bound * 1e3:.1f} ms ({limit}-bound",
        f"compute {terms['compute'] * 1e3:.1f} ms, the program's matmuls {terms['program'] * 1e3:.1f} ms, "
        f"hbm {terms['hbm'] * 1e3:.1f} ms, NVLink {terms['nvlink'] * 1e3:.1f} ms",
        f"schedule-aware bound      {p['schedule_bound_s'] * 1e3:.1f} ms",
        f"MFU ceiling               {100 * terms['compute'] / bound:.1f}% from the floor, "
        f"{100 * terms['compute'] / p['schedule_bound_s']:.1f}% from the schedule",
    ]  # fmt: skip
    for line in lines:
        assert line in out, line


LLAMA3_405B_SHAPE = ["--model.n_layer", "126", "--model.n_head", "128", "--model.d_model", "16384",
                     "--model.d_ff", "53248"]  # fmt: skip


def _layout_names(cfg, devices):
    grid = candidates.layouts(cfg, devices=devices, gpus_per_host=8)
    return {(t, c, e, pipe): fsdps for t, c, e, pipe, fsdps in grid}


def test_the_search_tries_the_layouts_we_ship_without_a_compile():
    """Issue 47: from a base config with only the size or the window changed, the search's
    candidates hold what we ship, and the floor it skips layouts by lets them through. Llama 3
    405B built from configs/llama3_70b.yaml on 256 x 8: pipeline 32 x tensor 8 x fsdp 1 (data 8,
    configs/llama3_405b.yaml's layout); llama3_8b at a 131,072-token window on 8 x 8: context 8
    x fsdp 8 (configs/llama3_8b_128k.yaml's)."""
    big = _cfg("llama3_70b.yaml", *LLAMA3_405B_SHAPE)
    grid = _layout_names(big, 2048)
    assert 1 in grid[(8, 1, 1, 32)]
    rows = big.total_batch_size // big.model.seq_len  # 512 sequences: 64 a pipeline's data shard
    floor = candidates.activation_floor(big, 1, 1, 32, rows // (2048 // (8 * 32)), tensor=8)
    assert floor == 64 * 8192 * 16384 * 2 // 8 and floor < USABLE_H100  # each tick's input split over tensor
    long = _cfg("llama3_8b.yaml", "--model.seq_len", "131072")
    assert 8 in _layout_names(long, 64)[(1, 8, 1, 1)]
    assert candidates.activation_floor(long, 1, context=8) < USABLE_H100


def _order(cfg, devices):
    """The search's compile order: (tensor, context, expert, pipeline) with the fsdp width and device
    batch it tries first, fastest estimate first (candidates.ranked, no compile)."""
    h100, rows = targets.get("h100"), candidates.rows_of(cfg)
    out = []
    for _, layout in candidates.ranked(cfg, candidates.layouts(cfg, devices, 8), devices, 8, h100):
        tensor, context, _, pipe, _ = layout
        per_shard = rows // (devices // (tensor * context * pipe))
        batch = candidates.first_batch(cfg, tensor, context, pipe, per_shard, USABLE_H100)
        least = candidates.memory_floor(cfg, batch, tensor, context, pipe, per_shard)
        out.append((layout[:4], candidates.first_fsdp(cfg, layout, devices, least, USABLE_H100), batch))
    return out


def test_the_search_compiles_the_layouts_we_ship_within_its_budget():
    """Issue 47: a search's 16 compiles cover a few layouts, so it compiles them in the order of an
    estimate from the shape (candidates.py), and starts each at the fsdp width its state can fit. From
    a base config with only the size or the window changed, the layouts we ship come among the first
    and start where we ship them; what cannot fit is passed over without a compile."""
    # Llama 3 405B from configs/llama3_70b.yaml by flags, Meta's 16M-token batch, on 256 x 8:
    # pipeline 32 x tensor 8 at fsdp 1, one sequence a microbatch (configs/llama3_405b.yaml's).
    big = _cfg("llama3_70b.yaml", *LLAMA3_405B_SHAPE, "--total_batch_size", "16777216")
    order = _order(big, 2048)
    assert ((8, 1, 1, 32), 1, 1) in order[:6]
    # llama3_8b at a 131,072-token window on 8 x 8: context 8 (configs/llama3_8b_128k.yaml's) among
    # the first; tensor 2 alone is passed over: 32 layers' inputs (34.4 GB) and the head's logits and
    # their gradient (2 x 8.4 GB) already exceed a GPU at one sequence.
    long = _cfg("llama3_8b.yaml", "--model.seq_len", "131072")
    order = _order(long, 64)
    assert (1, 8, 1, 1) in [layout for layout, _, _ in order[:5]]
    assert candidates.memory_floor(long, 1, 2, 1, 1, 1) > USABLE_H100
    # Llama 3 70B on 128 x 8 as shipped: tensor 2 among the first, started at its fsdp 16.
    assert ((2, 1, 1, 1), 16, 1) in _order(_cfg("llama3_70b.yaml"), 1024)[:3]


def test_a_widest_fsdp_that_two_compiles_say_cannot_fit_is_not_compiled():
    """When a layout fits neither at its first fsdp width nor at twice it, the widest is compiled
    only if it could fit, each further doubling saving at most what the last one saved. Figures
    from the searches of bench/results: llama3_8b at 128K tokens, context 2 at fsdp 4 and 8 (76.31,
    74.23 GB) cannot fit at 32; context 8 at 2 sequences, fsdp 1 and 2 (68.63, 61.81 GB) can at 8
    (it did: 45.47 GB); 405B, fsdp only, 512 and 1,024 (80.49, 76.28 GB) cannot at 2,048."""
    s = advice._Search(_cfg("llama3_8b.yaml"), (targets.get("h100"), 8, 8), 16)
    assert not s.could_fit([76_310_000_000, 74_230_000_000], 4)
    assert s.could_fit([68_630_000_000, 61_810_000_000], 4)
    assert not s.could_fit([80_490_000_000, 76_280_000_000], 2)
    assert s.could_fit([0, 61_810_000_000], 4)  # a width not compiled (its state alone): no judgement


@pytest.mark.parametrize("config", ["llama3_8b_128k.yaml", "llama3_405b.yaml", "mixtral_8x7b.yaml"])
def test_the_search_tries_only_meshes_that_can_exist(config):
    """Every candidate, at each fsdp width it may take, passes the checks a user's config meets
    and multiplies to the devices, over a base config that sets its own context, pipeline or
    expert axis (llama3_8b_128k: context 8; its candidates without context say --mesh.context 1);
    the 16 heads' and 8 key/value heads' splits that cannot divide are never tried."""
    from jaxtrain.config import check
    from jaxtrain.run.job import resolve_mesh

    cfg = _cfg(config)
    for devices in (48, 64):  # 48: a power of two past 16 does not divide it
        grid = candidates.layouts(cfg, devices=devices, gpus_per_host=8)
        assert grid
        for tensor, context, expert, pipe, fsdps in grid:
            mesh = candidates.mesh_overrides(cfg, tensor, context, expert, pipe)
            for fsdp in fsdps:
                candidate = candidates.with_overrides(cfg, {**mesh, "mesh.fsdp": fsdp})
                check(candidate)
                sizes = resolve_mesh(candidate.mesh, devices)
                assert sizes.data * fsdp * tensor * context * expert * pipe == devices
    if config == "llama3_8b_128k.yaml":
        assert candidates.mesh_overrides(cfg, 8, 1, 1, 1) == {
            "mesh.data": -1,
            "mesh.tensor": 8,
            "mesh.context": 1,
        }
        assert candidates.mesh_overrides(cfg, 1, 8, 1, 1) == {"mesh.data": -1, "mesh.tensor": 1}


CHECK_FAILED = (
    "F1207 12:37:57.562601   18398 spmd_partitioner_util.cc:497] Check failed: "
    "partition_group_list.num_replica_groups() * partition_group_list.num_devices_per_group() == "
    "device_groups.num_devices_per_group()\n*** Check failure stack trace: ***\n"
)  # what XLA printed compiling gpt2_124m's data -1 x fsdp 1 x context 2 x tensor 2 on 2 x 8 H100s


def _abort_as_xla_does() -> None:
    sys.stderr.write(CHECK_FAILED)
    sys.stderr.flush()
    os.abort()


def test_a_plan_whose_process_aborts_is_one_clean_line_and_the_search_goes_on(tmp_path, monkeypatch, capsys):
    """planner.in_child: a compile that kills its process (XLA's `Check failed`, exit 134: a real
    abort here, in the child) is a Refused naming what was compiled and where XLA stopped, never
    XLA's raw line, and the next call gets a fresh child. In a search it is the candidate's one
    line, and the search goes on (scripts/plan.py --config configs/gpt2_124m.yaml --hosts 2 --search)."""
    monkeypatch.setattr(
        advice,
        "plan_guarded",
        lambda *a: planner.in_child(_abort_as_xla_does, what="compiling a test layout"),
    )
    s = advice._Search(_cfg("gpt2_124m.yaml"), (targets.get("h100"), 2, 8), 16)
    mesh = {"mesh.data": -1, "mesh.tensor": 2, "mesh.context": 2, "mesh.fsdp": 1, "model.remat": "full"}
    why = "an internal check failed (XLA's spmd_partitioner_util.cc:497)"  # not XLA's text
    assert s.attempt(mesh) == f"not compiled: XLA aborts compiling it: {why}"
    assert (
        capsys.readouterr().out
        == f"  tensor 2, context 2, fsdp 1, remat full: not compiled: XLA aborts compiling it: {why}\n"
    )
    assert s.compiles == 0 and not s.results
    with pytest.raises(planner.Refused) as refused:  # the job as given: its layout named
        planner.in_child(_abort_as_xla_does, what="compiling a test layout")
    assert str(refused.value) == f"XLA aborted compiling a test layout: {why}"
    assert planner.in_child(os.getpid, what="a pid") != os.getpid()
    log = tmp_path / "stderr.log"
    log.write_text("")
    assert planner.last_words(str(log)) == "the compiler's process died without a word"


def test_the_search_names_the_job_as_given_and_compares_the_best_layout_with_it(monkeypatch, capsys):
    """scripts/plan.py --search: the as-given job's table has a label (it prints after the search's
    lines), and one line compares the fastest layout found with it, by forecast."""
    given = json.loads((ROOT / "bench/results/plan_gpt2_124m_h100_2x8_data16.json").read_text())
    given["forecast"] = {**given.get("forecast", {}), "step_time_s": 0.0770, "mfu": 0.346}
    best = {"overrides": {"mesh.data": -1, "model.remat": "none"}, "forecast": {"step_time_s": 0.0701}}
    monkeypatch.setattr(plan_cli, "plan_job", lambda *a: {**given, "search": [best]})
    monkeypatch.setattr(advice, "print_search", lambda found: None)
    assert (
        plan_cli.main(["--config", str(ROOT / "configs/gpt2_124m.yaml"), "--hosts", "2", "--search"], "") == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "the job as given:" and out[1].startswith("target ")
    assert out[-1] == (
        "best layout found vs the job as given: 70.1 vs 77.0 ms a step (forecast), 1.10x faster, with "
        "--mesh.data -1 --model.remat none"
    )
    assert advice.versus_given({}, [best]) == (
        "best layout found vs the job as given: 70.1 ms a step (forecast) with --mesh.data -1 "
        "--model.remat none; the job as given was not compiled"
    )
    assert advice.versus_given(given, []) == ""


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


def test_the_compiling_child_dies_with_the_planner():
    """A planner gone without a word (killed, timed out) leaves no child compiling on as an orphan:
    the child gets SIGKILL with its parent (cluster/lifeline.py)."""
    code = (
        "import os\nif __name__ == '__main__':\n    from jaxtrain.plan import planner\n"
        "    print(planner.in_child(os.getpid, what='x'), flush=True)\n    os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child), out.stderr[-2000:]
