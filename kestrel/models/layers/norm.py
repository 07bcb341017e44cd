"""RMSNorm in the exact dtype convention of the reference checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.models.layers.casts import cast, fp32


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale: identical rounding to transformers' DeepSeek/Kimi norms."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return torch.rms_norm(x, shape, self.weight, self.eps)  # one op (no Python wrapper), same rounding as below
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """KDA output norm: RMSNorm(o) * sigmoid(gate), entirely in fp32 (as fla does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(fp32(x), (x.shape[-1],), fp32(self.weight), self.eps)
        return cast(normed * torch.sigmoid(fp32(gate)), x.dtype)
