"""Health check: the verdicts on made-up facts, then the real script on 1, 2 and 4 CPU processes.

pytest tests/test_health.py                            # all (about 40 s on 2 busy cores)
pytest tests/test_health.py -m "not multiprocess"      # verdicts only, a few seconds
"""

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import pytest
from processes import clean_env

from jaxtrain.cluster.detect import LaunchSpec
from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.config import DistConfig
from jaxtrain.health import busbw, cli, numerics
from jaxtrain.health import checks as hc
from jaxtrain.health.exchange import Exchange
from jaxtrain.health.runner import HealthCheck, HealthOptions

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "test_distributed.py"
FAST = ["--max_bytes", "8K", "--iters", "3"]  # the check itself, not the figures, is under test


def record(pid, host="h0", count=2, **changes):
    versions = {"python": "3.11.7", "jax": "0.10.2", "jaxlib": "0.10.2", "plugin": "none"}
    r = {"process_id": pid, "host": host, "device_count": count, "platform": "cpu", "device_kind": "cpu"}
    r |= {"memory_bytes": None, "jax_platforms": "cpu", "versions": versions}
    return r | changes


def test_outliers_expected_majority_and_tie():
    assert hc.outliers({0: 2, 1: 4, 2: 2}) == (2, [1])
    assert hc.outliers({0: 2, 1: 4, 2: 2}, expected=4) == (4, [0, 2])
    assert hc.outliers({0: 2, 1: 4}) == (None, [0, 1])  # nobody can say which side is wrong


def test_devices_name_the_odd_process_and_host():
    records = {0: record(0), 1: record(1, count=4), 2: record(2)}
    check = hc.judge_devices(records)
    assert not check.ok and list(check.bad) == [1] and "device count 4, expected 2" in check.bad[1]
    check = hc.judge_devices({0: record(0), 1: record(1, count=4)}, per_process=2)
    assert list(check.bad) == [1]
    check = hc.judge_devices({0: record(0, "a"), 1: record(1, "a"), 2: record(2, "b")}, per_host=4)
    assert list(check.bad) == [2] and "host has 2 devices, expected 4" in check.bad[2]
    assert hc.judge_devices({0: record(0), 1: record(1)}, per_process=2, per_host=4).ok


def test_gpu_wheel_on_cpu_devices_is_named():
    r = record(0, jax_platforms="")
    r["versions"] = r["versions"] | {"plugin": "jax-cuda12-plugin 0.10.2"}
    check = hc.judge_devices({0: r})
    assert not check.ok and "found no accelerator" in check.bad[0]


def test_software_mismatch_names_the_host():
    old = record(2, host="node2")
    old["versions"] = old["versions"] | {"jax": "0.9.0"}
    check = hc.judge_software({0: record(0), 1: record(1), 2: old})
    assert not check.ok and check.bad == {2: "jax 0.9.0, expected 0.10.2"}
    report = hc.Report()
    report.set_processes({0: record(0), 1: record(1), 2: old})
    report.add(check)
    assert report.bad_hosts() == ["node2"] and not report.to_json()["healthy"]


def test_storage_groups_processes_by_what_they_see():
    shared = {"error": "", "seen": [0, 1, 2]}
    results = {0: shared, 1: shared, 2: shared, 3: {"error": "", "seen": [3]}}
    assert not (check := hc.judge_storage(results, "ckpt")).ok
    assert list(check.bad) == [3] and "processes [0, 1, 2]" in check.bad[3]
    assert hc.judge_storage({p: {"error": "", "seen": [0, 1]} for p in (0, 1)}, "ckpt").ok
    denied = hc.judge_storage({0: {"error": "cannot write x: Permission denied", "seen": [0]}}, "ckpt")
    assert denied.bad == {0: "cannot write x: Permission denied"}


def test_bandwidth_uses_nccl_tests_definitions():
    assert hc.sweep_sizes(4 << 20)[0] == 1024 and hc.sweep_sizes(4 << 20)[-1] == 4 << 20
    assert hc.sweep_sizes(5000) == [1024, 2048, 4096]
    rows = hc.bandwidth_rows({0: [1e-3, 2e-3], 1: [4e-3, 1e-3]}, [1000, 8000], n_devices=4)
    assert rows[0]["slowest_process"] == 1 and rows[1]["slowest_process"] == 0
    assert rows[0]["algbw_GBps"] == pytest.approx(1000 / 4e-3 / 1e9)
    assert rows[1]["busbw_GBps"] == pytest.approx(8000 / 2e-3 / 1e9 * 2 * 3 / 4)
    assert hc.judge_bandwidth(rows, [], ["h0", "h0"], 0, 0.5).ok
    below = hc.judge_bandwidth(rows, [], ["h0", "h0"], min_busbw_gbps=1.0, slow_factor=0.5)
    assert not below.ok and below.bad == {}  # the whole fabric is slow, no one host


def test_the_checksum_vote_names_the_odd_device_its_process_and_host():
    assert numerics.vote({0: 1.0, 1: 1.0, 2: 1.5}) == (1.0, [2])
    assert numerics.vote({0: 1.0, 1: 1.0 + 1e-7, 2: 1.0}) == (1.0, [])  # within the tolerance
    assert numerics.vote({0: 1.0, 1: 2.0}) == (None, [0, 1])  # no majority: nobody can say who
    assert numerics.vote({0: float("nan"), 1: float("nan"), 2: 1.0})[0] is None  # NaN never agrees
    sums = {0: {"0": [3.25, 7.5], "1": [3.25, 7.5]}, 1: {"2": [3.25, 7.5], "3": [3.25, 7.0]}}
    check = numerics.judge_checksums(sums, {0: "gpu-a", 1: "gpu-b"})
    assert not check.ok and list(check.bad) == [1] and "process 1 on gpu-b" in check.detail
    assert check.bad[1] == "device 3's bfloat16 matmul checksum 7.0, the others' 7.5"
    report = hc.Report()
    report.set_processes({0: record(0, "gpu-a"), 1: record(1, "gpu-b")})
    report.add(check)
    assert report.host_lines() == [
        "host gpu-a: healthy",
        "host gpu-b: UNHEALTHY: checksum (process 1: " + check.bad[1] + ")",
    ]
    sums = numerics.matmul_checksums(jax.devices()[:4])
    assert list(sums) == ["0", "1", "2", "3"]
    same = {0: {d: sums[d] for d in ("0", "1")}, 1: {d: sums[d] for d in ("2", "3")}}
    assert numerics.judge_checksums(same, {0: "a", 1: "b"}).ok  # CPU devices: equal by construction


def test_the_kernels_checked_on_each_gpu_and_a_failing_one_named():
    hopper = numerics.kernel_choices("gpu", "9.0", "auto")
    assert (hopper.attention, hopper.grouped_matmul, hopper.documents) == ("cudnn", "pallas", True)
    assert numerics.kernel_choices("gpu", "8.0", "auto").grouped_matmul == "ragged_dot"
    assert (hopper.matmul, hopper.d_ff) == ("cublaslt", 8192)  # FP8 GEMMs: Ada and Hopper on, not Ampere
    assert numerics.kernel_choices("gpu", "8.0", "auto").matmul == ""
    assert numerics.kernel_choices("cpu", "", "auto").attention == ""  # nothing GPU-only on a CPU
    assert numerics.kernel_choices("cpu", "", "on").attention == "xla"
    failed = {0: [], 1: ["attention cudnn 32x128 kv8 T512 documents bfloat16: cuda:3: d_q off by 3.1e-01"]}
    check = numerics.judge_kernels(failed, 16, checked=True, platform="gpu")
    assert not check.ok and list(check.bad) == [1] and "cuda:3" in check.bad[1]
    assert numerics.judge_kernels({0: [], 1: []}, 16, True, "gpu").detail.endswith("each of 16 devices")


def test_collectives_busbw_as_nccl_tests_against_the_planner_constants():
    from jaxtrain.observe import links

    assert busbw.bus_factor("all-reduce", 8) == 2 * 7 / 8 and busbw.bus_factor("all-to-all", 8) == 7 / 8
    h100 = busbw.target_of("NVIDIA H100 80GB HBM3")
    assert h100 is not None and busbw.target_of("cpu") is None
    for kind in busbw.KINDS:  # the planner's own figures, through its forecast (H100: no scaling)
        want = links.NVLINK_BUSBW.get(kind, links.NVLINK_BUSBW_OTHER)
        assert busbw.planner_busbw(h100, kind, across_hosts=False) == pytest.approx(want)
    assert busbw.planner_busbw(h100, "all-reduce", True) == pytest.approx(links.NETWORK_BUSBW["all-reduce"])
    times = {0: dict.fromkeys(busbw.KINDS, 1e-3), 1: dict.fromkeys(busbw.KINDS, 2e-3)}
    rows = busbw.rows(times, 8000, 4, h100, across_hosts=False)
    assert [r["slowest_process"] for r in rows] == [1] * 4
    assert rows[0]["busbw_GBps"] == pytest.approx(8000 / 2e-3 / 1e9 * 1.5)  # all-reduce: 2(n-1)/n
    assert rows[3]["busbw_GBps"] == pytest.approx(8000 / 2e-3 / 1e9 * 0.75)  # all-to-all: (n-1)/n
    assert rows[3]["of_planner"] == pytest.approx(rows[3]["busbw_GBps"] / 350)
    mesh = jax.sharding.Mesh(jax.devices()[:4], ("data",))
    assert all(len(busbw.time_collective(mesh, kind, 4096, 2)) == 2 for kind in busbw.KINDS)


@pytest.mark.parametrize("n", [1, 2])
def test_collectives_check_exact_on_one_device_and_two(n):
    """One device holds the whole array (its shard's index has no start): the first health check on
    a GPU, one H200 alone, failed there (2026-11-28)."""
    assert hc.check_collectives(jax.sharding.Mesh(jax.devices()[:n], ("data",))) == []


@pytest.mark.parametrize("n", range(2, 8))
def test_ring_pairs_cover_each_neighbour_once_without_overlap(n):
    rounds = hc.ring_pairs(n)
    edges = sorted(tuple(sorted(e)) for r in rounds for e in r)
    assert edges == sorted({tuple(sorted((i, (i + 1) % n))) for i in range(n)})
    assert all(len({h for e in r for h in e}) == 2 * len(r) for r in rounds)
    assert len(rounds) == (1 if n == 2 else 2 + n % 2)


def test_a_slow_host_stands_out_from_its_neighbour_pairs():
    hosts = ["a", "a", "b", "c", "d"]  # process -> host; host d has the slow link
    times = {0: [[0, 1, 1e-3], [3, 0, 4e-3]], 2: [[1, 2, 1e-3]], 3: [[2, 3, 4e-3]]}
    pairs = hc.pair_rows(times, ["a", "b", "c", "d"], 8000, Counter(a=2, b=1, c=1, d=1))
    assert [p["hosts"] for p in pairs] == [["a", "b"], ["b", "c"], ["c", "d"], ["d", "a"]]
    assert pairs[0]["busbw_GBps"] == pytest.approx(8000 / 1e-3 / 1e9 * 2 * 2 / 3)
    check = hc.judge_bandwidth([{"bytes": 8000, "busbw_GBps": 1.0}], pairs, hosts, 0, 0.5)
    assert not check.ok and list(check.bad) == [4] and "host's best neighbour pair" in check.bad[4]
    assert hc.judge_bandwidth([{"bytes": 8000, "busbw_GBps": 1.0}], pairs, hosts, 0, 0).ok  # off
    assert hc.slow_hosts(pairs[:1], 0.5) == {}  # two hosts: nothing to compare with


def test_a_step_that_fails_to_measure_names_the_process():
    check = HealthCheck(HealthOptions(), DistConfig(), {})
    check.process_id, check.exchange = 0, Exchange(0, 1)
    check.report.hosts[0] = "node0"

    def measure():
        raise RuntimeError("Unable to initialize backend 'cuda': no GPU\nmore detail")

    assert not check._shared("devices", measure, lambda r: [], fatal=False)
    failed = check.report.checks[-1]
    assert failed.bad == {0: "RuntimeError: Unable to initialize backend 'cuda': no GPU"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_network_names_who_cannot_reach_the_coordinator():
    spec = LaunchSpec("jax_env", f"127.0.0.1:{_free_port()}", 2, 1, None, {})
    start = time.monotonic()
    check = hc.check_network(spec, timeout=1.0)
    assert time.monotonic() - start < 5 and not check.ok and list(check.bad) == [1]
    assert "cannot reach coordinator" in check.bad[1]
    # Process 0 starts the coordinator: an address of another machine is the wrong host.
    check = hc.check_network(LaunchSpec("jax_env", "192.0.2.1:29500", 2, 0, None, {}), timeout=1.0)
    assert not check.ok and "must run on the host" in check.bad[0]


def test_bad_arguments_exit_2(capsys):
    main = exit_on_user_error(cli.main)  # as scripts/test_distributed.py runs it
    for argv in (["--max_bytes", "12X"], ["--iters", "0"], ["--no_such_flag"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1
    opts, dist = cli.parse_args(["--max_bytes", "64K", "--init_timeout", "9", "--process_id", "1"])
    assert opts.max_bytes == 65536 and dist == DistConfig(init_timeout=9, process_id=1)


def test_watchdog_ends_a_hung_step_naming_it():
    code = (
        "import time; from jaxtrain.cluster.watchdog import Watchdog\n"
        "from jaxtrain.health.runner import EXIT_FAILED\n"
        "report = lambda step, s: print(f'{step} hung after {s} s', flush=True)\n"
        "w = Watchdog(on_expiry=report, exit_code=EXIT_FAILED)\n"
        "with w.deadline('collectives', 0.3):\n"
        "    time.sleep(30)\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "collectives hung after 0.3 s" in done.stdout
    assert time.monotonic() - start < 20


def test_watchdog_ends_background_work_that_hangs_while_training_goes_on():
    """An asynchronous checkpoint write hung on storage is caught while steps still beat."""
    code = (
        "import time; from jaxtrain.cluster.watchdog import Watchdog\n"
        "w = Watchdog(timeout_s=1.0, on_expiry=lambda what, s: print(f'{what} over {s} s', flush=True))\n"
        "t0 = time.monotonic()\n"
        "w.watch_beside(lambda: ('checkpoint save at step 5 (its background write)', t0))\n"
        "for step in range(1000):\n"
        "    time.sleep(0.01); w.beat(step)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "checkpoint save at step 5 (its background write) over 1.0 s\n"


# ---------------------------------------------------------------- real processes (gloo on CPU)


@functools.cache
def _can_fake_hosts() -> bool:
    """Root with unshare: each process can get a host name (and /etc/hosts) of its own."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True).returncode == 0


def _as_host(name: str, tmp_path: Path, resolvable: bool = True) -> list[str]:
    """Command prefix running a process as host `name`: UTS + mount namespaces, private /etc/hosts."""
    hosts = tmp_path / f"hosts-{name}"
    hosts.write_text(Path("/etc/hosts").read_text() + (f"127.0.0.1 {name}\n" if resolvable else ""))
    script = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
    return ["unshare", "--uts", "--mount", "sh", "-c", script, str(hosts), name]


fake_hosts = pytest.mark.skipif(not _can_fake_hosts(), reason="needs root and unshare")


def _by_hand(tmp_path, devices, args, extra_args=None, ports=None, hosts=None):
    """Start one process per entry of `devices`, as a launcher would; [(code, stdout, stderr)]."""
    n, port = len(devices), _free_port()
    procs = []
    for i, d in enumerate(devices):
        coordinator = f"127.0.0.1:{(ports or {}).get(i, port)}"
        env = clean_env(
            d, JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i)
        )
        prefix = _as_host(hosts[i], tmp_path) if hosts else []
        cmd = [*prefix, sys.executable, str(SCRIPT), *args, *(extra_args or {}).get(i, [])]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    outs = [p.communicate(timeout=120) for p in procs]
    return [(p.returncode, o.decode(), e.decode()) for p, (o, e) in zip(procs, outs, strict=True)]


def _healthy_report(path, n_processes, n_devices):
    report = json.loads(path.read_text())
    assert report["healthy"] and report["bad_hosts"] == [] and all(c["ok"] for c in report["checks"])
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "environment",
        "network",
        "init",
        "software",
        "devices",
        "collectives",
        "kernels",
        "checksum",
        "exchange",
        "bandwidth",
        "storage",
    ]
    assert [r["collective"] for r in report["collectives"]] == list(busbw.KINDS)
    assert [r["process_id"] for r in report["processes"]] == list(range(n_processes))
    assert sum(r["device_count"] for r in report["processes"]) == n_devices
    rows = report["bandwidth"]
    assert [r["bytes"] for r in rows] == [1024, 2048, 4096, 8192]
    factor = 2 * (n_devices - 1) / n_devices
    for r in rows:
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3, rel=1e-2)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor, rel=1e-2, abs=1e-4)
        assert 0 <= r["slowest_process"] < n_processes and len(r["time_us_per_process"]) == n_processes
    return report


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_process(tmp_path):
    out = tmp_path / "health.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *FAST, "--json", str(out), "--target", "h100"],
        env=clean_env(4), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "verdict: HEALTHY" in done.stdout and "busbw_GB/s" in done.stdout
    report = _healthy_report(out, 1, 4)
    assert report["environment"]["source"] == "single" and "host " in done.stdout
    kernels = next(c for c in report["checks"] if c["name"] == "kernels")
    assert kernels["detail"].startswith("nothing GPU-only to check")  # --kernels auto on a CPU
    assert all(r["planner_busbw_GBps"] > 100 for r in report["collectives"])  # h100's, from the planner
    assert list(tmp_path.iterdir()) == [out]  # the storage probe cleaned up after itself


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_processes_through_the_launcher(tmp_path, n):
    out = tmp_path / "health.json"
    launcher = [sys.executable, str(REPO / "scripts" / "run_distributed.py"), "--mode", "manual"]
    args = [*FAST, "--json", str(out), "--checkpoint_dir", str(tmp_path / "ckpt")]
    args += ["--kernels", "on"] if n == 2 else []  # once: the CPU's kernels, the exchange across processes
    done = subprocess.run(
        [*launcher, "--world-size", str(n), "--script", str(SCRIPT), "--", *args],
        env=clean_env(2), cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = _healthy_report(out, n, 2 * n)
    kernels = next(c for c in report["checks"] if c["name"] == "kernels")
    assert ("each process's first CPU device" in kernels["detail"]) == (n == 2)
    assert report["environment"]["source"] == "jax_env"
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_with_other_devices_is_named(tmp_path):
    out = tmp_path / "health.json"
    args = [*FAST, "--json", str(out), "--expected_devices_per_process", "2"]
    results = _by_hand(tmp_path, [2, 4], args)
    assert [code for code, _, _ in results] == [1, 1], results
    report = json.loads(out.read_text())
    assert report["bad_processes"] == [
        {
            "process_id": 1,
            "host": socket.gethostname(),
            "check": "devices",
            "reason": "device count 4, expected 2",
        }
    ]
    assert "health check FAILED on process 1" in results[1][2]
    # Not fatal: collectives over 6 devices still ran, so the report says what else works.
    assert {c["name"]: c["ok"] for c in report["checks"]}["collectives"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_directory_that_is_not_shared_is_named(tmp_path):
    # Two hosts with a local directory each, played by two paths on one host.
    out = tmp_path / "health.json"
    args = [*FAST, "--json", str(out), "--checkpoint_dir", str(tmp_path / "a")]
    results = _by_hand(tmp_path, [1, 1], args, extra_args={1: ["--checkpoint_dir", str(tmp_path / "b")]})
    assert [code for code, _, _ in results] == [1, 1], results
    report = json.loads(out.read_text())
    storage = report["checks"][-1]
    assert storage["name"] == "storage" and not storage["ok"]
    assert [b["process_id"] for b in storage["bad_processes"]] == [0, 1]
    assert "cannot see the files of processes [1]" in storage["bad_processes"][0]["reason"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_unreachable_coordinator_is_named_fast(tmp_path):
    # Process 1 is given a closed port: it names itself, process 0 times out in init; no hang.
    out = tmp_path / "health.json"
    args = [*FAST, "--json", str(out), "--network_timeout", "2", "--init_timeout", "6"]
    start = time.monotonic()
    results = _by_hand(tmp_path, [1, 1], args, ports={1: _free_port()})
    assert [code for code, _, _ in results] == [1, 1], results
    assert time.monotonic() - start < 60
    assert "FAILED on process 1" in results[1][2] and "cannot reach coordinator" in results[1][2]
    mine = json.loads((tmp_path / "health.process-1.json").read_text())
    assert mine["bad_processes"][0]["process_id"] == 1 and mine["bad_hosts"] == [socket.gethostname()]
    init = json.loads(out.read_text())["checks"][-1]
    assert init["name"] == "init" and not init["ok"] and "not all 2 processes joined" in init["detail"]


@pytest.mark.slow
@pytest.mark.multiprocess
@fake_hosts
def test_three_hosts_pairs_and_a_host_short_of_devices(tmp_path):
    out = tmp_path / "health.json"
    # Noise on two shared cores exceeds what a slow host would show: pairs are judged in unit tests.
    args = [*FAST, "--json", str(out), "--slow_host_factor", "0", "--expected_devices_per_host", "2"]
    results = _by_hand(tmp_path, [2, 2, 1], args, hosts=["node-a", "node-b", "node-c"])
    assert [code for code, _, _ in results] == [1, 1, 1], results
    report = json.loads(out.read_text())
    assert report["bad_hosts"] == ["node-c"]
    assert report["bad_processes"][0]["reason"].endswith("its host has 1 devices, expected 2")
    ring = [["node-a", "node-b"], ["node-b", "node-c"], ["node-c", "node-a"]]
    assert [p["hosts"] for p in report["pairs"]] == ring
    assert all(p["busbw_GBps"] > 0 for p in report["pairs"]) and "neighbouring hosts" in results[0][1]


@pytest.mark.multiprocess
@fake_hosts
def test_a_host_name_that_does_not_resolve_is_named(tmp_path):
    coordinator = f"127.0.0.1:{_free_port()}"
    env = clean_env(1, JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
    script = [sys.executable, str(SCRIPT), "--network_timeout", "1"]
    host = _as_host("nowhere7", tmp_path, resolvable=False)
    done = subprocess.run([*host, *script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "FAILED on process 1 on nowhere7: network: this host's name nowhere7 does not" in done.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_frozen_process_is_named_and_nothing_hangs(tmp_path):
    out, port = tmp_path / "health.json", _free_port()
    args = [str(SCRIPT), "--max_bytes", "4M", "--iters", "100", "--step_timeout", "4", "--json", str(out)]
    procs = []
    for i in range(2):
        env = clean_env(
            1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)
        )
        procs.append(subprocess.Popen([sys.executable, *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE))
    try:
        for line in procs[0].stdout:  # process 0 prints this once every process has joined
            if line.startswith(b"distributed:"):
                break
        procs[1].send_signal(signal.SIGSTOP)  # frozen, as a process stuck on a dead mount would be
        start = time.monotonic()
        procs[0].communicate(timeout=60)
        assert procs[0].returncode == 1 and time.monotonic() - start < 30
    finally:
        procs[1].kill()
        procs[1].communicate()
    report = json.loads(out.read_text())
    assert [b["process_id"] for b in report["bad_processes"]] == [1], report["bad_processes"]
