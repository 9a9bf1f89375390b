"""Hugging Face models in and out, checked by transformers itself (jaxtrain/hf/).

Tiny random models of each family are made with transformers' own classes and save_pretrained;
jaxtrain imports them (logits, --task test's loss), exports them back (same tensors, which
transformers loads), and a model fine-tuned here from an import under fsdp 2 exports to a dir
transformers loads, with the same logits and the same
greedy tokens as --task predict --temperature 0.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from jaxtrain.config import ModelConfig, load_config, saved_model, to_dict
from jaxtrain.disk import checkpoint as ckpt_lib
from jaxtrain.errors import UserError
from jaxtrain.hf import config as hf_config
from jaxtrain.hf.config import with_hf_model
from jaxtrain.hf.export import byte_tokenizer_json, export
from jaxtrain.hf.load import HFCheckpoint
from jaxtrain.model.params import param_count
from jaxtrain.model.transformer import GPT
from jaxtrain.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=5000.0)),  # GQA, untied head
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),  # q/k norms, head_dim 32 != 64 / 4
    "mistral": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=1, sliding_window=None)),
    # Llama 3.1's rotary scaling, an original context of 16 so positions 0..39 use all three bands
    "llama3.1": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),  # fmt: skip
}


def _script(name: str, *args: str, devices: int = 8) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run(
        [sys.executable, f"scripts/{name}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each family saved by transformers, params nudged off their init (norm scales of 1, zero
    biases would hide a misplaced tensor); the byte tokenizer beside it."""
    tmp = tmp_path_factory.mktemp("hf")
    out = {}
    for family, (config_cls, model_cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**COMMON, **extra})).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(tmp / family)
        (tmp / family / "tokenizer.json").write_text(byte_tokenizer_json())
        out[family] = (tmp / family, model)
    return out


def _import(directory: Path | str) -> tuple[ModelConfig, dict]:
    """The model and its params on one device: from a HF dir, or a checkpoint of ours (a str)."""
    source, step = (
        (HFCheckpoint(directory, "x"), 0)
        if isinstance(directory, Path)
        else ckpt_lib.open_checkpoint(directory, "x")
    )
    cfg = saved_model(source.read_meta(step)["config"])  # a saved config's model (moe nested)
    abstract = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))[
        "params"
    ]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    return cfg, source.restore_params(step, target, "x")


@pytest.mark.parametrize("family", FAMILIES)
def test_import_gives_transformers_logits_and_export_gives_back_the_same_tensors(hf_models, family, tmp_path):
    directory, model = hf_models[family]
    cfg, params = _import(directory)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    ours = np.asarray(GPT(cfg).apply({"params": params}, jnp.asarray(tokens, jnp.int32)))
    theirs = _torch_logits(model, tokens)
    print(f"{family}: max |logit difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    # Saved as a checkpoint of ours, then exported: every tensor comes back as it was.
    ckpt = ckpt_lib.Checkpointer(tmp_path / "checkpoints", 1)
    ckpt.save(0, {"params": params}, {"config": {"model": to_dict(cfg)}})
    ckpt.wait()
    result = export(str(tmp_path / "checkpoints"), tmp_path / "out")
    assert result["architecture"] == (model.config.architectures[0].replace("Mistral", "Llama"))
    before, after = (
        load_file(directory / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        np.testing.assert_array_equal(after[name], tensor, err_msg=name)
    # What transformers' load warnings report: no missing, unexpected or mismatched keys.
    exported, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    np.testing.assert_allclose(_torch_logits(exported.eval(), tokens), theirs, atol=1e-6, rtol=0)


def test_task_test_gives_the_loss_transformers_computes(hf_models, tmp_path):
    directory, model = hf_models["qwen3"]
    seq = 64  # the model's max_position_embeddings, so --task test's windows
    tokens = np.random.default_rng(1).integers(0, 256, 4 * seq + 1).astype(np.uint16)
    tokens.tofile(tmp_path / "test.bin")
    out = _script(
        "train.py", "--task", "test", "--resume_from", f"hf:{directory}", "--test_data_path",
        str(tmp_path / "test.bin"), "--batch_size", "8", "--run_dir", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "test_step0.json").read_text())
    windows = np.stack([tokens[i * seq : (i + 1) * seq + 1] for i in range(4)]).astype(np.int64)
    with torch.no_grad():
        theirs = torch.nn.functional.cross_entropy(
            model(torch.tensor(windows[:, :-1])).logits.reshape(-1, 256),
            torch.tensor(windows[:, 1:]).reshape(-1),
        )
    assert result["loss"] == pytest.approx(float(theirs), abs=1e-4)


def test_predict_without_prompt_is_greedy_from_a_newline_with_the_dirs_tokenizer(hf_models, tmp_path):
    directory, model = hf_models["llama"]
    out = _script(
        "train.py", "--task", "predict", "--resume_from", f"hf:{directory}", "--temperature", "0",
        "--max_new_tokens", "16", "--run_dir", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "predict_step0.jsonl").read_text().splitlines()]
    assert record["checkpoint"] == f"{directory}/0" and record["prompt"] == ""
    assert str(directory) in out.stdout
    with torch.no_grad():
        greedy = model.generate(torch.tensor([[10]]), do_sample=False, max_new_tokens=16, pad_token_id=0)
    assert record["completion"] == ByteTokenizer().decode(greedy[0, 1:].numpy())


@pytest.mark.parametrize(
    "config,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not supported"),
        ({**COMMON, "architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias"),
        (
            {**COMMON, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn"}},
            "rope_type 'yarn' is not supported",
        ),
    ],
)
def test_unsupported_models_are_one_line_errors(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=message):
        load_config(["--init_from", f"hf:{tmp_path}"], fill=with_hf_model)


def test_model_keys_come_from_the_hf_config_and_others_are_refused(hf_models, tmp_path):
    directory = hf_models["qwen3"][0]
    cfg = load_config(["--init_from", f"hf:{directory}", "--model.scan_layers", "true"], fill=with_hf_model)
    assert (cfg.model.head_size, cfg.model.kv_heads, cfg.model.qk_norm, cfg.model.seq_len) == (
        32,
        2,
        True,
        64,
    )
    with pytest.raises(UserError, match=r"sets model.n_layer 2 \(its config.json\), but 4 was given"):
        load_config(["--init_from", f"hf:{directory}", "--model.n_layer", "4"], fill=with_hf_model)
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(UserError, match="holds no \\*.safetensors"):
        HFCheckpoint(tmp_path, "--init_from")
    with pytest.raises(UserError, match="GELU MLP or learned positions.*--model.mlp swiglu"):
        hf_config.to_hf(ModelConfig(), "float32")


@pytest.mark.parametrize("name,n_params", [("llama_tiny", 803_968), ("llama3_8b", 8_030_261_248)])
def test_llama_configs_have_their_sizes(name, n_params):
    cfg = load_config(["--config", f"configs/{name}.yaml"])
    shapes = jax.eval_shape(lambda: GPT(cfg.model).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    assert param_count(shapes["params"]) == n_params
    assert hf_config.architecture(cfg.model) == "LlamaForCausalLM"


@pytest.fixture(scope="module")
def trained(hf_models, tmp_path_factory) -> tuple[Path, Path]:
    """The Llama model fine-tuned 6 steps from hf:DIR under fsdp 2 (scanned layers) on the byte
    data, exported in 100 KiB shards."""
    tmp = tmp_path_factory.mktemp("trained")
    out = _script(
        "train.py", "--init_from", f"hf:{hf_models['llama'][0]}", "--run_dir", str(tmp / "run"),
        "--total_steps", "6", "--model.seq_len", "32", "--model.scan_layers", "true", "--batch_size", "8",
        "--mesh.data", "1", "--mesh.fsdp", "2", "--eval_interval", "0", "--sample_tokens", "0",
        "--checkpoint_interval", "6", "--progress_bar", "false", "--optim.warmup_steps", "2",
        "--log_interval", "1",
        devices=2,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    out = _script("export_hf.py", str(tmp / "run"), "--out", str(tmp / "hf"), "--max_shard_gb", "0.0001")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1])["tokenizer"] == "bytes"
    return tmp / "run", tmp / "hf"


@pytest.mark.slow
def test_trained_model_exports_to_transformers_with_the_same_logits_and_greedy_tokens(trained):
    run_dir, hf_dir = trained
    losses = [json.loads(line).get("loss") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in losses if x][-1] < [x for x in losses if x][0]  # it trained from the import
    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(weight_map) == 3 + 2 * 9 and len(set(weight_map.values())) > 1  # 2 layers of 9 tensors
    # What transformers' load warnings report: no missing, unexpected or mismatched keys.
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not any(info.values()), info
    cfg, params = _import(str(run_dir))  # the trained params, as the checkpoint holds them
    assert cfg.scan_layers and not cfg.tie_embeddings and cfg.kv_heads == 2
    tokens = np.random.default_rng(0).integers(0, 256, (2, 32))
    ours = np.asarray(GPT(cfg).apply({"params": params}, jnp.asarray(tokens, jnp.int32)))
    theirs = _torch_logits(model.eval(), tokens)
    print(f"trained llama: max |logit difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    out = _script(
        "train.py", "--task", "predict", "--resume_from", str(run_dir), "--prompt", "def ",
        "--temperature", "0", "--max_new_tokens", "24", devices=1,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in (run_dir / "predict_step6.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt = tokenizer("def ", return_tensors="pt").input_ids
    assert prompt.tolist() == [list(b"def ")]
    with torch.no_grad():
        greedy = model.generate(prompt, do_sample=False, max_new_tokens=24, pad_token_id=0)[0, 4:]
    assert record["completion"] == ByteTokenizer().decode(greedy.numpy())
    assert tokenizer.decode(greedy) == record["completion"]


def test_the_window_given_is_the_one_checked_against_the_sliding_window(hf_models, tmp_path):
    """--resume_from hf:DIR takes --model.seq_len and checks it, not the model's default context."""
    import shutil

    from jaxtrain.run.resolve import resolve

    directory = tmp_path / "mistral"
    shutil.copytree(hf_models["mistral"][0], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"sliding_window": 48}))
    np.zeros(200, np.uint16).tofile(tmp_path / "test.bin")

    def window(*flags: str) -> int:
        argv = [
            "--task",
            "test",
            "--resume_from",
            f"hf:{directory}",
            "--test_data_path",
            str(tmp_path / "test.bin"),
        ]
        return resolve(load_config([*argv, *flags])).cfg.model.seq_len

    with pytest.raises(UserError, match=r"sliding_window 48 < model.seq_len 64; use --model.seq_len 48"):
        window()
    assert window("--model.seq_len", "48") == 48 and window("--model.seq_len", "32") == 32
