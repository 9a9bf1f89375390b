"""jaxtrain/plan/forecast.py: each op class and transfer at its named rate, by hand; the committed
plans' schedules re-costed without a compile (their `schedule_trace`): the bound as planned, the
forecast as planned and within bench/calibration.py's tolerance of each published run."""

import importlib.util
import json
from pathlib import Path

import pytest

from jaxtrain.plan import forecast, planner, schedule, targets

ROOT = Path(__file__).resolve().parent.parent
H100 = targets.get("h100")
PEAK = targets.peak_flops(H100, "bfloat16")


def _calibration():
    spec = importlib.util.spec_from_file_location("calibration", ROOT / "bench/calibration.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_op_class_at_its_measured_rate():
    costs = forecast.Achievable(H100, PEAK, expert_load=1.25)
    gemm = 2 * 8192**3
    assert costs.op("gemm", gemm, 0, 0, False) == pytest.approx(gemm / 780e12)
    # A skinny GEMM is memory-bound: its bytes at 2.8 TB/s.
    assert costs.op("gemm", 1e6, 2.8e9, 0, False) == pytest.approx(1e-3)
    assert costs.op("memory", 0, 2.8e9, 0, False) == pytest.approx(1e-3)
    # cuDNN attention at its measured rate for the keys' length (the nearest length at or below).
    assert costs.op("attention", 529e12, 0, 8192, True) == pytest.approx(1.0)
    assert costs.op("attention", 529e12, 0, 9000, True) == pytest.approx(1.0)
    assert costs.op("attention_bwd", 518e12, 0, 8192, True) == pytest.approx(1.0)
    assert costs.op("attention", 315e12, 0, 100, True) == pytest.approx(1.0)  # below 512: 512's
    # The experts' kernel as a GEMM, held by the most loaded expert.
    assert costs.op("grouped", 780e12, 0, 0, False) == pytest.approx(1.25)
    # Its FP8 tiles (`pallas_fp8`) at the same fraction of the FP8 peak (1,978.9 TFLOP/s), held the same.
    assert costs.op("grouped_fp8", 1978.9e12 * forecast.GEMM_EFFICIENCY, 0, 0, False) == pytest.approx(1.25)


def test_each_transfer_at_its_bus_bandwidth_plus_a_latency():
    costs = forecast.Achievable(H100, PEAK, expert_load=1.25)
    gb = 1e9
    assert costs.legs(["all-gather", gb, 350 * gb, 0.0]) == {
        "nvlink": pytest.approx(1 + 5.5e-6),
        "network": 0.0,
    }
    assert costs.legs(["all-reduce", gb, 460 * gb, 0.0])["nvlink"] == pytest.approx(1 + 5.5e-6)
    assert costs.legs(["reduce-scatter", gb, 0.0, 25 * gb])["network"] == pytest.approx(1 + 24e-6)
    assert costs.legs(["all-reduce", gb, 0.0, 42.5 * gb])["network"] == pytest.approx(1 + 24e-6)
    # The expert exchange lasts as long as its most loaded receiver.
    assert costs.legs(["ragged-all-to-all", gb, 350 * gb, 0.0])["nvlink"] == pytest.approx(1.25 + 5.5e-6)
    # A small message is mostly latency.
    assert costs.legs(["all-gather", 8, 7.0, 0.0])["nvlink"] == pytest.approx(5.5e-6 + 7 / 350e9)


class _Seconds:
    """schedule.Costs by hand: an op takes its FLOPs in seconds; NVLink moves 4 bytes a second, the
    network 50."""

    def op(self, kind: str, flops: float, written: float, keys: int, causal: bool) -> float:
        return flops

    def legs(self, xfer: list) -> dict[str, float]:
        return {"nvlink": xfer[2] / 4, "network": xfer[3] / 50}


def test_the_replay_says_what_the_stream_waits_on():
    """Each wait is charged to the transfer waited for, by kind, bytes and whether it crosses hosts;
    the planner prints the longest (planner.forecast_waits)."""
    events = [
        ["start", "gather", ["all-gather", 100, 0.0, 100.0]],  # the network for 2 s
        ["op", "gemm", 1, 0, 0, False, 1],  # 1 s: the gather's done waits 1 s more
        ["done", ["gather"]],
        ["sync", ["all-reduce", 2, 2.0, 0.0]],  # 0.5 s on NVLink, all of it waited
        ["loop", 2, [["start", "sum", ["all-reduce", 2, 2.0, 0.0]], ["done", ["sum"]]]],  # 0.5 s each
    ]
    clock = schedule.replay(events, _Seconds())
    assert clock.now == pytest.approx(3.5) and clock.exposed == pytest.approx(2.5)
    assert clock.waited == {
        ("all-gather", 100, True): (pytest.approx(1.0), 1),
        ("all-reduce", 2, False): (pytest.approx(1.5), 3),
    }
    # Llama 3 70B on 128 x 8 in FP8: data's all-reduce of the float32 gradient at the step's end,
    # then tensor parallelism's all-reduces, synchronous on the compute stream (xla_env).
    p = json.loads((ROOT / "bench/results/plan_llama3_70b_h100_128x8_fp8.json").read_text())
    assert planner.forecast_waits(p).startswith(
        "371 ms on 1 all-reduce of 8.15 GB across hosts, 119 ms on 400 all-reduces of 134 MB, "
    )


def test_a_synchronous_collective_runs_beside_the_async_ones_and_shares_their_links():
    """XLA runs a synchronous collective on the compute stream, not behind the async stream's
    transfers: it starts at once; one in flight bound by a link it uses ends its time there later."""
    gather = ["start", "gather", ["reduce-scatter", 100, 4.0, 100.0]]  # 1 s of NVLink, 2 s of network
    tensor = ["sync", ["all-reduce", 2, 2.0, 0.0]]  # 0.5 s on NVLink: the gather's spare link
    scale = ["sync", ["all-reduce", 1, 0.0, 5.0]]  # 0.1 s across hosts: the gather's own bound
    clock = schedule.replay([gather, tensor, scale, ["done", ["gather"]]], _Seconds())
    # 0.5 s, then 0.1 s, then the gather's 2 s plus the scale's 0.1 s, from 0: 2.1 s in all.
    assert clock.now == pytest.approx(2.1) and clock.busy == 0.0
    assert clock.waited[("all-reduce", 2, False)] == (pytest.approx(0.5), 1)
    assert clock.waited[("reduce-scatter", 100, True)] == (pytest.approx(1.5), 1)
    # Queued behind the gather as an async one, the same all-reduce would wait for all of it.
    queued = [gather, ["start", "sum", tensor[1]], ["done", ["sum"]], ["done", ["gather"]]]
    assert schedule.replay(queued, _Seconds()).now == pytest.approx(2.5)


def test_the_expert_load_is_the_capacity_factor():
    assert forecast.expert_load(1.25, 128) == 1.25 and forecast.expert_load(2.0, 8) == 2.0
    assert forecast.expert_load(0.0, 8) == forecast.DROPLESS_LOAD and forecast.expert_load(1.25, 0) == 1.0


TRACED = [
    p for p in sorted((ROOT / "bench/results").glob("plan_*.json")) if "schedule_trace" in p.read_text()
]


@pytest.mark.parametrize("path", TRACED, ids=lambda p: p.stem)
def test_a_committed_plan_costed_again_from_its_trace(path):
    """The schedule stored in the plan replays to the plan's own bound and forecast, and each
    forecast figure is its step time's, by hand."""
    p = json.loads(path.read_text())
    target = targets.get(p["target"])
    peak = targets.peak_flops(target, p["dtype"])
    events = p["schedule_trace"]
    bound = schedule.replay(events, schedule.Roofline(target, peak))
    assert bound.now == pytest.approx(p["schedule_bound_s"], rel=1e-9)
    f = p["forecast"]
    likely = forecast.forecast(events, target, peak, f["expert_load"])
    assert likely.now == pytest.approx(f["step_time_s"], rel=1e-9)
    assert likely.now >= bound.now  # every rate at or below the bound's
    gpus, tokens = p["hosts"] * p["gpus_per_host"], p["global_batch"] * p["seq_len"]
    assert f["tokens_per_s_per_gpu"] == pytest.approx(tokens / f["step_time_s"] / gpus)
    mfu_peak = targets.peak_flops(target, p.get("mfu_dtype", p["dtype"]))
    assert f["mfu"] == pytest.approx(p["model_flops_per_step"] / gpus / mfu_peak / f["step_time_s"])
    assert p["schedule_tokens_per_s_per_gpu"] == pytest.approx(tokens / p["schedule_bound_s"] / gpus)


@pytest.mark.parametrize("run", _calibration().RUNS, ids=lambda r: r["case"])
def test_the_forecast_is_within_tolerance_of_each_published_run(run):
    """Re-costed from the committed trace with the constants as they are now: a change to a
    constant or to the replay that moves a forecast out of the tolerance fails here."""
    calibration = _calibration()
    p = calibration.plan(run["case"])
    target = targets.get(p["target"])
    step = forecast.forecast(
        p["schedule_trace"], target, targets.peak_flops(target, p["dtype"]), p["forecast"]["expert_load"]
    ).now
    assert abs(step / run["measured_step_s"] - 1) <= calibration.TOLERANCE, (step, run)


@pytest.mark.parametrize("run", _calibration().MEASURED_HERE, ids=lambda r: r["case"])
def test_each_run_measured_here_is_planned_as_the_same_job(run):
    """The plan beside a run jaxtrain measured is of the same job: the GPU, the rows, microbatches
    and window of a step, and the matmul precision; its step time is the run's tokens over its rate."""
    calibration = _calibration()
    p = calibration.plan(run["case"])
    bench = json.loads((ROOT / "bench/results" / run["bench"]).read_text())
    measured = bench["runs"][run["run"]]
    shape = bench.get("shapes", {}).get(run["run"].split("/")[0], [])  # absent: configs/gpt2_124m.yaml's
    assert measured["device_kind"] == targets.get(p["target"]).device_kind == "NVIDIA H200"
    rows, accumulation, seq_len = measured["batch"]
    assert (p["global_batch"], p["accumulation"], p["seq_len"]) == (rows, accumulation, seq_len)
    assert ("--model.matmul" in shape) == (p["mfu_dtype"] == "float8")
    (row,) = [r for r in calibration.measured_rows() if r["case"] == run["case"]]
    assert row["measured_step_s"] == pytest.approx(rows * seq_len / measured["tokens_per_sec"])
    assert row["error"] == pytest.approx(p["forecast"]["step_time_s"] / row["measured_step_s"] - 1)
