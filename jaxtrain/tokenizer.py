"""Tokenizers (raw bytes, or a byte-level BPE trained with `tokenizers`), and text to token files.

    tok = load_tokenizer("data/mytext/train.bin")  # BPE if tokenizer.json sits beside it, else bytes
    ids = tok.encode("def main():")
    text = tok.decode(ids)
    prepare_corpus(["books/"], "data/books", pattern="*.txt")  # -> train.bin, val.bin (uint16)

The `tokenizers` package is an optional extra (`pip install -e '.[bpe]'`), imported only when a
BPE is trained or loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from jaxtrain.errors import UserError
from jaxtrain.rundir import require_writable

TOKENIZER_FILE = "tokenizer.json"
_READ_CHUNK = 2**20  # bytes per read when tokenizing text


class Tokenizer(Protocol):
    """What the data pipeline and sampling need from a tokenizer."""

    vocab_size: int

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """Every byte is a token: no training, no files, lossless on any input."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids (uint8 values as int64) of the UTF-8 bytes of `text`."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of the bytes `ids`; invalid UTF-8 (e.g. a cut-off sample) becomes U+FFFD."""
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise UserError(
            "BPE needs the 'tokenizers' package: pip install -e '.[bpe]' (or use the byte tokenizer)"
        ) from None
    return tokenizers


class BPETokenizer:
    """A byte-level BPE (GPT-2 style) held by a HuggingFace `tokenizers.Tokenizer`."""

    def __init__(self, tok: Any):
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train on a stream of texts; the 256 byte symbols are always in the vocabulary."""
        tk = _tokenizers()
        if vocab_size <= 256:
            raise UserError(f"--vocab_size {vocab_size} is too small for a BPE; use more than 256")
        tok = tk.Tokenizer(tk.models.BPE())
        # Byte-level pre-tokenization makes every input encodable and decode(encode(x)) == x.
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load a tokenizer.json written by `to_json`."""
        tk = _tokenizers()
        try:
            return cls(tk.Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise UserError(f"cannot read tokenizer {path}: {e}; re-run scripts/prepare_data.py") from None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text."""
        return self._tok.to_str()

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids of `text` (bytes are read as UTF-8, invalid sequences replaced)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of the token ids."""
        return self._tok.decode(np.asarray(ids).tolist())


def load_tokenizer(data_path: str | Path) -> ByteTokenizer | BPETokenizer:
    """The tokenizer a token file was made with: tokenizer.json beside it, else bytes."""
    json_path = Path(data_path).parent / TOKENIZER_FILE
    if json_path.is_file():
        return BPETokenizer.from_file(json_path)
    return ByteTokenizer()


# ---------------------------------------------------------------- text to token files


@contextlib.contextmanager
def _atomic_write(path: Path) -> Iterator[BinaryIO]:
    """A file that appears at `path` whole on success and never half-written (temp + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own per writer (not mkstemp, whose files are private to the user: 0600).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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
        outs = [stack.enter_context(_atomic_write(train_path))]
        if val_fraction > 0:
            outs.append(stack.enter_context(_atomic_write(val_path)))
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
        with _atomic_write(out_dir / TOKENIZER_FILE) as f:
            f.write(tok.to_json().encode("utf-8"))
        result = dataclasses.replace(result, tokenizer_path=out_dir / TOKENIZER_FILE)
    return result
