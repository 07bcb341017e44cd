"""Tiny random checkpoints written by Hugging Face transformers (the oracle), with every weight randomised."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HF_KIMI_LINEAR = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.446,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    linear_attn_config={
        "head_dim": 16,
        "num_heads": 4,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
    },
)

HF_DEEPSEEK_V32 = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    index_topk=12,
    index_head_dim=32,
    index_n_heads=16,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

# DeepSeek-V3 with q_lora and grouped `noaux_tc` routing (4 groups, 2 kept), YaRN with mscale != mscale_all_dim.
HF_DEEPSEEK_V3 = {k: v for k, v in HF_DEEPSEEK_V32.items() if not k.startswith("index_")} | dict(
    v_head_dim=24,
    routed_scaling_factor=2.5,
    rope_parameters=HF_DEEPSEEK_V32["rope_parameters"] | {"mscale_all_dim": 0.8},
)
# Without q_lora (DeepSeek-V2-Lite style q_proj), ungrouped, default RoPE, two dense layers first.
HF_DEEPSEEK_V3_NO_Q_LORA = HF_DEEPSEEK_V3 | dict(
    q_lora_rank=None,
    n_group=1,
    topk_group=1,
    num_hidden_layers=4,
    first_k_dense_replace=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# Kimi K2's config.json: DeepseekV3ForCausalLM under model_type `kimi_k2`, one group, K2's YaRN (factor 32).
HF_KIMI_K2 = HF_DEEPSEEK_V3 | dict(
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 8,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
    },
)
# Fields K2 and DeepSeek-V3 checkpoints carry that transformers' config does not write back.
K2_EXTRA_FIELDS = {
    "model_type": "kimi_k2",
    "architectures": ["DeepseekV3ForCausalLM"],
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
}


@torch.no_grad()
def randomise_all_weights(model: torch.nn.Module, seed: int) -> None:
    """Make norms, biases, convs and the router's correction bias random too, so a dropped term shows."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if not p.is_floating_point() or "inv_freq" in name:
            continue
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith(("A_log", "dt_bias")):
            continue  # keep the reference init: decays in a trained-like range
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "conv1d" in name:
            p.copy_(0.4 * noise)
        elif name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            p.copy_(0.5 * noise)
        else:
            p.copy_(0.08 * noise)


def save_hf_model(kind: str, out: Path, seed: int = 0):
    """Build, randomise and `save_pretrained` a transformers model; returns it (eval, fp32)."""
    import transformers

    torch.manual_seed(seed)
    v3 = {"deepseek_v3": HF_DEEPSEEK_V3, "deepseek_v3_no_q_lora": HF_DEEPSEEK_V3_NO_Q_LORA, "kimi_k2": HF_KIMI_K2}
    if kind == "kimi_linear":
        model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**HF_KIMI_LINEAR))
    elif kind in v3:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**v3[kind]))
    else:
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**HF_DEEPSEEK_V32))
    randomise_all_weights(model, seed)
    model.eval()
    model.save_pretrained(out)
    if kind == "kimi_k2":  # rewrite config.json as a K2 checkpoint ships it
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config | K2_EXTRA_FIELDS, indent=2))
    return model
