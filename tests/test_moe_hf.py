"""Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 in and out (jaxtrain/hf/), checked by
transformers itself: tiny random models made by transformers import with its logits and greedy
tokens, export back to the same tensors, which transformers loads with no missing or unexpected
key; MoE classes we do not read are refused in one line naming the piece missing.

    pytest tests/test_moe_hf.py     # about a minute on 2 cores
"""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from jaxtrain.config import load_config, saved_model, to_dict
from jaxtrain.disk import checkpoint as ckpt_lib
from jaxtrain.errors import UserError
from jaxtrain.hf.config import to_hf, with_hf_model
from jaxtrain.hf.export import export
from jaxtrain.hf.load import HFCheckpoint
from jaxtrain.model.generate import generate
from jaxtrain.model.transformer import GPT

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
)
FAMILIES = {
    # every layer MoE, renormalised top-2 of 4 experts
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(intermediate_size=48, num_local_experts=4)),
    # q/k norms; layer 0 dense (intermediate_size), layer 1 MoE (decoder_sparse_step 2), top-2 of
    # 8 experts as the router gives them (norm_topk_prob false, transformers' default)
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=32, decoder_sparse_step=2
        ),
    ),
    # Qwen3-235B-A22B's shape (configs/qwen3_235b_a22b.yaml): every layer MoE, renormalised top-2,
    # 16 query heads to 1 key/value head (its 64:4), heads wider than the model together (64 x 128
    # on 4,096)
    "qwen3_235b_shape": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            head_dim=32,
            num_attention_heads=16,
            num_key_value_heads=1,
            norm_topk_prob=True,
        ),
    ),
    # q/k/v biases, a shared expert of its own size behind a sigmoid gate, renormalised top-2 of 4;
    # layer 0 dense by mlp_only_layers
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            num_hidden_layers=3,
        ),
    ),
    # latent attention (q through its latent, values of 12 beside query/key heads of 24, interleaved
    # rotary pairs), sigmoid routing with a correction bias, top-2 of 8 from the best 2 of 4
    # groups, routed scale 2.5, one shared expert; layer 0 dense (first_k_dense_replace)
    "deepseek_v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            num_key_value_heads=4,
            num_hidden_layers=3,
        ),
    ),
    # queries projected directly, one group, weights as the scores give them (no renormalising),
    # YaRN rotary scaling with both attention factors (rotary parts and scores) unlike 1
    "deepseek_v3_direct_q": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            num_key_value_heads=4,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
            norm_topk_prob=False,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_model(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    """The family saved by transformers, params nudged off their init (so a misplaced tensor shows)."""
    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek's correction bias: it must change the picks
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    directory = tmp_path_factory.mktemp("hf") / request.param
    model.save_pretrained(directory)
    return request.param, directory, model


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _ours(source: HFCheckpoint, cfg, tokens: np.ndarray) -> tuple:
    """The dir's params loaded for this model config, and our logits of `tokens`."""
    abstract = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    params = source.restore_params(0, target["params"], "x")
    logits = jax.jit(lambda p, t: GPT(cfg).apply({"params": p}, t))(params, jnp.asarray(tokens))
    return params, np.asarray(logits)


def test_import_export_agree_with_transformers(hf_model, tmp_path):
    family, directory, model = hf_model
    source = HFCheckpoint(directory, "x")
    cfg = saved_model(source.read_meta(0)["config"])
    experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    assert cfg.moe.n_experts == experts and cfg.moe.experts_per_token == 2
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    params, ours = _ours(source, cfg, tokens)
    theirs = _torch_logits(model, tokens)
    print(f"{family}: max |logit difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    if cfg.moe.every == 1 and not cfg.moe.dense_layers:  # scanned too (DeepSeek: two stacks)
        scanned = _ours(source, dataclasses.replace(cfg, scan_layers=True), tokens)[1]
        np.testing.assert_allclose(scanned, theirs, atol=1e-4, rtol=0)
    # Greedy decoding (our KV-cached path, experts and all) picks transformers' tokens.
    prompt = tokens[0, :5].astype(np.int32)
    mine = generate(params, cfg, prompt, 12, jax.random.key(0), temperature=0.0)
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor(prompt[None]), do_sample=False, max_new_tokens=12, pad_token_id=0
        )
    assert np.asarray(mine).tolist() == greedy[0, 5:].tolist()

    # Saved as a checkpoint of ours, then exported: every tensor comes back as it was.
    ckpt = ckpt_lib.Checkpointer(tmp_path / "checkpoints", 1)
    ckpt.save(0, {"params": params}, {"config": {"model": to_dict(cfg)}})
    ckpt.wait()
    result = export(str(tmp_path / "checkpoints"), tmp_path / "out")
    assert result["architecture"] == model.config.architectures[0]
    before = load_file(directory / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        np.testing.assert_array_equal(after[name], tensor, err_msg=name)
    exported, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    np.testing.assert_allclose(_torch_logits(exported.eval(), tokens), theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {**COMMON, "architectures": ["OlmoeForCausalLM"]},
            "architecture OlmoeForCausalLM needs RMSNorm of q and k across all heads at once",
        ),
        (
            {**COMMON, "architectures": ["GptOssForCausalLM"]},
            "architecture GptOssForCausalLM needs attention sinks, sliding-window layers",
        ),
        (
            {**COMMON, "architectures": ["Llama4ForCausalLM"]},
            "architecture Llama4ForCausalLM needs layers without rotary positions (no_rope_layers)",
        ),
        (
            {
                **COMMON, "architectures": ["DeepseekV3ForCausalLM"], "intermediate_size": 96,
                "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                "v_head_dim": 8, "n_routed_experts": 4, "moe_intermediate_size": 32, "n_shared_experts": 1,
                "rope_scaling": {
                    "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "attention_factor": 2.0,
                },
            },
            "rope_type 'yarn' is not supported (plain rotary positions, llama3, or yarn without",
        ),
        (
            {
                **COMMON, "architectures": ["MixtralForCausalLM"], "intermediate_size": 96,
                "num_local_experts": 4, "rope_scaling": {"rope_type": "yarn"},
            },
            "rope_type yarn needs its factor and original_max_position_embeddings",
        ),
    ],
    ids=["olmoe", "gpt-oss", "llama4", "deepseek-yarn", "yarn-without-factor"],
)  # fmt: skip
def test_moe_models_we_do_not_read_are_one_line_errors(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=re.escape(message)) as e:
        load_config(["--init_from", f"hf:{tmp_path}"], fill=with_hf_model)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model.moe.router", "sigmoid"],
            "sigmoid routing, expert groups and a routed scale are DeepSeek-V3's",
        ),
        (
            ["--model.moe.n_shared_experts", "1"],
            "shared experts export as Qwen2-MoE's one gated shared expert",
        ),
        (
            ["--model.kv_lora_rank", "16", "--model.n_kv_head", "0", "--model.rope_head_dim", "8"],
            "latent attention exports as DeepSeek-V3: experts after model.moe.first_dense in every layer, "
            "router sigmoid",
        ),
    ],
    ids=["sigmoid-without-mla", "ungated-shared", "mla-softmax"],
)
def test_moe_models_no_class_matches_are_refused_before_export(argv, message):
    base = ["--config", "configs/moe_tiny.yaml"]
    with pytest.raises(UserError, match=re.escape(message)) as e:
        to_hf(load_config([*base, *argv]).model, "float32")
    assert "\n" not in str(e.value)


# The config.json of Qwen's published checkpoints (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B on the
# Hugging Face hub): what --init_from reads. The shipped configs' model must be theirs.
QWEN3_HUB = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False, hidden_act="silu",
    head_dim=128, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, vocab_size=151936,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, router_aux_loss_coef=0.001,
    torch_dtype="bfloat16", sliding_window=None, use_sliding_window=False, bos_token_id=151643,
    eos_token_id=151645,
)  # fmt: skip
QWEN3_SIZES = {
    "qwen3_30b_a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_attention_heads=32, num_hidden_layers=48, max_window_layers=48),
    "qwen3_235b_a22b": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_attention_heads=64, num_hidden_layers=94, max_window_layers=94),
}  # fmt: skip


@pytest.mark.parametrize("name", list(QWEN3_SIZES))
def test_a_shipped_qwen3_config_is_the_published_model(tmp_path, name):
    """configs/<name>.yaml's model is what --init_from makes of the published config.json: every key
    of the architecture (the training settings, seq_len, remat, pieces, capacity, are the config's)."""
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_HUB, **QWEN3_SIZES[name]}))
    hub = load_config(["--init_from", f"hf:{tmp_path}"], fill=with_hf_model).model
    shipped = load_config(
        ["--config", str(Path(__file__).resolve().parent.parent / "configs" / f"{name}.yaml")]
    ).model
    training = {"seq_len", "scan_layers", "remat", "token_chunks", "moe"}
    assert {k: v for k, v in to_dict(hub).items() if k not in training} == {
        k: v for k, v in to_dict(shipped).items() if k not in training
    }
    routing = {"capacity_factor", "chunks", "overlap_groups", "grouped_matmul", "exchange", "dispatch_dtype"}
    assert {k: v for k, v in to_dict(hub.moe).items() if k not in routing} == {
        k: v for k, v in to_dict(shipped.moe).items() if k not in routing
    }
