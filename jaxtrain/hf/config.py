"""Hugging Face config.json <-> ModelConfig: which class each set of model options is.

Llama    SwiGLU, rotary, grouped-query attention, no biases          (Mistral reads as Llama)
Qwen2    the same with q/k/v biases
Qwen3    the same with RMSNorm of each head's q and k (no biases)
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3: mixtures of experts (hf/moe.py)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxtrain.config import ModelConfig, MoeConfig
from jaxtrain.disk import bucket
from jaxtrain.errors import UserError
from jaxtrain.hf import hf_dir
from jaxtrain.hf.moe import MOE_ARCHS, REFUSED, mla_keys, moe_architecture, moe_hf, moe_keys

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", *MOE_ARCHS)
# A model dir's context can be far longer than anyone trains here by default.
DEFAULT_SEQ_LEN = 2048


def read(directory: Path | str, flag: str = "hf:") -> dict[str, Any]:
    """The dir's config.json (missing or unreadable: one line); a dir in a bucket (gs://, s3://) is
    checked first: no bucket, no credentials are one line naming `flag`."""
    if isinstance(directory, str) and bucket.is_url(directory):
        bucket.check(directory, flag, write=False)
    path: Any = bucket.as_path(bucket.join(str(directory), "config.json"))  # a Path, or a bucket.ObjectPath
    try:
        out = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"{path} not found: hf:DIR needs a Hugging Face model dir (config.json, *.safetensors)"
        ) from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({type(e).__name__}); fix or replace it") from None
    if not isinstance(out, dict):
        raise UserError(f"{path} is not a JSON object")
    return out


def _rope_keys(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """model.rope_* keys: plain rotary positions, or scaled ones (rope_type llama3 or yarn)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    keys = {"model.rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        return keys | {
            "model.rope_scaling_factor": float(rope["factor"]),
            "model.rope_type": "llama3",
            "model.rope_low_freq_factor": float(rope["low_freq_factor"]),
            "model.rope_high_freq_factor": float(rope["high_freq_factor"]),
            "model.rope_original_context": int(rope["original_max_position_embeddings"]),
        }
    if kind == "yarn" and not {"factor", "original_max_position_embeddings"} <= rope.keys():
        raise UserError(f"{where}: rope_type yarn needs its factor and original_max_position_embeddings")
    if kind == "yarn" and rope.get("attention_factor") is None and rope.get("truncate", True):
        return keys | {
            "model.rope_scaling_factor": float(rope["factor"]),
            "model.rope_type": "yarn",
            "model.rope_original_context": int(rope["original_max_position_embeddings"]),
            "model.rope_beta_fast": float(rope.get("beta_fast") or 32.0),
            "model.rope_beta_slow": float(rope.get("beta_slow") or 1.0),
            "model.rope_mscale": float(rope.get("mscale") or 0.0),
            "model.rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
        }
    if kind != "default":
        raise UserError(
            f"{where}: rope_type {kind!r} is not supported (plain rotary positions, llama3, or yarn "
            "without attention_factor or truncate false)"
        )
    return keys


def model_keys(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The model.* config keys (dotted) of a Hugging Face config, or a one-line refusal."""
    arch = (hf.get("architectures") or ["?"])[0]
    if arch in REFUSED:
        raise UserError(f"{where}: architecture {arch} needs {REFUSED[arch]}, which jaxtrain does not have")
    if arch not in SUPPORTED:
        raise UserError(
            f"{where}: architecture {arch} is not supported; jaxtrain reads {', '.join(SUPPORTED)}"
        )
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias"):
        raise UserError(f"{where}: only a silu MLP without biases is supported (SwiGLU)")
    qwen2, qwen3 = arch == "Qwen2ForCausalLM", arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if hf.get("attention_bias") and not qwen2:
        raise UserError(f"{where}: attention_bias (a bias on the output projection too) is not supported")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // n
    deepseek = arch == "DeepseekV3ForCausalLM"
    attention = mla_keys(hf, where) if deepseek else {
        "model.n_kv_head": hf.get("num_key_value_heads") or n,
        "model.head_dim": 0 if head_dim * n == d else head_dim,
    }  # fmt: skip
    return {
        "model.vocab_size": hf["vocab_size"],
        "model.d_model": d,
        "model.n_layer": hf["num_hidden_layers"],
        "model.n_head": n,
        **attention,
        "model.d_ff": hf["intermediate_size"],
        "model.mlp": "swiglu",
        "model.pos_embedding": "rope",
        **_rope_keys(hf, where),
        "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.qkv_bias": qwen2 or arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True)),
        "model.qk_norm": qwen3,
        **(moe_keys(hf, arch) if arch in MOE_ARCHS else {}),
    }


def model_config(keys: dict[str, Any], **extra: Any) -> ModelConfig:
    """ModelConfig of model_keys' dotted keys (model.moe.* nested), plus `extra` fields."""
    return ModelConfig(**nested(keys), **extra)


def nested(keys: dict[str, Any]) -> dict[str, Any]:
    """model_keys' dotted keys as ModelConfig's fields: {"d_model": .., "moe": MoeConfig(..)}."""
    out = {k.split(".", 1)[1]: v for k, v in keys.items() if not k.startswith("model.moe.")}
    moe = {k.split(".", 2)[2]: v for k, v in keys.items() if k.startswith("model.moe.")}
    return out | ({"moe": MoeConfig(**moe)} if moe else {})


def context(hf: dict[str, Any]) -> int:
    """The longest window the model's positions were made for."""
    return int(hf.get("max_position_embeddings", DEFAULT_SEQ_LEN))


def seq_len(hf: dict[str, Any], wanted: int | None, where: str) -> int:
    """The training window: `wanted`, else the model's context up to DEFAULT_SEQ_LEN; checked."""
    limit = context(hf)
    out = wanted or min(limit, DEFAULT_SEQ_LEN)
    if out > limit:
        raise UserError(f"{where}: model.seq_len {out} exceeds its max_position_embeddings {limit}")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window and window < out:
        raise UserError(
            f"{where}: sliding_window {window} < model.seq_len {out}; use --model.seq_len {window}"
        )
    return out


def with_hf_model(flat: dict[str, Any]) -> dict[str, Any]:
    """Config keys (dotted, as given) with model.* filled from --init_from hf:DIR's config.json.

    Model keys given (file or flag) must agree with it: the checkpoint fixes the architecture.
    """
    init_from = str(flat.get("init_from", ""))
    directory = hf_dir(init_from)
    if directory is None:
        return flat
    where = f"--init_from {init_from}"
    hf = read(directory, "--init_from")
    keys = model_keys(hf, where)
    for key, value in keys.items():
        if key in flat and flat[key] != value and not (key == "model.n_kv_head" and flat[key] == 0):
            raise UserError(
                f"{where} sets {key} {value!r} (its config.json), but {flat[key]!r} was given; drop {key}"
            )
    keys["model.seq_len"] = seq_len(hf, flat.get("model.seq_len"), where)
    return {**flat, **keys}


def architecture(m: ModelConfig) -> str:
    """The Hugging Face class these model options are, or a one-line refusal naming the fix."""
    if m.mlp != "swiglu" or m.pos_embedding != "rope":
        raise UserError(
            "this model (GELU MLP or learned positions) matches no Hugging Face class; train with "
            "--model.mlp swiglu --model.pos_embedding rope (optionally n_kv_head, tie_embeddings false, "
            "qk_norm or qkv_bias) to export it"
        )
    if m.qk_norm and m.qkv_bias:
        raise UserError("qk_norm with qkv_bias matches no Hugging Face class (Qwen3 biases o_proj too)")
    if m.moe.n_experts or m.mla:
        return moe_architecture(m)
    return "Qwen3ForCausalLM" if m.qk_norm else "Qwen2ForCausalLM" if m.qkv_bias else "LlamaForCausalLM"


def _rope_parameters(m: ModelConfig) -> dict[str, Any]:
    if not m.rope_scaling_factor:
        return {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_type == "yarn":
        return {
            "rope_type": "yarn",
            "rope_theta": m.rope_theta,
            "factor": m.rope_scaling_factor,
            "original_max_position_embeddings": m.rope_original_context,
            "beta_fast": m.rope_beta_fast,
            "beta_slow": m.rope_beta_slow,
            **({"mscale": m.rope_mscale} if m.rope_mscale else {}),
            **({"mscale_all_dim": m.rope_mscale_all_dim} if m.rope_mscale_all_dim else {}),
        }
    return {
        "rope_type": "llama3",
        "rope_theta": m.rope_theta,
        "factor": m.rope_scaling_factor,
        "low_freq_factor": m.rope_low_freq_factor,
        "high_freq_factor": m.rope_high_freq_factor,
        "original_max_position_embeddings": m.rope_original_context,
    }


def to_hf(m: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json for these model options (transformers 4 and 5 read it)."""
    arch = architecture(m)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ff_dim,
        "num_hidden_layers": m.n_layer,
        "num_attention_heads": m.n_head,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": m.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": _rope_parameters(m),
        "rope_scaling": _rope_parameters(m) if m.rope_scaling_factor else None,  # transformers 4's name
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "attention_bias": m.qkv_bias and arch == "Qwen2ForCausalLM",
        "mlp_bias": False,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch != "LlamaForCausalLM":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layer)
    if arch in MOE_ARCHS:
        out.update(moe_hf(m, arch))
    return out


_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
