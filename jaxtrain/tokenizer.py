"""Tokenizers: raw bytes, or a BPE held by `tokenizers`, trained here or a user's tokenizer.json.

Text to token files: jaxtrain/prepare/.

    tok = tokenizer_for(find_tokenizer("data/mytext"), vocab_size)  # its tokenizer.json, else bytes
    ids = tok.encode("def main():")
    text = tok.decode(ids)

A Hugging Face tokenizer folder is read as transformers reads it: tokenizer.json, the special
tokens of tokenizer_config.json, and the chat template from chat_template.jinja (transformers 5's
save_pretrained) or from tokenizer_config.json (older saves).

The `tokenizers` package is an optional extra (`pip install -e '.[bpe]'`), imported only when a
BPE is trained or loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxtrain.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = (
    "tokenizer_config.json"  # Hugging Face's: special tokens (and before 2025 the chat template)
)
# transformers 5 saves the chat template as a file of its own, and further named ones in a folder
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
END_OF_TEXT = "<|endoftext|>"  # the document end of a BPE trained here (GPT-2's name for it)


@dataclass(frozen=True)
class Framing:
    """How a tokenizer frames a document: its begin-of-text token before it, its end-of-text token
    after it (either may be None). Neither: documents are separated by text (prepare's DOC_END)."""

    bos: int | None = None
    eos: int | None = None

    @property
    def has_tokens(self) -> bool:
        return self.bos is not None or self.eos is not None

    def frame(self, ids: np.ndarray) -> np.ndarray:
        """A document's ids with its framing tokens."""
        head = [] if self.bos is None else [self.bos]
        tail = [] if self.eos is None else [self.eos]
        return np.concatenate([np.asarray(head, np.int64), ids, np.asarray(tail, np.int64)])

    def to_json(self) -> dict[str, Any]:
        return {"bos": self.bos, "eos": self.eos}


class Tokenizer(Protocol):
    """What the data pipeline and sampling need from a tokenizer."""

    vocab_size: int

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    framing: Framing
    chat_template: str

    def encode_many(self, texts: Sequence[str], framing: Framing | None = None) -> np.ndarray: ...


class ByteTokenizer:
    """Every byte is a token: no training, no files, lossless on any input."""

    vocab_size = 256
    # No id is free among the 256 bytes: a boundary token would make the vocabulary 257 and every
    # byte dataset and checkpoint (make train's) another model's. Documents stay separated by text.
    framing = Framing()
    chat_template = ""

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids (uint8 values as int64) of the UTF-8 bytes of `text`."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def encode_many(self, texts: Sequence[str], framing: Framing | None = None) -> np.ndarray:
        """The token ids of the texts, concatenated (uint8); bytes frame nothing."""
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

    def __init__(
        self, tok: Any, config: dict[str, Any] | None = None, templates: dict[str, str] | None = None
    ):
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size()
        config = config or {}  # tokenizer_config.json's, if it came with one
        # The chat templates by name, "default" the one used: the files', else the config's
        self.chat_templates = templates or _config_templates(config.get("chat_template"))
        self.config = {k: v for k, v in config.items() if k != "chat_template"}
        self.chat_template: str = self.chat_templates.get("default", "")
        self.framing = Framing(self._begin_of_text(), self.special("eos_token"))

    def special(self, name: str) -> int | None:
        """The id of a special token named in tokenizer_config.json (bos_token, eos_token, ...);
        without a config, eos_token is END_OF_TEXT where the vocabulary holds it (a BPE trained here)."""
        token = self.config.get(name)
        if isinstance(token, dict):  # the older form: {"content": "<s>", ...}
            token = token.get("content")
        if not self.config and name == "eos_token":
            token = END_OF_TEXT
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    def _begin_of_text(self) -> int | None:
        """The token the tokenizer itself puts before every text (Llama's post-processor, or
        add_bos_token), as transformers' tokenizer(text) does: what it encodes "" to."""
        ids = self._tok.encode("").ids
        return ids[0] if ids and ids[0] == self.special("bos_token") else None

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
            special_tokens=[END_OF_TEXT],  # id 0: the end of every document
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load a tokenizer.json (or a folder holding one), with the tokenizer_config.json beside it."""
        tk = _tokenizers()
        path = find_tokenizer(path) or Path(path)
        try:
            tok = tk.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise UserError(f"cannot read tokenizer {path}: {e}; re-run scripts/prepare_data.py") from None
        config_path = path.parent / TOKENIZER_CONFIG
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
            templates = _file_templates(path.parent)
        except (OSError, ValueError) as e:
            raise UserError(
                f"cannot read {config_path.parent}'s tokenizer files: {e}; fix or remove it"
            ) from None
        return cls(tok, config, templates)

    def save(self, folder: Path, config: dict[str, Any] | None = None) -> None:
        """Write tokenizer.json, tokenizer_config.json (with `config`'s keys over its own) and the
        chat templates as transformers 5's save_pretrained does (chat_template.jinja, the named
        ones in additional_chat_templates/)."""
        (folder / TOKENIZER_FILE).write_text(self.to_json())
        if self.config or config:  # a BPE trained here has none
            (folder / TOKENIZER_CONFIG).write_text(json.dumps(self.config | (config or {}), indent=1) + "\n")
        for name, template in self.chat_templates.items():
            path = folder / (CHAT_TEMPLATE_FILE if name == "default" else f"{CHAT_TEMPLATE_DIR}/{name}.jinja")
            path.parent.mkdir(exist_ok=True)
            path.write_text(template, encoding="utf-8")

    @classmethod
    def from_json(cls, text: str, config: dict[str, Any] | None = None) -> BPETokenizer:
        """A tokenizer from tokenizer.json text (what `to_json` gives) and its config."""
        return cls(_tokenizers().Tokenizer.from_str(text), config)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text."""
        return self._tok.to_str()

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids of `text` (bytes are read as UTF-8, invalid sequences replaced)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def encode_many(self, texts: Sequence[str], framing: Framing | None = None) -> np.ndarray:
        """The token ids of the texts, concatenated (each encoded alone: a batch for `tokenizers`);
        with `framing`, each text framed by it alone (no other special token added)."""
        # encode_batch_fast skips the character offsets we never use: ~1.5x the tokens/s here.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encodings = batch(list(texts), add_special_tokens=framing is None)
        if not encodings:
            return np.zeros(0, dtype=np.int64)
        ids = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        return np.concatenate(ids if framing is None else [framing.frame(i) for i in ids])

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids of `text` with no special token added (as transformers' apply_chat_template
        tokenizes), and each token's first character."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int64), np.asarray([a for a, _ in enc.offsets], np.int64)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of the token ids."""
        return self._tok.decode(np.asarray(ids).tolist())


def _config_templates(value: Any) -> dict[str, str]:
    """tokenizer_config.json's chat_template by name: a template, or the older list of {name, template}."""
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t}
    return {"default": value} if isinstance(value, str) and value else {}


def _file_templates(folder: Path) -> dict[str, str]:
    """chat_template.jinja ("default") and additional_chat_templates/NAME.jinja, as transformers 5
    reads them: where any is present, they replace the config's."""
    out = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        out["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    for path in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        out[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return out


def find_tokenizer(where: str | Path) -> Path | None:
    """The tokenizer.json `where` names: that file, or the one in folder `where`; None if neither."""
    path = Path(where)
    path = path / TOKENIZER_FILE if path.is_dir() else path
    return path if path.is_file() else None


def tokenizer_for(where: Path | None, vocab_size: int) -> ByteTokenizer | BPETokenizer | None:
    """The tokenizer of a model of `vocab_size` tokens: the BPE at `where` (a find_tokenizer answer),
    else bytes when the vocabulary is theirs, else None (no tokenizer jaxtrain can find)."""
    if where is not None:
        return BPETokenizer.from_file(where)
    return ByteTokenizer() if vocab_size == ByteTokenizer.vocab_size else None
