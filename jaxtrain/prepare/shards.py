"""Text, jsonl and parquet inputs to token files plus manifest.json, tokenized in parallel, streamed.

    prepare_corpus(["web/"], "data/web", tokenizer="bpe", vocab_size=8192, shard_tokens=10**8)
    # -> data/web/train_00000.bin ... val_00000.bin (llm.c header), tokenizer.json, manifest.json

Without shard_tokens the outputs are train.bin and val.bin, flat nanoGPT files. Work units (see
inputs.py) are tokenized by `workers` processes, at most two units each in flight, and written in
order: the output is the same for any worker count and memory stays flat however large the input.
Everything is written into a hidden folder inside out_dir and moved into place only once all of it
succeeded, manifest.json last: a set without its manifest is incomplete.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from jaxtrain.cluster.lifeline import die_with_parent
from jaxtrain.disk.files import require_writable, write_text
from jaxtrain.errors import UserError
from jaxtrain.prepare import inputs
from jaxtrain.text.format import (
    HEADER_BYTES,
    HEADER_MAGIC,
    MANIFEST,
    MANIFEST_FORMAT,
    MASK_SUFFIX,
    token_dtype_for,
)
from jaxtrain.tokenizer import (
    CHAT_TEMPLATE_DIR,
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    Framing,
    find_tokenizer,
)

DEFAULT_GLOB = "*.txt,*.jsonl,*.parquet"


@dataclass(frozen=True)
class PreparedData:
    """What `prepare_corpus` wrote, and how fast it tokenized."""

    manifest_path: Path
    train_paths: list[Path]
    val_paths: list[Path]
    train_tokens: int
    val_tokens: int
    longest: dict[str, int]  # tokens of each split's longest file: windows of up to one less fit it
    vocab_size: int
    token_dtype: str
    tokenizer_path: Path | None
    tokenize_seconds: float
    workers: int


# ---------------------------------------------------------------- the workers

# Set once per worker process by _start_worker: the tokenizer is built there, not pickled per unit.
_worker: dict[str, Any] = {}


def _start_worker(
    tokenizer: tuple[str, dict[str, Any]] | None,
    text_key: str,
    text_column: str,
    dtype: str,
    files: list[Any],
) -> None:
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:  # a pool's worker dies with its process, kill -9 too
        die_with_parent(parent.pid)
    # Parallelism comes from the processes; tokenizers' own threads would only contend with them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = ByteTokenizer() if tokenizer is None else BPETokenizer.from_json(*tokenizer)
    _worker.update(tok=tok, text_key=text_key, text_column=text_column, dtype=dtype, files=files)


def _tokenize(unit: inputs.Unit) -> np.ndarray:
    w, tok = _worker, _worker["tok"]
    file = w["files"][unit.file]
    framed = tok.framing.has_tokens
    texts = inputs.read_unit(file, unit, w["text_key"], w["text_column"], "" if framed else inputs.DOC_END)
    if not framed:
        return tok.encode_many(texts).astype(w["dtype"])
    if file.kind != "txt":
        return tok.encode_many(texts, tok.framing).astype(w["dtype"])
    # A text file is one document: framed where it starts and ends, in whichever units hold those.
    ids = tok.encode_many(texts, Framing())
    bos, eos = tok.framing.bos, tok.framing.eos
    return (
        Framing(bos if unit.start == 0 else None, eos if unit.end == file.size else None)
        .frame(ids)
        .astype(w["dtype"])
    )


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**20):
            h.update(block)
    return h.hexdigest()


def _in_order(tasks: Sequence[Any], fn: Any, workers: int, init: tuple[Any, ...]) -> Iterator[Any]:
    """fn(task) for each task, in order; on `workers` processes with at most 2 tasks each in flight."""
    if workers <= 1:
        _start_worker(*init)
        yield from map(fn, tasks)
        return
    # spawn, not fork: a forked child would inherit the trained tokenizer's thread pool state.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker, initargs=init) as pool:
        pending: collections.deque[Future[Any]] = collections.deque()
        todo = iter(tasks)
        try:
            for task in todo:
                pending.append(pool.submit(fn, task))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            pool.shutdown(cancel_futures=True)


# ---------------------------------------------------------------- the outputs


class SplitWriter:
    """A split's tokens: `{split}.bin` (flat), or `{split}_00000.bin`, ... with the llm.c header;
    masked: each shard's loss mask beside it (`.mask`, one uint8 per token)."""

    def __init__(
        self, directory: Path, split: str, shard_tokens: int, dtype: np.dtype, masked: bool = False
    ) -> None:
        self.directory, self.split, self.shard_tokens, self.dtype = directory, split, shard_tokens, dtype
        self.masked = masked
        self.shards: list[dict[str, Any]] = []
        self.tokens = 0
        self._f: BinaryIO | None = None
        self._mask: BinaryIO | None = None
        self._name, self._count, self._max, self._hash = "", 0, 0, hashlib.sha256()

    def write(self, ids: np.ndarray, keep: np.ndarray | None = None) -> None:
        while len(ids):
            if self._f is None:
                self._open()
            room = self.shard_tokens - self._count if self.shard_tokens else len(ids)
            part, ids = ids[:room].astype(self.dtype, copy=False), ids[room:]
            if self._mask is not None and keep is not None:
                self._mask.write(keep[:room].astype(np.uint8).tobytes())
                keep = keep[room:]
            body = part.tobytes()
            assert self._f is not None
            self._f.write(body)
            self._hash.update(body)
            self._count += len(part)
            self._max = max(self._max, int(part.max()))
            self.tokens += len(part)
            if self.shard_tokens and self._count == self.shard_tokens:
                self._close()

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin" if self.shard_tokens else f"{self.split}.bin"
        self._f = open(self.directory / name, "xb")
        if self.masked:
            self._mask = open(self.directory / name.replace(".bin", MASK_SUFFIX), "xb")
        if self.shard_tokens:
            self._f.write(bytes(HEADER_BYTES))  # filled in once the count is known
        self._name, self._count, self._max, self._hash = name, 0, 0, hashlib.sha256()

    def _close(self) -> None:
        f = self._f
        assert f is not None
        if self.shard_tokens:
            header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
            header[:3] = HEADER_MAGIC, 1 if self.dtype.itemsize == 2 else 2, self._count
            f.seek(0)
            f.write(header.tobytes())
        for g in (f, self._mask) if self._mask is not None else (f,):
            g.flush()
            os.fsync(g.fileno())
            g.close()
        self._f = self._mask = None
        self.shards.append(
            {"file": self._name, "tokens": self._count, "bytes": (self.directory / self._name).stat().st_size,
             "max_id": self._max, "sha256_tokens": self._hash.hexdigest()}
            | ({"mask": self._name.replace(".bin", MASK_SUFFIX)} if self.masked else {})
        )  # fmt: skip

    def finish(self) -> list[dict[str, Any]]:
        if self._f is not None:
            self._close()
        return self.shards


def _is_output(name: str) -> bool:
    """Names this module writes into out_dir (so they are never inputs, and stale ones are removed)."""
    stem = name.removesuffix(".bin").removesuffix(MASK_SUFFIX)
    tokenizer = (TOKENIZER_FILE, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR)
    return name in (MANIFEST, *tokenizer) or (
        name.endswith((".bin", MASK_SUFFIX))
        and (stem in ("train", "val") or stem.split("_")[0] in ("train", "val"))
    )


@contextlib.contextmanager
def staged(out_dir: Path) -> Iterator[Path]:
    """A hidden folder inside out_dir to write a set into, whole or not at all: commit_outputs
    moves what it holds into place; whatever is left (a failure's) is removed, and so are the
    folders made for it (out_dir and its missing parents), where a failure left them empty."""
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # innermost first
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / f".prepare.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    done = False
    try:
        yield staging
        done = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made if not done else []:
            try:
                folder.rmdir()  # only an empty one: never what anyone else put there meanwhile
            except OSError:
                break


def commit_outputs(staging: Path, out_dir: Path, manifest: dict[str, Any]) -> None:
    """Move the staged files into out_dir, dropping an earlier run's; the manifest (its format
    and version put first) lands last."""
    with contextlib.suppress(FileNotFoundError):
        (out_dir / MANIFEST).unlink()  # from here until the new one lands, the set reads as incomplete
    new = {p.name for p in staging.iterdir()}
    for old in out_dir.iterdir():
        if old.is_dir() and old.name == CHAT_TEMPLATE_DIR:  # a folder is replaced whole
            shutil.rmtree(old)
        elif old.is_file() and _is_output(old.name) and old.name not in new:
            old.unlink()
    for path in staging.rglob("*"):  # on disk before the manifest says the set is whole
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for name in sorted(new):
        os.replace(staging / name, out_dir / name)
    manifest = {"format": MANIFEST_FORMAT, "version": 1} | manifest
    write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")


# ---------------------------------------------------------------- the pipeline


def _tokenizer(
    kind: str,
    vocab_size: int,
    files: list[inputs.InputFile],
    units: list[inputs.Unit],
    text_key: str,
    text_column: str,
) -> tuple[ByteTokenizer | BPETokenizer, dict[str, Any]]:
    """The tokenizer and its manifest entry: bytes, a BPE trained on the training units, or a file."""
    if kind == "byte":
        if vocab_size not in (0, 256):
            raise UserError(f"--vocab_size {vocab_size} needs --tokenizer bpe (the byte tokenizer has 256)")
        return ByteTokenizer(), {"kind": "byte", "vocab_size": 256, "file": None}
    if kind == "bpe":
        if not vocab_size:
            raise UserError("--tokenizer bpe needs --vocab_size N, e.g. --vocab_size 8192")
        # Trained on the training split only, so validation text stays unseen.
        texts = (
            t
            for u in units
            if not u.is_val
            for t in inputs.read_unit(files[u.file], u, text_key, text_column)
        )
        tok = BPETokenizer.train(texts, vocab_size)
        return tok, {"kind": "bpe", "vocab_size": tok.vocab_size, "file": TOKENIZER_FILE}
    if find_tokenizer(kind) is None:
        raise UserError(
            f"--tokenizer must be byte, bpe, a tokenizer.json file or a folder holding one; {kind} is "
            "none of these"
        )
    if vocab_size:
        raise UserError(f"--vocab_size is taken from {kind}; leave it out")
    tok = BPETokenizer.from_file(kind)
    return tok, {"kind": "file", "vocab_size": tok.vocab_size, "file": TOKENIZER_FILE, "from": str(kind)}


def prepare_corpus(
    inputs_: Sequence[str | Path],
    out_dir: str | Path,
    pattern: str = DEFAULT_GLOB,
    val_fraction: float = 0.01,
    tokenizer: str = "byte",
    vocab_size: int = 0,
    overwrite: bool = False,
    shard_tokens: int = 0,
    workers: int = 0,
    text_key: str = "text",
    text_column: str = "text",
) -> PreparedData:
    """Inputs (files, folders, globs) -> token files and manifest.json in out_dir; workers 0 = every core."""
    out_dir = Path(out_dir)
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 0 or workers < 0:
        raise UserError(f"--shard_tokens and --workers must be >= 0, got {shard_tokens} and {workers}")
    require_writable(out_dir, "--out_dir")
    existing = [n for n in (MANIFEST, "train.bin", "train_00000.bin") if (out_dir / n).exists()]
    if existing and not overwrite:
        raise UserError(f"{out_dir / existing[0]} already exists; pass --overwrite or another --out_dir")
    paths = [
        p for p in inputs.find_files([str(i) for i in inputs_], pattern)
        if not (p.resolve().parent == out_dir.resolve() and _is_output(p.name))
    ]  # fmt: skip
    if not paths:
        raise UserError("the only inputs are this script's own outputs; pass text, jsonl or parquet files")
    files = inputs.describe(paths, text_column)
    units = inputs.plan(files, val_fraction)
    tok, tok_entry = _tokenizer(tokenizer, vocab_size, files, units, text_key, text_column)
    return prepare_files(
        files, units, out_dir, tok, tok_entry,
        shard_tokens=shard_tokens, workers=workers or os.cpu_count() or 1,
        text_key=text_key, text_column=text_column, val_fraction=val_fraction,
    )  # fmt: skip


def prepare_files(
    files: list[inputs.InputFile],
    units: list[inputs.Unit],
    out_dir: Path,
    tok: ByteTokenizer | BPETokenizer,
    tok_entry: dict[str, Any],
    shard_tokens: int,
    workers: int,
    text_key: str,
    text_column: str,
    val_fraction: float,
) -> PreparedData:
    """Tokenize the planned units into out_dir (the part of prepare_corpus the default dataset uses too)."""
    dtype = np.dtype(token_dtype_for(tok.vocab_size)).newbyteorder("<")
    init = (
        None if isinstance(tok, ByteTokenizer) else (tok.to_json(), tok.config),
        text_key,
        text_column,
        dtype.str,
        files,
    )
    workers = max(1, min(workers, len(units)))
    with staged(out_dir) as staging:
        shards, counts, seconds = _write_splits(files, units, staging, shard_tokens, dtype, workers, init)
        longest = {split: max((s["tokens"] for s in shards[split]), default=0) for split in shards}
        _check_splits(longest, val_fraction, shard_tokens)
        if isinstance(tok, BPETokenizer):  # its special tokens and chat template: for training, predict, chat
            tok.save(staging)
        hashes = list(_in_order([f.path for f in files], sha256, min(workers, len(files)), init))
        manifest = {
            "tokenizer": tok_entry,
            # Boundary tokens around each document (null, null: separated by text, inputs.DOC_END);
            # a run checks them against its model's tokenizer and masks attention at them.
            "framing": tok.framing.to_json(),
            "token_dtype": str(np.dtype(dtype.str[1:])),
            "header": "llm.c" if shard_tokens else "none",
            "shard_tokens": shard_tokens,
            "val_fraction": val_fraction,
            "text_key": text_key,
            "text_column": text_column,
            "splits": {k: {"tokens": counts[k], "shards": shards[k]} for k in shards if counts[k]},
            "sources": [
                {"path": str(f.path), "bytes": f.size, "sha256": h}
                for f, h in zip(files, hashes, strict=True)
            ],
        }
        commit_outputs(staging, out_dir, manifest)
    return PreparedData(
        manifest_path=out_dir / MANIFEST,
        train_paths=[out_dir / s["file"] for s in shards["train"]],
        val_paths=[out_dir / s["file"] for s in shards["val"]],
        train_tokens=counts["train"],
        val_tokens=counts["val"],
        longest=longest,
        vocab_size=tok.vocab_size,
        token_dtype=str(np.dtype(dtype.str[1:])),
        tokenizer_path=out_dir / TOKENIZER_FILE if isinstance(tok, BPETokenizer) else None,
        tokenize_seconds=seconds,
        workers=workers,
    )


def _write_splits(
    files: list[inputs.InputFile],
    units: list[inputs.Unit],
    staging: Path,
    shard_tokens: int,
    dtype: np.dtype,
    workers: int,
    init: tuple[Any, ...],
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int], float]:
    """Each unit tokenized and written to its split, in order: each split's shards, its tokens, and
    the seconds it took. An input that gave no tokens is refused."""
    writers = {split: SplitWriter(staging, split, shard_tokens, dtype) for split in ("train", "val")}
    per_file = [0] * len(files)
    t0 = time.perf_counter()
    for unit, ids in zip(units, _in_order(units, _tokenize, workers, init), strict=True):
        writers["val" if unit.is_val else "train"].write(ids)
        per_file[unit.file] += len(ids)
    seconds = time.perf_counter() - t0
    for f, n in zip(files, per_file, strict=True):
        if n == 0:
            raise UserError(f"input {f.path} holds no text (no documents or only blank lines); remove it")
    shards = {split: w.finish() for split, w in writers.items()}
    return shards, {split: w.tokens for split, w in writers.items()}, seconds


def _check_splits(longest: dict[str, int], val_fraction: float, shard_tokens: int) -> None:
    """Refuse, before anything lands, a split too short for one sequence (two tokens) of any model:
    training on it fails whatever the flags."""
    for split, name in (("train", "train"), ("val", "validation")):
        if (n := longest[split]) < 2 and (split == "train" or val_fraction):
            where, flags = f"{n} token(s)", f"--val_fraction {val_fraction}"
            if shard_tokens:
                where, flags = f"{where} in its longest file", f"{flags} or --shard_tokens {shard_tokens}"
            raise UserError(
                f"the {name} split came out with {where}, too few for one sequence; add text, or "
                f"change {flags}"
            )
