"""What a run takes from how its data was prepared: the documents' boundary tokens (attention
never crosses them) and whether the data carries a loss mask (prepare_data.py --chat).

    cfg = with_framing(cfg, train_sources + val_sources, model_tokenizer(cfg))

Each manifest records its framing, (bos, eos). Sources framed differently from each other, or from
the tokenizer of the model a run starts from (--init_from hf:DIR), are refused in one line: the
model would be taught boundaries it never uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxtrain.config import Config, ModelConfig
from jaxtrain.config.origin import PREFIX, hf_dir, is_hf
from jaxtrain.data.sources import Source
from jaxtrain.disk import bucket
from jaxtrain.disk.remote import fetch_tokenizer
from jaxtrain.errors import DataError
from jaxtrain.text.chat_template import chat_framing
from jaxtrain.tokenizer import BPETokenizer, Framing, find_tokenizer


def model_tokenizer(cfg: Config) -> BPETokenizer | None:
    """The tokenizer of the model a run starts from, where it has its own (a Hugging Face dir's, in
    a bucket too: its tokenizer files copied to the local cache first)."""
    spec = cfg.init_from or cfg.resume_from
    if is_hf(spec) and bucket.is_url(spec[len(PREFIX) :]):
        where = fetch_tokenizer(spec[len(PREFIX) :], "--init_from" if cfg.init_from else "--resume_from")
    else:
        directory = hf_dir(spec)
        where = find_tokenizer(directory) if directory is not None else None
    return BPETokenizer.from_file(where) if where is not None else None


def _name(framing: tuple[int | None, int | None]) -> str:
    bos, eos = framing
    return f"bos {bos}, eos {eos}" if framing != (None, None) else "no boundary tokens"


def with_framing(cfg: Config, sources: Sequence[Source], tokenizer: BPETokenizer | None = None) -> Config:
    """cfg with model.doc_bos / doc_eos from the data's framing (document_mask auto) and loss_mask
    where the data has one; data framed unlike the rest, or unlike `tokenizer`, is refused."""
    found = {(s.name, f) for s in sources for f in s.shards.framings if f is not None}
    framings = {f for _, f in found if f != (None, None)}
    if len(framings) > 1:
        a, b = sorted(found, key=str)[:2]
        raise DataError(
            f"data source {a[0]} is framed with {_name(a[1])} but {b[0]} with {_name(b[1])}; prepare "
            "every source with the same tokenizer (scripts/prepare_data.py --tokenizer)"
        )
    if tokenizer is not None:
        own = {f for f in (_pair(tokenizer.framing), _pair(chat_framing(tokenizer))) if f != (None, None)}
        for name, framing in found:
            if framing not in own | {(None, None)} or (own and framing == (None, None)):
                expected = " or ".join(_name(f) for f in sorted(own, key=str)) or "no boundary tokens"
                where = (cfg.init_from or cfg.resume_from).removeprefix(PREFIX)
                raise DataError(
                    f"data source {name} is framed with {_name(framing)} but the model's tokenizer frames "
                    f"documents with {expected}; prepare it again with --tokenizer {where}"
                )
    model = _boundaries(cfg, found)
    for s in sources:
        for window in s.shards.windows - {cfg.model.seq_len}:
            raise DataError(
                f"data source {s.name} packs conversations into windows of {window} tokens but "
                f"model.seq_len is {cfg.model.seq_len}; pass --model.seq_len {window} or prepare it "
                f"again with --seq_len {cfg.model.seq_len}"
            )
    masked = any(info.mask is not None for s in sources for info in s.shards.infos)
    return dataclasses.replace(cfg, model=model, loss_mask=cfg.loss_mask or masked)


def _boundaries(cfg: Config, found: set[tuple[str, tuple[int | None, int | None]]]) -> ModelConfig:
    """The model with the boundary tokens attention stops at: none with document_mask off; else the
    data's (a manifest's framing), which must agree with any the model already has (given, or
    saved with the checkpoint a task reads)."""
    model = cfg.model
    if cfg.document_mask == "off":
        return dataclasses.replace(model, doc_bos=-1, doc_eos=-1)
    framed = sorted(((name, f) for name, f in found if f != (None, None)), key=lambda x: x[0])
    if not framed:
        return model
    name, (bos, eos) = framed[0]
    ids = (-1 if bos is None else bos, -1 if eos is None else eos)
    if (model.doc_bos, model.doc_eos) not in ((-1, -1), ids):
        raise DataError(
            f"model.doc_bos {model.doc_bos} / doc_eos {model.doc_eos} but data source {name} is framed with "
            f"{_name((bos, eos))}; drop --model.doc_bos/--model.doc_eos (document_mask auto takes the "
            "data's), or prepare the data with the model's tokenizer"
        )
    return dataclasses.replace(model, doc_bos=ids[0], doc_eos=ids[1])


def _pair(framing: Framing) -> tuple[int | None, int | None]:
    return framing.bos, framing.eos
