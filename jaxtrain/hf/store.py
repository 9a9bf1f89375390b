"""safetensors files, read and written here without holding a model in memory.

The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets; "__metadata__"), then the raw tensors. Reading memory-maps each tensor; writing lays out
every file's header first, then each tensor is written at its offset as soon as it is ready, so
a writer needs memory for one tensor at a time, in any order.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxtrain.errors import UserError

_DTYPES: dict[str, Any] = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
INDEX = "model.safetensors.index.json"


class Reader:
    """Every tensor of a model dir's *.safetensors files (one, or shards with or without an index)."""

    def __init__(self, directory: Path) -> None:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise UserError(f"{directory} holds no *.safetensors file; hf:DIR needs the model's weights")
        self.where: dict[str, tuple[Path, dict[str, Any], int]] = {}
        for path in files:
            try:
                with open(path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(n))
            except (OSError, ValueError, struct.error) as e:
                raise UserError(f"{path} is not a readable safetensors file ({type(e).__name__})") from None
            for name, info in header.items():
                if name != "__metadata__":
                    self.where[name] = (path, info, 8 + n)

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor, memory-mapped (read when touched), in its stored dtype."""
        path, info, start = self.where[name]
        if info["dtype"] not in _DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {info['dtype']}, not a float type")
        begin, _ = info["data_offsets"]
        shape = tuple(info["shape"])
        return np.memmap(path, _DTYPES[info["dtype"]], mode="r", offset=start + begin, shape=shape)


def plan(shapes: dict[str, tuple[int, ...]], dtype: Any, max_shard_bytes: int) -> list[list[str]]:
    """Tensor names split into files of at most max_shard_bytes (a larger tensor gets its own)."""
    files: list[list[str]] = [[]]
    size = 0
    itemsize = np.dtype(dtype).itemsize
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * itemsize
        if files[-1] and size + n > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


class Writer:
    """Files laid out by `plan`, written tensor by tensor in any order; `close` checks all came."""

    def __init__(self, out: Path, shapes: dict[str, tuple[int, ...]], dtype: Any, max_shard_bytes: int):
        self.dtype = np.dtype(dtype)
        groups = plan(shapes, dtype, max_shard_bytes)
        names = (
            ["model.safetensors"]
            if len(groups) == 1
            else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        )
        self.slots: dict[str, tuple[Path, int, tuple[int, ...]]] = {}
        self.files = [out / n for n in names]
        for path, group in zip(self.files, groups, strict=True):
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in group:
                n = int(np.prod(shapes[name])) * self.dtype.itemsize
                header[name] = {
                    "dtype": _NAMES[self.dtype],
                    "shape": list(shapes[name]),
                    "data_offsets": [offset, offset + n],
                }
                offset += n
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # tensors start 8-byte aligned
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text)
                f.truncate(8 + len(text) + offset)
            for name in group:
                self.slots[name] = (path, 8 + len(text) + header[name]["data_offsets"][0], shapes[name])
        self.written: set[str] = set()
        if len(groups) > 1:
            total = sum(int(np.prod(s)) for s in shapes.values()) * self.dtype.itemsize
            weight_map = {name: self.slots[name][0].name for name in shapes}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def write(self, name: str, tensor: np.ndarray) -> None:
        path, offset, shape = self.slots[name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tensor.shape}, planned {shape}")
        with open(path, "r+b") as f:
            f.seek(offset)
            # A view of the array's own buffer: tobytes() would hold a second copy of the tensor.
            f.write(np.ascontiguousarray(tensor, dtype=self.dtype).reshape(-1).view(np.uint8).data)
        self.written.add(name)

    def close(self) -> None:
        missing = set(self.slots) - self.written
        if missing:
            raise ValueError(f"tensors never written: {sorted(missing)[:3]}")
