"""What scripts/train.py does, by --task: train (loop.py), test or predict a checkpoint.

Each builds the same run (build.py) as training does, for the checkpoint's model, then does its one
thing.

    --task test --resume_from runs/x/checkpoints/300 [--test_data_path data/test.bin]
        loss and perplexity over every window of the data, on every device of every process;
        printed and written to <run dir>/test_step<N>.json
    --task predict --resume_from runs/x --prompt "def " [--prompt_file F] [--max_new_tokens 256]
        text from the checkpoint's model and its run's tokenizer (KV-cached sampling, process 0);
        printed and written to <run dir>/predict_step<N>.jsonl. No prompt: unconditional samples
        (from the tokenizer's begin-of-text, else a newline); --temperature 0: greedy
    --task chat --resume_from hf:DIR --prompt "What is 2 plus 3?" [--system "Be brief."]
        the prompt (no --prompt: standard input) as a user turn, after the system turn, rendered with
        the tokenizer's chat template; the answer generated up to the end of its turn, printed as
        `prompt -> answer`
    --resume_from hf:DIR reads a Hugging Face model dir (jaxtrain/hf/), its tokenizer.json too
    --model.seq_len N: the window to test or generate in (rotary models: any up to their context)

predict and chat stop at the tokenizer's end-of-text and end-of-turn tokens.

Both read the model shape from the checkpoint's saved config, and change nothing of its run:
the run dir is --run_dir, else the checkpoint's own run dir, which only gains the result file.
"""

from __future__ import annotations

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

from jaxtrain.cluster.detect import LaunchSpec
from jaxtrain.config import Config
from jaxtrain.data import loader, sources
from jaxtrain.data.default import given_paths, run_tokenizer
from jaxtrain.disk.files import require_writable, write_text
from jaxtrain.errors import UserError
from jaxtrain.model.generate import generate
from jaxtrain.observe import metrics
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import evaluate
from jaxtrain.run.build import Run, build
from jaxtrain.run.job import Job
from jaxtrain.run.loop import train
from jaxtrain.run.resolve import Resolved, Trained, resolve
from jaxtrain.run.step import compute_dtype
from jaxtrain.text.chat_template import ChatFormat, stop_tokens
from jaxtrain.tokenizer import BPETokenizer
from jaxtrain.xla_env import compile_cache_dir, enable_compile_cache

log = logging.getLogger("jaxtrain")


def run_task(cfg: Config, launch: LaunchSpec, launch_time: float | None = None) -> Any:
    """Run the configured task (launch: cluster.detect's; launch_time: see loop.train)."""
    # Every task compiles: jax's persistent compile cache is switched on here, once, before any.
    enable_compile_cache(cfg.compile_cache_dir)
    if cfg.task == "test":
        return evaluate_checkpoint(cfg, launch)
    if cfg.task in ("predict", "chat"):
        return predict(cfg, launch)
    return train(cfg, launch, launch_time)


def _start(cfg: Config, launch: LaunchSpec) -> tuple[Run, Trained, Path, Any, Resolved]:
    """Resolve the task's config (its checkpoint's model, its data), join the job, build the run
    once; the output dir, the checkpoint's params and what was resolved."""
    resolved = resolve(cfg)
    cfg, ckpt = resolved.cfg, resolved.trained
    assert ckpt is not None  # every task but train reads a checkpoint (config checks)
    out_dir = Path(cfg.run_dir) if cfg.run_dir else ckpt.run_dir
    require_writable(out_dir, "run dir")
    job = Job.join(cfg, launch)
    metrics.setup_logging(None, job.process_index, cfg.ddp.log_level, cfg.verbose)
    log.info(f"compile cache: {compile_cache_dir() or 'off'}")
    log.info(f"{cfg.task}: checkpoint {ckpt.where}; model {cfg.model}")
    run = build(job)
    run.preflight.say(log)  # the kernels checked at job start (run/verdicts.py)
    params = ckpt.source.restore_params(ckpt.step, run.target.params, "--resume_from")
    return run, ckpt, out_dir, params, resolved


def _windows(source: sources.Source, batch_size: int, pid: int, nproc: int) -> Iterator[np.ndarray]:
    """This process's rows of consecutive batches covering every window (a last partial batch wraps)."""
    rows = loader.process_rows(batch_size, pid, nproc)
    n = source.shards.n_windows
    for b in range(math.ceil(n / batch_size)):
        yield source.shards.read((np.arange(b * batch_size, (b + 1) * batch_size) % n)[rows])


def evaluate_checkpoint(cfg: Config, launch: LaunchSpec) -> dict[str, Any]:
    """--task test: loss and perplexity of a checkpoint on the test data; process 0 writes them as JSON."""
    run, ckpt, out_dir, params, resolved = _start(cfg, launch)
    cfg, job, m = run.cfg, run.job, run.cfg.model
    path, test_sources = resolved.data_path, resolved.val
    t0 = time.perf_counter()
    per_source: dict[str, dict[str, Any]] = {}
    for s in test_sources:
        loss = evaluate.mean_loss(run, params, _windows(s, cfg.batch_size, *mesh_lib.data_share(run.mesh)))
        n_tokens = math.ceil(s.shards.n_windows / cfg.batch_size) * cfg.batch_size * m.seq_len
        per_source[s.name] = {"loss": loss, "perplexity": math.exp(loss), "tokens": n_tokens}
    loss = evaluate.overall({name: r["loss"] for name, r in per_source.items()}, test_sources)
    tokens = sum(r["tokens"] for r in per_source.values())
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
    if job.is_main:
        write_text(out, json.dumps(result, indent=2) + "\n")
    log.info(
        f"test: loss {loss:.4f}, perplexity {math.exp(loss):.3f} over {tokens:,} tokens of {path} "
        f"({time.perf_counter() - t0:.1f} s, {len(job.devices)} devices); written to {out}"
    )
    return result


def _prompts(cfg: Config) -> list[str]:
    if cfg.task == "chat" and not (cfg.prompt or cfg.prompt_file):
        prompt = sys.stdin.read().strip()  # (the newline that ends a typed or echoed line is no part of it)
        if not prompt:
            raise UserError("--task chat: standard input held no prompt; pipe one in or pass --prompt TEXT")
        return [prompt]
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


def _unconditional_start(tokenizer: Any) -> np.ndarray:
    """What a sample without a prompt starts from: the begin-of-text token a tokenizer puts before
    every text (what it encodes "" to), else a newline, as nanoGPT's sample.py does."""
    ids = tokenizer.encode("")
    return ids if len(ids) else tokenizer.encode("\n")


# What --task chat needs and the checkpoint lacks: the flags train.py takes that give it
_CHAT_MODEL = (
    "give --resume_from hf:DIR of a chat model (its tokenizer.json with chat_template.jinja or a "
    "chat_template in tokenizer_config.json), or --resume_from a run trained on data prepared with "
    "scripts/prepare_data.py --chat"
)


def _starts(cfg: Config, tokenizer: Any, prompts: list[str]) -> list[np.ndarray]:
    """The ids each sample starts from: the prompt (--task chat: a user turn after the --system
    turn, rendered with the chat template, its generation prompt last)."""
    if cfg.task != "chat":
        return [tokenizer.encode(p) if p else _unconditional_start(tokenizer) for p in prompts]
    if not isinstance(tokenizer, BPETokenizer):
        raise UserError(
            f"--task chat: the model's tokenizer is bytes, which have no chat template; {_CHAT_MODEL}"
        )
    chat = ChatFormat(tokenizer, _CHAT_MODEL)
    return [tokenizer.encode_offsets(chat.prompt(p, cfg.system))[0] for p in prompts]


def _shown(cfg: Config, record: dict[str, Any]) -> str:
    """A sample as a person reads it: predict's continuation right after its prompt; chat's
    prompt -> answer (the arrow on a line of its own after a prompt of several lines)."""
    if cfg.task != "chat":
        return record["prompt"] + record["completion"]
    system = f"(system: {cfg.system})\n" if cfg.system else ""
    arrow = "\n-> " if "\n" in record["prompt"] else " -> "
    return f"{system}{record['prompt']}{arrow}{record['completion'].strip()}"


def predict(cfg: Config, launch: LaunchSpec) -> list[dict[str, Any]]:
    """Generate after each prompt with the checkpoint's model (--task chat: rendered as a user
    turn of its chat template); process 0 prints and writes them."""
    if cfg.system and cfg.task != "chat":
        raise UserError(f"--system is the system turn of --task chat; --task {cfg.task} takes none")
    prompts = _prompts(cfg)
    run, ckpt, out_dir, params, _ = _start(cfg, launch)
    cfg = run.cfg
    train_path = given_paths(ckpt.saved, cfg)[0]
    # A Hugging Face model dir's own tokenizer.json, else the one beside the training data.
    tokenizer = run_tokenizer(train_path, cfg.model.vocab_size, own=ckpt.saved.get("tokenizer", ""))
    if tokenizer is None:
        raise UserError(
            f"the checkpoint's model has vocab_size {cfg.model.vocab_size} but no tokenizer.json sits beside "
            f"its training data {train_path or '(the embedded byte dataset)'}; put the tokenizer there"
        )
    starts = _starts(cfg, tokenizer, prompts)  # a template that refuses the turns: refused before sampling
    stop = stop_tokens(tokenizer)
    params = mesh_lib.host_copy(params)  # a collective: every process takes part
    if not run.job.is_main:
        return []
    records = []
    for i, (prompt, ids) in enumerate(zip(prompts, starts, strict=True)):
        t0 = time.perf_counter()
        new = generate(
            params, cfg.model, ids.astype(np.int32), cfg.max_new_tokens,
            jax.random.fold_in(jax.random.key(cfg.seed), i), temperature=cfg.temperature,
            top_k=cfg.top_k or None, dtype=compute_dtype(cfg), stop=stop,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        record = {"checkpoint": str(ckpt.where), "prompt": prompt, "completion": tokenizer.decode(new)}
        records.append(record | ({"system": cfg.system} if cfg.system else {}) | {"tokens": len(new)})
        print(
            f"--- {ckpt.where}, prompt {i + 1}/{len(prompts)}: {len(new)} tokens "
            f"({len(new) / seconds:,.0f} tokens/s)\n{_shown(cfg, records[-1])}"
        )
    out = out_dir / f"{cfg.task}_step{ckpt.step}.jsonl"
    write_text(out, "".join(json.dumps(r) + "\n" for r in records))
    what = "answer" if cfg.task == "chat" else "completion"
    counts = ", ".join(str(r["tokens"]) for r in records)
    log.info(
        f"{cfg.task}: {len(records)} {what}{'s' * (len(records) > 1)} of {counts} tokens "
        f"(--max_new_tokens {cfg.max_new_tokens}) written to {out}"
    )
    return records
