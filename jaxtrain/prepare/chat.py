"""Conversations to tokens and a loss mask (scripts/prepare_data.py --chat).

    chat = ChatFormat(BPETokenizer.from_file("Qwen2.5-0.5B-Instruct/"))   # its chat_template
    ids, keep = chat.encode([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])

A conversation is rendered with the tokenizer's chat template (`chat_template` in its
tokenizer_config.json) as transformers' `apply_chat_template(messages, tokenize=True)` renders and
tokenizes it: the same jinja2 sandbox settings and names, then the text tokenized with no special
token added. `keep` is 1 on the assistant turns, each with its end-of-turn token, and 0 elsewhere:
a fine-tune learns the answers, never the questions. An assistant turn is found by rendering the
conversation up to it (with the generation prompt) and through it; a template that rewrites earlier
turns when later ones follow cannot be masked this way and is refused.

Conversations are packed into windows of the model's seq_len, whole: one that does not fit in
what is left of a window starts the next (the rest padded with the boundary token, no loss); only
one longer than a window is cut, and counted. The boundary between conversations is the
tokenizer's BOS where the template renders it first (Llama 3), else an end-of-text token appended
after each (Qwen's <|endoftext|>: its eos_token, or pad_token when the eos ends every turn).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from jaxtrain.disk.files import require_writable, write_text
from jaxtrain.errors import UserError
from jaxtrain.prepare import inputs
from jaxtrain.prepare.format import MANIFEST, MANIFEST_FORMAT, token_dtype_for
from jaxtrain.prepare.shards import SplitWriter, commit_outputs, sha256
from jaxtrain.tokenizer import TOKENIZER_CONFIG, TOKENIZER_FILE, BPETokenizer, Framing

ROLES = ("system", "user", "assistant", "tool")
# transformers passes the tokenizer's special tokens to every template under these names
_SPECIAL_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
)  # fmt: skip
_PROBE = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]


def _template(source: str) -> Any:
    """The template compiled as transformers compiles it (chat_template_utils): a sandbox with
    trim_blocks, lstrip_blocks, loop controls, its tojson, raise_exception and strftime_now."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("--chat needs jinja2: pip install -e '.[chat]'") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} (transformers' assistant-mask tag): its body as is.
        The mask here comes from rendering turn by turn, so templates without the tag mask too."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        # transformers' own: jinja's escapes HTML characters
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(
            f"the tokenizer's chat_template does not compile ({e}); fix its tokenizer_config.json"
        ) from None


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class ChatFormat:
    """A tokenizer's chat template: conversations to (ids, keep), its boundary and end-of-turn tokens."""

    def __init__(self, tok: BPETokenizer) -> None:
        if not tok.chat_template:
            raise UserError(
                "--chat needs a tokenizer with a chat_template in its tokenizer_config.json; pass "
                "--tokenizer DIR of a chat model (e.g. a Llama 3 or Qwen instruct model's folder)"
            )
        self.tok = tok
        self._template = _template(tok.chat_template)
        self._special: dict[str, Any] = {}
        for name in _SPECIAL_NAMES:
            value = tok.config.get(name)
            if name == "additional_special_tokens" and isinstance(value, list):
                self._special[name] = [_token_text(v) for v in value]
            elif _token_text(value) is not None:
                self._special[name] = _token_text(value)
        probe = self.render(_PROBE)
        self.framing = self._boundary(probe)
        # The token right after the probe's answer: where an assistant turn ends (<|eot_id|>, <|im_end|>)
        answer = self.render(_PROBE[:1], add_generation_prompt=True)
        after, _ = tok.encode_offsets(probe[len(answer) + len(_PROBE[1]["content"]) :])
        self.end_of_turn: int | None = int(after[0]) if len(after) else None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation's text, as transformers' apply_chat_template(tokenize=False) gives it."""
        return str(
            self._template.render(
                messages=list(messages), tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self._special,
            )
        )  # fmt: skip

    def _boundary(self, probe: str) -> Framing:
        bos = self.tok.special("bos_token")
        if bos is not None and probe.startswith(self._special.get("bos_token", "\0")):
            return Framing(bos=bos)  # the template renders it: nothing to add
        for name in ("eos_token", "pad_token"):  # an end-of-text token no turn uses
            token, text = self.tok.special(name), self._special.get(name)
            if token is not None and text and text not in probe:
                return Framing(eos=token)
        return Framing()

    def encode(self, messages: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the rendered conversation (plus its end-of-text boundary) and its loss mask."""
        text = self.render(messages)
        ids, starts = self.tok.encode_offsets(text)
        keep = np.zeros(len(ids), np.uint8)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    "its chat template renders earlier turns differently once later ones follow, so the "
                    "assistant turns cannot be told apart"
                )
            # Through the end-of-turn token; whitespace after it (ChatML's newline) is the template's
            keep[(starts >= len(before)) & (starts < len(through.rstrip()))] = 1
        if self.framing.eos is not None:
            ids, keep = np.append(ids, self.framing.eos), np.append(keep, np.uint8(0))
        return ids, keep


def check_messages(row: Any, key: str) -> list[dict[str, Any]]:
    """The row's messages, or ValueError saying what is wrong with them."""
    messages = row.get(key) if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        fields = ", ".join(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"has no messages (a non-empty list in '{key}'; it holds: {fields})")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {j} is not {{role, content}} with text content")
        if m.get("role") not in ROLES:
            raise ValueError(f"message {j} has role {m.get('role')!r}, not one of {', '.join(ROLES)}")
    return messages


def stop_tokens(tokenizer: Any) -> set[int]:
    """Where a sample ends: the tokenizer's end of text and its chat template's end of turn."""
    ends = {tokenizer.framing.eos}
    if getattr(tokenizer, "chat_template", ""):
        chat = ChatFormat(tokenizer)
        ends |= {chat.end_of_turn, chat.framing.eos}
    return {t for t in ends if t is not None}


def chat_framing(tok: BPETokenizer) -> Framing:
    """How --chat frames conversations with this tokenizer (Framing() when it has no template)."""
    return ChatFormat(tok).framing if tok.chat_template else Framing()


# ---------------------------------------------------------------- the pipeline


@dataclass(frozen=True)
class PreparedChat:
    """What `prepare_chat` wrote, for the report."""

    manifest_path: Path
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
        pf = inputs._parquet(file.path)
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
    with open(file.path, "rb") as f:
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
    """jsonl/parquet conversations -> train.bin/val.bin, their .mask files and manifest.json."""
    out_dir = Path(out_dir)
    if seq_len < 2:
        raise UserError(f"--chat needs --seq_len (the model's window, >= 2), got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val_fraction must be in [0, 1), got {val_fraction}")
    require_writable(out_dir, "--out_dir")
    if (out_dir / MANIFEST).exists() and not overwrite:
        raise UserError(f"{out_dir / MANIFEST} already exists; pass --overwrite or another --out_dir")
    if not (Path(tokenizer).is_file() or (Path(tokenizer) / TOKENIZER_FILE).is_file()):
        raise UserError(
            f"--chat needs --tokenizer DIR (or its tokenizer.json) of a chat model; got {tokenizer}"
        )
    tok = BPETokenizer.from_file(tokenizer)
    chat = ChatFormat(tok)
    files = inputs.describe(inputs.find_files([str(i) for i in inputs_], "*.jsonl,*.parquet"), None)
    t0 = time.perf_counter()
    encoded: list[tuple[np.ndarray, np.ndarray]] = []
    for file in files:
        for row, value in _rows(file, messages_key):
            try:
                encoded.append(chat.encode(check_messages(value, messages_key)))
            except UserError:
                raise
            except Exception as e:  # a template's raise_exception, a bad field: the row is at fault
                raise UserError(
                    f"{file.path} row {row}: {str(e).splitlines()[0]}; fix or remove the row"
                ) from None
    if not encoded:
        raise UserError(f"no conversation in {', '.join(str(f.path) for f in files)}")
    n_val = round(len(encoded) * val_fraction)
    if val_fraction and not n_val:
        raise UserError(
            f"{len(encoded)} conversations leave none for validation; lower --val_fraction or add some"
        )
    dtype = np.dtype(token_dtype_for(tok.vocab_size)).newbyteorder("<")
    pad = chat.framing.eos if chat.framing.eos is not None else chat.framing.bos
    staging = out_dir / f".prepare.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    try:
        packers = {}
        for split, part in (
            ("train", encoded[: len(encoded) - n_val]),
            ("val", encoded[len(encoded) - n_val :]),
        ):
            packers[split] = _Packer(SplitWriter(staging, split, 0, dtype, masked=True), seq_len, pad or 0)
            for ids, keep in part:
                packers[split].add(ids, keep)
        shards = {split: p.writer.finish() for split, p in packers.items()}
        write_text(staging / TOKENIZER_FILE, tok.to_json())
        write_text(staging / TOKENIZER_CONFIG, json.dumps(tok.config, indent=1) + "\n")
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "tokenizer": {
                "kind": "file", "vocab_size": tok.vocab_size, "file": TOKENIZER_FILE, "from": tokenizer
            },
            "token_dtype": str(np.dtype(dtype.str[1:])),
            "header": "none",
            "shard_tokens": 0,
            "val_fraction": val_fraction,
            "framing": chat.framing.to_json(),
            "chat": {
                "seq_len": seq_len, "messages_key": messages_key, "end_of_turn": chat.end_of_turn,
                "conversations": {s: p.conversations for s, p in packers.items()},
                "kept_tokens": {s: p.kept for s, p in packers.items()},
                "cut": sum(p.cut for p in packers.values()),
            },
            "splits": {
                s: {"tokens": p.writer.tokens, "shards": shards[s]}
                for s, p in packers.items() if p.writer.tokens
            },
            "sources": [{"path": str(f.path), "bytes": f.size, "sha256": sha256(f.path)} for f in files],
        }  # fmt: skip
        commit_outputs(staging, out_dir, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return PreparedChat(
        manifest_path=out_dir / MANIFEST,
        conversations={s: p.conversations for s, p in packers.items()},
        tokens={s: p.writer.tokens for s, p in packers.items()},
        kept={s: p.kept for s, p in packers.items()},
        cut=sum(p.cut for p in packers.values()),
        padding=sum(p.padding for p in packers.values()),
        vocab_size=tok.vocab_size,
        seconds=time.perf_counter() - t0,
    )
