"""What scripts/train.py does, by --task: train (loop.py), test or predict a checkpoint.

    --task test --resume_from runs/x/checkpoints/300 [--test_data_path data/test.bin]
        loss and perplexity over every window of the data, on every device of every process;
        printed and written to <run dir>/test_step<N>.json
    --task predict --resume_from runs/x --prompt "def " [--prompt_file F] [--max_new_tokens 256]
        text from the checkpoint's model and its run's tokenizer (KV-cached sampling, process 0);
        printed and written to <run dir>/predict_step<N>.jsonl. No prompt: unconditional samples
        (from the tokenizer's begin-of-text, else a newline); --temperature 0: greedy
    --resume_from hf:DIR reads a Hugging Face model dir (jaxtrain/hf/), its tokenizer.json too

Both read the model shape from the checkpoint's saved config, and change nothing of its run:
the run dir is --run_dir, else the checkpoint's own run dir, which only gains the result file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtrain import config as config_lib
from jaxtrain import data, sources
from jaxtrain import mesh as mesh_lib
from jaxtrain.cluster import join
from jaxtrain.config import Config, ModelConfig
from jaxtrain.errors import UserError
from jaxtrain.files import require_writable, write_text
from jaxtrain.hf import load as hf_load
from jaxtrain.loop import train
from jaxtrain.model import GPT, generate
from jaxtrain.optim import make_optimizer
from jaxtrain.state import abstract_state, state_sharding
from jaxtrain.step import compute_dtype, jit_steps
from jaxtrain.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer

log = logging.getLogger("jaxtrain")


def run(cfg: Config, launch_time: float | None = None) -> Any:
    """Run the configured task (launch_time: see loop.train)."""
    if cfg.task == "test":
        return test(cfg)
    if cfg.task == "predict":
        return predict(cfg)
    return train(cfg, launch_time)


@dataclasses.dataclass
class _Checkpoint:
    source: hf_load.ParamSource
    step: int
    saved: dict[str, Any]  # the config the checkpoint was written with

    @property
    def where(self) -> Path:
        return self.source.directory / str(self.step)

    @property
    def run_dir(self) -> Path:
        d = self.source.directory
        return d.parent if d.name == "checkpoints" else d


def _start(cfg: Config) -> tuple[Config, _Checkpoint, Path]:
    """Join the job, open the checkpoint, take its model shape; the output dir."""
    join.initialize(cfg.dist)
    _log_to_terminal(jax.process_index())
    source, step = hf_load.open_checkpoint(cfg.resume_from, "--resume_from")
    ckpt = _Checkpoint(source, step, source.read_meta(step).get("config", {}))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in ckpt.saved.get("model", {}).items() if k in fields})
    cfg = dataclasses.replace(cfg, model=model)
    config_lib.check(cfg)
    out_dir = Path(cfg.run_dir) if cfg.run_dir else ckpt.run_dir
    require_writable(out_dir, "run dir")
    log.info(f"{cfg.task}: checkpoint {ckpt.where}; model {model}")
    return cfg, ckpt, out_dir


def _log_to_terminal(process_index: int) -> None:
    """Process 0 logs INFO to stdout, others warnings to stderr; no log file in any run dir."""
    root = logging.getLogger("jaxtrain")
    root.handlers.clear()
    root.propagate = False
    handler = logging.StreamHandler(sys.stdout if process_index == 0 else sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if process_index == 0 else logging.WARNING)


def _params(cfg: Config, mesh: Mesh, ckpt: _Checkpoint) -> tuple[Any, Any, GPT]:
    """The checkpoint's params laid out on the mesh, the train state's shardings, and the model."""
    model, tx = GPT(cfg.model, dtype=compute_dtype(cfg)), make_optimizer(cfg)
    abstract = abstract_state(cfg, model, tx)
    shardings = state_sharding(mesh, abstract, cfg.mesh.zero1)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract.params, shardings.params
    )
    return ckpt.source.restore_params(ckpt.step, target, "--resume_from"), shardings, model


def _test_path(cfg: Config, saved: dict[str, Any]) -> str:
    """--test_data_path, else --valid_data_path, else the checkpoint run's validation data."""
    path = cfg.test_data_path or cfg.valid_data_path
    path = path or saved.get("valid_data_path") or saved.get("train_data_path") or ""
    return path or str(data.default_dataset()[1])


def _windows(source: sources.Source, batch_size: int, pid: int, nproc: int) -> Iterator[np.ndarray]:
    """This process's rows of consecutive batches covering every window (a last partial batch wraps)."""
    rows = data.process_rows(batch_size, pid, nproc)
    n = source.shards.n_windows
    for b in range(math.ceil(n / batch_size)):
        yield source.shards.read((np.arange(b * batch_size, (b + 1) * batch_size) % n)[rows])


def test(cfg: Config) -> dict[str, Any]:
    """Loss and perplexity of a checkpoint on the test data; process 0 writes them as JSON."""
    cfg, ckpt, out_dir = _start(cfg)
    path = _test_path(cfg, ckpt.saved)
    seq = cfg.model.seq_len
    test_sources = sources.open_sources(path, "val", cfg.model.vocab_size, cfg.token_dtype, seq)
    cfg = config_lib.with_topology(cfg, jax.device_count(), jax.process_count(), jax.devices()[0].platform)
    mesh = mesh_lib.make_mesh(shape=cfg.mesh)
    params, shardings, model = _params(cfg, mesh, ckpt)
    _, evaluate = jit_steps(cfg, model, make_optimizer(cfg), mesh, shardings)
    pid, nproc = jax.process_index(), jax.process_count()
    t0 = time.perf_counter()
    per_source = {}
    for s in test_sources:
        losses = [
            evaluate(params, mesh_lib.global_batch(rows, mesh, cfg.batch_size))
            for rows in _windows(s, cfg.batch_size, pid, nproc)
        ]
        loss = float(np.mean(jax.device_get(losses)))
        per_source[s.name] = {
            "loss": loss,
            "perplexity": math.exp(loss),
            "tokens": len(losses) * cfg.batch_size * seq,
        }
    tokens = sum(r["tokens"] for r in per_source.values())
    loss = sum(r["loss"] * r["tokens"] for r in per_source.values()) / tokens
    result = {
        "task": "test",
        "checkpoint": str(ckpt.where),
        "step": ckpt.step,
        "data": path,
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": tokens,
        "sources": per_source,
    }
    out = out_dir / f"test_step{ckpt.step}.json"
    if pid == 0:
        write_text(out, json.dumps(result, indent=2) + "\n")
    log.info(
        f"test: loss {loss:.4f}, perplexity {math.exp(loss):.3f} over {tokens:,} tokens of {path} "
        f"({time.perf_counter() - t0:.1f} s, {jax.device_count()} devices); written to {out}"
    )
    return result


def _prompts(cfg: Config) -> list[str]:
    if not cfg.prompt_file:
        return [cfg.prompt]  # "" samples unconditionally
    try:
        lines = Path(cfg.prompt_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompt_file {cfg.prompt_file}: cannot read it ({e.__class__.__name__})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"--prompt_file {cfg.prompt_file} holds no prompt; write one prompt a line")
    return prompts


def _tokenizer(cfg: Config, saved: dict[str, Any]) -> Any:
    """The tokenizer of the checkpoint run's training data (tokenizer.json beside it, else bytes)."""
    if saved.get("tokenizer"):  # a Hugging Face model dir's own
        return BPETokenizer.from_file(saved["tokenizer"])
    train_path = str(saved.get("train_data_path") or "")
    tokenizer = load_tokenizer(train_path) if train_path else ByteTokenizer()
    if isinstance(tokenizer, ByteTokenizer) and cfg.model.vocab_size != ByteTokenizer.vocab_size:
        raise UserError(
            f"the checkpoint's model has vocab_size {cfg.model.vocab_size} but no tokenizer.json sits beside "
            f"its training data {train_path or '(the embedded byte dataset)'}; put the tokenizer there"
        )
    return tokenizer


def _unconditional_start(tokenizer: Any) -> np.ndarray:
    """What a sample without a prompt starts from: the begin-of-text token a tokenizer puts before
    every text (what it encodes "" to), else a newline, as nanoGPT's sample.py does."""
    ids = tokenizer.encode("")
    return ids if len(ids) else tokenizer.encode("\n")


def predict(cfg: Config) -> list[dict[str, Any]]:
    """Generate after each prompt with the checkpoint's model; process 0 prints and writes them."""
    cfg, ckpt, out_dir = _start(cfg)
    prompts, tokenizer = _prompts(cfg), _tokenizer(cfg, ckpt.saved)
    cfg = config_lib.with_topology(cfg, jax.device_count(), jax.process_count(), jax.devices()[0].platform)
    mesh = mesh_lib.make_mesh(shape=cfg.mesh)
    params = mesh_lib.host_copy(_params(cfg, mesh, ckpt)[0])  # a collective: every process takes part
    if jax.process_index() != 0:
        return []
    records = []
    for i, prompt in enumerate(prompts):
        ids = (tokenizer.encode(prompt) if prompt else _unconditional_start(tokenizer)).astype(np.int32)
        t0 = time.perf_counter()
        new = generate(
            params, cfg.model, ids, cfg.max_new_tokens, jax.random.fold_in(jax.random.key(cfg.seed), i),
            temperature=cfg.temperature, top_k=cfg.top_k or None, dtype=compute_dtype(cfg),
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        completion = tokenizer.decode(new)
        records.append(
            {"checkpoint": str(ckpt.where), "prompt": prompt, "completion": completion, "tokens": len(new)}
        )
        print(
            f"--- {ckpt.where}, prompt {i + 1}/{len(prompts)} ({len(new) / seconds:,.0f} tokens/s)\n"
            f"{prompt}{completion}"
        )
    out = out_dir / f"predict_step{ckpt.step}.jsonl"
    write_text(out, "".join(json.dumps(r) + "\n" for r in records))
    log.info(f"predict: {len(records)} completion(s) of {cfg.max_new_tokens} tokens written to {out}")
    return records
