# ruff: noqa: E501  (HLO lines as the compiler prints them)
"""jaxtrain/plan/compiled.py's reading of compiled HLO text: replica groups, loop trips, host crossings."""

import importlib.util
import json
from pathlib import Path

import pytest

from jaxtrain.config import load_config
from jaxtrain.model.transformer import flops_per_token
from jaxtrain.observe import memory, metrics, peaks
from jaxtrain.plan import compiled as plan
from jaxtrain.plan import forecast, hlo, schedule, targets

ROOT = Path(__file__).resolve().parent.parent

# The shapes XLA's GPU compiler prints (tests/test_gpu_compile.py compiles the real thing).
HLO = """HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_update (p0: f32[64,1024], p1: f32[1,1024], p2: s32[]) -> f32[64,1024] {
  %p0 = f32[64,1024]{1,0} parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[64,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %zero)
}

%body (carry: (s32[], f32[64,1024], f32[1,1024])) -> (s32[], f32[64,1024], f32[1,1024]) {
  %carry = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %acc = f32[64,1024]{1,0} get-tuple-element(%carry), index=1
  %row = f32[1,1024]{1,0} get-tuple-element(%carry), index=2
  %gathered = f32[8,1024]{1,0} all-gather(%row), channel_id=2, replica_groups=[2,8]<=[16], dimensions={0}, use_global_device_ids=true
  %update = f32[64,1024]{1,0} fusion(%acc, %row, %i), kind=kLoop, calls=%fused_update
  ROOT %out = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) tuple(%i, %update, %row)
}

%cond (carry: (s32[], f32[64,1024], f32[1,1024])) -> pred[] {
  %carry = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[1024,1024], b: (s32[], f32[64,1024], f32[1,1024])) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %b = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) parameter(1)
  %loop = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) while(%b), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %ar = f32[1024,1024]{1,0} all-reduce-start(%a), channel_id=1, replica_groups=[8,2]<=[2,8]T(1,0), use_global_device_ids=true, to_apply=%add
  ROOT %done = f32[1024,1024]{1,0} all-reduce-done(%ar)
}
"""


def test_replica_groups_in_every_form():
    assert hlo.groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo.groups("replica_groups={{0,2},{1,3}}, x", 4) == [[0, 2], [1, 3]]
    assert hlo.groups("replica_groups={}, x", 3) == [[0, 1, 2]]
    # The mesh form (jax 0.10's GPU compiler prints it for ZeRO-1's gather): row-major partitions.
    mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}"
    assert hlo.groups(mesh, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo.groups(mesh.replace("{'axis_0'}", "{'axis_1'}"), 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_walk_counts_loop_trips_axes_hosts_and_in_place_updates():
    # 2 hosts x 8 GPUs as a data 2 x fsdp 8 mesh: fsdp inside a host, data across.
    layout = hlo.Placement(("data", "fsdp", "tensor"), (2, 8, 1), [0] * 8 + [1] * 8)
    tally = plan._Walker(HLO, layout).tally()
    gather = tally.collectives[("all-gather", "fsdp", False)]
    assert gather["count"] == 12 and gather["bytes"] == 12 * 8 * 1024 * 4
    assert gather["nvlink_bytes"] == 12 * 7 * 1024 * 4 and gather["network_bytes"] == 0
    reduce = tally.collectives[("all-reduce", "data", True)]
    assert reduce["count"] == 1 and reduce["largest_bytes"] == 1024 * 1024 * 4
    # One host's half of a 2-host all-reduce leaves through its GPU's own NIC (1 GPU per host in the group).
    assert reduce["network_bytes"] == 2 * 0.5 * 1024 * 1024 * 4
    # The in-place update writes one row per trip, not the whole buffer.
    assert tally.written == 12 * 1024 * 4


def test_one_peak_table_for_the_plan_and_the_mfu_log():
    for t in targets.TARGETS.values():
        bf16, tf32 = targets.peak_flops(t, "bfloat16"), targets.peak_flops(t, "float32")
        assert metrics.peak_flops(t.device_kind) == bf16 == targets.peak_flops(t, "float16")
        assert 0 < tf32 < bf16, t.name
    # The first match wins: a longer name before its prefix.
    assert metrics.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert metrics.peak_flops("NVIDIA L4") == 121e12 and metrics.peak_flops("NVIDIA L40S") == 362.05e12
    assert metrics.peak_flops("TPU v5 lite") == 197e12 and metrics.peak_flops("TPU v5p") == 459e12
    assert metrics.peak_flops("cpu") is None and peaks.peak_flops("TPU v4", "float32") is None
    # MFU against the dtype that runs: float32 at TF32's, FP8 (either format) at twice bf16's on Hopper.
    h100 = targets.get("h100").device_kind
    assert metrics.peak_flops(h100, "float32") == 494.7e12
    assert peaks.peak_flops(h100, "float8_e4m3fn") == peaks.peak_flops(h100, "float8") == 1978.9e12
    assert peaks.peak_flops("NVIDIA A100-SXM4-80GB", "float8") is None  # no FP8 unit


def test_fits_keeps_a_reserve_for_autotuning_and_workspaces():
    """The one memory rule, for the planner and a training run alike: 5% of what XLA may use kept."""
    limit = 60 * 10**9
    assert memory.reserve_bytes(limit) == 3 * 10**9
    assert memory.fits(57 * 10**9, limit) and not memory.fits(57 * 10**9 + 1, limit)


# What XLA 0.10.2's GPU compiler makes of an FP8 dot_general without a GPU to autotune on (a
# Triton GEMM fusion over f8e4m3fn operands: jax.lax.dot_general of two f8e4m3fn arrays compiled for h100),
# beside cuBLASLt's FP8 GEMM as XLA's GEMM rewriter writes it (xla/service/gpu/tests/
# gemm_rewrite_test.cc) and a bf16 cuBLAS GEMM.
FP8_HLO = """HloModule jit_f8, is_scheduled=true

%gemm_fusion_dot_computation (parameter_0: f8e4m3fn[4096,4096], parameter_1: f8e4m3fn[8192,4096]) -> bf16[4096,8192] {
  %parameter_0 = f8e4m3fn[4096,4096]{1,0} parameter(0)
  %parameter_1 = f8e4m3fn[8192,4096]{0,1} parameter(1)
  %transpose.1 = f8e4m3fn[4096,8192]{0,1} transpose(%parameter_1), dimensions={1,0}
  ROOT %dot_general.0 = bf16[4096,8192]{1,0} dot(%parameter_0, %transpose.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f8e4m3fn[4096,4096], b: f8e5m2[4096,8192], w: bf16[4096,4096], s: f32[]) -> bf16[4096,8192] {
  %a = f8e4m3fn[4096,4096]{1,0} parameter(0)
  %b = f8e4m3fn[4096,8192]{1,0} parameter(1)
  %bt = f8e4m3fn[8192,4096]{0,1} bitcast(%b)
  %triton = bf16[4096,8192]{1,0} fusion(%a, %bt), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %s = f32[] parameter(3)
  %lt = (bf16[4096,8192]{1,0}, s8[33554432]{0}) custom-call(%a, %bt, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %w = bf16[4096,4096]{1,0} parameter(2)
  %bf = (bf16[4096,4096]{1,0}, s8[33554432]{0}) custom-call(%w, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %out = (bf16[4096,8192]{1,0}, (bf16[4096,8192]{1,0}, s8[33554432]{0}), (bf16[4096,4096]{1,0}, s8[33554432]{0})) tuple(%triton, %lt, %bf)
}
"""


def test_fp8_gemms_are_found_and_costed_at_the_fp8_peak():
    """Both forms of an FP8 GEMM are FP8 (hlo.fp8), the bf16 one is not; the bound and the forecast
    cost them at the FP8 peak, and the plan's FLOPs name them."""
    program = hlo.Program(FP8_HLO)
    ops = program.comps[program.entry]
    assert [hlo.fp8(ops[n], program.comps, ops) for n in ("triton", "lt", "bf")] == [True, True, False]
    layout = hlo.Placement(("fsdp",), (1,), [0])
    events = schedule.trace(FP8_HLO, layout)
    fp8_flops, bf16_flops = 2 * 4096 * 8192 * 4096, 2 * 4096**3
    gemms = [(e[1], e[2], e[6]) for e in events if e[0] == "op" and e[2]]
    assert sorted(gemms) == [("gemm", bf16_flops, 1), ("gemm_fp8", fp8_flops, 2)]
    h100 = targets.get("h100")
    bf16 = targets.peak_flops(h100, "bfloat16")
    roofline = schedule.Roofline(h100, bf16)
    assert roofline.op("gemm_fp8", fp8_flops, 0, 0, False) == pytest.approx(fp8_flops / 1978.9e12)
    assert roofline.op("gemm", bf16_flops, 0, 0, False) == pytest.approx(bf16_flops / 989.4e12)
    likely = forecast.Achievable(h100, bf16)
    assert likely.op("gemm_fp8", fp8_flops, 0, 0, False) == pytest.approx(
        forecast.KERNEL_S + fp8_flops / (1978.9e12 * forecast.GEMM_EFFICIENCY)
    )
    # A target with no FP8 unit costs them at its own peak (never a peak it does not have).
    a100 = targets.get("a100")
    assert schedule.op_peak(a100, 312e12, "gemm_fp8") == 312e12
    tally = plan._Walker(FP8_HLO, layout).tally()
    assert tally.flops == 2 * fp8_flops + bf16_flops and tally.fp8_flops == 2 * fp8_flops


# A step's update in one branch of a conditional (the other skips a non-finite step): the update
# branch writes less than the skip branch's copy but holds ZeRO-1's all-gather of the new params.
COND_HLO = """HloModule jit_step, is_scheduled=true

%skip (s: f32[8,1024]) -> f32[8,1024] {
  %s = f32[8,1024]{1,0} parameter(0)
  ROOT %copy = f32[8,1024]{1,0} copy(%s)
}

%update (u: f32[8,1024]) -> f32[8,1024] {
  %u = f32[8,1024]{1,0} parameter(0)
  %row = f32[1,1024]{1,0} slice(%u), slice={[0:1], [0:1024]}
  ROOT %ag = f32[8,1024]{1,0} all-gather(%row), channel_id=3, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}
}

ENTRY %main (p: pred[], x: f32[8,1024]) -> f32[8,1024] {
  %p = pred[] parameter(0)
  %x = f32[8,1024]{1,0} parameter(1)
  ROOT %c = f32[8,1024]{1,0} conditional(%p, %x, %x), true_computation=%update, false_computation=%skip
}
"""


def test_a_conditional_counts_what_either_branch_could_cost():
    layout = hlo.Placement(("data", "fsdp", "tensor"), (8, 1, 1), [0] * 8)
    tally = plan._Walker(COND_HLO, layout).tally()
    assert tally.collectives[("all-gather", "data", False)]["bytes"] == 8 * 1024 * 4
    assert tally.written == 8 * 1024 * 4  # the larger branch's writes: the copy


# The expert exchange as XLA's GPU compiler prints it (model/moe.py): a device's 1024 routed rows
# into a receive buffer of 1280, and the results back; sizes and offsets known only when it runs.
RAGGED_HLO = """HloModule jit_step, is_scheduled=true

ENTRY %main (x: bf16[1024,256], o: s64[8]) -> bf16[1024,256] {
  %x = bf16[1024,256]{1,0} parameter(0)
  %o = s64[8]{0} parameter(1)
  %zeros = bf16[1280,256]{1,0} constant(0)
  %back = bf16[1024,256]{1,0} constant(0)
  %there = ((bf16[1024,256]{1,0}, bf16[1280,256]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, /*index=5*/s64[8]{0}), bf16[1280,256]{1,0}) ragged-all-to-all-start(%x, %zeros, %o, %o, %o, /*index=5*/%o), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
  %got = bf16[1280,256]{1,0} ragged-all-to-all-done(%there)
  ROOT %returned = bf16[1024,256]{1,0} ragged-all-to-all(%got, %back, %o, %o, %o, %o), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}
}
"""


def test_a_ragged_all_to_all_moves_the_rows_it_routes_not_its_buffers():
    """Each way the smaller buffer's bytes (a device's 1024 routed rows), an even share to each of
    the 8 peers: 3 of them in its host of 4, 4 across; the 1280-row receive buffer is not sent."""
    layout = hlo.Placement(("data", "expert", "fsdp", "tensor"), (1, 8, 1, 1), [0] * 4 + [1] * 4)
    moved = plan._Walker(RAGGED_HLO, layout).tally().collectives[("ragged-all-to-all", "expert", True)]
    rows = 1024 * 256 * 2
    assert moved["count"] == 2 and moved["bytes"] == moved["largest_bytes"] * 2 == 2 * rows
    assert moved["nvlink_bytes"] == 2 * 3 / 8 * rows and moved["network_bytes"] == 2 * 4 / 8 * rows
    t = targets.get("h100")
    clock = schedule.Replay(RAGGED_HLO, layout, t, targets.peak_flops(t, "bfloat16")).run()
    assert clock.exposed == pytest.approx(2 * 4 / 8 * rows / t.network_bytes_per_s)


# An async gather started before a matmul and waited for after it; then a synchronous all-reduce.
SCHEDULE_HLO = """HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%gemm (a: bf16[4096,8192], b: bf16[8192,8192]) -> bf16[4096,8192] {
  %a = bf16[4096,8192]{1,0} parameter(0)
  %b = bf16[8192,8192]{1,0} parameter(1)
  ROOT %d = bf16[4096,8192]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[4096,8192], w: bf16[1024,8192], g: f32[1048576]) -> bf16[4096,8192] {
  %a = bf16[4096,8192]{1,0} parameter(0)
  %w = bf16[1024,8192]{1,0} parameter(1)
  %g = f32[1048576]{0} parameter(2)
  %ags = (bf16[1024,8192]{1,0}, bf16[8192,8192]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %mm = bf16[4096,8192]{1,0} fusion(%a, %a), kind=kCustom, calls=%gemm
  %agd = bf16[8192,8192]{1,0} all-gather-done(%ags)
  %ar = f32[1048576]{0} all-reduce(%g), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %out = bf16[4096,8192]{1,0} fusion(%a, %agd), kind=kCustom, calls=%gemm
}
"""


def test_the_schedule_hides_only_what_runs_beside_it():
    t = targets.get("h100")
    peak = targets.peak_flops(t, "bfloat16")
    layout = hlo.Placement(("data", "fsdp", "tensor"), (1, 8, 1), [0] * 8)
    clock = schedule.Replay(SCHEDULE_HLO, layout, t, peak).run()
    matmul = max(2 * 4096 * 8192 * 8192 / peak, 2 * 4096 * 8192 * 2 / t.hbm_bytes_per_s)
    gather = 7 / 8 * 8192 * 8192 * 2 / t.nvlink_bytes_per_s  # an ideal ring, inside one host
    reduce = 2 * 7 / 8 * 1048576 * 4 / t.nvlink_bytes_per_s  # synchronous: all of it exposed
    assert clock.busy == pytest.approx(2 * matmul)
    assert clock.exposed == pytest.approx(max(0.0, gather - matmul) + reduce)
    assert clock.now == pytest.approx(2 * matmul + max(0.0, gather - matmul) + reduce)
    # The floor would hide all of it: the replay is never below the sum of the ops.
    assert clock.now >= clock.busy


def test_a_start_xla_runs_synchronously_is_traced_as_one():
    """`"is_sync":true` on an async start (XLA's mark for a collective it runs on the compute stream)."""
    text = SCHEDULE_HLO.replace(
        "%ar = f32[1048576]{0} all-reduce(%g), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add",
        "%ars = f32[1048576]{0} all-reduce-start(%g), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add, "
        'backend_config={"collective_backend_config":{"is_sync":true}}\n  %ar = f32[1048576]{0} all-reduce-done(%ars)',
    )
    layout = hlo.Placement(("data", "fsdp", "tensor"), (1, 8, 1), [0] * 8)
    events = schedule.trace(text, layout)
    assert [e[0] for e in events if e[0] != "op"] == ["start", "done", "sync", "done"]
    assert schedule.trace(text.replace('"is_sync":true', '"is_sync":false'), layout)[-3][0] == "start"


def test_flops_of_a_matmul_and_of_fused_attention():
    program = hlo.Program(SCHEDULE_HLO)
    entry = program.comps[program.entry]
    assert hlo.flops(entry["mm"], program.comps, entry) == 2 * 4096 * 8192 * 8192
    fwd = hlo.Op("f", "(bf16[2,8,1024,64]{3,1,2,0})", "custom-call", [], (
        ', custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[2,1024,8,64]{3,2,1,0}, '
        'bf16[2,1024,8,64]{3,2,1,0}, bf16[2,1024,8,64]{3,2,1,0}}, backend_config={"mask_type": "CAUSAL"}'
    ))  # fmt: skip
    assert hlo.flops(fwd, {}, {}) == 4 * (2 * 1024 * 8 * 64) * 1024 * 0.5
    bwd = hlo.Op("b", fwd.shape, "custom-call", [], fwd.attrs.replace("fmhaSoftmax", "fmhaSoftmaxBackward"))
    assert hlo.flops(bwd, {}, {}) == 2.5 * hlo.flops(fwd, {}, {})
    # model/grouped.py's kernel: the routed rows' FLOPs its scope names, not its buffer's.
    grouped = hlo.Op("g", "bf16[8,1024,512]{2,1,0}", "custom-call", [], (
        ', custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name='
        '"jit(f)/transpose(jvp(grouped_matmul_flops_4294967296))/body/mpmd_map"}, backend_config={module = "ML"}'
    ))  # fmt: skip
    assert hlo.flops(grouped, {}, {}) == 2 * 4096 * 1024 * 512
    assert not hlo.fp8(grouped, {}, {})
    # Its FP8 kernels (model/grouped_fp8.py) name their scope fp8: the same FLOPs, at the FP8 peak.
    fp8 = hlo.Op("g8", grouped.shape, grouped.opcode, [], grouped.attrs.replace("_matmul_", "_matmul_fp8_"))
    assert "grouped_matmul_fp8_flops_4294967296" in fp8.attrs
    assert hlo.flops(fp8, {}, {}) == 2 * 4096 * 1024 * 512 and hlo.fp8(fp8, {}, {})


# The microbatch loop as XLA's GPU compiler leaves it: no known_trip_count; `i < 3` from 0.
LOOP_HLO = """HloModule jit_step, is_scheduled=true

%compare_fused (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%p, %three), direction=LT
}

%cond (c: (s32[], f32[1024])) -> pred[] {
  %c = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%compare_fused
}

%body (c: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %c = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[1024]{0} get-tuple-element(%c), index=1
  %y = f32[1024]{0} exponential(%x)
  ROOT %t = (s32[], f32[1024]{0}) tuple(%i, %y)
}

ENTRY %main (x: f32[1024]) -> (s32[], f32[1024]) {
  %x = f32[1024]{0} parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[1024]{0}) tuple(%start, %x)
  ROOT %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_loop_without_a_known_trip_count_runs_as_its_condition_says():
    program = hlo.Program(LOOP_HLO)
    entry = program.comps[program.entry]
    assert program.trip_count(entry["loop"], entry) == 3
    layout = hlo.Placement(("data", "fsdp", "tensor"), (1, 1, 1), [0])
    assert plan._Walker(LOOP_HLO, layout).tally().written == 3 * 1024 * 4 + 4  # + the copy of i


def test_the_replay_counts_causal_attention_as_the_model_flops_do():
    """One convention (docs/scaling.md): causal attention at half. The replay's cuDNN causal
    forward and backward (their QK^T, PV and the backward's recomputed scores: 7 b T^2 d) are at
    least the model FLOPs' attention term (6 L d T a token: 6 b T^2 d a layer), so the
    schedule-aware bound cannot fall below the compute floor at any window (counted in full,
    12 b T^2 d, it did at 131,072 tokens)."""
    b, t, h, hd = 1, 131072, 32, 128
    fwd = hlo.Op("f", "(bf16[1,32,131072,128]{3,1,2,0})", "custom-call", [], (
        f', custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={{bf16[{b},{t},{h},{hd}]{{3,2,1,0}}, '
        f'bf16[{b},{t},8,{hd}]{{3,2,1,0}}}}, backend_config={{"mask_type": "CAUSAL"}}'
    ))  # fmt: skip
    bwd = hlo.Op("b", fwd.shape, "custom-call", [], fwd.attrs.replace("fmhaSoftmax", "fmhaSoftmaxBackward"))
    replayed = hlo.flops(fwd, {}, {}) + hlo.flops(bwd, {}, {})
    assert replayed == 7 * b * t * t * h * hd
    cfg = load_config(["--config", str(ROOT / "configs/llama3_8b.yaml"), "--model.seq_len", str(t)])
    lookup = cfg.model.vocab_size * cfg.model.d_model  # untied input embedding: no matmul, so 6N = 0
    attention = flops_per_token(cfg.model, lookup) * b * t / cfg.model.n_layer  # one layer, b sequences
    assert attention == 6 * b * t * t * h * hd <= replayed


PLANS = sorted((ROOT / "bench/results").glob("plan_*.json"))


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_every_committed_plans_figures_by_hand(path):
    """Each figure of every committed plan from its parts, as its docstrings define them; and
    the schedule-aware bound never below the floor (one attention-FLOP convention)."""
    p = json.loads(path.read_text())
    target = targets.get(p["target"])
    assert p["usable_bytes_per_device"] == int(0.75 * target.memory_bytes)
    if not p["compiled"]:
        assert not p["fits"] and p["state_bytes_per_device"] > p["usable_bytes_per_device"]
        return
    assert p["fits"] == memory.fits(
        max(p["total_bytes_per_device"], p["eval_total_bytes_per_device"]), p["usable_bytes_per_device"]
    )
    terms, devices = p["bound_terms_s"], p["hosts"] * p["gpus_per_host"]
    peak = targets.peak_flops(target, p["dtype"])  # FP8 GEMMs at FP8's, and then the MFU too
    fp8_peak, fp8_flops = targets.peak_flops(target, "float8"), p.get("fp8_flops_per_device", 0)
    assert terms["compute"] == pytest.approx(
        p["model_flops_per_step"] / devices / targets.peak_flops(target, p.get("mfu_dtype", p["dtype"]))
    )
    assert terms["nvlink"] == pytest.approx(
        sum(c["nvlink_bytes"] for c in p["collectives"]) / target.nvlink_bytes_per_s
    )
    assert terms["network"] == pytest.approx(
        sum(c["network_bytes"] for c in p["collectives"]) / target.network_bytes_per_s
    )
    assert terms["hbm"] == pytest.approx(p["hbm_bytes_floor"] / target.hbm_bytes_per_s)
    if "program" in terms:  # the program's own matmuls: remat, a pipeline's bubble and padding in them
        assert terms["program"] == pytest.approx(
            (p["compiled_flops_per_device"] - fp8_flops) / peak + fp8_flops / fp8_peak
        )
    assert p["step_time_lower_bound_s"] == max(terms.values()) == terms[p["bound_limited_by"]]
    assert p["mfu_ceiling"] == pytest.approx(terms["compute"] / p["step_time_lower_bound_s"])
    assert p["schedule_bound_s"] >= p["step_time_lower_bound_s"]
    assert p["schedule_bound_s"] == pytest.approx(p["schedule_busy_s"] + p["exposed_comm_s"])
    assert p["schedule_mfu_ceiling"] == pytest.approx(terms["compute"] / p["schedule_bound_s"])


@pytest.mark.parametrize(
    ("case", "matmul_params", "layers", "width", "window"),
    [
        ("gpt2_124m_h100x8_data8", 0, 12, 768, 1024),  # tied embedding: every param a matmul's
        ("llama3_8b_h100x8", 128256 * 4096, 32, 4096, 8192),  # the input embedding is a lookup
    ],
)
def test_model_flops_of_a_committed_plan_by_hand(case, matmul_params, layers, width, window):
    p = json.loads((ROOT / f"bench/results/plan_{case}.json").read_text())
    per_token = 6 * (p["n_params"] - matmul_params) + 6 * layers * width * window  # attention halved
    assert p["model_flops_per_step"] == pytest.approx(per_token * p["global_batch"] * window)


def test_the_docs_plan_tables_are_made_from_the_committed_plans():
    """docs/scaling.md's and docs/moe.md's plan tables are bench/scaling_tables.py's rendering of
    bench/results, and every committed plan has its row: a figure cannot go stale by hand."""
    spec = importlib.util.spec_from_file_location("scaling_tables", ROOT / "bench/scaling_tables.py")
    assert spec is not None and spec.loader is not None
    made = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(made)
    assert {f"plan_{n}" for n in [*made.DENSE, *made.MOE]} == {p.stem for p in PLANS}
    tables = made.tables()
    assert {ROOT / "docs/scaling.md", ROOT / "docs/moe.md"} <= set(made.BLOCKS)
    for page, names in made.BLOCKS.items():
        doc = page.read_text()
        assert made.render(doc, tables, names, page) == doc, "run: .venv/bin/python bench/scaling_tables.py"


def test_an_async_start_counts_its_result_not_its_operand_again():
    """An async start's result opens with its operand: a collective-permute moves its buffer
    once (not twice), an all-gather over 8 its gathered buffer (not an eighth more)."""
    ops = {"w": hlo.Op("w", "bf16[1024,8192]{1,0}", "parameter", [], "")}
    layout = hlo.Placement(("pipeline", "fsdp"), (2, 8), [0] * 8 + [1] * 8)
    gather = hlo.Op("g", "(bf16[1024,8192]{1,0}, bf16[8192,8192]{1,0})", "all-gather-start", ["w"],
                    ", channel_id=1, replica_groups=[2,8]<=[16], dimensions={0}")  # fmt: skip
    t = hlo.transfer(gather, ops, layout)
    assert t.size == 8192 * 8192 * 2 and t.nvlink == 7 / 8 * 8192 * 8192 * 2 and t.network == 0
    permute = hlo.Op("p", "(bf16[1024,8192]{1,0}, bf16[1024,8192]{1,0}, u32[]{:S(2)}, u32[]{:S(2)})",
                     "collective-permute-start", ["w"],
                     ", channel_id=2, source_target_pairs={{0,8},{8,0}}")  # fmt: skip
    t = hlo.transfer(permute, ops, layout)
    assert t.size == 1024 * 8192 * 2 + 2 * 4  # its buffer once, and the two u32 contexts
    assert t.crosses_hosts and t.network == t.size and t.nvlink == 0
    # An all-reduce-start's result is its result only: nothing to take off.
    reduce = hlo.Op("r", "bf16[1024,8192]{1,0}", "all-reduce-start", ["w"], ", replica_groups=[2,8]<=[16]")
    assert hlo.transfer(reduce, ops, layout).size == 1024 * 8192 * 2


def test_each_peer_row_is_sourced_and_ours_is_planned_at_the_fastest_peers_gpus_and_batch():
    """bench/peers.py: every published figure names its page, and jaxtrain's plan for a model is
    at the GPU count and global batch of its fastest peer (or says why not)."""
    spec = importlib.util.spec_from_file_location("peers", ROOT / "bench/peers.py")
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    for model, trainer, gpus, _, _, precision, tokens, source in peers.PEERS:
        assert source.startswith("https://") and tokens > 0 and gpus >= 8 and precision, (model, trainer)
    for model, name in peers.OURS.items():
        path = ROOT / f"bench/results/plan_{name}.json"
        rows = [r for r in peers.PEERS if r[0] == model]
        if not path.exists() or not rows or model in peers.NOTE:
            assert rows or model in peers.NO_PEER, model
            continue
        p = json.loads(path.read_text())
        best = max(rows, key=lambda r: r[6])
        assert (p["hosts"] * p["gpus_per_host"], f"{p['global_batch']} x {p['seq_len']}") == best[2:4], model
