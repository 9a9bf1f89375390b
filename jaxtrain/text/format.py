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


# A batch row is int32 tokens; a token whose prediction takes no loss (a --chat loss mask's 0: the
# user's turns) carries this bit, so masks travel with their tokens through the loader, the
# batch's sharding and the step, with no second array. Token ids stay below it (any vocabulary).
NO_LOSS = 1 << 30
TOKEN_BITS = NO_LOSS - 1
MASK_SUFFIX = ".mask"  # beside a token shard: one uint8 per token, 1 where it takes loss
