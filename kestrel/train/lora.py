"""Trainer side of LoRA: a fresh adapter on chosen projections of a frozen base, trained as its own parameters.

The adapter is never merged: the base's weights stay frozen (requires_grad False) and the model computes
x Wᵀ + (alpha/r)·(x Aᵀ) Bᵀ through `kestrel.models.lora`, the same code the engine serves adapters with, so
trainer and engine run the same LoRA arithmetic. What may be targeted (and why the router and the DSA indexer
may not) is documented there.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from kestrel.models.lora import LoRAAdapter, LoRAManager, in_out, lora_targets, save_peft


def new_adapter(
    model: nn.Module,
    target_modules: list[str],
    r: int = 8,
    lora_alpha: float = 16.0,
    name: str = "default",
    seed: int = 0,
) -> LoRAAdapter:
    """PEFT's initialisation: A kaiming-uniform (a=√5), B zero, so the adapted model starts equal to the base.

    `target_modules` are last name components (e.g. "q_proj", "o_proj", "gate_proj"), as in PEFT.
    """
    targets = lora_targets(model)
    wanted = set(target_modules)
    chosen = [m for m in targets if m.rsplit(".", 1)[-1] in wanted]
    missing = wanted - {m.rsplit(".", 1)[-1] for m in chosen}
    if missing:
        raise ValueError(f"target_modules: {sorted(missing)} match no LoRA-targetable projection of this model")
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    weights = {}
    for module_name in chosen:
        d_in, d_out = in_out(*targets[module_name])
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform_(a=√5) on [r, in]: gain √(2/6) · √(3/in) = 1/√in
        a = (torch.rand(r, d_in, generator=gen) * 2 - 1) * bound
        weights[module_name] = (a.to(dtype), torch.zeros(d_out, r, dtype=dtype))
    return LoRAAdapter(name, r, lora_alpha, sorted(wanted), weights)


def attach_trainable(model: nn.Module, adapter: LoRAAdapter) -> tuple[LoRAManager, list[nn.Parameter]]:
    """Freeze the base, attach `adapter` to every row of every forward, return its A/B as trainable parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    device = next(model.parameters()).device
    params: list[nn.Parameter] = []
    for module_name, (a, b) in list(adapter.weights.items()):
        pa, pb = nn.Parameter(a.detach().clone().to(device)), nn.Parameter(b.detach().clone().to(device))
        adapter.weights[module_name] = (pa, pb)
        params += [pa, pb]
    manager = LoRAManager(model)
    manager.apply_to_all(manager.add(adapter))
    return manager, params


def save_adapter(adapter: LoRAAdapter, path: str | Path, model_type: str, base_model: str | None = None) -> Path:
    """PEFT on-disk format (`adapter_config.json` + `adapter_model.safetensors`)."""
    return save_peft(adapter, path, model_type, base_model)
