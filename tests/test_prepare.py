"""scripts/prepare_data.py: text, jsonl and parquet inputs, shards, manifests, tokenizers, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from processes import clean_env

from jaxtrain.data import sources
from jaxtrain.errors import UserError
from jaxtrain.prepare.shards import prepare_corpus
from jaxtrain.text import format
from jaxtrain.tokenizer import BPETokenizer, ByteTokenizer, find_tokenizer, tokenizer_for

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _prepare(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_data.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=cwd,
    )


def _corpus(root: Path) -> str:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("First file.\nÜnïcödé line ✓\n")
    (root / "sub" / "b.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(300)))
    (root / "skip.md").write_text("not matched by the glob\n")
    return (root / "a.txt").read_text() + (root / "sub" / "b.txt").read_text()


def _docs(n: int, tag: str) -> list[str]:
    return [f"{tag} document {i}: " + "ünï words " * (i % 7 + 1) for i in range(n)]


def _jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _parquet(path: Path, docs: list[str], column: str = "text", row_group: int = 40) -> Path:
    import pyarrow as pa  # a dev dependency: missing, this fails (a skip would hide the broken install)
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group)
    return path


def _read_split(out: Path, split: str, vocab: int = 256) -> np.ndarray:
    m = json.loads((out / "manifest.json").read_text())
    return np.concatenate([sources.memmap(i) for i in sources.open_shards(
        str(out / "manifest.json"), split, vocab, "auto", 1
    ).infos]) if m["splits"].get(split) else np.zeros(0, np.uint16)  # fmt: skip


def test_text_round_trip_flat_files(tmp_path: Path) -> None:
    text = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    r = _prepare(str(tmp_path / "in"), "--out_dir", str(out), "--val_fraction", "0.1", "--workers", "1")
    assert r.returncode == 0, r.stderr
    # This interpreter (a bare `python` has no jaxtrain), a run dir of its own, no vocabulary (training
    # reads the manifest's): as run from the repo.
    python = (
        Path(sys.executable).relative_to(Path.cwd())
        if Path(sys.executable).is_relative_to(Path.cwd())
        else sys.executable
    )
    assert (
        f"\n  {python} scripts/train.py --run_dir runs/out --train_data_path {out / 'manifest.json'}\n"
        in r.stdout
    )
    assert "tokens/s" in r.stdout
    train, val = _read_split(out, "train"), _read_split(out, "val")
    assert (out / "train.bin").stat().st_size == 2 * len(train)  # flat nanoGPT file, no header
    assert 0.08 < len(val) / (len(train) + len(val)) < 0.12
    tok = tokenizer_for(find_tokenizer(out), 256)
    assert isinstance(tok, ByteTokenizer)
    assert tok.decode(train) + tok.decode(val) == text
    assert tok.decode(train).endswith("\n")  # cut at a line end
    m = json.loads((out / "manifest.json").read_text())
    assert m["splits"]["train"]["tokens"] == len(train) and m["tokenizer"]["kind"] == "byte"
    assert [Path(s["path"]).name for s in m["sources"]] == ["a.txt", "b.txt"]
    assert all(len(s["sha256"]) == 64 for s in m["sources"])


def test_jsonl_and_parquet_shards_the_same_for_any_worker_count(tmp_path: Path) -> None:
    web, code = _docs(300, "web"), _docs(120, "code")
    (tmp_path / "in").mkdir()
    _jsonl(tmp_path / "in" / "a.jsonl", code, key="content")
    _parquet(tmp_path / "in" / "b.parquet", web)
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        result = prepare_corpus(
            [tmp_path / "in"], out, val_fraction=0.05, shard_tokens=3000, workers=workers, text_key="content"
        )
        assert result.workers == workers and result.tokenize_seconds > 0
        outs.append(out)
    files = sorted(p.name for p in outs[0].iterdir())
    assert files == sorted(p.name for p in outs[1].iterdir()) and "train_00001.bin" in files
    for name in files:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    train, val = _read_split(outs[0], "train"), _read_split(outs[0], "val")
    text = ByteTokenizer().decode(train) + ByteTokenizer().decode(val)
    assert text == "".join(d + "\n\n" for d in code + web)  # every document once, in order
    header = np.fromfile(outs[0] / "train_00000.bin", "<i4", count=3)
    assert list(header) == [format.HEADER_MAGIC, 1, 3000]
    m = json.loads((outs[0] / "manifest.json").read_text())
    assert m["header"] == "llm.c" and sum(s["tokens"] for s in m["splits"]["train"]["shards"]) == len(train)
    assert max(s["max_id"] for s in m["splits"]["train"]["shards"]) == int(train.max())


def test_bpe_trained_and_brought(tmp_path: Path) -> None:
    text = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    result = prepare_corpus(
        [tmp_path / "in"], out, tokenizer="bpe", vocab_size=300, val_fraction=0.1, workers=1
    )
    assert result.tokenizer_path == out / "tokenizer.json" and 256 < result.vocab_size <= 300
    train, val = _read_split(out, "train", 300), _read_split(out, "val", 300)
    assert len(train) + len(val) < len(text.encode())  # merges compress
    tok = tokenizer_for(find_tokenizer(out), result.vocab_size)
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == result.vocab_size
    assert tok.decode(train) + tok.decode(val) == text
    # A tokenizer.json the user brings is used as is and copied beside the data.
    r = _prepare(
        str(tmp_path / "in"), "--out_dir", str(tmp_path / "b"), "--tokenizer", str(out / "tokenizer.json")
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b" / "train.bin").read_bytes() + (tmp_path / "b" / "val.bin").read_bytes() != b""
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["tokenizer"]["kind"] == "file"
    np.testing.assert_array_equal(
        np.concatenate([_read_split(tmp_path / "b", "train", 300), _read_split(tmp_path / "b", "val", 300)]),
        np.concatenate([train, val]),
    )


def test_bpe_without_tokenizers_package_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _corpus(tmp_path / "in")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(UserError, match=r"pip install -e '.\[bpe\]'"):
        prepare_corpus([tmp_path / "in"], tmp_path / "out", tokenizer="bpe", vocab_size=300)
    with pytest.raises(UserError, match="needs --tokenizer bpe"):
        prepare_corpus([tmp_path / "in"], tmp_path / "out", vocab_size=1000)
    assert not (tmp_path / "out" / "train.bin").exists()


def test_long_lines_and_unit_edges_never_cut_a_character(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxtrain.prepare import inputs

    monkeypatch.setattr(inputs, "_SCAN", 7)  # a "long line" is anything over 7 bytes
    text = "ab✓ü" * 50 + "\nshort\n" + "é" * 41 + "\n" + "x" * 30
    (tmp_path / "t.txt").write_text(text)
    files = inputs.describe([tmp_path / "t.txt"], "text")
    for unit_bytes in (5, 11, 64):
        for vf in (0.0, 0.3):
            units = inputs.plan(files, vf, unit_bytes)
            parts = [(u.is_val, "".join(inputs.read_unit(files[0], u, "text", "text"))) for u in units]
            assert "".join(p for _, p in parts) == text  # whole characters, nothing lost or doubled
            assert [v for v, _ in parts] == sorted(v for v, _ in parts)  # train, then val


def _one_line_exit_2(r: subprocess.CompletedProcess[str], *want: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    for w in want:
        assert w in r.stderr, r.stderr


@pytest.mark.slow
def test_bad_input_exits_2_naming_the_file_and_leaves_nothing(tmp_path: Path) -> None:
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    good = _prepare(str(tmp_path / "in"), "--out_dir", str(out), "--shard_tokens", "4000")
    assert good.returncode == 0, good.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (bad / "empty.txt").write_bytes(b"")
    (bad / "blank.jsonl").write_text("\n\n")
    _jsonl(bad / "nokey.jsonl", ["x"], key="body")
    (bad / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (bad / "junk.parquet").write_bytes(b"PAR1 not really parquet")
    _parquet(bad / "nocol.parquet", ["a", "b"], column="body")
    cases = [
        ("latin1.txt", ["not UTF-8"]),
        ("empty.txt", ["empty"]),
        ("blank.jsonl", ["holds no text"]),
        ("nokey.jsonl", ["no text field 'text'", "body", "--text_key"]),
        ("broken.jsonl", ["not valid JSON"]),
        ("junk.parquet", ["not a readable parquet file"]),
        ("nocol.parquet", ["no column 'text'", "body", "--text_column"]),
    ]
    for name, want in cases:
        # A good file first, so the failure comes mid-way through a real run.
        r = _prepare(
            str(tmp_path / "in" / "sub" / "b.txt"), str(bad / name), "--out_dir", str(out),
            "--overwrite", "--shard_tokens", "1000", "--workers", "2",
        )  # fmt: skip
        _one_line_exit_2(r, str(bad / name), *want)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before, name  # nothing changed
    _one_line_exit_2(_prepare(str(tmp_path / "in"), "--out_dir", str(out)), "--overwrite")
    _one_line_exit_2(_prepare(str(tmp_path / "nope"), "--out_dir", str(tmp_path / "o")), "does not exist")
    _one_line_exit_2(
        _prepare(str(tmp_path / "in"), "--glob", "*.rst", "--out_dir", str(tmp_path / "o")), "'*.rst'"
    )


@pytest.mark.slow
def test_train_on_a_mixture_of_manifests_then_refuse_a_changed_shard(tmp_path: Path) -> None:
    (tmp_path / "web").mkdir()
    (tmp_path / "code").mkdir()
    _jsonl(tmp_path / "web" / "a.jsonl", _docs(400, "web"))
    _parquet(tmp_path / "code" / "b.parquet", _docs(300, "code"))
    for name in ("web", "code"):
        prepare_corpus(
            [tmp_path / name], tmp_path / "data" / name, val_fraction=0.1, shard_tokens=4000, workers=1
        )
    mixture = (
        f"[{{path: {tmp_path}/data/web/manifest.json, weight: 0.7}}, "
        f"{{path: {tmp_path}/data/code/manifest.json, weight: 0.3}}]"
    )
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "scripts/train.py", "--config", "configs/tiny.yaml", "--run_dir", str(run_dir),
           "--train_data_path", mixture, "--total_steps", "10", "--checkpoint_interval", "5"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert evals and {"val_loss/web", "val_loss/code"} <= set(evals[-1])
    shard = tmp_path / "data" / "code" / "train_00001.bin"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-2])
    r = subprocess.run(
        [*cmd[:-4], "--total_steps", "12"], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    _one_line_exit_2(r, str(shard))


def _one_line_documents(root: Path, sizes: list[int]) -> list[str]:
    """A corpus as a new user's first one: a file a document, each one line of `size` words."""
    root.mkdir()
    words = "the of and a to in is that it was for on are as with his they at be this from".split()
    docs = [" ".join(words[(i + j) % len(words)] for j in range(n)) + "\n" for i, n in enumerate(sizes)]
    for i, doc in enumerate(docs):
        (root / f"doc{i:02d}.txt").write_text(doc)
    return docs


def test_one_line_documents_split_whole_and_a_single_one_is_refused(tmp_path: Path) -> None:
    # 40 documents of 400 words: 1% of the bytes fell inside the last line, moved to its end, and
    # validation held nothing (with a BPE's end token: that token alone). Now: the last document whole.
    docs = _one_line_documents(tmp_path / "c40", [400] * 40)
    out = tmp_path / "o40"
    result = prepare_corpus([tmp_path / "c40"], out, tokenizer="bpe", vocab_size=300, workers=1)
    tok = tokenizer_for(find_tokenizer(out), result.vocab_size)
    assert tok.decode(_read_split(out, "val", 300)) == docs[-1]
    assert tok.decode(_read_split(out, "train", 300)) == "".join(docs[:-1])
    _one_line_documents(tmp_path / "one", [50])
    with pytest.raises(UserError, match="the input is one document .*--val_fraction 0"):
        prepare_corpus([tmp_path / "one"], tmp_path / "o1")
    assert not (tmp_path / "o1").exists()


def test_a_failed_prepare_leaves_no_folder_it_made(tmp_path: Path) -> None:
    _corpus(tmp_path / "in")
    (tmp_path / "in" / "sub" / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):  # met while tokenizing, after the folders were made
        prepare_corpus([tmp_path / "in"], tmp_path / "new" / "out", workers=1)
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    with pytest.raises(UserError, match="not UTF-8"):
        prepare_corpus([tmp_path / "in"], tmp_path / "mine", workers=1)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_prepare_knows_train_pys_default_window() -> None:
    from jaxtrain.config.schema import ModelConfig
    from jaxtrain.prepare.cli import TRAIN_SEQ_LEN

    assert TRAIN_SEQ_LEN == ModelConfig().seq_len  # prepare/ may not import the config: a copy


@pytest.mark.slow
def test_the_printed_train_command_runs_on_a_small_corpus(tmp_path: Path) -> None:
    # 60 documents of 20-300 words, the last of 20: validation (that document, 100 bytes) is shorter
    # than one sequence of train.py's default window, so the printed command says a shorter one.
    docs = _one_line_documents(tmp_path / "c60", [20 + (i * 37) % 281 for i in range(59)] + [20])
    out = tmp_path / "o60"
    r = _prepare(str(tmp_path / "c60"), "--out_dir", str(out), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert ByteTokenizer().decode(_read_split(out, "val")) == docs[-1]
    assert f"note: val holds {len(docs[-1])} tokens" in r.stdout and "--model.seq_len 64" in r.stdout
    printed = r.stdout.split("train with:\n")[1].split()
    assert printed[1:4] == ["scripts/train.py", "--run_dir", "runs/o60"], r.stdout
    run_dir = tmp_path / "run"  # the last --run_dir wins: not the repo's runs/o60
    cmd = [*printed, "--run_dir", str(run_dir), "--total_steps", "2",
           "--eval_interval", "1", "--eval_batches", "1", "--progress_bar", "false"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in m for m in metrics), metrics
