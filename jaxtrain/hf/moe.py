"""The mixture-of-experts families' config.json keys, both ways (hf/config.py does the rest):

Mixtral      Llama's attention, every MLP a mixture of experts (renormalised top-k of a softmax)
Qwen2-MoE    Qwen2's attention (q/k/v biases), a shared expert behind a sigmoid gate
Qwen3-MoE    Qwen3's attention (q/k norms); both Qwens: MoE every decoder_sparse_step-th layer,
             but not mlp_only_layers (model.moe.dense_layers)
DeepSeek-V3  multi-head latent attention (model/mla.py), sigmoid routing with a correction bias,
             group-limited top-k, shared experts, the first k layers dense

The families jaxtrain does not read are refused in one line naming the piece it lacks (REFUSED).
"""

from __future__ import annotations

from typing import Any

from jaxtrain.config import ModelConfig
from jaxtrain.errors import UserError

# The piece each missing family needs, named in its refusal.
REFUSED = {
    "OlmoeForCausalLM": "RMSNorm of q and k across all heads at once (jaxtrain's qk_norm is per head)",
    "GptOssForCausalLM": "attention sinks, sliding-window layers and biased experts with a clamped SwiGLU",
    "Llama4ForCausalLM": "layers without rotary positions (no_rope_layers) and chunked attention",
    "Llama4ForConditionalGeneration": "a vision tower, layers without rotary positions and chunked attention",
    "DeepseekV2ForCausalLM": "DeepSeek-V2's softmax group routing (group_limited_greedy); V3's reads",
}
MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")


def mla_keys(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """model.* of DeepSeek-V3's multi-head latent attention (its heads sized apart from d_model)."""
    n = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or n) != n:
        raise UserError(
            f"{where}: num_key_value_heads {hf['num_key_value_heads']} != num_attention_heads {n}; "
            "latent attention expands its latent into every head"
        )
    return {
        "model.kv_lora_rank": hf["kv_lora_rank"],
        "model.q_lora_rank": hf.get("q_lora_rank") or 0,
        "model.rope_head_dim": hf["qk_rope_head_dim"],
        "model.nope_head_dim": hf["qk_nope_head_dim"],
        "model.v_head_dim": hf["v_head_dim"],
        "model.rope_interleave": bool(hf.get("rope_interleave", True)),
    }


def moe_keys(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """model.moe.* of a MoE family. Hugging Face's balancing loss is experts_per_token times ours
    (model/moe.py balance_loss): its coefficient is scaled to give the same loss."""
    k = hf["num_experts_per_tok"]
    keys: dict[str, Any] = {"model.moe.experts_per_token": k}
    if arch == "DeepseekV3ForCausalLM":  # no balancing coefficient: DeepSeek balances by the bias
        return keys | {
            "model.moe.n_experts": hf["n_routed_experts"],
            "model.moe.d_expert": hf["moe_intermediate_size"],
            "model.moe.n_shared_experts": hf["n_shared_experts"],
            "model.moe.router": "sigmoid",
            "model.moe.n_group": hf.get("n_group") or 1,
            "model.moe.topk_group": hf.get("topk_group") or 1,
            "model.moe.renormalize": bool(hf.get("norm_topk_prob", True)),
            "model.moe.routed_scale": float(hf.get("routed_scaling_factor", 1.0)),
            "model.moe.first_dense": hf.get("first_k_dense_replace") or 0,
        }
    keys["model.moe.n_experts"] = hf.get("num_local_experts") or hf["num_experts"]
    keys["model.moe.balance_coef"] = float(hf.get("router_aux_loss_coef", 0.0)) * k
    if arch == "MixtralForCausalLM":
        return keys | {"model.moe.d_expert": hf["intermediate_size"], "model.moe.renormalize": True}
    keys |= {
        "model.moe.d_expert": hf["moe_intermediate_size"],
        "model.moe.every": hf.get("decoder_sparse_step", 1),
        "model.moe.dense_layers": ",".join(str(i) for i in sorted(hf.get("mlp_only_layers") or [])),
        "model.moe.renormalize": bool(hf.get("norm_topk_prob", False)),
    }
    if arch == "Qwen2MoeForCausalLM":
        keys |= {
            "model.moe.n_shared_experts": 1,
            "model.moe.d_shared": hf["shared_expert_intermediate_size"],
            "model.moe.shared_gate": True,
        }
    return keys


def moe_architecture(m: ModelConfig) -> str:
    """The MoE class these options are (or a one-line refusal naming what no class has)."""
    moe = m.moe
    if m.mla:
        return _deepseek(m)
    if moe.router != "softmax" or moe.n_group > 1 or moe.routed_scale != 1.0:
        raise UserError(
            "sigmoid routing, expert groups and a routed scale are DeepSeek-V3's, which has latent "
            "attention: set model.kv_lora_rank, or use model.moe.router softmax without them, to export"
        )
    if moe.n_shared_experts:
        if not moe.shared_gate or m.qk_norm:
            raise UserError(
                "shared experts export as Qwen2-MoE's one gated shared expert: set model.moe.shared_gate "
                "true (and no q/k norms), or latent attention (DeepSeek-V3)"
            )
        return "Qwen2MoeForCausalLM"
    if m.qkv_bias:
        raise UserError(
            "a mixture of experts with q/k/v biases exports as Qwen2-MoE, which has a shared expert"
        )
    if m.qk_norm:
        return "Qwen3MoeForCausalLM"
    if moe.every != 1 or not moe.renormalize or moe.first_dense or moe.dense_layers:
        raise UserError(
            "Mixtral has experts in every layer and renormalised top-k weights: use model.moe.every 1, "
            "no dense layers and model.moe.renormalize true, or model.qk_norm true (Qwen3-MoE) to export"
        )
    return "MixtralForCausalLM"


def _deepseek(m: ModelConfig) -> str:
    moe = m.moe
    plain = moe.every == 1 and not moe.dense_layers and not moe.shared_gate
    shared = moe.d_shared in (0, moe.n_shared_experts * m.expert_dim)
    if not moe.n_experts or moe.router != "sigmoid" or not plain or not shared or not moe.n_shared_experts:
        raise UserError(
            "latent attention exports as DeepSeek-V3: experts after model.moe.first_dense in every layer, "
            "router sigmoid, n_shared_experts >= 1 of d_expert each, no shared_gate or dense_layers"
        )
    return "DeepseekV3ForCausalLM"


def moe_hf(m: ModelConfig, arch: str) -> dict[str, Any]:
    """The config.json keys of a MoE class beside hf/config.py's common ones."""
    moe, k = m.moe, m.moe.experts_per_token
    common: dict[str, Any] = {
        "num_experts_per_tok": k,
        "output_router_logits": False,
        "norm_topk_prob": moe.renormalize,
    }
    if arch == "DeepseekV3ForCausalLM":
        return common | {
            "moe_intermediate_size": m.expert_dim,
            "n_routed_experts": moe.n_experts,
            "n_shared_experts": moe.n_shared_experts,
            "routed_scaling_factor": moe.routed_scale,
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "first_k_dense_replace": moe.first_dense,
            "kv_lora_rank": m.kv_lora_rank,
            "q_lora_rank": m.q_lora_rank or None,
            "qk_rope_head_dim": m.rope_head_dim,
            "qk_nope_head_dim": m.nope_head_dim,
            "v_head_dim": m.v_head_dim,
            "rope_interleave": m.rope_interleave,
            "head_dim": m.rope_head_dim,  # what transformers sets: the rotary part's size
            "num_nextn_predict_layers": 0,  # no multi-token prediction module
        }
    common |= {
        "num_local_experts": moe.n_experts,
        "num_experts": moe.n_experts,  # Qwen-MoE's name
        "router_aux_loss_coef": moe.balance_coef / k,
    }
    if arch == "MixtralForCausalLM":
        return common | {"intermediate_size": m.expert_dim}
    dense = sorted({int(x) for x in moe.dense_layers.split(",") if x.strip()} | set(range(moe.first_dense)))
    common |= {
        "moe_intermediate_size": m.expert_dim,
        "decoder_sparse_step": moe.every,
        "mlp_only_layers": dense,
    }
    if arch == "Qwen2MoeForCausalLM":
        common |= {"shared_expert_intermediate_size": moe.d_shared or moe.n_shared_experts * m.expert_dim}
        common |= {"qkv_bias": m.qkv_bias}
    return common
