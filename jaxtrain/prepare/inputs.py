"""Text inputs of scripts/prepare_data.py: .txt, .jsonl and .parquet files cut into work units.

    files = describe(find_files(["web/", "books/*.txt"], "*.txt,*.jsonl,*.parquet"), "text")
    for unit in plan(files, val_fraction=0.01):
        texts = read_unit(files[unit.file], unit, text_key="text", text_column="text")

Units are ~8 MiB byte ranges of text and jsonl files (cut where a line starts) and row groups of
parquet files, so workers read them independently and memory stays bounded by a unit, never the
corpus. The validation split is the last val_fraction of the input bytes, moved to the next line
start (or parquet row), so no unit straddles it, and holds at least the input's last line (row): a
corpus of one-line documents (files, jsonl lines, rows) is split between whole ones. Documents of
jsonl and parquet files end with a blank line, unless the tokenizer frames documents with its own
tokens (then a text file is one document).

Any input may be an object in a bucket (gs://b/web/*.parquet, s3://b/books/): it is streamed by
ranged reads through fsspec (a unit's bytes, a parquet file's footer and row groups), never
copied whole to local disk.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from jaxtrain.disk import bucket
from jaxtrain.errors import UserError

Location = Path | bucket.ObjectPath  # a file on disk, or an object in a bucket
T = TypeVar("T")

UNIT_BYTES = 8 * 2**20
DOC_END = "\n\n"  # after every jsonl/parquet document, so documents never run together
_SCAN = 2**20  # bytes a text file is searched for a line start before a character start is taken
_STEP = 2**16  # bytes read at a time looking for a line start
_BLOCK = 2**18  # an object's reads: each ranged GET reads this much past what was asked
_PIECE = 2**16  # characters per piece handed to the tokenizer (cut at line ends)


@dataclass(frozen=True)
class InputFile:
    """An input file; `groups` holds a parquet file's rows per row group."""

    path: Location
    kind: str  # txt | jsonl | parquet
    size: int
    groups: tuple[int, ...] = ()
    checksum: str = ""  # an object's: the store's own (bucket.stat's version tag)


@dataclass(frozen=True)
class Unit:
    """Bytes [start, end) of a text or jsonl file (moved to line starts), or rows of a parquet row group."""

    file: int
    start: int
    end: int
    is_val: bool
    group: int = -1


def _kind(path: Location) -> str:
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(Path(path.name).suffix.lower(), "txt")


def _filesystem(url: str) -> Any:
    """fsspec's filesystem of `url`'s scheme, made without bucket.fs's set-up for checkpoints (which
    imports orbax): what a tokenizing worker needs to read objects. Endpoints and credentials come
    from where the clouds' SDKs look, as bucket.fs's do."""
    import fsspec

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # as bucket._setup
    return fsspec.filesystem(url.partition("://")[0])


def open_binary(path: Location, size: int | None = None) -> BinaryIO:
    """The file, or the object streamed by ranged reads (`size`, where known, spares a request for
    it), open for reading bytes."""
    if isinstance(path, bucket.ObjectPath):
        fs, key = _filesystem(path.url), path.url.partition("://")[2]
        return fs.open(key, "rb", block_size=_BLOCK, cache_type="readahead", size=size)
    return open(path, "rb")


def _parts(url: str) -> list[str]:
    """A URL's sort key: by folder, then name, as sorted() orders Paths (so "a/x" before "a-b/y")."""
    return url.split("/")


def _find_objects(item: str, patterns: list[str], pattern: str, checked: set[str]) -> list[Location]:
    """The objects `item` (a gs:// or s3:// URL) names: one object, a glob's matches, or the objects
    under a prefix matching `patterns`; a bucket that cannot be read is one line, as on disk (each
    bucket checked once: `checked` holds those that were)."""
    scheme, name, _ = bucket.split(item)
    if f"{scheme}://{name}" not in checked:
        bucket.check(item, "input", write=False)  # no such bucket, no credentials: UserError
        checked.add(f"{scheme}://{name}")
    fs, key = bucket.fs(item), item.partition("://")[2].rstrip("/")
    if glob.has_magic(item):
        matched = bucket.retry(f"listing {item}", lambda: fs.glob(key, detail=True))
        found = sorted(
            (f"{scheme}://{k}" for k, info in matched.items() if info.get("type") == "file"), key=_parts
        )
        if not found:
            raise UserError(f"no objects match {item}; check the pattern (quote it in the shell)")
        return [bucket.ObjectPath(u) for u in found]
    try:
        info = bucket.retry(f"reading {item}", lambda: fs.info(key, refresh=True))
    except FileNotFoundError:
        info = {}
    if info.get("type") == "file":
        return [bucket.ObjectPath(item)]
    if info.get("type") == "directory":
        under = [rel for rel in bucket.listing(item) if not rel.endswith("/")]
        names = {rel for rel in under if any(fnmatch.fnmatch(rel.rpartition("/")[2], p) for p in patterns)}
        if not names:
            raise UserError(f"no objects matching '{pattern}' under {item}; pass another --glob, e.g. '*.md'")
        return [bucket.ObjectPath(u) for u in sorted((f"{item.rstrip('/')}/{n}" for n in names), key=_parts)]
    raise UserError(
        f"input {item} does not exist; pass text, jsonl or parquet objects or prefixes (folders) of them"
    )


def find_files(inputs: list[str], pattern: str) -> list[Location]:
    """Files named directly or by a glob, plus files under named folders matching `pattern` (comma
    list); each may be in a bucket (gs://, s3://)."""
    files: list[Location] = []
    patterns = [p.strip() for p in pattern.split(",") if p.strip()]
    checked: set[str] = set()
    for item in inputs:
        if bucket.is_url(item):
            files += _find_objects(item, patterns, pattern, checked)
        elif glob.has_magic(item):
            found = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not found:
                raise UserError(f"no files match {item}; check the pattern (quote it in the shell)")
            files += found
        elif Path(item).is_file():
            files.append(Path(item))
        elif Path(item).is_dir():
            found = sorted({p for pat in patterns for p in Path(item).rglob(pat) if p.is_file()})
            if not found:
                raise UserError(
                    f"no files matching '{pattern}' under {item}; pass another --glob, e.g. '*.md'"
                )
            files += found
        else:
            raise UserError(
                f"input {item} does not exist; pass text, jsonl or parquet files or folders of them"
            )
    if not files:
        raise UserError("no input given; pass text, jsonl or parquet files or folders of them")
    return files


def _parquet(path: Location, size: int | None = None) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path} is parquet, which needs pyarrow: pip install -e '.[parquet]'") from None
    try:
        # An object: its footer, then each row group's column, read by range through fsspec.
        return _retried(path, lambda: pq.ParquetFile(open_binary(path, size) if _remote(path) else path))
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... on a bad file
        raise _unreadable(path, e, "parquet file") from None


def _remote(path: Location) -> bool:
    return isinstance(path, bucket.ObjectPath)


def _retried(path: Location, fn: Callable[[], T]) -> T:
    """fn(), tried again while an object's read fails transiently (a file's: once)."""
    return bucket.retry(f"reading {path}", fn) if _remote(path) else fn()


def _unreadable(path: Location, e: Exception, what: str) -> UserError:
    """The one line for a file that cannot be read: a bad file's, or a store's refusal."""
    if _remote(path) and (bucket.transient(e) or isinstance(e, (FileNotFoundError, PermissionError))):
        return UserError(f"{path} cannot be read: {bucket.reason(e)}")
    return UserError(f"{path} is not a readable {what} ({str(e).splitlines()[0]}); re-create it")


def describe(paths: Sequence[Location], text_column: str | None) -> list[InputFile]:
    """Size, kind and (parquet) row groups of each input; empty files and missing text columns are
    refused (text_column None: no text column is read, as with --chat's messages)."""
    out = []
    for path in paths:
        checksum, kind = "", _kind(path)
        if isinstance(path, bucket.ObjectPath):
            found = bucket.stat(path.url)
            if found is None:
                raise UserError(f"input {path} does not exist (removed meanwhile?)")
            size, _, checksum = found
        else:
            size = path.stat().st_size
        if size == 0:
            raise UserError(f"input {path} is empty (0 bytes); remove it or fill it")
        groups: tuple[int, ...] = ()
        if kind == "parquet":
            pf = _parquet(path, size)
            schema = pf.schema_arrow
            if text_column is not None and text_column not in schema.names:
                raise UserError(
                    f"{path} has no column '{text_column}' (columns: {', '.join(schema.names)}); "
                    "pass --text_column NAME"
                )
            text = ("string", "large_string", "string_view")
            if text_column is not None and str(schema.field(text_column).type) not in text:
                raise UserError(
                    f"{path} column '{text_column}' holds {schema.field(text_column).type}, not text; "
                    "pass --text_column NAME"
                )
            groups = tuple(pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups))
            if not sum(groups):
                raise UserError(f"input {path} has no rows; remove it")
        out.append(InputFile(path, kind, size, groups, checksum))
    return out


def plan(files: list[InputFile], val_fraction: float, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Work units in output order: the inputs' training part, then validation: from the first line
    start (parquet: row) at or after the last val_fraction of the bytes, and at least the input's
    last line or row, so a corpus of one-line documents is split between whole documents."""
    split_at = round(sum(f.size for f in files) * (1 - val_fraction)) if val_fraction else None
    units, offset = [], 0
    for i, f in enumerate(files):
        cut = None if split_at is None else min(max(split_at - offset, 0), f.size)
        offset += f.size
        last = i == len(files) - 1
        if f.kind == "parquet":
            units += _row_units(i, f, cut, last)
            continue
        if cut is not None:
            cut = _val_start(f, cut, last)
        parts = [(0, f.size, False)] if cut is None else [(0, cut, False), (cut, f.size, True)]
        for lo, hi, is_val in parts:
            for a in range(lo, hi, unit_bytes):
                units.append(Unit(i, a, min(a + unit_bytes, hi), is_val))
    if val_fraction and all(u.is_val for u in units):
        raise UserError(
            f"the input is one document (one line or row: {files[-1].path}), and validation takes whole "
            "ones from the end, leaving none to train on; add documents or pass --val_fraction 0"
        )
    return units


def _row_units(i: int, f: InputFile, cut: int | None, last: bool) -> list[Unit]:
    """A parquet file's units: its row groups, split at the row `cut` bytes in falls on."""
    rows = sum(f.groups)
    val_row = rows if cut is None else round(cut / f.size * rows)
    if cut is not None and last:
        val_row = min(val_row, rows - 1)  # the last row at least: validation is never empty
    units, row = [], 0
    for g, n in enumerate(f.groups):
        for lo, hi, is_val in ((row, min(row + n, val_row), False), (max(row, val_row), row + n, True)):
            if lo < hi:
                units.append(Unit(i, lo - row, hi - row, is_val, g))
        row += n
    return units


def _val_start(f: InputFile, cut: int, last: bool) -> int:
    """Where validation starts in a text or jsonl file cut at byte `cut`: the line start read_unit
    would move it to, but in the input's last file no later than its last line holding text (that
    line start, read_unit leaves as it is)."""

    def find() -> int:
        with open_binary(f.path, f.size) as fh:
            start = _line_start(fh, cut, f.size, f.kind == "jsonl")
            return min(start, _last_line_start(fh, f.size)) if last else start

    return _retried(f.path, find)


def _last_line_start(f: Any, size: int) -> int:
    """The start of the file's last line holding more than whitespace (0: it holds one such line)."""
    end, seen_text = size, False
    while end > 0:
        at = max(0, end - _SCAN)
        f.seek(at)
        block = f.read(end - at)
        if not seen_text:
            seen_text = bool(block.rstrip())
            block = block.rstrip()
        if seen_text and (i := block.rfind(b"\n")) >= 0:
            return at + i + 1
        end = at
    return 0


def _line_start(f: Any, pos: int, size: int, whole_lines: bool) -> int:
    """The first line start at or after `pos`; in text files past a line of over 1 MiB, a character start."""
    if pos <= 0 or pos >= size:
        return max(0, min(pos, size))
    f.seek(pos - 1)
    if f.read(1) == b"\n":
        return pos
    at = pos
    while block := f.read(_STEP):  # (an object reads a step's GET, not a whole 1 MiB, per line start)
        if (i := block.find(b"\n")) >= 0:
            return at + i + 1
        at += len(block)
        if not whole_lines and (at - pos >= _SCAN or at >= size):
            break
    else:
        return size
    f.seek(pos)
    head = f.read(4)
    skip = 0
    while skip < len(head) and head[skip] & 0xC0 == 0x80:  # UTF-8 continuation bytes
        skip += 1
    return pos + skip


def _pieces(text: str) -> list[str]:
    """`text` in pieces of about _PIECE characters cut after a newline, for the tokenizer."""
    out, i = [], 0
    while i < len(text):
        j = text.find("\n", i + _PIECE)
        j = len(text) if j < 0 else j + 1
        out.append(text[i:j])
        i = j
    return out


def read_unit(
    file: InputFile, unit: Unit, text_key: str, text_column: str, doc_end: str = DOC_END
) -> list[str]:
    """The unit's text, in pieces (text files) or documents each ending in `doc_end` (jsonl, parquet;
    "" where the tokenizer frames documents with tokens)."""
    if file.kind == "parquet":
        return _read_rows(file, unit, text_column, doc_end)

    def read() -> tuple[int, bytes]:
        with open_binary(file.path, file.size) as f:
            whole = file.kind == "jsonl"  # a JSON line cannot be cut
            start = _line_start(f, unit.start, file.size, whole)
            end = _line_start(f, unit.end, file.size, whole)
            f.seek(start)
            return start, f.read(end - start)

    try:
        start, data = _retried(file.path, read)
    except Exception as e:
        if not _remote(file.path):
            raise
        raise _unreadable(file.path, e, "text file") from None
    if file.kind == "txt":
        try:
            return _pieces(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UserError(
                f"{file.path} is not UTF-8 text (bad byte at offset {start + e.start}); convert it "
                "(e.g. iconv -t UTF-8) or leave it out"
            ) from None
    docs, at = [], start
    for line in data.split(b"\n"):
        here, at = at, at + len(line) + 1
        if not line.strip():
            continue
        try:
            doc = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise UserError(
                f"{file.path} is not UTF-8 (the line at byte {here}); convert it or leave it out"
            ) from None
        except ValueError:
            raise UserError(
                f"{file.path}: the line at byte {here} is not valid JSON; fix or remove it"
            ) from None
        if not isinstance(doc, dict) or not isinstance(doc.get(text_key), str):
            fields = ", ".join(doc) if isinstance(doc, dict) else type(doc).__name__
            raise UserError(
                f"{file.path}: the line at byte {here} has no text field '{text_key}' (it holds: {fields}); "
                "pass --text_key NAME"
            )
        docs.append(doc[text_key] + doc_end)
    return docs


def _read_rows(file: InputFile, unit: Unit, text_column: str, doc_end: str) -> list[str]:
    def read() -> list[str]:
        docs: list[str] = []
        row = 0
        for batch in _parquet(file.path, file.size).iter_batches(
            batch_size=1024, row_groups=[unit.group], columns=[text_column]
        ):
            lo, hi = max(unit.start - row, 0), min(unit.end - row, batch.num_rows)
            if lo < hi:
                docs += [t + doc_end for t in batch.column(0).slice(lo, hi - lo).to_pylist() if t]
            row += batch.num_rows
            if row >= unit.end:
                break
        return docs

    try:
        return _retried(file.path, read)
    except UserError:
        raise
    except Exception as e:  # a corrupt page surfaces only when read
        raise _unreadable(file.path, e, "parquet file") from None
