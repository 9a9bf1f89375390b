"""Text files to token files: train.bin and val.bin (nanoGPT layout), streamed in chunks.

prepare_corpus(["books/"], "data/books", pattern="*.txt")  # -> train.bin, val.bin (uint16)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxtrain.errors import UserError
from jaxtrain.files import atomic_write, require_writable
from jaxtrain.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, Tokenizer

_READ_CHUNK = 2**20  # bytes per read when tokenizing text


def _utf8_boundary(data: bytes, pos: int) -> int:
    """The nearest position <= pos that does not cut a UTF-8 character."""
    while 0 < pos < len(data) and (data[pos] & 0xC0) == 0x80:
        pos -= 1
    return pos


def _line_chunks(files: Sequence[Path]) -> Iterator[bytes]:
    """The files' bytes, concatenated, in ~1 MiB chunks that end at a newline or a file's end."""
    for file in files:
        carry = b""
        with open(file, "rb") as f:
            while block := f.read(_READ_CHUNK):
                data = carry + block
                cut = data.rfind(b"\n") + 1
                if cut == 0 and len(data) > _READ_CHUNK:  # one huge line: cut between characters
                    cut = _utf8_boundary(data, len(data) - 1)
                if cut:
                    yield data[:cut]
                carry = data[cut:]
        if carry:
            yield carry


def _split_chunks(chunks: Iterable[bytes], split_at: int) -> Iterator[tuple[bool, bytes]]:
    """(is_val, chunk) for a byte stream cut in two near offset `split_at` (at a line end if one is near)."""
    offset = 0
    for chunk in chunks:
        end = offset + len(chunk)
        if end <= split_at or offset >= split_at:
            yield offset >= split_at, chunk
        else:
            cut = chunk.find(b"\n", split_at - offset) + 1
            if cut in (0, len(chunk)):
                cut = _utf8_boundary(chunk, split_at - offset)
            yield False, chunk[:cut]
            yield True, chunk[cut:]
        offset = end


@dataclass(frozen=True)
class PreparedData:
    """What `write_corpus` wrote."""

    train_path: Path
    val_path: Path | None
    train_tokens: int
    val_tokens: int
    vocab_size: int
    token_dtype: str
    tokenizer_path: Path | None


def write_corpus(
    files: Sequence[Path], out_dir: Path, val_fraction: float, tokenizer: Tokenizer
) -> PreparedData:
    """Tokenize the files' concatenated text into out_dir/train.bin and val.bin (the last val_fraction)."""
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        raise UserError(f"the {len(files)} input file(s) are empty; nothing to tokenize")
    dtype = np.dtype("<u2" if tokenizer.vocab_size <= 65536 else "<u4")
    split_at = round(total * (1 - val_fraction))
    counts = [0, 0]
    train_path, val_path = out_dir / "train.bin", out_dir / "val.bin"
    with contextlib.ExitStack() as stack:
        # Both files stream at once: the corpus is read once and never held in memory.
        outs = [stack.enter_context(atomic_write(train_path))]
        if val_fraction > 0:
            outs.append(stack.enter_context(atomic_write(val_path)))
        for is_val, chunk in _split_chunks(_line_chunks(files), split_at):
            ids = tokenizer.encode(chunk).astype(dtype)
            outs[is_val].write(ids.tobytes())
            counts[is_val] += len(ids)
        if counts[0] == 0 or (val_fraction > 0 and counts[1] == 0):
            which = "train" if counts[0] == 0 else "validation"
            raise UserError(f"the {which} split came out empty; change --val_fraction {val_fraction}")
    return PreparedData(
        train_path=train_path,
        val_path=val_path if val_fraction > 0 else None,
        train_tokens=counts[0],
        val_tokens=counts[1],
        vocab_size=tokenizer.vocab_size,
        token_dtype=str(np.dtype(dtype.str[1:])),
        tokenizer_path=None,
    )


def find_text_files(inputs: Sequence[str | Path], pattern: str = "*.txt") -> list[Path]:
    """Files named directly, plus every file under a named folder whose name matches `pattern`."""
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_file():
            files.append(item)
        elif item.is_dir():
            found = sorted(p for p in item.rglob(pattern) if p.is_file())
            if not found:
                raise UserError(
                    f"no files matching '{pattern}' under {item}; pass another --glob, e.g. '*.md'"
                )
            files.extend(found)
        else:
            raise UserError(f"input {item} does not exist; pass text files or folders of them")
    if not files:
        raise UserError("no input given; pass text files or folders of them")
    return files


def prepare_corpus(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    pattern: str = "*.txt",
    val_fraction: float = 0.01,
    tokenizer: str = "byte",
    vocab_size: int = 0,
    overwrite: bool = False,
) -> PreparedData:
    """Text files or folders -> out_dir/train.bin, val.bin (and tokenizer.json for a BPE)."""
    out_dir = Path(out_dir)
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val_fraction must be in [0, 1), got {val_fraction}")
    if tokenizer not in ("byte", "bpe"):
        raise UserError(f"--tokenizer must be byte or bpe, got {tokenizer!r}")
    if tokenizer == "byte" and vocab_size not in (0, 256):
        raise UserError(f"--vocab_size {vocab_size} needs --tokenizer bpe (the byte tokenizer has 256)")
    if tokenizer == "bpe" and not vocab_size:
        raise UserError("--tokenizer bpe needs --vocab_size N, e.g. --vocab_size 8192")
    require_writable(out_dir, "--out_dir")
    if (out_dir / "train.bin").exists() and not overwrite:
        raise UserError(f"{out_dir / 'train.bin'} already exists; pass --overwrite or another --out_dir")
    outputs = {(out_dir / name).resolve() for name in ("train.bin", "val.bin", TOKENIZER_FILE)}
    files = [f for f in find_text_files(inputs, pattern) if f.resolve() not in outputs]
    if not files:
        raise UserError("the only inputs are this script's own outputs; pass text files")

    tok: ByteTokenizer | BPETokenizer = ByteTokenizer()
    if tokenizer == "bpe":
        # Trained on the training split only, so validation text stays unseen.
        split_at = round(sum(f.stat().st_size for f in files) * (1 - val_fraction))
        texts = (
            c.decode("utf-8", errors="replace")
            for is_val, c in _split_chunks(_line_chunks(files), split_at)
            if not is_val
        )
        tok = BPETokenizer.train(texts, vocab_size)
    # Stale outputs of an earlier run would describe the wrong data.
    for name in ("val.bin", TOKENIZER_FILE):
        with contextlib.suppress(FileNotFoundError):
            (out_dir / name).unlink()
    result = write_corpus(files, out_dir, val_fraction, tok)
    if isinstance(tok, BPETokenizer):
        with atomic_write(out_dir / TOKENIZER_FILE) as f:
            f.write(tok.to_json().encode("utf-8"))
        result = dataclasses.replace(result, tokenizer_path=out_dir / TOKENIZER_FILE)
    return result
