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


# Kimi K2.5: the DeepSeek-V3 text model above inside Kimi_K25ForConditionalGeneration with a 2-layer MoonViT whose
# position table (6x6) is smaller than most test grids (so it is interpolated) and equal to one of them.
HF_K25_VISION = dict(
    patch_size=14,
    pos_emb_height=6,
    pos_emb_width=6,
    pos_emb_time=4,
    num_attention_heads=2,
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=48,
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
HF_K25_TOKENS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
# transformers' save_pretrained writes a few names of K2.5's hub layout its own way; these restore the hub's.
_K25_HUB_NAMES = [
    (r"^language_model\.model\.blocks\.", "language_model.model.layers."),
    (r"^model\.mm_projector\.", "mm_projector."),
    (r"^vision_tower\.encoder\.patch_embed\.", "vision_tower.patch_embed."),
]


def save_hf_kimi_k25(out: Path, seed: int = 0):
    """A random `Kimi_K25ForConditionalGeneration` saved in Kimi K2.5's hub layout (`language_model.model.*`,
    `vision_tower.encoder.blocks.N.wqkv`, `mm_projector.proj.0`, ...); returns the model (eval, fp32)."""
    import re

    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    config = transformers.Kimi_K25Config(
        text_config=HF_DEEPSEEK_V3 | {"model_type": "deepseek_v3"},
        vision_config=HF_K25_VISION,
        projection_hidden_size=HF_K25_VISION["hidden_size"],
        tie_word_embeddings=False,
        **HF_K25_TOKENS,
    )
    model = transformers.Kimi_K25ForConditionalGeneration(config)
    time_table = model.model.vision_tower.patch_embed.pos_emb.time_position_embeddings.clone()
    randomise_all_weights(model, seed)
    model.model.vision_tower.patch_embed.pos_emb.time_position_embeddings.copy_(time_table)  # a fixed table
    model.eval()
    model.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        for pattern, repl in _K25_HUB_NAMES:
            name = re.sub(pattern, repl, name)
        renamed[name] = tensor
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return model


ORACLE_TORCHVISION = Path(__file__).resolve().parent.parent / ".venv" / "oracle-torchvision"
_PROCESSOR_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
real = torch.library.register_fake  # its CUDA-built C ops cannot load beside CPU torch; the transforms need none
torch.library.register_fake = lambda *a, **k: (lambda fn: fn)
import torchvision  # noqa
torch.library.register_fake = real
import transformers
from PIL import Image
from safetensors.torch import save_file
images = [Image.open(p) for p in sys.argv[4:]]
out = transformers.Kimi_K25ImageProcessor(max_patches=int(sys.argv[3]))(images=images, return_tensors="pt")
save_file({"pixel_values": out["pixel_values"].contiguous(), "grid": out["image_grid_thw"]}, sys.argv[2])
"""


def hf_image_processor(paths: list[Path], out: Path, max_patches: int = 16384) -> dict[str, torch.Tensor]:
    """`Kimi_K25ImageProcessor` (torchvision backend) on image files, in a child process: the only torchvision
    wheel beside CPU torch 2.13 is CUDA-built, so it lives outside the venv (`make setup`) and is imported with its
    C-op registrations skipped; inside pytest's own process it would break every transformers import."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    assert ORACLE_TORCHVISION.exists(), f"{ORACLE_TORCHVISION} missing: run `make setup`"
    cmd = [sys.executable, "-c", _PROCESSOR_SCRIPT, str(ORACLE_TORCHVISION), str(out), str(max_patches)]
    cmd += [str(p) for p in paths]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    return load_file(out)
