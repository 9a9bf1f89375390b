"""Object storage (gs://bucket/path, s3://bucket/path): the one way jaxtrain reaches a bucket.

Every object jaxtrain itself reads or writes (the run lock, the run dir's records, checkpoint
checksums, token shards) goes through fsspec's gcsfs and s3fs, the same filesystems orbax's
etils.epath paths use; checkpoint arrays go through tensorstore's own gcs and s3 drivers (orbax).
Credentials come from where each cloud's own SDK looks (application default credentials,
GOOGLE_APPLICATION_CREDENTIALS; the AWS variables, profiles, web-identity tokens) and are never
printed. The endpoint is each SDK's own override: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for S3
(and S3-compatible stores), STORAGE_EMULATOR_HOST for GCS; both are handed to tensorstore too.

    bucket.is_url("s3://b/run")           # True
    p = bucket.path("s3://b/run") / "x"     # an epath.Path (a pathlib.Path for a local path)
    bucket.check("s3://b/run", write=True)  # UserError in one line: no bucket, no credentials, ...
    bucket.create(p, b"...")                # False if it exists (If-None-Match / ifGenerationMatch=0)
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from jaxtrain.errors import UserError

log = logging.getLogger("jaxtrain")

SCHEMES = ("gs://", "s3://")
T = TypeVar("T")

# A transient failure (a 5xx, a timeout, a dropped connection) is retried this long, with backoff
# from RETRY_FIRST_S doubling to RETRY_MAX_S: long enough to ride out a store's restart.
RETRY_FOR_S = 120.0
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 8.0
# A batch's windows are ranged GETs in flight together, from every loader thread of a process, on
# one pool of connections. S3's client allows 10: at the tens of ms AWS gives as a small GET's
# median, ~300 GETs/s, what one process's 16 rows need at a 50 ms step with nothing to spare for
# slower answers or bigger batches; 64 (connections open only as needed; gcsfs's pool allows 100).
S3_CONNECTIONS = 64
# Ranges of one object at most MERGE_HOLE_BYTES apart are read by one GET of at most MERGE_MOST_BYTES,
# the hole read and dropped (Arrow's defaults for its merged reads): a few KiB cost far less than
# another request, and a long run of adjacent ranges (a safetensors file's tensors) stays many GETs
# in flight together rather than one long one. Adjacent windows overlap by a token, so a batch of
# consecutive windows (a small validation split) is one GET.
MERGE_HOLE_BYTES = 8 * 2**10
MERGE_MOST_BYTES = 32 * 2**20


def is_url(path: str | os.PathLike[str] | None) -> bool:
    """Whether `path` names an object in a bucket (gs:// or s3://)."""
    return str(path or "").startswith(SCHEMES)


def split(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of a gs:// or s3:// URL; UserError where the bucket is missing."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UserError(f"{url} names no bucket; write {scheme}://BUCKET/PATH")
    return scheme, bucket, key.strip("/")


def join(base: str, *parts: str) -> str:
    """`base`/`parts`, for a URL or a local path."""
    return "/".join([str(base).rstrip("/"), *parts]) if is_url(base) else str(Path(base, *parts))


def path(p: str | os.PathLike[str]) -> Any:
    """An etils.epath.Path for a URL (what orbax takes), an absolute pathlib.Path otherwise."""
    if is_url(p):
        from etils import epath

        _setup()
        return epath.Path(str(p).rstrip("/"))
    return Path(p).absolute()


@functools.cache
def _setup() -> None:
    """Hand the SDKs' endpoint overrides to tensorstore, and teach orbax 0.12 tensorstore's s3 driver
    (it knows gcs only: an s3:// checkpoint was refused as "not absolute")."""
    import fsspec.config

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", os.environ["STORAGE_EMULATOR_HOST"])
        # An emulator has no storage-control API: gcsfs's probe of a bucket's kind waited 60 s on it.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        # ...and no authentication: tensorstore, finding no credentials, asked a GCE metadata server.
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    # Listings are read fresh: processes on other hosts add and remove checkpoints meanwhile.
    for protocol in ("s3", "gs", "gcs"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)
    s3_config = fsspec.config.conf["s3"].setdefault("config_kwargs", {})
    s3_config.setdefault("max_pool_connections", S3_CONNECTIONS)
    from orbax.checkpoint._src.path import atomicity, atomicity_defaults, gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    for_gcs = gcs_utils.get_kvstore_for_gcs
    ts_utils._use_gcs_driver = lambda d: d.startswith(SCHEMES)
    ts_utils._normalize_path = lambda p: os.path.normpath(p).replace("gs:/", "gs://").replace("s3:/", "s3://")
    gcs_utils.get_kvstore_for_gcs = lambda p: s3_spec(p) if p.startswith("s3://") else for_gcs(p)
    # A checkpoint in a bucket is complete once its commit_success.txt is written (a bucket has no
    # atomic rename of a folder): orbax's rule for gs://, here for s3:// too.
    for name in ("get_default_temporary_path_class", "get_item_default_temporary_path_class"):
        default = getattr(atomicity_defaults, name)

        def pick(p: Any, *, atomicity_options: Any = None, _default: Any = default) -> Any:
            if str(p).startswith("s3://"):
                return atomicity.CommitFileTemporaryPath
            return _default(p, atomicity_options=atomicity_options)

        setattr(atomicity_defaults, name, pick)


def s3_spec(url: str) -> dict[str, Any]:
    """tensorstore's s3 kvstore for `url`, at the endpoint and region the AWS SDK would use."""
    _, bucket, key = split(url)
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key + "/" if key else ""}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        # The keys are in the environment: taken from there alone (tensorstore's default chain
        # logs an error for each place it looked in first, ~/.aws/config and the rest).
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def fs(url: str) -> Any:
    """The fsspec filesystem of `url`'s scheme (one per process, shared with etils.epath)."""
    import fsspec

    _setup()
    return fsspec.filesystem(url.partition("://")[0])


def _key(url: str) -> str:
    return url.partition("://")[2]


# ------------------------------------------------------------------------------------ errors


def _status(e: BaseException) -> int | None:
    """The HTTP status behind an SDK's exception, where it carries one."""
    for attr in ("code", "status", "status_code"):
        value = getattr(e, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status else None
    return None


def transient(e: BaseException) -> bool:
    """A failure worth another try: a 5xx or 429, a timeout, a refused or dropped connection."""
    seen: BaseException | None = e
    while seen is not None:
        status = _status(seen)
        if status is not None and (status >= 500 or status in (408, 429)):
            return True
        name = type(seen).__name__
        if isinstance(seen, (ConnectionError, TimeoutError)) or any(
            word in name for word in ("Connect", "Timeout", "ServerDisconnected", "EndpointConnection")
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def retry(what: str, fn: Callable[[], T], for_s: float = RETRY_FOR_S) -> T:
    """fn(), tried again with backoff while it fails transiently, for up to `for_s` seconds."""
    end, delay = time.monotonic() + for_s, RETRY_FIRST_S
    while True:
        try:
            return fn()
        except Exception as e:
            if not transient(e) or time.monotonic() + delay > end:
                raise
            log.warning(f"{what}: {type(e).__name__} (transient), trying again in {delay:.1f} s")
            time.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)


def reason(e: BaseException) -> str:
    """What a bucket's refusal means, in words (never the credentials themselves)."""
    text, name, status = str(e), type(e).__name__, _status(e)
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower() or "NoSuchBucket" in name:
        return "no such bucket"
    if "NoCredentials" in name or "credentials" in text.lower() and "could not" in text.lower():
        return "no credentials found (set the cloud SDK's variables or profile, or log in)"
    if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text or status == 401:
        return "the credentials were refused"
    if isinstance(e, PermissionError) or status == 403 or "AccessDenied" in text or "Forbidden" in text:
        return "access denied (read-only, or the credentials lack this bucket's permission)"
    if isinstance(e, FileNotFoundError) or status == 404:
        return "not found"
    return f"{name}: {text.splitlines()[0][:200] if text else ''}".rstrip(": ")


# -------------------------------------------------------------------------------- operations


def check(url: str, what: str, write: bool) -> None:
    """The bucket of `url` exists and answers with these credentials, and (write) takes an object
    (a probe, deleted at once): UserError in one line otherwise, before anything is written."""
    scheme, bucket, key = split(url)
    filesystem = fs(url)
    try:
        retry(f"reaching {scheme}://{bucket}", lambda: filesystem.ls(bucket, detail=False, refresh=True))
    except Exception as e:
        why = "no such bucket" if isinstance(e, FileNotFoundError) else reason(e)
        raise UserError(f"{what} {url}: {scheme}://{bucket} cannot be read: {why}") from None
    if write:
        probe = f"{bucket}/{key}/.jaxtrain-probe-{uuid.uuid4().hex[:12]}".replace("//", "/")
        try:
            retry(f"writing {scheme}://{bucket}", lambda: filesystem.pipe_file(probe, b""))
        except Exception as e:
            raise UserError(f"{what} {url} cannot be written: {reason(e)}; pass another one") from None
        try:
            filesystem.rm_file(probe)
        except Exception as e:  # the probe is harmless; the next run's check tries again
            log.warning(f"removing the probe {scheme}://{probe}: {reason(e)}")


def read(url: str) -> bytes | None:
    """The object's bytes, or None if there is none."""
    filesystem = fs(url)
    try:
        return retry(f"reading {url}", lambda: filesystem.cat_file(_key(url)))
    except FileNotFoundError:
        return None


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of the object (one ranged GET)."""
    filesystem = fs(url)
    return retry(f"reading {url}", lambda: filesystem.cat_file(_key(url), start=start, end=end))


def write(url: str, data: bytes) -> None:
    """Put the whole object (an object appears whole or not at all)."""
    filesystem = fs(url)
    retry(f"writing {url}", lambda: filesystem.pipe_file(_key(url), data))


def create(url: str, data: bytes) -> bool:
    """Put the object only if there is none (S3 If-None-Match: *, GCS ifGenerationMatch=0): True if
    this call created it, False if one was there."""
    filesystem = fs(url)
    try:
        retry(f"creating {url}", lambda: filesystem.pipe_file(_key(url), data, mode="create"))
    except FileExistsError:
        return False
    except Exception as e:
        if _status(e) == 412 or "PreconditionFailed" in str(e) or "conditionNotMet" in str(e):
            return False
        raise
    return True


def delete(url: str) -> None:
    """Remove the object; none there is not an error."""
    filesystem = fs(url)
    try:
        retry(f"deleting {url}", lambda: filesystem.rm_file(_key(url)))
    except FileNotFoundError:
        pass


def stat(url: str) -> tuple[int, float, str] | None:
    """(size, mtime in unix seconds, version tag) of the object, or None if there is none."""
    filesystem = fs(url)
    try:
        info = retry(f"reading {url}", lambda: filesystem.info(_key(url), refresh=True))
    except FileNotFoundError:
        return None
    return int(info.get("size") or 0), _mtime(info), _tag(info)


def listing(url: str) -> dict[str, tuple[int, float, str]]:
    """Every object under the prefix `url`: relative key -> (size, mtime, version tag)."""
    filesystem = fs(url)
    root = _key(url).rstrip("/")
    try:
        found = retry(f"listing {url}", lambda: filesystem.find(root, detail=True, refresh=True))
    except FileNotFoundError:
        return {}
    out = {}
    for name, info in found.items():
        if info.get("type") != "directory" and name.startswith(root + "/"):
            out[name[len(root) + 1 :]] = (int(info.get("size") or 0), _mtime(info), _tag(info))
    return out


def rmtree(url: str) -> None:
    """Remove every object under the prefix `url`."""
    filesystem = fs(url)
    for rel in listing(url):
        key = f"{_key(url).rstrip('/')}/{rel}"
        retry(f"deleting {url}/{rel}", lambda key=key: filesystem.rm_file(key))  # type: ignore[misc]
    filesystem.invalidate_cache()


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("LastModified") or info.get("updated") or info.get("mtime")
    if value is None:
        return 0.0
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        import datetime

        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return float(value.timestamp())


def _tag(info: dict[str, Any]) -> str:
    """What changes whenever the object's content does: its generation, CRC32C, MD5 or ETag."""
    for field in ("crc32c", "md5Hash", "ETag", "generation"):
        if info.get(field):
            return f"{field}:{str(info[field]).strip(chr(34))}"
    return ""


def merge(
    starts: list[int], ends: list[int], hole: int = MERGE_HOLE_BYTES, most: int = MERGE_MOST_BYTES
) -> tuple[list[int], list[int], list[int]]:
    """The GETs that read ranges [starts[i], ends[i]) of one object, ranges at most `hole` bytes
    apart (or overlapping) merged while a GET stays within `most` bytes: (the GETs' starts, their
    ends, the GET holding each range)."""
    lo: list[int] = []
    hi: list[int] = []
    which = [0] * len(starts)
    for i in sorted(range(len(starts)), key=starts.__getitem__):
        if lo and starts[i] <= hi[-1] + hole and max(hi[-1], ends[i]) - lo[-1] <= most:
            hi[-1] = max(hi[-1], ends[i])
        else:
            lo.append(starts[i])
            hi.append(ends[i])
        which[i] = len(lo) - 1
    return lo, hi, which


def read_ranges(url: str, starts: list[int], ends: list[int]) -> list[bytes]:
    """Bytes [starts[i], ends[i]) of the object: near ranges merged (merge), the ranged GETs in
    flight together."""
    filesystem, key = fs(url), _key(url)
    lo, hi, which = merge(starts, ends)
    # on_error="raise": fsspec's default returns a failed range's exception in place of its bytes,
    # which retry() would never see.
    got = retry(f"reading {url}", lambda: filesystem.cat_ranges([key] * len(lo), lo, hi, on_error="raise"))
    return [got[g][s - lo[g] : e - lo[g]] for g, s, e in zip(which, starts, ends, strict=True)]


def glob(pattern: str) -> list[str]:
    """The URLs of the objects matching `pattern` (gs://b/data/*.bin), sorted."""
    scheme = pattern.partition("://")[0]
    filesystem = fs(pattern)
    found = retry(f"listing {pattern}", lambda: filesystem.glob(_key(pattern)))
    return sorted(f"{scheme}://{k}" for k in found)


class ObjectStat(NamedTuple):
    st_size: int
    st_mtime_ns: int


class ObjectPath:
    """An object in a bucket with the few pathlib.Path methods the data readers use."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.url}/{name}")

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.url.rpartition("/")[0])

    @property
    def name(self) -> str:
        return self.url.rpartition("/")[2]

    def resolve(self) -> ObjectPath:
        return self

    def stat(self) -> ObjectStat:
        found = stat(self.url)
        if found is None:
            raise FileNotFoundError(self.url)
        return ObjectStat(found[0], int(found[1] * 1e9))

    def exists(self) -> bool:
        return stat(self.url) is not None

    is_file = exists  # an object is a file; a prefix is no object

    def read_text(self) -> str:
        data = read(self.url)
        if data is None:
            raise FileNotFoundError(self.url)
        return data.decode("utf-8")

    def read_range(self, start: int, end: int) -> bytes:
        return read_range(self.url, start, end)

    def tag(self) -> str:
        """What changes with the object's content (its checksum or version)."""
        found = stat(self.url)
        return found[2] if found else ""


def as_path(p: str | os.PathLike[str]) -> Any:
    """An ObjectPath for a URL, a pathlib.Path otherwise: what the data readers open."""
    return ObjectPath(str(p)) if is_url(p) else Path(p)
