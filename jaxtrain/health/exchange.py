"""The health check's messages between processes (`Exchange`) and the storage probe that uses
them to find out which processes share the checkpoint directory. The steps are in `check`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

from jax.errors import JaxRuntimeError

_KEY_PREFIX = "jaxtrain_health"
# NFS may show another host's new file a little late (attribute caching): keep looking this long.
STORAGE_GRACE_S = 5.0


class Exchange:
    """Small JSON messages through the coordinator's key-value store; a loopback for one process.

    Never a device collective, so messages travel when collectives are broken, and every wait
    has a timeout.
    """

    def __init__(self, process_id: int, num_processes: int):
        self.process_id, self.num_processes = process_id, num_processes
        self._client = None
        if num_processes > 1:
            # JAX has no public key-value API; orbax reaches the same client this way.
            from jax._src.distributed import global_state

            self._client = global_state.client

    def post(self, key: str, value: Any) -> None:
        """Publish this process's `value` under `key`."""
        if self._client:
            self._client.key_value_set(f"{_KEY_PREFIX}/{key}/{self.process_id}", json.dumps(value))

    def gather(self, key: str, value: Any, timeout: float) -> list[Any]:
        """Everyone posts `value`; process 0 gets all of them (None from a process silent past
        `timeout`), the others get []."""
        if not self._client:
            return [value]
        self.post(key, value)
        if self.process_id != 0:
            return []
        deadline, values = time.monotonic() + timeout, []
        for q in range(self.num_processes):
            wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                values.append(
                    json.loads(self._client.blocking_key_value_get(f"{_KEY_PREFIX}/{key}/{q}", wait_ms))
                )
            except JaxRuntimeError:
                values.append(None)
        return values

    def share(self, key: str, value: Any, timeout: float) -> Any:
        """Process 0's `value` on every process; TimeoutError if it does not come in time."""
        if not self._client:
            return value
        if self.process_id == 0:
            self._client.key_value_set(f"{_KEY_PREFIX}/{key}", json.dumps(value))
            return value
        try:
            return json.loads(
                self._client.blocking_key_value_get(f"{_KEY_PREFIX}/{key}", int(timeout * 1000))
            )
        except JaxRuntimeError:
            raise TimeoutError(f"no word from process 0 about '{key}' within {timeout:g} s") from None

    def barrier(self, key: str, timeout: float) -> bool:
        """Wait until every process gets here; False if someone did not within `timeout`."""
        if not self._client:
            return True
        try:
            self._client.wait_at_barrier(f"{_KEY_PREFIX}/{key}", int(timeout * 1000))
            return True
        except JaxRuntimeError:
            return False

    def start_heartbeat(self, period: float) -> threading.Event:
        """Count up under alive/ every `period` s until the returned event is set, so process 0
        can tell a frozen process (stopped, swapped out, stuck in the kernel) from a waiting one."""
        stop = threading.Event()

        def beat() -> None:
            count = 0
            while self._client and not stop.wait(period):
                count += 1
                try:
                    self._client.key_value_set(f"{_KEY_PREFIX}/alive/{self.process_id}", str(count), True)
                except JaxRuntimeError:
                    return  # the coordinator is gone; its absence is reported elsewhere

        threading.Thread(target=beat, name="jaxtrain-health-heartbeat", daemon=True).start()
        return stop

    def frozen(self, period: float) -> list[int]:
        """Processes whose heartbeat did not move over three periods."""
        if not self._client:
            return []
        before = self.posted("alive")
        time.sleep(3 * period)
        after = self.posted("alive")
        return [q for q in range(self.num_processes) if after.get(q) in (None, before.get(q))]

    def posted(self, key: str) -> dict[int, Any]:
        """What each process has posted under `key` so far, without waiting."""
        if not self._client:
            return {}
        try:
            entries = self._client.key_value_dir_get(f"{_KEY_PREFIX}/{key}/")
        except JaxRuntimeError:
            return {}  # the coordinator is gone: nothing more can be learned
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in entries}


def storage_probe(folder: Path, process_id: int, exchange: Exchange, timeout: float) -> dict[str, Any]:
    """Write this process's file in `folder`, wait for everyone, list whose files are visible here."""
    nonce = folder.name
    mine = folder / f"host-{process_id}.txt"
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    error = ""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        mine.write_text(json.dumps({"process_id": process_id, "host": socket.gethostname(), "nonce": nonce}))
    except OSError as e:
        error = f"cannot write {mine}: {e.strerror}"
    exchange.barrier("storage-written", timeout)
    seen: set[int] = set()
    deadline = time.monotonic() + STORAGE_GRACE_S
    while True:
        for q in set(range(exchange.num_processes)) - seen:
            try:
                # The nonce proves the file is from this run, not left over from an earlier one.
                if json.loads((folder / f"host-{q}.txt").read_text())["nonce"] == nonce:
                    seen.add(q)
            except (OSError, ValueError, KeyError):
                pass
        if len(seen) == exchange.num_processes or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    exchange.barrier("storage-read", timeout)
    mine.unlink(missing_ok=True)
    exchange.barrier("storage-cleaned", timeout)
    for path in created:
        with contextlib.suppress(OSError):  # removed by another process, or not empty: leave it
            path.rmdir()
    return {"error": error, "seen": sorted(seen)}
