"""`hf:DIR` as a checkpoint: --init_from hf:DIR (train from it), --resume_from hf:DIR (test, predict).

    source, step = jaxtrain.run.start.open_params(cfg.init_from, "--init_from")  # hf:DIR or ours
    params = source.restore_params(step, target, "--init_from")    # target: abstract params, sharded

Each of our params is assembled on the host from its memory-mapped HF tensors, then placed on the
devices shard by shard (each process reads only the slices it holds). DIR may be in a bucket
(hf:gs://BUCKET/PATH, hf:s3://BUCKET/PATH): config.json is read from there, each safetensors file's
header and then each tensor by range (store.py), the tokenizer files copied into the local cache
(remote.py); nothing else touches local disk.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtrain.disk import bucket
from jaxtrain.disk.remote import fetch_tokenizer
from jaxtrain.errors import UserError
from jaxtrain.hf import PREFIX, weights
from jaxtrain.hf import config as hf_config
from jaxtrain.hf.store import Reader
from jaxtrain.model.params import path_names
from jaxtrain.tokenizer import find_tokenizer


class HFCheckpoint:
    """A Hugging Face model dir, read as if it were a checkpoint of step 0."""

    def __init__(self, directory: Path | str, flag: str) -> None:
        self.flag, self.where = flag, f"{flag} {PREFIX}{directory}"
        # A dir in a bucket: its URL (read by range), and as a path an etils.epath.Path.
        self.url = str(directory).rstrip("/") if bucket.is_url(str(directory)) else None
        self.directory: Path = bucket.path(self.url) if self.url else Path(directory).absolute()
        if self.url is None and not self.directory.is_dir():
            raise UserError(f"{self.where}: no such directory; give a Hugging Face model dir")
        self.hf = hf_config.read(self.url or self.directory, flag)  # (a bucket checked: one line)
        self.keys = hf_config.model_keys(self.hf, self.where)
        self.reader = Reader(self.url or self.directory)

    def read_meta(self, step: int) -> dict[str, Any]:
        """What tasks.py reads of a checkpoint: its model config (and here its tokenizer)."""
        model = {
            k: dataclasses.asdict(v) if k == "moe" else v for k, v in hf_config.nested(self.keys).items()
        }
        model["seq_len"] = hf_config.context(self.hf)  # the task's window: `window`, checked there
        tokenizer = fetch_tokenizer(self.url, self.flag) if self.url else find_tokenizer(self.directory)
        return {"config": {"model": model, "tokenizer": str(tokenizer or "")}}

    def window(self, wanted: int | None) -> int:
        """The window a task runs this model in: `wanted`, else its default; checked against its
        context and sliding window."""
        return hf_config.seq_len(self.hf, wanted, self.where)

    def _entries(self, target: Any) -> dict[tuple[str, ...], list[weights.Entry]]:
        """The HF tensors of each of target's params, checked: all there, shaped as they must be."""
        leaves = {path_names(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
        blocks = [k for k in leaves if k[0].startswith("block")]
        cfg = hf_config.model_config(self.keys, scan_layers=("blocks",) in {k[:1] for k in blocks})
        by_leaf: dict[tuple[str, ...], list[weights.Entry]] = {}
        for e in weights.entries(cfg):
            if e.name not in self.reader.names():
                raise UserError(f"{self.where} has no tensor {e.name}; its weights are incomplete")
            want = weights.hf_shape(e, leaves[e.path])
            if self.reader.shape(e.name) != want:
                raise UserError(
                    f"{self.where}: tensor {e.name} is {list(self.reader.shape(e.name))}, config.json "
                    f"says {list(want)}"
                )
            by_leaf.setdefault(e.path, []).append(e)
        missing = set(leaves) - set(by_leaf)
        if missing:
            raise UserError(f"{self.where} gives no value for param {'/'.join(sorted(missing)[0])}")
        return by_leaf

    def check_params(self, step: int, target: Any, flag: str) -> None:
        """Every param of target comes from a tensor of the dir, shaped right."""
        self._entries(target)

    def restore_params(self, step: int, target: Any, flag: str) -> Any:
        """target's params (abstract arrays with shardings) from the dir's tensors."""
        by_leaf = self._entries(target)

        def load(path: tuple, leaf: Any) -> jax.Array:
            host = np.empty(leaf.shape, np.float32)
            group = by_leaf[path_names(path)]
            # (from a bucket: the param's tensors read together, in ranged GETs in flight at once)
            for e, tensor in zip(group, self.reader.get_many([e.name for e in group]), strict=True):
                weights.put(e, host, tensor.astype(np.float32))
            return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: host[index])

        return jax.tree_util.tree_map_with_path(load, target)
