"""Write checkpoints in the families' real on-disk format (used by `kestrel make-model` and the trainer).

Kestrel fuses some tensors in memory (q/k/v convs, projections of the same input, stacked experts); on disk each
family keeps its own layout: Kimi checkpoints write `block_sparse_moe.experts.N.w1/w2/w3` and separate
`q/k/v_conv1d`, DeepSeek writes `mlp.experts.N.gate_proj/up_proj/down_proj`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from kestrel.config import model_config_from_dict
from kestrel.models.decoder import CausalLM
from kestrel.models.layers.kda import KDAAttention
from kestrel.models.layers.linear import FusedLinear
from kestrel.models.layers.moe import Experts, Router
from kestrel.models.layers.moe_mxfp4 import MXFP4Experts
from kestrel.models.loader import build_model, checkpoint_files, load_model
from kestrel.models.presets import preset_config, vision_fields
from kestrel.models.vision.moonvit import PositionEmbedding
from kestrel.tokenizer import BYTE_VOCAB_SIZE, byte_level_tokenizer, save_tokenizer

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_KIMI_EXPERT_NAMES = ("w1", "w3", "w2")
_DS_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def init_random_(model: CausalLM, seed: int = 0, std: float = 0.02) -> CausalLM:
    """Deterministic random init in the style of the reference trainers (fla's KDA gate init included)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, scale: float = std) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * scale)

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            normal(module.weight)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, nn.Conv2d):  # the vision tower's patch embedding
            normal(module.weight)
            module.bias.zero_()
        elif isinstance(module, PositionEmbedding):
            normal(module.weight)
        elif isinstance(module, Experts):
            normal(module.gate_up_proj)
            normal(module.down_proj)
        elif isinstance(module, Router):
            normal(module.weight)
            module.e_score_correction_bias.zero_()
    for module in model.modules():
        if isinstance(module, KDAAttention):
            normal(module.conv1d.weight, 1.0 / math.sqrt(module.kernel))
            module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(1.0, 16.0, generator=gen).log())
            dt = torch.exp(torch.empty(module.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            dt = dt.clamp_min(1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def export_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Kestrel's parameters under the checkpoint names of the model's family."""
    kimi = model.cfg.model_type in ("kimi_linear", "kimi_k3")
    expert_names = _KIMI_EXPERT_NAMES if kimi else _DS_EXPERT_NAMES
    out: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    for prefix, module in model.named_modules():  # fused projections go back to their separate tensors
        if isinstance(module, FusedLinear):
            for kind in ("weight", "bias"):
                fused = state.pop(f"{prefix}.{kind}", None)
                shards = getattr(getattr(module, kind), "weight_shards", ()) if fused is not None else ()
                for part, piece in zip(module.parts, fused.split(module.sizes) if fused is not None else ()):
                    if part in shards:
                        state[f"{prefix.rsplit('.', 1)[0]}.{part}.{kind}"] = piece
    for name, tensor in state.items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        disk = re.sub(r"\.mlp\.", ".block_sparse_moe.", name) if kimi else name
        if name.endswith("self_attn.conv1d.weight"):
            for part, piece in zip("qkv", tensor.chunk(3, dim=0)):
                out[disk.replace("conv1d.weight", f"{part}_conv1d.weight")] = piece
        elif name.endswith("experts.gate_up_proj"):
            for e in range(tensor.shape[0]):
                gate, up = tensor[e].chunk(2, dim=0)
                out[disk.replace("gate_up_proj", f"{e}.{expert_names[0]}.weight")] = gate
                out[disk.replace("gate_up_proj", f"{e}.{expert_names[1]}.weight")] = up
        elif name.endswith("experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[disk.replace("down_proj", f"{e}.{expert_names[2]}.weight")] = tensor[e]
        elif name.endswith("self_attn.A_log") and kimi:
            out[disk] = tensor.reshape(1, 1, -1, 1)
        else:
            out[disk] = tensor
    if model.cfg.model_type == "kimi_k25":  # K2.5 nests the DeepSeek-V3 decoder under `language_model.`
        out = {k if k.startswith(VISION_PREFIXES) else f"language_model.{k}": v for k, v in out.items()}
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def save_checkpoint(
    model: CausalLM,
    config: dict[str, Any],
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """config.json + safetensors (sharded with an index past `max_shard_bytes`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = export_state_dict(model)
    if dtype is not None:
        keep_fp32 = ("gate.weight", "e_score_correction_bias", "dt_bias", "A_log")
        # Packed (integer) tensors such as MXFP4 blocks and scales are bytes, not values: never cast them.
        keep = lambda k, v: k.endswith(keep_fp32) or not v.is_floating_point()  # noqa: E731
        tensors = {k: v if keep(k, v) else v.to(dtype) for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for stale in out.glob("model*.safetensors"):
        stale.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / fname, metadata=meta)
            weight_map |= {k: fname for k in shard}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


WEIGHT_FORMATS = ("dense", "mxfp4")


def mxfp4_quantization_config(kimi: bool) -> dict[str, Any]:
    """`quantization_config` of a checkpoint whose routed experts are MXFP4 (Hugging Face's gpt-oss convention):
    routers, norms, attention (KDA decay parameters and the indexer included), shared experts and the latent
    projections stay in high precision."""
    moe = "block_sparse_moe" if kimi else "mlp"
    keep = ["self_attn", "input_layernorm", "post_attention_layernorm", f"{moe}.gate", f"{moe}.shared_experts"]
    keep += [f"{moe}.routed_expert_{p}" for p in ("down_proj", "up_proj", "norm")] + [
        "mlp.gate_up_proj",
        "mlp.down_proj",
    ]
    return {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.embed_tokens", "model.norm", "lm_head"]
        + [f"model.layers.*.{m}" for m in keep],
    }


def with_mxfp4_experts(model: CausalLM, config: dict[str, Any]) -> tuple[CausalLM, dict[str, Any]]:
    """The model with its routed experts quantized to MXFP4 by Kestrel's quantizer (all else copied), and its
    config declaring them."""
    config = copy.deepcopy(config)
    config["quantization_config"] = mxfp4_quantization_config(model.cfg.model_type in ("kimi_linear", "kimi_k3"))
    param = next(model.parameters())
    packed = build_model(model_config_from_dict(config), param.dtype, param.device)
    dense = {
        k: v for k, v in model.state_dict().items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    missing, unexpected = packed.load_state_dict(dense, strict=False)
    assert not unexpected and all(k.endswith(("_blocks", "_scales")) for k in missing), (missing, unexpected)
    for name, module in packed.named_modules():
        if isinstance(module, MXFP4Experts):
            source = model.get_submodule(name)
            module.pack_(source.gate_up_proj.float(), source.down_proj.float())
    return packed, config


def convert_checkpoint(src: str | Path, out_dir: str | Path, weight_format: str) -> Path:
    """Rewrite a checkpoint with its routed experts in `weight_format` (tokenizer files are copied along)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format: {weight_format!r} is not one of {WEIGHT_FORMATS}")
    src, out = Path(src), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    model, _ = load_model(src)
    if weight_format == "mxfp4":
        model, config = with_mxfp4_experts(model, config)
    save_checkpoint(model, config, out, dtype=stored_dtype(src))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    return out


def stored_dtype(path: Path) -> torch.dtype:
    """The floating dtype most of a checkpoint's tensors are stored in (what a rewrite keeps)."""
    counts: dict[torch.dtype, int] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(t.get_dtype())
                if dtype is not None:
                    counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=counts.get, default=torch.float32)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def make_model(
    family: str,
    size: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    weight_format: str = "dense",
    vision: str | None = None,
    **overrides: Any,
) -> Path:
    """Random checkpoint of a preset (config overrides allowed) written by Kestrel's own code; `weight_format`
    "mxfp4" stores the routed experts as MXFP4 blocks and scales; `vision` adds a MoonViT tower of that preset
    size to a kimi_k3 checkpoint."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format: {weight_format!r} is not one of {WEIGHT_FORMATS}")
    config = preset_config(family, size)
    if vision is not None:
        if family != "kimi_k3":
            raise ValueError("vision: only kimi_k3 checkpoints take an optional tower (kimi_k25 always has one)")
        config |= vision_fields(vision)
    target = config["text_config"] if "text_config" in config else config
    target.update(overrides)
    cfg = model_config_from_dict(config)
    model = init_random_(build_model(cfg, torch.float32), seed)
    if dtype != torch.float32:
        target["torch_dtype"] = str(dtype).removeprefix("torch.")
    if weight_format == "mxfp4":
        model, config = with_mxfp4_experts(model, config)
    out = save_checkpoint(model, config, out_dir, dtype=dtype)
    if cfg.vocab_size >= BYTE_VOCAB_SIZE:
        save_tokenizer(byte_level_tokenizer(), out)
    return out


def text_weights_sha256(path: str | Path) -> str:
    """sha256 over the language-model tensors of a checkpoint (name, dtype, shape, bytes; vision tower and projector
    left out): what a draft reads (hidden states, embedding, LM head). A tower added to a text model keeps the
    draft valid; any change to a text tensor changes this hash."""
    return _tensors_sha256(path, lambda name: not name.startswith(VISION_PREFIXES))


def vision_weights_sha256(path: str | Path) -> str:
    """sha256 over the vision tower's and projector's tensors (as `text_weights_sha256`): with it, what a vision
    adapter was trained against is pinned down whole."""
    return _tensors_sha256(path, lambda name: name.startswith(VISION_PREFIXES))


def _tensors_sha256(path: str | Path, keep: Callable[[str], bool]) -> str:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, framework="pt") as fh:
            tensors |= {n: fh.get_tensor(n) for n in fh.keys() if keep(n)}
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
