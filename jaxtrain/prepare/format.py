"""The on-disk format of token data, shared by preparation (writes it) and training (reads it)."""

from __future__ import annotations

HEADER_MAGIC = 20240520  # llm.c token files: 256 int32 header, then the tokens
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
HEADER_DTYPES = {1: "uint16", 2: "uint32"}
MANIFEST = "manifest.json"  # a prepared set's shards, tokenizer and counts (scripts/prepare_data.py)
MANIFEST_FORMAT = "jaxtrain.tokens"


def token_dtype_for(vocab_size: int) -> str:
    """The dtype of a vocabulary's token files: uint16 while every id fits (nanoGPT's), else uint32."""
    return "uint16" if vocab_size <= 65536 else "uint32"
