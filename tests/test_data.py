"""Token files, shard sets, mixtures, the global batch order, the grain loaders, the default dataset."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.config.data import SourceSpec
from jaxtrain.data import default, sources
from jaxtrain.data import loader as data
from jaxtrain.errors import UserError
from jaxtrain.tokenizer import ByteTokenizer

SEQ, BATCH = 8, 8


def _raw(path: Path, tokens: np.ndarray, dtype: str) -> Path:
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def _llmc(path: Path, tokens: np.ndarray, version: int, count: int | None = None) -> Path:
    header = np.zeros(sources.HEADER_INTS, dtype="<i4")
    header[:3] = sources.HEADER_MAGIC, version, len(tokens) if count is None else count
    body = np.asarray(tokens, dtype="<u2" if version == 1 else "<u4")
    path.write_bytes(header.tobytes() + body.tobytes())
    return path


def _open(path: Path | str, vocab: int = 256, seq: int = 1, token_dtype: str = "auto") -> sources.Shards:
    return sources.open_shards(str(path), "train", vocab, token_dtype, seq)


def _tokens(path: Path, vocab: int = 256, **kw: str) -> np.ndarray:
    """A single file's whole token array, as the loader maps it."""
    return _open(path, vocab, **kw).tokens(0)


def _one(shards: sources.Shards, name: str = "a", weight: float = 1.0) -> sources.Source:
    return sources.Source(name, weight, shards)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # scan records of this test only


@pytest.fixture
def src(tmp_path: Path) -> sources.Source:
    """1001 tokens: 125 windows of SEQ, so epochs wrap within a few dozen steps."""
    return _one(_open(_raw(tmp_path / "t.bin", np.arange(1001) % 251, "uint16"), seq=SEQ))


def _rows(srcs: list[sources.Source], step: int, batch: int = BATCH, seed: int = 0) -> np.ndarray:
    sizes, weights = [s.shards.n_windows for s in srcs], [s.weight for s in srcs]
    return data.read_batch(srcs, *data.global_batch_windows(sizes, weights, batch, seed, step))


# ---------------------------------------------------------------- token files


def test_raw_uint16_round_trip(tmp_path: Path) -> None:
    want = np.random.default_rng(0).integers(0, 50257, 5000)
    got = _tokens(_raw(tmp_path / "a.bin", want, "uint16"), 50257)
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)


def test_raw_uint32_by_vocab_size_and_by_flag(tmp_path: Path) -> None:
    want = np.random.default_rng(0).integers(0, 100_000, 5000)
    path = _raw(tmp_path / "a.bin", want, "uint32")
    np.testing.assert_array_equal(_tokens(path, 100_000), want)  # auto: vocab > 65536
    small = want % 1000
    path = _raw(tmp_path / "b.bin", small, "uint32")
    got = _tokens(path, 1000, token_dtype="uint32")
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, small)


@pytest.mark.parametrize("version,dtype", [(1, np.uint16), (2, np.uint32)])
def test_llmc_header_round_trip(tmp_path: Path, version: int, dtype: type) -> None:
    want = np.random.default_rng(1).integers(0, 50257, 3000)
    got = _tokens(_llmc(tmp_path / "h.bin", want, version), 50257)
    assert got.dtype == dtype and len(got) == 3000
    np.testing.assert_array_equal(got, want)


def test_header_overrides_vocab_based_dtype_guess(tmp_path: Path) -> None:
    # vocab 100k would guess uint32 for a raw file; the header's version 1 says uint16.
    got = _tokens(_llmc(tmp_path / "h.bin", np.arange(100), 1), 100_000)
    assert got.dtype == np.uint16 and len(got) == 100


def _error(path: Path | str, vocab: int = 256, seq: int = 1, **kw: str) -> str:
    with pytest.raises(UserError) as e:
        _open(path, vocab, seq, **kw)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_bad_token_files_fail_with_one_line(tmp_path: Path) -> None:
    assert "does not exist" in _error(tmp_path / "missing.bin")
    assert "not a file" in _error(tmp_path)
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "empty" in _error(tmp_path / "empty.bin")
    msg = _error(_raw(tmp_path / "short.bin", np.arange(10), "uint16"), seq=SEQ * 4)
    assert "holds 10 tokens" in msg and "33" in msg and "--model.seq_len" in msg
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    msg = _error(tmp_path / "odd.bin")
    assert "not a multiple of 2" in msg and "--token_dtype uint32" not in msg
    (tmp_path / "odd4.bin").write_bytes(bytes(6))
    assert "--token_dtype uint16" in _error(tmp_path / "odd4.bin", token_dtype="uint32")
    assert "no token files match" in _error(str(tmp_path / "nothing_*.bin"))
    assert "does not exist" in _error(str(tmp_path / "manifest.json"))


def test_token_id_beyond_vocab_names_id_and_fix(tmp_path: Path) -> None:
    ids = np.zeros(1000, dtype=np.uint16)
    ids[777] = 300
    msg = _error(_raw(tmp_path / "v.bin", ids, "uint16"), 256)
    assert "token id 300 at position 777" in msg and "vocab_size is 256" in msg
    assert "--model.vocab_size to at least 301" in msg and "--token_dtype" in msg


def test_id_check_scans_every_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "_CHECK_CHUNK", 64)  # many chunks; the bad id is in the last one
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


# ---------------------------------------------------------------- shard sets


def _shard_set(root: Path, n_shards: int, tokens_each: int = 97, start: int = 0) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_shards):
        ids = (np.arange(tokens_each) + (start + i) * 1000) % 65000
        paths.append(_llmc(root / f"train_{i:05d}.bin", ids, 1))
    return paths


def test_shards_are_one_window_space_read_lazily(tmp_path: Path) -> None:
    paths = _shard_set(tmp_path / "d", 30)
    shards = sources.Shards(
        [sources.inspect_file(p, 65536, "auto", p.stat().st_size) for p in paths], SEQ, max_open=3
    )
    per = (97 - 1) // SEQ  # 12 windows a shard, never across a shard's end
    assert shards.n_windows == 30 * per and not shards._open
    windows = np.arange(shards.n_windows)
    got = shards.read(windows[::-1])[::-1]
    want = np.stack(
        [np.fromfile(paths[w // per], "<u2", offset=1024)[(w % per) * SEQ :][: SEQ + 1] for w in windows]
    )
    np.testing.assert_array_equal(got, want)
    assert len(shards._open) <= 3  # open maps bounded however many shards were read


def test_windows_in_a_bucket_are_read_by_merged_ranged_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard in a bucket (fsspec's memory store standing in): overlapping windows and windows at
    most bucket.MERGE_HOLE_BYTES apart are one ranged GET, farther ones their own; every row is the
    shard's tokens; a GET that fails transiently is tried again (not returned in place of its bytes)."""
    from fsspec.implementations.memory import MemoryFileSystem

    from jaxtrain.disk import bucket

    class Store(MemoryFileSystem):
        gets: list[tuple[int, int]] = []
        drops = 1  # the first GET's connection drops

        def cat_file(self, path: str, start: int, end: int, **kw: object) -> bytes:
            if Store.drops:
                Store.drops -= 1
                raise ConnectionError("connection reset")
            Store.gets.append((start, end))
            return super().cat_file(path, start, end, **kw)

    store = Store(skip_instance_cache=True)
    tokens, header = np.arange(60_000, dtype="<u2"), 16  # a header's bytes before the tokens
    store.pipe_file("/jaxtrain-test/shard.bin", bytes(header) + tokens.tobytes())
    monkeypatch.setattr(bucket, "fs", lambda url: store)
    monkeypatch.setattr(bucket, "RETRY_FIRST_S", 0.01)
    array = sources.ObjectArray(
        bucket.ObjectPath("s3://jaxtrain-test/shard.bin"), np.dtype("<u2"), header, 60_000
    )
    hole = bucket.MERGE_HOLE_BYTES // 2  # tokens
    first = [0, SEQ, 2 * SEQ]  # overlapping: one GET
    near = 3 * SEQ + 1 + hole  # its first token just MERGE_HOLE_BYTES past the last window's end
    far = near + SEQ + 1 + hole + 1
    starts = np.array([far, near, *first, 50_000])  # in no order: rows come back in the index's order
    try:
        got = array[starts[:, None] + np.arange(SEQ + 1)]
    finally:
        store.rm("/jaxtrain-test", recursive=True)
    np.testing.assert_array_equal(got, tokens[starts[:, None] + np.arange(SEQ + 1)])
    rows = [(0, near + SEQ + 1), (far, far + SEQ + 1), (50_000, 50_000 + SEQ + 1)]  # tokens
    assert sorted(Store.gets) == [(header + 2 * lo, header + 2 * hi) for lo, hi in rows]
    # Adjacent ranges (a safetensors file's tensors) merge only while a GET stays within `most` bytes.
    merged = bucket.merge([0, 10, 20, 30], [10, 20, 30, 40], hole=0, most=20)
    assert merged == ([0, 20], [20, 40], [0, 0, 1, 1])


def test_glob_comma_list_and_set_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _shard_set(tmp_path / "a", 4)
    _shard_set(tmp_path / "b", 2, start=10)
    spec = f"{tmp_path / 'a'}/train_*.bin, {tmp_path / 'b' / 'train_00001.bin'}"
    first = sources.open_shards(spec, "train", 65536, "auto", SEQ)
    assert len(first.infos) == 5 and first.infos[-1].path.parent.name == "b"

    def no_reads(*a: object) -> None:
        raise AssertionError("a validated set was inspected again")

    monkeypatch.setattr(sources, "inspect_file", no_reads)
    again = sources.open_shards(spec, "train", 65536, "auto", SEQ)  # one stat per shard, no reads
    assert [i.count for i in again.infos] == [i.count for i in first.infos]


def test_mixture_spec_parsing() -> None:
    one = sources.parse_spec("data/web/train_*.bin", "train_data_path")
    assert one == [SourceSpec("data/web/train_*.bin", 1.0, "web")]
    mix = sources.parse_spec(
        "[{path: data/web/m.json, weight: 3}, {path: x/code.bin, weight: 1, name: c}]", "k"
    )
    assert [(s.weight, s.name) for s in mix] == [(3.0, "web"), (1.0, "c")]
    same = sources.parse_spec("[{path: a/x/1.bin}, {path: b/x/2.bin}]", "k")
    assert len({s.name for s in same}) == 2
    for bad, want in [
        ("[{path: a, weight: 0}]", "weight > 0"),
        ("[{path: a, wieght: 1}]", "only path/weight/name"),
        ("[]", "list of sources"),
        ("[{path: a, name: x}, {path: b, name: x}]", "distinct names"),
    ]:
        with pytest.raises(UserError, match=want):
            sources.parse_spec(bad, "train_data_path")


# ---------------------------------------------------------------- batch order


def test_permutation_is_a_bijection_for_any_size() -> None:
    for n in (1, 2, 3, 7, 64, 65, 1000, 4099):
        for epoch in (0, 1):
            perm = data._permute(np.arange(n), n, seed=3, epoch=epoch)
            np.testing.assert_array_equal(np.sort(perm), np.arange(n))
    a, b = data._permute(np.arange(1000), 1000, 0, 0), data._permute(np.arange(1000), 1000, 0, 1)
    assert (a != np.arange(1000)).mean() > 0.9 and (a != b).mean() > 0.9


def test_batch_windows_cover_an_epoch() -> None:
    n = 125
    steps = n // BATCH + 1
    got = [data.global_batch_windows([n], [1.0], BATCH, 0, s) for s in range(steps)]
    windows = np.concatenate([w for _, w in got])
    assert windows.dtype == np.int64 and all((k == 0).all() for k, _ in got)
    np.testing.assert_array_equal(np.sort(windows[:n]), np.arange(n))  # each window once per epoch


def _agree_across_process_counts(srcs: list[sources.Source], total: int = 20, seed: int = 5) -> None:
    for p_count in (1, 2, 4):
        loaders = [
            data.train_loader(srcs, BATCH, seed, 0, total, p, p_count, num_threads=2, prefetch=2)
            for p in range(p_count)
        ]
        per_process = [list(it) for it in loaders]
        assert all(len(b) == total for b in per_process)
        for step in range(total):
            local = [batches[step] for batches in per_process]
            assert all(b.shape == (BATCH // p_count, SEQ + 1) and b.dtype == np.int32 for b in local)
            np.testing.assert_array_equal(np.concatenate(local), _rows(srcs, step, seed=seed))


def test_loaders_agree_across_process_counts(src: sources.Source) -> None:
    _agree_across_process_counts([src])


def test_loaders_agree_across_process_counts_on_shards_and_mixtures(tmp_path: Path) -> None:
    _shard_set(tmp_path / "web", 7)
    _shard_set(tmp_path / "code", 3, start=50)
    web = _one(sources.open_shards(f"{tmp_path}/web/train_*.bin", "train", 65536, "auto", SEQ), "web", 0.7)
    code = _one(sources.open_shards(f"{tmp_path}/code/train_*.bin", "train", 65536, "auto", SEQ), "code", 0.3)
    _agree_across_process_counts([web])
    _agree_across_process_counts([web, code])


def test_mixture_matches_weights_over_any_window_of_steps() -> None:
    sizes, weights, batch = [1000, 37, 500], [0.5, 0.2, 0.3], 10
    counts = np.array(
        [
            np.bincount(data.global_batch_windows(sizes, weights, batch, 1, s)[0], minlength=3)
            for s in range(400)
        ]
    )
    assert (counts.sum(1) == batch).all()
    cum = np.concatenate([np.zeros((1, 3)), np.cumsum(counts, 0)])
    for lo in range(0, 400, 7):
        for hi in (lo + 1, lo + 13, 400):
            if hi <= 400:
                want = (hi - lo) * batch * np.array(weights)
                assert np.abs(cum[hi] - cum[lo] - want).max() <= 2, (lo, hi)
    # A pure function of (seed, step): recomputed, the same; a small source wraps its epochs.
    again = data.global_batch_windows(sizes, weights, batch, 1, 399)
    np.testing.assert_array_equal(again[1], data.global_batch_windows(sizes, weights, batch, 1, 399)[1])
    small = np.concatenate(
        [w[k == 1] for k, w in (data.global_batch_windows(sizes, weights, batch, 1, s) for s in range(400))]
    )
    np.testing.assert_array_equal(np.sort(small[:37]), np.arange(37))


def test_batch_rows_are_consecutive_tokens(src: sources.Source) -> None:
    batch = _rows([src], 3)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    np.testing.assert_array_equal(targets, (inputs + 1) % 251)  # the fixture's tokens count up


def test_resume_yields_the_same_batches(src: sources.Source) -> None:
    full = list(data.train_loader([src], BATCH, 1, 0, 30, 1, 2, 2, 2))
    resumed = list(data.train_loader([src], BATCH, 1, 17, 30, 1, 2, 2, 2))
    assert len(resumed) == 13
    for a, b in zip(full[17:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert list(data.train_loader([src], BATCH, 1, 30, 30, 0, 1, 2, 2)) == []


def test_seeds_differ_and_epochs_wrap() -> None:
    n = 125
    assert not np.array_equal(
        data.global_batch_windows([n], [1], BATCH, 0, 0)[1],
        data.global_batch_windows([n], [1], BATCH, 1, 0)[1],
    )
    # 125 windows, 8 rows a step: step 15 holds rows 120..127, across the epoch 0/1 boundary.
    rows = np.concatenate([data.global_batch_windows([n], [1], BATCH, 0, s)[1] for s in range(40)])
    epoch0, epoch1 = rows[:n], rows[n : 2 * n]
    np.testing.assert_array_equal(np.sort(epoch0), np.sort(epoch1))  # each epoch sees every window
    assert not np.array_equal(epoch0, epoch1)  # in a fresh order
    # A batch bigger than the data wraps several epochs within one step.
    big = data.global_batch_windows([n], [1], 300, 0, 0)[1]
    assert len(big) == 300 and set(big.tolist()) == set(range(n))


def test_loader_arguments_are_checked(src: sources.Source) -> None:
    with pytest.raises(UserError, match="not divisible by 3 processes"):
        data.train_loader([src], BATCH, 0, 0, 10, 0, 3, 1, 1)
    with pytest.raises(UserError, match="start_step"):
        data.train_loader([src], BATCH, 0, -1, 10, 0, 1, 1, 1)


def test_eval_batches_are_fixed_and_topology_free(src: sources.Source) -> None:
    one = data.eval_batches(src, BATCH, 3, 0, 1)
    assert len(one) == 3 and all(b.shape == (BATCH, SEQ + 1) and b.dtype == np.int32 for b in one)
    for b in range(3):
        split = [data.eval_batches(src, BATCH, 3, p, 4)[b] for p in range(4)]
        np.testing.assert_array_equal(np.concatenate(split), one[b])
    again = data.eval_batches(src, BATCH, 3, 0, 1)
    assert all(np.array_equal(x, y) for x, y in zip(one, again, strict=True))
    starts = np.concatenate(one)[:, 0]
    assert len(set(starts.tolist())) == 3 * BATCH  # distinct windows when the file has enough


def test_loader_throughput_sanity(tmp_path: Path) -> None:
    """Two threads reading ahead deliver every step's batch, whole and in order: exactly the rows
    the global order names for each step (tokens here are their own positions mod 251), at a rate
    that is a number (printed; timing is not asserted on a shared machine)."""
    path = _raw(tmp_path / "big.bin", np.arange(200_000) % 251, "uint16")
    big = _one(_open(path, seq=256))
    t = time.perf_counter()
    batches = list(data.train_loader([big], 64, 0, 0, 50, 0, 1, 2, 4))
    rate = len(batches) * 64 * 256 / (time.perf_counter() - t)
    print(f"loader: {rate / 1e6:.1f} M tokens/s")
    assert len(batches) == 50 and all(b.shape == (64, 257) and b.dtype == np.int32 for b in batches)
    for step in (0, 17, 49):
        source, window = data.global_batch_windows([big.shards.n_windows], [1.0], 64, 0, step)
        np.testing.assert_array_equal(batches[step], big.shards.read(window))
    # each row is a contiguous run of the file: consecutive tokens differ by 1 (mod 251)
    assert all(np.all(np.diff(b, axis=1) % 251 == 1) for b in batches)
    assert np.isfinite(rate) and rate > 0


# ---------------------------------------------------------------- the run's data, unchanged


def test_a_run_refuses_shards_missing_truncated_changed_or_added(tmp_path: Path) -> None:
    paths = _shard_set(tmp_path / "d", 4)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = f"{tmp_path / 'd'}/train_*.bin"

    def check() -> str:
        try:
            srcs = sources.open_sources(spec, "train", 65536, "auto", SEQ)
        except UserError as e:
            return str(e)
        with pytest.raises(UserError) as e:
            sources.check_run_data(run_dir, False, srcs)
        sources.check_run_data(run_dir, True, srcs)  # --overwrite starts afresh
        return str(e.value)

    sources.record_run_data(run_dir, sources.open_sources(spec, "train", 65536, "auto", SEQ))
    sources.check_run_data(run_dir, False, sources.open_sources(spec, "train", 65536, "auto", SEQ))
    os.utime(paths[0])  # touched, same bytes: still the run's data
    sources.check_run_data(run_dir, False, sources.open_sources(spec, "train", 65536, "auto", SEQ))
    original = paths[1].read_bytes()
    paths[1].write_bytes(original[:1024] + bytes(len(original) - 1024))  # same size, new content
    msg = check()
    assert str(paths[1]) in msg and "content differs" in msg and "\n" not in msg
    paths[1].write_bytes(original)
    _shard_set(tmp_path / "d", 5)  # a fifth shard appears
    assert "train_00004.bin" in check()
    (tmp_path / "d" / "train_00004.bin").unlink()
    raw = paths[2].read_bytes()
    paths[2].write_bytes(raw[:-20])  # truncated: the header no longer matches
    msg = check()
    assert str(paths[2]) in msg and "truncated" in msg
    paths[2].write_bytes(raw)
    paths[3].unlink()
    msg = check()
    assert str(paths[3]) in msg and "missing" in msg


# ---------------------------------------------------------------- default dataset


def test_default_dataset_builds_once(tmp_path: Path) -> None:
    train, val = default.default_dataset(tmp_path, max_bytes=2**20)
    assert train.is_file() and val.is_file() and train.parent.is_relative_to(tmp_path)
    mtime = train.stat().st_mtime_ns
    tr, va = _tokens(train), _tokens(val)
    assert tr.dtype == np.uint16 and int(tr.max()) < 256 and 900_000 < len(tr) + len(va) <= 2**20
    assert 0.005 < len(va) / (len(tr) + len(va)) < 0.02
    assert b"def " in ByteTokenizer().decode(tr[:20000]).encode()
    assert not [p for p in train.parent.iterdir() if p.name.endswith(".tmp")]
    time.sleep(0.01)
    assert default.default_dataset(tmp_path, max_bytes=2**20) == (train, val)
    assert train.stat().st_mtime_ns == mtime  # cached, not rebuilt
    # Deterministic: a fresh build elsewhere gives the same bytes.
    train2, _ = default.default_dataset(tmp_path / "again", max_bytes=2**20)
    assert train2.read_bytes() == train.read_bytes()


def test_a_passed_scan_is_remembered_until_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).clip(0, 255).tofile(path)
    _open(path)
    records = list((tmp_path / "cache" / "jaxtrain" / "token_scans").glob("*.json"))
    assert len(records) == 1 and '"max_id": 255' in records[0].read_text()
    bad = np.arange(1000, dtype=np.uint16).clip(0, 255)
    bad[500] = 999
    bad.tofile(path)  # same size, new mtime: scanned again, and the bad id is found
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(UserError, match="token id 999 at position 500"):
        _open(path)
