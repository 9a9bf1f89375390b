"""Token files, the deterministic global batch order, and the per-process grain loaders.

    tokens = open_tokens("data/train.bin", vocab_size=256, min_tokens=seq_len + 1)
    for batch in train_loader(tokens, seq_len, batch_size, seed, start_step, total_steps,
                              process_index, process_count, num_threads=4, prefetch=4):
        inputs, targets = batch[:, :-1], batch[:, 1:]

The global batch at step s depends only on (len(tokens), seq_len, batch_size, seed, s): never on
the process or device count, so a run can resume on a different topology and see the same data.
Sequence windows are the non-overlapping starts 0, seq_len, 2*seq_len, ...; global sample
g = s * batch_size + r is window perm_e(g % n) of epoch e = g // n, where perm_e is a keyed
Feistel permutation of [0, n): computed per index, so it needs no memory, no cache and no lock
however large the file, and grain's threads can call it freely.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np

from jaxtrain.config import check_batch_split
from jaxtrain.corpus import write_corpus
from jaxtrain.errors import UserError
from jaxtrain.files import write_text
from jaxtrain.tokenizer import ByteTokenizer

HEADER_MAGIC = 20240520  # llm.c token files: 256 int32 header, then the tokens
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
_HEADER_DTYPES = {1: "uint16", 2: "uint32"}
_CHECK_CHUNK = 16 * 2**20  # tokens per chunk when scanning a file for its largest id
_ROUNDS = 6  # Feistel rounds; 4 already give a pseudorandom permutation, 6 for margin
_MASK64 = 2**64 - 1


class DataError(UserError):
    """A token file that cannot be used."""


# ---------------------------------------------------------------- token files


def _read_header(path: Path, size: int) -> np.ndarray | None:
    """The llm.c header of a token file, or None for a raw nanoGPT file."""
    if size < HEADER_BYTES:
        return None
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    return header if header[0] == HEADER_MAGIC else None


def open_tokens(
    path: str | Path, vocab_size: int, token_dtype: str = "auto", min_tokens: int = 2
) -> np.ndarray:
    """Memory-mapped 1-D token array of a flat token file, validated. Never loads it into RAM."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"token file {path} does not exist; check the data path or make one with scripts/prepare_data.py"
        )
    if not path.is_file():
        raise DataError(f"token file {path} is not a file; point at a token file such as {path}/train.bin")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"token file {path} is empty (0 bytes); re-create it with scripts/prepare_data.py")
    if token_dtype not in ("auto", "uint16", "uint32"):
        raise DataError(f"token_dtype must be auto|uint16|uint32, got {token_dtype!r}")

    header = _read_header(path, size)
    if header is not None:
        version = int(header[1])
        if version not in _HEADER_DTYPES:
            raise DataError(f"token file {path} has llm.c header version {version}; only 1 and 2 are known")
        dtype, offset = _HEADER_DTYPES[version], HEADER_BYTES
        if token_dtype not in ("auto", dtype):
            raise DataError(
                f"token file {path} has a header saying {dtype} tokens but token_dtype is "
                f"{token_dtype}; use --token_dtype auto"
            )
    else:
        dtype = token_dtype if token_dtype != "auto" else ("uint16" if vocab_size <= 65536 else "uint32")
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
    if count < min_tokens:
        raise DataError(
            f"token file {path} holds {count} tokens, fewer than the {min_tokens} one sequence needs "
            "(seq_len + 1); use a smaller --model.seq_len or more data"
        )
    tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=offset, shape=(count,))
    _check_ids(tokens, vocab_size, path, dtype)
    return tokens


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxtrain"


def _scan_record(path: Path) -> Path:
    """Where the largest id of this exact file (path, size, mtime) is remembered."""
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return _cache_root() / "token_scans" / f"{key}.json"


def _check_ids(tokens: np.ndarray, vocab_size: int, path: Path, dtype: str) -> None:
    """Raise on the first id >= vocab_size, scanning in chunks so RAM stays flat.

    A big file takes a while to scan, and every process of every launch would do it again, so
    the largest id of a file that passed is remembered (keyed by path, size and mtime).
    """
    record = _scan_record(path)
    try:
        if json.loads(record.read_text())["max_id"] < vocab_size:
            return
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record (or an unreadable one): scan
    largest = 0
    for lo in range(0, len(tokens), _CHECK_CHUNK):
        chunk = tokens[lo : lo + _CHECK_CHUNK]
        chunk_max = int(chunk.max())
        if chunk_max >= vocab_size:
            at = lo + int(np.argmax(chunk >= vocab_size))
            bad = int(tokens[at])
            raise DataError(
                f"token file {path} holds token id {bad} at position {at} but model.vocab_size is "
                f"{vocab_size}; set --model.vocab_size to at least {bad + 1}, or --token_dtype if the "
                f"file is not {dtype}"
            )
        largest = max(largest, chunk_max)
    try:
        write_text(record, json.dumps({"path": str(path.resolve()), "max_id": largest}))
    except OSError:
        pass  # a read-only home only costs a rescan next time


# ---------------------------------------------------------------- batch order


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many non-overlapping (seq_len + 1)-token windows start at multiples of seq_len."""
    return max(0, (num_tokens - 1) // seq_len)


def _require_windows(num_tokens: int, seq_len: int, what: str) -> int:
    """The window count, or a DataError when there is not even one."""
    n = num_windows(num_tokens, seq_len)
    if n < 1:
        raise DataError(
            f"{what} holds {num_tokens} tokens, not one window of seq_len + 1 = {seq_len + 1}; "
            "use a smaller --model.seq_len or more data"
        )
    return n


def process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """The rows of each global batch that process `process_index` loads."""
    check_batch_split(batch_size, process_count)
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} is outside [0, {process_count})")
    local = batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-mixing hash of uint64 values (wraps by design)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _feistel(x: np.ndarray, half_bits: int, keys: np.ndarray) -> np.ndarray:
    """A balanced Feistel network: a bijection of [0, 4**half_bits) for any round keys."""
    mask, shift = np.uint64((1 << half_bits) - 1), np.uint64(half_bits)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << shift) | right


def _permute(idx: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """perm_(seed, epoch)[idx] for a pseudorandom permutation of [0, n)."""
    keys = np.random.SeedSequence([seed & _MASK64, epoch]).generate_state(_ROUNDS, np.uint64)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    x = _feistel(idx.astype(np.uint64), half_bits, keys)
    # Cycle-walking: re-encrypt values past n; this restricts the bijection to [0, n), and
    # since the domain is < 4n it takes under 4 rounds on average.
    out = x >= n
    while out.any():
        x[out] = _feistel(x[out], half_bits, keys)
        out = x >= n
    return x.astype(np.int64)


def global_batch_rows(
    num_tokens: int, seq_len: int, batch_size: int, seed: int, step: int, rows: slice | None = None
) -> np.ndarray:
    """int64 token offsets of the windows in rows `rows` (default all) of the global batch at `step`."""
    n = _require_windows(num_tokens, seq_len, "training data")
    g = step * batch_size + np.arange(batch_size, dtype=np.int64)[rows if rows is not None else slice(None)]
    epoch, idx = g // n, g % n
    window = np.empty_like(g)
    for e in np.unique(epoch):  # at most two epochs meet in one batch unless batch_size > n
        here = epoch == e
        window[here] = _permute(idx[here], n, seed, int(e))
    return window * seq_len


def load_rows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """The windows tokens[start : start + seq_len + 1] for each start, as int32 (n, seq_len + 1)."""
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    return np.asarray(tokens[idx], dtype=np.int32)


def train_loader(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    seed: int,
    start_step: int,
    total_steps: int,
    process_index: int,
    process_count: int,
    num_threads: int,
    prefetch: int,
) -> Iterator[np.ndarray]:
    """This process's rows of the global batches of steps [start_step, total_steps), read ahead."""
    rows = process_rows(batch_size, process_index, process_count)
    num_tokens = len(tokens)
    _require_windows(num_tokens, seq_len, "training data")  # fail here, not later in a grain thread
    if start_step < 0:
        raise DataError(f"start_step must be >= 0, got {start_step}")

    def batch_at(step: int) -> np.ndarray:
        return load_rows(
            tokens, global_batch_rows(num_tokens, seq_len, batch_size, seed, step, rows), seq_len
        )

    # The position in the data is the global step alone, so resuming is a different start_step.
    ds = grain.MapDataset.range(start_step, max(start_step, total_steps)).map(batch_at)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int, process_index: int, process_count: int
) -> list[np.ndarray]:
    """A fixed set of validation batches (this process's rows), the same for every call and topology."""
    rows = process_rows(batch_size, process_index, process_count)
    n = _require_windows(len(tokens), seq_len, "validation data")
    total = n_batches * batch_size
    # Evenly spaced windows over the whole file; a file with fewer windows repeats some.
    starts = (np.arange(total, dtype=np.int64) * n // total) * seq_len
    return [
        load_rows(tokens, starts[b * batch_size : (b + 1) * batch_size][rows], seq_len)
        for b in range(n_batches)
    ]


# ---------------------------------------------------------------- the default dataset


def _stdlib_sources(max_bytes: int) -> list[Path]:
    """The standard library's own .py files in sorted order, without tests, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    files, total = [], 0
    # Sorted by path relative to the root, so the order is the same on every run.
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return files


def default_dataset(cache_dir: str | Path | None = None, max_bytes: int = 32 * 2**20) -> tuple[Path, Path]:
    """(train.bin, val.bin) of the Python standard library's sources as bytes (vocab 256), built once."""
    if cache_dir is None:
        cache_dir = _cache_root()
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    out_dir = Path(cache_dir) / "stdlib_bytes" / f"{version}-max{max_bytes}"
    train, val = out_dir / "train.bin", out_dir / "val.bin"
    if train.is_file() and val.is_file():
        return train, val
    files = _stdlib_sources(max_bytes)
    if not files:
        raise DataError(
            f"no Python sources found under {sysconfig.get_paths()['stdlib']} to build the default "
            "dataset; pass --train_data_path (see scripts/prepare_data.py)"
        )
    # Several processes may build at once: each writes its own temp files and the renames of
    # identical bytes are harmless. train.bin is renamed last, so its presence means done.
    result = write_corpus(files, out_dir, 0.01, ByteTokenizer())
    assert result.val_path is not None
    return result.train_path, result.val_path
