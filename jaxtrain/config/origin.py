"""What --init_from and --resume_from name: `hf:DIR`, a Hugging Face model dir, or else a
checkpoint of ours. The one place that spells the prefix."""

from __future__ import annotations

from pathlib import Path

PREFIX = "hf:"


def is_hf(path: str) -> bool:
    """Whether a --init_from / --resume_from value names a Hugging Face model dir."""
    return path.startswith(PREFIX)


def hf_dir(path: str) -> Path | None:
    """The Hugging Face model dir a --init_from / --resume_from value names, or None."""
    return Path(path[len(PREFIX) :]) if is_hf(path) else None
