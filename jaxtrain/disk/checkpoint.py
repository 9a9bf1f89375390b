"""Orbax checkpoints: asynchronous saves of the train state plus a JSON record of the run.

Every process calls save/restore (orbax needs all of them); replicated arrays are written
once, by the primary replica on process 0. A step directory only becomes visible once it
is complete (orbax writes to a temporary name and renames), so a killed save is never
restored.

Damage that does not raise (a file truncated by a node crash, a bad disk, a partial copy) is
found by checksums: once a save has finished, process 0 records the size and CRC32 of every
file of the step dir in its `checksums.json`, and a restore checks them first; a step dir without
them (a kill between orbax's rename and their record, or an older jaxtrain's) is read back whole
on process 0 instead, so a damaged one is moved aside, never the restore's failure. A save the
filesystem refuses (no space, read-only, I/O error, quota) raises StorageError, whether orbax
reports it at once, from its background thread (`poll`), or when waited for.

In a bucket (gs://, s3://; jaxtrain/disk/bucket.py) orbax writes through tensorstore's gcs and s3
drivers, each process its own shards, and a step dir is complete once its commit_success.txt is
written (orbax lists no other); the checksums recorded are the store's own (size and CRC32C, MD5
or ETag of each object), so recording and checking them reads no array back.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxtrain.disk import bucket, storage
from jaxtrain.disk.files import write_text
from jaxtrain.errors import StorageError, UserError
from jaxtrain.model.params import path_names

log = logging.getLogger(__name__)

CHECKSUMS = "checksums.json"
# A state read back without checksums is read this many bytes at a time (_state_unreadable).
READ_BACK_BYTES = 1 << 30


class _OneLine(logging.Filter):
    """Orbax logs a failed background save with its traceback, four times over, and asyncio may log
    it once more ("Task exception was never retrieved", its traceback through orbax's frames); the
    StorageError that follows says it in one line, so those records keep only their first line.
    Orbax's note that a read-only manager's directory is read only is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" in record.pathname or _through_orbax(record.exc_info):
            if record.getMessage().startswith("Given directory is read only"):
                return False  # every read-only manager says it: what read-only means, not news
            record.msg, record.args = record.getMessage().splitlines()[0], None
            record.exc_info, record.exc_text = None, None
        return True


def _through_orbax(exc_info: Any) -> bool:
    """Whether a logged exception was raised inside orbax (any frame of its traceback)."""
    tb = exc_info[2] if isinstance(exc_info, tuple) else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


_ONE_LINE = _OneLine()


def _quiet_closed_loop(previous: Any) -> Any:
    """sys.unraisablehook without the noise of a failed save: when one write fails, orbax closes
    its event loop while tensorstore's other writes are still in flight, and each of those that
    ends then reports "Event loop is closed" as an unraisable traceback (tens of them). The
    StorageError says what happened; every other unraisable error still goes to `previous`."""

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
            previous(unraisable)

    hook.jaxtrain_quiet = True  # type: ignore[attr-defined]
    return hook


class Checkpointer:
    """A CheckpointManager over `directory` holding items `state` and `meta`."""

    def __init__(
        self,
        directory: Path | str,
        keep: int,
        read_only: bool = False,
        primary: bool = True,
        flag: str = "--resume_from",
    ) -> None:
        options = ocp.CheckpointManagerOptions(
            # Read-only: nothing saved, nothing deleted (the values orbax warns it sets otherwise).
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self.directory = bucket.path(directory)  # an epath.Path in a bucket
        for name in ("absl", "asyncio"):  # once each: a filter is added only once
            logging.getLogger(name).addFilter(_ONE_LINE)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self.primary = primary  # the process that records checksums (process 0)
        self.flag = flag  # how the user named this checkpoint, for error messages
        if not getattr(sys.unraisablehook, "jaxtrain_quiet", False):
            sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)
        self.pending: int | None = None  # the step being saved in the background
        # (what, time.monotonic() it started) of the save in flight, until its checksums are
        # recorded: read by the watchdog's thread (Watchdog.watch_beside), so set in one assignment.
        self.in_flight: tuple[str, float] | None = None
        self.state_bytes = 0  # of the state last saved: what one checkpoint needs on disk

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous save (after finishing the previous one); returns once the arrays
        are copied off the devices."""
        self.wait()
        self.state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        self.in_flight = (f"checkpoint save at step {step} (its background write)", time.monotonic())
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
        except Exception as e:
            raise self._failed(step, e) from None
        self.pending = step

    def poll(self) -> None:
        """Cheap, every step: raise a background save's failure now; finish a save that is done."""
        if self.pending is None:
            return
        try:
            self.manager.check_for_errors()
        except Exception as e:
            raise self._failed(self.pending, e) from None
        if bucket.is_url(self.directory):
            if not self.manager.is_saving_in_progress():  # its commit file is written
                self.wait()
        elif (self.directory / str(self.pending)).is_dir():  # orbax renamed it: the save is complete
            self.wait()

    def read_meta(self, step: int) -> dict[str, Any]:
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # missing, truncated or garbled files: one user problem
            raise unreadable(self.directory / str(step), e, self.flag) from None
        return dict(out["meta"])

    def restore(self, step: int, target: Any = None) -> Any:
        """Restore `state` into the shapes and shardings of `target` (abstract arrays), or as saved."""
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        except Exception as e:  # missing, truncated or mismatched files: one user problem
            raise unreadable(self.directory / str(step), e, self.flag) from None
        return out["state"]

    def check_params(self, step: int, target: Any, flag: str) -> None:
        """The saved params are `target`'s (abstract arrays): a param missing, extra or shaped
        otherwise is a one-line error naming `flag`."""
        try:
            saved = (
                ocp.PyTreeCheckpointHandler().metadata(self.directory / str(step) / "state").tree["params"]
            )
        except Exception as e:  # missing or garbled files
            raise unreadable(self.directory / str(step), e, self.flag) from None
        _check_shapes(saved, target, f"{flag} {self.directory / str(step)}")

    def restore_params(self, step: int, target: Any, flag: str) -> Any:
        """Only the saved state's params, into `target`'s shapes and shardings (checked first)."""
        self.check_params(step, target, flag)
        item = {"params": target}
        restore = ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=restore))
        except Exception as e:
            raise unreadable(self.directory / str(step), e, self.flag) from None
        return out["state"]["params"]

    def wait(self) -> None:
        """Finish the save in flight, if any, and record its checksums."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._failed(self.pending, e) from None
        if self.pending is not None and self.primary:
            step_dir = self.directory / str(self.pending)
            _write_text(step_dir / CHECKSUMS, json.dumps(_checksums(step_dir)))
        self.pending, self.in_flight = None, None

    def damage(self, step: int, read_back_on: Any = None) -> str | None:
        """Why checkpoint `step` cannot be restored, or None: its files against their checksums, or
        (none recorded) its state read back onto the device `read_back_on`, if given (a run's own
        checkpoints, where an older one can be taken instead; for one the user named, the restore's
        own error says the same), then its meta. Never raises: an unreadable file is damage."""
        step_dir = self.directory / str(step)
        try:
            recorded = json.loads((step_dir / CHECKSUMS).read_text())
        except FileNotFoundError:
            recorded = None  # older jaxtrain, or a kill before `wait` recorded them: read it back
        except (OSError, ValueError) as e:
            return f"{CHECKSUMS} unreadable: {e}"
        if recorded is not None and not isinstance(recorded, dict):
            return f"{CHECKSUMS} unreadable: not a JSON object"
        try:
            if recorded is not None:
                why = _differs(step_dir, recorded)
            else:
                why = _state_unreadable(step_dir, read_back_on) if read_back_on is not None else None
        except OSError as e:  # a file that cannot be opened or read (permissions, EIO)
            return f"a file is unreadable: {e}"
        if why:
            return why
        # Read the meta's file (JsonCheckpointHandler's `metadata`) directly: process 0 judges
        # alone, and orbax's restore would wait at a barrier for the other processes.
        try:
            meta = json.loads((step_dir / "meta" / "metadata").read_text())
        except (OSError, ValueError) as e:  # missing, truncated or garbled
            return f"its meta is unreadable: {type(e).__name__}"
        if not isinstance(meta, dict):
            return "its meta is unreadable: not a JSON object"
        return None

    def move_aside(self, step: int) -> Path:
        """Rename a damaged step dir out of the checkpoints (kept for a post-mortem, never deleted)."""
        aside = self.directory.parent / "damaged_checkpoints" / f"{step}.{time.strftime('%Y%m%d-%H%M%S')}"
        if bucket.is_url(self.directory):
            # No rename in a bucket: orbax stops listing the step once its commit file is gone,
            # then its objects are copied aside and deleted.
            step_url = str(self.directory / str(step))
            bucket.delete(f"{step_url}/commit_success.txt")
            for rel in bucket.listing(step_url):
                data = bucket.read(f"{step_url}/{rel}")
                if data is not None:
                    bucket.write(f"{aside}/{rel}", data)
            bucket.rmtree(step_url)
            return aside
        aside.parent.mkdir(exist_ok=True)
        (self.directory / str(step)).rename(aside)
        return aside

    def reload(self) -> None:
        """Forget steps moved aside by any process."""
        self.manager.reload()

    def _failed(self, step: int | None, e: Exception) -> Exception:
        """A StorageError for a save the filesystem refused (its half-written dir removed), else `e`."""
        reason = storage.failure_reason(e)
        if reason is None:
            return e
        log.warning(f"checkpoint save of step {step} failed: {type(e).__name__}: {e}")
        # orbax's temporary dirs: a step dir that never became complete (a bucket has none)
        if self.primary and not bucket.is_url(self.directory):
            # Its writer threads may still be finishing files in it: removed until it stays gone
            # (one pass left it behind once in ~20 CI runs).
            for _ in range(50):
                halves = list(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
                if not halves:
                    break
                for half in halves:
                    shutil.rmtree(half, ignore_errors=True)
                time.sleep(0.1)
        self.manager.reload()
        good = self.latest_step()
        last = f"{self.directory}/{good}" if good is not None else "none yet"
        free = ""
        if not bucket.is_url(self.directory):
            free = f"{storage.mib(storage.free_bytes(self.directory))} free there, "
        return StorageError(
            f"saving checkpoint {self.directory}/{step} failed: {reason}; "
            f"{free}a checkpoint needs about "
            f"{storage.mib(self.state_bytes)}; last good checkpoint: {last}; make room (or fix the "
            "filesystem), then relaunch the same command to resume from it"
        )

    def close(self) -> None:
        self.manager.close()


def unreadable(step_dir: Path, e: BaseException, flag: str = "--resume_from") -> UserError:
    """The one-line error for a step dir that cannot be restored; the details go to the log."""
    log.warning(f"restoring {step_dir} failed: {type(e).__name__}: {e}")
    return UserError(
        f"checkpoint {step_dir} is unreadable ({type(e).__name__}): it is incomplete or corrupt; "
        f"pass {flag} another checkpoint"
    )


def _differs(step_dir: Path, recorded: dict[str, Any]) -> str | None:
    """Which files of `step_dir` differ from the checksums recorded when it was saved, if any."""
    found = _checksums(step_dir)
    bad = sorted(name for name in recorded.keys() | found.keys() if recorded.get(name) != found.get(name))
    return f"{len(bad)} file(s) differ from their checksums, e.g. {bad[0]}" if bad else None


def _state_unreadable(step_dir: Path, device: Any) -> str | None:
    """Why the state of a step dir with no checksums cannot be read, or None: every array is read
    back on process 0, through orbax's handler, which has no barrier (the Checkpointer's restore
    waits for every process). Without this, the restore was the first to meet a truncated state
    file, and ended the launch (exit 2) where an older checkpoint was there to fall back on."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        saved = handler.metadata(step_dir / "state").tree
        for chunk in _chunks(saved, device):
            handler.restore(
                step_dir / "state", args=ocp.args.PyTreeRestore(item=chunk[0], restore_args=chunk[1])
            )
    except Exception as e:  # missing, truncated or garbled files: orbax raises many kinds
        log.warning(f"reading {step_dir}/state failed: {type(e).__name__}: {e}")
        return f"its state is unreadable: {type(e).__name__}"
    finally:
        handler.close()
    return None


def _chunks(saved: Any, device: Any) -> Iterator[tuple[Any, Any]]:
    """(item, restore_args) trees that read `saved`'s arrays (orbax's metadata tree) a few at a
    time, about READ_BACK_BYTES each, the rest left out (orbax's PLACEHOLDER): host memory stays
    near READ_BACK_BYTES whatever the state's size, and so does `device`'s. As jax arrays (their
    array metadata is read only then)."""
    leaves, treedef = jax.tree.flatten(saved)
    one = ocp.ArrayRestoreArgs(sharding=jax.sharding.SingleDeviceSharding(device))
    group: list[int] = []
    size = 0
    for i, meta in enumerate(leaves):
        group.append(i)
        size += math.prod(getattr(meta, "shape", ())) * np.dtype(getattr(meta, "dtype", None)).itemsize
        if size >= READ_BACK_BYTES or i == len(leaves) - 1:
            chosen = set(group)
            item = [m if j in chosen else ocp.PLACEHOLDER for j, m in enumerate(leaves)]
            args = [one if j in chosen else ocp.PLACEHOLDER for j in range(len(leaves))]
            yield jax.tree.unflatten(treedef, item), jax.tree.unflatten(treedef, args)
            group, size = [], 0


def _write_text(path: Any, text: str) -> None:
    """A file written whole (a bucket's object always is)."""
    if bucket.is_url(path):
        bucket.write(str(path), text.encode("utf-8"))
    else:
        write_text(path, text)


def _checksums(step_dir: Any) -> dict[str, list[Any]]:
    """[size, CRC32] of each file under `step_dir`, by relative path (CRC32: ~1 GB/s, in chunks); in
    a bucket [size, the store's own checksum or version] of each object, from one listing."""
    if bucket.is_url(step_dir):
        found = bucket.listing(str(step_dir))
        return {rel: [size, tag] for rel, (size, _, tag) in sorted(found.items()) if rel != CHECKSUMS}
    out = {}
    for p in sorted(step_dir.rglob("*")):
        if p.is_file() and p.name != CHECKSUMS:
            crc = 0
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    crc = zlib.crc32(chunk, crc)
            out[str(p.relative_to(step_dir))] = [p.stat().st_size, crc]
    return out


def locate(path: str, flag: str = "--resume_from") -> tuple[Any, int | None]:
    """Split a --resume_from (or `flag`) path into (checkpoints dir, step or None for the latest)."""
    if bucket.is_url(path):
        bucket.check(path, flag, write=False)
    p = bucket.path(path) if bucket.is_url(path) else Path(path)
    if not p.exists():
        raise UserError(f"{flag} {path} does not exist; give a run's checkpoints/ dir or one step dir in it")
    if not p.is_dir():
        raise UserError(f"{flag} {path} is a file; give a run's checkpoints/ dir or one step dir in it")
    if p.name.isdigit() and (p / "state").exists():
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    return p, None


def open_checkpoint(path: str, flag: str) -> tuple[Checkpointer, int]:
    """A read-only view of the checkpoint `path` names (a step dir, or the latest of a run)."""
    directory, step = locate(path, flag)
    source = Checkpointer(directory, 1, read_only=True, flag=flag)
    step = step if step is not None else source.latest_step()
    if step is None:
        raise UserError(f"{flag} {path} holds no complete checkpoint")
    return source, step


def _check_shapes(saved: Any, target: Any, where: str) -> None:
    """Every param of `target` is in `saved` with the same shape, and nothing else is."""

    def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {"/".join(path_names(path)): tuple(x.shape) for path, x in leaves}

    have, want = shapes(saved), shapes(target)
    fix = "give a checkpoint of this model, or the model keys it was trained with (its config.yaml)"
    differ = "model.n_layer, scan_layers or pos_embedding differ"
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            raise UserError(f"{where} has no param {name}, which this model has ({differ}); {fix}")
        if name not in want:
            raise UserError(f"{where} has a param {name} this model lacks ({differ}); {fix}")
        if have[name] != want[name]:
            raise UserError(
                f"{where}: param {name} is {list(have[name])} there, {list(want[name])} in this model; {fix}"
            )
