"""scripts/prepare_data.py, --init_from hf:DIR and scripts/export_hf.py with buckets (prepare/inputs.py,
prepare/output.py, hf/store.py, disk/remote.py), against the real servers of tests/stores.py.

In-process, this process's environment pointed at the servers (as a user's would be at a store):
jsonl, parquet and text objects in S3 prepared into S3 give the bytes the same files on disk give,
and the data loader reads the set by its manifest alone (no shard scanned); a prepare that fails
midway leaves a fresh prefix empty and an earlier set as it was. A tiny model exported to GCS gives
the bytes an export to disk gives (sharded, with the index and the BPE tokenizer found beside the
run's data in the bucket), and read back as --init_from hf:gs://... gives every param exactly; an
export that fails midway puts nothing. A missing bucket as prepare's input or output or export's
--out is one line, exit 2, with nothing written.

    pytest tests/test_bucket_io.py     # about 25 s on 2 cores, most of it the servers' start
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from stores import BUCKET, client

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.config import load_config
from jaxtrain.data import sources
from jaxtrain.data.framing import model_tokenizer
from jaxtrain.errors import UserError
from jaxtrain.prepare import cli as prepare_cli
from jaxtrain.prepare.shards import prepare_corpus
from jaxtrain.tokenizer import BPETokenizer, ByteTokenizer

# The same xdist worker as tests/test_object_storage.py: one pair of servers for both files.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("object_storage")]


@pytest.fixture
def stores(s3, gcs, tmp_path, monkeypatch):
    """Both servers in this process's environment, with the settings bucket.fs's set-up would add
    (set here, so they leave with the test); fsspec's filesystems made afresh before and after."""
    env = {**s3, **gcs, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # (read at gcsfs's import)
    env["TENSORSTORE_GCS_HTTP_URL"] = gcs["STORAGE_EMULATOR_HOST"]
    env["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "emulator"
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # token scans, fetched tokenizers: this test's own
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import gcsfs
    import s3fs

    for fs in (s3fs.S3FileSystem, gcsfs.GCSFileSystem):
        fs.clear_instance_cache()
    yield {"s3": client("s3", s3), "gs": client("gs", gcs)}
    for fs in (s3fs.S3FileSystem, gcsfs.GCSFileSystem):
        fs.clear_instance_cache()


def _docs(n: int, tag: str) -> list[str]:
    return [f"{tag} document {i}: " + "ünï words " * (i % 7 + 1) for i in range(n)]


def _inputs(root: Path) -> list[str]:
    """jsonl, parquet (row groups of 40) and text inputs; every document, in the order read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "sub").mkdir(parents=True)
    code, web = _docs(120, "code"), _docs(200, "web")
    lines = [json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(code)]
    (root / "a.jsonl").write_text("".join(lines))
    pq.write_table(pa.table({"text": web}), root / "sub" / "b.parquet", row_group_size=40)
    (root / "sub" / "c.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(300)))
    (root / "notes.md").write_text("not matched by the glob\n")
    return [d + "\n\n" for d in code + web] + [(root / "sub" / "c.txt").read_text()]


def _tokens(manifest: str, split: str) -> np.ndarray:
    shards = sources.open_shards(manifest, split, 256, "auto", 8)
    return np.concatenate([np.asarray(sources.memmap(info)[:]) for info in shards.infos])


def _objects(fs, prefix: str) -> dict[str, bytes]:
    return {k.removeprefix(f"{BUCKET}/{prefix}/"): fs.cat_file(k) for k in fs.find(f"{BUCKET}/{prefix}")}


def test_prepare_from_and_to_s3_gives_the_files_disk_gives(stores, tmp_path):
    fs = stores["s3"]
    docs = _inputs(tmp_path / "in")
    fs.put(str(tmp_path / "in") + "/", f"{BUCKET}/prep/in/", recursive=True)
    flags = dict(val_fraction=0.05, shard_tokens=3000)
    local = prepare_corpus([tmp_path / "in"], tmp_path / "out", workers=1, **flags)
    url = f"s3://{BUCKET}/prep/out"
    # (--workers 2 gives the same bytes, as on disk; not here: its processes' start costs ~10 s)
    result = prepare_corpus([f"s3://{BUCKET}/prep/in"], url, workers=1, **flags)
    assert str(result.manifest_path) == f"{url}/manifest.json" and result.train_tokens == local.train_tokens
    on_disk = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    put = _objects(fs, "prep/out")
    assert put.keys() == on_disk.keys() and "train_00001.bin" in put
    for name in put.keys() - {"manifest.json"}:
        assert put[name] == on_disk[name], name
    manifest, want = json.loads(put["manifest.json"]), json.loads(on_disk["manifest.json"])
    assert manifest.pop("sources") != want.pop("sources") and manifest == want
    got = json.loads(put["manifest.json"])["sources"]
    names = ("a.jsonl", "sub/b.parquet", "sub/c.txt")  # sorted as on disk; notes.md not matched
    assert [s["path"] for s in got] == [f"s3://{BUCKET}/prep/in/{n}" for n in names]
    assert all(s["checksum"].startswith("ETag:") for s in got)  # the store's own: no second read

    # What training opens: every token, in order, from the manifest alone (its max_id trusted: the
    # shards are older than the manifest, so none is scanned).
    text = "".join(ByteTokenizer().decode(_tokens(f"{url}/manifest.json", s)) for s in ("train", "val"))
    assert text == "".join(docs)
    assert not (Path(os.environ["XDG_CACHE_HOME"]) / "jaxtrain" / "token_scans").exists()

    # A failure midway (a text object not in UTF-8, met after shards were put): over the set, it is
    # left as it was (the new one was put under a hidden prefix, now gone); into a new prefix, nothing.
    fs.pipe_file(f"{BUCKET}/prep/bad/latin1.txt", "caf\xe9\n".encode("latin-1"))
    bad = [f"s3://{BUCKET}/prep/in/a.jsonl", f"s3://{BUCKET}/prep/bad/latin1.txt"]
    for out, overwrite in ((url, True), (f"s3://{BUCKET}/prep/new", False)):
        with pytest.raises(UserError, match="latin1.txt is not UTF-8"):
            prepare_corpus(bad, out, workers=1, overwrite=overwrite, shard_tokens=1000)
    assert _objects(fs, "prep/out") == put and not fs.exists(f"{BUCKET}/prep/new")
    # A good one over it replaces the set: the earlier shards it does not rewrite are gone.
    again = prepare_corpus([f"s3://{BUCKET}/prep/in/a.jsonl"], url, workers=1, overwrite=True, **flags)
    splits = json.loads(fs.cat_file(f"{BUCKET}/prep/out/manifest.json"))["splits"]
    shards = {s["file"] for split in splits.values() for s in split["shards"]}
    assert set(_objects(fs, "prep/out")) == shards | {"manifest.json"} and len(shards) < len(put) - 1
    assert again.train_tokens < local.train_tokens


def _refused(main, argv: list[str], capsys, phrase: str) -> None:
    """The script's main as the script runs it: exit 2, one line naming `phrase`."""
    with pytest.raises(SystemExit) as exit:
        exit_on_user_error(main)(argv, "")
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and phrase in err, err


def test_a_missing_bucket_is_one_line_and_nothing_is_written(stores, tmp_path, capsys):
    from jaxtrain.hf import cli as hf_cli

    (tmp_path / "in.txt").write_text("some text\n" * 50)
    before = {scheme: set(fs.find(BUCKET)) for scheme, fs in stores.items()}
    _refused(
        prepare_cli.main, ["s3://no-such-bucket/in/*.jsonl", "--out_dir", str(tmp_path / "out")], capsys,
        "input s3://no-such-bucket/in/*.jsonl: s3://no-such-bucket cannot be read: no such bucket",
    )  # fmt: skip
    _refused(
        prepare_cli.main, [str(tmp_path / "in.txt"), "--out_dir", "gs://no-such-bucket/data"], capsys,
        "--out_dir gs://no-such-bucket/data: gs://no-such-bucket cannot be read: no such bucket",
    )  # fmt: skip
    _refused(
        prepare_cli.main, [f"s3://{BUCKET}/no/such/prefix", "--out_dir", str(tmp_path / "out")], capsys,
        f"input s3://{BUCKET}/no/such/prefix does not exist",
    )  # fmt: skip
    _refused(
        hf_cli.main, [str(tmp_path / "no_run"), "--out", "s3://no-such-bucket/hf"], capsys,
        "--out s3://no-such-bucket/hf: s3://no-such-bucket cannot be read: no such bucket",
    )  # fmt: skip
    assert not (tmp_path / "out").exists()
    assert {scheme: set(fs.find(BUCKET)) for scheme, fs in stores.items()} == before


@pytest.fixture
def checkpoint(tmp_path, stores):
    """A tiny Qwen3-like model (scanned layers, random params) saved as a checkpoint of ours, as
    if trained on data in the GCS bucket with a BPE tokenizer beside it; (its dir, its params)."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.config import ModelConfig, to_dict
    from jaxtrain.disk import checkpoint as ckpt_lib
    from jaxtrain.model.transformer import GPT

    tok = BPETokenizer.train(iter(["the quick brown fox jumps over the lazy dog\n" * 30]), 300)
    (tmp_path / "tok").mkdir()
    tok.save(tmp_path / "tok")
    for path in (tmp_path / "tok").iterdir():
        stores["gs"].put_file(str(path), f"{BUCKET}/hf_data/{path.name}")
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96,
        mlp="swiglu", tie_embeddings=False, qk_norm=True, scan_layers=True,
    )  # fmt: skip
    init = lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))  # noqa: E731
    abstract = jax.eval_shape(init)["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), abstract)
    ckpt = ckpt_lib.Checkpointer(tmp_path / "checkpoints", 1)
    saved = {"model": to_dict(cfg), "train_data_path": f"gs://{BUCKET}/hf_data/manifest.json"}
    ckpt.save(0, {"params": params}, {"config": saved})
    ckpt.wait()
    return tmp_path / "checkpoints", params


def test_export_to_gcs_and_init_from_it_give_back_every_param(stores, checkpoint, tmp_path, monkeypatch):
    import jax

    from jaxtrain.disk import remote
    from jaxtrain.hf import export as export_lib
    from jaxtrain.hf.config import with_hf_model
    from jaxtrain.hf.load import HFCheckpoint

    fs, (run, params) = stores["gs"], checkpoint
    local = export_lib.export(str(run), tmp_path / "hf", max_shard_bytes=60_000)
    url = f"gs://{BUCKET}/hf/tiny"
    result = export_lib.export(str(run), url, max_shard_bytes=60_000)
    assert result["out"] == url and result["tokenizer"].startswith("BPE") and len(result["files"]) > 2
    on_disk = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert _objects(fs, "hf/tiny") == on_disk  # every file byte for byte, the index and tokenizer too
    assert {"model.safetensors.index.json", "tokenizer.json", "config.json"} <= on_disk.keys()
    assert local["files"] == result["files"]

    # --init_from hf:gs://...: the model keys from its config.json, every param back exactly, each
    # tensor read by range (no local copy of the weights), the tokenizer copied into the cache.
    keys = with_hf_model({"init_from": f"hf:{url}"})
    assert (keys["model.d_model"], keys["model.n_kv_head"], keys["model.qk_norm"]) == (64, 2, True)
    source = HFCheckpoint(url, "--init_from")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), params)
    back = source.restore_params(0, target, "--init_from")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), back, params)
    tokenizer = Path(source.read_meta(0)["config"]["tokenizer"])
    assert tokenizer.read_bytes() == on_disk["tokenizer.json"]
    assert tokenizer.is_relative_to(os.environ["XDG_CACHE_HOME"])
    # train.py takes it (a bucket URL in init_from is read, not refused), and checks the data's
    # framing against the tokenizer beside its weights in the bucket
    cfg = load_config(["--config", "configs/tiny.yaml", "--init_from", f"hf:{url}"])
    assert model_tokenizer(cfg).to_json() == on_disk["tokenizer.json"].decode()

    # An export that fails midway (after some files were put) puts nothing.
    get, calls = export_lib._Leaves.get, []

    def failing(self, path):
        calls.append(path)
        if len(calls) == 3:
            raise RuntimeError("the checkpoint's disk failed")
        return get(self, path)

    put, puts = remote.Upload.put, []

    def counted(self, path):
        puts.append(path.name)
        return put(self, path)

    monkeypatch.setattr(export_lib._Leaves, "get", failing)
    monkeypatch.setattr(remote.Upload, "put", counted)
    with pytest.raises(RuntimeError, match="disk failed"):
        export_lib.export(str(run), f"gs://{BUCKET}/hf/failed", max_shard_bytes=20_000)
    assert puts and fs.find(f"{BUCKET}/hf/failed") == []
    with pytest.raises(UserError, match="config.json not found"):  # a prefix without config.json
        HFCheckpoint(f"gs://{BUCKET}/hf/failed", "--init_from")
