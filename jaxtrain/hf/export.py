"""A checkpoint of ours as a Hugging Face model dir: config.json, safetensors, tokenizer, generation.

Each param is read from the orbax checkpoint alone (a partial restore of one leaf, as a host
numpy array) and written at once into its place in the safetensors files, so the host holds one
param (a scanned stack holds every layer's) and its HF tensors, never the whole model.

The dir may be a prefix in a bucket (gs://, s3://; remote.Upload): the files are staged in a local
folder, each safetensors file put as soon as its every tensor is written (and removed locally),
config.json last; a failure removes what it put, and a missing bucket or one these credentials may
not write is one line before anything is read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from jaxtrain.config import Config, ModelConfig, saved_model
from jaxtrain.config.data import parse_spec
from jaxtrain.data.default import given_paths, tokenizer_file
from jaxtrain.disk import bucket
from jaxtrain.disk import checkpoint as ckpt_lib
from jaxtrain.disk.remote import Upload, fetch_tokenizer
from jaxtrain.errors import UserError
from jaxtrain.hf import config as hf_config
from jaxtrain.hf import is_hf, weights
from jaxtrain.hf.store import Writer
from jaxtrain.model.params import path_names
from jaxtrain.text.chat_template import stop_tokens
from jaxtrain.tokenizer import TOKENIZER_CONFIG, TOKENIZER_FILE, BPETokenizer, tokenizer_for

log = logging.getLogger("jaxtrain")

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


class _Leaves:
    """One param at a time from an orbax step dir's `state` item, as a host numpy array."""

    def __init__(self, step_dir: Path) -> None:
        self.state_dir = step_dir / "state"
        try:
            meta = ocp.PyTreeCheckpointHandler().metadata(self.state_dir).tree["params"]
        except Exception as e:  # missing or garbled files
            raise ckpt_lib.unreadable(step_dir, e) from None
        self.shapes = {path_names(path): tuple(leaf.shape) for path, leaf in _flatten(meta)}
        self.checkpointer = ocp.PyTreeCheckpointer()

    def get(self, path: tuple[str, ...]) -> np.ndarray:
        item: Any = np.empty(0)  # only its place in the tree matters
        args: Any = ocp.RestoreArgs(restore_type=np.ndarray)
        for key in reversed(("params", *path)):
            item, args = {key: item}, {key: args}
        out = self.checkpointer.restore(
            self.state_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)
        )
        for key in ("params", *path):
            out = out[key]
        return np.asarray(out)


def _flatten(tree: Any) -> list[tuple[tuple, Any]]:
    import jax

    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]


def _tokenizer_files(saved: dict[str, Any], model: ModelConfig, out: Path) -> str:
    """The run's tokenizer as transformers 5 saves one (tokenizer.json, tokenizer_config.json,
    chat_template.jinja); which one it was."""
    train_path = given_paths(saved)[0]
    beside = tokenizer_file(train_path) or _in_bucket(train_path)
    tok = tokenizer_for(beside, model.vocab_size)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.seq_len,
        "clean_up_tokenization_spaces": False,
    }
    if isinstance(tok, BPETokenizer):  # the data's own special tokens and chat template, ours over them
        tok.save(out, config)
        return f"BPE ({beside})"
    if tok is None:
        log.warning(f"no {TOKENIZER_FILE} beside the training data: exported without a tokenizer")
        return "none"
    (out / TOKENIZER_FILE).write_text(byte_tokenizer_json())
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return "bytes"


def _in_bucket(train_path: str) -> Path | None:
    """The tokenizer.json beside training data in a bucket (as tokenizer_file finds one on disk),
    copied into the local cache; None (with a warning where the bucket cannot be read) if none."""
    first = parse_spec(train_path, "train_data_path")[0].path.split(",")[0] if train_path else ""
    if not bucket.is_url(first):
        return None
    try:
        return fetch_tokenizer(first.rpartition("/")[0], "the training data")
    except UserError as e:
        log.warning(f"the tokenizer beside the training data cannot be read: {e}")
        return None


def byte_tokenizer_json() -> str:
    """tokenizer.json whose token ids are the UTF-8 bytes, as our ByteTokenizer's: a byte-level
    BPE without merges, each byte's printable stand-in (GPT-2's byte-to-unicode map) as its id."""
    import tokenizers as tk

    by_byte = _gpt2_bytes_to_unicode()
    vocab = {c: b for b, c in by_byte.items()}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return str(tok.to_str())


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (what ByteLevel pre-tokenizes into)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def export(
    path: str, out: Path | str, max_shard_bytes: int = 5 * 2**30, dtype: str = "float32"
) -> dict[str, Any]:
    """Write checkpoint `path` (a run dir, its checkpoints/ dir or one step dir) to `out`, a folder
    or a gs:// or s3:// prefix."""
    if is_hf(path):
        raise UserError(f"{path} is a Hugging Face model dir already; export a checkpoint of ours")
    url = str(out).rstrip("/") if bucket.is_url(str(out)) else None
    upload = Upload(url, "--out") if url else None  # the bucket checked first: one line, nothing read
    source, step = ckpt_lib.open_checkpoint(path, "checkpoint")
    saved = source.read_meta(step).get("config", {})
    model = saved_model(saved)  # the rule --task test|predict|chat read it by (run/resolve.py)
    config = hf_config.to_hf(model, dtype)  # refuses models no class matches, before writing
    leaves = _Leaves(source.directory / str(step))
    entries = weights.entries(model)
    shapes = {e.name: weights.hf_shape(e, leaves.shapes[e.path]) for e in entries}
    if upload is None:
        Path(out).mkdir(parents=True, exist_ok=True)
        written = _write(leaves, saved, model, config, entries, shapes, Path(out), max_shard_bytes, dtype)
    else:
        with upload:
            written = _write(
                leaves, saved, model, config, entries, shapes, upload.folder, max_shard_bytes, dtype,
                done=upload.put,
            )  # fmt: skip
            upload.commit()
    return {"checkpoint": str(source.directory / str(step)), "out": url or str(out), **written}


def _write(
    leaves: _Leaves, saved: dict[str, Any], model: ModelConfig, config: dict[str, Any],
    entries: list[weights.Entry], shapes: dict[str, tuple[int, ...]], out: Path, max_shard_bytes: int,
    dtype: str, done: Callable[[Path], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The model dir's files written into `out`; `done` is handed each safetensors file complete."""
    writer = Writer(out, shapes, DTYPES[dtype], max_shard_bytes)
    by_leaf: dict[tuple[str, ...], list[weights.Entry]] = {}
    for e in entries:
        by_leaf.setdefault(e.path, []).append(e)
    for leaf_path, group in by_leaf.items():
        leaf = leaves.get(leaf_path)
        for e in group:
            complete = writer.write(e.name, weights.to_hf(e, leaf))
            if complete is not None and done is not None:
                done(complete)
        del leaf
    writer.close()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    defaults = Config()  # the run's sampling settings, else jaxtrain's
    generation = {
        "do_sample": True,
        "temperature": saved.get("temperature", defaults.temperature),
        "top_k": saved.get("top_k", defaults.top_k),
    }
    tokenizer = _tokenizer_files(saved, model, out)
    if (out / TOKENIZER_FILE).is_file() and tokenizer != "bytes":  # generate stops where --task predict does
        generation["eos_token_id"] = sorted(stop_tokens(BPETokenizer.from_file(out)))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return {
        "architecture": config["architectures"][0],
        "files": [p.name for p in writer.files],
        "tokenizer": tokenizer,
    }
