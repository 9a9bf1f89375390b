"""Text, jsonl and parquet inputs to token files plus manifest.json, tokenized in parallel, streamed.

    prepare_corpus(["web/"], "data/web", tokenizer="bpe", vocab_size=8192, shard_tokens=10**8)
    # -> data/web/train_00000.bin ... val_00000.bin (llm.c header), tokenizer.json, manifest.json

Without shard_tokens the outputs are train.bin and val.bin, flat nanoGPT files. Work units (see
inputs.py) are tokenized by `workers` processes, at most two units each in flight, and written in
order: the output is the same for any worker count and memory stays flat however large the input.
Everything is staged and moved into place only once all of it succeeded, manifest.json last: a set
without its manifest is incomplete (output.py). Inputs and out_dir may be in a bucket (gs://,
s3://): inputs are streamed by range, each shard is put into the bucket as soon as it is closed.
"""

from __future__ import annotations

import collections
import hashlib
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from jaxtrain.cluster.lifeline import die_with_parent
from jaxtrain.disk import bucket
from jaxtrain.disk.files import require_writable
from jaxtrain.errors import UserError
from jaxtrain.prepare import inputs
from jaxtrain.prepare.inputs import Location
from jaxtrain.prepare.output import Staging, is_output, staged
from jaxtrain.text.format import HEADER_BYTES, HEADER_MAGIC, MANIFEST, MASK_SUFFIX, token_dtype_for
from jaxtrain.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, Framing, find_tokenizer

DEFAULT_GLOB = "*.txt,*.jsonl,*.parquet"


@dataclass(frozen=True)
class PreparedData:
    """What `prepare_corpus` wrote, and how fast it tokenized."""

    manifest_path: Location
    train_paths: list[Location]
    val_paths: list[Location]
    train_tokens: int
    val_tokens: int
    longest: dict[str, int]  # tokens of each split's longest file: windows of up to one less fit it
    vocab_size: int
    token_dtype: str
    tokenizer_path: Location | None
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


def sha256(path: Path) -> str:  # (a file on disk)
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
        self,
        directory: Path,
        split: str,
        shard_tokens: int,
        dtype: np.dtype,
        masked: bool = False,
        on_close: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.directory, self.split, self.shard_tokens, self.dtype = directory, split, shard_tokens, dtype
        self.masked, self.on_close = masked, on_close
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
        if self.on_close is not None:  # (a bucket's staging puts the shard there now)
            self.on_close([self._name, *([self.shards[-1]["mask"]] if self.masked else [])])

    def finish(self) -> list[dict[str, Any]]:
        if self._f is not None:
            self._close()
        return self.shards


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
    where = local_tokenizer(kind, "--tokenizer")
    if where is None:
        raise UserError(
            f"--tokenizer must be byte, bpe, a tokenizer.json file or a folder holding one; {kind} is "
            "none of these"
        )
    if vocab_size:
        raise UserError(f"--vocab_size is taken from {kind}; leave it out")
    tok = BPETokenizer.from_file(where)
    return tok, {"kind": "file", "vocab_size": tok.vocab_size, "file": TOKENIZER_FILE, "from": str(kind)}


def local_tokenizer(where: str, flag: str) -> Path | None:
    """find_tokenizer(where), where a tokenizer in a bucket (a tokenizer.json object, or a prefix
    holding one, as a Hugging Face folder does) is first copied with its companions into the cache."""
    if bucket.is_url(where):
        from jaxtrain.disk.remote import fetch_tokenizer

        return fetch_tokenizer(where, flag)
    return find_tokenizer(where)


def out_location(out_dir: str | Path) -> Location:
    """--out_dir as written to: a folder, or (gs://, s3://) a prefix in a bucket, checked: a bucket
    that cannot be read or written is one line here, before any input is read."""
    if bucket.is_url(str(out_dir)):
        bucket.check(str(out_dir), "--out_dir", write=True)
        return bucket.ObjectPath(str(out_dir))
    require_writable(Path(out_dir), "--out_dir")
    return Path(out_dir)


def source_entry(f: inputs.InputFile, sha: str | None) -> dict[str, Any]:
    """manifest.json's record of an input: its path, size and sha256; an object in a bucket, the
    store's own checksum (CRC32C, MD5 or ETag), which asks for no second read of it."""
    if isinstance(f.path, bucket.ObjectPath):
        return {"path": str(f.path), "bytes": f.size, "checksum": f.checksum}
    return {"path": str(f.path), "bytes": f.size, "sha256": sha}


def source_hashes(files: list[inputs.InputFile], workers: int, init: tuple[Any, ...]) -> list[str | None]:
    """The sha256 of each input on disk (None for objects: see source_entry), on `workers` processes."""
    local = [f.path for f in files if isinstance(f.path, Path)]
    workers = min(workers, len(local))
    hashes = iter(_in_order(local, sha256, workers, init) if workers > 1 else map(sha256, local))
    return [next(hashes) if isinstance(f.path, Path) else None for f in files]


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
    """Inputs (files, folders, globs) -> token files and manifest.json in out_dir; workers 0 = every
    core. Any input, and out_dir, may be in a bucket (gs://, s3://)."""
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 0 or workers < 0:
        raise UserError(f"--shard_tokens and --workers must be >= 0, got {shard_tokens} and {workers}")
    out = out_location(out_dir)
    existing = [n for n in (MANIFEST, "train.bin", "train_00000.bin") if (out / n).exists()]
    if existing and not overwrite:
        raise UserError(f"{out / existing[0]} already exists; pass --overwrite or another --out_dir")
    paths = [
        p for p in inputs.find_files([str(i) for i in inputs_], pattern)
        if not (p.resolve().parent == out.resolve() and is_output(p.name))
    ]  # fmt: skip
    if not paths:
        raise UserError("the only inputs are this script's own outputs; pass text, jsonl or parquet files")
    files = inputs.describe(paths, text_column)
    units = inputs.plan(files, val_fraction)
    tok, tok_entry = _tokenizer(tokenizer, vocab_size, files, units, text_key, text_column)
    return prepare_files(
        files, units, out, tok, tok_entry,
        shard_tokens=shard_tokens, workers=workers or os.cpu_count() or 1,
        text_key=text_key, text_column=text_column, val_fraction=val_fraction,
    )  # fmt: skip


def prepare_files(
    files: list[inputs.InputFile],
    units: list[inputs.Unit],
    out_dir: Location,
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
            tok.save(staging.folder)
        hashes = source_hashes(files, workers, init)
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
            "sources": [source_entry(f, h) for f, h in zip(files, hashes, strict=True)],
        }
        staging.commit(manifest)
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
    staging: Staging,
    shard_tokens: int,
    dtype: np.dtype,
    workers: int,
    init: tuple[Any, ...],
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int], float]:
    """Each unit tokenized and written to its split, in order: each split's shards, its tokens, and
    the seconds it took. An input that gave no tokens is refused."""
    writers = {
        split: SplitWriter(staging.folder, split, shard_tokens, dtype, on_close=staging.closed)
        for split in ("train", "val")
    }
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
