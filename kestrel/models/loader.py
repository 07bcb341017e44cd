"""Hugging Face checkpoint folder (config.json + safetensors, single or sharded) → `CausalLM`.

Tensors stream one at a time from the safetensors files straight into the parameters, so the weights are
never held twice. Name mapping is data (`_RENAMES`); reshaping and fusing live with each parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kestrel.config import ModelConfig, load_model_config
from kestrel.models.decoder import CausalLM
from kestrel.models.layers.derived import weights_changed
from kestrel.models.layers.linear import FusedLinear
from kestrel.models.weight_loaders import FULL, SKIP, ShapeMismatch, loader_of, slice_of

log = logging.getLogger(__name__)

# Parameters that the reference implementations keep in fp32 whatever the model dtype.
FP32_PARAMS = ("mlp.gate.weight", "e_score_correction_bias", "dt_bias", "A_log")
PROGRESS_BAR_MIN_BYTES = 256 << 20


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; lists every problem at once."""


# (pattern, replacement) applied in order to every checkpoint name.
_RENAMES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"^language_model\."), ""),  # multimodal wrappers (K2.5, K3) nest the decoder
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
]
_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_TARGET = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}
_EXPERT_TARGET |= {"up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


def map_checkpoint_name(name: str, fused: dict[str, tuple[str, Any]] | None = None) -> tuple[str, Any]:
    """Checkpoint tensor name → (Kestrel parameter name, shard id); `fused` holds the `fused_names` aliases."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    if fused and name in fused:
        return fused[name]
    if m := _CONV.match(name):
        return f"{m.group(1)}.conv1d.weight", m.group(2)
    if m := _EXPERT.match(name):
        target, half = _EXPERT_TARGET[m.group(3)]
        return f"{m.group(1)}.{target}", (int(m.group(2)), half)
    return name, FULL


def fused_names(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """Checkpoint names of the parts of every `FusedLinear` → (fused parameter name, part)."""
    out: dict[str, tuple[str, Any]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, FusedLinear):
            out |= module.checkpoint_names(prefix)
    return out


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Build modules without running their random init: every value is about to be overwritten."""
    classes = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.LayerNorm)
    saved = {cls: cls.reset_parameters for cls in classes}
    try:
        for cls in classes:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """Allocate an uninitialised model (weights in `dtype`, FP32_PARAMS in fp32) on `device`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with skip_init(), torch.device(device):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    for name, param in model.named_parameters():
        if name.endswith(FP32_PARAMS):
            param.data = param.data.float()
    return model.eval()


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def load_weights(
    model: CausalLM, path: str | Path, progress: bool = True, skip: Callable[[str], bool] | None = None
) -> None:
    """Stream every tensor of the checkpoint into `model`; raise one error listing all problems.

    A sharded model (`kestrel.dist`) reads only its parameters' slices; `progress` False hides the bar (ranks > 0);
    `skip` names (Kestrel's names) the model does not hold: a pipeline stage's other stages' layers.
    A model on the meta device reads no tensor data: only names and shapes are checked (`check_checkpoint`).
    """
    path = Path(path)
    files = checkpoint_files(path)
    weights_changed()  # parameters are written in place below; tensors derived from them must be rebuilt
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    loaded: dict[str, set] = {name: set() for name in params}
    unexpected: list[str] = []
    mismatched: list[str] = []
    n_layers = model.cfg.num_hidden_layers
    fused = fused_names(model)
    part_names = {target: name for name, target in fused.items()}
    total = sum(f.stat().st_size for f in files)
    quiet = not progress or total < PROGRESS_BAR_MIN_BYTES
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=quiet) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for ckpt_name in f.keys():
                    name, shard = map_checkpoint_name(ckpt_name, fused)
                    if (m := _LAYER.match(name)) and int(m.group(1)) >= n_layers:
                        continue  # e.g. DeepSeek's multi-token-prediction layer: not part of the decoder
                    if skip is not None and skip(name):
                        continue
                    if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                        continue
                    target = params.get(name)
                    if target is None and name in buffers:
                        target = buffers[name]
                    if target is None:
                        unexpected.append(ckpt_name)
                        continue
                    index = slice_of(target, shard, tuple(f.get_slice(ckpt_name).get_shape()))
                    if index == SKIP:  # another rank's shard (tensor / expert parallel)
                        continue
                    fn, shards = loader_of(target)
                    if shard not in shards and shard != FULL:
                        unexpected.append(ckpt_name)
                        continue
                    if target.device.type == "meta" and index is None:
                        tensor = torch.empty(f.get_slice(ckpt_name).get_shape(), device="meta")
                    else:
                        tensor = f.get_tensor(ckpt_name) if index is None else f.get_slice(ckpt_name)[index]
                    tensor = tensor.to(device=target.device, dtype=target.dtype)
                    try:
                        fn(target, tensor, shard)
                    except ShapeMismatch as exc:
                        mismatched.append(f"{ckpt_name}: {exc}")
                        continue
                    if name in loaded:
                        loaded[name] |= shards if shard == FULL else {shard}
                    bar.update(tensor.numel() * tensor.element_size())
    missing = []
    for name, got in loaded.items():
        _, shards = loader_of(params[name])
        if not shards <= got:
            lacking = sorted(shards - got, key=str)
            if all((name, shard) in part_names for shard in lacking):  # name the checkpoint's own tensors
                missing += [part_names[(name, shard)] for shard in lacking]
                continue
            lacking = [str(shard) for shard in lacking]
            missing.append(name if len(lacking) == len(shards) else f"{name} (shards {', '.join(lacking[:6])}...)")
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected))
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): " + "; ".join(mismatched))
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config:\n  " + "\n  ".join(problems))


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[CausalLM, ModelConfig]:
    """Read config.json, allocate the model, stream the weights in."""
    cfg = load_model_config(path)
    model = build_model(cfg, dtype, device)
    load_weights(model, path)
    log.info(
        "loaded %s (%s layers, %.1fM params) from %s",
        cfg.model_type,
        cfg.num_hidden_layers,
        param_count(model) / 1e6,
        path,
    )
    return model, cfg


def check_checkpoint(cfg: ModelConfig, path: str | Path, dtype: torch.dtype) -> None:
    """CheckpointError naming every difference between the checkpoint at `path` and a model built from `cfg`:
    its config.json's architecture fields, then its tensors' names and shapes (read from the headers only, so a
    reload in place can refuse a mismatched checkpoint before it overwrites a single weight)."""
    path = Path(path)
    try:
        other = load_model_config(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None
    ours, theirs = dataclasses.asdict(cfg), dataclasses.asdict(other)
    differ = [f"{k}: {theirs[k]!r}, the running model has {ours[k]!r}" for k in ours if ours[k] != theirs[k]]
    if differ:
        raise CheckpointError(f"checkpoint {path} is another architecture: " + "; ".join(differ))
    try:
        load_weights(build_model(cfg, dtype, "meta"), path, progress=False)
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors' own error type: a truncated or foreign file
        raise CheckpointError(f"checkpoint {path}: unreadable safetensors ({exc})") from None


def param_count(model: nn.Module) -> int:
    """Model weights; packed MXFP4 `*_blocks` bytes hold two weights each and their `*_scales` none."""
    weights = {"_blocks": 2, "_scales": 0}
    return sum(
        p.numel() * (weights.get(name[-7:], 1) if p.dtype == torch.uint8 else 1) for name, p in model.named_parameters()
    )
