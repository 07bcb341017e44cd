"""DSA lightning indexer: cheap per-token scores over the whole history, then top-k selection for MLA."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.config import ModelConfig
from kestrel.models.layers.rope import apply_rope_half
from kestrel.models.layers.topk_order import topk_positions


class Indexer(nn.Module):
    """DSA lightning indexer: Score(t, s) = Σ_h w_h · ReLU(D^-1/2 · q[t,h]·k[s]) for s ≤ t, and MLA reads only
    the top-k scored positions; one cached key per token."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim = cfg.qk_rope_head_dim if cfg.use_rope else 0
        q_in = cfg.q_lora_rank or cfg.hidden_size
        self.wq_b = nn.Linear(q_in, self.n_heads * self.head_dim, bias=False)
        # wk and weights_proj read x: they live in the attention layer's fused input projection.
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        if not self.rope_dim:
            return x
        rot = apply_rope_half(x[..., : self.rope_dim], cos, sin)
        return torch.cat([rot, x[..., self.rope_dim :]], dim=-1)

    def keys(self, wk_out: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        """Index keys [T, D] for the cache, from wk(x)."""
        return self._rotate(self.k_norm(wk_out), cos, sin)

    def queries(
        self, q_resid: torch.Tensor, weights_out: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [T, H, D] and per-head weights [T, H] (fp32, already scaled by (H·D)^-1/2) from
        weights_proj(x)."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = self._rotate(q, cos, sin)
        # Both scales fold into the weights: ReLU is positively homogeneous, so w·ReLU(c·s) = (c·w)·ReLU(s)
        # and the [H, L] score tensor never takes an extra pass.
        return q, weights_out.float() * (self.n_heads * self.head_dim) ** -0.5

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores [n, L] of n queries against L cached keys (fp32, no causal mask)."""
        s = torch.einsum("nhd,ld->nhl", q.float(), keys.float())
        return torch.einsum("nh,nhl->nl", w, torch.relu(s))

    def scores_padded(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Decode form: one query per sequence [B, H, D] against padded keys [B, L, D] → [B, L]."""
        if not torch.is_grad_enabled():
            # Inference: keys-major [B, L, H] products, ReLU in place, then one matrix-vector product per sequence.
            s = torch.bmm(keys.float(), q.float().transpose(1, 2)).relu_()
            return torch.bmm(s, w[:, :, None]).squeeze(-1)
        s = torch.einsum("bhd,bld->bhl", q.float(), keys.float())
        return torch.einsum("bh,bhl->bl", w, torch.relu(s))


def causal_mask(prefix_len: int, n: int, length: int, device) -> torch.Tensor:
    """[n, L]: query j (at position prefix_len + j) may see key s iff s <= prefix_len + j."""
    query_pos = torch.arange(prefix_len, prefix_len + n, device=device)[:, None]
    return torch.arange(length, device=device)[None, :] <= query_pos


def as_positions(idx: torch.Tensor, selected: torch.Tensor, width: int) -> torch.Tensor:
    """Selected positions of each row in ascending order, -1 padded to `width` (int32): the rollout record format."""
    last = torch.iinfo(torch.int64).max
    pos = torch.where(selected, idx, last).sort(dim=-1).values
    pos = pos.masked_fill(pos == last, -1).to(torch.int32)
    if pos.shape[-1] < width:
        pos = torch.cat([pos, pos.new_full((*pos.shape[:-1], width - pos.shape[-1]), -1)], dim=-1)
    return pos


def selected_positions(scores: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """The top-k allowed positions of each row of scores [n, L] (all if fewer): ascending, -1 padded, [n, topk]."""
    return as_positions(*topk_positions(scores, allowed, min(topk, scores.shape[-1])), topk)


def positions_mask(positions: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """Allowed [n, L] from positions [n, k] (-1: none); ValueError if one is not causally visible (records replayed
    onto a sequence they were not taken from)."""
    n, length = causal.shape
    pos = positions.to(device=causal.device, dtype=torch.long)
    if pos.shape[0] != n or bool((pos >= length).any()):
        raise ValueError("routing replay: index top-k positions do not fit this sequence")
    mask = torch.zeros(n, length + 1, dtype=torch.bool, device=causal.device)
    mask = mask.scatter_(1, torch.where(pos >= 0, pos, length), True)[:, :length]
    if bool((mask & ~causal).any()):
        raise ValueError("routing replay: index top-k selects a position its query cannot see")
    return mask


def gather_positions(keys: torch.Tensor, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's keys at its positions [n, k] (-1: none), padded to `width` slots: keys [g, L, c] (g = 1: shared by
    every query, else one history per query) → (keys [n, width, c] zero where invalid, valid [n, width])."""
    pos = positions.to(device=keys.device, dtype=torch.long)
    if pos.shape[1] < width:
        pos = torch.cat([pos, pos.new_full((pos.shape[0], width - pos.shape[1]), -1)], dim=1)
    valid, idx = pos >= 0, pos.clamp(min=0)
    c = keys.shape[-1]
    if keys.shape[0] == 1:
        out = keys[0].index_select(0, idx.reshape(-1)).view(*idx.shape, c)
    else:
        out = keys.gather(1, idx[..., None].expand(-1, -1, c))
    return out.masked_fill(~valid[..., None], 0.0), valid


def topk_mask(scores: torch.Tensor, causal: torch.Tensor, topk: int) -> torch.Tensor:
    """Allowed [n, L]: the top-k causal positions per query (all of them if fewer), ties to the lower position."""
    if scores.shape[-1] <= topk:
        return causal
    idx, _ = topk_positions(scores, causal, topk)  # a row short of k pads with position 0: all its causal ones win
    return torch.zeros_like(causal).scatter_(-1, idx, True) & causal
