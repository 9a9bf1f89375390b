"""Tokenizers: raw bytes, or a BPE held by `tokenizers`, trained here or a user's tokenizer.json.

Text to token files: corpus.py.

    tok = load_tokenizer("data/mytext/train.bin")  # BPE if tokenizer.json sits beside it, else bytes
    ids = tok.encode("def main():")
    text = tok.decode(ids)

The `tokenizers` package is an optional extra (`pip install -e '.[bpe]'`), imported only when a
BPE is trained or loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxtrain.errors import UserError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    """What the data pipeline and sampling need from a tokenizer."""

    vocab_size: int

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def encode_many(self, texts: Sequence[str]) -> np.ndarray: ...


class ByteTokenizer:
    """Every byte is a token: no training, no files, lossless on any input."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids (uint8 values as int64) of the UTF-8 bytes of `text`."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def encode_many(self, texts: Sequence[str]) -> np.ndarray:
        """The token ids of the texts, concatenated (uint8)."""
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)

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

    @classmethod
    def from_json(cls, text: str) -> BPETokenizer:
        """A tokenizer from tokenizer.json text (what `to_json` gives)."""
        return cls(_tokenizers().Tokenizer.from_str(text))

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text."""
        return self._tok.to_str()

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids of `text` (bytes are read as UTF-8, invalid sequences replaced)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def encode_many(self, texts: Sequence[str]) -> np.ndarray:
        """The token ids of the texts, concatenated (each encoded alone: a batch for `tokenizers`)."""
        # encode_batch_fast skips the character offsets we never use: ~1.5x the tokens/s here.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encodings = batch(list(texts))
        if not encodings:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of the token ids."""
        return self._tok.decode(np.asarray(ids).tolist())


def load_tokenizer(data_path: str | Path) -> ByteTokenizer | BPETokenizer:
    """The tokenizer a token file was made with: tokenizer.json beside it, else bytes."""
    json_path = Path(data_path).parent / TOKENIZER_FILE
    if json_path.is_file():
        return BPETokenizer.from_file(json_path)
    return ByteTokenizer()
