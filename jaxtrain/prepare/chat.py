"""Conversations to token files and a loss mask (scripts/prepare_data.py --chat).

    prepare_chat(["chats.jsonl"], "data/chats", tokenizer="Qwen2.5-0.5B-Instruct/", seq_len=1024)

Each row's messages are rendered and masked by the tokenizer's chat template
(jaxtrain/text/chat_template.py: only the assistant turns take loss). Conversations are packed into
windows of the model's seq_len, whole: one that does not fit in what is left of a window starts
the next (the rest padded with the boundary token, no loss); only one longer than a window is cut,
and counted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxtrain.errors import UserError
from jaxtrain.prepare import inputs
from jaxtrain.prepare.inputs import Location
from jaxtrain.prepare.output import staged
from jaxtrain.prepare.shards import SplitWriter, local_tokenizer, out_location, source_entry, source_hashes
from jaxtrain.text.chat_template import ChatFormat
from jaxtrain.text.format import MANIFEST, token_dtype_for
from jaxtrain.tokenizer import TOKENIZER_FILE, BPETokenizer

ROLES = ("system", "user", "assistant", "tool")


def check_messages(row: Any, key: str) -> list[dict[str, Any]]:
    """The row's messages, or ValueError saying what is wrong with them."""
    if not isinstance(row, dict) or key not in row:
        fields = ", ".join(row) if isinstance(row, dict) else f"a {type(row).__name__}, not an object"
        raise ValueError(f"has no '{key}' (the list of messages; it holds: {fields})")
    messages = row[key]
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else f"a {type(messages).__name__}"
        raise ValueError(
            f"'{key}' is {what}, not a non-empty list of {{role, content}} messages"
            + ("; a JSON string in it must be decoded to the list" if isinstance(messages, str) else "")
        )
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {j} is not {{role, content}} with text content")
        if m.get("role") not in ROLES:
            raise ValueError(f"message {j} has role {m.get('role')!r}, not one of {', '.join(ROLES)}")
    return messages


# ---------------------------------------------------------------- the pipeline


@dataclass(frozen=True)
class PreparedChat:
    """What `prepare_chat` wrote, for the report."""

    manifest_path: Location
    conversations: dict[str, int]
    tokens: dict[str, int]
    kept: dict[str, int]  # tokens that take loss
    cut: int  # conversations longer than a window
    padding: int
    vocab_size: int
    seconds: float


def _rows(file: inputs.InputFile, key: str) -> Iterator[tuple[int, Any]]:
    """(row number from 1, row) of a jsonl or parquet file of conversations."""
    if file.kind == "parquet":
        pf = inputs._parquet(file.path, file.size)
        if key not in pf.schema_arrow.names:
            raise UserError(
                f"{file.path} has no column '{key}' (columns: {', '.join(pf.schema_arrow.names)})"
            )
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[key]):
            for value in batch.column(0).to_pylist():
                row += 1
                yield row, {key: value}
        return
    if file.kind != "jsonl":
        raise UserError(f"{file.path}: --chat reads .jsonl or .parquet rows holding '{key}', not text files")
    with inputs.open_binary(file.path, file.size) as f:
        for row, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield row, json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise UserError(
                    f"{file.path} row {row}: not a JSON object in UTF-8; fix or remove the line"
                ) from None


class _Packer:
    """Conversations into windows of `window` tokens, whole unless longer than a window."""

    def __init__(self, writer: SplitWriter, window: int, pad: int) -> None:
        self.writer, self.window, self.pad = writer, window, pad
        self.conversations = self.kept = self.cut = self.padding = 0

    def add(self, ids: np.ndarray, keep: np.ndarray) -> None:
        room = self.window - self.writer.tokens % self.window
        if len(ids) > room and room < self.window:  # start the next window with it
            self.writer.write(np.full(room, self.pad, np.int64), np.zeros(room, np.uint8))
            self.padding += room
        self.writer.write(ids, keep)
        self.conversations += 1
        self.kept += int(keep.sum())
        self.cut += len(ids) > self.window


def prepare_chat(
    inputs_: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str,
    seq_len: int,
    val_fraction: float = 0.01,
    overwrite: bool = False,
    messages_key: str = "messages",
) -> PreparedChat:
    """jsonl/parquet conversations -> train.bin/val.bin, their .mask files and manifest.json (any
    input, and out_dir, may be in a bucket)."""
    if seq_len < 2:
        raise UserError(f"--chat needs --seq_len N, the window of the model to train (>= 2); got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val_fraction must be in [0, 1), got {val_fraction}")
    out = out_location(out_dir)
    if (out / MANIFEST).exists() and not overwrite:
        raise UserError(f"{out / MANIFEST} already exists; pass --overwrite or another --out_dir")
    where = local_tokenizer(tokenizer, "--tokenizer")
    if where is None:
        raise UserError(
            f"--chat needs --tokenizer DIR (or its tokenizer.json) of a chat model; got {tokenizer}"
        )
    tok = BPETokenizer.from_file(where)
    chat = ChatFormat(tok, "pass --tokenizer DIR of a chat model (e.g. a Llama 3 or Qwen instruct model's)")
    files = inputs.describe(inputs.find_files([str(i) for i in inputs_], "*.jsonl,*.parquet"), None)
    t0 = time.perf_counter()
    encoded = _encode(files, chat, messages_key)
    n_val = round(len(encoded) * val_fraction)
    if val_fraction and not n_val:
        raise UserError(
            f"{len(encoded)} conversations leave none for validation; lower --val_fraction or add some"
        )
    dtype = np.dtype(token_dtype_for(tok.vocab_size)).newbyteorder("<")
    pad = chat.framing.eos if chat.framing.eos is not None else chat.framing.bos
    with staged(out) as staging:
        packers = {}
        for split, part in (
            ("train", encoded[: len(encoded) - n_val]),
            ("val", encoded[len(encoded) - n_val :]),
        ):
            writer = SplitWriter(staging.folder, split, 0, dtype, masked=True, on_close=staging.closed)
            packers[split] = _Packer(writer, seq_len, pad or 0)
            for ids, keep in part:
                packers[split].add(ids, keep)
        tok.save(staging.folder)
        manifest = _manifest(packers, tok, tokenizer, chat, dtype, val_fraction, messages_key, files)
        staging.commit(manifest)
    return PreparedChat(
        manifest_path=out / MANIFEST,
        conversations={s: p.conversations for s, p in packers.items()},
        tokens={s: p.writer.tokens for s, p in packers.items()},
        kept={s: p.kept for s, p in packers.items()},
        cut=sum(p.cut for p in packers.values()),
        padding=sum(p.padding for p in packers.values()),
        vocab_size=tok.vocab_size,
        seconds=time.perf_counter() - t0,
    )


def _encode(files: list[inputs.InputFile], chat: ChatFormat, key: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every row's conversation as (ids, keep); a bad row is a one-line error naming it."""
    encoded = []
    for file in files:
        for row, value in _rows(file, key):
            try:
                encoded.append(chat.encode(check_messages(value, key)))
            except UserError:
                raise
            except Exception as e:  # a template's raise_exception, a bad field: the row is at fault
                raise UserError(
                    f"{file.path} row {row}: {str(e).splitlines()[0]}; fix or remove the row"
                ) from None
    if not encoded:
        raise UserError(f"no conversation in {', '.join(str(f.path) for f in files)}")
    return encoded


def _manifest(
    packers: dict[str, _Packer], tok: BPETokenizer, tokenizer: str, chat: ChatFormat, dtype: np.dtype,
    val_fraction: float, messages_key: str, files: list[inputs.InputFile],
) -> dict[str, Any]:  # fmt: skip
    """manifest.json of the packed splits (closing their files)."""
    shards = {split: p.writer.finish() for split, p in packers.items()}
    return {
        "tokenizer": {
            "kind": "file", "vocab_size": tok.vocab_size, "file": TOKENIZER_FILE, "from": tokenizer
        },
        "token_dtype": str(np.dtype(dtype.str[1:])),
        "header": "none",
        "shard_tokens": 0,
        "val_fraction": val_fraction,
        "framing": chat.framing.to_json(),
        "chat": {
            "seq_len": next(iter(packers.values())).window, "messages_key": messages_key,
            "end_of_turn": chat.end_of_turn,
            "conversations": {s: p.conversations for s, p in packers.items()},
            "kept_tokens": {s: p.kept for s, p in packers.items()},
            "cut": sum(p.cut for p in packers.values()),
        },
        "splits": {
            s: {"tokens": p.writer.tokens, "shards": shards[s]} for s, p in packers.items() if p.writer.tokens
        },
        "sources": [source_entry(f, h) for f, h in zip(files, source_hashes(files, 1, ()), strict=True)],
    }  # fmt: skip
