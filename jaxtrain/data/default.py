"""The data a run reads when the user names none, and where a run's data paths come from.

    train_path, val_path = run_paths(cfg)    # the user's, else the embedded default dataset

The default dataset is the Python standard library's own sources as bytes (vocab 256): on every
machine with Python, no download, built once into the cache.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from jaxtrain.config import Config
from jaxtrain.config.data import parse_spec
from jaxtrain.disk.files import cache_root
from jaxtrain.errors import DataError, UserError
from jaxtrain.prepare import inputs
from jaxtrain.prepare.shards import prepare_files
from jaxtrain.text.format import MANIFEST
from jaxtrain.tokenizer import BPETokenizer, ByteTokenizer, find_tokenizer, tokenizer_for


def run_paths(cfg: Config, saved: dict[str, Any] | None = None) -> tuple[str, str]:
    """(training, validation) data of a run: its own paths (a checkpoint's `saved` config for
    --task test), else the embedded byte dataset.

    Without a validation path the training path is read again as validation: a manifest gives its
    val shards, a mixture its sources' val shards (each evaluated apart), a plain file itself.
    """
    train, val = given_paths(saved or {}, cfg)
    if train:
        return train, val or train
    if cfg.model.vocab_size < 256:
        raise UserError(
            f"the embedded byte dataset needs model.vocab_size >= 256, got {cfg.model.vocab_size}; "
            "raise it or pass --train_data_path"
        )
    default_train, default_val = default_dataset()
    return str(default_train), val or str(default_val)


def given_paths(saved: dict[str, Any], cfg: Config | None = None) -> tuple[str, str]:
    """(training, validation) data paths as given: `cfg`'s, else `saved`'s (a checkpoint's config);
    "" where none is (a run on the embedded dataset)."""
    train = (cfg.train_data_path if cfg else "") or saved.get("train_data_path") or ""
    val = (cfg.valid_data_path if cfg else "") or saved.get("valid_data_path") or ""
    return str(train), str(val)


def tokenizer_file(train_path: str) -> Path | None:
    """The tokenizer.json beside the first file of training data `train_path` (a file, glob, comma
    list, manifest or mixture: its first source), if there is one; scripts/prepare_data.py puts it
    there."""
    if not train_path:
        return None
    first = parse_spec(train_path, "train_data_path")[0].path.split(",")[0]
    return find_tokenizer(Path(first).parent)


def run_tokenizer(train_path: str, vocab_size: int, own: str = "") -> ByteTokenizer | BPETokenizer | None:
    """The tokenizer of a model trained on `train_path` ("": the embedded byte dataset): `own` (a
    checkpoint's own tokenizer.json, as a Hugging Face dir has) wins, then the one beside the
    training data, else bytes for a 256-token vocabulary, else None (none jaxtrain can find)."""
    return tokenizer_for(Path(own) if own else tokenizer_file(train_path), vocab_size)


def _stdlib_sources(max_bytes: int) -> list[Path]:
    """The standard library's own .py files in sorted order, without tests, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    files, total = [], 0
    # Sorted by path relative to the root, so the order is the same on every run.
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        if not size:  # empty __init__.py files add nothing, and preparation refuses empty inputs
            continue
        files.append(path)
        total += size
    return files


def default_dataset(cache_dir: str | Path | None = None, max_bytes: int = 32 * 2**20) -> tuple[Path, Path]:
    """(train.bin, val.bin) of the Python standard library's sources as bytes (vocab 256), built once."""
    if cache_dir is None:
        cache_dir = cache_root()
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    out_dir = Path(cache_dir) / "stdlib_bytes" / f"{version}-max{max_bytes}"
    train, val = out_dir / "train.bin", out_dir / "val.bin"
    if (out_dir / MANIFEST).is_file():
        return train, val
    files = _stdlib_sources(max_bytes)
    if not files:
        raise DataError(
            f"no Python sources found under {sysconfig.get_paths()['stdlib']} to build the default "
            "dataset; pass --train_data_path (see scripts/prepare_data.py)"
        )
    # Several processes may build at once: each stages its own files and the renames of
    # identical bytes are harmless. The manifest lands last, so its presence means done.
    described = inputs.describe(files, "text")
    units = inputs.plan(described, 0.01)
    prepare_files(
        described, units, out_dir, ByteTokenizer(), {"kind": "byte", "vocab_size": 256},
        shard_tokens=0, workers=1, text_key="text", text_column="text", val_fraction=0.01,
    )  # fmt: skip
    return train, val
