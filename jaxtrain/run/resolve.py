"""The job, finished once: every consumer turns what the user gave into the config it runs the same
way, here, and nowhere else.

    job_in = resolve(cfg)                     # no devices: every process alike, before joining
    job = Job.join(job_in.cfg, launch)        # the devices: mesh and batch (job.py: with_topology)
    run = build(job)

`cfg` is the config of flags and YAML, with an --init_from hf:DIR's model filled in (config/load.py,
hf/config.py: with_hf_model). `resolve` adds, in this order:
1. the model of the checkpoint a task reads (--task test|predict|chat, scripts/export_hf.py), in
   the window given (--model.seq_len);
2. the data: training's (or --task test's) sources opened and checked, --epochs' step count,
   the vocabulary, documents' framing and loss mask their manifests record (data/framing.py).

Training (loop.py), --task test|predict|chat (tasks.py) and the GPU planner (scripts/plan.py) call
`resolve`, so the planner compiles the program training runs for the same data.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxtrain import config as config_lib
from jaxtrain.config import Config, ModelConfig, global_rows
from jaxtrain.data import framing, loader, sources
from jaxtrain.data.default import run_paths
from jaxtrain.errors import UserError
from jaxtrain.hf.load import HFCheckpoint
from jaxtrain.run.start import ParamSource, open_params


@dataclass(frozen=True)
class Trained:
    """A checkpoint a task reads: where its params are, and the config it was written with."""

    source: ParamSource
    step: int
    saved: dict[str, Any]  # the config the checkpoint was written with (a Hugging Face dir's model)

    @property
    def where(self) -> Path:
        return self.source.directory / str(self.step)

    @property
    def run_dir(self) -> Path:
        d = self.source.directory
        return d.parent if d.name == "checkpoints" else d

    def model(self, given_seq_len: int = 0) -> ModelConfig:
        """The checkpoint's model, in the window given (0 or the default: the one it was trained in)."""
        model = config_lib.saved_model(self.saved)
        given = 0 if given_seq_len == ModelConfig().seq_len else given_seq_len
        if isinstance(self.source, HFCheckpoint):  # its window is checked against its config.json
            return dataclasses.replace(model, seq_len=self.source.window(given or None))
        return window(model, given)


def window(model: ModelConfig, given: int) -> ModelConfig:
    """A checkpoint's model in the window given (0: its own): a rotary model runs on any window up
    to the one it was trained with."""
    if not given or given == model.seq_len:
        return model
    if model.pos_embedding != "rope":
        raise UserError(
            f"--model.seq_len {given}: the checkpoint's model has learned positions for windows of "
            f"{model.seq_len} tokens only; leave the flag out"
        )
    if given > model.seq_len:
        raise UserError(
            f"--model.seq_len {given}: the checkpoint's model was trained on windows of {model.seq_len} "
            f"tokens; pass at most {model.seq_len}"
        )
    return dataclasses.replace(model, seq_len=given)


def open_trained(path: str, flag: str) -> Trained:
    """The checkpoint `path` names (hf:DIR, a step dir, or a run's newest) and its saved config."""
    source, step = open_params(path, flag)
    return Trained(source, step, source.read_meta(step).get("config", {}))


@dataclass(frozen=True)
class Resolved:
    """The config finished but for the devices, with the data and checkpoint it was finished from."""

    cfg: Config
    train: list[sources.Source]  # training data (none for the other tasks)
    val: list[sources.Source]  # validation data; --task test's test data
    data_path: str  # where `train` (--task test: `val`) was read from; "" for none
    trained: Trained | None  # --task test|predict|chat: the checkpoint read


def resolve(cfg: Config, default_data: bool = True) -> Resolved:
    """`cfg` finished from its checkpoint and data (see the module's docstring); bad input raises a
    UserError before anything is written. default_data False (the planner): without a data path,
    open no data rather than build the embedded dataset (which frames nothing, masks nothing)."""
    trained = None
    if cfg.task != "train":
        trained = open_trained(cfg.resume_from, "--resume_from")
        cfg = dataclasses.replace(cfg, model=trained.model(cfg.model.seq_len))
        config_lib.check(cfg)
    train: list[sources.Source] = []
    val: list[sources.Source] = []
    path = ""
    if cfg.task == "train" and (default_data or cfg.train_data_path):
        path, val_path = run_paths(cfg)
        cfg = with_data_vocab(cfg, path, val_path)
        train, val = _open(cfg, path, "train"), _open(cfg, val_path, "val")
        cfg = with_epochs(cfg, loader.epoch_windows(train))
    elif cfg.task == "test":
        assert trained is not None
        path = cfg.test_data_path or run_paths(cfg, trained.saved)[1]
        val = _open(cfg, path, "val")
    if train or val:
        cfg = framing.with_framing(cfg, train + val, framing.model_tokenizer(cfg))
    return Resolved(cfg, train, val, path, trained)


def with_data_vocab(cfg: Config, train_path: str, val_path: str) -> Config:
    """model.vocab_size raised to the vocabulary the data's manifests record where it is smaller:
    the model embeds every id of the data's tokenizer, so prepare_data.py's command needs no
    --model.vocab_size. A larger one stays (padded, e.g. GPT-2's 50304 for its 50257), and so does
    --init_from's, which its params fix (the data's ids are checked against it)."""
    vocab = max(
        sources.manifest_vocab(train_path, "train_data_path"),
        sources.manifest_vocab(val_path, "valid_data_path"),
    )
    if cfg.init_from or vocab <= cfg.model.vocab_size:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def _open(cfg: Config, path: str, role: str) -> list[sources.Source]:
    m = cfg.model
    return sources.open_sources(path, role, m.vocab_size, cfg.token_dtype, m.seq_len)


def with_epochs(cfg: Config, n_windows: int) -> Config:
    """--epochs: total_steps from the training data's windows; --continue_on_error: never stop."""
    if cfg.epochs:
        cfg = dataclasses.replace(
            cfg, total_steps=max(1, math.ceil(cfg.epochs * n_windows / global_rows(cfg)))
        )
    if cfg.compat.continue_on_error:
        cfg = dataclasses.replace(cfg, max_bad_steps=cfg.total_steps)
    return cfg
