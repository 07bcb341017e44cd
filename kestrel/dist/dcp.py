"""Decode context parallelism (DCP): the exact DSA top-k over token-sharded index keys, and the log-sum-exp merge
of partial attention outputs.

Token p of a history lives on DCP rank (p // interleave) % N. Selection order is total (kestrel.models.layers.
topk_order: higher score first, then lower position), so "the top-k" is one set and every path (single rank, merged,
fallback) yields the same one; a (score, position) pair travels as one int64 key in that order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kestrel.dist import comm
from kestrel.dist.groups import Group
from kestrel.models.layers.topk_order import INVALID, exact_topk, pack_keys, top_keys, unpack_keys

__all__ = ["INVALID", "exact_topk", "pack_keys", "top_keys", "unpack_keys"]  # the selection order, re-exported

# Running totals of this process's DCP work (merges, fallback_pairs, candidate_bytes, fallback_bytes,
# decode_layers): how often the exact merge had to read a rank's full top-k, and what it all moved.
TOTALS: Counter[str] = Counter()


# -- sharding -------------------------------------------------------------------------------------------
def shard_positions(length: int, rank: int, world: int, interleave: int = 1) -> torch.Tensor:
    """Global positions in [0, length) stored on `rank`, ascending."""
    pos = torch.arange(length)
    return pos[(pos // interleave) % world == rank]


def shard_count(lengths: torch.Tensor, rank: int, world: int, interleave: int = 1) -> torch.Tensor:
    """How many of positions [0, L) live on `rank`, for each length L (no communication: lengths are replicated)."""
    block = interleave * world
    full, rest = lengths // block, lengths % block
    return full * interleave + (rest - rank * interleave).clamp(0, interleave)


def reference_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection by stable sorting (the oracle `exact_topk` and the merge are tested against)."""
    b, length = scores.shape
    out_s = torch.full((b, k), float("-inf"))
    out_p = torch.full((b, k), -1, dtype=torch.long)
    for row in range(b):
        n = int(lengths[row])
        s = scores[row, :n].float() + 0.0
        order = torch.sort(s, descending=True, stable=True).indices[:k]  # stable: equal scores keep position order
        out_s[row, : order.numel()], out_p[row, : order.numel()] = s[order], order
    return out_s, out_p


# -- the distributed top-k merge -------------------------------------------------------------------------
@dataclass
class MergeStats:
    """What one merge moved: bytes this rank contributed per phase, and the (rank, row) pairs that fell back."""

    candidate_bytes: int = 0
    fallback_bytes: int = 0
    fallback_pairs: int = 0
    fallback_ranks: list[int] = field(default_factory=list)


def fallback_mask(
    cands: torch.Tensor, kth: torch.Tensor, lengths: torch.Tensor, c: int, k: int, interleave: int = 1
) -> torch.Tensor:
    """[N, B]: rank r may hold unsent winners of row b — it has more than c tokens (and c < k) and its c-th
    candidate scores at or above the merged k-th score (or the union has fewer than k)."""
    world = cands.shape[0]
    if c >= k:  # every rank sent its whole local top-k already
        return torch.zeros(cands.shape[:2], dtype=torch.bool)
    more = torch.stack([shard_count(lengths, r, world, interleave) > c for r in range(world)])
    cth_score = unpack_keys(cands[:, :, c - 1])[0]
    kth_score = unpack_keys(kth)[0]
    return more & ((cth_score >= kth_score[None, :]) | (kth == INVALID)[None, :])


def merge_candidates(
    cands: torch.Tensor, k: int, fallback: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
) -> torch.Tensor:
    """Merged top-k keys [B, k] of every rank's candidates [N, B, c]; `fallback` {rank: (rows, full local top-k
    [rows, k])} replaces that rank's candidates on those rows."""
    world, b, _ = cands.shape
    union = cands.permute(1, 0, 2).reshape(b, -1).clone()
    extra = []
    for r, (rows, full) in (fallback or {}).items():
        union.view(b, world, -1)[rows, r] = INVALID  # its candidates are a prefix of its full top-k: drop them
        block = full.new_full((b, k), INVALID)
        block[rows] = full
        extra.append(block)
    return top_keys(torch.cat([union, *extra], dim=-1), k)


def dcp_topk(
    local_scores: torch.Tensor,
    local_positions: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    c: int,
    group: Group,
    interleave: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, MergeStats]:
    """Exact top-k over a DCP group (collective). This rank holds scores [B, Lr] of global positions [Lr] (its
    shard of the padded histories); `lengths` [B] are the full history lengths. Returns (scores, positions) [B, k]
    (-1 padded), identical on every rank, and what moved."""
    stats = MergeStats()
    c = min(c, k)
    valid = local_positions[None, :] < lengths[:, None]
    keys = pack_keys(local_scores, local_positions.expand_as(local_scores), valid)
    mine = top_keys(keys, c)
    stats.candidate_bytes = mine.numel() * mine.element_size()
    cands = comm.all_gather(mine[None], group, dim=0)  # [N, B, c]
    merged = merge_candidates(cands, k)
    flags = fallback_mask(cands, merged[:, k - 1], lengths, c, k, interleave)
    if flags.any():
        local_full = top_keys(keys, k)
        fallback = {}
        for r in flags.any(dim=1).nonzero().flatten().tolist():
            rows = flags[r].nonzero().flatten()
            full = local_full[rows].contiguous() if r == group.rank else local_full.new_empty((rows.numel(), k))
            comm.broadcast(full, group, r)
            if r == group.rank:
                stats.fallback_bytes += full.numel() * full.element_size()
            fallback[r] = (rows, full)
            stats.fallback_pairs += rows.numel()
            stats.fallback_ranks.append(r)
        merged = merge_candidates(cands, k, fallback)
    scores, positions = unpack_keys(merged)
    TOTALS.update(
        merges=1,
        fallback_pairs=stats.fallback_pairs,
        candidate_bytes=stats.candidate_bytes,
        fallback_bytes=stats.fallback_bytes,
    )
    return scores, positions, stats


def simulate_topk(
    scores: torch.Tensor, lengths: torch.Tensor, k: int, c: int, world: int, interleave: int = 1
) -> tuple[torch.Tensor, MergeStats]:
    """The same merge over `world` simulated ranks in this process (for byte counts; no communication).
    Returns merged positions [B, k] and the bytes all ranks together would send."""
    stats = MergeStats()
    c = min(c, k)
    local = []
    for r in range(world):
        pos = shard_positions(scores.shape[-1], r, world, interleave)
        local.append(pack_keys(scores[:, pos], pos.expand(scores.shape[0], -1), pos[None, :] < lengths[:, None]))
    cands = torch.stack([top_keys(keys, c) for keys in local])
    stats.candidate_bytes = cands.numel() * cands.element_size()
    merged = merge_candidates(cands, k)
    flags = fallback_mask(cands, merged[:, k - 1], lengths, c, k, interleave)
    if flags.any():
        fallback = {}
        for r in flags.any(dim=1).nonzero().flatten().tolist():
            rows = flags[r].nonzero().flatten()
            fallback[r] = (rows, top_keys(local[r][rows], k))
            stats.fallback_bytes += rows.numel() * k * 8
            stats.fallback_pairs += rows.numel()
            stats.fallback_ranks.append(r)
        merged = merge_candidates(cands, k, fallback)
    return unpack_keys(merged)[1], stats


# -- log-sum-exp merge of partial attention ---------------------------------------------------------------
def partial_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, Dk] over this rank's keys [B, L, Dk] / values [B, L, Dv] where allowed [B, L]:
    (out [B, H, Dv] fp32, lse [B, H]); a row with nothing allowed gives out 0, lse -inf."""
    logits = torch.einsum("bhd,bld->bhl", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return torch.einsum("bhl,bld->bhd", probs, values.float()), lse


def lse_weights(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank weights exp(lse_r - lse) [N, ...] and the merged lse, over dim 0; rows empty everywhere get
    weight 0 (output 0) and lse -inf instead of NaN."""
    total = torch.logsumexp(lse, dim=0)
    safe = total.masked_fill(total == float("-inf"), 0.0)
    return torch.exp(lse - safe[None]), total


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention from N partials: outs [N, B, H, D], lses [N, B, H] → ([B, H, D], [B, H])."""
    w, total = lse_weights(lses)
    return (w[..., None] * outs).sum(0), total


def _head_block(h: int, world: int) -> int:
    if h % world:
        raise ValueError(f"heads ({h}) must divide over the DCP group ({world})")
    return h // world


def merge_allgather(out: torch.Tensor, lse: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the lse [B, H], rescale this rank's out [B, H, D], reduce-scatter over heads: this rank's head
    block [B, H/N, D] of the exact output, and its lse (collective)."""
    n, h = group.size, out.shape[1]
    block = _head_block(h, n)
    lses = comm.all_gather(lse.float()[None].contiguous(), group, dim=0)  # [N, B, H]
    w, total = lse_weights(lses)
    scaled = (w[group.rank][..., None] * out.float()).transpose(0, 1).contiguous()  # [H, B, D]: heads on dim 0
    mine = comm.reduce_scatter(scaled, group).transpose(0, 1)
    return mine, total[:, group.rank * block : (group.rank + 1) * block]


def merge_alltoall(out: torch.Tensor, lse: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """All-to-all: rank j receives every rank's partial (out and lse) for head block j and merges it: [B, H/N, D]
    and its lse (collective)."""
    n, (b, h, d) = group.size, out.shape
    block = _head_block(h, n)
    packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1).transpose(0, 1).contiguous()  # [H, B, D+1]
    got = comm.all_to_all(packed, [block] * n, [block] * n, group).view(n, block, b, d + 1).transpose(1, 2)
    return merge_partials(got[..., :d], got[..., d])
