"""Where scripts/prepare_data.py's files land, whole or not at all: a folder, or a prefix in a bucket.

    with staged(out_dir) as staging:                     # a Path, or a bucket.ObjectPath
        writer = SplitWriter(staging.folder, "train", ..., on_close=staging.closed)
        ...
        staging.commit(manifest)                         # manifest.json last

On disk the files are written into a hidden folder inside out_dir and moved into place at commit;
whatever a failure left is removed, and so are the folders made for it. For a bucket they are
written into a local folder ($TMPDIR), and each shard is put into the bucket as soon as it is
closed and removed locally (local disk holds about one shard at a time); at commit the rest (the
tokenizer) follows and manifest.json is put last, so a set without its manifest is incomplete,
as on disk. Where the prefix holds an earlier set the new one is put under a hidden prefix inside
it (.prepare.PID.HEX/) and copied over the earlier set (a copy inside the store) only at commit:
a prepare that fails leaves the earlier set as it was. A failure removes every object it put.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxtrain.disk import bucket
from jaxtrain.disk.files import write_text
from jaxtrain.text.format import MANIFEST, MANIFEST_FORMAT, MASK_SUFFIX
from jaxtrain.tokenizer import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, TOKENIZER_FILE


def is_output(name: str) -> bool:
    """Names this package writes into out_dir (so they are never inputs, and stale ones are removed)."""
    stem = name.removesuffix(".bin").removesuffix(MASK_SUFFIX)
    tokenizer = (TOKENIZER_FILE, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR)
    return name in (MANIFEST, *tokenizer) or (
        name.endswith((".bin", MASK_SUFFIX))
        and (stem in ("train", "val") or stem.split("_")[0] in ("train", "val"))
    )


def manifest_text(manifest: dict[str, Any]) -> str:
    """manifest.json's text, its format and version first."""
    return json.dumps({"format": MANIFEST_FORMAT, "version": 1} | manifest, indent=1) + "\n"


class Staging:
    """A set being written: its files go into `folder`; `closed` is told each one complete."""

    folder: Path

    def closed(self, names: list[str]) -> None:
        """Files of `folder` are complete (a shard and its mask)."""

    def commit(self, manifest: dict[str, Any]) -> None:
        raise NotImplementedError


class _OnDisk(Staging):
    def __init__(self, folder: Path, out_dir: Path) -> None:
        self.folder, self.out_dir = folder, out_dir

    def commit(self, manifest: dict[str, Any]) -> None:
        commit_outputs(self.folder, self.out_dir, manifest)


@contextlib.contextmanager
def staged(out_dir: Path | bucket.ObjectPath) -> Iterator[Staging]:
    """A Staging to write a set into, whole or not at all (see the module's docstring)."""
    if isinstance(out_dir, bucket.ObjectPath):
        with _in_bucket(out_dir.url) as staging:
            yield staging
        return
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # innermost first
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = out_dir / f".prepare.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    done = False
    try:
        yield _OnDisk(folder, out_dir)
        done = True
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        for made_dir in made if not done else []:
            try:
                made_dir.rmdir()  # only an empty one: never what anyone else put there meanwhile
            except OSError:
                break


def commit_outputs(staging: Path, out_dir: Path, manifest: dict[str, Any]) -> None:
    """Move the staged files into out_dir, dropping an earlier run's; the manifest (its format
    and version put first) lands last."""
    with contextlib.suppress(FileNotFoundError):
        (out_dir / MANIFEST).unlink()  # from here until the new one lands, the set reads as incomplete
    new = {p.name for p in staging.iterdir()}
    for old in out_dir.iterdir():
        if old.is_dir() and old.name == CHAT_TEMPLATE_DIR:  # a folder is replaced whole
            shutil.rmtree(old)
        elif old.is_file() and is_output(old.name) and old.name not in new:
            old.unlink()
    for path in staging.rglob("*"):  # on disk before the manifest says the set is whole
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for name in sorted(new):
        os.replace(staging / name, out_dir / name)
    write_text(out_dir / MANIFEST, manifest_text(manifest))


# ---------------------------------------------------------------- a prefix in a bucket


class _InBucket(Staging):
    """Files written locally, put into the bucket as each is complete (see the module's docstring)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs = bucket.fs(self.url)
        earlier = self._outputs()
        hidden = f"{self.url}/.prepare.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.target = hidden if earlier else self.url  # where the objects go until commit
        self.put: list[str] = []  # the relative names put under target
        self.folder = Path(tempfile.mkdtemp(prefix="jaxtrain-prepare-"))

    def _outputs(self) -> dict[str, str]:
        """What out_dir holds that this package writes: top-level name -> "file" | "directory"."""
        key = self.url.partition("://")[2]
        try:
            found = bucket.retry(f"listing {self.url}", lambda: self.fs.ls(key, detail=True, refresh=True))
        except FileNotFoundError:
            return {}
        out = {}
        for info in found:
            name = str(info["name"]).rstrip("/").rpartition("/")[2]
            if is_output(name):
                out[name] = str(info.get("type", "file"))
        return out

    def _put(self, path: Path) -> None:
        rel = path.relative_to(self.folder).as_posix()
        url = f"{self.target}/{rel}"
        bucket.retry(f"writing {url}", lambda: self.fs.put_file(str(path), url.partition("://")[2]))
        self.put.append(rel)
        path.unlink()

    def closed(self, names: list[str]) -> None:
        for name in names:
            self._put(self.folder / name)

    def commit(self, manifest: dict[str, Any]) -> None:
        for path in sorted(p for p in self.folder.rglob("*") if p.is_file()):
            self._put(path)
        if self.target != self.url:  # over an earlier set: its manifest first, then its files
            bucket.delete(f"{self.url}/{MANIFEST}")
            new = {rel.partition("/")[0] for rel in self.put}
            for name, kind in self._outputs().items():
                if kind == "directory" and name == CHAT_TEMPLATE_DIR:  # a folder is replaced whole
                    bucket.rmtree(f"{self.url}/{name}")
                elif kind == "file" and name not in new:
                    bucket.delete(f"{self.url}/{name}")
            for rel in self.put:
                self._copy(rel)
        bucket.write(f"{self.url}/{MANIFEST}", manifest_text(manifest).encode())

    def _copy(self, rel: str) -> None:
        """target/rel copied to out_dir/rel (inside the store: nothing comes through this host)."""
        src, dst = (f"{base}/{rel}".partition("://")[2] for base in (self.target, self.url))
        bucket.retry(f"copying {self.target}/{rel}", lambda: self.fs.copy(src, dst))

    def remove(self, committed: bool) -> None:
        """What is left: the local folder, the hidden prefix, and (a failure's) every object put."""
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.target != self.url:
            bucket.rmtree(self.target)
        elif not committed:
            for rel in self.put:
                bucket.delete(f"{self.url}/{rel}")


@contextlib.contextmanager
def _in_bucket(url: str) -> Iterator[Staging]:
    staging = _InBucket(url)
    committed = False
    try:
        yield staging
        committed = True
    finally:
        staging.remove(committed)
