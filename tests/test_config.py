"""Config: YAML + command line, types, choices, topology errors; and the script's exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain.config import ConfigError, load_config, to_yaml
from jaxtrain.run.job import with_topology

ROOT = Path(__file__).resolve().parents[1]


def test_yaml_then_command_line_wins(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("batch_size: 8\noptim:\n  lr: 1.0e-3\nmodel:\n  n_layer: 3\n")
    cfg = load_config(["--config", str(f), "--batch_size", "64", "--optim.lr=3e-4"])
    assert (cfg.batch_size, cfg.optim.lr, cfg.model.n_layer) == (64, 3e-4, 3)


def test_unique_leaf_names_and_bare_bool_flags():
    cfg = load_config(["--lr", "1e-3", "--n_layer", "6", "--use_wandb", "--seed", "7"])
    assert (cfg.optim.lr, cfg.model.n_layer, cfg.use_wandb, cfg.seed) == (1e-3, 6, True, 7)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(["--batch_size", "24", "--dtype", "bfloat16"])
    f = tmp_path / "c.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(["--config", str(f)]) == cfg


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch_sise", "8"], "unknown config key 'batch_sise' (did you mean 'batch_size'?)"),
        (["--optim.lrr=1"], "did you mean 'optim.lr'"),
        (["--batch_size", "eight"], "'batch_size' must be int, got 'eight'"),
        (["--batch_size", "0"], "'batch_size' must be > 0"),
        (["--dtype", "fp8"], "'dtype' must be one of float32|bfloat16|float16"),
        (
            ["--model.moe.dispatch_dtype", "bf16"],
            "dispatch_dtype' must be one of auto|compute|float8_e4m3fn, got",
        ),
        (["--use_wandb", "maybe"], "'use_wandb' must be bool"),
        (["--n_head", "5"], "d_model 256 is not divisible by model.n_head 5"),
        (
            ["--batch_size", "10", "--gradient_accumulation_steps", "4"],
            "not divisible by gradient_accumulation_steps",
        ),
        (["--total_batch_size", "1000", "--device_batch_size", "2"], "not a multiple of seq_len 256"),
        (["--lr"], "flag --lr needs a value"),
        (["positional"], "unexpected argument 'positional'"),
        (["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml not found"),
    ],
)
def test_bad_config_is_one_clear_error(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_yaml_must_be_a_safe_mapping(tmp_path):
    f = tmp_path / "evil.yaml"
    f.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="uses a YAML tag that would build an object"):
        load_config(["--config", str(f)])


def test_total_batch_size_derives_accumulation():
    cfg = load_config(["--total_batch_size", str(64 * 256), "--device_batch_size", "2"])
    resolved = with_topology(cfg, n_devices=8, n_processes=2)
    assert (resolved.batch_size, resolved.gradient_accumulation_steps) == (64, 4)
    with pytest.raises(ConfigError, match="not divisible by device_batch_size 3 x 8 devices = 24"):
        with_topology(load_config(["--total_batch_size", str(64 * 256), "--device_batch_size", "3"]), 8, 2)


def test_topology_errors_give_the_numbers():
    with pytest.raises(ConfigError, match="global batch_size 30 is not divisible by 4 processes"):
        with_topology(load_config(["--batch_size", "30"]), 8, 4)
    with pytest.raises(ConfigError, match=r"microbatch 6 .* not divisible by 8 devices"):
        with_topology(load_config(["--batch_size", "24", "--gradient_accumulation_steps", "4"]), 8, 1)


def test_train_script_exits_2_with_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), "--batch_sise", "3", "--run_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert (
        out.stderr.strip() == "error: unknown config key 'batch_sise' (did you mean 'batch_size'?); "
        "scripts/train.py --help lists every key"
    )
    assert not list(tmp_path.iterdir())


def test_the_mesh_and_batch_advice_keeps_the_expert_axis_and_knows_one_sequence_a_device():
    """A mesh that does not multiply is told one that does with its expert axis (a mixture of
    experts needs it: the advice repeated the error before); a batch already at one sequence a
    device is not told to change device_batch_size."""
    mixtral = load_config(["--config", "configs/mixtral_8x7b.yaml", "--mesh.fsdp", "3"])
    with pytest.raises(
        ConfigError, match="e.g. --mesh.data -1 --mesh.expert 8 --mesh.fsdp 2 --mesh.tensor 1$"
    ):
        with_topology(mixtral, 16, 2, "gpu")
    window = ["--model.seq_len", "131072", "--total_batch_size", str(4 * 131072)]
    long = load_config(["--config", "configs/llama3_8b.yaml", *window])
    with pytest.raises(ConfigError, match=r"a multiple of 64 sequences, or split the batch fewer ways") as e:
        with_topology(long, 64, 1, "gpu")
    assert "device_batch_size" not in str(e.value).split(";")[1]
