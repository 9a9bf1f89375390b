"""Token data on disk: files, shard sets, manifests and weighted mixtures, validated once.

    sources = open_sources("data/web/manifest.json", "train", 50304, token_dtype="auto", seq_len=1024)
    rows = sources[0].shards.read(np.array([0, 17, 4096]))  # int32 (3, seq_len + 1)

A data path is one source (a token file, a glob, a comma list of these, or a manifest.json written
by scripts/prepare_data.py, whose `train` or `val` shards are taken by role), or a YAML list of
sources with weights: `[{path: data/web/manifest.json, weight: 0.7}, {path: code/*.bin, weight: 0.3}]`.
A source's shards form one sample space of (seq_len + 1)-token windows, numbered shard by shard;
windows never cross a shard's end. Shards are memory-mapped only when read, at most `max_open` at
once, so memory and file handles stay flat however many shards there are.

Validation (header, length, largest token id) happens once per set of exact files: the result is
remembered in ~/.cache/jaxtrain keyed by every shard's (path, size, mtime), so a relaunch costs one
stat per shard. A run dir remembers its shards (data.json); a relaunch whose shards went missing,
changed size or content is refused naming the shard.

Any of these may be in a bucket (gs://, s3://; jaxtrain/disk/bucket.py): a shard there is read by
ranged GETs of the windows a batch needs, all of a batch's rows in flight together, never
downloaded whole; a manifest's shards are checked against the largest id it records, so only a
bare token file in a bucket is scanned (read once per host, then remembered).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxtrain.config.data import TOKEN_DTYPES, parse_spec
from jaxtrain.disk import bucket
from jaxtrain.disk.files import cache_root, write_text
from jaxtrain.errors import DataError
from jaxtrain.text.format import (
    HEADER_BYTES,
    HEADER_DTYPES,
    HEADER_INTS,
    HEADER_MAGIC,
    MANIFEST_FORMAT,
    NO_LOSS,
    token_dtype_for,
)

RUN_RECORD = "data.json"  # in the run dir: the shards the run started with
_CHECK_CHUNK = 16 * 2**20  # tokens per chunk when scanning a file for its largest id
_SAMPLE_BYTES = 4096  # head and tail bytes hashed to tell a shard's content changed


# ---------------------------------------------------------------- one token file


@dataclass(frozen=True)
class ShardInfo:
    """Where a token file's tokens are: byte offset, count and dtype."""

    path: Path  # or a bucket.ObjectPath
    offset: int
    count: int
    dtype: str
    mask: Path | None = None  # the loss mask beside it (prepare_data.py --chat), one uint8 per token


def inspect_file(path: Path, vocab_size: int, token_dtype: str, size: int) -> ShardInfo:
    """Header, dtype and token count of a token file of `size` bytes, checked; never reads the tokens."""
    if size == 0:
        raise DataError(f"token file {path} is empty (0 bytes); re-create it with scripts/prepare_data.py")
    header = _read_array(path, "<i4", 0, HEADER_INTS)[:] if size >= HEADER_BYTES else None
    if header is not None and header[0] != HEADER_MAGIC:
        header = None
    if header is not None:
        version = int(header[1])
        if version not in HEADER_DTYPES:
            raise DataError(f"token file {path} has llm.c header version {version}; only 1 and 2 are known")
        dtype, offset = HEADER_DTYPES[version], HEADER_BYTES
        if token_dtype not in ("auto", dtype):
            raise DataError(
                f"token file {path} has a header saying {dtype} tokens but token_dtype is "
                f"{token_dtype}; use --token_dtype auto"
            )
    else:
        dtype = token_dtype if token_dtype != "auto" else token_dtype_for(vocab_size)
        offset = 0
    itemsize = np.dtype(dtype).itemsize
    if (size - offset) % itemsize:
        other = "uint32" if dtype == "uint16" else "uint16"
        fits_other = header is None and (size - offset) % np.dtype(other).itemsize == 0
        hint = f"pass --token_dtype {other} if it holds {other}" if fits_other else "re-create it"
        raise DataError(
            f"token file {path} holds {size - offset} token bytes, not a multiple of {itemsize} "
            f"({dtype}): it is truncated; {hint}"
        )
    count = (size - offset) // itemsize
    if header is not None and int(header[2]) != count:
        raise DataError(
            f"token file {path} header says {int(header[2])} tokens but the file holds {count}; "
            "it is truncated or corrupt: re-create it"
        )
    return ShardInfo(path, offset, count, dtype)


def memmap(info: ShardInfo) -> Any:
    """The tokens of a shard, memory-mapped read-only (nothing is read until indexed)."""
    return _read_array(info.path, np.dtype(info.dtype).newbyteorder("<"), info.offset, info.count)


def _read_array(path: Any, dtype: Any, offset: int, count: int) -> Any:
    """`count` items of `dtype` at byte `offset` of a file (memory-mapped) or an object (ObjectArray)."""
    if isinstance(path, bucket.ObjectPath):
        return ObjectArray(path, np.dtype(dtype), offset, count)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


class ObjectArray:
    """A 1-D array in an object, read by ranged GETs: a slice is one GET, an (n, k) index of n
    contiguous rows (Shards.read's windows) at most n GETs in flight together, rows a few KiB apart
    or overlapping read by one (bucket.read_ranges)."""

    def __init__(self, path: bucket.ObjectPath, dtype: np.dtype, offset: int, count: int) -> None:
        self.path, self.dtype, self.offset, self.count = path, dtype, offset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, at: Any) -> np.ndarray:
        size = self.dtype.itemsize
        if isinstance(at, slice):
            lo, hi, _ = at.indices(self.count)
            if hi <= lo:
                return np.empty(0, self.dtype)
            return np.frombuffer(
                self.path.read_range(self.offset + lo * size, self.offset + hi * size), self.dtype
            )
        at = np.asarray(at)
        if at.ndim == 0:
            return self[int(at) : int(at) + 1][0]
        assert at.ndim == 2 and len(at), "rows of contiguous indices"
        starts = [self.offset + int(a) * size for a in at[:, 0]]
        ends = [self.offset + (int(a) + 1) * size for a in at[:, -1]]
        rows = bucket.read_ranges(self.path.url, starts, ends)
        return np.stack([np.frombuffer(r, self.dtype) for r in rows])


def _remember(record: Path, content: object) -> None:
    try:
        write_text(record, json.dumps(content))
    except OSError:
        pass  # a read-only home only costs a rescan next time


def _max_id(info: ShardInfo, vocab_size: int, mtime_ns: int) -> int:
    """The largest token id of a shard, raising on the first id >= vocab_size; chunked, so RAM stays flat.

    Remembered per file (path, size, mtime): adding one shard to a set scans only that shard.
    """
    key = hashlib.sha1(f"{info.path.resolve()}:{info.offset + info.count}:{mtime_ns}".encode()).hexdigest()
    # (an object in a bucket is read once per host, by range, then remembered)
    record = cache_root() / "token_scans" / f"{key}.json"
    try:
        largest = int(json.loads(record.read_text())["max_id"])
        if largest < vocab_size:
            return largest
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record (or an unreadable one): scan
    tokens, largest = memmap(info), 0
    for lo in range(0, len(tokens), _CHECK_CHUNK):
        chunk = tokens[lo : lo + _CHECK_CHUNK]
        chunk_max = int(chunk.max())
        if chunk_max >= vocab_size:
            at = lo + int(np.argmax(chunk >= vocab_size))
            bad = int(tokens[at])
            raise DataError(
                f"token file {info.path} holds token id {bad} at position {at} but model.vocab_size is "
                f"{vocab_size}; set --model.vocab_size to at least {bad + 1}, or --token_dtype if the "
                f"file is not {info.dtype}"
            )
        largest = max(largest, chunk_max)
    _remember(record, {"path": str(info.path.resolve()), "max_id": largest})
    return largest


# ---------------------------------------------------------------- shard sets


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many non-overlapping (seq_len + 1)-token windows start at multiples of seq_len."""
    return max(0, (num_tokens - 1) // seq_len)


class Shards:
    """Token shards as one space of windows: window w is in shard i when starts[i] <= w < starts[i + 1]."""

    def __init__(self, infos: Sequence[ShardInfo], seq_len: int, max_open: int = 64) -> None:
        self.infos, self.seq_len, self.max_open = list(infos), seq_len, max_open
        counts = np.array([num_windows(i.count, seq_len) for i in self.infos], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.n_windows = int(self.starts[-1])
        self.num_tokens = sum(i.count for i in self.infos)
        # From the manifests: (bos, eos) of each (None: not recorded), --chat's window lengths
        self.framings: set[tuple[int | None, int | None] | None] = set()
        self.windows: set[int] = set()
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # grain's threads read concurrently

    def tokens(self, i: int) -> np.ndarray:
        """Shard i memory-mapped; the least recently used map is dropped past max_open."""
        with self._lock:
            mm = self._open.get(i)
            if mm is None:
                mm = self._open[i] = memmap(self.infos[i])
                if len(self._open) > self.max_open:
                    # A reader still holding the dropped map keeps it alive until it is done.
                    self._open.popitem(last=False)
            else:
                self._open.move_to_end(i)
            return mm

    def read(self, windows: np.ndarray) -> np.ndarray:
        """The windows' tokens as int32 (len(windows), seq_len + 1)."""
        windows = np.asarray(windows, dtype=np.int64)
        shard = np.searchsorted(self.starts, windows, side="right") - 1
        offsets = (windows - self.starts[shard]) * self.seq_len
        out = np.empty((len(windows), self.seq_len + 1), dtype=np.int32)
        span = np.arange(self.seq_len + 1, dtype=np.int64)
        for i in np.unique(shard):
            here = shard == i
            at = offsets[here][:, None] + span
            out[here] = self.tokens(int(i))[at]
            if (mask := self.infos[i].mask) is not None:
                keep = _read_array(mask, np.uint8, 0, self.infos[i].count)[at]
                out[here] |= np.where(keep == 0, NO_LOSS, 0).astype(np.int32)
        return out


@dataclass(frozen=True)
class Source:
    """A named, weighted set of shards."""

    name: str
    weight: float
    shards: Shards


@dataclass(frozen=True)
class _Entry:
    """A shard to open; from a manifest, with what prepare_data.py wrote and when."""

    path: Path
    manifest_bytes: int | None = None
    manifest_max_id: int | None = None
    manifest_mtime_ns: int = 0
    mask: Path | None = None
    framing: tuple[int | None, int | None] | None = None  # boundary tokens (bos, eos); None: unknown
    window: int = 0  # prepare_data.py --chat packed conversations into windows of this many tokens


def _manifest_entries(path: Any, role: str) -> list[_Entry]:
    try:
        manifest = json.loads(path.read_text())
        split = manifest["splits"][role] if manifest.get("format") == MANIFEST_FORMAT else None
    except (OSError, ValueError, KeyError, TypeError):
        split = manifest = None
    if manifest is None:
        raise DataError(f"{path} is not a readable manifest of scripts/prepare_data.py; re-create the data")
    if split is None or not split.get("shards"):
        raise DataError(
            f"manifest {path} has no {role} shards (prepared with --val_fraction 0?); pass "
            f"--{'valid' if role == 'val' else 'train'}_data_path or --eval_interval 0"
        )
    mtime = path.stat().st_mtime_ns
    framing = manifest.get("framing")
    bos_eos = None if framing is None else (framing.get("bos"), framing.get("eos"))
    window = int((manifest.get("chat") or {}).get("seq_len", 0))
    return [
        _Entry(
            path.parent / s["file"], s["bytes"], s["max_id"], mtime,
            path.parent / s["mask"] if s.get("mask") else None, bos_eos, window,
        )
        for s in split["shards"]
    ]  # fmt: skip


def _entries(path_spec: str, role: str) -> list[_Entry]:
    """The shards named by one source: files, globs and manifests, comma-separated, in order."""
    out: list[_Entry] = []
    for item in (s.strip() for s in path_spec.split(",")):
        if not item:
            continue
        if glob.has_magic(item):
            if bucket.is_url(item):
                found = bucket.glob(item)
            else:
                found = sorted(p for p in glob.glob(item) if os.path.isfile(p))
            if not found:
                raise DataError(f"no token files match {item}; check the pattern (quote it in the shell)")
            out += [_Entry(bucket.as_path(p)) for p in found]
        elif item.endswith(".json"):
            if not bucket.as_path(item).is_file():
                raise DataError(f"manifest {item} does not exist; make one with scripts/prepare_data.py")
            out += _manifest_entries(bucket.as_path(item), role)
        else:
            out.append(_Entry(bucket.as_path(item)))
    if not out:
        raise DataError(f"data path {path_spec!r} names no file; pass a token file, glob or manifest")
    return out


def _stat(path: Any) -> Any:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(
            f"token file {path} does not exist; check the data path or make one with scripts/prepare_data.py"
        ) from None
    if not path.is_file():
        raise DataError(f"token file {path} is not a file; point at a token file such as {path}/train.bin")
    return st


def open_shards(path_spec: str, role: str, vocab_size: int, token_dtype: str, seq_len: int) -> Shards:
    """One source's shards, validated (at most once per exact set of files: then one stat per shard)."""
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"token_dtype must be {'|'.join(TOKEN_DTYPES)}, got {token_dtype!r}")
    entries = _entries(path_spec, role)
    stats = [_stat(e.path) for e in entries]
    key = hashlib.sha1(
        "\n".join(
            [token_dtype, str(vocab_size)]
            + [f"{e.path.resolve()}:{s.st_size}:{s.st_mtime_ns}" for e, s in zip(entries, stats, strict=True)]
        ).encode()
    ).hexdigest()
    record = cache_root() / "token_sets" / f"{key}.json"
    try:
        infos = [
            ShardInfo(e.path, *row) for e, row in zip(entries, json.loads(record.read_text()), strict=True)
        ]
    except (OSError, ValueError, TypeError):
        infos = _validate(entries, stats, vocab_size, token_dtype)
        _remember(record, [[i.offset, i.count, i.dtype] for i in infos])
    for e, info in zip(entries, infos, strict=True):
        if e.mask is None:
            continue
        if not e.mask.is_file():
            raise DataError(f"loss mask {e.mask} of {e.path} is missing; re-create the data")
        if (size := e.mask.stat().st_size) != info.count:  # one byte a token: a cut copy reads past its end
            raise DataError(
                f"loss mask {e.mask} holds {size:,} bytes but {e.path} holds {info.count:,} tokens (one "
                "byte a token); the copy is cut short or stale: copy or re-create the data"
            )
    infos = [dataclasses.replace(i, mask=e.mask) for i, e in zip(infos, entries, strict=True)]
    shards = Shards(infos, seq_len)
    shards.framings = {e.framing for e in entries}
    shards.windows = {e.window for e in entries if e.window}
    if shards.n_windows < 1:
        what = (
            f"token file {entries[0].path}"
            if len(entries) == 1
            else f"data {path_spec} ({len(entries)} shards)"
        )
        raise DataError(
            f"{what} holds {shards.num_tokens} tokens, fewer than the {seq_len + 1} one sequence needs "
            "(seq_len + 1); use a smaller --model.seq_len or more data"
        )
    return shards


def _validate(
    entries: Sequence[_Entry], stats: Sequence[Any], vocab_size: int, token_dtype: str
) -> list[ShardInfo]:
    infos = [
        inspect_file(e.path, vocab_size, token_dtype, s.st_size) for e, s in zip(entries, stats, strict=True)
    ]

    def largest(i: int) -> int:
        e, st = entries[i], stats[i]
        # A manifest's shard unchanged since the manifest was written needs no scan.
        if (
            e.manifest_max_id is not None
            and st.st_size == e.manifest_bytes
            and st.st_mtime_ns <= e.manifest_mtime_ns
        ):
            if e.manifest_max_id >= vocab_size:
                raise DataError(
                    f"token file {e.path} holds token ids up to {e.manifest_max_id} but model.vocab_size is "
                    f"{vocab_size}; set --model.vocab_size to at least {e.manifest_max_id + 1}"
                )
            return e.manifest_max_id
        return _max_id(infos[i], vocab_size, st.st_mtime_ns)

    with ThreadPoolExecutor(min(8, len(infos))) as pool:  # numpy's max releases the GIL
        list(pool.map(largest, range(len(infos))))
    return infos


def manifest_vocab(spec: str, key: str) -> int:
    """The largest vocabulary the manifests of a data path setting (`key`) record, their
    tokenizer's; 0 where it names none (token files and globs record none). A manifest that cannot
    be read is left to open_sources to name."""
    sizes = [0]
    for source in parse_spec(spec, key):
        for item in (s.strip() for s in source.path.split(",")):
            if not item.endswith(".json") or not bucket.as_path(item).is_file():
                continue
            try:
                sizes.append(int(json.loads(bucket.as_path(item).read_text())["tokenizer"]["vocab_size"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return max(sizes)


def open_sources(spec: str, role: str, vocab_size: int, token_dtype: str, seq_len: int) -> list[Source]:
    """Every source of a data path setting (role: 'train' or 'val' picks a manifest's split)."""
    key = "train_data_path" if role == "train" else "valid_data_path"
    return [
        Source(s.name, s.weight, open_shards(s.path, role, vocab_size, token_dtype, seq_len))
        for s in parse_spec(spec, key)
    ]


# ---------------------------------------------------------------- the run's data, unchanged


def _fingerprint(path: Any, st: Any) -> str:
    """A hash of a shard's head and tail: cheap, and catches a rewrite that kept the size (in a
    bucket, the object's own checksum or version)."""
    if isinstance(path, bucket.ObjectPath):
        return path.tag()
    h = hashlib.sha1()
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, st.st_size - _SAMPLE_BYTES))
        h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _describe(sources: Sequence[Source]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for s in sources:
        for info in s.shards.infos:
            st = info.path.stat()
            out.append(
                {"source": s.name, "path": str(info.path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                 "sample": _fingerprint(info.path, st)}
            )  # fmt: skip
    return out


def record_run_data(run_dir: Path, sources: Sequence[Source]) -> None:
    """Remember the shards a run starts with (process 0, at its first launch)."""
    path = run_dir / RUN_RECORD
    if not path.exists():
        write_text(path, json.dumps({"shards": _describe(sources)}))


def check_run_data(run_dir: Path, overwrite: bool, sources: Sequence[Source]) -> None:
    """Refuse to continue a run whose shards went missing, changed, or were added since it started."""
    path = run_dir / RUN_RECORD
    if overwrite or not path.exists():
        return
    try:
        before = json.loads(path.read_text())["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{path} is unreadable; restore it, or pass --overwrite to start afresh") from None
    fix = "restore the data as it was, or start a new --run_dir (or --overwrite)"
    now = [str(i.path) for s in sources for i in s.shards.infos]
    for old in before:
        p = bucket.as_path(old["path"])
        if not p.exists():
            raise DataError(f"shard {p} of this run's data is missing since the run started; {fix}")
        st = p.stat()
        if st.st_size != old["bytes"]:
            how = "truncated" if st.st_size < old["bytes"] else "grown"
            raise DataError(
                f"shard {p} changed since the run started ({how}: {old['bytes']} -> {st.st_size} "
                f"bytes); {fix}"
            )
        if st.st_mtime_ns != old["mtime_ns"] and _fingerprint(p, st) != old["sample"]:
            raise DataError(f"shard {p} changed since the run started (its content differs); {fix}")
    known = {old["path"] for old in before}
    added = [p for p in now if p not in known]
    if added or len(now) != len(before):
        raise DataError(
            f"the data path now names {len(now)} shards, the run started with {len(before)} "
            f"({'new: ' + added[0] if added else 'a shard is gone'}); {fix}"
        )
