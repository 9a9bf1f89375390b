"""The users' guides' last commands (../shared/seeds), as they are written, paths and sizes aside.

seed 000, method C:  python train_distributed.py --distributed --world_size 4 ...
seed 003:            a YAML holding `ddp: {enabled: true, log_level: "INFO"}`
seed 000, wandb:     --use_wandb --wandb_project P --wandb_run_name N, on a machine never logged in
"""

import subprocess
import sys
from pathlib import Path

import pytest
from processes import clean_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", "--total_steps", "4", "--eval_interval", "0", "--log_interval", "2"]

pytestmark = pytest.mark.slow


def _train(*argv: str, devices: int = 2, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/train.py", *argv], cwd=ROOT, env=clean_env(devices, **env),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in out.stderr + out.stdout
    return line


def test_world_size_in_one_process_trains_on_that_many_local_devices(tmp_path):
    out = _train("--distributed", "--world_size", "2", *TINY, "--run_dir", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 process(es) x 2 cpu device(s)" in out.stdout
    assert "--world_size 2: in JAX one process drives every local device" in out.stdout
    fewer = _train("--distributed", "--world_size", "1", *TINY, "--run_dir", str(tmp_path / "b"))
    assert fewer.returncode == 0 and "1 process(es) x 1 cpu device(s)" in fewer.stdout, fewer.stderr[-3000:]
    line = _one_line_error(
        _train("--distributed", "--world_size", "4", *TINY, "--run_dir", str(tmp_path / "c"))
    )
    assert (
        "--world_size 4 but this process has 2 cpu device(s)" in line
        and "torchrun --nproc_per_node=4" in line
    )
    assert not list((tmp_path / "c").glob("*")), "the refused run wrote into its run dir"


def test_a_ddp_section_in_the_yaml_is_accepted(tmp_path):
    config = tmp_path / "ddp_example.yaml"
    base = (ROOT / "configs/tiny.yaml").read_text()
    config.write_text(base + '\nddp:\n  enabled: true\n  log_level: "INFO"\n')
    out = _train("--config", str(config), "--task", "train", *TINY[2:], "--run_dir", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr[-3000:]
    config.write_text(base + "\nddp:\n  enabled: false\n")
    refused = subprocess.run(
        [sys.executable, "scripts/run_distributed.py", "--mode", "manual", "--world-size", "2", "--",
         "--config", str(config), *TINY[2:], "--run_dir", str(tmp_path / "b")],
        cwd=ROOT, env=clean_env(1), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "ddp.enabled is false but this job has 2 processes" in refused.stderr
    assert not (tmp_path / "b").exists()


def test_wandb_without_a_key_is_refused_before_anything_is_written(tmp_path):
    home = tmp_path / "home"  # no ~/.netrc: never `wandb login`
    home.mkdir()
    argv = ["--use_wandb", "--wandb_project", "my-transformer", "--wandb_run_name", "4gpu-bf16-experiment"]
    out = _train(*argv, *TINY, "--run_dir", str(tmp_path / "run"), HOME=str(home), WANDB_MODE="")
    line = _one_line_error(out)
    assert "no wandb API key" in line and "wandb login" in line and "--wandb_mode offline" in line
    assert not (tmp_path / "run").exists()


def test_wandb_whose_server_cannot_be_reached_logs_offline_and_training_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    out = _train(
        "--use_wandb", "--wandb_project", "p", *TINY, "--run_dir", str(run_dir),
        WANDB_MODE="", WANDB_API_KEY="x" * 40, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_INIT_TIMEOUT="10",
        HOME=str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wandb: cannot reach its server" in out.stdout + out.stderr
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb files"
    assert '"step": 4' in (run_dir / "metrics.jsonl").read_text()
