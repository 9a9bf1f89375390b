"""Join the other processes of a job: jax.distributed.initialize, bounded and with readable errors.

Where this process sits comes from `jaxtrain.cluster.detect` (no jax there, so launchers can use
it); this module is the part that needs jax.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Mapping
from types import TracebackType

from jaxtrain.cluster.detect import (
    LaunchSpec,
    describe,
    detect,
    port_in_use,
    split_address,
    wait_for_coordinator,
)
from jaxtrain.cluster.watchdog import Watchdog, exit_now
from jaxtrain.config import DistConfig
from jaxtrain.errors import EXIT_USAGE, UserError


def join_error(spec: LaunchSpec, what: str) -> UserError:
    return UserError(
        f"process {spec.process_id} of {spec.num_processes} (coordinator {spec.coordinator_address}, "
        f"source {spec.source}) {what}"
    )


def _init_watchdog(spec: LaunchSpec) -> Watchdog:
    """JAX aborts the whole process when joining times out; exit first with a readable line."""

    def expired(what: str, seconds: float) -> None:
        err = join_error(
            spec,
            f"timed out after {seconds:.0f} s waiting for all processes to join; start every "
            "process, check they agree on the coordinator, or raise --dist.init_timeout",
        )
        sys.stderr.write(f"error: {err}\n")  # one write: the line stays whole (cluster/shutdown.py)
        sys.stderr.flush()

    return Watchdog(on_expiry=expired, exit_code=EXIT_USAGE)


def _exit_at_once_on_crash() -> None:
    """An uncaught exception ends this process now, after printing it.

    Otherwise JAX's exit handler waits up to 5 minutes in a shutdown barrier for peers that are
    themselves stuck in a collective with this process, and the launcher cannot stop the job.
    """
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(exc_type, exc, tb)
        exit_now(1)

    sys.excepthook = hook


def initialize(
    dist: DistConfig, spec: LaunchSpec | None = None, environ: Mapping[str, str] = os.environ
) -> LaunchSpec:
    """Join the other processes of `spec` (default: detect()) within dist.init_timeout, gloo
    collectives on CPU."""
    import jax

    spec = spec or detect(dist, environ)
    if spec.num_processes == 1:
        if spec.local_device_ids:
            jax.config.update("jax_cuda_visible_devices", ",".join(map(str, spec.local_device_ids)))
        print(describe(spec), flush=True)
        return spec
    assert spec.coordinator_address is not None  # detect() sets it whenever num_processes > 1
    # Without this a CPU-only job has no cross-process collectives; GPUs ignore the setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    start, timeout = time.monotonic(), float(dist.init_timeout)
    if spec.process_id == 0:
        _, port = split_address(spec.coordinator_address)
        if port_in_use(port):
            fix = (
                f"JAX's coordinator takes MASTER_PORT+1 (torchrun's agent holds {port - 1}); pass "
                f"torchrun a --master_port whose next port is free, e.g. --master_port {port + 1}"
                if "TORCHELASTIC_RUN_ID" in spec.details
                else "pick a free port (e.g. --dist.coordinator_address HOST:29501) or stop what holds it"
            )
            raise join_error(
                spec, f"cannot start the coordinator: port {port} is already in use on this host; {fix}"
            )
    elif not wait_for_coordinator(spec.coordinator_address, timeout):
        raise join_error(
            spec,
            f"could not reach the coordinator within {timeout:.0f} s; check that process 0 is "
            f"running and that {spec.coordinator_address} is reachable from this host (firewall?)",
        )
    remaining = max(1.0, timeout - (time.monotonic() - start))
    watchdog = _init_watchdog(spec)
    try:
        with watchdog.deadline("init", remaining), warnings.catch_warnings():
            # In a Kubernetes pod JAX's own cluster detection, asked though every value is given,
            # warns that it lacks the `kubernetes` package: nothing is missing, say nothing.
            warnings.filterwarnings("ignore", "Kubernetes environment detected", UserWarning)
            jax.distributed.initialize(
                coordinator_address=spec.coordinator_address,
                num_processes=spec.num_processes,
                process_id=spec.process_id,
                local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
                # JAX's own limit sits just past the watchdog so the readable error wins the race.
                initialization_timeout=int(remaining) + 5,
            )
    except Exception as e:  # JAX raises several types here; all mean this process cannot join
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise join_error(spec, f"failed to join the job: {first_line}") from e
    finally:
        watchdog.stop()
    _exit_at_once_on_crash()
    if spec.process_id == 0:
        print(describe(spec), flush=True)
    return spec
