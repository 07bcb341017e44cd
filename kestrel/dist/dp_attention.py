"""Attention data parallelism, the tensor side: each attention-DP group's ranks run only that group's batch.

Rank 0 plans every group's step (`dp_scheduler`); each group's ranks hold only that group's KV pages and KDA
state slots. The MLP half of every layer, the embedding and the LM head (on the sampled rows) run over all ranks
on the rows of every group (`DPGathered`), so the MoE sees the union of the groups' tokens. A group with nothing
to do runs one padding row on the scratch page and slot, which the gather drops: the collectives always match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kestrel.dist import comm
from kestrel.dist.groups import Group, Groups


@dataclass
class DPStep:
    """Real (non-padding) token rows of every group this step, and this rank's group."""

    real_rows: list[int]
    group: int


_STEP: DPStep | None = None


def set_dp_step(step: DPStep | None) -> None:
    global _STEP
    _STEP = step


def gather_rows(x: torch.Tensor, step: DPStep, group: Group) -> torch.Tensor:
    """Every group's real rows of x, in group order (x's first rows are this group's real ones)."""
    width = max(max(step.real_rows), 1)
    padded = x.new_zeros((width, *x.shape[1:]))
    n = step.real_rows[step.group]
    padded[:n] = x[:n]
    everyone = comm.all_gather(padded, group)
    keep = [everyone[g * width : g * width + r] for g, r in enumerate(step.real_rows)]
    return torch.cat(keep)


def own_rows(y: torch.Tensor, step: DPStep, rows: int) -> torch.Tensor:
    """This group's rows of a gathered result, padded back with zeros to the group's `rows` physical rows."""
    start = sum(step.real_rows[: step.group])
    n = step.real_rows[step.group]
    out = y.new_zeros((rows, *y.shape[1:]))
    out[:n] = y[start : start + n]
    return out


class DPGathered(nn.Module):
    """A row-wise block (embedding, MLP, MoE) run over every attention-DP group's rows at once: the
    vocabulary-, tensor- and expert-parallel layers inside see the same rows on every rank.

    Dispatch is an all-gather of the groups' rows. Combine: when the block's last step is a sum over ranks (a
    dense MLP, a MoE without a latent projection) the block returns partial sums and they are reduce-scattered
    over all ranks, each group's rows landing on its ranks; otherwise the block reduces inside and each group
    keeps its rows.
    """

    def __init__(self, inner: nn.Module, groups: Groups) -> None:
        super().__init__()
        self.inner, self.dp, self.world, self.attn_tp = inner, groups.attn_dp, groups.tp, groups.attn_tp
        self.partial = _defer_reduction(inner)

    def __getattr__(self, name: str):
        """What code reads of the wrapped block (e.g. the embedding's weight for the model's device and dtype)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, x: torch.Tensor, *args):
        step = _STEP
        if args and args[0] is not None:
            raise ValueError("routing replay (forced experts) is not supported with attention DP")
        out = self.inner(gather_rows(x, step, self.dp), *args)
        ids = None
        if isinstance(out, tuple):  # MoE: (output, expert ids)
            out, ids = out
            ids = own_rows(ids, step, x.shape[0])
        out = self._reduce_scatter(out, step, x.shape[0]) if self.partial else own_rows(out, step, x.shape[0])
        return out if ids is None else (out, ids)

    def _reduce_scatter(self, partial: torch.Tensor, step: DPStep, rows: int) -> torch.Tensor:
        """Sum partial results over all ranks, each group receiving only its rows: reduce-scatter over the world
        (rank r = group g, attention-TP index j gets slice j of group g's rows), then all-gather within the group."""
        a = self.attn_tp.size
        width = -(-max(max(step.real_rows), 1) // a) * a
        padded = partial.new_zeros((len(step.real_rows) * width, *partial.shape[1:]))
        start = 0
        for g, n in enumerate(step.real_rows):
            padded[g * width : g * width + n] = partial[start : start + n]
            start += n
        mine = comm.all_gather(comm.reduce_scatter(padded, self.world), self.attn_tp)
        out = partial.new_zeros((rows, *partial.shape[1:]))
        n = step.real_rows[step.group]
        out[:n] = mine[:n]
        return out


def _defer_reduction(block: nn.Module) -> bool:
    """Switch a block's final cross-rank sums to partial results when the block ends in one; say if it did."""
    from kestrel.dist.moe import ParallelExperts
    from kestrel.dist.parallel import RowParallelLinear
    from kestrel.models.layers.moe import DenseMLP, MoE

    if isinstance(block, DenseMLP) and isinstance(block.down_proj, RowParallelLinear):
        block.down_proj.reduce = False
        return True
    if isinstance(block, MoE) and not block.latent and isinstance(block.experts, ParallelExperts):
        shared = block.shared_experts
        if shared is not None and not isinstance(shared.down_proj, RowParallelLinear):
            return False
        block.experts.reduce = False  # routed + shared: both partial, one reduce-scatter
        if shared is not None:
            shared.down_proj.reduce = False
        return True
    return False
