"""The habits of seeds 002/003 as a user types them: --task test|predict, --init_from, Muon, --depth.

One tiny run (Muon under fsdp 4 x tensor 2 on 8 fake devices) is trained once; the tasks read it.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml"]


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/train.py", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tasks")
    # Byte-level text: this package's own source, 9/10 to train on, the rest to validate.
    text = np.frombuffer(b"".join(p.read_bytes() for p in sorted((ROOT / "jaxtrain").glob("*.py"))), np.uint8)
    cut = len(text) * 9 // 10
    text[:cut].astype(np.uint16).tofile(tmp / "train.bin")
    text[cut:].astype(np.uint16).tofile(tmp / "val.bin")
    run_dir = tmp / "run"
    out = _script(
        *TINY, "--run_dir", str(run_dir), "--optim.name", "muon", "--mesh.fsdp", "4", "--mesh.tensor", "2",
        "--train_data_path", str(tmp / "train.bin"), "--valid_data_path", str(tmp / "val.bin"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_muon_trains_under_fsdp_and_tensor(trained):
    losses = [r["loss"] for r in _records(trained) if "loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses
    # The model-info log lists parameters per module.
    log = (trained / "train.log").read_text()
    assert "block_0..1 (each)" in log and "attn 16,384" in log and "wte" in log


@pytest.mark.slow
def test_task_test_writes_loss_and_perplexity_and_leaves_the_run_alone(trained):
    before = _snapshot(trained)
    out = _script(
        "--task", "test", "--resume_from", str(trained / "checkpoints" / "20"), "--batch_size", "64"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((trained / "test_step20.json").read_text())
    assert result["step"] == 20 and result["tokens"] > 0
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    # Every window of the validation file, so close to (not equal to) the run's sampled val_loss.
    val_loss = [r["val_loss"] for r in _records(trained) if "val_loss" in r][-1]
    assert abs(result["loss"] - val_loss) < 0.3, (result["loss"], val_loss)
    assert f"perplexity {result['perplexity']:.3f}" in out.stdout
    after = _snapshot(trained)
    assert after.pop("test_step20.json") and after == before


@pytest.mark.slow
def test_task_predict_from_prompt_and_prompt_file(trained, tmp_path):
    out = _script(
        "--task", "predict", "--resume_from", str(trained), "--prompt", "def main", "--max_new_tokens", "24",
        "--top_k", "1", "--run_dir", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "predict_step20.jsonl").read_text().splitlines()]
    assert record["prompt"] == "def main" and record["tokens"] == 24
    assert "def main" + record["completion"] in out.stdout
    assert "read_only" not in out.stderr  # orbax's notes on opening the checkpoint read-only

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n\nclass A:\n")
    out = _script(
        "--task", "predict", "--resume_from", str(trained), "--prompt_file", str(prompts),
        "--max_new_tokens", "8", "--run_dir", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "predict_step20.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["import os", "class A:"]
    assert all(r["tokens"] == 8 for r in records) and "prompt 2/2" in out.stdout
    assert "predict: 2 completions of 8, 8 tokens (--max_new_tokens 8) written to" in out.stdout + out.stderr


@pytest.mark.slow
def test_init_from_starts_a_new_run_from_trained_params(trained, tmp_path):
    new = tmp_path / "new"
    data = ["--train_data_path", str(trained.parent / "train.bin")]
    out = _script(*TINY, *data, "--init_from", str(trained), "--run_dir", str(new), "--total_steps", "5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(--init_from); optimizer and step start afresh" in out.stdout
    first = [r for r in _records(trained) if "loss" in r][0]  # step 5 of the run it starts from
    start = [r for r in _records(new) if r.get("event") == "start"][0]
    assert start["step"] == 0
    (five,) = [r for r in _records(new) if "loss" in r]
    assert five["step"] == 5 and five["loss"] < first["loss"] - 0.5, (five, first)


@pytest.mark.slow
def test_init_from_with_another_model_shape_is_a_one_line_error(trained, tmp_path):
    data = ["--train_data_path", str(trained.parent / "train.bin")]
    out = _script(
        *TINY, *data, "--init_from", str(trained), "--run_dir", str(tmp_path / "x"), "--d_model", "32"
    )
    assert out.returncode == 2, out.stderr[-3000:]
    # (orbax's absl warnings about opening the checkpoint read-only precede it)
    lines = [line for line in out.stderr.strip().splitlines() if not line.startswith("WARNING:absl")]
    assert len(lines) == 1 and lines[0].startswith("error: --init_from "), out.stderr
    assert "param block_0/attn/out/kernel is [2, 32, 64] there, [2, 16, 32] in this model" in lines[0]
    assert not (tmp_path / "x" / "checkpoints").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--task", "test"], "--task test needs --resume_from"),
        (
            ["--task", "predict", "--resume_from", "x", "--prompt", "a", "--prompt_file", "f"],
            "--task predict takes --prompt TEXT or --prompt_file FILE",
        ),
        (
            ["--init_from", "x", "--task", "test", "--resume_from", "y"],
            "--init_from starts a new training run",
        ),
        (["--task", "eval"], "'task' must be one of train|test|predict"),
        (["--optim.name", "lion"], "'optim.name' must be one of adamw|muon"),
        (["--depth", "5"], "--depth 5 gives d_model 320, which 3 heads of ~128 do not divide"),
        # Other configs' names for a key are suggested in its section (not the closest spelling)
        (["--model.moe.top_k", "2"], "did you mean 'model.moe.experts_per_token'"),
        (["--num_experts_per_tok", "2"], "did you mean 'model.moe.experts_per_token'"),
        (["--model.num_hidden_layers", "2"], "did you mean 'model.n_layer'"),
    ],
)
def test_bad_task_flags_are_one_line_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|")):
        load_config(TINY + argv)


def test_help_says_what_the_sampling_keys_do_for_predict_and_chat():
    from jaxtrain.config.load import help_text

    keys = {line.split()[0]: line for line in help_text().splitlines() if line.startswith("  --")}
    assert "0 = greedy" in keys["--temperature"] and "chat" in keys["--temperature"]
    assert "chat" in keys["--max_new_tokens"] and "--task chat" in keys["--system"]
    assert "jaxtrain/data/sources.py" in help_text() and " jaxtrain/sources.py" not in help_text()


def test_depth_sizes_the_model_as_nanochat_and_explicit_keys_win():
    cfg = load_config(TINY + ["--depth", "4", "--max_seq_len", "64"])
    m = cfg.model
    assert (m.n_layer, m.d_model, m.n_head, m.seq_len) == (4, 256, 2, 64)  # width 64 x depth, heads of 128
    assert cfg.optim.lr == pytest.approx(0.004 * (256 / 768) ** -0.5)  # AdamW lr ~ 1/sqrt(width)
    cfg = load_config(TINY + ["--depth", "4", "--model.n_head", "4", "--lr", "1e-3"])
    assert (cfg.model.d_model, cfg.model.n_head, cfg.optim.lr) == (256, 4, 1e-3)
