"""AttnRes: the residual stream as a bank of block snapshots mixed by learned softmax weights (K3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.models.layers import batch_invariant


def attn_res_mix(
    partial: torch.Tensor, bank: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Σ_i softmax_i(⟨rms(c_i), norm.weight ⊙ proj.weight⟩)·c_i over c = [bank..., partial], in fp32.

    Scores use the gain-free RMS of each candidate; the mix is over the raw candidates.
    """
    candidates = torch.stack([*bank, partial]).float()  # [N, T, D]
    query = norm_weight.float() * proj_weight.float().reshape(-1)
    # rms(c) ⊙ query in one fused op (F.rms_norm scales by its weight after normalising), then the dot product.
    logits = F.rms_norm(candidates, (candidates.shape[-1],), query, eps).sum(-1)  # [N, T]
    if batch_invariant.active():  # softmax along each token's own row, then the candidates added in order
        return batch_invariant.mix(torch.softmax(logits.t().contiguous(), dim=-1).t(), candidates).to(partial.dtype)
    return torch.einsum("nt,ntd->td", torch.softmax(logits, dim=0), candidates).to(partial.dtype)
