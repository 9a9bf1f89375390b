"""Token files, the global batch order, the grain loaders, the default dataset and prepare_data.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.errors import UserError
from jaxtrain.tokenizer import ByteTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SEQ, BATCH = 8, 8


def _raw(path: Path, tokens: np.ndarray, dtype: str) -> Path:
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def _llmc(path: Path, tokens: np.ndarray, version: int, count: int | None = None) -> Path:
    header = np.zeros(data.HEADER_INTS, dtype="<i4")
    header[:3] = data.HEADER_MAGIC, version, len(tokens) if count is None else count
    body = np.asarray(tokens, dtype="<u2" if version == 1 else "<u4")
    path.write_bytes(header.tobytes() + body.tobytes())
    return path


@pytest.fixture
def tokens(tmp_path: Path) -> np.ndarray:
    """1001 tokens: 125 windows of SEQ, so epochs wrap within a few dozen steps."""
    return data.open_tokens(_raw(tmp_path / "t.bin", np.arange(1001) % 251, "uint16"), 256)


# ---------------------------------------------------------------- token files


def test_raw_uint16_round_trip(tmp_path: Path) -> None:
    want = np.random.default_rng(0).integers(0, 50257, 5000)
    got = data.open_tokens(_raw(tmp_path / "a.bin", want, "uint16"), 50257)
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)


def test_raw_uint32_by_vocab_size_and_by_flag(tmp_path: Path) -> None:
    want = np.random.default_rng(0).integers(0, 100_000, 5000)
    path = _raw(tmp_path / "a.bin", want, "uint32")
    np.testing.assert_array_equal(data.open_tokens(path, 100_000), want)  # auto: vocab > 65536
    small = want % 1000
    path = _raw(tmp_path / "b.bin", small, "uint32")
    got = data.open_tokens(path, 1000, token_dtype="uint32")
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, small)


@pytest.mark.parametrize("version,dtype", [(1, np.uint16), (2, np.uint32)])
def test_llmc_header_round_trip(tmp_path: Path, version: int, dtype: type) -> None:
    want = np.random.default_rng(1).integers(0, 50257, 3000)
    got = data.open_tokens(_llmc(tmp_path / "h.bin", want, version), 50257)
    assert got.dtype == dtype and len(got) == 3000
    np.testing.assert_array_equal(got, want)


def test_header_overrides_vocab_based_dtype_guess(tmp_path: Path) -> None:
    # vocab 100k would guess uint32 for a raw file; the header's version 1 says uint16.
    got = data.open_tokens(_llmc(tmp_path / "h.bin", np.arange(100), 1), 100_000)
    assert got.dtype == np.uint16 and len(got) == 100


def _error(path: Path, vocab: int = 256, **kw: object) -> str:
    with pytest.raises(UserError) as e:
        data.open_tokens(path, vocab, **kw)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_bad_token_files_fail_with_one_line(tmp_path: Path) -> None:
    assert "does not exist" in _error(tmp_path / "missing.bin")
    assert "not a file" in _error(tmp_path)
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "empty" in _error(tmp_path / "empty.bin")
    msg = _error(_raw(tmp_path / "short.bin", np.arange(10), "uint16"), min_tokens=SEQ * 4 + 1)
    assert "holds 10 tokens" in msg and "33" in msg and "--model.seq_len" in msg
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    msg = _error(tmp_path / "odd.bin")
    assert "not a multiple of 2" in msg and "--token_dtype uint32" not in msg
    (tmp_path / "odd4.bin").write_bytes(bytes(6))
    assert "--token_dtype uint16" in _error(tmp_path / "odd4.bin", token_dtype="uint32")


def test_token_id_beyond_vocab_names_id_and_fix(tmp_path: Path) -> None:
    ids = np.zeros(1000, dtype=np.uint16)
    ids[777] = 300
    msg = _error(_raw(tmp_path / "v.bin", ids, "uint16"), 256)
    assert "token id 300 at position 777" in msg and "vocab_size is 256" in msg
    assert "--model.vocab_size to at least 301" in msg and "--token_dtype" in msg


def test_id_check_scans_every_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "_CHECK_CHUNK", 64)  # many chunks; the bad id is in the last one
    ids = np.zeros(1000, dtype=np.uint16)
    ids[-1] = 256
    assert "position 999" in _error(_raw(tmp_path / "v.bin", ids, "uint16"), 256)


def test_nanogpt_uint16_file_misread_as_uint32_is_caught(tmp_path: Path) -> None:
    # An even count of uint16 ids read as uint32 gives huge ids: the error points at --token_dtype.
    path = _raw(tmp_path / "g.bin", np.full(1000, 5000), "uint16")
    assert "--token_dtype" in _error(path, 100_000)


def test_header_errors(tmp_path: Path) -> None:
    assert "header says 999 tokens but the file holds 500" in _error(
        _llmc(tmp_path / "c.bin", np.arange(500), 1, count=999)
    )
    assert "version 7" in _error(_llmc(tmp_path / "v.bin", np.arange(500), 7))
    assert "--token_dtype auto" in _error(_llmc(tmp_path / "d.bin", np.arange(500), 1), token_dtype="uint32")


# ---------------------------------------------------------------- batch order


def test_permutation_is_a_bijection_for_any_size() -> None:
    for n in (1, 2, 3, 7, 64, 65, 1000, 4099):
        for epoch in (0, 1):
            perm = data._permute(np.arange(n), n, seed=3, epoch=epoch)
            np.testing.assert_array_equal(np.sort(perm), np.arange(n))
    a, b = data._permute(np.arange(1000), 1000, 0, 0), data._permute(np.arange(1000), 1000, 0, 1)
    assert (a != np.arange(1000)).mean() > 0.9 and (a != b).mean() > 0.9


def test_batch_rows_are_window_starts_and_cover_an_epoch() -> None:
    n_tokens, n = 1001, 125
    steps = n // BATCH + 1
    starts = np.concatenate([data.global_batch_rows(n_tokens, SEQ, BATCH, 0, s) for s in range(steps)])
    assert starts.dtype == np.int64 and (starts % SEQ == 0).all()
    assert (starts + SEQ + 1 <= n_tokens).all()
    np.testing.assert_array_equal(np.sort(starts[:n]), np.arange(n) * SEQ)  # each window once per epoch


def test_loaders_agree_across_process_counts(tokens: np.ndarray) -> None:
    total = 20
    for p_count in (1, 2, 4):
        loaders = [
            data.train_loader(tokens, SEQ, BATCH, 5, 0, total, p, p_count, num_threads=2, prefetch=2)
            for p in range(p_count)
        ]
        per_process = [list(it) for it in loaders]
        assert all(len(b) == total for b in per_process)
        for step in range(total):
            local = [batches[step] for batches in per_process]
            assert all(b.shape == (BATCH // p_count, SEQ + 1) and b.dtype == np.int32 for b in local)
            want = data.load_rows(tokens, data.global_batch_rows(len(tokens), SEQ, BATCH, 5, step), SEQ)
            np.testing.assert_array_equal(np.concatenate(local), want)


def test_batch_rows_are_consecutive_tokens(tokens: np.ndarray) -> None:
    batch = data.load_rows(tokens, data.global_batch_rows(len(tokens), SEQ, BATCH, 0, 3), SEQ)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    np.testing.assert_array_equal(targets, (inputs + 1) % 251)  # the fixture's tokens count up


def test_resume_yields_the_same_batches(tokens: np.ndarray) -> None:
    full = list(data.train_loader(tokens, SEQ, BATCH, 1, 0, 30, 1, 2, 2, 2))
    resumed = list(data.train_loader(tokens, SEQ, BATCH, 1, 17, 30, 1, 2, 2, 2))
    assert len(resumed) == 13
    for a, b in zip(full[17:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert list(data.train_loader(tokens, SEQ, BATCH, 1, 30, 30, 0, 1, 2, 2)) == []


def test_seeds_differ_and_epochs_wrap(tokens: np.ndarray) -> None:
    a = data.global_batch_rows(len(tokens), SEQ, BATCH, 0, 0)
    b = data.global_batch_rows(len(tokens), SEQ, BATCH, 1, 0)
    assert not np.array_equal(a, b)
    # 125 windows, 8 rows a step: step 15 holds rows 120..127, across the epoch 0/1 boundary.
    n = 125
    rows = np.concatenate([data.global_batch_rows(len(tokens), SEQ, BATCH, 0, s) for s in range(40)])
    epoch0, epoch1 = rows[:n], rows[n : 2 * n]
    np.testing.assert_array_equal(np.sort(epoch0), np.sort(epoch1))  # each epoch sees every window
    assert not np.array_equal(epoch0, epoch1)  # in a fresh order
    # A batch bigger than the data wraps several epochs within one step.
    big = data.global_batch_rows(len(tokens), SEQ, 300, 0, 0)
    assert len(big) == 300 and set(big.tolist()) == set(range(0, n * SEQ, SEQ))


def test_loader_arguments_are_checked(tokens: np.ndarray) -> None:
    with pytest.raises(UserError, match="not divisible by 3 processes"):
        data.train_loader(tokens, SEQ, BATCH, 0, 0, 10, 0, 3, 1, 1)
    with pytest.raises(UserError, match="seq_len"):
        data.train_loader(tokens, 5000, BATCH, 0, 0, 10, 0, 1, 1, 1)


def test_eval_batches_are_fixed_and_topology_free(tokens: np.ndarray) -> None:
    one = data.eval_batches(tokens, SEQ, BATCH, 3, 0, 1)
    assert len(one) == 3 and all(b.shape == (BATCH, SEQ + 1) and b.dtype == np.int32 for b in one)
    for b in range(3):
        split = [data.eval_batches(tokens, SEQ, BATCH, 3, p, 4)[b] for p in range(4)]
        np.testing.assert_array_equal(np.concatenate(split), one[b])
    again = data.eval_batches(tokens, SEQ, BATCH, 3, 0, 1)
    assert all(np.array_equal(x, y) for x, y in zip(one, again, strict=True))
    starts = np.concatenate(one)[:, 0]
    assert len(set(starts.tolist())) == 3 * BATCH  # distinct windows when the file has enough


def test_loader_throughput_sanity(tokens: np.ndarray) -> None:
    big = np.tile(np.asarray(tokens), 200)  # ~200k tokens
    t = time.perf_counter()
    n = sum(1 for _ in data.train_loader(big, 256, 64, 0, 0, 50, 0, 1, 2, 4))
    rate = n * 64 * 256 / (time.perf_counter() - t)
    print(f"loader: {rate / 1e6:.1f} M tokens/s")


# ---------------------------------------------------------------- default dataset


def test_default_dataset_builds_once(tmp_path: Path) -> None:
    train, val = data.default_dataset(tmp_path, max_bytes=2**20)
    assert train.is_file() and val.is_file() and train.parent.is_relative_to(tmp_path)
    mtime = train.stat().st_mtime_ns
    tr = data.open_tokens(train, 256, min_tokens=1025)
    va = data.open_tokens(val, 256, min_tokens=257)
    assert tr.dtype == np.uint16 and int(tr.max()) < 256 and 900_000 < len(tr) + len(va) <= 2**20
    assert 0.005 < len(va) / (len(tr) + len(va)) < 0.02
    assert b"def " in ByteTokenizer().decode(tr[:20000]).encode()
    assert not [p for p in train.parent.iterdir() if p.name.endswith(".tmp")]
    time.sleep(0.01)
    assert data.default_dataset(tmp_path, max_bytes=2**20) == (train, val)
    assert train.stat().st_mtime_ns == mtime  # cached, not rebuilt
    # Deterministic: a fresh build elsewhere gives the same bytes.
    train2, _ = data.default_dataset(tmp_path / "again", max_bytes=2**20)
    assert train2.read_bytes() == train.read_bytes()


# ---------------------------------------------------------------- prepare_data.py


def _prepare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_data.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _corpus(root: Path) -> str:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("First file.\nÜnïcödé line ✓\n")
    (root / "sub" / "b.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(300)))
    (root / "skip.md").write_text("not matched by the glob\n")
    return (root / "a.txt").read_text() + (root / "sub" / "b.txt").read_text()


def test_prepare_data_byte_round_trip(tmp_path: Path) -> None:
    text = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    r = _prepare(str(tmp_path / "in"), "--out_dir", str(out), "--val_fraction", "0.1")
    assert r.returncode == 0, r.stderr
    assert f"--train_data_path {out / 'train.bin'}" in r.stdout and "--model.vocab_size 256" in r.stdout
    train = data.open_tokens(out / "train.bin", 256)
    val = data.open_tokens(out / "val.bin", 256)
    assert train.dtype == np.uint16
    assert 0.08 < len(val) / (len(train) + len(val)) < 0.12
    tok = load_tokenizer(out / "train.bin")
    assert isinstance(tok, ByteTokenizer)
    assert tok.decode(train) + tok.decode(val) == text
    assert tok.decode(train).endswith("\n")  # cut at a line end
    assert f"{len(train):,} tokens" in r.stdout


def test_prepare_data_bad_input_exits_2_with_one_line(tmp_path: Path) -> None:
    _corpus(tmp_path / "in")
    cases = [
        ([str(tmp_path / "nope")], "does not exist"),
        ([str(tmp_path / "in"), "--glob", "*.rst"], "no files matching '*.rst'"),
    ]
    for args, want in cases:
        r = _prepare(*args, "--out_dir", str(tmp_path / "out"))
        assert r.returncode == 2 and want in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    r = _prepare(str(tmp_path / "empty"), "--out_dir", str(tmp_path / "out"))
    assert r.returncode == 2 and "empty" in r.stderr
    assert not (tmp_path / "out" / "train.bin").exists()
    assert not list((tmp_path / "out").glob("*.tmp")) if (tmp_path / "out").exists() else True
    ok = _prepare(str(tmp_path / "in"), "--out_dir", str(tmp_path / "out"))
    assert ok.returncode == 0
    r = _prepare(str(tmp_path / "in"), "--out_dir", str(tmp_path / "out"))
    assert r.returncode == 2 and "--overwrite" in r.stderr and "Traceback" not in r.stderr
    assert _prepare(str(tmp_path / "in"), "--out_dir", str(tmp_path / "out"), "--overwrite").returncode == 0


def test_prepare_data_bpe_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from jaxtrain.corpus import prepare_corpus
    from jaxtrain.tokenizer import BPETokenizer

    text = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    result = prepare_corpus([tmp_path / "in"], out, tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    assert result.tokenizer_path == out / "tokenizer.json" and 256 < result.vocab_size <= 300
    train = data.open_tokens(out / "train.bin", result.vocab_size)
    val = data.open_tokens(out / "val.bin", result.vocab_size)
    assert len(train) + len(val) < len(text.encode())  # merges compress
    tok = load_tokenizer(out / "train.bin")
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == result.vocab_size
    assert tok.decode(train) + tok.decode(val) == text


def test_bpe_without_tokenizers_package_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxtrain.corpus import prepare_corpus

    _corpus(tmp_path / "in")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(UserError, match=r"pip install -e '.\[bpe\]'"):
        prepare_corpus([tmp_path / "in"], tmp_path / "out", tokenizer="bpe", vocab_size=300)
    with pytest.raises(UserError, match="needs --tokenizer bpe"):
        prepare_corpus([tmp_path / "in"], tmp_path / "out", vocab_size=1000)
    assert not (tmp_path / "out" / "train.bin").exists()


def test_text_chunks_never_cut_a_character(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxtrain import corpus

    monkeypatch.setattr(corpus, "_READ_CHUNK", 7)  # tiny reads: lines longer than a read
    text = "ab✓ü" * 50 + "\nshort\n" + "é" * 41
    (tmp_path / "t.txt").write_text(text)
    chunks = list(corpus._line_chunks([tmp_path / "t.txt"]))
    assert len(chunks) > 10 and b"".join(chunks) == text.encode()
    assert "".join(c.decode("utf-8") for c in chunks) == text  # every chunk is whole characters
    for split_at in (1, 5, 100, 203, 250):
        parts = list(corpus._split_chunks(chunks, split_at))
        train = b"".join(c for is_val, c in parts if not is_val)
        val = b"".join(c for is_val, c in parts if is_val)
        assert train + val == text.encode() and train.decode() and val.decode()


def test_a_passed_scan_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).clip(0, 255).tofile(path)
    data.open_tokens(path, vocab_size=256)
    records = list((tmp_path / "cache" / "jaxtrain" / "token_scans").glob("*.json"))
    assert len(records) == 1 and '"max_id": 255' in records[0].read_text()
    bad = np.arange(1000, dtype=np.uint16).clip(0, 255)
    bad[500] = 999
    bad.tofile(path)  # same size, new mtime: scanned again, and the bad id is found
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(UserError, match="token id 999 at position 500"):
        data.open_tokens(path, vocab_size=256)
