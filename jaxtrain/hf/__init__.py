"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and Qwen3 causal LMs.

    --init_from hf:DIR               train from a Hugging Face model dir (config.json, *.safetensors)
    --task test|predict --resume_from hf:DIR
    scripts/export_hf.py RUN_DIR|CHECKPOINT --out DIR

config.py maps architectures to ModelConfig and back, weights.py names every tensor (one table,
read both ways), store.py reads and writes safetensors files, load.py and export.py use them.
"""

from pathlib import Path

PREFIX = "hf:"


def is_hf(path: str) -> bool:
    """Whether a --init_from / --resume_from value names a Hugging Face model dir."""
    return path.startswith(PREFIX)


def hf_dir(path: str) -> Path | None:
    """The Hugging Face model dir a --init_from / --resume_from value names, or None."""
    return Path(path[len(PREFIX) :]) if is_hf(path) else None
