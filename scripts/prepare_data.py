r"""Turn text into the token files scripts/train.py reads, with a manifest.json describing them.

Inputs are .txt files, .jsonl files (one JSON object a line, text in a `text` field: --text_key)
and .parquet files (text in a `text` column: --text_column), named directly, by glob, or as folders
searched recursively (--glob). They are streamed, tokenized by one process per core (--workers),
and written in input order, so the output is the same for any worker count.

Byte-level (vocab 256), flat train.bin and val.bin:
    python scripts/prepare_data.py books/ --out_dir data/books
Parquet shards of 100M tokens with a BPE trained here (pip install -e '.[bpe,parquet]'):
    python scripts/prepare_data.py 'fineweb/*.parquet' --out_dir data/web --tokenizer bpe \
        --vocab_size 32768 --shard_tokens 100000000
A tokenizer you bring, jsonl with the text in `content`:
    python scripts/prepare_data.py code.jsonl --out_dir data/code --tokenizer my/tokenizer.json \
        --text_key content

Conversations for fine-tuning (rows holding `messages`: [{role, content}, ...], as OpenAI and
Hugging Face chat datasets do), rendered with the tokenizer's chat template, packed into windows of
--seq_len tokens, with a loss mask keeping only the assistant turns:
    python scripts/prepare_data.py chats.jsonl --chat --tokenizer Qwen2.5-0.5B-Instruct/ \
        --seq_len 1024 --out_dir data/chats

The last --val_fraction of the input bytes (cut at a line start, or a parquet row) becomes the
validation split. With --shard_tokens N the splits are train_00000.bin, ... and val_00000.bin, ...
of N tokens each with the llm.c header. manifest.json (token counts, tokenizer, each shard's size
and largest id, each source file's size and sha256) is written last: train with
--train_data_path OUT_DIR/manifest.json (its val shards become the validation data). On bad input
(not UTF-8, a missing field or column, an empty or unreadable file) one line names the file, the
exit code is 2, and nothing in OUT_DIR changes.
"""

from __future__ import annotations

import argparse

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.errors import UserError
from jaxtrain.parser import Parser
from jaxtrain.prepare.chat import prepare_chat
from jaxtrain.prepare.shards import DEFAULT_GLOB, prepare_corpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="files, globs and/or folders (searched recursively)")
    p.add_argument("--out_dir", required=True, help="where the token files and manifest.json are written")
    p.add_argument(
        "--glob", default=DEFAULT_GLOB, help=f"file name patterns inside folders (default: {DEFAULT_GLOB})"
    )
    p.add_argument("--val_fraction", type=float, default=0.01, help="share of bytes held out (default 0.01)")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte, bpe (trained here), a tokenizer.json or a Hugging Face folder",
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


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
        print(f"       (enough for --model.seq_len up to {result.val_tokens - 1})")
    if result.tokenizer_path is not None:
        print(f"tokenizer: {result.tokenizer_path}  vocabulary {result.vocab_size}")
    rate = total / max(result.tokenize_seconds, 1e-9)
    print(
        f"tokenized {total:,} tokens in {result.tokenize_seconds:.2f} s: {rate:,.0f} tokens/s "
        f"({result.workers} workers)"
    )
    flags = f"--train_data_path {result.manifest_path}"
    if not result.val_paths:
        flags += " --eval_interval 0"
    print(f"train with:\n  python scripts/train.py {flags} --model.vocab_size {result.vocab_size}")


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
    flags = f"--train_data_path {r.manifest_path} --model.seq_len {args.seq_len}"
    print(f"train with:\n  python scripts/train.py {flags} --model.vocab_size {r.vocab_size}")


if __name__ == "__main__":
    main()
