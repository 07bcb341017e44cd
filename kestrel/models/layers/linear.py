"""Several projections of the same input as one matmul, loaded from the checkpoint's separate tensors.

A decode step of a small model is bound by op launches, not flops: KDA reads x through seven projections and MLA
through up to five. `FusedLinear` stacks their weights along the output dimension; the checkpoint keeps its real
names (`q_proj.weight`, `kv_a_proj_with_mqa.weight`, ...), which the loader maps to shards of the fused weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.models.layers import batch_invariant
from kestrel.models.weight_loaders import set_loader, sized_parts_loader


class FusedLinear(nn.Linear):
    """y = x Wᵀ for W = [W_part1; W_part2; ...]; `forward` returns the parts split apart.

    `parts` maps each part's name relative to the parent module (e.g. "q_proj", "indexer.wk") to its output size.
    Parts listed in `biased` also load a bias; the others' bias rows stay zero.
    """

    def __init__(self, in_features: int, parts: dict[str, int], biased: frozenset[str] = frozenset()) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bool(biased))
        self.parts = dict(parts)
        self.sizes = list(parts.values())
        self.lora = None  # a LoRA term on some parts (kestrel.models.lora), added to the base output, never merged
        set_loader(self.weight, sized_parts_loader(self.parts), set(parts))
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()  # skip_init leaves memory uninitialised; unbiased parts must read zero
            set_loader(self.bias, sized_parts_loader(self.parts), set(biased))

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """All parts side by side [..., sum of sizes] (callers that split differently)."""
        out = super().forward(x)
        return out if self.lora is None else self.lora(x, out)

    def part(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """One part alone (e.g. on a detached input, where only that part's gradient path must change)."""
        lo = sum(self.sizes[: list(self.parts).index(name)])
        if batch_invariant.active():  # a narrower GEMM could sum in another order: slice the whole product instead
            return self.fused(x)[..., lo : lo + self.parts[name]]
        bias = self.bias[lo : lo + self.parts[name]] if self.bias is not None else None
        out = F.linear(x, self.weight[lo : lo + self.parts[name]], bias)
        return out if self.lora is None else self.lora(x, out, slice(lo, lo + self.parts[name]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return self.fused(x).split_with_sizes(self.sizes, dim=-1)  # the C++ method: no Python wrapper

    def checkpoint_names(self, prefix: str) -> dict[str, tuple[str, str]]:
        """Checkpoint tensor name → (fused parameter name, shard) for a module named `prefix` (loader aliases)."""
        parent = prefix.rsplit(".", 1)[0]
        out = {f"{parent}.{part}.weight": (f"{prefix}.weight", part) for part in self.parts}
        if self.bias is not None:
            out |= {f"{parent}.{part}.bias": (f"{prefix}.bias", part) for part in self.bias.weight_shards}
        return out


def compiled_cpu_product_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for the batched matmuls of a compiled CPU step, else x's dtype.

    CPU bf16 `bmm` of decode-sized operands is several times slower than fp32 (profile of a compiled bf16
    DeepSeek-V3 step at batch 1: 580 us a call, 40% of the step). Compiled, inductor fuses the upcast into the
    gather or projection that produces each operand, so fp32 costs no extra pass; eager, it would be a separate
    copy of every gathered latent (a same-process A/B: 1.11x at batch 1, 0.75x at 32), so eager keeps the dtype.
    """
    return torch.float32 if x.device.type == "cpu" and torch.compiler.is_compiling() else x.dtype
