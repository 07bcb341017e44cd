"""RMSNorm in the exact dtype convention of the reference checkpoints."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale: identical rounding to transformers' DeepSeek/Kimi norms."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GatedRMSNorm(nn.Module):
    """KDA output norm: RMSNorm(o) * sigmoid(gate), entirely in fp32 (as fla does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        xf = self.weight.float() * xf * torch.sigmoid(gate.float())
        return xf.to(dtype)


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a gain (AttnRes scores candidates with it)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
