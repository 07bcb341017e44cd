"""AttnRes: the residual stream as a bank of block snapshots mixed by learned softmax weights (K3)."""

from __future__ import annotations

import torch

from kestrel.models.layers.norm import rms_unit


def attn_res_mix(
    partial: torch.Tensor, bank: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Σ_i softmax_i(⟨rms(c_i), norm.weight ⊙ proj.weight⟩)·c_i over c = [bank..., partial], in fp32.

    Scores use the gain-free RMS of each candidate; the mix is over the raw candidates.
    """
    candidates = torch.stack([c.float() for c in bank] + [partial.float()])  # [N, T, D]
    query = norm_weight.float() * proj_weight.float().reshape(-1)
    scores = (rms_unit(candidates, eps) * query).sum(-1)  # [N, T]
    weights = torch.softmax(scores, dim=0)
    return (weights.unsqueeze(-1) * candidates).sum(0).to(partial.dtype)
