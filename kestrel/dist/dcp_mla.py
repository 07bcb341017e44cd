"""MLA / DSA decode under decode context parallelism: each DCP rank holds every decode row's latents, rope keys and
index keys for its token shard only, and the ranks together give the one-rank `MLAAttention._decode` output.

Per step (the vLLM / SGLang layout): each rank absorbs its own heads' queries into latent space (its kv_b_proj
shard), the DCP group all-gathers them so every rank scores all heads against its shard; DSA rows pick their
top-k with the exact candidate merge (`dcp.dcp_topk`), each rank attends over the selected tokens it owns, and the
log-sum-exp merge hands every rank the exact output of its own heads, which its W_UV shard projects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.dist import comm, dcp
from kestrel.dist.groups import Group
from kestrel.models.layers.mla import MLAAttention


@dataclass
class DecodeShard:
    """This rank's part of the decode rows' histories: global positions [Lr] (its shard of the padded length,
    ascending) and, at those positions, latents [D, Lr, r], rope keys [D, Lr, dr], index keys [D, Lr, Di]."""

    lengths: torch.Tensor  # [D] whole history lengths (replicated)
    positions: torch.Tensor
    latent: torch.Tensor
    rope_key: torch.Tensor
    index_key: torch.Tensor | None = None


def local_index(positions: torch.Tensor, world: int, interleave: int) -> torch.Tensor:
    """Row of global position p inside its owner's shard (owner = (p // interleave) % world)."""
    return (positions // (interleave * world)) * interleave + positions % interleave


def dcp_mla_decode(
    attn: MLAAttention,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    index_q: torch.Tensor | None,
    index_w: torch.Tensor | None,
    shard: DecodeShard,
    group: Group,
    candidates: int = 384,
    interleave: int = 1,
    merge: str = "alltoall",
) -> torch.Tensor:
    """One decode token per row for this rank's heads q_nope [D, Hl, dn], q_rope [D, Hl, dr] → [D, Hl, dv]
    (collective over the DCP group)."""
    if merge not in ("alltoall", "allgather"):
        raise ValueError(f"merge must be 'alltoall' or 'allgather', got {merge!r}")
    w = attn.kv_b_proj.weight.view(attn.n_heads, attn.nope + attn.v_dim, attn.rank)
    w_uk, w_uv = w[:, : attn.nope], w[:, attn.nope :]
    q_latent = torch.einsum("bhd,hdr->bhr", q_nope.float(), w_uk.float())
    q_all = comm.all_gather(torch.cat([q_latent, q_rope.float()], dim=-1), group, dim=1)  # [D, H, r + dr]
    keys = torch.cat([shard.latent.float(), shard.rope_key.float()], dim=-1)  # [D, Lr, r + dr]
    values = shard.latent.float()
    allowed = shard.positions[None, :] < shard.lengths[:, None]
    if attn.indexer is not None:
        if keys.shape[1] == 0:  # a shard past every history: one dummy row to gather from (never allowed)
            keys, values = (
                keys.new_zeros(keys.shape[0], 1, keys.shape[2]),
                values.new_zeros(values.shape[0], 1, values.shape[2]),
            )
        scores = attn.indexer.scores_padded(index_q, index_w, shard.index_key)  # [D, Lr]
        _, chosen, _ = dcp.dcp_topk(
            scores, shard.positions, shard.lengths, attn.indexer.topk, candidates, group, interleave
        )
        mine = (chosen >= 0) & ((chosen // interleave) % group.size == group.rank)
        rows = local_index(chosen, group.size, interleave).masked_fill(~mine, 0)[..., None]
        keys = keys.gather(1, rows.expand(-1, -1, keys.shape[-1]))
        values = values.gather(1, rows.expand(-1, -1, values.shape[-1]))
        allowed = mine
    dcp.TOTALS["decode_layers"] += 1
    out, lse = dcp.partial_attention(q_all, keys, values, allowed, attn.scale)  # [D, H, r], [D, H]
    out = (dcp.merge_alltoall if merge == "alltoall" else dcp.merge_allgather)(out, lse, group)[0]
    return torch.einsum("bhr,hvr->bhv", out, w_uv.float()).to(q_nope.dtype)
