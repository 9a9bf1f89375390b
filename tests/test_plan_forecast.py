"""jaxtrain/plan/forecast.py: each op class and transfer at its named rate, by hand; the expert
exchange as XLA's GPU runtime runs it; the committed plans' schedules re-costed without a compile
(their `schedule_trace`): the bound and the forecast as planned; the forecast within
bench/calibration.py's tolerances of every measured run, and its fitted constants at the fit."""

import importlib.util
import json
from pathlib import Path

import pytest

from jaxtrain.errors import UserError
from jaxtrain.observe import links
from jaxtrain.plan import cli as plan_cli
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
    k = forecast.KERNEL_S  # each kernel's fixed cost, then its own time
    rate = forecast.GEMM_EFFICIENCY * 989.4e12
    gemm = 2 * 8192**3
    assert costs.op("gemm", gemm, 0, 0, False) == pytest.approx(k + gemm / rate)
    # A skinny GEMM is memory-bound: its bytes at 2.8 TB/s.
    assert costs.op("gemm", 1e6, 2.8e9, 0, False) == pytest.approx(k + 1e-3)
    assert costs.op("memory", 0, 2.8e9, 0, False) == pytest.approx(k + 1e-3)
    assert costs.op("memory", 0, 0, 0, False) == pytest.approx(8.3e-6)
    # cuDNN attention at its measured rate for the keys' length (the nearest length at or below).
    assert costs.op("attention", 529e12, 0, 8192, True) == pytest.approx(k + 1.0)
    assert costs.op("attention", 529e12, 0, 9000, True) == pytest.approx(k + 1.0)
    assert costs.op("attention_bwd", 518e12, 0, 8192, True) == pytest.approx(k + 1.0)
    assert costs.op("attention", 315e12, 0, 100, True) == pytest.approx(k + 1.0)  # below 512: 512's
    # The experts' kernel as a GEMM, held by the most loaded expert.
    assert costs.op("grouped", rate, 0, 0, False) == pytest.approx(k + 1.25)
    # Its FP8 tiles (`pallas_fp8`) at the same fraction of the FP8 peak (1,978.9 TFLOP/s), held the same.
    assert costs.op("grouped_fp8", 1978.9e12 * forecast.GEMM_EFFICIENCY, 0, 0, False) == pytest.approx(
        k + 1.25
    )


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
    # An all-to-all (NCCL's) as an all-gather.
    assert costs.legs(["all-to-all", gb, 350 * gb, 0.0])["nvlink"] == pytest.approx(1 + 5.5e-6)
    # A small message is mostly latency.
    assert costs.legs(["all-gather", 8, 7.0, 0.0])["nvlink"] == pytest.approx(5.5e-6 + 7 / 350e9)


def test_the_ragged_exchange_as_xla_runs_it_and_the_padded_one_beside_it():
    """Inside a host, XLA's one-shot kernel at 16.42 GiB/s whatever NVLink can do; across hosts, a
    send and a receive for each (update, peer) slot at 12 us, bytes at the network's rate, and the
    host's two waits; the padded all-to-all: peers x the bytes at NCCL's rate, no slots, no wait,
    no load. The slots and peers come from the trace (peers from the bytes: 7/8 of 8 MiB sent)."""
    costs = forecast.Achievable(H100, PEAK, expert_load=1.25)
    padded = forecast.Achievable(H100, PEAK, expert_load=1.25, exchange="padded")
    mib8 = 8 * 2**20
    local = ["ragged-all-to-all", mib8, 7 / 8 * mib8, 0.0, 128]  # 8 peers x 16 experts each
    assert links.peers(local) == 8 and links.slots(local) == 128
    assert costs.legs(local) == {
        "nvlink": pytest.approx(5.5e-6 + 1.25 * 7 / 8 * mib8 / (16.42 * 2**30)),
        "network": 0.0,
    }
    assert costs.host_wait(local) == 0.0  # one process's GPUs: no host wait
    assert padded.legs(local)["nvlink"] == pytest.approx(5.5e-6 + 8 * 7 / 8 * mib8 / 350e9)
    # 128 peers on 128 hosts (DeepSeek-V3: 256 slots), one GPU of each host in the group.
    across = ["ragged-all-to-all", 128 * 2**20, 0.0, 127 / 128 * 128 * 2**20, 256]
    assert links.peers(across) == 128
    network = 24e-6 + 1.25 * 127 * 2**20 / 25e9 + 256 * 12e-6
    assert costs.legs(across) == {"nvlink": 0.0, "network": pytest.approx(network)}
    assert costs.host_wait(across) == pytest.approx(2 * 24e-6)
    assert padded.host_wait(across) == 0.0
    assert padded.legs(across)["network"] == pytest.approx(24e-6 + 128 * 127 * 2**20 / 25e9)
    # A program compiled with the padded exchange (schedule.PADDED) costs the same either way.
    compiled_padded = ["padded-exchange", 8 * mib8, 7 * mib8, 0.0, 128]
    assert links.as_run(local, "padded") == pytest.approx(compiled_padded)
    assert links.as_run(compiled_padded, "ragged") == pytest.approx(local)
    for way in ("ragged", "padded"):
        costs_way = forecast.Achievable(H100, PEAK, 1.25, way)
        assert costs_way.legs(compiled_padded) == pytest.approx(costs_way.legs(local))
    assert forecast.Achievable(H100, PEAK, 1.25).legs(compiled_padded) == padded.legs(local)
    # A trace from before the slots were stored: one update a peer.
    assert links.slots(across[:4]) == 128
    # auto's pick at job start, from the job's shape alone: the same transfers, the faster way.
    assert links.exchange_xfer(mib8, 8, 8, 16) == pytest.approx(local)
    assert links.exchange_xfer(128 * 2**20, 128, 1, 2) == pytest.approx(across)
    seconds = links.exchange_seconds(local, 1.25)
    assert seconds == pytest.approx(
        {"ragged": costs.legs(local)["nvlink"], "padded": padded.legs(local)["nvlink"]}
    )
    assert links.pick_exchange(local, 1.25) == "padded"  # 0.52 ms against 0.17 ms
    assert links.pick_exchange(across, 1.25) == "ragged"  # 128 x the bytes padded
    # Under a capacity factor each peer's buffer holds that factor x an even share
    # (parallel/expert.py pair_bound): the padded one moves 1.25 x the ragged one's bytes, not 8 x.
    assert links.widen(1.25, 8) == 1.25 and links.widen(0.0, 8) == 8.0 and links.widen(16.0, 8) == 8.0
    capped = ["padded-exchange", 1.25 * mib8, 1.25 * 7 / 8 * mib8, 0.0, 128]
    assert links.as_run(local, "padded", 1.25) == pytest.approx(capped)
    assert links.as_run(capped, "ragged", 1.25) == pytest.approx(local)
    wide = forecast.Achievable(H100, PEAK, expert_load=1.25, exchange="padded", wide=1.25)
    assert wide.legs(local)["nvlink"] == pytest.approx(5.5e-6 + 1.25 * 7 / 8 * mib8 / 350e9)
    assert links.exchange_seconds(across, 1.25, wide=1.25)["padded"] == pytest.approx(
        24e-6 + 1.25 * 127 * 2**20 / 25e9
    )
    assert links.pick_exchange(across, 1.25, wide=1.25) == "padded"  # no slots, 1.25 x the bytes


def test_a_held_host_drains_the_collectives_stream_first():
    """XLA's ragged all-to-all across hosts blocks the host until the collectives' stream is done:
    a gather in flight is waited for, then the host's own hold, then the exchange itself."""

    class Held(_Seconds):
        def host_wait(self, xfer: list) -> float:
            return 0.5 if xfer[0] == "ragged-all-to-all" else 0.0

    gather = ["start", "gather", ["all-gather", 100, 0.0, 100.0]]  # 2 s on the network
    exchange = ["start", "x", ["ragged-all-to-all", 50, 0.0, 50.0, 4]]  # 1 s on the network
    clock = schedule.replay(
        [gather, ["op", "gemm", 1, 0, 0, False, 1], exchange, ["done", ["x", "gather"]]], Held()
    )
    # 1 s of the GEMM, 1 s more for the gather, 0.5 s held, then the exchange's 1 s.
    assert clock.now == pytest.approx(3.5) and clock.exposed == pytest.approx(2.5)
    # The bound has no host in it: the exchange queues behind the gather on the network, 3 s.
    assert schedule.replay([gather, exchange, ["done", ["x", "gather"]]], _Seconds()).now == pytest.approx(
        3.0
    )


class _Seconds:
    """schedule.Costs by hand: an op takes its FLOPs in seconds; NVLink moves 4 bytes a second, the
    network 50."""

    def op(self, kind: str, flops: float, written: float, keys: int, causal: bool) -> float:
        return flops

    def legs(self, xfer: list) -> dict[str, float]:
        return {"nvlink": xfer[2] / 4, "network": xfer[3] / 50}

    def host_wait(self, xfer: list) -> float:
        return 0.0


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
    assert links.expert_load(1.25, 128) == 1.25 and links.expert_load(2.0, 8) == 2.0
    assert links.expert_load(0.0, 8) == links.DROPLESS_LOAD and links.expert_load(1.25, 0) == 1.0


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
    # An expert exchange XLA runs ragged: the step and its largest exchange forecast both ways, and
    # auto's pick (one exchange's costs, as at job start) is the step's faster way (within 1%).
    # Plans made since the padded buffers were capped carry their width (links.widen) to cost it by.
    wide = f.get("exchange", {}).get("wide", 0.0)
    both = forecast.exchanges(events, target, peak, f["expert_load"], wide)
    assert f.get("exchange", {}) == pytest.approx(both)
    if both:
        assert both["auto"] == ("ragged" if both["one_ragged_s"] <= both["one_padded_s"] else "padded")
        assert both[f"{both['auto']}_s"] <= 1.01 * min(both["ragged_s"], both["padded_s"])
    gpus, tokens = p["hosts"] * p["gpus_per_host"], p["global_batch"] * p["seq_len"]
    assert f["tokens_per_s_per_gpu"] == pytest.approx(tokens / f["step_time_s"] / gpus)
    mfu_peak = targets.peak_flops(target, p.get("mfu_dtype", p["dtype"]))
    assert f["mfu"] == pytest.approx(p["model_flops_per_step"] / gpus / mfu_peak / f["step_time_s"])
    assert p["schedule_tokens_per_s_per_gpu"] == pytest.approx(tokens / p["schedule_bound_s"] / gpus)


def test_the_forecast_is_unbiased_and_within_tolerance_of_every_measured_run():
    """Every row, published and measured here, re-costed from its committed trace at the constants
    as they are now: each within ROW_TOLERANCE, the mean signed error within MEAN_TOLERANCE. A
    change to a constant or to the replay that biases the forecast fails here."""
    calibration = _calibration()
    errors = {r["case"]: r["error"] for r in calibration.rows()}
    assert len(errors) == len(calibration.RUNS) + len(calibration.MEASURED_HERE) == 6
    assert all(abs(e) <= calibration.ROW_TOLERANCE for e in errors.values()), errors
    assert abs(sum(errors.values()) / len(errors)) <= calibration.MEAN_TOLERANCE, errors
    # Each row's error is its re-costed forecast over its measured median step.
    (row,) = [r for r in calibration.rows() if r["case"] == "gpt2_124m_h200x1_bench"]
    assert row["measured_step_s"] == pytest.approx(1.0148120628)  # gpu_bench_h200.json's median step
    assert row["error"] == pytest.approx(row["forecast_s"] / row["measured_step_s"] - 1)


def test_the_fitted_constants_are_the_fit_of_every_row():
    """forecast.py's GEMM_EFFICIENCY and KERNEL_S are the least-squares fit over every row (as
    rounded there): a new measured row, or a changed plan, that moves the fit fails here until the
    constants are fitted again and the plans re-costed (bench/recost_plans.py)."""
    fitted = _calibration().fit(_calibration().every_run())
    assert fitted["gemm_efficiency"] == pytest.approx(forecast.GEMM_EFFICIENCY, abs=5e-4)
    assert fitted["kernel_s"] == pytest.approx(forecast.KERNEL_S, abs=5e-8)


@pytest.mark.parametrize("run", _calibration().MEASURED_HERE, ids=lambda r: r["case"])
def test_each_run_measured_here_is_planned_as_the_same_job(run):
    """The plan beside a run jaxtrain measured is of the same job: the GPU, the rows, microbatches
    and window of a step, and the matmul precision; its step is the run's median step."""
    calibration = _calibration()
    p = calibration.plan(run["case"])
    bench = json.loads((ROOT / "bench/results" / run["bench"]).read_text())
    measured = bench["runs"][run["run"]]
    shape = bench.get("shapes", {}).get(run["run"].split("/")[0], [])  # absent: configs/gpt2_124m.yaml's
    assert measured["device_kind"] == targets.get(p["target"]).device_kind == "NVIDIA H200"
    rows, accumulation, seq_len = measured["batch"]
    assert (p["global_batch"], p["accumulation"], p["seq_len"]) == (rows, accumulation, seq_len)
    assert ("--model.matmul" in shape) == (p["mfu_dtype"] == "float8")
    (row,) = [r for r in calibration.rows() if r["case"] == run["case"]]
    assert row["measured_step_s"] == measured["step_time_s"]  # the median step, one statistic
    assert row["forecast_s"] == pytest.approx(p["forecast"]["step_time_s"], rel=1e-9)  # re-costed


def test_the_plan_prints_its_exchange_both_ways_and_auto_s_pick():
    """Each MoE plan's summary says which exchange it compiled, the step both ways and the one auto
    takes with one exchange's costs: Qwen3-30B-A3B on 4 x 8 H100, inside each host."""
    p = json.loads((ROOT / "bench/results/plan_qwen3_30b_a3b_h100_4x8.json").read_text())
    assert planner.exchange_line(p["forecast"]["exchange"]) == (
        "compiled padded; step forecast 18.167 s ragged, 4.149 s padded; auto takes padded: one exchange "
        "0.4 ms against 8.3 ms ragged (observe/links.py)"
    )


def test_a_measured_expert_load_re_costs_the_plan():
    """--expert_load X: the plan's forecast at a load measured (or 1, routing forced even, as the
    peers' runs force it), re-costed from its trace; the committed plans at their own load are their
    own forecast. A load below 1 is one line before anything compiles."""
    p = json.loads((ROOT / "bench/results/plan_qwen3_30b_a3b_h100_4x8.json").read_text())
    assert planner.recost(p) == p
    even = planner.recost(p, 1.0)["forecast"]
    assert even["expert_load"] == 1.0 and even["step_time_s"] < p["forecast"]["step_time_s"]
    assert even["exchange"]["padded_s"] < p["forecast"]["exchange"]["padded_s"]  # the experts' GEMMs
    assert even["tokens_per_s_per_gpu"] == pytest.approx(256 * 4096 / even["step_time_s"] / 32)
    with pytest.raises(UserError, match=r"^--expert_load 0.5: the most loaded expert's rows over an even"):
        plan_cli.main(["--expert_load", "0.5", "--config", str(ROOT / "configs/moe_tiny.yaml")], "")
