"""Cluster health check: find the broken host before a training job does.

Steps, in order, each under a deadline; a fatal failure stops the run with its verdict:
  environment  launch source and its values (cluster.detect); half-set variables
  network      process 0: the coordinator address is on this host; others: it accepts TCP
  init         jax.distributed joins every process within --init_timeout
  software     python, jax, jaxlib, plugin, flax, optax, orbax, grain: equal everywhere
  devices      count, kind, memory per process; expected counts per process or host
  collectives  all-reduce and all-gather of known values over every device
  kernels      the preflight's kernel checks (run/preflight.py) on each GPU alone
  checksum     a fixed-seed matmul on every device, voted on: the odd device named
  exchange     all-to-all and the experts' ragged exchange exact over every device
  bandwidth    all-reduce sweep (nccl-tests algbw/busbw), then neighbouring pairs of hosts; all-reduce,
               all-gather, reduce-scatter and all-to-all at --max_bytes against the planner's figures
  storage      every process sees every other's file in the checkpoint directory
Software and devices are judged after init because touching devices first makes
jax.distributed.initialize fail. Before init each process judges, and names, itself. After
init every process posts its facts to the coordinator's key-value store, never a device
collective (`exchange.Exchange`), so the verdict still travels when collectives are broken;
process 0 judges and tells the others whether to go on, so every process exits with the same
code. Each step's measurement and verdict are in `checks`; the deadlines are kept by the
watchdog that training uses too (jaxtrain/cluster/watchdog.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import statistics
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxtrain.cluster import detect, join
from jaxtrain.cluster.watchdog import Watchdog, exit_now
from jaxtrain.config import DistConfig
from jaxtrain.errors import UserError
from jaxtrain.health import busbw, numerics
from jaxtrain.health import checks as hc
from jaxtrain.health.exchange import STORAGE_GRACE_S, Exchange, storage_probe
from jaxtrain.parallel.mesh import make_mesh

EXIT_HEALTHY, EXIT_FAILED = 0, 1
# jax.distributed gets this much longer than our init deadline, so our verdict comes first.
_INIT_MARGIN_S = 10
_HEARTBEAT_S = 1.0  # a process whose count stands still for 3 beats is frozen
Judge = Callable[[dict[int, Any]], list[hc.Check]]  # every process's result -> checks


@dataclass(frozen=True)
class HealthOptions:
    """What to check and how long to wait; every wait is bounded."""

    checkpoint_dir: str = "runs/health_check"  # must be shared by every host
    json_path: str = ""  # "" = no JSON report
    max_bytes: int = 4 << 20  # largest all-reduce message per device
    iters: int = 10  # timed all-reduces per size; the median counts
    expected_devices_per_process: int = 0  # 0 = the majority decides
    expected_devices_per_host: int = 0  # 0 = not checked
    min_busbw_gbps: float = 0.0  # fail below this busbw at the largest size; 0 = report only
    slow_host_factor: float = 0.5  # fail a host whose best pair is under this x the median; 0 = off
    network_timeout: float = 60.0  # seconds to reach the coordinator (hosts started by hand lag)
    step_timeout: float = 120.0  # seconds for each later step (each message size for bandwidth)
    kernels: str = "auto"  # auto: the GPU-only kernels on GPUs (none on CPUs); on: every kernel; off
    target: str = ""  # the planner's GPU target to compare busbw with; "" = the devices' own kind


def check_options(opts: HealthOptions, dist: DistConfig) -> None:
    """Raise UserError naming the first unusable option."""
    if opts.max_bytes < hc.MIN_BYTES:
        raise UserError(f"--max_bytes must be at least {hc.MIN_BYTES} (1 KiB), got {opts.max_bytes}")
    if opts.kernels not in ("auto", "on", "off"):
        raise UserError(f"--kernels must be auto, on or off, got {opts.kernels!r}")
    if opts.target and opts.target not in busbw.TARGETS:
        raise UserError(f"unknown --target {opts.target!r}; known targets: {', '.join(busbw.TARGETS)}")
    if opts.iters < 1:
        raise UserError(f"--iters must be >= 1, got {opts.iters}")
    for name, value in (
        ("network_timeout", opts.network_timeout),
        ("step_timeout", opts.step_timeout),
        ("init_timeout", dist.init_timeout),
    ):
        if value <= 0:
            raise UserError(f"--{name} must be > 0 seconds, got {value}")
    for name in (
        "expected_devices_per_process",
        "expected_devices_per_host",
        "min_busbw_gbps",
        "slow_host_factor",
    ):
        if getattr(opts, name) < 0:
            raise UserError(f"--{name} must be >= 0, got {getattr(opts, name)}")


class HealthCheck:
    """One run of every step on this process; `run()` returns the exit code."""

    def __init__(self, opts: HealthOptions, dist: DistConfig, environ: Mapping[str, str]):
        self.opts, self.dist, self.environ = opts, dist, environ
        self.host = socket.gethostname()
        self.process_id = -1
        self.report = hc.Report(hosts={-1: self.host})
        self.exchange: Exchange | None = None
        self.watchdog = Watchdog(on_expiry=self._on_timeout, exit_code=EXIT_FAILED)
        self.spec: detect.LaunchSpec | None = None
        self.mesh: jax.sharding.Mesh | None = None
        self._among: dict[str, tuple[int, ...]] = {}  # step -> the processes it involves (all if empty)
        self._heartbeat = threading.Event()  # set to stop this process's heartbeat

    @property
    def _joined(self) -> Exchange:
        """The exchange that every step after init uses."""
        assert self.exchange is not None, "only after init"
        return self.exchange

    def run(self) -> int:
        """Every step in order; 0 healthy, 1 failed, the same on every process that gets a verdict."""
        try:
            spec = detect.detect(self.dist, self.environ)
        except UserError as e:
            return self._alone(hc.Check("environment", False, str(e), {-1: str(e)}))
        self.spec, self.process_id = spec, spec.process_id
        self.report.hosts[spec.process_id] = self.host
        self.report.environment = {
            "source": spec.source,
            "coordinator_address": spec.coordinator_address,
            "num_processes": spec.num_processes,
            "details": spec.details,
        }
        raw = " ".join(f"{k}={v}" for k, v in spec.details.items()) or "no launcher variables set"
        self.report.add(hc.Check("environment", True, f"{spec.source}: {raw}"))
        network = self.report.add(hc.check_network(spec, self.opts.network_timeout))
        if not network.ok or not self._init():
            return self._alone()
        self.exchange = Exchange(spec.process_id, spec.num_processes)
        self.exchange.post("host", self.host)  # so process 0 can name a host that fails later
        self._heartbeat = self.exchange.start_heartbeat(_HEARTBEAT_S)
        try:
            steps = (self._devices, self._collectives, self._numerics, self._bandwidth, self._storage)
            for step in steps:
                if not step():
                    break
            code = EXIT_HEALTHY if self.report.healthy else EXIT_FAILED
            verdict = self.exchange.share(
                "verdict", {"code": code, "bad": self.report.bad_processes()}, self.opts.step_timeout
            )
        except TimeoutError as e:  # process 0 went silent: no shared verdict will come
            self.report.add(hc.Check("verdict", False, str(e), {self.process_id: str(e)}))
            return self._leave(self._alone())
        self._publish(verdict["bad"], alone=False)
        code = verdict["code"]
        return self._leave(code)

    def _init(self) -> bool:
        spec = self.spec
        assert spec is not None  # run() sets it before init
        dist = dataclasses.replace(self.dist, init_timeout=self.dist.init_timeout + _INIT_MARGIN_S)
        start = time.monotonic()
        with self.watchdog.deadline("init", self.dist.init_timeout):
            try:
                join.initialize(dist, spec)
            except UserError as e:
                return self.report.add(hc.Check("init", False, str(e), {spec.process_id: str(e)})).ok
        took = time.monotonic() - start
        joined = f"{spec.num_processes} processes joined" if spec.num_processes > 1 else "single process"
        return self.report.add(hc.Check("init", True, f"{joined} in {took:.1f} s")).ok

    @contextlib.contextmanager
    def _step(self, name: str, timeout: float, among: tuple[int, ...] = ()) -> Iterator[None]:
        """Run a step that may hang under a deadline; tell process 0 this process got there."""
        self._among[name] = among
        self._joined.post(f"enter/{name}", 1)
        with self.watchdog.deadline(name, timeout):
            yield

    def _shared(self, name: str, measure: Callable[[], Any], judge: Judge, fatal: bool) -> bool:
        """Measure here, gather every process's result, let process 0 judge, share whether to go on."""
        try:
            value = {"result": measure()}
        except Exception as e:  # a failure to measure is a finding about this host: report it, go on
            traceback.print_exc()
            value = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"}
        values = self._joined.gather(name, value, self.opts.step_timeout)
        stop = False
        if self.process_id == 0:
            silent = f"sent nothing within {self.opts.step_timeout:g} s"
            bad = {p: v["error"] if v else silent for p, v in enumerate(values) if not v or "error" in v}
            if bad:
                self._learn_hosts()
                checks = [hc.Check(name, False, "could not be measured everywhere", bad)]
            else:
                checks = judge({p: v["result"] for p, v in enumerate(values)})
            for check in checks:
                self.report.add(check)
            stop = bool(bad) or fatal and not all(c.ok for c in checks)
        return not self._joined.share(f"stop/{name}", stop, self.opts.step_timeout)

    def _devices(self) -> bool:
        opts, spec = self.opts, self.spec
        assert spec is not None  # run() sets it before init

        def judge(records: dict[int, dict]) -> list[hc.Check]:
            self.report.set_processes(records)
            per_process, per_host = opts.expected_devices_per_process, opts.expected_devices_per_host
            return [hc.judge_software(records), hc.judge_devices(records, per_process, per_host)]

        def measure() -> dict[str, Any]:
            # The first device query starts the backend, which waits for every other process.
            with self._step("devices", opts.step_timeout):
                return hc.local_record(spec)

        return self._shared("devices", measure, judge, fatal=False)

    def _collectives(self) -> bool:
        def measure() -> list[str]:
            self.mesh = make_mesh()
            with self._step("collectives", self.opts.step_timeout):
                return hc.check_collectives(self.mesh)

        n = jax.device_count()
        return self._shared("collectives", measure, lambda r: [hc.judge_collectives(r, n)], fatal=True)

    def _numerics(self) -> bool:
        """Kernels on each GPU, the matmul checksum on every device, the exchange over all of them."""
        opts, n = self.opts, jax.device_count()

        def measure() -> dict[str, Any]:
            local = jax.local_devices()
            # Three deadlines: the kernels' first compiles (Pallas's take tens of seconds on a GPU),
            # the checksums, the exchange.
            with self._step("numerics", 3 * opts.step_timeout):
                kernels = numerics.measure_kernels(local, opts.kernels) if opts.kernels != "off" else []
                sums = numerics.matmul_checksums(local)
                return {
                    "kernels": kernels,
                    "checksums": sums,
                    "exchange": numerics.measure_exchange(jax.devices(), opts.kernels),
                }

        def judge(results: dict[int, dict]) -> list[hc.Check]:
            device = jax.devices()[0]
            capability = str(getattr(device, "compute_capability", ""))
            checked = opts.kernels != "off" and bool(
                numerics.kernel_choices(device.platform, capability, opts.kernels).attention
            )
            return [
                numerics.judge_kernels(
                    {p: r["kernels"] for p, r in results.items()}, n, checked, device.platform
                ),
                numerics.judge_checksums({p: r["checksums"] for p, r in results.items()}, self.report.hosts),
                numerics.judge_exchange({p: r["exchange"] for p, r in results.items()}, n),
            ]

        return self._shared("numerics", measure, judge, fatal=False)

    def _bandwidth(self) -> bool:
        opts, n = self.opts, jax.device_count()
        sizes = hc.sweep_sizes(opts.max_bytes)
        hosts = self._joined.share("hosts", self.report.process_hosts(), opts.step_timeout)
        order = list(dict.fromkeys(hosts))

        def measure() -> dict[str, Any]:
            assert self.mesh is not None  # _collectives made it
            sweep: list[float] = []
            pairs: list[list[Any]] = []
            for nbytes in sizes:
                with self._step(f"bandwidth-{nbytes}", opts.step_timeout):
                    sweep.append(statistics.median(hc.time_all_reduce(self.mesh, nbytes, opts.iters)))
            # In lock-step every process waits as long as the slowest, so sweep times look alike
            # everywhere; all-reduces between neighbouring pairs of hosts single out a slow host.
            for r, round_pairs in enumerate(hc.ring_pairs(len(order))):
                self._joined.barrier(f"pairs-{r}", opts.step_timeout)  # one round at a time
                for a, b in round_pairs:
                    members = tuple(p for p, host in enumerate(hosts) if host in (order[a], order[b]))
                    if self.process_id in members:
                        mesh = make_mesh([d for d in jax.devices() if d.process_index in members])
                        with self._step(f"pair-{a}-{b}", opts.step_timeout, among=members):
                            # The best run: noise slows some runs, a bad link slows them all.
                            pairs.append([a, b, min(hc.time_all_reduce(mesh, sizes[-1], opts.iters))])
            kinds = {"all-reduce": sweep[-1]}  # the sweep's largest size: measured already
            for kind in busbw.KINDS[1:]:
                with self._step(f"busbw-{kind}", opts.step_timeout):
                    kinds[kind] = statistics.median(
                        busbw.time_collective(self.mesh, kind, sizes[-1], opts.iters)
                    )
            return {"sweep": sweep, "pairs": pairs, "kinds": kinds}

        def judge(results: dict[int, dict]) -> list[hc.Check]:
            devices = Counter(hosts[d.process_index] for d in jax.devices())
            rows = hc.bandwidth_rows({p: r["sweep"] for p, r in results.items()}, sizes, n)
            pairs = hc.pair_rows({p: r["pairs"] for p, r in results.items()}, order, sizes[-1], devices)
            self.report.bandwidth, self.report.pairs = rows, pairs
            target = busbw.target_of(jax.devices()[0].device_kind, opts.target)
            kinds = busbw.rows(
                {p: r["kinds"] for p, r in results.items()}, sizes[-1], n, target, len(order) > 1
            )
            self.report.collectives = kinds
            check = hc.judge_bandwidth(rows, pairs, hosts, opts.min_busbw_gbps, opts.slow_host_factor)
            return [dataclasses.replace(check, detail=f"{check.detail}; {busbw.summary(kinds, target)}")]

        return self._shared("bandwidth", measure, judge, fatal=False)

    def _storage(self) -> bool:
        timeout = self.opts.step_timeout
        nonce = self._joined.share("nonce", f".health-{uuid.uuid4().hex[:12]}", timeout)
        folder = Path(self.opts.checkpoint_dir) / nonce

        def measure() -> dict[str, Any]:
            with self._step("storage", 3 * timeout + STORAGE_GRACE_S):  # three barriers
                return storage_probe(folder, self.process_id, self._joined, timeout)

        def judge(results: dict[int, dict]) -> list[hc.Check]:
            return [hc.judge_storage(results, self.opts.checkpoint_dir)]

        return self._shared("storage", measure, judge, fatal=True)

    def _learn_hosts(self) -> None:
        """Host names posted right after init, for processes whose records never came."""
        if self.exchange:
            self.report.hosts = self.exchange.posted("host") | self.report.hosts

    def _on_timeout(self, step: str, seconds: float) -> None:
        """Name the step that hung and, on process 0, the processes that never entered it."""
        self._learn_hosts()
        if step == "init":
            env = self.report.environment
            detail = (
                f"not all {env['num_processes']} processes joined coordinator {env['coordinator_address']} "
                f"within {seconds:g} s; a process that failed before init named itself on its stderr, "
                "one that printed nothing never started"
            )
            late: list[int] = []
        else:
            late, frozen = [], []
            if self.exchange and self.process_id == 0:
                among = self._among.get(step) or range(self.exchange.num_processes)
                entered = self.exchange.posted(f"enter/{step}")
                late = [p for p in among if p not in entered]
                frozen = [p for p in self.exchange.frozen(_HEARTBEAT_S) if p in among and p not in late]
            detail = f"did not finish within {seconds:g} s"
            for label, procs in (("never started on", late), ("stopped responding on", frozen)):
                if procs:
                    detail += f"; {label} " + ", ".join(hc.who(p, self.report.hosts) for p in procs)
            late += frozen
        # Process 0 blames only those it can name; any other process reports itself.
        blamed = late if self.process_id <= 0 else [self.process_id]
        self.report.add(hc.Check(step, False, detail, dict.fromkeys(blamed, f"{step} did not finish")))
        self._alone()

    def _alone(self, check: hc.Check | None = None) -> int:
        """A failure no shared verdict will cover: this process reports for itself."""
        if check:
            self.report.add(check)
        self._publish(self.report.bad_processes(), alone=True)
        return EXIT_FAILED

    def _publish(self, bad: list[dict], alone: bool) -> None:
        """Process 0 prints the table and writes the JSON; every process names its own failures.

        A process other than 0 that fails alone writes FILE.process-N.json next to --json FILE:
        process 0 cannot know about it, and sharing one path would overwrite its report.
        """
        if self.process_id <= 0:
            print(self.report.table(), flush=True)
        if self.opts.json_path and (self.process_id <= 0 or alone):
            path = Path(self.opts.json_path)
            if self.process_id > 0:
                path = path.with_name(f"{path.stem}.process-{self.process_id}{path.suffix}")
            self.report.write_json(str(path))
        where = hc.who(self.process_id, self.report.hosts)
        for b in bad:
            if b["process_id"] == self.process_id:
                print(
                    f"health check FAILED on {where}: {b['check']}: {b['reason']}",
                    file=sys.stderr,
                    flush=True,
                )

    def _leave(self, code: int) -> int:
        """Leave together: process 0 hosts the coordinator, so nobody may go before all are done."""
        if self._joined.num_processes == 1:
            return code
        self._heartbeat.set()
        if not self._joined.barrier("done", self.opts.step_timeout):
            exit_now(code)  # a process is gone; jax's exit-time shutdown would wait minutes for it
        with self.watchdog.deadline("shutdown", self.opts.step_timeout):
            jax.distributed.shutdown()
        return code


def run(opts: HealthOptions, dist: DistConfig, environ: Mapping[str, str] = os.environ) -> int:
    """Run the health check on this process: 0 when healthy, 1 when a check failed."""
    check_options(opts, dist)
    return HealthCheck(opts, dist, environ).run()
