"""MLA / DSA decode under DCP: every rank's head block equals the one-rank `MLAAttention._decode` (1e-5), for
histories longer than index_topk (selection matters), shorter than it, and of one token (empty shards), at world
2 and 4, both merge variants, with and without the indexer."""

from __future__ import annotations

import pytest
import torch
from dist_harness import spawn_ranks
from torch import nn

from kestrel.dist import dcp
from kestrel.dist.dcp_mla import DecodeShard, dcp_mla_decode, local_index
from kestrel.dist.groups import ParallelLayout

# (family, sparse, merge, interleave, candidates)
CASES = (
    ("deepseek_v32", True, "alltoall", 1, 4),
    ("kimi_k3", True, "allgather", 2, 16),
    ("deepseek_v32", False, "alltoall", 3, 4),
)


def _problem(family: str, sparse: bool):
    """A tiny preset's MLA layer (seeded) and one decode step's inputs over whole histories."""
    from kestrel.config import model_config_from_dict
    from kestrel.models.layers.mla import MLAAttention
    from kestrel.models.presets import preset_config

    cfg = model_config_from_dict(preset_config(family, "tiny"))
    torch.manual_seed(0)
    attn = MLAAttention(cfg, cfg.attention_layers[0], sparse).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([40, 23, 9, 1])  # index_topk is 16
    d, length, h = lengths.numel(), int(lengths.max()), attn.n_heads
    t = {
        "q_nope": torch.randn(d, h, attn.nope, generator=gen),
        "q_rope": torch.randn(d, h, attn.rope_dim, generator=gen),
        "latent": torch.randn(d, length, attn.rank, generator=gen),
        "rope_key": torch.randn(d, length, attn.rope_dim, generator=gen),
        "index_q": None,
        "index_w": None,
        "index_key": None,
    }
    if sparse:
        ix = attn.indexer
        t["index_q"] = torch.randn(d, ix.n_heads, ix.head_dim, generator=gen)
        t["index_w"] = torch.rand(d, ix.n_heads, generator=gen)
        t["index_key"] = torch.randn(d, length, ix.head_dim, generator=gen)
    return attn, lengths, t


class _FullCache:
    """The one-rank decode cache: whole padded histories."""

    def __init__(self, lengths, t):
        self.lengths, self.t = lengths, t

    def decode_lengths(self):
        return self.lengths

    def decode_index_keys(self, layer):
        return self.t["index_key"]

    def decode_kv(self, layer):
        return self.t["latent"], self.t["rope_key"]

    def decode_pool(self, layer):
        return None  # padded histories, no pool: the PyTorch decode form

    def decode_kv_at(self, layer, positions):
        lat, rope = self.t["latent"], self.t["rope_key"]
        return (x.gather(1, positions[..., None].expand(-1, -1, x.shape[-1])) for x in (lat, rope))


def _rank_decode(groups, world: int) -> list[torch.Tensor]:
    group, outs = groups.world, []
    for family, sparse, merge, inter, cands in CASES:
        attn, lengths, t = _problem(family, sparse)
        hl = attn.n_heads // world
        heads = slice(group.rank * hl, (group.rank + 1) * hl)
        w = attn.kv_b_proj.weight.view(attn.n_heads, -1, attn.rank)[heads].reshape(-1, attn.rank)
        attn.kv_b_proj = nn.Linear(attn.rank, w.shape[0], bias=False)  # this rank's heads, as TP shards it
        attn.kv_b_proj.weight.data.copy_(w)
        attn.n_heads = hl
        pos = dcp.shard_positions(t["latent"].shape[1], group.rank, world, inter)
        idx = t["index_key"][:, pos] if sparse else None
        shard = DecodeShard(lengths, pos, t["latent"][:, pos], t["rope_key"][:, pos], idx)
        with torch.no_grad():
            out = dcp_mla_decode(
                attn,
                t["q_nope"][:, heads],
                t["q_rope"][:, heads],
                t["index_q"],
                t["index_w"],
                shard,
                group,
                candidates=cands,
                interleave=inter,
                merge=merge,
            )
        outs.append(out)
    return outs


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_mla_decode_equals_one_rank_decode(world):
    results = spawn_ranks(_rank_decode, ParallelLayout(tp=world), world)
    for i, (family, sparse, _, _, _) in enumerate(CASES):
        attn, lengths, t = _problem(family, sparse)
        with torch.no_grad():
            ref = attn._decode(t["q_nope"], t["q_rope"], t["index_q"], t["index_w"], _FullCache(lengths, t))
        hl = attn.n_heads // world
        for rank, outs in enumerate(results):
            torch.testing.assert_close(outs[i], ref[:, rank * hl : (rank + 1) * hl], atol=1e-5, rtol=1e-5)


def test_local_index_inverts_shard_positions():
    for world, inter in ((2, 1), (4, 3), (3, 2)):
        for r in range(world):
            pos = dcp.shard_positions(50, r, world, inter)
            assert torch.equal(local_index(pos, world, inter), torch.arange(pos.numel()))
