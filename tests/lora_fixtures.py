"""PEFT adapters with non-zero B on a tiny checkpoint, shared by the LoRA engine and server tests."""

from __future__ import annotations

from pathlib import Path

import torch

from kestrel.models.loader import load_model
from kestrel.models.lora import LoRAManager, load_peft, lora_targets
from kestrel.models.simple_cache import greedy_generate
from kestrel.train.lora import new_adapter, save_adapter


def write_adapters(checkpoint: Path, root: Path) -> dict[str, Path]:
    """a1 on every projection (r=4), a2 on q_proj / o_proj / down_proj (r=2); B random so each one matters."""
    model, cfg = load_model(checkpoint)
    names = sorted({m.rsplit(".", 1)[-1] for m in lora_targets(model)})
    paths = {}
    for i, (name, targets, r) in enumerate([("a1", names, 4), ("a2", ["q_proj", "o_proj", "down_proj"], 2)]):
        adapter = new_adapter(model, targets, r=r, lora_alpha=2.0 * r, name=name, seed=i)
        gen = torch.Generator().manual_seed(100 + i)
        for m, (a, b) in adapter.weights.items():
            adapter.weights[m] = (a, torch.randn(b.shape, generator=gen) * 0.2)
        paths[name] = save_adapter(adapter, root / name, cfg.model_type)
    return paths


def reference_tokens(checkpoint: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the plain single-request path, the adapter (if any) on every row."""
    model, _ = load_model(checkpoint)
    if adapter is not None:
        manager = LoRAManager(model)
        manager.apply_to_all(manager.add(load_peft(adapter)))
    return greedy_generate(model, prompt, n)[0]
