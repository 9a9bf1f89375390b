"""One job, resolved once (jaxtrain/run/resolve.py): the planner compiles the program training runs
for framed data, --task test builds once, test/predict/chat run on 1, 2, 4 and 8 devices, and what
the data or a checkpoint says is checked against what the user gave before anything is written.

    pytest tests/test_resolve.py
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from chat_tokenizers import make_tokenizer_dir
from processes import clean_env

from jaxtrain.cluster.detect import detect
from jaxtrain.config import ConfigError, DistConfig, load_config
from jaxtrain.errors import DataError
from jaxtrain.plan import cli as plan_cli
from jaxtrain.prepare.chat import prepare_chat
from jaxtrain.prepare.shards import prepare_corpus
from jaxtrain.run import tasks
from jaxtrain.run.build import build
from jaxtrain.run.job import Job
from jaxtrain.run.loop import train
from jaxtrain.run.resolve import resolve
from jaxtrain.tokenizer import BPETokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen_framed(tmp_path_factory) -> tuple[Path, BPETokenizer]:
    """A manifest framed as GPT-2 and Qwen frame documents: an end-of-text token after each."""
    root = tmp_path_factory.mktemp("framed")
    tokenizer = make_tokenizer_dir(root / "tok", "qwen2")
    texts = root / "texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"{i:02d}.txt").write_text(f"document {i}: " + "some words and more words. " * (3 + i % 5))
    prepare_corpus([texts], root / "data", tokenizer=str(tokenizer), val_fraction=0.1)
    return root / "data" / "manifest.json", BPETokenizer.from_file(tokenizer)


def _lowered(cfg) -> str:
    run = build(Job.of_devices(cfg, jax.devices()))
    return run.train_step.lower(run.target, run.batch_shape).as_text()


def test_the_planner_compiles_the_program_training_runs_for_framed_data(qwen_framed):
    """scripts/plan.py's config (plan/cli.py: job_config) is training's: the manifest's end-of-text
    token masks attention in both; without the data's framing the program is another one."""
    manifest, tok = qwen_framed
    argv = ["--config", "configs/tiny.yaml", "--model.vocab_size", str(tok.vocab_size),
            "--train_data_path", str(manifest), "--model.seq_len", "16", "--batch_size", "8"]  # fmt: skip
    trained = resolve(load_config(argv)).cfg
    planned = plan_cli.job_config(argv, "")
    assert planned == trained
    assert (planned.model.doc_bos, planned.model.doc_eos) == (-1, tok.framing.eos)
    program = _lowered(planned)
    assert program == _lowered(trained)
    unframed = dataclasses.replace(planned, model=dataclasses.replace(planned.model, doc_eos=-1))
    assert program != _lowered(unframed)  # what plan.py compiled before: no document mask


def test_boundary_tokens_are_checked_against_the_vocabulary_the_data_and_document_mask(qwen_framed):
    manifest, tok = qwen_framed
    base = ["--config", "configs/tiny.yaml", "--model.seq_len", "16", "--train_data_path", str(manifest),
            "--model.vocab_size", str(tok.vocab_size)]  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.doc_eos 9999 is not a token of the \d+-token vocabulary"):
        load_config([*base, "--model.doc_eos", "9999"])
    with pytest.raises(ConfigError, match="document_mask off but model.doc_bos 3"):
        load_config([*base, "--model.doc_bos", "3", "--document_mask", "off"])
    given = load_config([*base, "--model.doc_eos", "5"])
    with pytest.raises(DataError, match=r"doc_eos 5 but data source .* is framed with bos None, eos \d+"):
        resolve(given)
    same = resolve(load_config([*base, "--model.doc_eos", str(tok.framing.eos)])).cfg
    assert same.model.doc_eos == tok.framing.eos
    off = resolve(load_config([*base, "--document_mask", "off"])).cfg
    assert (off.model.doc_bos, off.model.doc_eos) == (-1, -1)


def test_the_vocabulary_comes_from_the_manifest_where_the_config_has_fewer(qwen_framed):
    """prepare_data.py's printed command gives no --model.vocab_size: tiny.yaml's 256 is raised to
    the manifest's tokenizer's; a larger (padded) one stays."""
    manifest, tok = qwen_framed
    base = ["--config", "configs/tiny.yaml", "--model.seq_len", "16", "--train_data_path", str(manifest)]
    assert tok.vocab_size > 256 and resolve(load_config(base)).cfg.model.vocab_size == tok.vocab_size
    padded = resolve(load_config([*base, "--model.vocab_size", str(tok.vocab_size + 50)])).cfg
    assert padded.model.vocab_size == tok.vocab_size + 50


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> tuple[Path, BPETokenizer]:
    """A tiny run on Llama-3-style conversations (framed, masked), its checkpoint at step 2."""
    root = tmp_path_factory.mktemp("chatrun")
    tokenizer = make_tokenizer_dir(root / "tok", "llama3")
    rows = [{"messages": [{"role": "user", "content": f"{a} plus {a}?"},
                          {"role": "assistant", "content": f"{2 * a}"}]} for a in range(60)]  # fmt: skip
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare_chat([root / "chats.jsonl"], root / "data", str(tokenizer), seq_len=32, val_fraction=0.1)
    tok = BPETokenizer.from_file(tokenizer)
    cfg = load_config([
        "--config", "configs/tiny.yaml", "--train_data_path", str(data.manifest_path),
        "--model.seq_len", "32", "--model.vocab_size", str(tok.vocab_size), "--model.n_layer", "1",
        "--batch_size", "8", "--total_steps", "2", "--eval_interval", "0", "--checkpoint_interval", "2",
        "--run_dir", str(root / "run"),
    ])  # fmt: skip
    train(cfg, detect(DistConfig(), {}))
    return root / "run", tok


def test_a_run_on_framed_data_is_relaunched_against_its_resolved_config(chat_run, capsys):
    """The run dir is compared with the config as resolved from the data, as it was saved: a relaunch
    was refused as a different config (model.doc_bos: its begin-of-text -> -1, set from the manifest).
    Without --model.vocab_size (the manifest's) and complete at step 2: one line, nothing written."""
    run_dir, tok = chat_run
    cfg = load_config([
        "--config", "configs/tiny.yaml", "--train_data_path", str(run_dir.parent / "data" / "manifest.json"),
        "--model.seq_len", "32", "--model.n_layer", "1", "--batch_size", "8", "--total_steps", "2",
        "--eval_interval", "0", "--checkpoint_interval", "2", "--run_dir", str(run_dir),
    ])  # fmt: skip
    assert train(cfg, detect(DistConfig(), {})).final_step == 2
    assert f"{run_dir} is complete at step 2" in capsys.readouterr().out


def test_task_test_takes_the_runs_mask_and_boundaries_and_builds_once(chat_run, monkeypatch):
    run_dir, tok = chat_run
    builds = []
    monkeypatch.setattr(tasks, "build", lambda job: builds.append(job) or build(job))
    result = tasks.run_task(
        load_config(["--task", "test", "--resume_from", str(run_dir / "checkpoints")]),
        detect(DistConfig(), {}),
    )
    (job,) = builds
    assert job.cfg.loss_mask and job.cfg.model.doc_bos == tok.token_id("<|begin_of_text|>")
    assert result["loss"] == pytest.approx(json.loads((run_dir / "test_step2.json").read_text())["loss"])


_TASKS = """
import json, sys
from jaxtrain.cluster.detect import detect
from jaxtrain.config import DistConfig, load_config
from jaxtrain.run.tasks import run_task
ckpt, out, data = sys.argv[1:]
launch = detect(DistConfig(), {})
common = ["--resume_from", ckpt, "--run_dir", out, "--max_new_tokens", "4", "--temperature", "0"]
loss = run_task(load_config(["--task", "test", "--test_data_path", data, *common]), launch)["loss"]
(predicted,) = run_task(load_config(["--task", "predict", "--prompt", "3 plus", *common]), launch)
(chatted,) = run_task(load_config(["--task", "chat", "--prompt", "3 plus 3?", *common]), launch)
print(json.dumps({"loss": loss, "predict": predicted["completion"], "chat": chatted["completion"]}))
"""


def test_test_predict_and_chat_give_the_same_on_1_2_4_and_8_devices(chat_run, tmp_path):
    """XLA:CPU deadlocked --task test on 2 and 4 devices (eval steps dispatched all at once)."""
    run_dir, _ = chat_run
    ckpt = str(run_dir / "checkpoints")
    # 256 batches: it took over 32 (eval steps in flight at once) for the deadlock to show.
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 256 * 8 * 33 + 1).astype(np.uint16).tofile(tmp_path / "test.bin")
    results = {}
    for n in (1, 2, 4):
        done = subprocess.run(
            [sys.executable, "-c", _TASKS, ckpt, str(tmp_path / str(n)), str(tmp_path / "test.bin")],
            cwd=REPO, env=clean_env(n), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results[n] = json.loads(done.stdout.strip().splitlines()[-1])
    namespace: dict = {}
    argv, sys.argv = sys.argv, ["-c", ckpt, str(tmp_path / "8"), str(tmp_path / "test.bin")]
    try:
        exec(_TASKS, namespace)  # 8 devices: this process's
    finally:
        sys.argv = argv
    results[8] = {"loss": namespace["loss"], "predict": namespace["predicted"]["completion"],
                  "chat": namespace["chatted"]["completion"]}  # fmt: skip
    for n in (1, 4, 8):
        assert results[n]["loss"] == pytest.approx(results[2]["loss"], rel=1e-5), results
        assert (results[n]["predict"], results[n]["chat"]) == (results[2]["predict"], results[2]["chat"])
    assert np.isfinite(results[1]["loss"])


def test_a_loss_mask_cut_short_is_one_line_before_the_run_dir_is_made(chat_run, tmp_path):
    import shutil

    run_dir, tok = chat_run
    data = tmp_path / "data"
    shutil.copytree(run_dir.parent / "data", data)
    (mask,) = data.glob("train*.mask")
    mask.write_bytes(mask.read_bytes()[:-10])
    cfg = load_config([
        "--config", "configs/tiny.yaml", "--train_data_path", str(data / "manifest.json"),
        "--model.seq_len", "32", "--model.vocab_size", str(tok.vocab_size),
        "--run_dir", str(tmp_path / "run"),
    ])  # fmt: skip
    with pytest.raises(
        DataError, match=r"loss mask .*train.*\.mask holds [\d,]+ bytes but .* holds [\d,]+ tokens"
    ):
        train(cfg, detect(DistConfig(), {}))
    assert not (tmp_path / "run").exists()
