"""AttnRes: the residual stream as a bank of block snapshots mixed by learned softmax weights (K3)."""

from __future__ import annotations

import torch

from kestrel.models.layers import batch_invariant
from kestrel.models.layers.norm import rms_norm_fp32


def attn_res_mix(
    partial: torch.Tensor, bank: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Σ_i softmax_i(⟨rms(c_i), norm.weight ⊙ proj.weight⟩)·c_i over c = [bank..., partial], in fp32.

    Scores use the gain-free RMS of each candidate; the mix is over the raw candidates.
    """
    candidates = torch.stack([*bank, partial]).float()  # [N, T, D]
    query = norm_weight.float() * proj_weight.float().reshape(-1)
    # rms(c) ⊙ query (the norm scales by its weight after normalising), then the dot product.
    logits = rms_norm_fp32(candidates, query, eps).sum(-1)  # [N, T]
    if batch_invariant.active():  # softmax along each token's own row, then the candidates added in order
        return batch_invariant.mix(torch.softmax(logits.t().contiguous(), dim=-1).t(), candidates).to(partial.dtype)
    # Weighted candidates summed over N elementwise: the einsum's batched matmul (T matrices of 1 x N) cost 25 us at
    # T = 7 against 8 us (11 vs 6 at T = 1, where both give the same bits).
    return (torch.softmax(logits, dim=0).unsqueeze(-1) * candidates).sum(0).to(partial.dtype)
