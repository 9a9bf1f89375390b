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
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxtrain.errors import UserError

UNIT_BYTES = 8 * 2**20
DOC_END = "\n\n"  # after every jsonl/parquet document, so documents never run together
_SCAN = 2**20  # bytes read at a time looking for a line start
_PIECE = 2**16  # characters per piece handed to the tokenizer (cut at line ends)


@dataclass(frozen=True)
class InputFile:
    """An input file; `groups` holds a parquet file's rows per row group."""

    path: Path
    kind: str  # txt | jsonl | parquet
    size: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Unit:
    """Bytes [start, end) of a text or jsonl file (moved to line starts), or rows of a parquet row group."""

    file: int
    start: int
    end: int
    is_val: bool
    group: int = -1


def _kind(path: Path) -> str:
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix.lower(), "txt")


def find_files(inputs: list[str], pattern: str) -> list[Path]:
    """Files named directly or by a glob, plus files under named folders matching `pattern` (comma list)."""
    files: list[Path] = []
    patterns = [p.strip() for p in pattern.split(",") if p.strip()]
    for item in inputs:
        if glob.has_magic(item):
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


def _parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path} is parquet, which needs pyarrow: pip install -e '.[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... on a bad file
        raise UserError(
            f"{path} is not a readable parquet file ({str(e).splitlines()[0]}); re-create it"
        ) from None


def describe(paths: list[Path], text_column: str | None) -> list[InputFile]:
    """Size, kind and (parquet) row groups of each input; empty files and missing text columns are
    refused (text_column None: no text column is read, as with --chat's messages)."""
    out = []
    for path in paths:
        size, kind = path.stat().st_size, _kind(path)
        if size == 0:
            raise UserError(f"input {path} is empty (0 bytes); remove it or fill it")
        groups: tuple[int, ...] = ()
        if kind == "parquet":
            pf = _parquet(path)
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
        out.append(InputFile(path, kind, size, groups))
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
    with open(f.path, "rb") as fh:
        start = _line_start(fh, cut, f.size, f.kind == "jsonl")
        return min(start, _last_line_start(fh, f.size)) if last else start


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
    while block := f.read(_SCAN):
        if (i := block.find(b"\n")) >= 0:
            return at + i + 1
        at += len(block)
        if not whole_lines:
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
    with open(file.path, "rb") as f:
        whole = file.kind == "jsonl"  # a JSON line cannot be cut
        start = _line_start(f, unit.start, file.size, whole)
        end = _line_start(f, unit.end, file.size, whole)
        f.seek(start)
        data = f.read(end - start)
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
    docs: list[str] = []
    row = 0
    try:
        for batch in _parquet(file.path).iter_batches(
            batch_size=1024, row_groups=[unit.group], columns=[text_column]
        ):
            lo, hi = max(unit.start - row, 0), min(unit.end - row, batch.num_rows)
            if lo < hi:
                docs += [t + doc_end for t in batch.column(0).slice(lo, hi - lo).to_pylist() if t]
            row += batch.num_rows
            if row >= unit.end:
                break
    except UserError:
        raise
    except Exception as e:  # a corrupt page surfaces only when read
        raise UserError(
            f"{file.path} is not a readable parquet file ({str(e).splitlines()[0]}); re-create it"
        ) from None
    return docs
