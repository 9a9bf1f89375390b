"""Packed documents: attention never crosses a boundary token and positions restart in each, so a
packed window computes each document exactly as it computes it alone; prepare frames documents
with the tokenizer's own boundary tokens and records them in the manifest.

    pytest tests/test_documents.py
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chat_tokenizers import KINDS, make_tokenizer_dir

from jaxtrain.config import ModelConfig, load_config
from jaxtrain.data import sources
from jaxtrain.data.framing import with_framing
from jaxtrain.errors import DataError
from jaxtrain.model import documents as packing
from jaxtrain.model.documents import documents
from jaxtrain.model.transformer import GPT
from jaxtrain.prepare.shards import prepare_corpus
from jaxtrain.tokenizer import BPETokenizer

BOS, EOS = 1, 2


def _docs(rng: np.random.Generator, lengths: list[int], bos: int, eos: int) -> list[np.ndarray]:
    out = []
    for n in lengths:
        body = rng.integers(3, 64, n)
        out.append(
            np.concatenate([[bos] if bos >= 0 else [], body, [eos] if eos >= 0 else []]).astype(np.int32)
        )
    return out


MODELS = {
    "llama": ModelConfig(
        vocab_size=64, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, mlp="swiglu", d_ff=64,
        tie_embeddings=False, attention_impl="xla",
    ),
    "gpt_learned_scan": ModelConfig(
        vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32, pos_embedding="learned",
        scan_layers=True, attention_impl="xla",
    ),
}  # fmt: skip


def test_segments_and_positions_from_boundary_tokens():
    tokens = jnp.asarray([[5, BOS, 5, 5, EOS, BOS, 5, EOS, 5]])
    cases = {
        (BOS, -1): ([0, 1, 1, 1, 1, 2, 2, 2, 2], [0, 0, 1, 2, 3, 0, 1, 2, 3]),
        (-1, EOS): ([0, 0, 0, 0, 0, 1, 1, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2, 0]),
        (BOS, EOS): ([0, 1, 1, 1, 1, 3, 3, 3, 4], [0, 0, 1, 2, 3, 0, 1, 2, 0]),
    }
    for (bos, eos), (segments, positions) in cases.items():
        doc = documents(tokens, bos, eos)
        assert doc.segments[0].tolist() == segments and doc.positions[0].tolist() == positions


@pytest.mark.parametrize("name,bos,eos", [("llama", BOS, -1), ("gpt_learned_scan", -1, EOS)])
def test_packed_documents_compute_as_each_alone(name, bos, eos):
    cfg = dataclasses.replace(MODELS[name], doc_bos=bos, doc_eos=eos)
    docs = _docs(np.random.default_rng(0), [7, 12, 5], bos, eos)
    packed = np.concatenate(docs)
    # One batch: the packed window, then each document alone, right-padded (causal attention: the
    # padding after a document changes nothing before it).
    rows = np.full((1 + len(docs), len(packed)), 3, np.int32)
    rows[0] = packed
    for i, d in enumerate(docs):
        rows[1 + i, : len(d)] = d
    model = GPT(cfg, jnp.float32)
    params = model.init(jax.random.key(0), jnp.asarray(rows[:1]))["params"]
    out = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(rows)))
    alone = np.concatenate([out[1 + i, : len(d)] for i, d in enumerate(docs)])
    np.testing.assert_allclose(out[0], alone, atol=1e-5, rtol=0)
    # Without the mask the later documents attend to the earlier ones: the test can tell.
    plain = GPT(dataclasses.replace(cfg, doc_bos=-1, doc_eos=-1), jnp.float32)
    unmasked = np.asarray(jax.jit(plain.apply)({"params": params}, jnp.asarray(rows[:1])))[0]
    assert np.abs(unmasked[len(docs[0]) :] - alone[len(docs[0]) :]).max() > 1e-3


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: make_tokenizer_dir(root / kind, kind) for kind in KINDS}


DOCS = ["What is 12 plus 7?", "Hello there.\n\nHow are you?", "système"]


def _inputs(root):
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    txt = root / "notes.txt"
    txt.write_text("line one\nline two\n")
    return [jsonl, txt]


def test_prepare_frames_each_document_with_the_tokenizers_own_tokens(tokenizer_dirs, tmp_path):
    out = tmp_path / "out"
    prepare_corpus(_inputs(tmp_path), out, tokenizer=str(tokenizer_dirs["llama3"]), val_fraction=0, workers=1)
    tok = BPETokenizer.from_file(out)  # tokenizer.json and its config, copied beside the data
    bos, eos = tok.token_id("<|begin_of_text|>"), tok.token_id("<|eot_id|>")
    assert json.loads((out / "manifest.json").read_text())["framing"] == {"bos": bos, "eos": eos}
    plain = [tok.encode_offsets(t)[0] for t in [*DOCS, "line one\nline two\n"]]  # a text file: one document
    expected = np.concatenate([np.concatenate([[bos], ids, [eos]]) for ids in plain])
    np.testing.assert_array_equal(np.fromfile(out / "train.bin", np.uint16), expected)


def test_a_bpe_trained_here_ends_each_document_with_its_end_of_text_and_bytes_keep_a_blank_line(tmp_path):
    bpe, byte = tmp_path / "bpe", tmp_path / "byte"
    prepare_corpus(_inputs(tmp_path), bpe, tokenizer="bpe", vocab_size=300, val_fraction=0, workers=1)
    tok = BPETokenizer.from_file(bpe / "tokenizer.json")
    end = tok.token_id("<|endoftext|>")
    assert json.loads((bpe / "manifest.json").read_text())["framing"] == {"bos": None, "eos": end}
    ids = np.fromfile(bpe / "train.bin", np.uint16)
    assert (ids == end).sum() == len(DOCS) + 1 and ids[-1] == end
    assert tok.decode(ids[: np.flatnonzero(ids == end)[0]].tolist()) == DOCS[0]
    # Bytes have no id to spare: documents stay separated by a blank line, as before.
    prepare_corpus(_inputs(tmp_path), byte, val_fraction=0, workers=1)
    assert json.loads((byte / "manifest.json").read_text())["framing"] == {"bos": None, "eos": None}
    text = np.fromfile(byte / "train.bin", np.uint16).astype(np.uint8).tobytes()
    assert text.startswith(f"{DOCS[0]}\n\n{DOCS[1]}\n\n".encode())


def test_runs_take_boundaries_from_the_data_and_refuse_data_framed_otherwise(tokenizer_dirs, tmp_path):
    made = {}
    for kind in KINDS:
        prepare_corpus(
            _inputs(tmp_path), tmp_path / kind, tokenizer=str(tokenizer_dirs[kind]), val_fraction=0
        )
        made[kind] = sources.Source(
            kind, 1.0, sources.open_shards(str(tmp_path / kind / "manifest.json"), "train", 512, "auto", 8)
        )
    llama = BPETokenizer.from_file(tokenizer_dirs["llama3"])
    cfg = load_config(["--config", "configs/tiny.yaml", "--model.seq_len", "8"])
    framed = with_framing(cfg, [made["llama3"]], llama)
    assert (framed.model.doc_bos, framed.model.doc_eos) == (llama.framing.bos, llama.framing.eos)
    assert not framed.loss_mask
    off = with_framing(dataclasses.replace(cfg, document_mask="off"), [made["llama3"]], llama)
    assert (off.model.doc_bos, off.model.doc_eos) == (-1, -1)
    with pytest.raises(
        DataError, match=r"data source qwen2 is framed with bos None, eos \d+ but the model's"
    ):
        with_framing(cfg, [made["qwen2"]], llama)
    with pytest.raises(DataError, match="prepare every source with the same tokenizer"):
        with_framing(cfg, [made["llama3"], made["qwen2"]])


def _levels_by_hand(segments: np.ndarray) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """model/documents.py `levels` in plain Python: each document at the coarsest level whose
    sub-blocks it crosses, listed in its block; the level's owner of each token (-1: none)."""
    b, t = segments.shape
    sizes = packing.block_sizes(t)
    out = [
        (np.full((b * t // s, packing.SPLIT), -1), np.full((b * t // s, packing.SPLIT - 1), -1))
        for s in sizes
    ]
    out = out[:-1]
    owner = np.full((b, t), -1)
    for row in range(b):
        bounds = [0, *(np.flatnonzero(np.diff(segments[row])) + 1).tolist(), t]
        for start, end in zip(bounds, bounds[1:], strict=False):
            crosses = [start // sub != (end - 1) // sub for sub in sizes[1:]]
            if not any(crosses):
                owner[row, start:end] = len(sizes) - 1
                continue
            level = crosses.index(True)
            owner[row, start:end] = level
            offsets, lengths = out[level]
            block = row * t // sizes[level] + start // sizes[level]
            slot = int((lengths[block] >= 0).sum())
            offsets[block, slot], lengths[block, slot] = start % sizes[level], end - start
    return out, owner


def test_documents_become_packed_levels_of_at_most_15_a_block_for_any_data():
    """levels() against the same rule by hand, on 4,096 tokens (blocks of 4,096, 256 and 16: two
    packed levels): random documents, a window of one-token documents (4,096 of them: the most a
    window can hold, past any fixed bound on documents a sequence), and one document the whole
    window. Every token is in exactly one level, no block holds more than 15 documents, and the
    documents each level lists are whole: no two merged, none cut."""
    rng = np.random.default_rng(0)
    t = 4096
    random_rows = np.cumsum(rng.random((2, t)) < 0.02, axis=1)
    mixed = np.cumsum(np.isin(np.arange(t), np.r_[100:400, 1000, 1100, 3000:3040]), axis=0)
    segments = np.stack([*random_rows, np.arange(t), np.zeros(t, int), mixed]).astype(np.int32)
    assert packing.block_sizes(t) == [4096, 256, 16]
    found, rest = jax.jit(packing.levels)(jnp.asarray(segments))
    want, owner = _levels_by_hand(segments)
    assert [level.block for level in found] == [4096, 256]
    for level, (offsets, lengths), i in zip(found, want, range(len(want)), strict=True):
        np.testing.assert_array_equal(level.offsets, offsets)
        np.testing.assert_array_equal(level.lengths, lengths)
        np.testing.assert_array_equal(level.owned, owner == i)
        assert int((lengths >= 0).sum(axis=1).max()) <= 15
    np.testing.assert_array_equal(rest, owner == len(want))
    assert (owner >= 0).all() and int(want[0][1][3, 0]) == t  # the whole window: one document, level 0
