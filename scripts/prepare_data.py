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

The last --val_fraction of the input bytes becomes the validation split, in whole lines (or parquet
rows) and at least the last one, so one-line documents are never cut. With --shard_tokens N the
splits are train_00000.bin, ... and val_00000.bin, ... of N tokens each with the llm.c header.
manifest.json (token counts, tokenizer, each shard's size and largest id, each source file's size
and sha256) is written last: train with --train_data_path OUT_DIR/manifest.json (its val shards
become the validation data; the vocabulary is read from it). On bad input (not UTF-8, a missing
field or column, an empty or unreadable file) one line names the file, the exit code is 2, nothing
in OUT_DIR changes, and an OUT_DIR it made is removed.

Inputs, --out_dir and --tokenizer may be in buckets (gs://BUCKET/PATH, s3://BUCKET/PATH; credentials
and endpoints as each cloud's SDK finds them): inputs are streamed by range, each shard is put as
soon as it is written, manifest.json last (docs/object_storage.md):
    python scripts/prepare_data.py 's3://b/raw/*.jsonl' --out_dir s3://b/data/web --shard_tokens 100000000
"""

import sys

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.prepare.cli import main

if __name__ == "__main__":
    exit_on_user_error(main)(sys.argv[1:], __doc__ or "")
