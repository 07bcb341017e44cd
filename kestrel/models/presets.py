"""Config presets for random checkpoints (`kestrel make-model`), written as the families' real config.json."""

from __future__ import annotations

from typing import Any

from kestrel.tokenizer import BYTE_IMAGE_TOKEN_ID

FAMILIES = ("kimi_linear", "deepseek_v32", "kimi_k3", "deepseek_v3", "kimi_k2", "kimi_k25")
SIZES = ("tiny", "small")

# Per-size dimensions shared by the families. `small` lands near 20M parameters.
_DIMS: dict[str, dict[str, int]] = {
    "tiny": dict(
        vocab=512,
        hidden=64,
        layers=4,
        heads=4,
        inter=128,
        moe_inter=32,
        experts=8,
        top_k=2,
        kv_rank=32,
        q_rank=48,
        nope=16,
        rope=16,
        v=16,
        kda_heads=4,
        kda_dim=16,
        idx_heads=16,
        idx_dim=32,
        topk=16,
    ),
    "small": dict(
        vocab=4096,
        hidden=384,
        layers=8,
        heads=6,
        inter=1024,
        moe_inter=128,
        experts=12,
        top_k=4,
        kv_rank=128,
        q_rank=192,
        nope=32,
        rope=32,
        v=48,
        kda_heads=6,
        kda_dim=64,
        idx_heads=16,
        idx_dim=64,
        topk=128,
    ),
}


# MoonViT towers per size (transformers' `Kimi_K25VisionConfig` names); K2.5 itself: 1152 wide, 27 layers.
_VISION: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, pos_emb_height=8),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384),
}


def vision_fields(size: str, image_token_id: int = BYTE_IMAGE_TOKEN_ID) -> dict[str, Any]:
    """A wrapper config's `vision_config` and top-level projector / token fields for a tower of `size`."""
    tower = {"pos_emb_height": 16, "pos_emb_width": 16} | _VISION[size]
    tower["pos_emb_width"] = tower["pos_emb_height"]
    vision = {
        "model_type": "kimi_k25_vision",
        "patch_size": 14,
        "pos_emb_time": 4,
        "merge_kernel_size": [2, 2],
        "hidden_act": "gelu_pytorch_tanh",
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        **tower,
    }
    return {
        "vision_config": vision,
        "projection_hidden_size": vision["hidden_size"],
        "projection_layer_norm_eps": 1e-5,
        "image_token_id": image_token_id,
    }


def _kda_layout(n_layers: int) -> tuple[list[int], list[int]]:
    """1-based layer lists: every 4th layer full attention (3:1 KDA:full, as Kimi Linear and K3)."""
    full = [i + 1 for i in range(n_layers) if i % 4 == 3]
    return [i + 1 for i in range(n_layers) if i + 1 not in full], full


def preset_config(family: str, size: str) -> dict[str, Any]:
    """A config.json dict in the family's on-disk format."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    d = _DIMS[size]
    common = {
        "vocab_size": d["vocab"],
        "hidden_size": d["hidden"],
        "intermediate_size": d["inter"],
        "moe_intermediate_size": d["moe_inter"],
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["heads"],
        "kv_lora_rank": d["kv_rank"],
        "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"],
        "v_head_dim": d["v"],
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    if family == "deepseek_v32":
        return common | {
            "model_type": "deepseek_v32",
            "architectures": ["DeepseekV32ForCausalLM"],
            "q_lora_rank": d["q_rank"],
            "n_routed_experts": d["experts"],
            "num_experts_per_tok": d["top_k"],
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
            "index_n_heads": d["idx_heads"],
            "index_head_dim": d["idx_dim"],
            "index_topk": d["topk"],
            "max_position_embeddings": 16384,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        }
    if family in ("deepseek_v3", "kimi_k2"):
        return common | _deepseek_v3(family, d)
    if family == "kimi_k25":  # Kimi K2.5 / K2.6: a DeepSeek-V3 (K2) decoder and a MoonViT tower
        text = common | _deepseek_v3("kimi_k2", d) | {"model_type": "deepseek_v3"}
        text.pop("architectures")
        top = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"]}
        return top | {"text_config": text, "tie_word_embeddings": False} | vision_fields(size)
    kda_layers, full_layers = _kda_layout(d["layers"])
    kimi = common | {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "q_lora_rank": None,
        "num_experts": d["experts"],
        "num_experts_per_token": d["top_k"],
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "mla_use_nope": True,
        "model_max_length": 1048576,
        "linear_attn_config": {
            "kda_layers": kda_layers,
            "full_attn_layers": full_layers,
            "head_dim": d["kda_dim"],
            "num_heads": d["kda_heads"],
            "short_conv_kernel_size": 4,
        },
    }
    if family == "kimi_linear":
        return kimi
    text = kimi | {
        "model_type": "kimi_k3_text",
        "q_lora_rank": d["q_rank"],
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 8.0,
        "attn_res_block_size": 2,
        "routed_expert_hidden_size": d["hidden"] // 2,
        "latent_moe_use_norm": True,
        "mla_use_output_gate": True,
        "index_n_heads": d["idx_heads"],
        "index_head_dim": d["idx_dim"],
        "index_topk": d["topk"],
    }
    text["linear_attn_config"] = text["linear_attn_config"] | {"use_full_rank_gate": True}
    text.pop("architectures")
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": None,
        "tie_word_embeddings": False,
    }


def _deepseek_v3(family: str, d: dict[str, int]) -> dict[str, Any]:
    """DeepSeek-V3's on-disk fields (grouped `noaux_tc` routing); Kimi K2 is the same architecture renamed,
    ungrouped, with K2's long YaRN context."""
    k2 = family == "kimi_k2"
    return {
        "model_type": family,
        "architectures": ["DeepseekV3ForCausalLM"],
        "q_lora_rank": d["q_rank"],
        "n_routed_experts": d["experts"],
        "num_experts_per_tok": d["top_k"],
        "n_shared_experts": 1,
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 1 if k2 else 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 131072 if k2 else 16384,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0 if k2 else 4.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 1.0 if k2 else 32.0,
            "beta_slow": 1.0,
        },
        "rope_theta": 50000.0 if k2 else 10000.0,
    }
