"""safetensors files, read and written here without holding a model in memory.

The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets; "__metadata__"), then the raw tensors. Reading memory-maps each tensor; writing lays out
every file's header first, then each tensor is written at its offset as soon as it is ready, so
a writer needs memory for one tensor at a time, in any order.

A model dir in a bucket (gs://, s3://) is read by range: each file's header (its length, then the
header), then each tensor's bytes when asked for, a param's tensors in flight together; nothing is
downloaded whole, and nothing is written to local disk.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxtrain.disk import bucket
from jaxtrain.errors import UserError

_DTYPES: dict[str, Any] = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
INDEX = "model.safetensors.index.json"


# A param's tensors in a bucket are read together in ranged GETs of at most this many bytes in all.
READ_BYTES = 2**30


class Reader:
    """Every tensor of a model dir's *.safetensors files (one, or shards with or without an index);
    the dir may be a gs:// or s3:// URL."""

    def __init__(self, directory: Path | str) -> None:
        remote = bucket.is_url(str(directory))
        files: list[Path | str] = []
        if remote:
            files += bucket.glob(bucket.join(str(directory), "*.safetensors"))
        else:
            files += sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise UserError(f"{directory} holds no *.safetensors file; hf:DIR needs the model's weights")
        self.where: dict[str, tuple[Path | str, dict[str, Any], int]] = {}
        for path in files:
            try:
                n, header = _header(path)
            except (OSError, ValueError, struct.error) as e:
                raise UserError(f"{path} is not a readable safetensors file ({type(e).__name__})") from None
            for name, info in header.items():
                if name != "__metadata__":
                    self.where[name] = (path, info, 8 + n)

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def _dtype(self, name: str) -> Any:
        path, info, _ = self.where[name]
        if info["dtype"] not in _DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {info['dtype']}, not a float type")
        return _DTYPES[info["dtype"]]

    def get(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype: memory-mapped (read when touched), or read from the bucket."""
        path, info, start = self.where[name]
        dtype, (begin, end), shape = self._dtype(name), info["data_offsets"], tuple(info["shape"])
        if isinstance(path, str):
            return _from_bytes(bucket.read_range(path, start + begin, start + end), dtype, shape)
        return np.memmap(path, dtype, mode="r", offset=start + begin, shape=shape)

    def get_many(self, names: list[str]) -> Iterator[np.ndarray]:
        """Each tensor of `names` in order, as `get` gives it; from a bucket, read in groups of up to
        READ_BYTES whose ranged GETs are in flight together (a scanned param's every layer)."""
        group: list[str] = []
        size = 0
        for name in names:
            if not isinstance(self.where[name][0], str):
                yield self.get(name)
                continue
            begin, end = self.where[name][1]["data_offsets"]
            if group and size + end - begin > READ_BYTES:
                yield from self._read_group(group)
                group, size = [], 0
            group.append(name)
            size += end - begin
        yield from self._read_group(group)

    def _read_group(self, names: list[str]) -> Iterator[np.ndarray]:
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(str(self.where[name][0]), []).append(name)
        got: dict[str, bytes] = {}
        for url, group in by_file.items():
            starts = [self.where[n][2] + self.where[n][1]["data_offsets"][0] for n in group]
            ends = [self.where[n][2] + self.where[n][1]["data_offsets"][1] for n in group]
            got |= dict(zip(group, bucket.read_ranges(url, starts, ends), strict=True))
        for name in names:
            yield _from_bytes(got.pop(name), self._dtype(name), tuple(self.where[name][1]["shape"]))


def _header(path: Path | str) -> tuple[int, dict[str, Any]]:
    """(length, header) of a safetensors file or object."""
    if isinstance(path, str):
        (n,) = struct.unpack("<Q", bucket.read_range(path, 0, 8))
        return n, json.loads(bucket.read_range(path, 8, 8 + n))
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _from_bytes(data: bytes, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor read from a bucket (read-only: its bytes are the buffer)."""
    if len(data) != int(np.prod(shape)) * np.dtype(dtype).itemsize:
        raise UserError(f"a tensor read {len(data)} bytes, not the {shape} its safetensors header says")
    return np.frombuffer(data, dtype).reshape(shape)


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
        self.left = {path: len(group) for path, group in zip(self.files, groups, strict=True)}
        if len(groups) > 1:
            total = sum(int(np.prod(s)) for s in shapes.values()) * self.dtype.itemsize
            weight_map = {name: self.slots[name][0].name for name in shapes}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def write(self, name: str, tensor: np.ndarray) -> Path | None:
        """Write the tensor into its place; the file it completes (its every tensor written), if any."""
        path, offset, shape = self.slots[name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tensor.shape}, planned {shape}")
        with open(path, "r+b") as f:
            f.seek(offset)
            # A view of the array's own buffer: tobytes() would hold a second copy of the tensor.
            f.write(np.ascontiguousarray(tensor, dtype=self.dtype).reshape(-1).view(np.uint8).data)
        if name in self.written:  # written again: its file was complete already
            return None
        self.written.add(name)
        self.left[path] -= 1
        return path if self.left[path] == 0 else None

    def close(self) -> None:
        missing = set(self.slots) - self.written
        if missing:
            raise ValueError(f"tensors never written: {sorted(missing)[:3]}")
