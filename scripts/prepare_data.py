"""Turn text files into the flat token files scripts/train.py reads: OUT_DIR/train.bin and val.bin.

Byte-level (vocab 256, uint16 tokens), the default:
    python scripts/prepare_data.py books/ --glob "*.txt" --out_dir data/books
A single file, 5% held out for validation:
    python scripts/prepare_data.py shakespeare.txt --out_dir data/shakespeare --val_fraction 0.05
A BPE trained here with HuggingFace `tokenizers` (pip install -e '.[bpe]'; adds tokenizer.json):
    python scripts/prepare_data.py docs/ --glob "*.md" --out_dir data/docs --tokenizer bpe --vocab_size 8192

The files are read in sorted order and concatenated as they are; the last --val_fraction of the
bytes (cut at a line end) becomes val.bin. The text is streamed, never held in memory whole, and
each output appears only once complete. The script ends by printing the train.py flags to use.
"""

from __future__ import annotations

import argparse

from jaxtrain.cli import Parser
from jaxtrain.corpus import prepare_corpus
from jaxtrain.errors import exit_on_user_error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text files and/or folders (searched recursively)")
    p.add_argument("--out_dir", required=True, help="where train.bin and val.bin are written")
    p.add_argument("--glob", default="*.txt", help="file name pattern inside folders (default: *.txt)")
    p.add_argument("--val_fraction", type=float, default=0.01, help="share of bytes held out (default 0.01)")
    p.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    p.add_argument("--vocab_size", type=int, default=0, help="BPE vocabulary size (with --tokenizer bpe)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR/train.bin")
    return p.parse_args(argv)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = prepare_corpus(
        args.inputs,
        args.out_dir,
        pattern=args.glob,
        val_fraction=args.val_fraction,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        overwrite=args.overwrite,
    )
    print(f"train: {result.train_path}  {result.train_tokens:,} tokens ({result.token_dtype})")
    flags = f"--train_data_path {result.train_path}"
    if result.val_path is not None:
        print(f"val:   {result.val_path}  {result.val_tokens:,} tokens")
        print(f"       (enough for --model.seq_len up to {result.val_tokens - 1})")
        flags += f" --valid_data_path {result.val_path}"
    else:
        flags += " --eval_interval 0"
    if result.tokenizer_path is not None:
        print(f"tokenizer: {result.tokenizer_path}  vocabulary {result.vocab_size}")
    flags += f" --model.vocab_size {result.vocab_size}"
    print(f"train with:\n  python scripts/train.py {flags}")


if __name__ == "__main__":
    main()
