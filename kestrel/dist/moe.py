"""Routed experts split over expert-parallel ranks (and each expert's intermediate over the moe-TP ranks).

Two dispatch/combine schemes, equal up to summation order:
- `allgather`: every rank sees every token of the MoE group (gathered from the attention-DP groups), runs its own
  experts on the (token, expert) pairs that chose them, and the partial sums are all-reduced (one attention group)
  or reduce-scattered back to the groups (attention DP, `dp_attention.DPGathered`).
- `alltoall`: each rank takes an equal share of the tokens, sends each (token, expert) pair to the expert's owner,
  the owner sends back weight·expert(x), and the shares are all-gathered. Needs whole experts per rank (moe_tp 1).
Pairs with expert id -1 (padding rows, idle attention groups) are routed to no expert.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kestrel.dist import comm
from kestrel.dist.groups import Group
from kestrel.dist.parallel import empty_param, set_slicer, shard_range
from kestrel.models.layers.moe import Experts, GatedActivation, segment_linear
from kestrel.models.weight_loaders import SKIP, expert_loader, set_loader

DISPATCH = ("allgather", "alltoall")


def local_expert_sum(
    x: torch.Tensor,
    token_of: torch.Tensor,
    local_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: GatedActivation,
    out_rows: int,
) -> torch.Tensor:
    """Σ weight·expert(x[token]) over pairs (token_of[i], local_ids[i], weights[i]) into [out_rows, D]."""
    order = local_ids.argsort(stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.long, device=x.device).index_add_(
        0, local_ids, torch.ones_like(local_ids)
    )
    rows = token_of[order]
    gate, up = segment_linear(x[rows], gate_up, counts).chunk(2, dim=-1)
    y = segment_linear(act(gate, up), down, counts) * weights[order, None]
    return x.new_zeros(out_rows, x.shape[1]).index_add_(0, rows, y.to(x.dtype))


class ParallelExperts(nn.Module):
    """This rank's experts ([E_local, 2·I_local, D] and [E_local, D, I_local]); forward returns the full sum."""

    def __init__(
        self, base: Experts, owners: list[int], ep: Group, moe_tp: Group, world: Group, dispatch: str = "allgather"
    ) -> None:
        super().__init__()
        if dispatch not in DISPATCH:
            raise ValueError(f"moe dispatch must be one of {DISPATCH}, got {dispatch!r}")
        if dispatch == "alltoall" and moe_tp.size != 1:
            raise ValueError("moe dispatch alltoall needs whole experts per rank (ep == tp)")
        n_experts, two_inter, hidden = base.gate_up_proj.shape
        start, inter = shard_range(two_inter // 2, moe_tp, "moe_intermediate_size")
        self.owners, self.ep, self.world, self.dispatch, self.act = owners, ep, world, dispatch, base.act
        self.reduce = True  # False: return this rank's partial sum (attention DP reduce-scatters it)
        self.local_experts = [e for e, o in enumerate(owners) if o == ep.rank]
        local_of = torch.full((n_experts,), -1, dtype=torch.long, device="cpu")
        local_of[self.local_experts] = torch.arange(len(self.local_experts), device="cpu")
        self.register_buffer("local_of", local_of, persistent=False)
        self.register_buffer("owner_of", torch.tensor(owners, dtype=torch.long, device="cpu"), persistent=False)
        self._local = {e: i for i, e in enumerate(self.local_experts)}
        n = len(self.local_experts)
        self.gate_up_proj = empty_param((n, 2 * inter, hidden), base.gate_up_proj)
        self.down_proj = empty_param((n, hidden, inter), base.down_proj)
        for param, halves, dim in ((self.gate_up_proj, True, 0), (self.down_proj, False, 1)):
            inner = expert_loader(halves)
            set_loader(
                param,
                lambda p, t, shard, inner=inner: inner(p, t, (self._local[shard[0]], shard[1])),
                {(e, h) for e in self.local_experts for h in ((0, 1) if halves else (None,))},
            )
            set_slicer(param, self._slicer(dim, start, inter))

    def _slicer(self, dim: int, start: int, n: int):
        def slicer(shard: Any, disk_shape: tuple[int, ...]) -> Any:
            if shard[0] not in self._local:
                return SKIP
            return tuple(slice(start, start + n) if i == dim else slice(None) for i in range(len(disk_shape)))

        return slicer

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.dispatch == "alltoall":
            return self._all_to_all(x, ids, weights)
        flat = ids.reshape(-1)
        local = self.local_of[flat.clamp_min(0)].masked_fill(flat < 0, -1)
        mine = (local >= 0).nonzero().squeeze(1)
        token_of = mine // ids.shape[1]
        out = local_expert_sum(
            x, token_of, local[mine], weights.reshape(-1)[mine], self.gate_up_proj, self.down_proj, self.act, len(x)
        )
        return comm.all_reduce(out, self.world) if self.reduce else out

    def _all_to_all(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Tokens are the same on every rank: each takes its share, dispatches its pairs, combines, all-gathers."""
        n, rank, (t, k) = self.world.size, self.world.rank, ids.shape
        share = -(-t // n)
        lo, hi = min(rank * share, t), min((rank + 1) * share, t)
        my_ids, my_w = ids[lo:hi].reshape(-1), weights[lo:hi].reshape(-1)
        valid = (my_ids >= 0).nonzero().squeeze(1)
        dest = self.owner_of[my_ids[valid]]
        order = dest.argsort(stable=True)
        pairs = valid[order]  # this share's (token, expert) pair indices, grouped by destination rank
        send_counts = torch.bincount(dest, minlength=n).tolist()
        recv_counts = comm.exchange_counts(send_counts, self.world)
        tokens = lo + pairs // k
        payload = torch.cat(
            [x[tokens].float(), my_ids[pairs, None].float(), my_w[pairs, None].float()], dim=1
        )  # one message: the row, its global expert id (exact in fp32) and its routing weight
        got = comm.all_to_all(payload, send_counts, recv_counts, self.world)
        gx, gid, gw = got.split([x.shape[1], 1, 1], dim=1)
        local = self.local_of[gid.squeeze(1).long()]
        rows = torch.arange(len(got), device=x.device)
        y = local_expert_sum(
            gx.to(x.dtype), rows, local, gw.squeeze(1), self.gate_up_proj, self.down_proj, self.act, len(got)
        )
        back = comm.all_to_all(y, recv_counts, send_counts, self.world)
        if not self.reduce:  # a partial sum: this rank's share of the rows, zeros elsewhere
            return x.new_zeros(t, x.shape[1]).index_add_(0, tokens, back)
        out = x.new_zeros(share, x.shape[1]).index_add_(0, tokens - lo, back)
        return comm.all_gather(out, self.world)[:t]
