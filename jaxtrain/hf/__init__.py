"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and Qwen3 causal LMs, and the
mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (moe.py).

    --init_from hf:DIR               train from a Hugging Face model dir (config.json, *.safetensors)
    --task test|predict --resume_from hf:DIR
    scripts/export_hf.py RUN_DIR|CHECKPOINT --out DIR

config.py maps architectures to ModelConfig and back (moe.py: the MoE families' keys), weights.py
names every tensor (one table, read both ways), store.py reads and writes safetensors files,
load.py and export.py use them. A dir may be a gs:// or s3:// prefix: its safetensors read by
range (store.py), its tokenizer files fetched and whole dirs written complete-or-nothing (disk/remote.py).
"""

from pathlib import Path

from jaxtrain.config import origin
from jaxtrain.config.origin import PREFIX, is_hf
from jaxtrain.disk import bucket

__all__ = ["PREFIX", "hf_dir", "is_hf"]


def hf_dir(path: str) -> Path | str | None:
    """The Hugging Face model dir a --init_from / --resume_from value names, or None: origin.hf_dir's
    answer, but a dir in a bucket (hf:gs://b/m, hf:s3://b/m) as its URL (a Path folds the //)."""
    directory = origin.hf_dir(path)
    return (
        path[len(PREFIX) :].rstrip("/")
        if directory is not None and bucket.is_url(path[len(PREFIX) :])
        else directory
    )
