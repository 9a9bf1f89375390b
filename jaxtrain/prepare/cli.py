"""The command line of scripts/prepare_data.py (whose docstring is its --help): the flags, what it
prints, and a train command that runs on what was written (with this interpreter, into a run dir
of its own; the vocabulary is read from the manifest).

The printed command takes train.py's default window (TRAIN_SEQ_LEN) unless a split's longest file
is shorter than one sequence of it; then it names the largest power of two that fits both splits,
and says why and how to keep the default. prepare/ imports nothing of training, so TRAIN_SEQ_LEN is
a copy of ModelConfig.seq_len; tests/test_prepare.py holds them equal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxtrain.disk import bucket
from jaxtrain.errors import UserError
from jaxtrain.parser import Parser
from jaxtrain.prepare.chat import prepare_chat
from jaxtrain.prepare.inputs import Location
from jaxtrain.prepare.shards import DEFAULT_GLOB, PreparedData, prepare_corpus

TRAIN_SEQ_LEN = 256  # scripts/train.py's default --model.seq_len


def parse_args(argv: list[str] | None = None, usage: str = "") -> argparse.Namespace:
    p = Parser(
        prog="scripts/prepare_data.py",
        description=usage,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "inputs", nargs="+",
        help="files, globs and/or folders (searched recursively); any may be gs:// or s3:// URLs",
    )  # fmt: skip
    p.add_argument(
        "--out_dir", required=True,
        help="where the token files and manifest.json are written: a folder, or a gs:// or s3:// prefix",
    )  # fmt: skip
    p.add_argument(
        "--glob", default=DEFAULT_GLOB, help=f"file name patterns inside folders (default: {DEFAULT_GLOB})"
    )
    p.add_argument(
        "--val_fraction", type=float, default=0.01,
        help="share of bytes held out, in whole lines or rows, at least one (default 0.01)",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte, bpe (trained here), a tokenizer.json or a Hugging Face folder (either in a bucket too)",
    )
    p.add_argument("--vocab_size", type=int, default=0, help="BPE vocabulary size (with --tokenizer bpe)")
    p.add_argument(
        "--shard_tokens", type=int, default=0, help="tokens per shard; 0 = one train.bin and val.bin"
    )
    p.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: one per core)")
    p.add_argument("--text_key", default="text", help="the text field of .jsonl inputs")
    p.add_argument("--text_column", default="text", help="the text column of .parquet inputs")
    p.add_argument("--overwrite", action="store_true", help="replace what OUT_DIR holds")
    p.add_argument("--chat", action="store_true", help="conversations: rows of messages, with a loss mask")
    p.add_argument(
        "--seq_len", type=int, metavar="N",
        help="--chat (required with it, no default): the window of the model to train, which conversations "
        "are packed in; train with --model.seq_len N",
    )  # fmt: skip
    p.add_argument("--messages_key", default="messages", help="--chat: the field (or column) of the messages")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, usage: str = "") -> None:
    args = parse_args(argv, usage)
    if args.chat:
        return _chat(args)
    result = prepare_corpus(
        args.inputs,
        args.out_dir,
        pattern=args.glob,
        val_fraction=args.val_fraction,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        overwrite=args.overwrite,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        text_key=args.text_key,
        text_column=args.text_column,
    )
    total = result.train_tokens + result.val_tokens
    print(f"train: {len(result.train_paths)} file(s), {result.train_tokens:,} tokens ({result.token_dtype})")
    if result.val_paths:
        print(f"val:   {len(result.val_paths)} file(s), {result.val_tokens:,} tokens")
        print(f"       (enough for --model.seq_len up to {result.longest['val'] - 1})")
    if result.tokenizer_path is not None:
        print(f"tokenizer: {result.tokenizer_path}  vocabulary {result.vocab_size}")
    rate = total / max(result.tokenize_seconds, 1e-9)
    print(
        f"tokenized {total:,} tokens in {result.tokenize_seconds:.2f} s: {rate:,.0f} tokens/s "
        f"({result.workers} workers)"
    )
    print(f"train with:\n  {train_command(args.out_dir)} {train_flags(result, args.shard_tokens)}")


def train_command(out_dir: str) -> str:
    """The start of the printed train command: the interpreter running this (the one with jaxtrain
    installed; relative where it is under the working folder) and a run dir named after the data
    (runs/<out_dir's name>: `make train`'s runs/default holds another run)."""
    python = Path(sys.executable)
    if python.is_relative_to(Path.cwd()):
        python = python.relative_to(Path.cwd())
    name = out_dir.rstrip("/").rpartition("/")[2] if bucket.is_url(out_dir) else Path(out_dir).resolve().name
    return f"{python} scripts/train.py --run_dir runs/{name or 'data'}"


def _shown(path: Location) -> str:
    """A written file as a train command names it: absolute (the command runs from the repo,
    wherever prepare ran), or its URL."""
    return str(path) if isinstance(path, bucket.ObjectPath) else str(Path(path).resolve())


def train_flags(result: PreparedData, shard_tokens: int) -> str:
    """The flags of a train command that runs on `result`, after a note on any window it shortens."""
    # Absolute: the command runs from the repo, wherever prepare ran. Training reads the vocabulary
    # from the manifest (run/resolve.py: with_data_vocab).
    flags = f"--train_data_path {_shown(result.manifest_path)}"
    if not result.val_paths:
        flags += " --eval_interval 0"
    split = min(["train", "val"] if result.val_paths else ["train"], key=lambda s: result.longest[s])
    fits = result.longest[split] - 1  # the longest window a split holds: its longest file's tokens less one
    if fits >= TRAIN_SEQ_LEN:
        return flags
    seq_len = 1 << (fits.bit_length() - 1)  # a power of two: the sizes kernels and configs expect
    total = result.train_tokens + result.val_tokens
    more = "add text"
    if shard_tokens and shard_tokens <= TRAIN_SEQ_LEN:
        more = f"raise --shard_tokens above {TRAIN_SEQ_LEN}"
    elif split == "val" and (share := (TRAIN_SEQ_LEN + 1) / total) < 0.5:
        more = f"raise --val_fraction to about {share * 1.2:.2g}, or add text"
    print(
        f"note: {split} holds {result.longest[split]:,} tokens"
        f"{' in its longest file' if shard_tokens else ''}, fewer than the {TRAIN_SEQ_LEN + 1} one "
        f"sequence of train.py's default --model.seq_len {TRAIN_SEQ_LEN} needs: the command below trains "
        f"on windows of {seq_len} tokens (to keep {TRAIN_SEQ_LEN}, {more})"
    )
    return f"{flags} --model.seq_len {seq_len}"


def _chat(args: argparse.Namespace) -> None:
    if args.shard_tokens or args.vocab_size:
        flag = "--shard_tokens" if args.shard_tokens else "--vocab_size"
        raise UserError(
            f"--chat writes one train.bin and val.bin with the tokenizer's vocabulary; leave out {flag}"
        )
    if args.seq_len is None:
        raise UserError("--chat needs --seq_len N, the window of the model to train (e.g. 1024); none given")
    r = prepare_chat(
        args.inputs, args.out_dir, args.tokenizer, args.seq_len, val_fraction=args.val_fraction,
        overwrite=args.overwrite, messages_key=args.messages_key,
    )  # fmt: skip
    for split, n in r.conversations.items():
        print(
            f"{split}: {n:,} conversations, {r.tokens[split]:,} tokens, {r.kept[split]:,} of them trained on"
        )
    total = sum(r.tokens.values())
    print(f"packed into windows of {args.seq_len} tokens: {r.padding:,} padding ({r.padding / total:.1%})")
    print(f"rendered, tokenized and packed in {r.seconds:.2f} s")
    if r.cut:
        print(f"{r.cut:,} conversation(s) longer than a window were cut across windows")
    flags = f"--train_data_path {_shown(r.manifest_path)} --model.seq_len {args.seq_len}"
    print(f"train with:\n  {train_command(args.out_dir)} {flags}")
