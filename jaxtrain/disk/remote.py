"""Hugging Face folders in buckets (gs://, s3://): their tokenizers read, whole folders written.
(Here, below prepare/, data/ and hf/, which all read a bucket's tokenizer.)

    local = fetch_tokenizer("gs://b/models/qwen3", "--init_from")   # tokenizer.json (+ companions)
    with Upload("s3://b/hf/tiny", "--out") as up:                    # in the local cache
        (up.folder / "model.safetensors").write_bytes(...)
        up.put(up.folder / "model.safetensors")                      # into the bucket, now
        up.commit()                                                  # the rest, config.json last

The safetensors of a folder in a bucket are read by range (store.py); its tokenizer files, a few
small objects that the tokenizers library opens by path, are copied into the local cache, keyed by
their URLs and the store's checksums (a changed tokenizer is copied again). An Upload writes a
folder complete-or-nothing: every file is staged in a local folder ($TMPDIR) and put as soon as it
is complete (a model's safetensors one at a time), config.json, which every reader opens first,
last. An earlier folder's config.json is removed before anything is put, and its files this one
does not replace (another count of safetensors shards) are removed before the new config.json lands;
a failure removes every object the upload put.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from jaxtrain.disk import bucket
from jaxtrain.disk.files import cache_root
from jaxtrain.tokenizer import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, TOKENIZER_FILE

CONFIG = "config.json"
# What a Hugging Face folder holds that an export writes (a stale one is removed): the weights and
# their index, the configs, the tokenizer files.
_FOLDER_FILES = (
    CONFIG, "generation_config.json", "model.safetensors.index.json", TOKENIZER_FILE, TOKENIZER_CONFIG,
    CHAT_TEMPLATE_FILE, "special_tokens_map.json",
)  # fmt: skip


def fetch_tokenizer(url: str, what: str) -> Path | None:
    """The tokenizer.json `url` names (the object, or the one in the prefix `url`) copied with the
    tokenizer files beside it (tokenizer_config.json, chat_template.jinja,
    additional_chat_templates/) into a folder of the local cache; None where there is none. A
    bucket that cannot be read is one line (UserError) naming `what`."""
    bucket.check(url, what, write=False)
    url = url.rstrip("/")
    folder, tokenizer = (url.rpartition("/")[0], url) if is_object(url) else (url, f"{url}/{TOKENIZER_FILE}")
    wanted = {TOKENIZER_FILE: tokenizer}
    wanted |= {name: f"{folder}/{name}" for name in (TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE)}
    templates = bucket.listing(f"{folder}/{CHAT_TEMPLATE_DIR}")
    wanted |= {f"{CHAT_TEMPLATE_DIR}/{rel}": f"{folder}/{CHAT_TEMPLATE_DIR}/{rel}" for rel in templates}
    tags = {name: found[2] for name, u in wanted.items() if (found := bucket.stat(u)) is not None}
    if TOKENIZER_FILE not in tags:
        return None
    key = hashlib.sha256(repr(sorted((name, wanted[name], tag) for name, tag in tags.items())).encode())
    present = {name: wanted[name] for name in tags}
    local = cache_root() / "bucket_tokenizers" / key.hexdigest()[:24]
    if not (local / TOKENIZER_FILE).is_file():
        local.parent.mkdir(parents=True, exist_ok=True)
        part = Path(tempfile.mkdtemp(prefix=f".{local.name}.", dir=local.parent))
        try:
            for name, object_url in present.items():
                data = bucket.read(object_url)
                if data is None:  # removed meanwhile
                    return None
                (part / name).parent.mkdir(parents=True, exist_ok=True)
                (part / name).write_bytes(data)
            with contextlib.suppress(OSError):  # another process put the same copy there first
                os.replace(part, local)
        finally:
            shutil.rmtree(part, ignore_errors=True)
    return local / TOKENIZER_FILE


def is_object(url: str) -> bool:
    """Whether `url` names an object (not a prefix, which a store may answer as a folder)."""
    fs = bucket.fs(url)
    try:
        info = bucket.retry(f"reading {url}", lambda: fs.info(url.partition("://")[2], refresh=True))
    except FileNotFoundError:
        return False
    return info.get("type") == "file"


class Upload:
    """A Hugging Face folder written into the prefix `url` complete-or-nothing (see the module's
    docstring). The bucket is checked (it exists, these credentials may write it) when made."""

    def __init__(self, url: str, what: str) -> None:
        bucket.check(url, what, write=True)
        self.url = url.rstrip("/")
        self.fs = bucket.fs(self.url)
        self.folder = Path()
        self.put_names: list[str] = []

    def __enter__(self) -> Upload:
        self.folder = Path(tempfile.mkdtemp(prefix="jaxtrain-export-"))
        # Until the new config.json lands, the prefix reads as incomplete, not as the earlier folder.
        bucket.delete(f"{self.url}/{CONFIG}")
        return self

    def put(self, path: Path) -> None:
        """A complete file of `folder` put into the bucket (and removed locally)."""
        rel = path.relative_to(self.folder).as_posix()
        key = f"{self.url}/{rel}".partition("://")[2]
        bucket.retry(f"writing {self.url}/{rel}", lambda: self.fs.put_file(str(path), key))
        self.put_names.append(rel)
        path.unlink()

    def commit(self) -> None:
        """Every file left in `folder`, an earlier folder's files this one does not replace removed,
        then config.json."""
        for path in sorted(p for p in self.folder.rglob("*") if p.is_file() and p.name != CONFIG):
            self.put(path)
        new = set(self.put_names)
        for rel in bucket.listing(self.url):
            earlier = (
                rel.endswith(".safetensors") and "/" not in rel
            ) or rel in _FOLDER_FILES or rel.startswith(f"{CHAT_TEMPLATE_DIR}/")  # fmt: skip
            if earlier and rel not in new and rel != CONFIG:
                bucket.delete(f"{self.url}/{rel}")
        self.put(self.folder / CONFIG)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        if kind is not None:
            for rel in self.put_names:
                bucket.delete(f"{self.url}/{rel}")
